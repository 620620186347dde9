"""The launcher's parts, one at a time, without processes: the one path from an exit to the
job machine, the typed fault events, and the narrow interface (``poll``, ``wake``) each part
offers the supervision loop. Pure and fast: no worker is started, no signal reaches a
real process (``signal_tree`` is replaced where a stall would send one)."""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from resilient_train.launcher import faults as faults_mod
from resilient_train.launcher.capacity import CapacityLease
from resilient_train.launcher.chaos import ChaosSchedule, FaultKind, parse_chaos
from resilient_train.launcher.exits import ProcessExit
from resilient_train.launcher.faults import Faults
from resilient_train.launcher.job import JobConfig, JobMachine, StopWorkers
from resilient_train.launcher.jobrecord import job_spec, launcher_alive
from resilient_train.launcher.memory import MemoryLimit
from resilient_train.launcher.messages import JobState
from resilient_train.launcher.quota import Capacity, LocalQuota, Request
from resilient_train.launcher.runner import Launcher, LaunchOptions
from resilient_train.launcher.workerenv import JobEnv, replicas_for, worker_env
from resilient_train.observe.events import EventKind
from resilient_train.observe.telemetry import FAILURES_ENV
from resilient_train.platform.programs import PoolProgram
from resilient_train.platform.resources import process_start_time
from resilient_train.platform.rules import Cause

T0 = 1_700_000_000.0
PRIMARY, W1 = "workerpool0-0", "workerpool1-0"


def running_machine(replicas: tuple[str, ...] = (PRIMARY, W1)) -> JobMachine:
    """A job machine whose replicas all started: the job is RUNNING at T0."""
    m = JobMachine(JobConfig(name="parts", replicas=replicas), T0)
    m.start(T0)
    m.quota_granted(T0)
    for name in replicas:
        m.worker_started(name, T0)
    assert m.state is JobState.RUNNING
    return m


class Notes:
    """The launcher's ``note``, recorded (and passed on to a machine when given one)."""

    def __init__(self, machine: JobMachine | None = None) -> None:
        self.machine = machine
        self.calls: list[tuple[EventKind, str, dict[str, Any]]] = []

    def __call__(self, kind: EventKind, message: str, **fields: Any) -> None:
        self.calls.append((kind, message, fields))
        if self.machine is not None:
            self.machine.note(T0, kind, message, **fields)


def fake_worker(name: str) -> Any:
    """What Faults reads of a worker; its pid is this test's own, never signalled (the
    stall's signal_tree is replaced)."""
    return SimpleNamespace(replica=SimpleNamespace(name=name), injected=None, kill_at=None,
                           popen=SimpleNamespace(pid=os.getpid()), tree=[], attempt=1,
                           restart=0, snapshot_tree=lambda: None)


# --------------------------------------------------------------------------- chaos kinds

def test_each_fault_kind_names_the_cause_the_policy_sees() -> None:
    assert {k: k.cause for k in FaultKind} == {
        FaultKind.KILL: Cause.NODE_LOSS, FaultKind.MAINTENANCE: Cause.MAINTENANCE,
        FaultKind.PREEMPT: Cause.PREEMPTION, FaultKind.OOM: Cause.OOM,
        FaultKind.STOCKOUT: Cause.STOCKOUT, FaultKind.INTERNAL: Cause.INTERNAL,
        FaultKind.HANG: None, FaultKind.SLOW: None, FaultKind.WIPE: None,
        FaultKind.CORRUPT: None}


# --------------------------------------------------------------------------- one exit path

@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    """A launcher that is never run: its job machine is driven by hand."""
    now = [T0]
    launcher = Launcher(LaunchOptions(
        command=(sys.executable, "-c", "pass"), job_dir=tmp_path / "job", job_name="parts",
        pools=(("workerpool0", 1), ("workerpool1", 1)), quota_dir=tmp_path / "quota",
        env={"RESILIENT_TRAIN_GPUS": "none", "RESILIENT_TRAIN_CPU_SLOTS": "4"},
        shared_workdir=True), clock=lambda: now[0])
    m = launcher.machine
    m.start(T0)
    m.quota_granted(T0)
    for name in (PRIMARY, W1):
        m.worker_started(name, T0)
    try:
        yield launcher
    finally:
        launcher.machines.close()
        os.close(launcher._wake_r)
        os.close(launcher._wake_w)


def test_a_kill_from_outside_is_a_typed_fault_then_a_node_loss(launcher: Launcher) -> None:
    cmds = launcher._exited(ProcessExit(W1, T0 + 1, -signal.SIGKILL, step=12), None)
    fault, exited = [e for e in launcher.machine.events
                     if e.kind in (EventKind.FAULT, EventKind.EXITED)]
    assert fault.message == f"{W1}: killed by SIGKILL from outside the launcher: a node loss"
    assert (fault.replica, fault.fault, fault.cause, fault.injected, fault.step,
            fault.counts_as_failure) == (W1, "kill", "node_loss", False, 12, True)
    assert (exited.replica, exited.exit_code, exited.cause) == (W1, 137, "node_loss")
    assert [type(c).__name__ for c in cmds] == ["StartWorker"]   # restarted in place
    assert launcher.machine.failures() == 1   # the fault counts, not its exit again


