"""How long an async save of CUDA state blocks the training loop, against bare copies.

    python benchmarks/bench_cuda_staging.py [--size-gb 1.0] [--repeats 5] [--out PATH]

The state: 64 float32 CUDA tensors, ``--size-gb`` in all, tracked by a CheckpointManager.
Measured after a warm-up save (host buffers allocated and pinned):

- ours: ``last_blocking_s`` of ``save()`` with ``async_save=True`` (device-to-host copy into
  reused pinned buffers, RNG capture, bookkeeping);
- pinned copy: ``dst.copy_(src, non_blocking=True)`` per tensor into preallocated pinned
  buffers, then a synchronize (the floor);             target: ours / pinned copy <= 1.5
- pageable copy: ``src.cpu()`` per tensor (what a plain ``torch.save`` of CUDA state pays).

Needs CUDA; exits 0 with a line saying so where there is none. Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from resilient_train.checkpoint.manager import CheckpointManager, CheckpointOptions

RESULTS = Path(__file__).resolve().parent / "results" / "cuda_staging.json"


def timed(fn: object) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_cuda_staging: no CUDA device here; nothing to measure")
        return 0
    logging.getLogger("resilient_train").setLevel(logging.WARNING)
    numel = int(args.size_gb * 2**30) // 4 // 64
    params = torch.nn.ParameterList(
        torch.nn.Parameter(torch.randn(numel, device="cuda")) for _ in range(64))
    pinned = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in params]

    def pinned_copy() -> None:
        for dst, src in zip(pinned, params):
            dst.copy_(src.detach(), non_blocking=True)

    def pageable_copy() -> None:
        for src in params:
            src.detach().cpu()

    ours, floor, pageable = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-cuda-") as root:
        mgr = CheckpointManager(root, options=CheckpointOptions(async_save=True))
        mgr.track(model=params)
        mgr.save(0)
        mgr.wait()  # warm-up: buffers allocated and pinned
        pinned_copy()
        for step in range(1, args.repeats + 1):
            with torch.no_grad():
                params[0].add_(1.0)
            torch.cuda.synchronize()
            mgr.save(step)
            ours.append(mgr.last_blocking_s)
            mgr.wait()
            floor.append(timed(pinned_copy))
            pageable.append(timed(pageable_copy))
        mgr.close()
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "size_gib": 64 * numel * 4 / 2**30, "repeats": args.repeats,
        "ours_blocking_s": statistics.median(ours),
        "pinned_copy_s": statistics.median(floor),
        "pageable_copy_s": statistics.median(pageable),
    }
    result["ratio_ours_to_pinned_copy"] = result["ours_blocking_s"] / result["pinned_copy_s"]
    result["pass"] = result["ratio_ours_to_pinned_copy"] <= 1.5
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
