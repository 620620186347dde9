"""An FSDP2 job (``fully_shard`` on CPU over gloo) whose every kind of state matters for an
exact resume: sharded weights and AdamW moments, dropout (the RNG), a shuffled
ResumableLoader (the data position), a schedule, per-rank ``ctx.values``.

``fsdp_job.py STEPS SAVE_EVERY STEP_TIME_S``: the primary writes the full weights to
``$AIP_MODEL_DIR/model.pt``, and every rank ``rank{R}.pt``: its ``values`` and four draws
from its RNG at the end.
"""
import os
import sys
import time

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import Dataset

import resilient_train as rt

STEPS, SAVE_EVERY, STEP_TIME = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])


class Data(Dataset):
    def __len__(self) -> int:
        return 600

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(16, generator=torch.Generator().manual_seed(i))
        return x, x[:4].sum(dim=0, keepdim=True).tanh()


def train(ctx: rt.Context) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.7)
    torch.manual_seed(100 + ctx.rank)   # each rank its own dropout stream
    loader = rt.ResumableLoader(Data(), batch_size=8, shuffle=True, seed=0)
    ctx.track(model=model, optimizer=opt, scheduler=sched, data=loader)
    batches = loader.forever()
    for step in ctx.steps(STEPS):
        if step == ctx.restored_step:
            print(f"rank {ctx.rank}: resumed from step {step} "
                  f"(from {ctx.checkpoints.last_restore.describe()})", flush=True)
        x, y = next(batches)
        ctx.values["seen"] = ctx.values.get("seen", 0) + len(x) * (ctx.rank + 1)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        time.sleep(STEP_TIME)
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}   # collective
    out = os.environ["AIP_MODEL_DIR"]
    os.makedirs(out, exist_ok=True)
    torch.save({"values": dict(ctx.values), "draws": torch.rand(4)},
               os.path.join(out, f"rank{ctx.rank}.pt"))
    if ctx.is_primary:
        torch.save(full, os.path.join(out, "model.pt"))
        print(f"finished {STEPS} steps", flush=True)


rt.main(train, options=rt.MainOptions(
    checkpoint=rt.CheckpointOptions(save_every_steps=SAVE_EVERY)))()
