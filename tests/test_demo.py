"""The README's main job, exactly as the README writes it: the demo trains under the
launcher, a worker is killed 8 s in, the survivor re-forms the group in-process and the job
succeeds without a retry. Then the demo's other ways out: a hung worker, and workers that
exit instead of recovering in-process. (Bitwise-exact recovery: test_flagship.py.)"""

from __future__ import annotations

import json
from datetime import datetime
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_main_command() -> list[str]:
    """The launcher command of the README's first set-up command (after `pip install ... &&`)."""
    text = (ROOT / "README.md").read_text()
    first = re.search(r"```bash\n(.*?)\n```", text, re.S)
    assert first, "the README has no bash block"
    install, _, launch = first.group(1).partition(" && ")
    assert install.startswith("pip install torch==2.13.0 -e ."), install
    return shlex.split(launch)


@pytest.mark.slow
def test_the_readme_main_job_recovers_from_a_killed_worker(tmp_path: Path) -> None:
    argv = readme_main_command()
    assert argv[:2] == ["resilient-train", "launch"] and "--chaos" in argv
    # This interpreter for both, whatever is first on PATH.
    argv = [sys.executable, "-m", "resilient_train.cli", *argv[1:]]
    argv = [sys.executable if a == "python" else a for a in argv]
    env = dict(os.environ, RESILIENT_TRAIN_QUOTA_DIR=str(tmp_path / "quota"))
    # Run from a copy's point of view: the README's relative paths resolve in the repo.
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    record = re.search(r"job record: (\S+/job\.json)", out)
    assert record, out[-2000:]
    job_dir = (ROOT / record.group(1)).parent
    try:
        job = json.loads((job_dir / "job.json").read_text())
        assert job["state"] == "JOB_STATE_SUCCEEDED"
        assert any(e.get("cause") == "node_loss" for e in job["events"] if e["kind"] == "exited")
        assert len(job["attempts"]) == 1           # no job retry: recovered by a worker restart
        assert "process group re-formed at generation 1" in out
        # The README says so: from the survivor's memory, at the step the kill landed in
        # (the primary had finished step 85: the killed worker was in step 86 or 87).
        resumed = re.findall(r"rank (\d): resumed from step (\d+) \(from (.*?)\)", out)
        assert sorted(resumed) == [("0", resumed[0][1], "its own memory"),
                                   ("1", resumed[0][1], "rank 0's memory")], resumed
        assert resumed[0][1] in ("85", "86"), resumed
        assert "finished 200 steps" in out
    finally:
        import shutil
        shutil.rmtree(job_dir, ignore_errors=True)


