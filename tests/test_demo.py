"""The README's main job: the demo trains under the launcher, a worker is killed, the job
recovers from its checkpoint and succeeds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
    # A node loss, then maintenance on the primary (SIGTERM: emergency save, exit 134).
    proc, job_dir = _launch(tmp_path, "faulty", "--chaos",
                            "kill:workerpool1-0@4s,maintenance:workerpool0-0@9s/20s")
    job = json.loads((job_dir / "job.json").read_text())
    assert job["state"] == "JOB_STATE_SUCCEEDED"
    assert job["error"] is None
    exits = [e for e in job["events"] if e["kind"] == "exited"]
    assert any(e.get("cause") == "node_loss" and e["replica"] == "workerpool1-0" for e in exits)
    # (Its exit code is 134 after an emergency save when the SIGTERM lands in training; the
    # deterministic test of that path is in test_checkpoint_distributed.py.)
    assert any(e.get("cause") == "maintenance" and e["replica"] == "workerpool0-0"
               for e in exits), exits
    assert "finished 60 steps" in proc.stdout
    faulty = final_weights(job_dir)

    # Wherever the kill landed (before or after a checkpoint), the recovered run ends with
    # exactly the weights of a run that was never interrupted.
    _, clean_dir = _launch(tmp_path, "clean")
    clean = final_weights(clean_dir)
    assert clean.keys() == faulty.keys()
    for key, tensor in clean.items():
        assert torch.equal(tensor, faulty[key]), key


def final_weights(job_dir: Path) -> dict[str, torch.Tensor]:
    """The model of the job's latest committed checkpoint, read through the SDK."""
    import resilient_train as rt

    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    mgr = rt.CheckpointManager(job_dir / "output" / "checkpoints")
    mgr.track(model=model)
    assert mgr.restore_latest(strict=False) == 60
    assert mgr.values["data_position"] == 60
    mgr.close()
    return model.state_dict()
