"""The record's ``recoveries``: from the restore events every worker life writes to its
telemetry, through job.json (kept current while the job runs), ``status`` and ``report``.

The job is a real :class:`JobMachine` driven with known times and a real
:class:`JobRecord`; the telemetry files are written as ``Telemetry`` writes them (event
lines in ``PREFIX.jsonl``, a killed life's open segment in ``PREFIX.progress``), in a job
directory laid out by ``record.telemetry_prefix``.
"""

from __future__ import annotations

import json
import re
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from resilient_train.cli.main import main
from resilient_train.launcher import jobrecord
from resilient_train.launcher.job import JobConfig, JobMachine, StartWorker
from resilient_train.launcher.jobrecord import JobRecord
from resilient_train.observe import telemetry as tel
from resilient_train.observe.events import Event, EventKind, iso
from resilient_train.observe.jobdir import (
    TelemetryLife,
    describe_recovery,
    job_recoveries,
    rank_names,
    read_job,
    telemetry_lives,
    telemetry_prefix,
)
from resilient_train.observe.report import write_report
from resilient_train.observe.telemetry import LifeReader, LifeTelemetry, Restore, read_life
from resilient_train.platform.rules import Cause

P0, P1, P2 = "workerpool0-0", "workerpool1-0", "workerpool1-1"
MIB = 1 << 20
# Whole seconds: exact in the record's millisecond ISO times.
T0 = float(int(time.time()) - 100)


# --- writing telemetry as a worker life does ------------------------------------------------

def _line(prefix: Path, kind: str, t: float, **fields: Any) -> None:
    """One event line, as ``Telemetry.event`` appends it."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{prefix}.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"kind": kind, "t": t, **fields}) + "\n")


def _restore(prefix: Path, t: float, step: int, source: str, generation: int, *,
             from_rank: int | None = None, seconds: float = 0.1,
             read: dict[str, int] | None = None, reason: str = "") -> None:
    """A restore event; the rank is the replica's place, one process per replica."""
    rank = [P0, P1, P2].index(prefix.name.split(".")[0])
    _line(prefix, "restore", t, step=step, source=source, from_rank=from_rank,
          generation=generation, seconds=seconds,
          bytes_read={"peer": 0, "node-local": 0, "persistent": 0, **(read or {})},
          reason=reason, rank=rank)


def _segment(prefix: Path, first: int, last: int, t0: float, t1: float) -> None:
    """A segment closed at an in-process re-forming (or at the life's end)."""
    _line(prefix, "segment", t1, first_step=first, last_step=last, t_start=t0,
          t_first=t0 + 0.1, t_last=t1, blocking_s=0.0)


def _open_segment(prefix: Path, first: int, last: int, t0: float, t1: float) -> None:
    """The segment a SIGKILLed life left in its memory-mapped progress record."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    record = tel._RECORD.pack(tel._MAGIC, first, t0, t0 + 0.1, 0.0, last, t1)
    Path(f"{prefix}.progress").write_bytes(record)


# --- the job ---------------------------------------------------------------------------------

class Job:
    """A 3-replica job: a JobMachine at known times, its JobRecord, its telemetry."""

    def __init__(self, job_dir: Path) -> None:
        self.dir = job_dir
        job_dir.mkdir(parents=True, exist_ok=True)
        self.machine = JobMachine(JobConfig("rec", (P0, P1, P2)), T0)
        self.echoed: list[str] = []
        self.record = JobRecord(job_dir, self.machine, {"command": ["python", "t.py"]}, P0,
                                self.echoed.append, chaos=False, unfired=list,
                                exit_status=lambda: self.machine.exit_status)
        self.restarts: dict[str, int] = {}

    def at(self, dt: float) -> float:
        return T0 + dt

    def prefix(self, replica: str, attempt: int = 1) -> Path:
        return telemetry_prefix(self.dir, attempt, replica, self.restarts.get(replica, 0))

    def execute(self, commands: list[Any], dt: float) -> None:
        """The runner's part: each StartWorker starts at ``dt``."""
        for cmd in commands:
            if isinstance(cmd, StartWorker):
                self.restarts[cmd.replica] = cmd.restart
                self.machine.worker_started(cmd.replica, self.at(dt))

    def json(self) -> dict[str, Any]:
        return read_job(self.dir)


