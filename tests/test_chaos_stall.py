"""Hangs and stragglers injected by chaos (``hang``, ``slow``), with real processes.

The launcher stops a replica's process tree (SIGSTOP) and continues it (SIGCONT): for a
duration, for good, or in a duty cycle. The workers are tests/workers/ticker.py (a step is
a 5 ms sleep: its count says how long the process was let run) and ddp_bitwise.py (real
DDP training under ``@rt.main``). Every test checks, through the e2e fixture, that no
process of the job is left behind, stopped ones included.
"""

from __future__ import annotations

import datetime as dt
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from jobs import preloaded
from test_launcher_e2e import E2E, PY, WORKERS, e2e, event_messages, replica  # noqa: F401

from resilient_train.launcher.chaos import SLOW_PERIOD_S, FaultKind, ScheduledFault
from resilient_train.launcher.stall import Stall, StallStep
from resilient_train.observe.report import write_report

PRIMARY, WORKER = "workerpool0-0", "workerpool1-0"


def ticks(e2e: E2E, name: str, attempt: int = 1, restart: int = 0) -> list[tuple[int, float]]:
    text = (e2e.ready / f"{name}.a{attempt}.r{restart}.ticks").read_text()
    return [(int(s), float(t)) for s, t in (line.split() for line in text.splitlines())]


def event_at(record: dict[str, Any], prefix: str) -> float:
    """Epoch seconds of the first event whose message starts with ``prefix``."""
    for e in record["events"]:
        if e["message"].startswith(prefix):
            return dt.datetime.fromisoformat(e["time"].replace("Z", "+00:00")).timestamp()
    raise AssertionError(f"no event starting {prefix!r} in {event_messages(record)}")


# --------------------------------------------------------------------------- units

def test_a_hang_stops_once_and_is_over_after_its_duration() -> None:
    stall = Stall.begin(ScheduledFault(FaultKind.HANG, 1.0, WORKER, duration=30.0), 100.0)
    assert stall.deadline() == 100.0
    assert stall.advance(100.0) is StallStep.STOP and stall.stopped
    assert stall.deadline() == 130.0
    assert stall.advance(129.9) is None
    assert stall.advance(130.0) is StallStep.OVER
    for_good = Stall.begin(ScheduledFault(FaultKind.HANG, 1.0, WORKER), 0.0)
    assert for_good.advance(0.0) is StallStep.STOP
    assert for_good.deadline() is None and for_good.advance(1e9) is None


def test_slow_runs_its_speed_of_every_period() -> None:
    stall = Stall.begin(ScheduledFault(FaultKind.SLOW, 0.0, WORKER, duration=1.0, speed=0.25),
                        0.0)
    now, stopped_for = 0.0, 0.0
    while (step := stall.advance(now)) is not StallStep.OVER:
        assert step in (StallStep.STOP, StallStep.CONT)
        nxt = stall.deadline()
        assert nxt is not None and nxt > now
        if stall.stopped:
            stopped_for += min(nxt, 1.0) - now
        now = nxt
    assert stopped_for == pytest.approx(0.75, abs=SLOW_PERIOD_S)


def test_a_late_launcher_makes_a_straggler_slower_never_faster() -> None:
    stall = Stall.begin(ScheduledFault(FaultKind.SLOW, 0.0, WORKER, speed=0.5), 0.0)
    assert stall.advance(0.0) is StallStep.STOP
    assert stall.advance(0.5) is StallStep.CONT          # 0.45 s late: stopped that long
    assert stall.deadline() == pytest.approx(0.5 + 0.5 * SLOW_PERIOD_S)


# --------------------------------------------------------------------------- processes

@pytest.mark.slow
def test_a_hang_with_a_duration_stops_the_replica_then_it_goes_on(e2e: E2E) -> None:
    status, job, out = e2e.launch("--workers", "1", "--chaos", "hang:0@step30+2s",
                                  script="ticker.py", script_args=("200",))
    assert status == 0, out[-3000:]
    assert job["state"] == "JOB_STATE_SUCCEEDED"
    assert len(job["attempts"]) == 1 and replica(job, PRIMARY)["restarts"] == 0
    got = ticks(e2e, PRIMARY)
    assert [s for s, _ in got] == list(range(1, 201))     # one life, no step lost
    gaps = [(b[1] - a[1], a[0]) for a, b in zip(got, got[1:])]
    gap, after = max(gaps)
    assert 1.8 <= gap <= 6.0, gaps[-5:]                    # stopped for the 2 s
    assert after >= 30                                     # once step 30 was done
    messages = event_messages(job)
    assert "chaos: hang on workerpool0-0 at step 30 for 2 s" in messages
    resumed = event_at(job, "chaos: workerpool0-0 resumed after")
    assert resumed - event_at(job, "chaos: hang on") == pytest.approx(2.0, abs=0.5)
    assert "chaos: hang on workerpool0-0 at step 30 for 2 s" in out   # the launcher's lines

    # The report draws it, and prices it: training went on after 2 s, nothing redone.
    page = write_report(e2e.job_dir()).read_text(encoding="utf-8")
    assert "hang \u2192 workerpool0-0" in page
    row = next(r for r in page.split("<tr") if ">hang<" in r)
    stall = re.search(r'<td class="num">([\d.]+) s</td><td class="num">0</td></tr>', row)
    assert stall and float(stall.group(1)) == pytest.approx(2.0, abs=0.5), row