def test_what_the_launcher_did_itself_is_no_observed_fault(launcher: Launcher) -> None:
    launcher._exited(ProcessExit(W1, T0 + 1, -signal.SIGKILL, injected=Cause.OOM), None)
    assert not [e for e in launcher.machine.events if e.kind is EventKind.FAULT]
    [exited] = [e for e in launcher.machine.events if e.kind is EventKind.EXITED]
    assert (exited.exit_code, exited.cause) == (137, "oom")


def test_a_command_that_cannot_start_exits_128(launcher: Launcher) -> None:
    msg = "cannot start 'nope': No such file or directory"
    launcher._exited(ProcessExit(W1, T0 + 1, None, start_error=msg), msg)
    [exited] = [e for e in launcher.machine.events if e.kind is EventKind.EXITED]
    assert (exited.exit_code, exited.cause) == (128, "start_error")
    [decision] = [e for e in launcher.machine.events if e.kind is EventKind.DECISION]
    assert decision.action == "fail_job"   # permanent: the others are stopped


def test_a_crash_of_the_user_s_code_is_its_exit_and_a_failure(launcher: Launcher) -> None:
    tail = ["[rank1]: RuntimeError: Connection reset by peer"]
    launcher._exited(ProcessExit(W1, T0 + 1, 1), "RuntimeError: ...", tail)
    [exited] = [e for e in launcher.machine.events if e.kind is EventKind.EXITED]
    assert (exited.exit_code, exited.cause, exited.counts_as_failure) == (1, "exit", True)


# --------------------------------------------------------------------------- faults

def faults_for(spec: str, machine: JobMachine, workers: dict[str, Any],
               tmp_path: Path) -> tuple[Faults, Notes, list[Any]]:
    notes, executed = Notes(machine), []
    schedule = ChaosSchedule(parse_chaos(spec), list(machine.config.replicas))
    part = Faults(schedule, machine, workers, primary=PRIMARY, job_dir=tmp_path, grace=10.0,
                  no_step_warning_s=60.0, note=notes, execute=executed.extend,
                  node_local=lambda name: tmp_path / "machines" / name / "local")
    return part, notes, executed


def test_a_whole_job_fault_is_a_typed_failure_and_retries_the_attempt(tmp_path: Path) -> None:
    m = running_machine()
    part, notes, executed = faults_for("stockout@2s", m, {}, tmp_path)
    assert part.wake(T0) == pytest.approx(2.0)   # the loop sleeps until it is due
    part.poll(T0 + 1)
    assert notes.calls == []
    part.poll(T0 + 2)
    [(kind, message, fields)] = notes.calls
    assert (kind, message) == (EventKind.FAULT, "chaos: stockout (whole job) at 2.0 s")
    assert fields == {"fault": "stockout", "cause": "stockout", "injected": True,
                      "step": None, "counts_as_failure": True, "detail": "whole job"}
    assert [type(c) for c in executed] == [StopWorkers]
    assert part.wake(T0 + 2) is None and part.unfired() == []


def test_a_kill_hits_its_target_and_waits_while_it_is_between_lives(
        tmp_path: Path) -> None:
    m = running_machine()
    workers: dict[str, Any] = {}
    part, notes, _ = faults_for("kill:1@1s", m, workers, tmp_path)
    part.poll(T0 + 1)                      # no live W1: the fault waits for its next life
    assert notes.calls == [] and part.wake(T0 + 1) == 0.25
    w = fake_worker(W1)
    ended: list[Cause] = []
    w.end = ended.append
    workers[W1] = w
    part.poll(T0 + 1.5)
    [(kind, message, fields)] = notes.calls
    assert (kind, message) == (EventKind.FAULT, f"chaos: kill on {W1}")
    assert (fields["replica"], fields["cause"], fields["counts_as_failure"]) == (
        W1, "node_loss", True)
    assert ended == [Cause.NODE_LOSS]


def test_a_hang_counts_as_a_failure_and_a_slow_down_does_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(faults_mod, "signal_tree",
                        lambda pid, tree, sig: sent.append((pid, sig)))
    m = running_machine()
    workers = {PRIMARY: fake_worker(PRIMARY), W1: fake_worker(W1)}
    part, notes, _ = faults_for("hang:1@1s+2s,slow:0@1s+3s*0.5", m, workers, tmp_path)
    part.poll(T0 + 1)
    begun = {fields["fault"]: (kind, fields["counts_as_failure"])
             for kind, _, fields in notes.calls}
    assert begun == {"hang": (EventKind.FAULT, True), "slow": (EventKind.FAULT, False)}
    assert (os.getpid(), signal.SIGSTOP) in sent   # both stopped now
    part.poll(T0 + 3)                               # the hang's 2 s are over
    kind, message, fields = notes.calls[-1]
    assert (kind, message) == (EventKind.FAULT_OVER, f"chaos: {W1} resumed after 2.0 s")
    assert fields == {"replica": W1, "fault": "hang", "duration_s": 2.0}
    assert sum(e.counts_as_failure for e in m.events) == 1


