"""``resilient-train report``: the HTML page of a job, from a hand-made job directory with
known times and from a real (short, torch-free) launcher job with injected faults."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from resilient_train.cli.main import main
from resilient_train.launcher.job import iso
from resilient_train.observe.jobdir import telemetry_prefix
from resilient_train.observe.report import ReportError, render_report, write_report
from resilient_train.observe.telemetry import Telemetry

ROOT = Path(__file__).resolve().parents[1]
SVG = "{http://www.w3.org/2000/svg}"
EVIL = "<script>alert('x')</script> & \"quotes\""
P0, P1 = "workerpool0-0", "workerpool1-0"


def _page(path: Path) -> str:
    """The page's text; the whole page is well-formed XML too (a stricter check than HTML)."""
    page = path.read_text(encoding="utf-8")
    ET.fromstring(page.removeprefix("<!DOCTYPE html>"))
    return page


def _svg(page: str, svg_id: str) -> ET.Element:
    """The SVG element ``svg_id`` of the page, parsed as XML (it must be well-formed)."""
    m = re.search(rf'<svg id="{svg_id}".*?</svg>', page, re.DOTALL)
    assert m is not None, f"no <svg id={svg_id}> in the page"
    return ET.fromstring(m.group(0))


def _texts(svg: ET.Element) -> list[str]:
    return ["".join(t.itertext()) for t in svg.iter(f"{SVG}text")]


def _titles(svg: ET.Element) -> list[str]:
    return ["".join(t.itertext()) for t in svg.iter(f"{SVG}title")]


