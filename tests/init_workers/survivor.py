"""Three ranks train (all-reduce in a loop); the primary dies mid-loop.

Only the ranks that exchange data with the dead one in gloo's algorithm see an error; the
others wait on a *survivor*. That survivor re-forms, and destroying its old group must
close its sockets so the waiting one fails at once, not at the collective timeout. Each
survivor prints how long after the death its collective failed, as one JSON line.

``BETWEEN_STEPS=1``: the ranks compute (a sleep) between all-reduces and the primary dies
just after one, so the survivors' watchers, which lose the rendezvous store it hosted,
notice first, not a collective; the library's lines go to stderr, for the test to read.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import torch
import torch.distributed as dist
from jsonline import emit

import resilient_train as rt

logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
rank = int(os.environ["RANK"])
group = rt.init_distributed(rt.DistributedOptions(join_timeout_s=6, collective_timeout_s=60))
dist.all_reduce(torch.ones(1))
dist.barrier()
death = time.time() + 1.0
noticed: dict[str, float] = {}


def mid_collective() -> None:
    try:
        while True:
            dist.all_reduce(torch.ones(1 << 16))
            if rank == 0 and time.time() >= death:
                os._exit(9)  # the primary dies mid-training (nobody restarts it here)
    finally:
        noticed.setdefault("failed_after_s", time.time() - death)


def between_steps() -> None:
    for i in range(3):
        dist.all_reduce(torch.ones(1))
        if rank == 0 and group.generation == 0 and i == 1:
            os._exit(9)   # the primary dies between steps
        time.sleep(1.5)   # computing: no collective in flight when the store goes


try:
    group.run(between_steps if os.environ.get("BETWEEN_STEPS") == "1" else mid_collective)
except rt.RendezvousTimeoutError:
    pass  # nobody restarts the primary in this test
except Exception as exc:  # noqa: BLE001 - reported to the test
    emit({"rank": rank, "unexpected": repr(exc)[:300]})
emit({"rank": rank, "recoveries": group.recoveries, **noticed})
sys.stdout.flush()
os._exit(0)
