"""The job state machine against the platform's lifecycle and restart rules (docs/platform.md).

``FakeCluster`` plays the runner: a fake clock, fake workers, and a queue of the
machine's commands that it executes one by one (StartWorker -> worker_started,
StopWorkers -> exit 143 of each live worker, RequestCapacity -> quota_granted or
no_capacity). Leaving commands in the queue while injecting other events is how the
races are written.
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient_train.launcher.job import (
    PRIMARY,
    Command,
    JobConfig,
    JobMachine,
    ReleaseCapacity,
    RequestCapacity,
    StartWorker,
    StopWorkers,
)
from resilient_train.launcher.messages import JobState
from resilient_train.platform.rules import (
    JOB_SCOPE,
    Cause,
    Strategy,
    default_policy,
    load_policy,
    policy_from_dict,
    with_platform_defaults,
)

T0 = 1_700_000_000.0          # 2023-11-14T22:13:20Z
W1, W2 = "workerpool1-0", "workerpool1-1"
HOUR, DAY = 3600.0, 86400.0

STOCKOUT_MESSAGE = ("Resources are insufficient in region: local. "
                    "Try a different region or use a different accelerator.")
INTERNAL_MESSAGE = "Internal error occurred for the current attempt."


def replica_names(workers: int) -> tuple[str, ...]:
    return (PRIMARY,) + tuple(f"workerpool1-{i}" for i in range(workers - 1))


class FakeCluster:
    """Fake clock + fake workers executing the machine's commands like the runner does."""

    def __init__(self, workers: int = 2, *, capacity: str = "free",
                 disable_retries: bool = False, **config: Any) -> None:
        strategy = config.setdefault("strategy", Strategy.STANDARD)
        config.setdefault("policy", default_policy(strategy, disable_retries=disable_retries))
        self.now = T0
        self.machine = JobMachine(JobConfig("job-1", replica_names(workers), **config), self.now)
        # "free": quota granted; "never": the request can never fit (no_capacity);
        # "busy": held by another job, no answer until free_capacity().
        self.capacity = capacity
        self.wants_capacity = False
        self.alive: dict[str, StartWorker] = {}
        self.inbox: deque[Command] = deque()
        self.executed: list[Command] = []
        self.superseded: list[StartWorker] = []
        self.releases = 0

    # --- the runner's half --------------------------------------------------------------

    def feed(self, commands: list[Command], settle: bool = True) -> FakeCluster:
        self.inbox.extend(commands)
        if settle:
            self.settle()
        return self

    def settle(self) -> FakeCluster:
        while self.inbox:
            self.step()
        return self

    def step(self) -> None:
        cmd = self.inbox.popleft()
        self.executed.append(cmd)
        m = self.machine
        if isinstance(cmd, StartWorker):
            if not m.is_current(cmd):
                self.superseded.append(cmd)
                return
            assert cmd.replica not in self.alive, f"{cmd.replica} started twice"
            self.alive[cmd.replica] = cmd
            self.inbox.extend(m.worker_started(cmd.replica, self.now))
        elif isinstance(cmd, StopWorkers):
            for name in cmd.replicas:
                if self.alive.pop(name, None) is not None:
                    self.inbox.extend(m.worker_exited(name, 143, Cause.EXIT, self.now))
        elif isinstance(cmd, RequestCapacity):
            self.wants_capacity = True
            self._try_capacity()
        elif isinstance(cmd, ReleaseCapacity):
            self.wants_capacity = False
            self.releases += 1

    def _try_capacity(self) -> None:
        if self.capacity == "free":
            self.wants_capacity = False
            self.inbox.extend(self.machine.quota_granted(self.now))
        elif self.capacity == "never":
            self.inbox.extend(self.machine.no_capacity(self.now))

    def set_capacity(self, capacity: str, settle: bool = True) -> FakeCluster:
        self.capacity = capacity
        if self.wants_capacity:
            self._try_capacity()
        return self.settle() if settle else self

    # --- what happens to the job ----------------------------------------------------------

    def launch(self) -> FakeCluster:
        return self.feed(self.machine.start(self.now))

    def later(self, seconds: float) -> FakeCluster:
        self.now += seconds
        return self

    def exit(self, replica: str, code: int, cause: Cause = Cause.EXIT, *,
             excerpt: str | None = None, settle: bool = True) -> FakeCluster:
        assert replica in self.alive, f"{replica} is not running"
        del self.alive[replica]
        return self.feed(self.machine.worker_exited(replica, code, cause, self.now, excerpt=excerpt),
                         settle)

    def fail_n(self, replica: str, n: int, code: int, cause: Cause = Cause.EXIT) -> FakeCluster:
        for _ in range(n):
            self.exit(replica, code, cause)
        return self

    def fault(self, cause: Cause, settle: bool = True) -> FakeCluster:
        return self.feed(self.machine.job_fault(cause, self.now), settle)

    def cancel(self, settle: bool = True) -> FakeCluster:
        return self.feed(self.machine.cancel(self.now), settle)

    def tick(self, after: float = 0.0, settle: bool = True) -> FakeCluster:
        self.now += after
        return self.feed(self.machine.tick(self.now), settle)

    def succeed(self) -> FakeCluster:
        return self.exit(PRIMARY, 0)

    # --- what the job looks like -------------------------------------------------------

    @property
    def state(self) -> JobState:
        return self.machine.state

    @property
    def record(self) -> dict[str, Any]:
        rec = self.machine.to_record()
        json.dumps(rec)   # the record is written as JSON: it must serialise
        return rec

    def replica(self, name: str, attempt: int = -1) -> dict[str, Any]:
        return self.record["attempts"][attempt]["replicas"][name]

    def used(self, budget: str) -> int:
        return self.record["budgets"][budget]["used"]

    def commands(self, kind: type) -> list[Any]:
        return [c for c in self.executed if isinstance(c, kind)]

    def states(self) -> list[str]:
        return [e["state"] for e in self.record["events"] if e["kind"] == "state"]

    def assert_ended(self, state: JobState, exit_status: int,
                     error: tuple[int, str] | None = None) -> None:
        rec = self.record
        assert rec["state"] == state.value
        assert self.machine.exit_status == rec["exit_status"] == exit_status
        assert rec["error"] == (None if error is None else {"code": error[0], "message": error[1]})
        assert rec["end_time"] is not None
        assert self.releases == 1, "the quota is given back exactly once"
        assert not self.alive, f"workers left running: {sorted(self.alive)}"
        assert not self.machine.live_replicas()


