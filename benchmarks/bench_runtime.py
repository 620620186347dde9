"""Per-step overhead of ``ctx.steps()`` (restore, save policy check, watchdog feed, peer
check) against a bare ``range`` loop, single process, no save due.

    python benchmarks/bench_runtime.py [--steps N]

Writes benchmarks/results/runtime.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import resilient_train as rt

RESULTS = Path(__file__).parent / "results" / "runtime.json"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200_000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    for var in ("RANK", "WORLD_SIZE", "CLUSTER_SPEC", "TF_CONFIG"):
        os.environ.pop(var, None)
    out: dict[str, list[float]] = {"bare": [], "ctx.steps": []}
    with tempfile.TemporaryDirectory() as tmp:

        @rt.main(options=rt.MainOptions(checkpoint_dir=tmp, final_save=False,
                                        checkpoint=rt.CheckpointOptions(
                                            save_every_steps=10**12),
                                        distributed=rt.DistributedOptions(
                                            hang_timeout_s=3600)))
        def loop(ctx: rt.Context) -> None:
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    pass
                out["bare"].append((time.perf_counter() - t0) / args.steps)
                t0 = time.perf_counter()
                for _ in ctx.steps(args.steps):
                    pass
                out["ctx.steps"].append((time.perf_counter() - t0) / args.steps)
                ctx.checkpoints.last_saved_step = None

        loop()
    bare = sorted(out["bare"])[len(out["bare"]) // 2]
    ours = sorted(out["ctx.steps"])[len(out["ctx.steps"]) // 2]
    result = {"benchmark": "runtime", "time": time.time(), "steps": args.steps,
              "repeats": args.repeats, "python": sys.version.split()[0],
              "bare_us_per_step": bare * 1e6, "ctx_steps_us_per_step": ours * 1e6,
              "overhead_us_per_step": (ours - bare) * 1e6, "target_us": 5.0,
              "samples": out}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    print(f"bare loop {bare * 1e6:.3f} us/step; ctx.steps {ours * 1e6:.3f} us/step; "
          f"overhead {(ours - bare) * 1e6:.3f} us/step (target < 5 us, hang watchdog on)")


if __name__ == "__main__":
    main()