def _segment(prefix: Path, first: int, last: int, t0: float, t1: float,
             saves: Sequence[tuple[float, int]] = ()) -> None:
    """A closed segment (and its saves) as a worker's telemetry writes them."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{prefix}.jsonl", "a", encoding="utf-8") as f:
        f.writelines(json.dumps({"kind": "save", "t": t, "step": step, "blocking_s": 0.01})
                     + "\n" for t, step in saves)
        f.write(json.dumps({"kind": "segment", "t": t1, "first_step": first, "last_step": last,
                            "t_start": t0, "t_first": t0 + 0.1, "t_last": t1,
                            "blocking_s": 0.01 * len(saves)}) + "\n")


def _ev(t: float, kind: str, message: str, attempt: int | None = 1, **extra: Any) -> dict[str, Any]:
    return {"time": "", "elapsed_s": t, "kind": kind, "attempt": attempt, "message": message,
            **extra}


def _hand_made_job(job_dir: Path, *, goodput: bool = True, telemetry: bool = True) -> float:
    """A 2-replica job: a kill on the worker at 5 s (both recover, the primary in-process,
    steps 31..40 redone), a whole-job internal error at 12 s (attempt 2), success at 35 s.
    Returns the job's create time."""
    created = float(int(time.time()) - 30)   # whole seconds: exact in the ISO times
    events = [
        _ev(0.0, "state", "job hand: JOB_STATE_QUEUED", None, state="JOB_STATE_QUEUED"),
        _ev(0.01, "state", "job hand: JOB_STATE_PENDING", state="JOB_STATE_PENDING"),
        _ev(0.02, "started", f"{P0}: started", replica=P0),
        _ev(0.03, "started", f"{P1}: started", replica=P1),
        _ev(0.03, "state", "job hand: JOB_STATE_RUNNING", state="JOB_STATE_RUNNING"),
        _ev(5.0, "fault", f"chaos: kill on {P1}", replica=P1, fault="kill",
            cause="node_loss", injected=True, counts_as_failure=True),
        _ev(5.05, "exited", EVIL, replica=P1, exit_code=137, cause="node_loss"),
        _ev(5.05, "decision", f"{P1}: restart_worker (infrastructure-fault)", replica=P1,
            rule="infrastructure-fault", action="restart_worker", cause="node_loss"),
        _ev(5.05, "restarting", f"{P1}: restarting (restart 1 in this job)", replica=P1),
        _ev(5.1, "started", f"{P1}: started", replica=P1),
        _ev(12.0, "fault", "chaos: internal (whole job) at 12.0 s", fault="internal",
            cause="internal", injected=True, detail="whole job", counts_as_failure=True),
        _ev(11.99, "decision", "job hand: retry_job (internal-error)", rule="internal-error",
            action="retry_job", cause="internal"),
        _ev(12.0, "stopping", f"stopping {P0}, {P1} (retry: internal-error)"),
        _ev(12.1, "stopped", f"{P0}: stopped (exit 143)", replica=P0, exit_code=143),
        _ev(12.2, "stopped", f"{P1}: stopped (exit 143)", replica=P1, exit_code=143),
        _ev(12.2, "state", "job hand: JOB_STATE_PENDING", 2, state="JOB_STATE_PENDING"),
        _ev(12.3, "started", f"{P0}: started", 2, replica=P0),
        _ev(12.3, "started", f"{P1}: started", 2, replica=P1),
        _ev(12.3, "state", "job hand: JOB_STATE_RUNNING", 2, state="JOB_STATE_RUNNING"),
        _ev(35.0, "exited", f"{P0}: exited with status 0", 2, replica=P0, exit_code=0,
            cause="exit"),
        _ev(35.05, "stopped", f"{P1}: stopped (exit 0)", 2, replica=P1, exit_code=0),
        _ev(35.05, "state", "job hand: JOB_STATE_SUCCEEDED", 2, state="JOB_STATE_SUCCEEDED"),
    ]
    replicas = {P0: {"status": "stopped", "restarts": 0, "uncounted_restarts": 0,
                     "exit_codes": [143]},
                P1: {"status": "stopped", "restarts": 1, "uncounted_restarts": 0,
                     "exit_codes": [137, 143]}}
    job: dict[str, Any] = {
        "name": "hand", "state": "JOB_STATE_SUCCEEDED", "create_time": iso(created),
        "start_time": iso(created + 0.03), "end_time": iso(created + 35.05),
        "update_time": iso(created + 35.05),
        "error": {"code": 13, "message": f"not really an error: {EVIL}"},
        "exit_status": 0, "replicas": [P0, P1],
        "attempts": [
            {"attempt": 1, "start_time": iso(created + 0.01), "end_time": iso(created + 12.2),
             "result": f"retry: internal-error {EVIL}", "replicas": replicas},
            {"attempt": 2, "start_time": iso(created + 12.2), "end_time": iso(created + 35.05),
             "result": "succeeded", "replicas": replicas}],
        "events": events,
    }
    if goodput:
        job["goodput"] = {"wall_s": 35.02, "startup_s": 1.97, "productive_s": 12.345,
                          "lost_s": 0.875, "checkpoint_s": 0.04, "recovery_s": 18.5,
                          "other_s": 1.29, "steps": 70, "steps_lost": 10, "segments": 3,
                          "recoveries": 2, "goodput": 0.4321}
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "job.json").write_text(json.dumps(job), encoding="utf-8")
    if telemetry:
        c = created
        # Attempt 1: both train 0..40; the worker is killed at 5 s; both restore step 30.
        _segment(telemetry_prefix(job_dir, 1, P0, 0), 0, 40, c + 2.0, c + 5.0,
                 [(c + 4.5, 30)])
        _segment(telemetry_prefix(job_dir, 1, P0, 0), 30, 60, c + 7.0, c + 11.5)
        _segment(telemetry_prefix(job_dir, 1, P1, 0), 0, 40, c + 2.0, c + 5.0)
        _segment(telemetry_prefix(job_dir, 1, P1, 1), 30, 60, c + 7.0, c + 11.5)
        # Attempt 2: the real writer (its segment still open: the progress file), now.
        tel = Telemetry(telemetry_prefix(job_dir, 2, P0, 1))
        tel.begin_segment(60)
        for step in range(61, 71):
            tel.step(step)
        tel.saved(70, 0.01)
        del tel   # not closed: the segment stays in the memory-mapped progress file
        _segment(telemetry_prefix(job_dir, 2, P1, 2), 60, 70, time.time(), time.time() + 0.2)
    return created