def running(workers: int = 2, **config: Any) -> FakeCluster:
    cluster = FakeCluster(workers, **config).launch()
    assert cluster.state is JobState.RUNNING
    assert set(cluster.alive) == set(replica_names(workers))
    return cluster


def user_error(replica: str, code: int, reason: str = "Error", excerpt: str | None = None) -> str:
    message = (f"The replica {replica} exited with a non-zero status of {code}. "
               f"Termination reason: {reason}.")
    return message + ("\n" + excerpt if excerpt else "")


# --- the lifecycle ----------------------------------------------------------------------------

def test_lifecycle_queued_pending_running_succeeded() -> None:
    c = FakeCluster(3)
    assert c.state is JobState.QUEUED and c.machine.exit_status is None
    c.feed(c.machine.start(c.now), settle=False)
    c.later(5).step()                                      # RequestCapacity -> quota_granted
    assert c.state is JobState.PENDING
    assert c.inbox == deque(StartWorker(r, 1, 0) for r in replica_names(3))
    c.later(1).step()
    c.later(1).step()
    assert c.state is JobState.PENDING                    # not every worker is up yet
    assert c.record["start_time"] is None
    c.later(1).step()
    assert c.state is JobState.RUNNING
    assert c.record["start_time"] == "2023-11-14T22:13:28.000Z"   # T0 + 8 s
    c.later(60).succeed()
    c.assert_ended(JobState.SUCCEEDED, 0)
    assert c.states() == ["JOB_STATE_QUEUED", "JOB_STATE_PENDING", "JOB_STATE_RUNNING",
                          "JOB_STATE_SUCCEEDED"]
    rec = c.record
    assert rec["create_time"] == "2023-11-14T22:13:20.000Z"
    assert rec["end_time"] == "2023-11-14T22:14:28.000Z"
    [attempt] = rec["attempts"]
    assert attempt["result"] == "succeeded" and attempt["end_time"] == rec["end_time"]
    assert attempt["replicas"][PRIMARY] == {"status": "exited", "restarts": 0,
                                            "uncounted_restarts": 0, "peer_restarts": 0,
                                            "maintenance_restarts": 0, "exit_codes": [0]}
    assert attempt["replicas"][W1] == {"status": "stopped", "restarts": 0,
                                       "uncounted_restarts": 0, "peer_restarts": 0,
                                       "maintenance_restarts": 0, "exit_codes": [143]}


def test_rule1_primary_exit_0_stops_the_others_and_succeeds() -> None:
    c = running(3)
    c.exit(PRIMARY, 0, settle=False)
    assert c.state is JobState.RUNNING                     # still stopping the others
    assert c.inbox == deque([StopWorkers((W1, W2), "succeeded")])
    c.settle()
    c.assert_ended(JobState.SUCCEEDED, 0)
    assert c.replica(W2)["status"] == "stopped"


def test_rule2_non_primary_exit_0_is_done_and_not_restarted() -> None:
    c = running(3).exit(W1, 0)
    assert c.state is JobState.RUNNING
    assert c.replica(W1) == {"status": "done", "restarts": 0, "uncounted_restarts": 0,
                             "peer_restarts": 0, "maintenance_restarts": 0,
                             "exit_codes": [0]}
    assert len(c.commands(StartWorker)) == 3               # no restart
    c.succeed()
    c.assert_ended(JobState.SUCCEEDED, 0)
    assert c.commands(StopWorkers) == [StopWorkers((W2,), "succeeded")]   # W1 is not stopped again


def test_rule3_out_of_memory_fails_with_the_oom_message() -> None:
    c = running(2).exit(W1, 137, Cause.OOM)
    oom = "The replica workerpool1-0 ran out of memory and exited with a non-zero status of 137."
    c.assert_ended(JobState.FAILED, 137, (3, oom))
    assert c.replica(PRIMARY)["status"] == "stopped"
    assert c.record["attempts"][0]["result"] == "failed: out-of-memory"


@pytest.mark.parametrize("code", [6, 11, 134, 139, 128 + 6, 128 + 11])
def test_rule4_transient_exit_codes_retry_the_whole_job(code: int) -> None:
    c = running(3).later(10).exit(W2, code)
    assert c.state is JobState.RUNNING
    first, second = c.record["attempts"]
    assert first["result"] == "retry: transient-exit-code"
    assert first["replicas"][W2]["exit_codes"] == [code]
    assert first["replicas"][PRIMARY] == {"status": "stopped", "restarts": 0,
                                          "uncounted_restarts": 0, "peer_restarts": 0,
                                          "maintenance_restarts": 0, "exit_codes": [143]}
    assert second["attempt"] == 2 and second["end_time"] is None
    assert all(r["status"] == "running" and r["exit_codes"] == [] for r in second["replicas"].values())
    assert c.used("job_retries") == 1
    assert c.alive == {r: StartWorker(r, 2, 1) for r in replica_names(3)}


