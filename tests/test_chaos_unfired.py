"""A fault that cannot fire says so (issue 15, part 4).

A ``--chaos`` fault that never fired is listed in job.json (``unfired_faults``) and in the
launcher's final lines; when the job SUCCEEDED and a fault set at a fixed time or step
never fired, the launcher exits STATUS_FAULT_NOT_FIRED: the resilience test did not
happen. Seeded random faults that the job outlived are only listed. The workers are
tests/workers/no_steps.py (reports no step) and raise_bug.py.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
from test_launcher_e2e import E2E, WORKERS, e2e, event_messages  # noqa: F401

from resilient_train.launcher.chaos import (
    ChaosSchedule,
    FaultKind,
    ScheduledFault,
    load_chaos,
    parse_chaos,
)
from resilient_train.launcher.messages import STATUS_FAULT_NOT_FIRED
from resilient_train.launcher.runner import NO_STEP_WARNING_S, Launcher, LaunchOptions
from resilient_train.observe.jobdir import read_job

REPLICAS = ["workerpool0-0", "workerpool1-0", "workerpool1-1"]
NO_STEP = "the primary never reported a step (steps are reported under @rt.main, by ctx.steps)"


# --------------------------------------------------------------------------- units

@pytest.mark.parametrize("item", ["kill:1@step50", "kill:workerpool1-0@60s", "kill@1.5m",
                                  "preempt:0@step300/5s", "hang:1@step40+30s",
                                  "slow:1@20s+60s*0.25", "kill~30sx5", "stockout@10s"])
def test_a_fault_s_text_is_its_item_as_written(item: str) -> None:
    spec = parse_chaos(item)
    [fault] = (*spec.faults, *spec.random)
    assert fault.text == item


def test_a_json_entry_s_text_is_an_equivalent_item(tmp_path: Path) -> None:
    path = tmp_path / "faults.json"
    path.write_text('{"faults": [{"kind": "preempt", "at_step": 300, "target": 1, "grace": "5s"},'
                    ' {"kind": "slow", "at": "20s", "target": 1, "duration": "1m", "speed": 0.25}],'
                    ' "random": [{"kind": "kill", "mean": "30s", "count": 5}]}')
    spec = load_chaos(f"@{path}")
    texts = [f.text for f in (*spec.faults, *spec.random)]
    assert texts == ["preempt:1@step300/5s", "slow:1@20s+60s*0.25", "kill~30sx5"]
    assert parse_chaos(",".join(texts)) == spec


def test_never_fired_says_why_for_each_kind_of_item() -> None:
    spec = parse_chaos("kill:1@step50,kill:2@step10,kill:1@60s,preempt:2@5s,stockout@8s,"
                       "kill:1@1s,kill~30sx3,kill~1h,kill~2s")
    sched = ChaosSchedule(spec, REPLICAS)
    due = sched.due(12.0)
    by_source = {f.source: f for f in due}
    sched.fired(by_source[5])                     # kill:1@1s fired
    [step10] = sched.due_at_step(10)
    sched.fired(step10)                           # kill:2@step10 fired
    randoms = [f for f in due if f.source == 8]   # kill~2s: some fired
    sched.fired(randoms[0])
    pending = [by_source[3], by_source[4]]        # came due, found nothing to hit
    unfired = sched.never_fired(ran_for=12.34, last_step=42, pending=pending)
    assert [u.spec for u in unfired] == ["kill:1@step50", "kill:1@60s", "preempt:2@5s",
                                        "stockout@8s", "kill~30sx3", "kill~1h"]
    why = {u.spec: u.why for u in unfired}
    assert why["kill:1@step50"] == "the primary's last reported step was 42, before step 50"
    assert why["kill:1@60s"] == "the job ended at 12.3 s, before 60 s"
    assert why["preempt:2@5s"] == (
        "it came due, but its target workerpool1-1 was never running again")
    assert why["stockout@8s"].startswith("it came due while the job was not running")
    assert why["kill~30sx3"].startswith("the job ended at 12.3 s, before the next at ")
    assert [u.to_json() for u in unfired if u.spec in ("kill:1@step50", "kill~30sx3")] == [
        {"spec": "kill:1@step50", "kind": "kill", "target": "workerpool1-0", "random": False,
         "at_s": None, "at_step": 50, "why": why["kill:1@step50"]},
        {"spec": "kill~30sx3", "kind": "kill", "target": None, "random": True, "fired": 0,
         "count": 3, "why": why["kill~30sx3"]}]
    assert sched.never_fired(ran_for=None, last_step=None)[0].why == NO_STEP
    assert sched.never_fired(ran_for=None, last_step=None)[1].why == (
        "the job never reached JOB_STATE_RUNNING")


def test_a_random_stream_is_listed_while_some_of_its_count_never_fired() -> None:
    sched = ChaosSchedule(parse_chaos("kill:1~1sx2"), REPLICAS)
    first = sched.due(math.inf)
    assert len(first) == 2
    sched.fired(first[0])
    [u] = sched.never_fired(ran_for=9.0, last_step=None, pending=first[1:])
    assert (u.spec, u.random, u.fired, u.count, u.target) == (
        "kill:1~1sx2", True, 1, 2, "workerpool1-0")
    assert u.why == "one came due, but its target workerpool1-0 was never running again"
    sched.fired(first[1])
    assert sched.never_fired(ran_for=9.0, last_step=None) == []


def test_scheduled_faults_compare_without_their_source() -> None:
    # The bookkeeping field keeps tests and callers that build ScheduledFault working.
    [fault] = ChaosSchedule(parse_chaos("kill:1@3s"), REPLICAS).due(3.0)
    assert fault == ScheduledFault(FaultKind.KILL, 3.0, "workerpool1-0")
    assert fault.source == 0


# --------------------------------------------------------------------------- end to end

def unfired(rec: dict[str, object]) -> list[dict[str, object]]:
    return rec["unfired_faults"]  # type: ignore[return-value]


def test_a_step_fault_against_a_script_without_steps_fails_the_test(e2e: E2E) -> None:
    status, rec, out = e2e.launch("--workers", "2", "--chaos", "kill:1@step50",
                                  script="no_steps.py", script_args=("1",))
    assert rec["state"] == "JOB_STATE_SUCCEEDED"
    assert status == rec["exit_status"] == STATUS_FAULT_NOT_FIRED == 78
    assert unfired(rec) == [{"spec": "kill:1@step50", "kind": "kill", "target": "workerpool1-0",
                             "random": False, "at_s": None, "at_step": 50, "why": NO_STEP}]
    final = out.splitlines()[-3:]
    assert final == [
        f"chaos: kill:1@step50 never fired: {NO_STEP}",
        ("the job succeeded, but 1 of its faults never fired: the resilience test did not "
         "happen (exit status 78)"),
        f"job record: {e2e.job_dir()}/job.json (exit status 78)"], out


def test_the_primary_reporting_no_step_is_warned_of_while_the_job_runs(e2e: E2E) -> None:
    assert NO_STEP_WARNING_S == 60.0
    job_dir = e2e.job_dir()
    lines: list[str] = []
    launcher = Launcher(LaunchOptions(
        command=(sys.executable, str(WORKERS / "no_steps.py"), "warning"), job_dir=job_dir,
        job_name="e2e-no-steps", chaos=parse_chaos("kill:0@step5"), timeout=90.0,
        env=dict(os.environ), quota_dir=e2e.quota, no_step_warning_s=0.5), echo=lines.append)
    # The primary exits 0 once the warning is in job.json: the warning came while it ran.
    assert launcher.run() == STATUS_FAULT_NOT_FIRED
    rec = read_job(job_dir)
    assert rec["state"] == "JOB_STATE_SUCCEEDED" and rec["exit_status"] == 78
    [warning] = [e for e in rec["events"] if e["kind"] == "warning"]
    assert warning["message"].startswith(
        "chaos: kill:0@step5 cannot fire yet: the primary workerpool0-0 has reported no step ")
    assert "only a script under @rt.main (ctx.steps) reports steps" in warning["message"]
    running = next(e["elapsed_s"] for e in rec["events"]
                   if e.get("state") == "JOB_STATE_RUNNING")
    assert warning["elapsed_s"] - running >= 0.5
    assert any(line.endswith("[launcher] " + warning["message"]) for line in lines)
    assert [u["spec"] for u in unfired(rec)] == ["kill:0@step5"]


def test_a_time_fault_after_the_job_s_end_fails_the_test(e2e: E2E) -> None:
    status, rec, out = e2e.launch("--workers", "2", "--chaos", "kill:1@0s,kill:1@60s",
                                  script="no_steps.py", script_args=("1",))
    assert rec["state"] == "JOB_STATE_SUCCEEDED"
    assert status == rec["exit_status"] == STATUS_FAULT_NOT_FIRED
    assert "chaos: kill on workerpool1-0" in event_messages(rec)   # the first one fired
    [u] = unfired(rec)
    assert (u["spec"], u["at_s"], u["at_step"], u["random"]) == ("kill:1@60s", 60.0, None, False)
    assert str(u["why"]).startswith("the job ended at ") and str(u["why"]).endswith(
        " s, before 60 s")
    assert f"chaos: kill:1@60s never fired: {u['why']}" in out.splitlines()


def test_random_faults_the_job_outlived_are_only_listed(e2e: E2E) -> None:
    spec = parse_chaos("kill~1hx3")
    next_at = ChaosSchedule(spec, REPLICAS[:2]).next_time()
    assert next_at is not None and next_at > 60   # seed 0: long after this job
    status, rec, out = e2e.launch("--workers", "2", "--chaos", "kill~1hx3",
                                  script="no_steps.py", script_args=("0.5",))
    assert (status, rec["state"], rec["exit_status"]) == (0, "JOB_STATE_SUCCEEDED", 0)
    [u] = unfired(rec)
    assert (u["spec"], u["random"], u["fired"], u["count"]) == ("kill~1hx3", True, 0, 3)
    assert f"chaos: kill~1hx3 never fired: {u['why']} (0 of 3 fired)" in out.splitlines()
    assert "resilience test did not happen" not in out


def test_a_failed_job_keeps_its_failure_s_exit_status(e2e: E2E) -> None:
    status, rec, out = e2e.launch("--workers", "2", "--chaos", "kill:1@60s",
                                  script="raise_bug.py", script_args=("workerpool0-0",))
    assert (status, rec["state"], rec["exit_status"]) == (1, "JOB_STATE_FAILED", 1)
    assert [u["spec"] for u in unfired(rec)] == ["kill:1@60s"]
    assert "chaos: kill:1@60s never fired: the job ended at " in out
