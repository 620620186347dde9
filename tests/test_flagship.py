"""The project's promise, end to end: the real example (a transformer language model, DDP,
shuffled DataLoader with worker processes) trained under the launcher by 2 workers, hit by
five faults of different kinds, ends with exactly the weights of a run without faults.
And a bug fails the job at once, with the user's message and traceback in job.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
STEPS = 200  # about 25 s of training: the last fault lands well before the end

# One fault of each kind the launcher injects (except OOM, which fails the job by design),
# each once the primary has finished a given step (checkpoints every 25 steps), so they
# land at the same point of training however loaded the machine is. A fault whose target
# is between lives hits its next life; the job-wide ones wait for the job to be RUNNING.
FIVE_FAULTS = ",".join([
    "kill:workerpool0-0@step30",             # node loss of the primary: its store goes too
    "maintenance:workerpool1-0@step60/20s",  # SIGTERM: emergency checkpoint, exit 134
    "preempt:workerpool0-0@step90",          # SIGTERM, counted against the worker's budget
    "internal@step120",                      # the attempt fails: the whole job is retried
    "stockout@step160",                      # the resources vanish: the whole job is retried
])


def launch(tmp: Path, name: str, *launcher_args: str, script_args: tuple[str, ...] = (),
           env: dict[str, str] | None = None, step_time: float = 0.0
           ) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Train STEPS steps under the launcher. ``step_time`` (a sleep: it does not change the
    computation, so the weights stay comparable) stretches a run that faults must land in."""
    env = dict(os.environ, RESILIENT_TRAIN_QUOTA_DIR=str(tmp / "quota"),
               RESILIENT_TRAIN_FORM_TIMEOUT_S="15", **(env or {}))
    job_dir = tmp / name
    proc = subprocess.run(
        [sys.executable, "-m", "resilient_train.cli", "launch", "--workers", "2",
         "--job-dir", str(job_dir), "--grace", "20s", *launcher_args, "--",
         sys.executable, str(ROOT / "examples" / "train_charlm.py"), "--steps", str(STEPS),
         "--save-every", "25", "--step-time", str(step_time), *script_args],
        env=env, cwd=tmp, capture_output=True, text=True, timeout=420)
    return proc, job_dir


def final_weights(job_dir: Path) -> dict[str, torch.Tensor]:
    path = job_dir / "output" / "model" / "model.pt"
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def clean_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    tmp = tmp_path_factory.mktemp("flagship-clean")
    proc, job_dir = launch(tmp, "clean")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return final_weights(job_dir)


@pytest.mark.slow
def test_five_faults_of_five_kinds_end_bitwise_equal_to_a_run_without_faults(
        tmp_path: Path, clean_weights: dict[str, torch.Tensor]) -> None:
    proc, job_dir = launch(tmp_path, "faulty", "--chaos", FIVE_FAULTS, step_time=0.05)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    job = json.loads((job_dir / "job.json").read_text())
    assert job["state"] == "JOB_STATE_SUCCEEDED" and job["error"] is None

    # Every fault was injected and handled by the platform's rule for it.
    causes = [e.get("cause") for e in job["events"] if e["kind"] == "exited"]
    for cause in ("node_loss", "maintenance", "preemption"):
        assert cause in causes, (cause, causes)
    results = [a["result"] for a in job["attempts"]]
    assert len(results) == 3, results                      # the two job-wide faults retried it
    assert "internal" in results[0] and "stockout" in results[1], results
    first = job["attempts"][0]["replicas"]
    assert first["workerpool0-0"]["restarts"] == 2         # node loss, then preemption
    assert first["workerpool1-0"]["uncounted_restarts"] == 1  # maintenance is not counted
    # The primary's node loss cost the survivor nothing: it re-formed in-process, never
    # restarted for it.
    assert first["workerpool1-0"]["restarts"] == 0
    assert "[workerpool1-0] workerpool1-0: process group re-formed at generation 1" in out
    assert "chaos: kill on workerpool0-0 at step 30" in out
    assert out.count("resumed from step") >= 5            # after each of the five faults

    # Wherever the faults landed, the result is exactly that of the uninterrupted run.
    assert_same(clean_weights, final_weights(job_dir))


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key, tensor in a.items():
        assert torch.equal(tensor, b[key]), key


@pytest.mark.slow
def test_a_bug_fails_the_job_at_once_with_its_message_and_traceback(tmp_path: Path) -> None:
    proc, job_dir = launch(tmp_path, "bug", script_args=("--bug-at-step", "5"))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    job = json.loads((job_dir / "job.json").read_text())
    assert job["state"] == "JOB_STATE_FAILED"
    assert job["error"]["code"] == 3
    first, *excerpt = job["error"]["message"].splitlines()
    assert first == ("The replica workerpool1-0 exited with a non-zero status of 1. "
                     "Termination reason: Error.")
    assert excerpt[-1] == ("ValueError: a bug at step 5: the tokenizer returned an empty "
                           "batch")
    assert any("train_charlm.py" in line and "in train" in line for line in excerpt), excerpt
    # Permanent: no worker restart, no job retry.
    assert len(job["attempts"]) == 1
    assert job["attempts"][0]["replicas"]["workerpool1-0"]["restarts"] == 0
    assert job["budgets"]["job_retries"]["used"] == 0