def test_rule5_stockout_retries_the_job() -> None:
    c = running(2).fault(Cause.STOCKOUT)
    assert c.state is JobState.RUNNING
    assert [a["result"] for a in c.record["attempts"]] == ["retry: stockout", None]
    assert c.used("job_retries") == 1


def test_rule5_stockout_at_the_quota_stage_is_retried_3_times_then_fails() -> None:
    c = FakeCluster(2, capacity="never").launch()
    c.assert_ended(JobState.FAILED, 69, (8, STOCKOUT_MESSAGE))
    rec = c.record
    assert rec["attempts"] == [] and rec["start_time"] is None
    assert c.used("job_retries") == 3
    assert len(c.commands(RequestCapacity)) == 4           # the first ask and 3 retries
    assert sum(e["kind"] == "stockout" for e in rec["events"]) == 4
    assert c.states() == ["JOB_STATE_QUEUED", "JOB_STATE_FAILED"]


def test_rule5_stockout_at_the_quota_stage_then_capacity_is_an_ordinary_first_attempt() -> None:
    c = FakeCluster(2, capacity="never")
    c.feed(c.machine.start(c.now), settle=False)
    c.step()                                               # RequestCapacity -> no_capacity: retry
    c.capacity = "free"
    c.settle()                                             # the retry's RequestCapacity is granted
    assert c.state is JobState.RUNNING and c.used("job_retries") == 1
    assert [a["attempt"] for a in c.record["attempts"]] == [1]
    assert c.alive[PRIMARY] == StartWorker(PRIMARY, 1, 0)


def flex(**config: Any) -> FakeCluster:
    return running(2, strategy=Strategy.FLEX_START, **config)


def test_rule5_flex_start_stockout_waits_in_queued_without_spending_retries() -> None:
    c = flex(max_wait=HOUR)
    c.capacity = "busy"
    c.fault(Cause.STOCKOUT)
    assert c.state is JobState.QUEUED and not c.alive
    assert c.record["attempts"][0]["result"] == "requeue: stockout"
    assert c.machine.next_deadline() == c.now + HOUR
    c.tick(HOUR - 1)
    assert c.state is JobState.QUEUED
    c.set_capacity("free")
    assert c.state is JobState.RUNNING
    assert [a["attempt"] for a in c.record["attempts"]] == [1, 2]
    assert all(b["used"] == 0 for b in c.record["budgets"].values())
    c.succeed()
    c.assert_ended(JobState.SUCCEEDED, 0)


@pytest.mark.parametrize("capacity", ["busy", "never"])
def test_rule5_flex_start_fails_with_the_stockout_message_after_max_wait(capacity: str) -> None:
    c = flex(max_wait=HOUR)
    c.capacity = capacity
    c.fault(Cause.STOCKOUT).tick(HOUR - 0.001)
    assert c.state is JobState.QUEUED
    c.tick(0.001)
    c.assert_ended(JobState.FAILED, 69, (8, STOCKOUT_MESSAGE))
    assert c.used("job_retries") == 0


def test_rule5_flex_start_stockout_at_the_quota_stage_waits_then_fails() -> None:
    c = FakeCluster(2, capacity="never", strategy=Strategy.FLEX_START, max_wait=2 * HOUR).launch()
    assert c.state is JobState.QUEUED and c.record["attempts"] == []
    c.tick(HOUR)
    assert c.state is JobState.QUEUED
    c.tick(HOUR)
    c.assert_ended(JobState.FAILED, 69, (8, STOCKOUT_MESSAGE))
    assert c.used("job_retries") == 0


@pytest.mark.parametrize("max_wait", [None, 0])
def test_rule5_flex_start_without_max_wait_waits_forever(max_wait: float | None) -> None:
    c = flex(max_wait=max_wait, timeout=None)              # 0 = forever, as on the platform
    c.capacity = "busy"
    c.fault(Cause.STOCKOUT).tick(365 * DAY)
    assert c.state is JobState.QUEUED and c.machine.next_deadline() is None


def internal_error_by_fault(c: FakeCluster) -> None:
    c.fault(Cause.INTERNAL)


def internal_error_by_worker(c: FakeCluster) -> None:
    c.exit(W1, 70, Cause.INTERNAL)


@pytest.mark.parametrize("inject", [internal_error_by_fault, internal_error_by_worker])
def test_rule6_internal_errors_give_exactly_three_attempts(inject: Any) -> None:
    c = running(2)
    inject(c)
    inject(c)
    assert c.state is JobState.RUNNING and len(c.record["attempts"]) == 3
    inject(c)
    c.assert_ended(JobState.FAILED, 70, (13, INTERNAL_MESSAGE))
    assert len(c.record["attempts"]) == 3
    assert (c.used("internal_retries"), c.used("job_retries")) == (2, 0)


@pytest.mark.parametrize("cause", [Cause.NODE_LOSS, Cause.PREEMPTION])
def test_rule7_infrastructure_faults_restart_the_worker_in_place(cause: Cause) -> None:
    c = running(3).exit(W1, 137, cause)
    assert c.state is JobState.RUNNING and len(c.record["attempts"]) == 1
    assert c.replica(W1) == {"status": "running", "restarts": 1, "uncounted_restarts": 0,
                             "peer_restarts": 0, "maintenance_restarts": 0,
                             "exit_codes": [137]}
    assert c.alive[W1] == StartWorker(W1, attempt=1, restart=1)   # same attempt, same name
    assert c.commands(StopWorkers) == []                          # the others keep running
    assert c.alive[PRIMARY] == StartWorker(PRIMARY, 1, 0)
    assert c.used("worker_restarts") == 1


