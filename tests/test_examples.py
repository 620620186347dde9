"""The single-process example as a user runs it: train, stop, run again, it resumes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(tmp: Path, steps: int) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_single.py"), "--steps", str(steps)],
        cwd=tmp, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.slow
def test_train_single_resumes_where_the_last_run_stopped(tmp_path: Path) -> None:
    first = run(tmp_path, 300)
    assert "resumed" not in first and "done: 300 steps" in first
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step-000000000200", "step-000000000300"]   # every 200 steps, and the final step
    second = run(tmp_path, 400)
    # 8192 samples / 128 per batch = 64 batches an epoch: step 300 is in epoch 4.
    assert "resumed after step 300 (epoch 4)" in second
    assert "done: 400 steps" in second
