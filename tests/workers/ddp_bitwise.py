"""DDP training under ``@rt.main`` whose final weights do not depend on where it was
interrupted: step-keyed data, and ``find_unused_parameters=True`` so that DDP keeps its
first gradient-bucket layout (with 3+ ranks the layout decides the order in which gloo
sums, docs/checkpointing.md, "Exact data position"). The primary writes ``$AIP_MODEL_DIR/model.pt``.

``ddp_bitwise.py STEPS SAVE_EVERY STEP_TIME_S HANG_TIMEOUT_S``
"""
import os
import sys
import time

import torch
from torch import nn

import resilient_train as rt

STEPS, SAVE_EVERY = int(sys.argv[1]), int(sys.argv[2])
STEP_TIME, HANG_TIMEOUT = float(sys.argv[3]), float(sys.argv[4])


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step * world + rank)
    x = torch.randn(32, 16, generator=g)
    return x, x[:, :4].sum(dim=1, keepdim=True).tanh()


def train(ctx: rt.Context) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx.track(model=model, optimizer=opt)
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    for step in ctx.steps(STEPS):
        if step == ctx.restored_step:
            print(f"rank {ctx.rank}: resumed from step {step}", flush=True)
        x, y = batch(step, ctx.rank, ctx.world_size)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(STEP_TIME)
    if ctx.is_primary:
        path = os.path.join(os.environ["AIP_MODEL_DIR"], "model.pt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(model.state_dict(), path)
        print(f"finished {STEPS} steps", flush=True)


rt.main(train, options=rt.MainOptions(
    checkpoint=rt.CheckpointOptions(save_every_steps=SAVE_EVERY),
    distributed=rt.DistributedOptions(hang_timeout_s=HANG_TIMEOUT)))()
