"""A short DDP job under ``@rt.main`` whose replica workerpool1-0, in its first life only,
SIGKILLs itself one second into its first ``init_process_group``, before its gloo
address reaches the store: the other ranks are then inside torch's formation, waiting
for it. The launcher restarts it in place (a node loss); the job must form again and
finish without a job retry. Writes the number of formations it saw to stdout."""
import os
import signal
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

import resilient_train as rt

_real_init = dist.init_process_group
_first = [True]


def _dying_init(*args: object, **kwargs: object) -> None:
    dying = (_first[0] and os.environ.get("RESILIENT_TRAIN_REPLICA") == "workerpool1-0"
             and os.environ.get("RESILIENT_TRAIN_RESTART_COUNT", "0") == "0")
    _first[0] = False
    if dying:
        threading.Timer(1.0, os.kill, args=(os.getpid(), signal.SIGKILL)).start()
        time.sleep(30)  # the kill comes first
    _real_init(*args, **kwargs)


dist.init_process_group = _dying_init


def train(ctx: rt.Context) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx.track(model=model, optimizer=opt)
    ddp = nn.parallel.DistributedDataParallel(model)
    for step in ctx.steps(20):
        g = torch.Generator().manual_seed(step * ctx.world_size + ctx.rank)
        loss = ddp(torch.randn(16, 8, generator=g)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"rank {ctx.rank}: finished at generation {ctx.group.generation}", flush=True)


rt.main(train)()
