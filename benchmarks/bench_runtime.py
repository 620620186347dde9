"""Per-step overhead of ``ctx.steps()`` (restore, save policy check, watchdog feed, peer
check) against a bare ``range`` loop, single process, no save due; and the same with the
launcher's goodput telemetry on (a store into a shared memory map per step).

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
from resilient_train.observe.telemetry import TELEMETRY_ENV

RESULTS = Path(__file__).parent / "results" / "runtime.json"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200_000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    for var in ("RANK", "WORLD_SIZE", "CLUSTER_SPEC", "TF_CONFIG"):
        os.environ.pop(var, None)
    out: dict[str, list[float]] = {"bare": [], "ctx.steps": [], "ctx.steps+telemetry": []}
    with tempfile.TemporaryDirectory() as tmp:
        phase = ["ctx.steps"]

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
                out[phase[0]].append((time.perf_counter() - t0) / args.steps)
                # A second loop in a life goes on from where the first ended: start over.
                ctx.step = 0
                ctx.checkpoints.scheduler.last_save_step = None

        os.environ.pop(TELEMETRY_ENV, None)
        loop()
        # As under the launcher: each rt.main call's telemetry is created on first use.
        os.environ[TELEMETRY_ENV] = os.path.join(tmp, "telemetry", "bench")
        phase[0] = "ctx.steps+telemetry"
        out["bare"].clear()
        loop()
    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    bare, ours = median(out["bare"]), median(out["ctx.steps"])
    tele = median(out["ctx.steps+telemetry"])
    result = {"benchmark": "runtime", "time": time.time(), "steps": args.steps,
              "repeats": args.repeats, "python": sys.version.split()[0],
              "bare_us_per_step": bare * 1e6, "ctx_steps_us_per_step": ours * 1e6,
              "overhead_us_per_step": (ours - bare) * 1e6,
              "telemetry_overhead_us_per_step": (tele - bare) * 1e6, "target_us": 5.0,
              "samples": out}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    print(f"bare loop {bare * 1e6:.3f} us/step; ctx.steps {ours * 1e6:.3f} us/step; "
          f"overhead {(ours - bare) * 1e6:.3f} us/step (target < 5 us, hang watchdog on); "
          f"with the launcher's telemetry {(tele - bare) * 1e6:.3f} us/step")


if __name__ == "__main__":
    main()