def launch_demo(tmp: Path, *launcher_args: str, script_args: tuple[str, ...] = (),
                env: dict[str, str] | None = None, workers: int = 2, steps: int = 60,
                step_time: float = 0.05) -> tuple[dict, str, Path]:
    job_dir = tmp / "job"
    proc = subprocess.run(
        [sys.executable, "-m", "resilient_train.cli", "launch", "--workers", str(workers),
         "--job-dir", str(job_dir), *launcher_args, "--",
         sys.executable, str(ROOT / "examples" / "train_demo.py"),
         "--steps", str(steps), "--step-time", str(step_time), *script_args],
        env=dict(os.environ, RESILIENT_TRAIN_QUOTA_DIR=str(tmp / "quota"),
                 RESILIENT_TRAIN_FORM_TIMEOUT_S="15", **(env or {})),
        cwd=tmp, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    job = json.loads((job_dir / "job.json").read_text())
    assert job["state"] == "JOB_STATE_SUCCEEDED"
    assert f"finished {steps} steps" in out
    return job, out, job_dir


@pytest.mark.slow
def test_on_peer_restart_exit_makes_every_worker_exit_transient(tmp_path: Path) -> None:
    # For users who prefer a clean process restart to in-process recovery.
    job, _, _ = launch_demo(tmp_path, "--chaos", "kill:workerpool1-0@step30",
                            env={"RESILIENT_TRAIN_ON_PEER_RESTART": "exit"})
    first = job["attempts"][0]["replicas"]
    assert 134 in first["workerpool0-0"]["exit_codes"], first   # the survivor left transient
    assert len(job["attempts"]) == 2                              # so the job was retried


@pytest.mark.slow
def test_a_hung_worker_is_detected_and_the_job_recovers(tmp_path: Path) -> None:
    # Short steps, and a watchdog that still allows a step 100 times their length.
    job, out, job_dir = launch_demo(tmp_path, steps=40, step_time=0.02, script_args=(
        "--hang-timeout", "3", "--hang-at-step", "25"))
    assert 134 in job["attempts"][0]["replicas"]["workerpool1-0"]["exit_codes"]
    assert len(job["attempts"]) == 2
    reports = sorted((job_dir / "reports" / "attempt-1").glob("workerpool1-0.*.json"))
    assert reports
    report = json.loads(reports[0].read_text())["resilient_train"]
    assert report["message"].startswith("hang: no training step finished for")
    assert report["classification"] == "transient"
    # Every thread's stack, the hung one inside the user's step.
    assert 'Thread "MainThread"' in report["traceback"]
    assert "train_demo.py" in report["traceback"]
    assert "time.sleep(10_000)" in report["traceback"]
    assert "resumed from step 20" in out   # the last checkpoint before the hang


@pytest.mark.slow
def test_the_hang_watchdog_arms_for_a_single_worker(tmp_path: Path) -> None:
    # RESILIENT_TRAIN_HANG_TIMEOUT_S did nothing with --workers 1: the watchdog was armed only
    # once a multi-rank group had formed.
    job, out, job_dir = launch_demo(tmp_path, workers=1, script_args=("--hang-at-step", "25"),
                                    env={"RESILIENT_TRAIN_HANG_TIMEOUT_S": "3"})
    assert job["attempts"][0]["replicas"]["workerpool0-0"]["exit_codes"] == [134]
    assert len(job["attempts"]) == 2
    report = json.loads(next((job_dir / "reports" / "attempt-1").glob(
        "workerpool0-0.*.json")).read_text())["resilient_train"]
    assert report["message"].startswith("hang: no training step finished for")
    assert "resumed from step 20" in out


@pytest.mark.slow
def test_sigterm_reaches_a_primary_blocked_in_a_collective_with_a_frozen_peer(
        tmp_path: Path) -> None:
    # The peer is frozen (SIGSTOP) so the primary's collective never returns and Python
    # never runs its SIGTERM handler: it sat out the 30 s grace until the SIGKILL. The
    # stall guard ends the collectives 5 s in and the primary exits transient by itself.
    # The peer stays frozen 10 s, well past the guard's 5 s (it acts about 5.5 s in):
    # the collective cannot have ended because the peer came back.
    # No save before step 30: a freeze that catches a save's commit in flight can leave the
    # frozen rank's writer in its gather after it resumes (see the stop notes of issues 14
    # and 16), which is another defect than the one tested here. Saving every 10 steps, the
    # step-20 commit was still in flight at step 25 in one loaded run out of several.
    job, out, _ = launch_demo(tmp_path, "--timeout", "150s",
                              "--chaos", "hang:1@step25+10s,preempt:0@step25/30s", steps=40,
                              script_args=("--save-every", "30"))
    primary = job["attempts"][0]["replicas"]["workerpool0-0"]
    assert primary["exit_codes"][0] == 134, primary       # not 137: no SIGKILL needed
    assert "the main thread has been blocked inside torch" in out
    assert "SIGTERM while the process group was failing" in out
    events = job["events"]
    sent = next(e for e in events if "preempt on workerpool0-0" in e["message"])
    exited = next(e for e in events if e["message"].startswith("workerpool0-0: exited"))
    took = (datetime.fromisoformat(exited["time"].replace("Z", "+00:00"))
            - datetime.fromisoformat(sent["time"].replace("Z", "+00:00"))).total_seconds()
    # A bound on the mechanism (5 s stall, then the exit) against the 30 s grace.
    assert took < 25, (sent, exited)
