"""Rank 0 vanishes right after the group forms (it hosts the store); rank 1 then waits
inside torch on a Future that nobody completes: a collective that never sees its sockets
fail. Rank 1 must leave by itself (exit 134) rather than wait for the job's timeout.

Environment: RANK, WORLD_SIZE=2, MASTER_ADDR, MASTER_PORT (torchrun style), and READY: a
file rank 1 creates once formed, for rank 0 to leave only then. STALL_S: the bound on
being held (the library's 30 s is the same mechanism, only slower to test).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

import resilient_train as rt
from resilient_train.distributed import group as group_module

group_module.LOST_PEER_STALL_S = float(os.environ["STALL_S"])

group = rt.init_distributed(rt.DistributedOptions(join_timeout_s=60))
ready = Path(os.environ["READY"])
if group.rank == 0:
    while not ready.exists():
        time.sleep(0.01)
    os._exit(9)
ready.touch()
torch.futures.Future().wait()
