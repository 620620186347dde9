"""A user's unchanged torchrun-style script under the launcher: PyTorch's DDP tutorial shape
(tests/workers/tutorial_snapshot.py), which saves ``snapshot.pt`` in its working directory
on ``LOCAL_RANK == 0`` and loads it at start. A node loss (the worker killed from outside)
fails the job with its cause and the fixes named (the platform's default policy), and with
``--restart-job-on-worker-restart`` the job recovers as the platform would: every replica
in a fresh container, so from scratch, with a warning naming ``snapshot.pt``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import life_pid

SCRIPT = Path(__file__).resolve().parent / "workers" / "tutorial_snapshot.py"
WORKER = "workerpool1-0"


def _launch(tmp_path: Path, *extra: str, timeout: str = "150s"
            ) -> tuple[subprocess.Popen[str], Path]:
    job_dir = tmp_path / "job"
    env = {**os.environ, "RESILIENT_TRAIN_QUOTA_DIR": str(tmp_path / "quota"),
           "RESILIENT_TRAIN_GPUS": "none"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "resilient_train.cli.main", "launch", "--workers", "2",
         "--job-dir", str(job_dir), "--timeout", timeout, "--quiet", *extra, "--",
         sys.executable, str(SCRIPT), "40", "5", "--batch_size", "64"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, job_dir


def _kill_worker_after_its_snapshot(proc: subprocess.Popen[str], job_dir: Path) -> None:
    """As a user would: `kill -9` the worker once it has saved a snapshot (a node loss)."""
    snapshot = job_dir / "machines" / WORKER / "container" / "workdir" / "snapshot.pt"
    deadline = time.monotonic() + 60
    while not snapshot.exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the worker never saved its snapshot"
        time.sleep(0.05)
    while (pid := life_pid(job_dir, WORKER)) is None:
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)


def _logs(job_dir: Path, replica: str) -> str:
    return "".join(p.read_text() for p in sorted(job_dir.glob(f"logs/attempt-*/{replica}.log")))


def test_a_node_loss_fails_the_plain_script_with_its_cause_and_the_fixes(tmp_path: Path) -> None:
    proc, job_dir = _launch(tmp_path, timeout="90s")
    _kill_worker_after_its_snapshot(proc, job_dir)
    out, _ = proc.communicate(timeout=150)
    record = json.loads((job_dir / "job.json").read_text())
    # The killed worker was restarted in place (rule 7) before the survivor's end ended it.
    assert any(e["message"].startswith(f"{WORKER}: killed by SIGKILL from outside")
               for e in record["events"])
    if "ran longer than its timeout" in (record.get("error") or {}).get("message", "") and \
            "Traceback" not in _logs(job_dir, "workerpool0-0"):
        # Plain torch, now and then on loaded cores: the survivor reached its next
        # collective only after the restarted worker had joined its old store and gloo
        # listener, and waits there for ever (what @rt.main's generations prevent).
        pytest.skip("the plain script's survivor hung in its collective instead of failing "
                    "(the restarted peer joined its old group first): the job ran to its "
                    "timeout; the message of a survivor's exit 1 is checked on the other runs")
    if record["state"] != "JOB_STATE_FAILED" and \
            "terminate called without an active exception" in _logs(job_dir, "workerpool0-0"):
        # Now and then torch aborts on its way out after the survivor's traceback (SIGABRT:
        # 134, from its own threads, in a script that is not ours): a code the platform
        # retries, and the launcher must have.
        assert any(e["message"] == "workerpool0-0: retry_job (transient-exit-code), "
                   "job_retries 1/3" for e in record["events"]), out
        pytest.skip("torch aborted at exit (134), so the job was retried: the message of a "
                    "survivor's exit 1 is checked on the runs where Python exits")
    assert record["state"] == "JOB_STATE_FAILED", out
    message = record["error"]["message"]
    # The survivor's exit 1 is the user-code rule, as on the platform ...
    assert message.startswith("The replica workerpool0-0 exited with a non-zero status of 1. "
                              "Termination reason: Error."), message
    # ... and the message says why and what to do, with the survivor's traceback.
    assert f"{WORKER} was lost" in message
    for fix in ("@rt.main", "@rt.record", "restartJobOnWorkerRestart"):
        assert fix in message
    assert "Traceback (most recent call last):" in message
    assert proc.returncode == 1


def test_restarting_the_job_on_a_worker_restart_starts_every_replica_afresh(
        tmp_path: Path) -> None:
    proc, job_dir = _launch(tmp_path, "--restart-job-on-worker-restart")
    _kill_worker_after_its_snapshot(proc, job_dir)
    out, _ = proc.communicate(timeout=140)
    assert proc.returncode == 0, out
    record = json.loads((job_dir / "job.json").read_text())
    assert record["state"] == "JOB_STATE_SUCCEEDED"
    retries = _retries_for_an_abort_at_exit(record, job_dir)
    assert len(record["attempts"]) == 1 + retries   # restarts, not a job retry
    messages = [e["message"] for e in record["events"]]
    # Every replica's new life is a new container: no snapshot to load, and it says so.
    for replica in ("workerpool0-0", WORKER):
        log = _logs(job_dir, replica)
        lives = log.split("=====")[1:]
        assert len(lives) >= 4, log[:2000]   # two lives: a header line and a body each
        assert "Loading snapshot" not in log
        assert any(m.startswith(f"{replica} wrote snapshot.pt in its working directory")
                   for m in messages)
        assert any(m.startswith(f"{replica}: restarted on") and "snapshot.pt" in m
                   and "wiped" in m for m in messages)
    # The second lives ran every epoch again, from 0.
    assert _logs(job_dir, "workerpool0-0").count("[GPU0] Epoch 0 |") == 2 + retries


def _retries_for_an_abort_at_exit(record: dict, job_dir: Path) -> int:
    """How many times the job was retried because the script, having trained every epoch,
    aborted at interpreter exit (torch's gloo teardown: "terminate called without an
    active exception", exit 134, about one run in fifteen on a loaded machine). The
    platform retries a job on 134, and so does the launcher; any other retry fails."""
    for n, attempt in enumerate(record["attempts"][:-1], start=1):
        assert attempt["result"] == "retry: transient-exit-code", attempt
        aborted = [r for r, rep in attempt["replicas"].items() if rep["exit_codes"][-1] == 134]
        assert len(aborted) == 1, attempt
        life = (job_dir / "logs" / f"attempt-{n}" / f"{aborted[0]}.log").read_text()
        last = life.split("=====")[-1]
        assert "Epoch 39 |" in last, last[-2000:]
        assert last.rstrip().endswith("terminate called without an active exception"), \
            last[-2000:]
    return len(record["attempts"]) - 1
