"""The job state machine: pure, driven by events, with an injected clock.

The process layer (``runner`` and its parts) turns OS facts into calls here (a worker started, a
worker exited with a code and a cause, a fault, a tick of the clock) and executes the
commands that come back (start a worker, stop workers, ask for capacity). Nothing here
touches a process, a file or the real time, so every rule and budget edge of the
platform's lifecycle and restart rules (docs/platform.md) is testable with a fake clock and
fake workers. Everything that happens is recorded as a typed :class:`~.events.Event`.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Union

from ..observe.events import EVENT_FIELDS, Event, EventKind, decision_summary, iso
from ..platform.rules import (
    JOB_SCOPE,
    Action,
    Cause,
    Outcome,
    Policy,
    Step,
    Strategy,
    default_policy,
)
from ..text import first_line
from .machines import new_vm_after
from .messages import (
    JobError,
    JobState,
    PeerLoss,
    cancelled_error,
    error_for,
    internal_error,
    timeout_error,
)

__all__ = ["PRIMARY", "Command", "JobConfig", "JobMachine", "ReleaseCapacity",
           "RequestCapacity", "StartWorker", "StopWorkers", "iso"]

log = logging.getLogger(__name__)

PRIMARY = "workerpool0-0"

# A replica's permanent exit this soon after a peer's loss, with a failed peer connection
# in its log, is put down to that loss (error.message's "Likely cause" line). gloo and NCCL
# see a dead peer's connection at once, but a survivor busy elsewhere (a data loader, a
# long forward, a save) meets it only at its next collective: 30 s covers a step of an
# ordinary length, and a bug much later than that is unlikely to be the loss's doing.
PEER_LOSS_WINDOW_S = 30.0
# A peer that ended so is lost to the others' collectives (and any non-zero exit: a crash).
_LOSS_CAUSES = frozenset({"node_loss", "preemption", "maintenance", "oom"})
# Set by the machine on every event; a note names the others.
_MACHINE_FIELDS = frozenset({"kind", "time", "elapsed_s", "message", "attempt"})


@dataclass(frozen=True)
class JobConfig:
    name: str
    replicas: tuple[str, ...]  # rank order; replicas[0] is the primary
    policy: Policy | None = None   # None: the platform's table for ``strategy``
    strategy: Strategy = Strategy.STANDARD
    restart_job_on_worker_restart: bool = False
    timeout: float | None = 7 * 24 * 3600.0   # from the first RUNNING; None or 0 = no limit
    max_wait: float | None = 24 * 3600.0      # FLEX_START wait for capacity; None or 0 = forever
    region: str = "local"

    @property
    def rules(self) -> Policy:
        return self.policy if self.policy is not None else default_policy(self.strategy)


# --- commands for the process layer -------------------------------------------------

@dataclass(frozen=True)
class StartWorker:
    replica: str
    attempt: int
    restart: int        # restarts of this replica so far in this job (all kinds)
    # On a VM of its own that is new (first start, job retry, after a node loss): its
    # local disk is wiped. Its container is always new (machines.py has the table).
    new_vm: bool = True


@dataclass(frozen=True)
class StopWorkers:
    replicas: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class RequestCapacity:
    """Acquire the job's quota, then call ``quota_granted`` or ``no_capacity``."""


@dataclass(frozen=True)
class ReleaseCapacity:
    """The job is over: give its quota back."""


Command = Union[StartWorker, StopWorkers, RequestCapacity, ReleaseCapacity]


# --- records --------------------------------------------------------------------------

# Replica status inside one attempt.
STARTING, RUNNING, DONE, STOPPING, STOPPED, EXITED = (
    "starting", "running", "done", "stopping", "stopped", "exited")
_LIVE = (STARTING, RUNNING, STOPPING)


@dataclass
class ReplicaRecord:
    status: str = STARTING
    restarts: int = 0              # restarts in this attempt that a budget paid for
    uncounted_restarts: int = 0    # maintenance; restarted along with a peer (restart-all)
    peer_restarts: int = 0         # of those, restarted along with a peer (restart-all)
    exit_codes: list[int] = field(default_factory=list)
    # What this replica spent of each worker-scoped budget in this attempt (not in the
    # record: the job's budget summary shows the most any replica spent).
    budget_used: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        # uncounted_restarts stays the total of the two that follow it (older readers).
        return {"status": self.status, "restarts": self.restarts,
                "uncounted_restarts": self.uncounted_restarts,
                "peer_restarts": self.peer_restarts,
                "maintenance_restarts": self.uncounted_restarts - self.peer_restarts,
                "exit_codes": list(self.exit_codes)}


