"""Typed events: the job machine records them, the record holds their JSON form, and
``report``, ``status`` and the MTBF's failure count read their fields, not their messages."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from resilient_train.cli import main as cli
from resilient_train.launcher.job import JobConfig, JobMachine
from resilient_train.observe.events import Event, EventKind, decision_summary, iso
from resilient_train.observe.report import render_report
from resilient_train.platform.rules import Cause

T0 = 1_700_000_000.0
P0, P1 = "workerpool0-0", "workerpool1-0"


def test_an_event_round_trips_through_its_json_form() -> None:
    e = Event(EventKind.DECISION, T0 + 1.25, 1.25, "workerpool1-0: restart_worker (...)",
              attempt=2, replica=P1, step=40, cause="node_loss", rule="infrastructure-fault",
              action="restart_worker", budget="worker_restarts", budget_used=1,
              budget_limit=5, counts_as_failure=True, detail="x")
    data = json.loads(json.dumps(e.to_json()))
    assert data["kind"] == "decision" and data["time"] == iso(T0 + 1.25)
    assert Event.from_json(data) == e
    # What does not apply stays out of the record; reading it back restores the defaults.
    bare = Event(EventKind.STARTED, T0, 0.0, "workerpool0-0: started", replica=P0)
    assert bare.to_json() == {"time": iso(T0), "kind": "started", "elapsed_s": 0.0,
                              "message": "workerpool0-0: started", "replica": P0}
    assert Event.from_json(bare.to_json()) == bare
    # A record from before typed events reads back, its new fields None; unknown keys pass.
    old = Event.from_json({"time": "", "elapsed_s": 5, "kind": "fault", "attempt": None,
                           "message": "chaos: kill on x", "someday": 1})
    assert (old.kind, old.elapsed_s, old.fault, old.time) == (EventKind.FAULT, 5.0, None, 0.0)


def running(replicas: tuple[str, ...] = (P0, P1)) -> JobMachine:
    m = JobMachine(JobConfig("ev", replicas), T0)
    m.start(T0)
    m.quota_granted(T0)
    for r in replicas:
        m.worker_started(r, T0 + 0.1)
    return m


def kinds(m: JobMachine, kind: EventKind) -> list[Event]:
    return [e for e in m.events if e.kind is kind]


def test_the_machine_records_typed_exits_and_decisions_and_counts_failures() -> None:
    m = running()
    m.worker_exited(P1, 137, Cause.NODE_LOSS, T0 + 5, step=40)
    m.worker_started(P1, T0 + 6)
    m.worker_exited(P1, 1, Cause.EXIT, T0 + 7)
    exited = kinds(m, EventKind.EXITED)
    assert [(e.replica, e.exit_code, e.cause, e.step, e.counts_as_failure) for e in exited] == [
        (P1, 137, "node_loss", 40, False), (P1, 1, "exit", None, True)]
    first, last = kinds(m, EventKind.DECISION)
    assert (first.rule, first.action, first.cause, first.budget, first.budget_used,
            first.budget_limit) == ("infrastructure-fault", "restart_worker", "node_loss",
                                    "worker_restarts", 1, 5)
    # The human line is rendered from the same fields.
    assert first.message == f"{P1}: " + decision_summary(
        "restart_worker", "infrastructure-fault", "worker_restarts", 1, 5)
    assert first.message == f"{P1}: restart_worker (infrastructure-fault), worker_restarts 1/5"
    assert (last.rule, last.action, last.budget) == ("user-code-error", "fail_job", None)
    m.worker_exited(P0, 143, Cause.EXIT, T0 + 8)   # the stop the failure asked for
    [stopped] = kinds(m, EventKind.STOPPED)
    assert (stopped.replica, stopped.exit_code, stopped.counts_as_failure) == (P0, 143, False)
    [error] = kinds(m, EventKind.ERROR)
    assert error.code == 3
    assert m.failures() == 1          # the user code's exit 1; the node loss was not noted
    record = m.to_record()
    json.dumps(record)
    assert record["events"] == [e.to_json() for e in m.events]


def test_a_note_takes_event_fields_and_refuses_others() -> None:
    m = running()
    m.note(T0 + 2, EventKind.FAULT, "chaos: kill on workerpool1-0 at step 20", replica=P1,
           fault="kill", cause="node_loss", injected=True, step=20, counts_as_failure=True)
    m.note(T0 + 3, EventKind.FAULT, "chaos: slow on workerpool1-0", replica=P1, fault="slow",
           injected=True)
    m.note(T0 + 4, EventKind.FAULT_OVER, "chaos: workerpool1-0 resumed full speed after 1.0 s",
           replica=P1, fault="slow", duration_s=1.0)
    kill, slow = kinds(m, EventKind.FAULT)
    assert (kill.replica, kill.fault, kill.cause, kill.injected, kill.step, kill.attempt) == (
        P1, "kill", "node_loss", True, 20, 1)
    assert m.failures() == 1          # a slow-down was not passed as a failure
    [over] = kinds(m, EventKind.FAULT_OVER)
    assert (over.fault, over.duration_s, over.detail) == ("slow", 1.0, None)
    with pytest.raises(TypeError, match="unknown event fields"):
        m.note(T0 + 5, EventKind.WARNING, "x", target=P1)
    with pytest.raises(TypeError, match="unknown event fields"):
        m.note(T0 + 5, EventKind.WARNING, "x", attempt=3)   # the machine's to set
    with pytest.raises(TypeError):
        m.note(T0 + 5, EventKind.WARNING)   # no message


def test_a_note_must_say_its_kind_and_name_only_event_fields() -> None:
    # The old form, note(now, message, kind="fault", **extra), is gone: a note without an
    # EventKind would leave the MTBF count to guess whether it is a failure.
    m = running()
    with pytest.raises(TypeError, match="expected an EventKind"):
        m.note(T0 + 1, "fault", "chaos: preempt on workerpool1-0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unknown event fields"):
        m.note(T0 + 1, EventKind.FAULT, "x", gossip=True)
    assert m.failures() == 0


# --- readers -------------------------------------------------------------------------------

def _job(events: list[Event]) -> dict[str, Any]:
    return {"name": "typed", "state": "JOB_STATE_RUNNING", "create_time": iso(T0),
            "replicas": [P0, P1], "attempts": [], "events": [e.to_json() for e in events]}


def _ev(t: float, kind: EventKind, message: str, **fields: Any) -> Event:
    return Event(kind, T0 + t, t, message, 1, **fields)


def _titles(page: str) -> list[str]:
    import html
    return [html.unescape(t) for t in re.findall(r"<title>(.*?)</title>", page, re.S)]


def test_the_report_reads_faults_and_decisions_by_their_fields() -> None:
    # Messages that say nothing the report could parse: only the fields tell.
    page = render_report(_job([
        _ev(0.0, EventKind.STARTED, "a", replica=P0),
        _ev(0.0, EventKind.STARTED, "b", replica=P1),
        _ev(1.0, EventKind.FAULT, "first fault", replica=P1, fault="kill", injected=True),
        _ev(1.1, EventKind.EXITED, "c", replica=P1, exit_code=137, cause="node_loss"),
        _ev(1.1, EventKind.DECISION, "d", replica=P1, rule="infrastructure-fault",
            action="restart_worker", budget="worker_restarts", budget_used=1, budget_limit=5),
        _ev(2.0, EventKind.FAULT, "second fault", fault="internal", injected=True),
        _ev(2.0, EventKind.DECISION, "e", rule="internal-error", action="retry_job"),
    ]))
    assert "kill \u2192 workerpool1-0" in page and "internal (whole job)" in page
    assert "workerpool1-0: restart_worker (infrastructure-fault), worker_restarts 1/5" in page
    assert "job typed: retry_job (internal-error)" in page
    assert "exit 137 node_loss" in page


@pytest.mark.parametrize("cut_short", [False, True])
def test_a_stall_is_over_when_its_end_says_it_ran_its_course(cut_short: bool) -> None:
    page = render_report(_job([
        _ev(0.0, EventKind.STARTED, "a", replica=P0),
        _ev(1.0, EventKind.FAULT, "stalled", replica=P0, fault="hang", injected=True),
        _ev(3.0, EventKind.FAULT_OVER, "over", replica=P0, fault="hang", duration_s=2.0,
            detail="to deliver the SIGTERM" if cut_short else None),
    ]))
    [title] = {t for t in _titles(page) if t.startswith("stalled at ")}   # line and label
    assert ("training resumed at 3.000 s" in title) is not cut_short


def test_status_prints_the_events_from_their_fields(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = running()
    m.worker_exited(P1, 137, Cause.NODE_LOSS, T0 + 5)
    (tmp_path / "job.json").write_text(json.dumps(m.to_record()), encoding="utf-8")
    assert cli.main(["status", str(tmp_path), "--events"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("  +")]
    assert lines == [f"  +{e.elapsed_s:9.3f}s  {e.message}" for e in m.events]
    assert "+    5.000s  workerpool1-0: restart_worker (infrastructure-fault), " \
           "worker_restarts 1/5" in out
