"""``resilient-train checkpoints list`` starts without torch: the CLI imports each
subcommand's modules in its handler, and the checkpoint directory library is torch-free."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_checkpoints_list_leaves_torch_out(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "resilient_train.cli.main", "checkpoints",
         "list", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path)
    # -X importtime writes "import time: self | cumulative | module" per import to stderr.
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:")}
    assert "resilient_train.cli.checkpoints" in imported, done.stderr[-2000:]
    heavy = sorted(m for m in imported if m == "torch" or m.startswith("torch."))
    assert not heavy, heavy[:5]
    launcher = sorted(m for m in imported if m in {"resilient_train.launcher.runner",
                                                   "resilient_train.observe.report"})
    assert not launcher, launcher