def test_rule7_maintenance_is_never_counted() -> None:
    c = running(2)
    for i in range(100):
        c.exit(W1 if i % 2 else PRIMARY, 143, Cause.MAINTENANCE)
    assert c.state is JobState.RUNNING and len(c.record["attempts"]) == 1
    assert c.replica(W1)["uncounted_restarts"] == c.replica(PRIMARY)["uncounted_restarts"] == 50
    assert c.replica(W1)["restarts"] == 0
    assert all(b["used"] == 0 for b in c.record["budgets"].values())
    assert c.alive[W1].restart == 50
    c.succeed()
    c.assert_ended(JobState.SUCCEEDED, 0)


def test_rule8_exit_1_fails_at_once_with_the_user_code_message_and_excerpt() -> None:
    excerpt = 'Traceback (most recent call last):\n  File "train.py", line 3\nValueError: bad lr'
    c = running(2).exit(W1, 1, excerpt=excerpt)
    c.assert_ended(JobState.FAILED, 1, (3, user_error(W1, 1, excerpt=excerpt)))
    assert c.record["error"]["message"].splitlines()[:2] == [
        "The replica workerpool1-0 exited with a non-zero status of 1. Termination reason: Error.",
        "Traceback (most recent call last):"]
    assert c.record["attempts"][0]["result"] == "failed: user-code-error"
    error_events = [e for e in c.record["events"] if e["kind"] == "error"]
    assert error_events[-1]["message"].endswith("Termination reason: Error.")   # first line only


@pytest.mark.parametrize("code", [1, 2, 42, 127, 137, 143, 255])
def test_rule8_any_other_exit_code_fails_the_job(code: int) -> None:
    c = running(2).exit(PRIMARY, code)
    c.assert_ended(JobState.FAILED, code, (3, user_error(PRIMARY, code)))


def test_rule8_start_error_is_status_128_with_reason_start_error() -> None:
    c = running(2).exit(W1, 128, Cause.START_ERROR, excerpt="cannot start 'trian.py': No such file")
    c.assert_ended(JobState.FAILED, 128, (3, user_error(W1, 128, "StartError",
                                                       "cannot start 'trian.py': No such file")))


# --- budget edges -------------------------------------------------------------------------

def test_fifth_worker_restart_is_allowed_and_sixth_failure_retries_the_job() -> None:
    c = running(2).fail_n(W1, 5, 137, Cause.NODE_LOSS)
    assert len(c.record["attempts"]) == 1
    assert c.replica(W1)["restarts"] == 5 and c.used("worker_restarts") == 5
    c.exit(W1, 137, Cause.NODE_LOSS)                       # the 6th failure
    first, second = c.record["attempts"]
    assert first["result"] == "retry: infrastructure-fault"
    assert first["replicas"][W1]["restarts"] == 5 and len(first["replicas"][W1]["exit_codes"]) == 6
    assert second["replicas"][W1]["restarts"] == 0        # fresh per-worker counters
    assert c.used("worker_restarts") == 0 and c.used("job_retries") == 1
    assert c.alive[W1] == StartWorker(W1, 2, 6)           # restarts in the job, all kinds
    c.fail_n(W1, 5, 137, Cause.NODE_LOSS)                  # the new attempt has 5 again
    assert len(c.record["attempts"]) == 2


def test_third_job_retry_is_allowed_and_fourth_failure_fails_the_job() -> None:
    c = running(2).fail_n(W1, 3, 134)
    assert c.state is JobState.RUNNING and len(c.record["attempts"]) == 4
    assert c.used("job_retries") == 3
    c.exit(W1, 134)
    c.assert_ended(JobState.FAILED, 134, (3, user_error(W1, 134)))
    assert len(c.record["attempts"]) == 4
    assert c.record["attempts"][-1]["result"] == "failed: transient-exit-code"


def test_job_retries_are_shared_by_every_kind_of_retry() -> None:
    c = running(2).exit(PRIMARY, 139).fault(Cause.STOCKOUT)
    c.fail_n(W1, 6, 137, Cause.NODE_LOSS)
    assert c.used("job_retries") == 3 and len(c.record["attempts"]) == 4
    c.fault(Cause.INTERNAL)                                # its own budget
    assert c.state is JobState.RUNNING and c.used("internal_retries") == 1
    c.fail_n(W1, 5, 143, Cause.PREEMPTION).exit(W1, 143, Cause.PREEMPTION)
    c.assert_ended(JobState.FAILED, 143, (14, user_error(W1, 143, "Preempted")))


def test_spot_preemption_retries_the_job_up_to_six_times() -> None:
    c = running(2, strategy=Strategy.SPOT)
    for n in range(1, 7):
        c.exit(W1 if n % 2 else PRIMARY, 143, Cause.PREEMPTION)
        assert c.state is JobState.RUNNING and len(c.record["attempts"]) == n + 1
    assert (c.used("spot_retries"), c.used("job_retries")) == (6, 0)
    c.exit(W1, 143, Cause.PREEMPTION)
    assert c.state is JobState.FAILED and len(c.record["attempts"]) == 7
    # A node loss on Spot is an ordinary infrastructure fault.
    c = running(2, strategy=Strategy.SPOT).exit(W1, 137, Cause.NODE_LOSS)
    assert c.replica(W1)["restarts"] == 1 and c.used("spot_retries") == 0


