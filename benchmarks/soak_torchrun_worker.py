"""The torchrun side of benchmarks/bench_soak.py (not a test; run by the benchmark).

    torchrun ... benchmarks/soak_torchrun_worker.py [train_demo.py's arguments]

Runs ``examples/train_demo.py`` unchanged, in this process, after giving it what our
launcher gives each worker life and torchrun does not: ``RESILIENT_TRAIN_TELEMETRY``, the
per-life progress record, here ``BENCH_SOAK_DIR/telemetry/attempt-1/rankR.restart-N``
(N = ``TORCHELASTIC_RESTART_COUNT``), so both jobs are measured from the same record; and
``BENCH_SOAK_DIR/pids/rankR.restart-N``, this process's id, for the harness's SIGKILL.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "examples" / "train_demo.py"


def main() -> None:
    bench = Path(os.environ["BENCH_SOAK_DIR"])
    life = f"rank{os.environ['RANK']}.restart-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    os.environ["RESILIENT_TRAIN_TELEMETRY"] = str(bench / "telemetry" / "attempt-1" / life)
    pids = bench / "pids"
    pids.mkdir(parents=True, exist_ok=True)
    tmp = pids / f".{life}.tmp"
    tmp.write_text(str(os.getpid()))
    tmp.replace(pids / life)   # the harness never reads half a pid
    sys.argv = [str(DEMO), *sys.argv[1:]]
    runpy.run_path(str(DEMO), run_name="__main__")


if __name__ == "__main__":
    main()