@pytest.mark.slow
def test_slow_runs_the_replica_at_a_fraction_of_its_step_rate(e2e: E2E) -> None:
    status, job, out = e2e.launch("--workers", "1", "--chaos", "slow:0@step50+3s*0.25",
                                  script="ticker.py", script_args=("700",))
    assert status == 0, out[-3000:]
    assert "chaos: slow on workerpool0-0 at step 50: 25% speed for 3 s" in event_messages(job)
    t0 = event_at(job, "chaos: slow on")
    t1 = event_at(job, "chaos: workerpool0-0 resumed full speed after")
    assert t1 - t0 == pytest.approx(3.0, abs=0.5)
    got = ticks(e2e, PRIMARY)
    inside = sum(1 for _, t in got if t0 <= t < t1)
    outside = [t for _, t in got if not t0 - 0.05 <= t < t1 + 0.05]
    # The rate when not slowed: the steps outside the window over the time they took.
    span = (outside[-1] - got[0][1]) - (t1 - t0)
    normal, slowed = len(outside) / span, inside / (t1 - t0)
    assert 0.05 * normal < slowed < 0.5 * normal, (normal, slowed)


@pytest.mark.slow
def test_a_replica_hung_for_good_gets_sigcont_before_the_sigterm_of_the_jobs_end(
        e2e: E2E, monkeypatch: pytest.MonkeyPatch) -> None:
    # The primary finishes while workerpool1-0 is stopped: stopping it must not wait out
    # the 30 s grace period (a stopped process acts on SIGTERM only once continued).
    monkeypatch.setenv("E2E_TICK_AFTER", f"{WORKER}.a1.r0.ticks")   # both count from then
    status, job, out = e2e.launch("--workers", "2", "--grace", "30s",
                                  "--chaos", "hang:1@step20", script="ticker.py",
                                  script_args=("150", "0.005", "0"))
    assert status == 0, out[-3000:]
    assert job["state"] == "JOB_STATE_SUCCEEDED"
    messages = event_messages(job)
    assert "chaos: hang on workerpool1-0 at step 20" in messages
    assert not any("grace period over" in m for m in messages), messages
    assert replica(job, WORKER)["exit_codes"] == [143]    # SIGTERM, as delivered at once
    stop = event_at(job, "stopping workerpool1-0")
    assert event_at(job, "workerpool1-0: stopped") - stop < 10.0
    assert any(m.startswith("chaos: workerpool1-0 resumed after") and "SIGTERM" in m
               for m in messages), messages
    # It was stopped near the primary's step 20, while the primary ran on to 150 steps.
    assert len(ticks(e2e, WORKER)) < 100


# --------------------------------------------------------------------------- the promise

STEPS, SAVE_EVERY = 40, 10


def ddp_job(e2e: E2E, name: str, *args: str) -> tuple[dict[str, Any], str, float]:
    for key, value in preloaded().items():
        e2e.monkeypatch.setenv(key, value)
    t0 = time.monotonic()
    status, job, out = e2e.launch(
        "--workers", "3", "--grace", "10s", *args, name=name,
        script=[PY, str(WORKERS / "ddp_bitwise.py"), str(STEPS), str(SAVE_EVERY), "0.02", "3"])
    elapsed = time.monotonic() - t0
    assert status == 0, out[-4000:]
    assert job["state"] == "JOB_STATE_SUCCEEDED" and job["error"] is None
    return job, out, elapsed


def final_weights(e2e: E2E, name: str) -> dict[str, torch.Tensor]:
    path: Path = e2e.job_dir(name) / "output" / "model" / "model.pt"
    return torch.load(path, weights_only=True)


@pytest.mark.slow
def test_a_hung_worker_of_three_ends_in_a_job_retry_with_bitwise_equal_weights(
        e2e: E2E, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESILIENT_TRAIN_FORM_TIMEOUT_S", "15")
    clean, _, clean_s = ddp_job(e2e, "clean")
    job, out, hung_s = ddp_job(e2e, "hung", "--chaos", "hang:1@step20")
    first = job["attempts"][0]["replicas"]
    # The survivors' hang watchdogs fired (exit 134, transient): the platform retried the
    # job, which restarted every replica, the stopped one included.
    assert 134 in first[PRIMARY]["exit_codes"] + first["workerpool1-1"]["exit_codes"], first
    assert len(job["attempts"]) == 2 and job["budgets"]["job_retries"]["used"] == 1
    assert "chaos: hang on workerpool1-0 at step 20" in event_messages(job)
    # Each survivor waited in a step's all-reduce or in a save's collectives: its watchdog
    # counted the step's time, or the stopped peer's silence (no heartbeat).
    assert ("hang: no training step finished for" in out
            or "hang: workerpool1-0 (rank 1) sent no heartbeat for" in out), out[-4000:]
    assert out.count("resumed from step") >= 3            # every rank, in attempt 2
    assert len(clean["attempts"]) == 1
    print(f"clean run {clean_s:.1f} s; with the hang {hung_s:.1f} s, "
          f"{len(job['attempts'])} attempts")
    a, b = final_weights(e2e, "clean"), final_weights(e2e, "hung")
    assert a.keys() == b.keys()
    for key, tensor in a.items():
        assert torch.equal(tensor, b[key]), key