# --- options ----------------------------------------------------------------------------

def test_restart_job_on_worker_restart_restarts_every_worker_in_the_same_attempt() -> None:
    c = running(3, restart_job_on_worker_restart=True)
    c.exit(W1, 137, Cause.NODE_LOSS, settle=False)
    assert c.inbox == deque([StopWorkers((PRIMARY, W2), f"restart all after {W1}")])
    c.settle()
    assert c.state is JobState.RUNNING and len(c.record["attempts"]) == 1
    # The lost one on a new VM; its peers on their own (their local disks are kept).
    assert c.alive == {r: StartWorker(r, 1, 1, new_vm=r == W1) for r in replica_names(3)}
    assert c.replica(W1)["restarts"] == 1
    assert c.replica(PRIMARY)["exit_codes"] == [143] and c.replica(PRIMARY)["restarts"] == 0
    # Restarted with W1, on W1's budget: the record still shows that it was restarted.
    assert c.replica(PRIMARY)["uncounted_restarts"] == c.replica(W2)["uncounted_restarts"] == 1
    assert c.replica(W1)["uncounted_restarts"] == 0
    c.fail_n(W2, 4, 137, Cause.NODE_LOSS).exit(W1, 143, Cause.MAINTENANCE)
    assert c.alive[PRIMARY].restart == 6 and len(c.record["attempts"]) == 1


def test_disable_retries_fails_on_a_transient_exit_code_and_on_a_stockout() -> None:
    c = running(2, disable_retries=True).exit(W1, 134)
    c.assert_ended(JobState.FAILED, 134, (3, user_error(W1, 134)))
    assert len(c.record["attempts"]) == 1
    c = running(2, disable_retries=True).fault(Cause.STOCKOUT)
    c.assert_ended(JobState.FAILED, 69, (8, STOCKOUT_MESSAGE))
    c = running(2, disable_retries=True).fault(Cause.INTERNAL)
    c.assert_ended(JobState.FAILED, 70, (13, INTERNAL_MESSAGE))


def test_disable_retries_still_restarts_workers_five_times_then_fails() -> None:
    c = running(2, disable_retries=True).fail_n(W1, 5, 137, Cause.NODE_LOSS)
    assert c.state is JobState.RUNNING and c.replica(W1)["restarts"] == 5
    c.exit(W1, 137, Cause.NODE_LOSS)
    c.assert_ended(JobState.FAILED, 137, (14, user_error(W1, 137, "NodeLost")))
    assert len(c.record["attempts"]) == 1


def test_timeout_fails_the_job_with_deadline_exceeded() -> None:
    c = running(2, timeout=HOUR)
    assert c.machine.next_deadline() == T0 + HOUR
    c.tick(HOUR - 0.5)
    assert c.state is JobState.RUNNING
    c.tick(0.5, settle=False)
    assert c.inbox == deque([StopWorkers((PRIMARY, W1), "timeout")])
    c.settle()
    c.assert_ended(JobState.FAILED, 124,
                   (4, "The job ran longer than its timeout of 3600 s and was stopped."))
    assert c.machine.next_deadline() is None


def test_timeout_counts_from_the_first_running_across_retries() -> None:
    c = FakeCluster(2, timeout=HOUR, capacity="busy").launch().tick(DAY)   # queued: not counted
    c.set_capacity("free").exit(W1, 134).tick(HOUR - 1)
    assert c.state is JobState.RUNNING
    c.tick(1)
    assert c.state is JobState.FAILED and c.record["error"]["code"] == 4


def test_no_timeout_means_none() -> None:
    c = running(2, timeout=None).tick(365 * DAY)
    assert c.state is JobState.RUNNING and c.machine.next_deadline() is None


def test_cancel_while_queued_is_immediate() -> None:
    c = FakeCluster(2, capacity="busy").launch()
    assert c.state is JobState.QUEUED
    c.cancel()
    c.assert_ended(JobState.CANCELLED, 130, (1, "The job was cancelled."))
    assert c.record["attempts"] == []


def test_cancel_while_running_stops_the_workers_first() -> None:
    c = running(3).cancel(settle=False)
    assert c.state is JobState.CANCELLING and c.machine.exit_status is None
    assert c.machine.cancel(c.now) == []                   # a second Ctrl-C changes nothing
    c.settle()
    c.assert_ended(JobState.CANCELLED, 130, (1, "The job was cancelled."))
    assert c.states()[-2:] == ["JOB_STATE_CANCELLING", "JOB_STATE_CANCELLED"]
    assert c.record["attempts"][0]["result"] == "cancelled"


def test_cancel_while_pending_skips_workers_that_never_started() -> None:
    c = FakeCluster(2)
    c.feed(c.machine.start(c.now), settle=False)
    c.step()                                               # granted; two StartWorker queued
    c.step()                                               # the primary is up
    assert c.state is JobState.PENDING
    c.cancel()
    c.assert_ended(JobState.CANCELLED, 130, (1, "The job was cancelled."))
    assert [s.replica for s in c.superseded] == [W1]


# --- races -----------------------------------------------------------------------------

@pytest.mark.parametrize("code,cause", [(1, Cause.EXIT), (137, Cause.OOM), (134, Cause.EXIT),
                                        (137, Cause.NODE_LOSS), (0, Cause.EXIT)])
