"""Three ranks step (a second of computing, then an all-reduce); the primary dies just
after a step's all-reduce, so the survivors' watchers, not a collective, notice first:
they lose the rendezvous store the primary hosted. What each survivor logs is the test's.
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
group = rt.init_distributed(rt.DistributedOptions(join_timeout_s=4, collective_timeout_s=60))


def fn() -> None:
    for i in range(3):
        dist.all_reduce(torch.ones(1))
        if rank == 0 and group.generation == 0 and i == 1:
            os._exit(9)   # the primary dies between steps (nobody restarts it here)
        time.sleep(1.5)   # computing: no collective in flight when the store goes


try:
    group.run(fn)
except rt.RendezvousTimeoutError:
    pass  # nobody restarts the primary in this test
except Exception as exc:  # noqa: BLE001 - reported to the test
    emit({"rank": rank, "unexpected": repr(exc)[:300]})
emit({"rank": rank, "recoveries": group.recoveries})
sys.stdout.flush()
os._exit(0)
