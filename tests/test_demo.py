"""The README's main job, exactly as the README writes it: the demo trains under the
launcher, a worker is killed 8 s in, the survivor re-forms the group in-process and the job
succeeds without a retry. Then the demo's other ways out: a hung worker, and workers that
exit instead of recovering in-process. (Bitwise-exact recovery: test_flagship.py.)"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from jobs import life_pid, preloaded

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
    argv = [sys.executable, "-m", "resilient_train.cli.main", *argv[1:]]
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
        # The survivor's line says what happened, as the README shows it: not gloo's C++
        # source file nor torch's advice to read the other worker's log.
        ended = re.search(r"generation 0 ended \((.*)\); re-forming the process group", out)
        assert ended and ".cc:" not in ended.group(1) and "typically" not in ended.group(1), \
            out[-3000:]
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
        [sys.executable, "-m", "resilient_train.cli.main", "launch", "--workers", str(workers),
         "--job-dir", str(job_dir), *launcher_args, "--",
         sys.executable, str(ROOT / "examples" / "train_demo.py"),
         "--steps", str(steps), "--step-time", str(step_time), *script_args],
        env=dict(os.environ, RESILIENT_TRAIN_QUOTA_DIR=str(tmp / "quota"),
                 RESILIENT_TRAIN_FORM_TIMEOUT_S="15", **preloaded(), **(env or {})),
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
    job, out, _ = launch_demo(tmp_path, "--chaos", "kill:workerpool1-0@step30",
                              env={"RESILIENT_TRAIN_ON_PEER_RESTART": "exit"})
    first = job["attempts"][0]["replicas"]
    assert 134 in first["workerpool0-0"]["exit_codes"], first   # the survivor left transient
    assert len(job["attempts"]) == 2                              # so the job was retried
    # As asked: one line saying why, not a crash's stack.
    assert re.search(r"\[workerpool0-0\] a peer of the process group went away: .*, exit 134\n",
                     out), out[-3000:]


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
    # The SIGTERM is sent once the primary has been blocked for 2 s (no step done; a step
    # takes 50 ms): sent together with the freeze, it could reach the primary in Python,
    # whose emergency save then waits for the frozen peer in its writer thread instead
    # (and is abandoned at the grace's deadline: another path, tested elsewhere).
    # The peer stays frozen 15 s, well past the guard's 5 s (it acts about 5.5 s after
    # the SIGTERM): the collective cannot have ended because the peer came back.
    # No save before step 30: a freeze that catches a save's commit in flight can leave the
    # frozen rank's writer in its gather after it resumes (see the stop notes of issues 14
    # and 16), which is another defect than the one tested here.
    job_dir = tmp_path / "job"
    proc = subprocess.Popen(
        [sys.executable, "-m", "resilient_train.cli.main", "launch", "--workers", "2",
         "--job-dir", str(job_dir), "--timeout", "150s", "--chaos", "hang:1@step25+15s",
         "--", sys.executable, str(ROOT / "examples" / "train_demo.py"), "--steps", "40",
         "--step-time", "0.05", "--save-every", "30"],
        env=dict(os.environ, RESILIENT_TRAIN_QUOTA_DIR=str(tmp_path / "quota"),
                 RESILIENT_TRAIN_FORM_TIMEOUT_S="15", **preloaded()),
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        sent = _sigterm_once_blocked(job_dir, proc)
        out, _ = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    job = json.loads((job_dir / "job.json").read_text())
    assert job["state"] == "JOB_STATE_SUCCEEDED"
    primary = job["attempts"][0]["replicas"]["workerpool0-0"]
    assert primary["exit_codes"][0] == 134, primary       # not 137: no SIGKILL needed
    assert "the main thread has been blocked inside torch" in out
    # A planned exit, in one line (the stack is in the error report), not a crash's stack.
    assert re.search(r"SIGTERM while the process group was failing \(.*\); exiting instead "
                     r"of re-forming it, exit 134\n", out), out[-3000:]
    exited = next(e for e in job["events"]
                  if e["message"].startswith("workerpool0-0: exited"))
    took = datetime.fromisoformat(exited["time"].replace("Z", "+00:00")).timestamp() - sent
    # A bound on the mechanism (5 s stall, then the exit) against the 30 s grace.
    assert took < 25, (sent, exited)


def _sigterm_once_blocked(job_dir: Path, proc: subprocess.Popen[str]) -> float:
    """SIGTERM to the primary's process group (what a preemption sends) once the peer is
    frozen and the primary has finished no step for 2 s; the time it was sent."""
    from resilient_train.observe.telemetry import read_step

    prefix = job_dir / "telemetry" / "attempt-1" / "workerpool0-0.restart-0"
    deadline = time.monotonic() + 120
    last, since = None, time.monotonic()
    while True:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the peer was never frozen, or the primary ran on"
        record = job_dir / "job.json"
        frozen = record.exists() and "hang on workerpool1-0" in record.read_text()
        step = read_step(prefix)
        if step != last:
            last, since = step, time.monotonic()
        elif frozen and time.monotonic() - since >= 2.0:
            break
        time.sleep(0.05)
    pid = life_pid(job_dir, "workerpool0-0")
    assert pid is not None
    sent = time.time()
    os.killpg(pid, signal.SIGTERM)
    return sent