def test_a_worker_failing_during_the_succeeded_shutdown_changes_nothing(code: int, cause: Cause) -> None:
    c = running(3).exit(PRIMARY, 0, settle=False)
    c.exit(W1, code, cause)                                # before its StopWorkers arrives
    c.assert_ended(JobState.SUCCEEDED, 0)
    assert c.replica(W1) == {"status": "stopped", "restarts": 0, "uncounted_restarts": 0,
                             "peer_restarts": 0, "maintenance_restarts": 0,
                             "exit_codes": [code]}
    assert c.used("job_retries") == 0 and len(c.record["attempts"]) == 1


def test_a_cancel_during_the_succeeded_shutdown_changes_nothing() -> None:
    c = running(2).exit(PRIMARY, 0, settle=False).cancel()
    c.assert_ended(JobState.SUCCEEDED, 0)
    assert "JOB_STATE_CANCELLING" not in c.states()


def test_a_start_superseded_by_a_stop_is_not_current() -> None:
    c = running(2).exit(W1, 137, Cause.NODE_LOSS, settle=False)
    [restart] = list(c.inbox)
    assert restart == StartWorker(W1, 1, 1) and c.machine.is_current(restart)
    c.exit(PRIMARY, 0, settle=False)
    assert not c.machine.is_current(restart)
    c.settle()
    assert c.superseded == [restart]
    c.assert_ended(JobState.SUCCEEDED, 0)
    assert c.replica(W1)["status"] == "stopped"


def test_a_start_from_an_earlier_attempt_is_not_current() -> None:
    c = running(2).exit(W1, 137, Cause.NODE_LOSS, settle=False)
    [stale] = list(c.inbox)
    c.inbox.clear()
    c.exit(PRIMARY, 134)                                   # retry: attempt 2 starts both
    assert not c.machine.is_current(stale)
    assert c.alive[W1] == StartWorker(W1, 2, 2)


def test_failures_during_a_retry_stop_spend_no_budget() -> None:
    c = running(3).exit(W1, 134, settle=False)
    c.exit(PRIMARY, 137, Cause.OOM, settle=False).exit(W2, 1)
    assert c.state is JobState.RUNNING and len(c.record["attempts"]) == 2
    assert c.used("job_retries") == 1
    assert c.record["attempts"][0]["replicas"][PRIMARY]["status"] == "stopped"


def cancel_now(c: FakeCluster) -> None:
    c.cancel(settle=False)


def time_out_now(c: FakeCluster) -> None:
    c.tick(HOUR, settle=False)


def retry_the_job(c: FakeCluster) -> None:
    c.exit(W1, 134, settle=False)


def restart_every_worker(c: FakeCluster) -> None:
    c.exit(W1, 137, Cause.NODE_LOSS, settle=False)


@pytest.mark.parametrize("winding_down", [retry_the_job, restart_every_worker])
@pytest.mark.parametrize("terminal,state,status", [(cancel_now, JobState.CANCELLED, 130),
                                                   (time_out_now, JobState.FAILED, 124)])
def test_a_terminal_decision_during_a_retry_or_restart_stop_wins(
        winding_down: Any, terminal: Any, state: JobState, status: int) -> None:
    c = running(2, timeout=HOUR, restart_job_on_worker_restart=True)
    winding_down(c)                                        # the primary's stop is in flight
    terminal(c)
    c.settle()
    assert c.state is state and c.machine.exit_status == status and not c.alive
    assert len(c.record["attempts"]) == 1
    assert len(c.commands(StartWorker)) == 2               # nothing was started again


def test_a_failure_during_cancelling_changes_nothing() -> None:
    c = running(2).cancel(settle=False).exit(W1, 137, Cause.OOM)
    c.assert_ended(JobState.CANCELLED, 130, (1, "The job was cancelled."))


def test_a_failed_job_never_exits_0_even_when_its_last_worker_did() -> None:
    """A worker that catches SIGTERM on a preemption may exit 0 (docs/platform.md, "Signals")."""
    c = running(2, disable_retries=True).fail_n(W1, 6, 0, Cause.PREEMPTION)
    assert c.state is JobState.FAILED
    assert c.machine.exit_status == 1
    assert c.record["error"]["message"] == user_error(W1, 0, "Preempted")


# --- user policy files --------------------------------------------------------------------

FLAKY_42 = {
    "budgets": {"flaky": {"limit": 2, "scope": "worker"}},
    "rules": [
        {"name": "done", "match": {"causes": ["exit"], "exit_codes": [0], "primary": True},
         "actions": ["succeed_job"]},
        {"name": "flaky-42", "match": {"exit_codes": [42]}, "actions": ["restart_worker:flaky", "fail_job"]},
        {"name": "everything-else", "match": {}, "actions": ["fail_job"]},
    ],
}


def test_two_worker_budgets_are_counted_apart() -> None:
    # Each worker-scoped budget has its own count per replica (they shared one counter).
    policy = with_platform_defaults(policy_from_dict({
        "budgets": {"flaky": {"limit": 1, "scope": "worker"}},
        "rules": [{"match": {"exit_codes": [42]}, "actions": ["restart_worker:flaky"]}]}))
    c = running(2, policy=policy).exit(W1, 42)
    c.fail_n(W1, 5, 137, Cause.NODE_LOSS)           # worker_restarts: 5 of 5, flaky untouched
    assert c.replica(W1)["restarts"] == 6 and len(c.record["attempts"]) == 1
    assert c.record["budgets"]["worker_restarts"]["used"] == 5
    assert c.record["budgets"]["flaky"]["used"] == 1


