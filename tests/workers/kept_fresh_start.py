"""A model and optimizer built at the script's top, trained on by every life, and no
checkpoint yet. Rank 1 kills itself (first attempt only) just before step KILL_AT's metric
all-reduce, which follows opt.step(): the survivor is torn, no survivor holds a step, and
there is nothing in storage, so the restore finds nothing while the survivor's objects hold
KILL_AT steps of training. The primary writes its final weights' sum."""
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn

import resilient_train as rt

STEPS, KILL_AT = int(sys.argv[1]), int(sys.argv[2])

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


@rt.main
def train(ctx: rt.Context) -> None:
    ctx.track(model=model, optimizer=opt)
    ddp = nn.parallel.DistributedDataParallel(model)
    for step in ctx.steps(STEPS):
        g = torch.Generator().manual_seed(step * 10 + ctx.rank)
        x = torch.randn(16, 8, generator=g)
        loss = nn.functional.mse_loss(ddp(x), x[:, :1].sin())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step == KILL_AT and ctx.rank == 1 and os.environ["RESILIENT_TRAIN_ATTEMPT"] == "1"
                and os.environ.get("RESILIENT_TRAIN_RESTART_COUNT", "0") == "0"):
            os.kill(os.getpid(), signal.SIGKILL)
        metric = loss.detach().reshape(1)
        dist.all_reduce(metric)   # after opt.step(): a peer lost here tears the survivor
    if ctx.is_primary:
        total = sum(p.detach().double().sum().item() for p in model.parameters())
        print(f"final weights sum {total:.12f}", flush=True)


if __name__ == "__main__":
    train()