def _start(job: Job) -> None:
    """Attempt 1: every rank starts afresh (generation 0, nothing to restore) and trains."""
    job.machine.start(job.at(0.0))
    job.execute(job.machine.quota_granted(job.at(0.01)), 0.02)
    for i, r in enumerate((P0, P1, P2)):
        _restore(job.prefix(r), job.at(1.0 + i / 10), 0, "none", 0, seconds=0.0)


def _kill_p2(job: Job) -> None:
    """P2 is killed at step 86 (10 s); the survivors re-form at generation 1 and every rank
    restores step 80: the survivors from their own memory, P2 (restarted) from P1."""
    _segment(job.prefix(P0), 0, 85, job.at(1.5), job.at(9.9))
    _segment(job.prefix(P1), 0, 85, job.at(1.5), job.at(9.9))
    _open_segment(job.prefix(P2), 0, 86, job.at(1.5), job.at(9.95))
    job.machine.note(job.at(10.0), EventKind.FAULT, f"chaos: kill on {P2} at step 86",
                     replica=P2, fault="kill", cause="node_loss", injected=True, step=86,
                     counts_as_failure=True)
    job.execute(job.machine.worker_exited(P2, 137, Cause.NODE_LOSS, job.at(10.01)), 10.1)
    _restore(job.prefix(P0), job.at(10.5), 80, "peer", 1, seconds=0.05)
    _restore(job.prefix(P1), job.at(10.55), 80, "peer", 1, seconds=0.06)
    _restore(job.prefix(P2), job.at(10.9), 80, "peer", 1, from_rank=1, seconds=0.84,
             read={"peer": 5 * MIB})


def _retry(job: Job) -> None:
    """At 20 s an internal error retries the whole job: attempt 2 restores step 140 at
    generation 0, two ranks from the node-local tier, P2 from the persistent one."""
    for r in (P0, P1, P2):
        _segment(job.prefix(r), 80, 150, job.at(11.0), job.at(19.9))
    job.execute(job.machine.job_fault(Cause.INTERNAL, job.at(20.0)), 20.0)
    for r in (P0, P1, P2):
        job.execute(job.machine.worker_exited(r, 143, Cause.EXIT, job.at(20.1)), 20.2)
    _restore(job.prefix(P0, 2), job.at(22.0), 140, "node-local", 0, seconds=0.3,
             read={"node-local": 3 * MIB})
    _restore(job.prefix(P1, 2), job.at(22.1), 140, "node-local", 0, seconds=0.4,
             read={"node-local": 3 * MIB})
    _restore(job.prefix(P2, 2), job.at(22.2), 140, "persistent", 0, seconds=1.5,
             read={"persistent": 12 * MIB}, reason="no node-local copy: a new VM")


def _finish(job: Job) -> None:
    for r in (P0, P1, P2):
        _segment(job.prefix(r, 2), 140, 200, job.at(23.0), job.at(30.0))
    job.execute(job.machine.worker_exited(P0, 0, Cause.EXIT, job.at(30.5)), 30.5)
    for r in (P1, P2):
        job.execute(job.machine.worker_exited(r, 0, Cause.EXIT, job.at(30.6)), 30.6)


@pytest.fixture
def finished(tmp_path: Path) -> Job:
    job = Job(tmp_path / "rt-jobs" / "rec")
    _start(job)
    _kill_p2(job)
    _retry(job)
    _finish(job)
    job.record.flush(force=True)
    assert job.machine.state.value == "JOB_STATE_SUCCEEDED"
    return job


# --- job.json ----------------------------------------------------------------------------------

def test_each_recovery_is_one_entry_and_the_first_start_is_none(finished: Job) -> None:
    recs = finished.json()["recoveries"]
    assert [(r["attempt"], r["generation"]) for r in recs] == [(1, 1), (2, 0)]

    peer = recs[0]
    assert peer["at"] == iso(T0 + 10.5)
    assert peer["step"] == 80
    assert peer["steps_lost"] == 6          # the killed worker had reached 86
    assert peer["seconds"] == 0.84          # the slowest rank
    assert peer["bytes_read"] == {"peer": 5 * MIB, "node-local": 0, "persistent": 0}
    assert [r["replica"] for r in peer["ranks"]] == [P0, P1, P2]     # rank order
    assert peer["ranks"][2] == {"replica": P2, "rank": 2, "source": "peer", "from_rank": 1,
                                "step": 80,
                                "bytes_read": {"peer": 5 * MIB, "node-local": 0,
                                               "persistent": 0},
                                "seconds": 0.84, "reason": ""}
    assert peer["ranks"][0]["from_rank"] is None
    fault = peer["fault"]
    assert fault["replica"] == P2 and fault["cause"] == "node_loss"
    assert fault["exit_code"] == 137 and fault["action"] == "restart_worker"
    assert fault["time"] == iso(T0 + 10.01)