def test_a_user_policy_file_changes_behaviour(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(FLAKY_42))
    c = running(2, policy=load_policy(path)).fail_n(W1, 2, 42)
    assert c.state is JobState.RUNNING and c.replica(W1)["restarts"] == 2
    assert c.record["budgets"]["flaky"] == {"limit": 2, "scope": "worker", "used": 2}
    c.exit(W1, 42)
    c.assert_ended(JobState.FAILED, 42, (3, user_error(W1, 42)))
    decisions = [e["rule"] for e in c.record["events"] if e["kind"] == "decision"]
    assert decisions == ["flaky-42"] * 3
    # The same exit under the default policy fails at once.
    running(2).exit(W1, 42).assert_ended(JobState.FAILED, 42, (3, user_error(W1, 42)))


def test_a_user_policy_with_no_matching_rule_fails_the_job() -> None:
    policy = policy_from_dict({"rules": [{"match": {"causes": ["oom"]}, "actions": ["fail_job"]}]})
    c = running(2, policy=policy).exit(W1, 3)
    c.assert_ended(JobState.FAILED, 3, (3, user_error(W1, 3)))
    [decision] = [e for e in c.record["events"] if e["kind"] == "decision"]
    assert (decision["rule"], decision["action"]) == ("no rule matched", "fail_job")


def test_a_policy_file_names_its_exceptions_and_the_platform_table_does_the_rest() -> None:
    # What the CLI runs for --policy: the user's rules first, then the platform's table.
    only_42 = policy_from_dict({"budgets": {"flaky": 1}, "rules": [
        {"name": "flaky-42", "match": {"exit_codes": [42]},
         "actions": ["restart_worker:flaky", "fail_job"]}]})
    policy = with_platform_defaults(only_42)
    assert policy.budgets["flaky"].limit == 1 and policy.budgets["job_retries"].limit == 3
    c = running(2, policy=policy).exit(W1, 42)
    # A restart paid from a job-scoped budget is a restart of the replica all the same.
    assert c.state is JobState.RUNNING and c.replica(W1)["restarts"] == 1
    c.exit(W1, 0)  # a worker done: worker-finished, not a failure
    assert c.replica(W1)["status"] == "done"
    c.succeed().assert_ended(JobState.SUCCEEDED, 0)
    # An OOM that the file does not mention is still the platform's permanent OOM.
    c = running(2, policy=policy).exit(W1, 137, Cause.OOM)
    c.assert_ended(JobState.FAILED, 137, (3, "The replica workerpool1-0 ran out of memory "
                                            "and exited with a non-zero status of 137."))


def test_worker_actions_in_a_user_policy_skip_job_wide_faults() -> None:
    policy = policy_from_dict({"rules": [
        {"match": {"causes": ["internal"]}, "actions": ["worker_done", "restart_worker", "fail_job"]}]})
    c = running(2, policy=policy).fault(Cause.INTERNAL)
    c.assert_ended(JobState.FAILED, 70, (13, INTERNAL_MESSAGE))


# --- the property test ----------------------------------------------------------------------

# Worker outcomes, weighted towards the ones a job survives so that runs get long enough
# to exhaust budgets.
SURVIVABLE = [(Cause.NODE_LOSS, 137), (Cause.PREEMPTION, 143), (Cause.PREEMPTION, 0),
              (Cause.MAINTENANCE, 143), (Cause.EXIT, 134), (Cause.EXIT, 139), (Cause.EXIT, 6),
              (Cause.EXIT, 11), (Cause.INTERNAL, 70), (Cause.STOCKOUT, 143)]
FINISHING = [(Cause.EXIT, 0)]
FATAL = [(Cause.EXIT, 1), (Cause.EXIT, 42), (Cause.OOM, 137), (Cause.START_ERROR, 128),
         (Cause.EXIT, 143)]
OUTCOMES = st.sampled_from(SURVIVABLE * 3 + FINISHING * 3 + FATAL)
# sampled_from keeps duplicates, so the list is the weighting; cancels are rarer still
# (see apply).
KINDS = ["exit"] * 20 + ["primary_exits_0"] * 2 + ["step"] * 10 + ["settle"] * 4 + ["tick"] * 4 + ["fault"] * 2 + [
    "capacity"] * 2 + ["cancel"] * 2
EVENTS = st.tuples(st.sampled_from(KINDS), st.integers(0, 3), OUTCOMES,
                   st.sampled_from([Cause.STOCKOUT, Cause.INTERNAL]),
                   st.sampled_from([1.0, 600.0, HOUR, DAY]),
                   st.sampled_from(["free", "busy", "never"]))
SCENARIOS = st.fixed_dictionaries({
    "workers": st.integers(1, 4),
    "strategy": st.sampled_from(list(Strategy)),
    "disable_retries": st.booleans(),
    "restart_job_on_worker_restart": st.booleans(),
    "timeout": st.sampled_from([None, 2 * HOUR]),
    "max_wait": st.sampled_from([None, HOUR]),
    "capacity": st.sampled_from(["free"] * 6 + ["busy", "never"]),
})


def apply(c: FakeCluster, event: tuple) -> bool:
    """Inject one event; True when it was an unsolicited exit 0 of the primary while the
    job was RUNNING and not winding down (so the job must end SUCCEEDED)."""
    kind, index, (cause, code), fault, seconds, capacity = event
    if kind == "primary_exits_0":
        kind, index, cause, code = "exit", 0, Cause.EXIT, 0   # the primary sorts first
    if kind == "exit":
        alive = sorted(c.alive)
        if not alive:                      # nobody to fail: let the cluster make progress
            c.settle()
            return False
        replica = alive[index % len(alive)]
        att = c.machine.attempt
        must_succeed = (replica == PRIMARY and cause is Cause.EXIT and code == 0
                        and c.state is JobState.RUNNING and att is not None
                        and att.replicas[PRIMARY].status == "running")
        c.exit(replica, code, cause, settle=False)
        return must_succeed
    if kind == "step" and c.inbox:
        c.step()
    elif kind == "settle":
        c.settle()
    elif kind == "fault":
        c.fault(fault, settle=False)
    elif kind == "tick":
        c.tick(seconds, settle=False)
    elif kind == "capacity":
        c.set_capacity(capacity, settle=False)
    elif kind == "cancel" and index == 0:
        c.cancel(settle=False)
    return False


