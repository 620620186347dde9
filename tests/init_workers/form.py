"""Form the group after an optional delay, all-reduce once, meet at a barrier, print one
JSON line, shut down.

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torchrun style), plus
DELAY_S (sleep before init), JOIN_TIMEOUT_S, BARRIER_TIMEOUT_S (BARRIER_TIMEOUT_S_<rank>
for one rank), and SKIP_BARRIER_RANK (that rank does not come to the barrier: it sleeps
SKIP_SLEEP_S and exits).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
from jsonline import emit

import resilient_train as rt

logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                    format="%(asctime)s %(name)s %(levelname)s %(message)s")
rank = rt.ClusterInfo.from_env().rank  # RANK, or the platform's CLUSTER_SPEC
time.sleep(float(os.environ.get("DELAY_S", "0")))
t0 = time.monotonic()
try:
    group = rt.init_distributed(rt.DistributedOptions(
        join_timeout_s=float(os.environ.get("JOIN_TIMEOUT_S", "60")),
        barrier_timeout_s=float(os.environ.get(f"BARRIER_TIMEOUT_S_{rank}",
                                               os.environ.get("BARRIER_TIMEOUT_S", "60")))))
except rt.RendezvousTimeoutError as exc:
    emit({"rank": rank, "error": type(exc).__name__, "message": str(exc),
                      "missing": list(exc.missing), "after_s": time.monotonic() - t0})
    sys.exit(3)
formed_s = time.monotonic() - t0
t = torch.tensor([float(group.rank + 1)])
dist.all_reduce(t)
result: dict[str, object] = {"rank": group.rank, "sum": t.item(),
                             "generation": group.generation, "formed_s": formed_s,
                             "device": str(group.device), "backend": group.backend}
if os.environ.get("SKIP_BARRIER_RANK") == str(rank):
    time.sleep(float(os.environ.get("SKIP_SLEEP_S", "10")))
    group.shutdown(wait_for_peers=False)
    emit(result | {"skipped_barrier": True})
    sys.exit(0)
try:
    group.barrier("after-allreduce")
except rt.BarrierTimeoutError as exc:
    result.update(error=type(exc).__name__, message=str(exc), missing=list(exc.missing))
    group.shutdown(wait_for_peers=False)
else:
    group.shutdown()
result["initialized_after_shutdown"] = dist.is_initialized()
result["threads_after_shutdown"] = sorted(t.name for t in threading.enumerate())
emit(result)