def test_step_faults_make_the_loop_look_often(tmp_path: Path) -> None:
    m = running_machine()
    part, _, _ = faults_for("kill:1@step5", m, {}, tmp_path)
    assert part.wake(T0) == 0.05
    waiting = JobMachine(JobConfig(name="q", replicas=(PRIMARY,)), T0)   # never RUNNING
    part, _, _ = faults_for("kill:0@step5", waiting, {}, tmp_path)
    assert part.wake(T0) is None


# --------------------------------------------------------------------------- capacity, memory

def test_each_replica_s_gpus_follow_those_before_it(tmp_path: Path) -> None:
    quota = LocalQuota(tmp_path, Capacity(gpu_ids=(0, 1, 2, 3), cpu_slots=4))
    m = JobMachine(JobConfig(name="gpus", replicas=(PRIMARY, W1)), T0)
    lease = CapacityLease(quota, Request(gpus=3), "gpus", m, lambda line: None, list)
    assert lease.wake(T0) is None
    [cmd] = m.start(T0)
    assert [type(c).__name__ for c in lease.ask(T0)] == ["StartWorker", "StartWorker"]
    assert lease.lease is not None and not lease.wanted
    assert lease.gpu_ids(0, 1) == (0,) and lease.gpu_ids(1, 2) == (1, 2)
    assert lease.gpu_ids(3, 0) == ()   # no accelerators asked: it sees none
    lease.release()
    assert lease.lease is None and quota.usage() == []


def test_a_job_that_waits_for_the_quota_says_so_once(tmp_path: Path) -> None:
    quota = LocalQuota(tmp_path, Capacity(gpu_ids=(0,), cpu_slots=1))
    other = quota.try_acquire("other", Request(gpus=1))
    assert other is not None
    m = JobMachine(JobConfig(name="waits", replicas=(PRIMARY,)), T0)
    lines: list[str] = []
    lease = CapacityLease(quota, Request(gpus=1), "waits", m, lines.append, list)
    m.start(T0)
    assert lease.ask(T0) == [] and lease.wanted and lease.wake(T0) == 0.25
    lease.poll(T0 + 1)
    assert lines == ["[launcher] queued: the quota is in use by other (1 GPUs, 0 slots)"]
    quota.release(other)
    lease.poll(T0 + 2)
    assert lease.lease is not None and not lease.wanted and m.state is JobState.PENDING


def test_without_a_memory_limit_nothing_is_measured() -> None:
    notes = Notes()
    part = MemoryLimit({"workerpool0": None}, {PRIMARY: fake_worker(PRIMARY)}, notes, 0.1)
    assert not part.active and part.wake(T0) is None
    part.poll(T0)
    assert notes.calls == []
    limited = MemoryLimit({"workerpool0": 1 << 30}, {}, notes, 0.1)
    assert limited.active and limited.wake(T0) is None   # no worker: nothing to poll
    assert MemoryLimit({"workerpool0": 1 << 30}, {PRIMARY: object()}, notes,
                       0.1).wake(T0) == 0.1


# --------------------------------------------------------------------------- record, env

def test_the_job_spec_masks_secrets_and_lists_every_pool() -> None:
    programs = {"workerpool0": PoolProgram("workerpool0", ("train", "--token=abc"), {}, None, 0)}
    spec = job_spec((("workerpool0", 1),), (("workerpool2", 1),), programs, "/out", 1234)
    assert spec["command"] == ["train", "--token=***"]
    assert [p["pool"] for p in spec["worker_pool_specs"]] == ["workerpool0", "workerpool2"]
    assert spec["worker_pool_specs"][1]["listed_only"] is True


def test_launcher_alive_tells_this_process_from_a_reused_pid() -> None:
    me = {"host": socket.gethostname(), "pid": os.getpid(),
          "started": process_start_time(os.getpid())}
    assert launcher_alive({"launcher": me}) is True
    assert launcher_alive({"launcher": {**me, "started": me["started"] - 100}}) is False
    assert launcher_alive({"launcher": {**me, "host": "elsewhere"}}) is None
    assert process_start_time(2**22 + 12345) is None


def test_workers_learn_the_mtbf_from_the_failure_log_only() -> None:
    replicas = replicas_for((("workerpool0", 1), ("workerpool1", 2)))
    assert [r.name for r in replicas] == [PRIMARY, W1, "workerpool1-1"]
    job = JobEnv(job_id="j", replicas=replicas, master_addr="127.0.0.1", master_port=1234,
                 output_base="/out", job_dir="/job")
    env = worker_env(job, replicas[1], attempt=1, restart=2, error_file="e", gpu_ids=None,
                     base={}, failures_file="/job/telemetry/failures.json")
    assert env[FAILURES_ENV] == "/job/telemetry/failures.json"
    assert "RESILIENT_TRAIN_OBSERVED_MTBF_S" not in env