def check_invariants(c: FakeCluster) -> None:
    rec = c.record
    budgets = c.machine.config.policy.budgets
    for name, b in rec["budgets"].items():
        assert 0 <= b["used"] <= b["limit"], (name, b)
    worker_limit = budgets["worker_restarts"].limit
    for attempt in rec["attempts"]:
        for r in attempt["replicas"].values():
            assert r["restarts"] <= worker_limit
    retry_budget = sum(b.limit for b in budgets.values() if b.scope == JOB_SCOPE)
    results = [a["result"] for a in rec["attempts"]]
    assert all(r is not None for r in results[:-1])
    retries = sum(r.startswith("retry:") for r in results if r)
    requeues = sum(r.startswith("requeue:") for r in results if r)
    assert retries <= sum(b["used"] for n, b in rec["budgets"].items() if budgets[n].scope == JOB_SCOPE)
    assert len(results) <= 1 + retry_budget + requeues
    state = c.state
    if state.terminal:
        assert (rec["error"] is None) == (state is JobState.SUCCEEDED)
        assert (c.machine.exit_status == 0) == (state is JobState.SUCCEEDED)
        if state is JobState.CANCELLED:
            assert c.machine.exit_status == 130 and rec["error"]["code"] == 1
    else:
        assert c.machine.exit_status is None and rec["error"] is None


def drive_to_the_end(c: FakeCluster) -> None:
    """Stop injecting failures: capacity appears and the primary exits 0 (or the user cancels)."""
    for _ in range(20):
        c.settle()
        if c.state.terminal:
            return
        if c.state is JobState.QUEUED and c.wants_capacity:
            c.set_capacity("free")
        elif PRIMARY in c.alive:
            c.exit(PRIMARY, 0)
        else:
            c.cancel()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=SCENARIOS, settle_launch=st.booleans(), events=st.lists(EVENTS, min_size=20, max_size=80))
def test_property_random_outcomes_keep_budgets_and_always_end(
        scenario: dict, settle_launch: bool, events: list) -> None:
    c = FakeCluster(scenario.pop("workers"), **scenario)
    c.feed(c.machine.start(c.now), settle=settle_launch)
    must_succeed = False
    for event in events:
        must_succeed |= apply(c, event)
        check_invariants(c)
    drive_to_the_end(c)
    check_invariants(c)
    assert c.state.terminal, c.state
    assert c.releases == 1 and not c.alive and not c.machine.live_replicas()
    if must_succeed:
        assert c.state is JobState.SUCCEEDED
    # Once terminal, nothing moves it.
    final = c.record
    c.cancel().tick(365 * DAY).fault(Cause.INTERNAL)
    assert c.machine.quota_granted(c.now) == [] and c.machine.no_capacity(c.now) == []
    assert c.record["state"] == final["state"] and c.record["error"] == final["error"]


# --- strategy defaults and edge options ----------------------------------------------------

def test_spot_preemption_budget_exhausted_fails_with_the_stockout_message() -> None:
    """On Spot VMs a preemption surfaces as a stockout (docs/platform.md, "Scheduling
    strategies")."""
    c = running(2, strategy=Strategy.SPOT)
    for _ in range(7):
        c.exit(W1, 143, Cause.PREEMPTION)
    c.assert_ended(JobState.FAILED, 69, (8, STOCKOUT_MESSAGE))


def test_the_strategy_alone_selects_the_platform_table() -> None:
    from resilient_train.platform.rules import Action, Outcome

    spot = JobConfig("j", replica_names(2), strategy=Strategy.SPOT).rules
    assert any(r.name == "spot-preemption" for r in spot.rules)
    flex_rules = JobConfig("j", replica_names(2), strategy=Strategy.FLEX_START).rules
    rule = flex_rules.first_match(Outcome(None, False, Cause.STOCKOUT, None))
    assert rule is not None and rule.steps[0].action is Action.WAIT_FOR_CAPACITY


def test_restart_job_on_worker_restart_never_restarts_a_finished_worker() -> None:
    c = running(3, restart_job_on_worker_restart=True)
    c.exit(W2, 0)                                          # done: worker-finished
    c.exit(W1, 137, Cause.NODE_LOSS)
    assert set(c.alive) == {PRIMARY, W1}
    assert c.replica(W2)["status"] == "done"


def test_flex_start_bounds_the_wait_for_busy_local_quota_too() -> None:
    c = FakeCluster(2, capacity="busy", strategy=Strategy.FLEX_START, max_wait=HOUR).launch()
    assert c.state is JobState.QUEUED
    c.tick(HOUR)
    c.assert_ended(JobState.FAILED, 69, (8, STOCKOUT_MESSAGE))


def test_standard_strategy_waits_for_busy_quota_without_limit() -> None:
    c = FakeCluster(2, capacity="busy").launch().tick(365 * DAY)
    assert c.state is JobState.QUEUED
    c.set_capacity("free")
    assert c.state is JobState.RUNNING


def test_timeout_zero_means_no_timeout() -> None:
    c = running(2, timeout=0).tick(365 * DAY)
    assert c.state is JobState.RUNNING and c.machine.next_deadline() is None
