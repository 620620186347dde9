"""A job with a node-local tier: a save every 5 steps to each machine's own disk, every 4th
also to the checkpoint directory. Dropout (the RNG), Adam, per-rank values, DDP when there
are several workers. Writes ``$AIP_MODEL_DIR/model.pt`` and ``rankR.pt`` (values and four
RNG draws) at the end.

``local_tier.py STEPS STEP_TIME_S``; ``LOCAL_TIER_NO_PEER=1``: peer recovery off;
``LOCAL_TIER_DIR=PATH``: every rank's node-local tier in that one directory.
"""
import os
import sys
import time

import torch
from torch import nn

import resilient_train as rt

STEPS, STEP_TIME = int(sys.argv[1]), float(sys.argv[2])


def train(ctx: rt.Context) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.2), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ctx.track(model=model, optimizer=opt)
    torch.manual_seed(100 + ctx.rank)
    net = nn.parallel.DistributedDataParallel(model) if ctx.world_size > 1 else model
    for step in ctx.steps(STEPS):
        if step == ctx.restored_step:
            print(f"rank {ctx.rank}: resumed from step {step} "
                  f"(from {ctx.checkpoints.last_restore.describe()})", flush=True)
        x = torch.randn(16, 8)
        ctx.values["seen"] = ctx.values.get("seen", 0) + 16 * (ctx.rank + 1)
        loss = nn.functional.mse_loss(net(x), x[:, :1])
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(STEP_TIME)
    out = os.environ["AIP_MODEL_DIR"]
    os.makedirs(out, exist_ok=True)
    torch.save({"values": dict(ctx.values), "draws": torch.rand(4)},
               os.path.join(out, f"rank{ctx.rank}.pt"))
    if ctx.is_primary:
        torch.save(model.state_dict(), os.path.join(out, "model.pt"))


rt.main(train, options=rt.MainOptions(checkpoint=rt.CheckpointOptions(
    save_every_steps=5,
    node_local=rt.NodeLocal(directory=os.environ.get("LOCAL_TIER_DIR"), persistent_every=4),
    peer_recovery=not os.environ.get("LOCAL_TIER_NO_PEER"))))()