def test_a_job_retry_restore_is_a_recovery_with_the_previous_attempts_loss(finished: Job) -> None:
    retry = finished.json()["recoveries"][1]
    assert retry["at"] == iso(T0 + 22.0)
    assert retry["step"] == 140
    assert retry["steps_lost"] == 10        # attempt 1 had reached 150
    assert retry["seconds"] == 1.5
    assert retry["bytes_read"] == {"peer": 0, "node-local": 6 * MIB, "persistent": 12 * MIB}
    assert [r["source"] for r in retry["ranks"]] == ["node-local", "node-local", "persistent"]
    assert retry["ranks"][2]["reason"] == "no node-local copy: a new VM"
    assert retry["fault"]["replica"] is None
    assert retry["fault"]["cause"] == "internal" and retry["fault"]["action"] == "retry_job"


def test_the_record_follows_restores_while_the_job_runs(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobrecord, "TELEMETRY_CHECK_S", 0.0)
    job = Job(tmp_path / "job")
    _start(job)
    job.record.flush(force=True)
    assert job.json()["recoveries"] == []   # the first start is no recovery
    _kill_p2(job)
    job.record.flush()
    assert [r["generation"] for r in job.json()["recoveries"]] == [1]
    # A restore written with no launcher event after it still reaches job.json.
    _restore(job.prefix(P0), job.at(40.0), 170, "peer", 2, seconds=0.1)
    job.record.flush()
    recs = job.json()["recoveries"]
    assert [(r["generation"], r["step"], r["fault"]) for r in recs[1:]] == [(2, 170, None)]
    assert recs[1]["steps_lost"] is None    # no segment between the two restores


def test_the_record_is_not_rewritten_for_telemetry_that_changes_no_recovery(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobrecord, "TELEMETRY_CHECK_S", 0.0)
    job = Job(tmp_path / "job")
    _start(job)
    job.record.flush(force=True)
    (job.dir / "job.json").unlink()
    _line(job.prefix(P0), "save", job.at(5.0), step=40, blocking_s=0.01)
    _segment(job.prefix(P0), 0, 40, job.at(1.5), job.at(5.0))
    job.record.flush()
    assert not (job.dir / "job.json").exists(), "rewritten for a save and a segment"