@dataclass
class AttemptRecord:
    number: int
    start_time: float
    replicas: dict[str, ReplicaRecord]
    end_time: float | None = None
    result: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"attempt": self.number, "start_time": iso(self.start_time),
                "end_time": iso(self.end_time), "result": self.result,
                "replicas": {name: r.to_json() for name, r in self.replicas.items()}}


@dataclass(frozen=True)
class _AfterStop:
    """What to do once every live worker has stopped."""

    kind: str                  # "retry", "requeue", "restart_all", "terminal"
    state: JobState | None = None
    error: JobError | None = None
    reason: str = ""
    replica: str | None = None  # restart_all: the replica whose restart restarts all
    cause: Cause | None = None  # restart_all: why that replica ended


class JobMachine:
    def __init__(self, config: JobConfig, now: float) -> None:
        if not config.replicas:
            raise ValueError("a job needs at least one replica")
        self.config = config
        self.state = JobState.QUEUED
        self.create_time = now
        self.start_time: float | None = None
        self.end_time: float | None = None
        self.update_time = now
        self.error: JobError | None = None
        self.attempts: list[AttemptRecord] = []
        self.budget_used: Counter[str] = Counter()
        self.events: list[Event] = []
        self._restarts_in_job: Counter[str] = Counter()
        self._after_stop: _AfterStop | None = None
        self._waiting_since: float | None = None   # FLEX_START wait for capacity
        self._stockout_waiting = False
        self._policy = config.rules
        # The exit being decided: (replica, time, its log's failed-connection line).
        self._exit_seen: tuple[str, float, str | None] | None = None
        self._event(now, EventKind.STATE, f"job {config.name}: {self.state.value}",
                    state=self.state.value)

    # --- queries ----------------------------------------------------------------------

    @property
    def attempt(self) -> AttemptRecord | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def exit_status(self) -> int | None:
        """The launcher's exit status once terminal: 0, the root cause's code, or a STATUS_*."""
        if not self.state.terminal:
            return None
        if self.state is JobState.SUCCEEDED:
            return 0
        status = self.error.exit_status if self.error else 1
        # A job that did not succeed never exits 0, even when its root cause is a worker
        # that exited 0 (one that caught SIGTERM on a preemption, say).
        return status or 1

    def live_replicas(self) -> tuple[str, ...]:
        att = self.attempt
        return tuple(n for n, r in att.replicas.items() if r.status in _LIVE) if att else ()

    def is_current(self, cmd: StartWorker) -> bool:
        """Still wanted? A decision taken after a StartWorker was issued may cancel it."""
        att = self.attempt
        return (att is not None and att.number == cmd.attempt
                and att.replicas[cmd.replica].status == STARTING
                and self._restarts_in_job[cmd.replica] == cmd.restart)

    def next_deadline(self) -> float | None:
        """When ``tick`` next has something to do (timeout or end of a capacity wait)."""
        times = []
        if self.config.timeout and self.start_time is not None and not self.state.terminal:
            times.append(self.start_time + self.config.timeout)
        if self._waiting_since is not None and self.config.max_wait:
            times.append(self._waiting_since + self.config.max_wait)
        return min(times) if times else None

    def budget_summary(self) -> dict[str, dict[str, Any]]:
        out = {}
        for name, b in self._policy.budgets.items():
            if b.scope == JOB_SCOPE:
                used = self.budget_used[name]
            else:
                att = self.attempt
                used = max((r.budget_used.get(name, 0) for r in att.replicas.values()),
                           default=0) if att else 0
            out[name] = {"limit": b.limit, "scope": b.scope, "used": used}
        return out

    def failures(self) -> int:
        """Failures so far in this job, for its observed MTBF: the events that count as one
        (faults as their notes say; non-zero exits of user code)."""
        return sum(e.counts_as_failure for e in self.events)

    # --- events -----------------------------------------------------------------------

    def start(self, now: float) -> list[Command]:
        if self.config.strategy is Strategy.FLEX_START:
            # Flex-start: waiting for capacity, local quota included, is bounded by max_wait.
            self._waiting_since = now
        return [RequestCapacity()]

    def quota_granted(self, now: float) -> list[Command]:
        if self.state is not JobState.QUEUED:
            return []
        self._waiting_since = None
        self._stockout_waiting = False
        return self._new_attempt(now)

    def no_capacity(self, now: float) -> list[Command]:
        """The job asks for more than the machine has: a stockout before any worker starts."""
        if self.state is not JobState.QUEUED or self._stockout_waiting:
            return []
        self._event(now, EventKind.STOCKOUT, f"job {self.config.name}: stockout: the request "
                    f"exceeds what this machine has", cause=Cause.STOCKOUT.value)
        return self._decide(Outcome(None, False, Cause.STOCKOUT, None), now)

    def worker_started(self, replica: str, now: float) -> list[Command]:
        att = self.attempt
        if att is None or att.replicas[replica].status != STARTING:
            return []
        att.replicas[replica].status = RUNNING
        self._event(now, EventKind.STARTED, f"{replica}: started", replica=replica)
        if self.state is JobState.PENDING and all(
                r.status != STARTING for r in att.replicas.values()):
            if self.start_time is None:
                self.start_time = now
            self._set_state(JobState.RUNNING, now)
        return []

    def worker_exited(self, replica: str, exit_code: int, cause: Cause, now: float,
                      excerpt: str | None = None, connection_error: str | None = None,
                      step: int | None = None) -> list[Command]:
        """``excerpt``: the traceback for the job's error; ``connection_error``: the line of
        the replica's log that says a peer's connection failed, if one does; ``step``: the
        last step it reported."""
        att = self.attempt
        if att is None or att.replicas[replica].status not in _LIVE:
            return []
        self._exit_seen = (replica, now, connection_error)
        rec = att.replicas[replica]
        rec.exit_codes.append(exit_code)
        if rec.status == STOPPING:
            rec.status = STOPPED
            self._event(now, EventKind.STOPPED, f"{replica}: stopped (exit {exit_code})",
                        replica=replica, exit_code=exit_code, step=step)
            return self._maybe_finish_stop(now)
        rec.status = EXITED
        detail = "" if cause is Cause.EXIT else f" ({cause.value})"
        # The MTBF's failures: faults (their notes count) and the user code's own crashes.
        self._event(now, EventKind.EXITED, f"{replica}: exited with status {exit_code}{detail}",
                    replica=replica, exit_code=exit_code, cause=cause.value, step=step,
                    counts_as_failure=cause is Cause.EXIT and exit_code != 0)
        outcome = Outcome(replica, replica == self.config.replicas[0], cause, exit_code)
        return self._decide(outcome, now, excerpt)

    @property
    def stopping(self) -> bool:
        """The workers are being stopped for a decision already taken (retry, end)."""
        return self._after_stop is not None

    def job_fault(self, cause: Cause, now: float) -> list[Command]:
        """An attempt-wide fault (stockout, internal error) while workers run."""
        if self.state not in (JobState.PENDING, JobState.RUNNING) or self._after_stop:
            return []
        return self._decide(Outcome(None, False, cause, None), now)

    def cancel(self, now: float) -> list[Command]:
        if self.state.terminal or self.state is JobState.CANCELLING:
            return []
        if self._after_stop is not None and self._after_stop.kind == "terminal":
            return []   # the job's end is already decided; the first terminal decision stands
        if self.state is JobState.QUEUED:
            self.error = cancelled_error()
            return self._finish(JobState.CANCELLED, now)
        self._set_state(JobState.CANCELLING, now)
        return self._stop_all(_AfterStop("terminal", JobState.CANCELLED, cancelled_error(),
                                         "cancelled"), now)

    def tick(self, now: float) -> list[Command]:
        if self.state.terminal:
            return []
        timeout = self.config.timeout
        if (timeout and self.start_time is not None
                and now >= self.start_time + timeout
                and not (self._after_stop and self._after_stop.kind == "terminal")):
            self._event(now, EventKind.TIMEOUT,
                        f"job {self.config.name}: timeout of {timeout:g} s reached")
            return self._stop_all(_AfterStop("terminal", JobState.FAILED, timeout_error(timeout),
                                             "timeout"), now)
        # max_wait_duration 0 means forever, as on the platform (docs/platform.md,
        # "Scheduling strategies").
        if (self._waiting_since is not None and self.config.max_wait
                and now >= self._waiting_since + self.config.max_wait):
            self._waiting_since = None
            self.error = error_for(Cause.STOCKOUT, self.config.replicas[0],
                                   region=self.config.region)
            return self._finish(JobState.FAILED, now)
        return []

    def note(self, now: float, kind: EventKind, message: str, /, **fields: Any) -> None:
        """An event from the process layer: a fault, a stall's end, a signal, a machine
        change, a warning. ``fields`` are :class:`Event` fields (``replica``, ``fault``,
        ``cause``, ``injected``, ``step``, ``counts_as_failure``, ``duration_s``...)::

            machine.note(now, EventKind.FAULT, "chaos: kill on workerpool1-0 at step 20",
                         replica="workerpool1-0", fault="kill", cause="node_loss",
                         injected=True, step=20, counts_as_failure=True)
        """
        if not isinstance(kind, EventKind):
            raise TypeError(f"note: expected an EventKind, found {kind!r}")
        bad = set(fields) - (EVENT_FIELDS - _MACHINE_FIELDS)
        if bad:
            raise TypeError(f"note: unknown event fields {sorted(bad)}; an Event has "
                            f"{sorted(EVENT_FIELDS - _MACHINE_FIELDS)}")
        self._event(now, kind, message, **fields)

    def launcher_failed(self, now: float) -> None:
        """The launcher itself crashed: the job ends FAILED with the internal error."""
        if self.state.terminal:
            return
        self.error = internal_error()
        self.end_time = now
        self._set_state(JobState.FAILED, now)

    # --- decisions --------------------------------------------------------------------

    def _decide(self, outcome: Outcome, now: float, excerpt: str | None = None) -> list[Command]:
        if self._after_stop is not None:
            # Already winding down (a retry or a terminal decision): late exits change nothing.
            return self._maybe_finish_stop(now)
        rule = self._policy.first_match(outcome)
        step = self._take_step(rule.steps if rule else (), outcome)
        rule_name = rule.name if rule else "no rule matched"
        who = outcome.replica or f"job {self.config.name}"
        action = step.action if step else Action.FAIL_JOB
        budget, used, limit = self._budget_spent(step, outcome)
        self._event(now, EventKind.DECISION,
                    f"{who}: {decision_summary(action.value, rule_name, budget, used, limit)}",
                    replica=outcome.replica, rule=rule_name, action=action.value,
                    cause=outcome.cause.value, budget=budget, budget_used=used,
                    budget_limit=limit)
        if action is Action.SUCCEED_JOB:
            return self._stop_all(_AfterStop("terminal", JobState.SUCCEEDED, None, "succeeded"),
                                  now)
        if action is Action.WORKER_DONE:
            assert outcome.replica is not None
            self.attempts[-1].replicas[outcome.replica].status = DONE
            return []
        if action is Action.RESTART_WORKER and outcome.replica is not None:
            return self._restart_worker(outcome.replica, outcome.cause, now)
        if action is Action.RETRY_JOB:
            return self._stop_all(_AfterStop("retry", reason=f"retry: {rule_name}"), now)
        if action is Action.WAIT_FOR_CAPACITY:
            return self._stop_all(_AfterStop("requeue", reason=f"requeue: {rule_name}"), now)
        return self._stop_all(_AfterStop("terminal", JobState.FAILED,
                                         self._error_for(outcome, excerpt),
                                         f"failed: {rule_name}"), now)

    def _take_step(self, steps: tuple[Step, ...], outcome: Outcome) -> Step | None:
        """The first step whose budget lasts; spend it."""
        for step in steps:
            if (step.action in (Action.RESTART_WORKER, Action.WORKER_DONE)
                    and outcome.replica is None):
                continue   # a job-wide fault has no worker to restart or finish
            if step.budget is None:
                if step.action is Action.RESTART_WORKER and outcome.replica is not None:
                    self.attempts[-1].replicas[outcome.replica].uncounted_restarts += 1
                return step
            budget = self._policy.budgets[step.budget]
            rec = (self.attempts[-1].replicas[outcome.replica]
                   if outcome.replica is not None and self.attempts else None)
            if budget.scope == JOB_SCOPE:
                if self.budget_used[step.budget] >= budget.limit:
                    continue
                self.budget_used[step.budget] += 1
            elif rec is not None and rec.budget_used.get(step.budget, 0) < budget.limit:
                rec.budget_used[step.budget] = rec.budget_used.get(step.budget, 0) + 1
            else:
                continue
            if step.action is Action.RESTART_WORKER and rec is not None:
                rec.restarts += 1
            return step
        return None

    def _budget_spent(self, step: Step | None,
                      outcome: Outcome) -> tuple[str | None, int | None, int | None]:
        """The budget the step spent: (name, used, limit), all None when it spent none."""
        if step is None or step.budget is None:
            return None, None, None
        budget = self._policy.budgets[step.budget]
        if budget.scope == JOB_SCOPE:
            used = self.budget_used[step.budget]
        else:
            assert outcome.replica is not None
            used = self.attempts[-1].replicas[outcome.replica].budget_used[step.budget]
        return step.budget, used, budget.limit

    def _error_for(self, outcome: Outcome, excerpt: str | None) -> JobError:
        replica = outcome.replica or self.config.replicas[0]
        peer_loss = (self._peer_loss(replica)
                     if outcome.cause is Cause.EXIT and outcome.exit_code else None)
        return error_for(outcome.cause, replica, outcome.exit_code, excerpt, peer_loss,
                         self.config.strategy, self.config.region)

    def _peer_loss(self, replica: str) -> PeerLoss | None:
        """Another replica of this attempt lost shortly before this exit, when this
        replica's log shows a failed peer connection (PEER_LOSS_WINDOW_S)."""
        seen, att = self._exit_seen, self.attempt
        if seen is None or seen[0] != replica or att is None:
            return None
        _, now, connection_error = seen
        if connection_error is None:
            return None
        for e in reversed(self.events):
            if e.attempt != att.number:
                break
            ago = now - (self.create_time + e.elapsed_s)
            if ago > PEER_LOSS_WINDOW_S:
                break
            peer = e.replica
            if peer is None or peer == replica:
                continue
            cause = e.cause
            if e.kind is EventKind.EXITED and (cause in _LOSS_CAUSES or e.exit_code):
                what = cause if cause in _LOSS_CAUSES else f"exit {e.exit_code}"
            elif e.kind is EventKind.FAULT and cause in _LOSS_CAUSES:
                what = cause   # the fault's SIGTERM or SIGKILL: its exit may come later
            else:
                continue
            return PeerLoss(peer, what, max(0.0, ago), connection_error,
                            self.config.restart_job_on_worker_restart)
        return None

    def _restart_worker(self, replica: str, cause: Cause, now: float) -> list[Command]:
        if self.config.restart_job_on_worker_restart:
            return self._stop_all(_AfterStop("restart_all", reason=f"restart all after {replica}",
                                             replica=replica, cause=cause), now)
        return [self._start(replica, now, new_vm=new_vm_after(cause))]

    def _start(self, replica: str, now: float, *, first: bool = False,
               new_vm: bool = True) -> StartWorker:
        att = self.attempts[-1]
        att.replicas[replica].status = STARTING
        if not first:
            self._restarts_in_job[replica] += 1
            self._event(now, EventKind.RESTARTING, f"{replica}: restarting "
                        f"(restart {self._restarts_in_job[replica]} in this job)",
                        replica=replica)
        return StartWorker(replica, att.number, self._restarts_in_job[replica], new_vm)

    def _new_attempt(self, now: float) -> list[Command]:
        number = len(self.attempts) + 1
        self.attempts.append(AttemptRecord(number, now,
                                           {r: ReplicaRecord() for r in self.config.replicas}))
        self._set_state(JobState.PENDING, now)
        return [self._start(r, now, first=number == 1) for r in self.config.replicas]

    def _stop_all(self, after: _AfterStop, now: float) -> list[Command]:
        current = self._after_stop
        # A terminal decision overrides a retry in progress; the first terminal one stands.
        if current is not None and (current.kind == "terminal" or after.kind != "terminal"):
            return []
        self._after_stop = after
        att = self.attempt
        to_stop = []
        if att is not None:
            for name, rec in att.replicas.items():
                if rec.status == STARTING:       # never started: nothing to stop
                    rec.status = STOPPED
                elif rec.status == RUNNING:
                    rec.status = STOPPING
                    to_stop.append(name)
                elif rec.status == STOPPING:
                    to_stop.append(name)
        cmds: list[Command] = []
        if to_stop:
            self._event(now, EventKind.STOPPING, f"stopping {', '.join(to_stop)} "
                        f"({after.reason})", detail=after.reason)
            cmds.append(StopWorkers(tuple(to_stop), after.reason))
        return cmds + self._maybe_finish_stop(now)

    def _maybe_finish_stop(self, now: float) -> list[Command]:
        after = self._after_stop
        att = self.attempt
        if after is None or (att is not None
                             and any(r.status == STOPPING for r in att.replicas.values())):
            return []
        self._after_stop = None
        if after.kind == "restart_all":
            assert att is not None
            # A worker that finished (exit 0) is never restarted; the others are restarted
            # with the one that failed, on its budget.
            again = [name for name, r in att.replicas.items() if r.status != DONE]
            for name in again:
                if name != after.replica:
                    att.replicas[name].uncounted_restarts += 1
                    att.replicas[name].peer_restarts += 1
            # The peers are restarted on their own VMs; the one that failed where its
            # cause puts it.
            return [self._start(name, now, new_vm=name == after.replica and after.cause
                                is not None and new_vm_after(after.cause)) for name in again]
        if att is not None:
            att.end_time = now
            att.result = after.reason
        if after.kind == "retry":
            # Decided before any attempt (a stockout at the quota stage): ask for the quota again.
            return self._new_attempt(now) if att is not None else [RequestCapacity()]
        if after.kind == "requeue":
            self._waiting_since = now
            self._stockout_waiting = True
            self._set_state(JobState.QUEUED, now)
            return [RequestCapacity()]
        assert after.state is not None
        self.error = after.error
        return self._finish(after.state, now)

    def _finish(self, state: JobState, now: float) -> list[Command]:
        self.end_time = now
        self._waiting_since = None
        self._set_state(state, now)
        if self.error is not None:
            self._event(now, EventKind.ERROR, f"job {self.config.name}: error "
                        f"{self.error.code}: {first_line(self.error.message, limit=1000)}",
                        code=self.error.code)
        return [ReleaseCapacity()]

    # --- bookkeeping ------------------------------------------------------------------

    def _set_state(self, state: JobState, now: float) -> None:
        if state is self.state:
            return
        self.state = state
        self._event(now, EventKind.STATE, f"job {self.config.name}: {state.value}",
                    state=state.value)

    def _event(self, now: float, kind: EventKind, message: str, **fields: Any) -> Event:
        """Record one event of this job (``fields``: Event fields; an unknown one is a
        TypeError), stamped with its time and attempt."""
        self.update_time = now
        att = self.attempts[-1].number if self.attempts else None
        event = Event(kind, now, round(now - self.create_time, 3), message, att, **fields)
        self.events.append(event)
        log.debug("%s", message)
        return event

    def to_record(self) -> dict[str, Any]:
        """The job record, shaped like the platform's CustomJob."""
        return {
            "name": self.config.name,
            "state": self.state.value,
            "create_time": iso(self.create_time),
            "start_time": iso(self.start_time),
            "end_time": iso(self.end_time),
            "update_time": iso(self.update_time),
            "error": self.error.to_json() if self.error else None,
            "exit_status": self.exit_status,
            "replicas": list(self.config.replicas),
            "scheduling": {
                "strategy": self.config.strategy.value,
                "restart_job_on_worker_restart": self.config.restart_job_on_worker_restart,
                "timeout_s": self.config.timeout,
                "max_wait_duration_s": self.config.max_wait,
            },
            "budgets": self.budget_summary(),
            "attempts": [a.to_json() for a in self.attempts],
            "events": [e.to_json() for e in self.events],
        }