def test_report_of_a_hand_made_job(tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    _hand_made_job(job_dir)
    path = write_report(job_dir)
    assert path == job_dir / "report.html"
    page = _page(path)

    # Every string from the record is escaped.
    assert "<script" not in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page
    timeline = _svg(page, "timeline")
    texts, titles = _texts(timeline), _titles(timeline)
    assert any(EVIL in t for t in titles)   # the retry's title, as text once parsed

    # Every replica has a lane; every fault a labelled marker with its message in a title.
    assert P0 in texts and P1 in texts
    assert f"kill \u2192 {P1}" in texts
    assert "internal (whole job)" in texts
    assert "attempt 2" in texts
    assert any(t.startswith(f"chaos: kill on {P1} at 5.000 s") for t in titles)
    assert any(t.startswith("chaos: internal (whole job) at 12.0 s") for t in titles)
    assert "exit 137 node_loss" in texts and "exit 0" in texts

    # The lanes: what each replica was doing.
    assert any(t.startswith(f"{P0}, life 1 (attempt 1): recovering in-process, 5.000 s to "
                            f"7.000 s") for t in titles)
    assert any("steps 31\u201340 (10) redone by a later segment" in t for t in titles)
    assert any(t.startswith(f"{P1}: down, 5.050 s to 5.100 s") for t in titles)
    assert any(t.startswith(f"{P0}, life 2 (attempt 2): training steps 61\u201370") for t in titles)
    assert any(t.startswith(f"{P0}: saved step 70") for t in titles)
    assert any(t.startswith(f"{P0}, life 1 (attempt 1): starting, 0.020 s to 2.000 s")
               for t in titles)

    # The goodput numbers of job.json.
    bar = _svg(page, "goodput-bar")
    assert "productive 35%" in _texts(bar)
    assert "Goodput 43.2%" in page
    assert "12.345" in page and "18.500" in page and "0.875" in page

    # What the kill cost: the primary was at step 40 when it hit, trained again at 7 s
    # from step 30: 2 s without training, 10 steps redone.
    row = next(r for r in page.split("<tr") if ">kill<" in r)
    assert ">40<" in row and "7.000 s from step 30" in row and ">2.00 s<" in row
    assert ">10<" in row


def test_report_without_goodput_draws_the_events(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job_dir = tmp_path / "job"
    _hand_made_job(job_dir, goodput=False, telemetry=False)
    out = tmp_path / "elsewhere" / "r.html"
    out.parent.mkdir()
    assert main(["report", str(job_dir), "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    page = _page(out)
    assert "No goodput for this job" in page
    timeline = _svg(page, "timeline")
    titles = _titles(timeline)
    assert any(t.startswith(f"{P0}, life 1 (attempt 1): alive, 0.020 s to 12.100 s")
               for t in titles)
    assert "running (no telemetry)" in _texts(timeline)
    assert P0 in _texts(timeline) and P1 in _texts(timeline)
    assert '<svg id="goodput-bar"' not in page


def test_render_is_pure_and_a_missing_record_is_a_clear_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = {"name": "x", "state": "JOB_STATE_QUEUED", "create_time": "2026-01-01T00:00:00.000Z",
           "events": [_ev(0.0, "state", "job x: JOB_STATE_QUEUED", None,
                          state="JOB_STATE_QUEUED")]}
    page = render_report(job)
    _svg(page, "timeline")
    assert "not finished" in page

    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "no job record" in err and "job.json" in err and "resilient-train launch" in err
    assert "holds job directories" not in err
    # The launcher's parent directory (rt-jobs) given for a job: its jobs, newest first.
    for i, name in enumerate(["old", "new"]):
        (tmp_path / "jobs" / name).mkdir(parents=True)
        (tmp_path / "jobs" / name / "job.json").write_text("{}", encoding="utf-8")
        os.utime(tmp_path / "jobs" / name / "job.json", (1000 + i, 1000 + i))
    assert main(["report", str(tmp_path / "jobs")]) == 2
    err = capsys.readouterr().err
    assert (f"; {tmp_path / 'jobs'} holds job directories: {tmp_path / 'jobs' / 'new'}, "
            f"{tmp_path / 'jobs' / 'old'} (newest first)") in err, err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "job.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ReportError, match="not valid JSON"):
        write_report(tmp_path / "bad")


def test_the_report_masks_secrets_of_a_recorded_command(tmp_path: Path) -> None:
    """A record written before the launcher masked commands still gets a masked page."""
    job_dir = tmp_path / "job"
    _hand_made_job(job_dir, goodput=False, telemetry=False)
    record = json.loads((job_dir / "job.json").read_text(encoding="utf-8"))
    record["job_spec"] = {"command": ["env", "HF_TOKEN=hf-123", "python", "t.py",
                                      "--token=tok-456", "--password", "pw-789", "--lr", "1"]}
    (job_dir / "job.json").write_text(json.dumps(record), encoding="utf-8")
    page = _page(write_report(job_dir))
    assert ("<code>env HF_TOKEN=*** python t.py --token=*** --password *** --lr 1</code>"
            in page)
    assert not any(secret in page for secret in ("hf-123", "tok-456", "pw-789"))


# A torch-free worker: trains STEPS steps of STEP_S, the primary saves every 10 steps, and
# every (re)start resumes from the last save, reporting through the launcher's telemetry.
_WORKER = """
import os, sys, time
from collections.abc import Sequence
from pathlib import Path
from resilient_train.observe.telemetry import Telemetry

steps, step_s = int(sys.argv[1]), float(sys.argv[2])
ckpt = Path(os.environ["AIP_CHECKPOINT_DIR"])
ckpt.mkdir(parents=True, exist_ok=True)
saved = ckpt / "step"
start = int(saved.read_text()) if saved.exists() else 0
tel = Telemetry.from_env()
assert tel is not None
tel.begin_segment(start)
for step in range(start + 1, steps + 1):
    time.sleep(step_s)
    tel.step(step)
    if step % 10 == 0:
        if os.environ["RANK"] == "0":
            (ckpt / "step.tmp").write_text(str(step))
            os.replace(ckpt / "step.tmp", saved)
        tel.saved(step, 0.001)
tel.close()
"""


@pytest.mark.slow
def test_report_of_a_real_launcher_job(tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(_WORKER, encoding="utf-8")
    job_dir = tmp_path / "job"
    env = {**os.environ, "RESILIENT_TRAIN_QUOTA_DIR": str(tmp_path / "quota")}
    launch = subprocess.run(
        [sys.executable, "-m", "resilient_train.cli.main", "launch", "--workers", "2",
         "--job-dir", str(job_dir), "--quiet", "--grace", "1s",
         "--chaos", f"kill:{P1}@1s,maintenance:{P0}@2s/1s",
         "--", sys.executable, str(worker), "60", "0.05"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert launch.returncode == 0, launch.stdout + launch.stderr
    out = subprocess.run([sys.executable, "-m", "resilient_train.cli.main", "report", str(job_dir)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    path = Path(out.stdout.strip())
    assert path == job_dir / "report.html"
    page = _page(path)
    record = json.loads((job_dir / "job.json").read_text(encoding="utf-8"))

    timeline = _svg(page, "timeline")
    texts, titles = _texts(timeline), _titles(timeline)
    for replica in record["replicas"]:
        assert replica in texts
    faults = [e["message"] for e in record["events"] if e["kind"] == "fault"]
    assert len(faults) == 2
    for message in faults:
        assert any(t.startswith(message + " at ") for t in titles)
    assert f"kill \u2192 {P1}" in texts and f"maintenance \u2192 {P0}" in texts
    # Both replicas trained (every replica writes telemetry) and saved.
    for replica in (P0, P1):
        assert any(t.startswith(f"{replica}, life ") and ": training steps " in t
                   for t in titles)
        assert any(t.startswith(f"{replica}: saved step ") for t in titles)
    goodput = record["goodput"]
    assert goodput is not None and goodput["steps"] == 60
    assert f"Goodput {100 * goodput['goodput']:.1f}%" in page
    assert f"{goodput['productive_s']:.3f}" in page
    _svg(page, "goodput-bar")
