"""The README's main job, exactly as the README writes it: the demo trains under the
launcher, a worker is killed 8 s in, the survivor re-forms the group in-process and the job
succeeds without a retry. (Bitwise-exact recovery under many faults: test_flagship.py.)"""

from __future__ import annotations

import json
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
        assert "finished 300 steps" in out
    finally:
        import shutil
        shutil.rmtree(job_dir, ignore_errors=True)
