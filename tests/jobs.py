"""Jobs under the launcher for the end-to-end recovery tests: start one, and compare how
two runs of a worker that writes ``model.pt`` and ``rankR.pt`` (its values and RNG draws,
tests/workers/peer_ddp.py and local_tier.py) ended."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import preloads
import torch

from resilient_train.launcher.preload import PRELOAD_ENV, PRELOAD_SERVER_ENV


def preloaded() -> dict[str, str]:
    """The environment of a launch whose worker lives are forked from this test process's
    warm server (tests/preloads.py; docs/launcher.md "Preloading"), instead of each importing
    torch again: for the jobs that train with torch. Not where a new process's start is
    what is tested (the README's demo)."""
    return {PRELOAD_ENV: ",".join(preloads.MODULES), PRELOAD_SERVER_ENV: preloads.for_launched_workers()}


def launch_job(tmp: Path, name: str, workers: int, launcher_args: Sequence[str],
               script: Sequence[str], program: str = sys.executable
               ) -> tuple[dict[str, Any], str, Path]:
    """Run ``script`` (a worker and its arguments) with ``program`` under the launcher to the
    end: the job record, the launcher's output, the job directory. Fails the test unless it
    exits 0."""
    job_dir = tmp / name
    proc = subprocess.run(
        [sys.executable, "-m", "resilient_train.cli.main", "launch", "--workers", str(workers),
         "--job-dir", str(job_dir), *launcher_args, "--", program, *script],
        env=dict(os.environ, RESILIENT_TRAIN_QUOTA_DIR=str(tmp / "quota"),
                 RESILIENT_TRAIN_FORM_TIMEOUT_S="15", **preloaded()),
        cwd=tmp, capture_output=True, text=True, timeout=400, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return json.loads((job_dir / "job.json").read_text()), out, job_dir


def the_recovery(job: dict[str, Any], out: str) -> dict[str, Any]:
    """The job record's one recovery; fails the test with the record's recoveries and the
    launcher's output when there is not exactly one (say, a retry after an abort at exit)."""
    recoveries = job.get("recoveries") or []
    assert len(recoveries) == 1, (recoveries, out[-4000:])
    return recoveries[0]


def life_pid(job_dir: Path, replica: str, attempt: int = 1, restart: int = 0) -> int | None:
    """The root pid of one life of ``replica``, from the launcher's processes.log (REPLICA
    ATTEMPT RESTART PID TICKS, the root first); None until the launcher wrote it."""
    try:
        lines = (job_dir / "processes.log").read_text().splitlines()
    except FileNotFoundError:
        return None
    key = [replica, str(attempt), str(restart)]
    return next((int(f[3]) for f in map(str.split, lines) if f[:3] == key), None)


def assert_same_end(clean: Path, faulted: Path, ranks: int) -> None:
    """The two runs ended bitwise alike: weights, and each rank's values and RNG draws."""
    for name in ["model.pt", *(f"rank{r}.pt" for r in range(ranks))]:
        want = torch.load(clean / "output" / "model" / name, weights_only=True)
        got = torch.load(faulted / "output" / "model" / name, weights_only=True)
        if name == "model.pt":
            assert want.keys() == got.keys()
            assert all(torch.equal(want[k], got[k]) for k in want), name
        else:
            assert got["values"] == want["values"], name
            assert torch.equal(got["draws"], want["draws"]), name
