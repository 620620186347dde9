"""The README's main job: the demo trains under the launcher, a worker is killed, the job
recovers from its checkpoint and succeeds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _launch(tmp_path: Path, name: str, *chaos: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    env = dict(os.environ, RESILIENT_TRAIN_QUOTA_DIR=str(tmp_path / "quota"))
    job_dir = tmp_path / name
    proc = subprocess.run(
        [sys.executable, "-m", "resilient_train.cli", "launch", "--workers", "2",
         "--job-dir", str(job_dir), *chaos, "--",
         sys.executable, str(ROOT / "examples" / "train_demo.py"),
         "--steps", "60", "--save-every", "10", "--step-time", "0.1"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, job_dir


@pytest.mark.slow
def test_demo_recovers_from_a_killed_worker(tmp_path: Path) -> None:
    import torch

    proc, job_dir = _launch(tmp_path, "faulty", "--chaos", "kill:workerpool1-0@4s")
    job = json.loads((job_dir / "job.json").read_text())
    assert job["state"] == "JOB_STATE_SUCCEEDED"
    assert job["error"] is None
    exits = [e for e in job["events"] if e["kind"] == "exited"]
    assert any(e.get("cause") == "node_loss" and e["replica"] == "workerpool1-0" for e in exits)
    assert "finished 60 steps" in proc.stdout
    faulty = torch.load(job_dir / "output" / "checkpoints" / "demo.pt", weights_only=True)
    assert faulty["step"] == 60

    # Wherever the kill landed (before or after a checkpoint), the recovered run ends with
    # exactly the weights of a run that was never interrupted.
    _, clean_dir = _launch(tmp_path, "clean")
    clean = torch.load(clean_dir / "output" / "checkpoints" / "demo.pt", weights_only=True)
    assert clean["model"].keys() == faulty["model"].keys()
    for key, tensor in clean["model"].items():
        assert torch.equal(tensor, faulty["model"][key]), key