def test_telemetry_is_looked_at_no_more_often_than_the_interval(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = Job(tmp_path / "job")
    _start(job)
    job.record.flush(force=True)
    _kill_p2(job)
    job.record.flush(force=True)                 # events: looked at at once
    _restore(job.prefix(P0), job.at(40.0), 170, "peer", 2)
    monkeypatch.setattr(jobrecord, "TELEMETRY_CHECK_S", 3600.0)
    job.record.flush()
    assert len(job.json()["recoveries"]) == 1    # not yet: checked a moment ago
    monkeypatch.setattr(jobrecord, "TELEMETRY_CHECK_S", 0.0)
    job.record.flush()
    assert len(job.json()["recoveries"]) == 2


def _event(kind: EventKind, t: float, attempt: int = 1, **fields: Any) -> Event:
    """An event of the launcher's ``t`` seconds into the job."""
    return Event(kind, T0 + t, t, f"{kind.value} {fields}", attempt, **fields)


def test_two_faults_before_the_first_restore_are_put_down_to_one_recovery_each() -> None:
    events = [
        _event(EventKind.EXITED, 10.0, replica=P1, exit_code=137, cause="node_loss"),
        _event(EventKind.DECISION, 10.0, replica=P1, action="restart_worker", cause="node_loss"),
        _event(EventKind.EXITED, 10.2, replica=P2, exit_code=143, cause="preemption"),
        _event(EventKind.DECISION, 10.2, replica=P2, action="restart_worker", cause="preemption"),
    ]

    def life(replica: str, restart: int, *restores: tuple[float, int]) -> tuple[
            TelemetryLife, LifeTelemetry]:
        return (TelemetryLife(1, replica, restart, Path(replica)),
                LifeTelemetry((), (), tuple(
                    Restore(T0 + t, 80 if g else 0, "peer" if g else "none", None, g, 0.1,
                            (), "") for t, g in restores)))

    lives = [life(P0, 0, (1.0, 0), (10.5, 1), (11.0, 2)),
             life(P1, 1, (10.6, 1), (11.1, 2)),
             life(P2, 1, (11.2, 2))]
    recs = job_recoveries(lives, events, [P0, P1, P2])
    assert [(r["generation"], r["fault"]["replica"]) for r in recs] == [(1, P1), (2, P2)]
    assert recs[1]["ranks"][2]["replica"] == P2


def test_two_workers_lost_together_are_one_recovery_with_both_causes() -> None:
    """Four workers; two lost at once, both rejoin generation 1; later two more, both
    rejoin generation 2. The second of the first pair was once put down to generation 2,
    and generation 2's own faults to nothing."""
    p3 = "workerpool1-2"
    events = [e for t, r in ((10.0, P1), (10.1, p3), (20.0, P2), (20.1, P1)) for e in (
        _event(EventKind.EXITED, t, replica=r, exit_code=137, cause="node_loss"),
        _event(EventKind.DECISION, t, replica=r, action="restart_worker", cause="node_loss"))]

    def life(replica: str, restart: int, *restores: tuple[float, int]) -> tuple[
            TelemetryLife, LifeTelemetry]:
        return (TelemetryLife(1, replica, restart, Path(f"{replica}.{restart}")),
                LifeTelemetry((), (), tuple(
                    Restore(T0 + t, 30 * g, "peer" if g else "none", None, g, 0.1, (), "")
                    for t, g in restores)))

    lives = [life(P0, 0, (1.0, 0), (12.0, 1), (22.0, 2)),
             life(P1, 0, (1.0, 0)), life(P1, 1, (12.1, 1)), life(P1, 2, (22.3, 2)),
             life(P2, 0, (1.0, 0), (12.2, 1)), life(P2, 1, (22.1, 2)),
             life(p3, 0, (1.0, 0)), life(p3, 1, (12.3, 1), (22.2, 2))]
    recs = job_recoveries(lives, events, [P0, P1, P2, p3])
    assert [(r["generation"], [f["replica"] for f in r["faults"]], r["fault"]["replica"])
            for r in recs] == [(1, [P1, p3], P1), (2, [P2, P1], P2)], recs
    assert [f["exit_code"] for f in recs[1]["faults"]] == [137, 137]
    assert ("after workerpool1-1 node_loss (exit 137) and workerpool1-0 node_loss (exit 137)"
            in describe_recovery(2, recs[1]))


def test_a_job_retry_is_the_cause_of_the_next_attempts_recovery() -> None:
    """The primary exits 134 (a retry); before the retry stops it, the other worker
    re-forms on its own in the old attempt. The retry caused the next attempt's restore."""
    events = [_event(EventKind.EXITED, 10.0, replica=P0, exit_code=134, cause="exit"),
              _event(EventKind.DECISION, 10.0, replica=P0, action="retry_job", cause="exit")]

    def life(attempt: int, replica: str, *restores: tuple[float, int, int]) -> tuple[
            TelemetryLife, LifeTelemetry]:
        return (TelemetryLife(attempt, replica, 0, Path(f"{attempt}.{replica}")),
                LifeTelemetry((), (), tuple(
                    Restore(T0 + t, step, "persistent" if step else "none", None, g, 0.1,
                            (), "") for t, g, step in restores)))

    lives = [life(1, P0, (1.0, 0, 0)), life(1, P1, (1.0, 0, 0), (10.4, 1, 20)),
             life(2, P0, (14.0, 0, 20)), life(2, P1, (14.1, 0, 20))]
    recs = job_recoveries(lives, events, [P0, P1])
    assert [(r["attempt"], r["generation"], [f["action"] for f in r["faults"]])
            for r in recs] == [(1, 1, []), (2, 0, ["retry_job"])], recs
    assert describe_recovery(1, recs[0]).split(": step")[0].endswith("no fault recorded")


def test_lives_that_all_start_afresh_are_one_recovery_each() -> None:
    """A single worker restarted twice, or every worker under restartJobOnWorkerRestart:
    each new life starts at generation 0 of the same attempt. Keyed by (attempt,
    generation) alone, both restarts and the first start were one group, and the record
    showed one recovery: the last."""
    def life(replica: str, restart: int, t: float, step: int) -> tuple[
            TelemetryLife, LifeTelemetry]:
        source = "persistent" if step else "none"
        return (TelemetryLife(1, replica, restart, Path(f"{replica}.{restart}")),
                LifeTelemetry((), (), (Restore(T0 + t, step, source, None, 0, 0.1, (), "",
                                               rank=[P0, P1].index(replica)),)))

    events = [e for t in (10.0, 20.0) for e in (
        _event(EventKind.EXITED, t, replica=P0, exit_code=137, cause="node_loss"),
        _event(EventKind.DECISION, t, replica=P0, action="restart_worker", cause="node_loss"))]
    alone = job_recoveries([life(P0, 0, 1.0, 0), life(P0, 1, 11.0, 40), life(P0, 2, 21.0, 90)],
                           events, [P0])
    assert [(r["generation"], r["step"]) for r in alone] == [(0, 40), (0, 90)], alone
    both = job_recoveries([life(r, n, t + i / 10, s) for n, t, s in ((0, 1.0, 0), (1, 11.0, 40),
                                                                    (2, 21.0, 90))
                           for i, r in enumerate((P0, P1))], events, [P0, P1])
    assert [(r["step"], [x["replica"] for x in r["ranks"]]) for r in both] == [
        (40, [P0, P1]), (90, [P0, P1])], both


def test_a_first_start_that_restores_is_listed() -> None:
    """Generation 0 of the first attempt is left out only when every rank started afresh:
    a job launched over checkpoints it finds restores, and that is shown."""
    lives = [(TelemetryLife(1, P0, 0, Path("p")),
              LifeTelemetry((), (), (Restore(T0, 500, "persistent", None, 0, 2.0,
                                             (("persistent", MIB),), ""),)))]
    [rec] = job_recoveries(lives, [], [P0])
    assert (rec["attempt"], rec["generation"], rec["step"], rec["fault"]) == (1, 0, 500, None)


def test_a_first_start_whose_forming_failed_once_is_no_recovery() -> None:
    """Under load a member may not connect the mesh within form_timeout_s: the ranks give
    generation 0 up and form generation 1 (distributed/group.py), and the job's first start
    restores there, every rank afresh. It was listed as a recovery (no fault, step 0); a
    later re-forming is, as ever."""
    events = [_event(EventKind.EXITED, 10.0, replica=P1, exit_code=137, cause="node_loss"),
              _event(EventKind.DECISION, 10.0, replica=P1, action="restart_worker",
                     cause="node_loss")]

    def life(replica: str, restart: int, *restores: tuple[float, int, int]) -> tuple[
            TelemetryLife, LifeTelemetry]:
        return (TelemetryLife(1, replica, restart, Path(f"{replica}.{restart}")),
                LifeTelemetry((), (), tuple(
                    Restore(T0 + t, step, "peer" if step else "none", None, g, 0.1, (), "")
                    for t, g, step in restores)))

    lives = [life(P0, 0, (1.0, 1, 0), (12.0, 2, 30)), life(P1, 0, (1.1, 1, 0)),
             life(P1, 1, (12.1, 2, 30))]
    recs = job_recoveries(lives, events, [P0, P1])
    assert [(r["attempt"], r["generation"], r["step"], r["fault"]["replica"])
            for r in recs] == [(1, 2, 30, P1)], recs


def test_each_process_of_a_replica_is_its_own_rank_in_the_recovery(tmp_path: Path) -> None:
    """torchrun's processes on one machine share the replica's telemetry file: each of
    their restores is a rank of the recovery, named by its rank in the report, and the
    replica's two ranks are not taken for one restarted twice."""
    a, b = tmp_path / "attempt-1" / f"{P0}.restart-0", tmp_path / "attempt-1" / f"{P1}.restart-1"
    for rank, prefix, source in ((0, a, "peer"), (1, a, "peer"), (2, b, "peer"),
                                 (3, b, "persistent")):
        _line(prefix, "restore", T0 + 10 + rank / 10, step=80, source=source,
              from_rank=None if prefix == a else rank - 2, generation=1, seconds=0.5,
              bytes_read={"persistent": MIB if source == "persistent" else 0},
              reason="" if source == "peer" else "no survivor holds rank 3's RNG", rank=rank)
    lives = [(TelemetryLife(1, P0, 0, a), read_life(a)), (TelemetryLife(1, P1, 1, b), read_life(b))]
    [rec] = job_recoveries(lives, [], [P0, P1])
    assert [(r["replica"], r["rank"], r["source"]) for r in rec["ranks"]] == [
        (P0, 0, "peer"), (P0, 1, "peer"), (P1, 2, "peer"), (P1, 3, "persistent")]
    assert rec["bytes_read"]["persistent"] == MIB
    assert rank_names(rec) == [f"{P0} rank 0", f"{P0} rank 1", f"{P1} rank 2", f"{P1} rank 3"]
    one_each = {**rec, "ranks": rec["ranks"][1:3]}   # one process per replica: no rank shown
    assert rank_names(one_each) == [P0, P1]


# --- reading the telemetry -------------------------------------------------------------------

def test_read_life_skips_a_cut_line_and_reads_missing_fields_as_nothing_said(
        tmp_path: Path) -> None:
    prefix = tmp_path / "attempt-1" / f"{P0}.restart-0"
    _line(prefix, "restore", T0, step=80, source="peer", generation=1)   # older writer
    _line(prefix, "segment", T0 + 1, first_step=80)                      # a field missing
    with open(f"{prefix}.jsonl", "a", encoding="utf-8") as f:
        f.write('{"kind": "restore", "t": 17000, "step": 9')             # cut by a SIGKILL
    life = read_life(prefix)
    assert life.segments == ()
    assert life.restores == (Restore(T0, 80, "peer", None, 1, None, (), ""),)
    assert life.restores[0].read == {"peer": 0, "node-local": 0, "persistent": 0}


def test_the_reader_parses_only_whole_lines_and_only_once(tmp_path: Path) -> None:
    prefix = tmp_path / f"{P0}.restart-0"
    reader = LifeReader(prefix)
    assert reader.update() is False                      # nothing written yet
    _restore(prefix, T0, 0, "none", 0)
    line = json.dumps({"kind": "restore", "t": T0 + 5, "step": 80, "source": "persistent",
                       "generation": 1})
    with open(f"{prefix}.jsonl", "a", encoding="utf-8") as f:
        f.write(line[:20])                               # a writer mid-line
    assert reader.update() is True
    assert [r.step for r in reader.life().restores] == [0]
    with open(f"{prefix}.jsonl", "a", encoding="utf-8") as f:
        f.write(line[20:] + "\n")
    _line(prefix, "save", T0 + 6, step=90, blocking_s=0.0)
    assert reader.update() is True
    assert [r.step for r in reader.life().restores] == [0, 80]
    assert len(reader.life().saves) == 1
    _line(prefix, "save", T0 + 7, step=100, blocking_s=0.0)
    assert reader.update() is False                      # a save changes no recovery
    assert len(reader.life().saves) == 2


def test_telemetry_lives_names_attempt_replica_and_restart(finished: Job) -> None:
    lives = {(life.attempt, life.replica, life.restart) for life in telemetry_lives(finished.dir)}
    # The restart number counts every restart in the job: the retry's too.
    assert lives == {(1, P0, 0), (1, P1, 0), (1, P2, 0), (1, P2, 1),
                     (2, P0, 1), (2, P1, 1), (2, P2, 2)}


# --- status and report -----------------------------------------------------------------------

def _status(job_dir: Path, capsys: pytest.CaptureFixture[str]) -> list[str]:
    assert main(["status", str(job_dir)]) == 0
    return [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("recovery")]


def test_status_prints_one_line_per_recovery(finished: Job,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    lines = _status(finished.dir, capsys)
    assert lines == [
        (f"recovery 1: attempt 1 gen 1 at +10.5 s after {P2} node_loss (exit 137): step 80 "
         "(lost 6 steps), restore 0.84 s (slowest rank's transfer/read); ranks from peer x3; "
         "read peer 5.0 MiB, node-local 0 B, persistent 0 B"),
        ("recovery 2: attempt 2 gen 0 at +22.0 s after internal (whole job): step 140 "
         "(lost 10 steps), restore 1.50 s (slowest rank's transfer/read); ranks from "
         "node-local x2, persistent x1; read peer 0 B, node-local 6.0 MiB, persistent "
         "12.0 MiB; why not faster: no node-local copy: a new VM"),
    ]


def test_status_says_which_time_a_recovery_line_and_the_goodput_line_give(
        finished: Job, capsys: pytest.CaptureFixture[str]) -> None:
    """A newcomer read "in 0.84 s" on a recovery's line against "recovery 4.2 s" of the
    goodput as a contradiction: the first is the ranks' restore alone, the second all the
    time training stood still (noticing the fault, restarting, re-forming, restoring)."""
    assert main(["status", str(finished.dir)]) == 0
    out = capsys.readouterr().out
    goodput = next(ln for ln in out.splitlines() if ln.startswith("goodput "))
    assert re.search(r", recovery \d+\.\d s \(training stopped, fault to training again\), ",
                     goodput), goodput
    recoveries = [ln for ln in out.splitlines() if ln.startswith("recovery ")]
    assert len(recoveries) == 2
    for line in recoveries:
        assert re.search(r", restore \d+\.\d\d s \(slowest rank's transfer/read\);", line)
        assert " in 0." not in line and " in 1." not in line, line


def test_status_and_report_read_a_record_written_without_recoveries(
        finished: Job, capsys: pytest.CaptureFixture[str]) -> None:
    """A record from before job.json had them: both read the telemetry instead."""
    expected = _status(finished.dir, capsys)
    job = finished.json()
    del job["recoveries"]
    (finished.dir / "job.json").write_text(json.dumps(job), encoding="utf-8")
    assert _status(finished.dir, capsys) == expected
    page = write_report(finished.dir).read_text(encoding="utf-8")
    assert len(_rows(page)) == 2


def _rows(page: str) -> list[list[str]]:
    """The recoveries table's rows (cells as text); the table is well-formed XML."""
    m = re.search(r'<table id="recoveries">.*?</table>', page, re.DOTALL)
    assert m is not None, "no recoveries table"
    table = ET.fromstring(m.group(0))
    return [["".join(td.itertext()) for td in tr.findall("td")] for tr in table.findall("tr")
            if tr.findall("td")]


def test_the_report_shows_the_recoveries_in_a_table(finished: Job) -> None:
    page = write_report(finished.dir).read_text(encoding="utf-8")
    ET.fromstring(page.removeprefix("<!DOCTYPE html>"))      # the whole page is well-formed
    rows = _rows(page)
    assert [r[:8] for r in rows] == [
        ["1", "10.500 s", "1", "1", f"{P2} node_loss (exit 137)", "80", "6", "0.84"],
        ["2", "22.000 s", "2", "0", "internal (whole job)", "140", "10", "1.50"],
    ]
    assert f"{P2}: peer (rank 1), 5.0 MiB, 0.84 s" in rows[0][8]
    assert rows[1][9] == "peer 0 B, node-local 6.0 MiB, persistent 12.0 MiB"
    assert rows[1][10] == f"{P2}: no node-local copy: a new VM"


def test_the_report_escapes_what_a_worker_wrote(tmp_path: Path) -> None:
    job = Job(tmp_path / "job")
    _start(job)
    _kill_p2(job)
    _restore(job.prefix(P2), job.at(12.0), 80, "<b>disk</b>", 2, reason="</td><script>x")
    job.record.flush(force=True)
    page = write_report(job.dir).read_text(encoding="utf-8")
    assert "<script>" not in page and "<b>disk" not in page
    assert _rows(page)[1][10] == f"{P2}: </td><script>x"


def test_a_job_without_restore_events_says_so(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    job = Job(tmp_path / "job")
    job.machine.start(job.at(0.0))
    job.execute(job.machine.quota_granted(job.at(0.01)), 0.02)
    job.record.flush(force=True)
    assert job.json()["recoveries"] == []
    assert _status(job.dir, capsys) == []
    assert "No recovery" in write_report(job.dir).read_text(encoding="utf-8")
