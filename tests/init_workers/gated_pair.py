"""One rank of a 2-rank gloo group behind the store's gate (tests/test_store_security.py).

Trains (all-reduce in a loop) inside ``group.run``. Writes ``$READY_DIR/rank-<R>.life-<L>``
once its group has formed. Rank 1's first life (LIFE=0) dies when ``$READY_DIR/die``
appears; its second life (LIFE=1) joins the survivor. Each rank prints one JSON line.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from jsonline import emit

import resilient_train as rt

rank = int(os.environ["RANK"])
life = int(os.environ.get("LIFE", "0"))
ready = Path(os.environ["READY_DIR"])
group = rt.init_distributed(rt.DistributedOptions(join_timeout_s=60, form_timeout_s=30))
(ready / f"rank-{rank}.life-{life}").touch()


def train() -> None:
    steps = 0
    while True:
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2.0
        group.step_done(steps)
        steps += 1
        if rank == 1 and life == 0 and (ready / "die").exists():
            os._exit(9)   # a peer dies mid-training; the test starts its next life
        if group.generation >= 1 and steps >= 20:
            return
        time.sleep(0.01)


group.run(train)
emit({"rank": rank, "generation": group.generation,
                  "recoveries": group.recoveries})
group.shutdown()
