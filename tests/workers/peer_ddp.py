"""A DDP job whose every kind of state matters for an exact resume: dropout (the RNG), a
shuffled ResumableLoader with a worker process (the data position), AdamW and a schedule
(the optimizer), per-rank ``ctx.values``. ``find_unused_parameters=True`` keeps DDP's first
bucket layout, so 3 ranks sum in the same order after a resume (docs/checkpointing.md).

``peer_ddp.py STEPS SAVE_EVERY STEP_TIME_S``: the primary writes ``$AIP_MODEL_DIR/model.pt``,
and every rank ``rank{R}.pt``: its ``values`` and four draws from its RNG at the end.
"""
import os
import sys
import time

import torch
from torch import nn
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
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.7)
    torch.manual_seed(100 + ctx.rank)   # each rank its own dropout stream
    loader = rt.ResumableLoader(Data(), batch_size=8, shuffle=True, seed=0, num_workers=1)
    ctx.track(model=model, optimizer=opt, scheduler=sched, data=loader)
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    batches = loader.forever()
    for step in ctx.steps(STEPS):
        if step == ctx.restored_step:
            print(f"rank {ctx.rank}: resumed from step {step} "
                  f"(from {ctx.checkpoints.last_restore.describe()})", flush=True)
        x, y = next(batches)
        ctx.values["seen"] = ctx.values.get("seen", 0) + len(x) * (ctx.rank + 1)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        time.sleep(STEP_TIME)
    out = os.environ["AIP_MODEL_DIR"]
    os.makedirs(out, exist_ok=True)
    torch.save({"values": dict(ctx.values), "draws": torch.rand(4)},
               os.path.join(out, f"rank{ctx.rank}.pt"))
    if ctx.is_primary:
        torch.save(model.state_dict(), os.path.join(out, "model.pt"))
        print(f"finished {STEPS} steps", flush=True)


rt.main(train, options=rt.MainOptions(
    checkpoint=rt.CheckpointOptions(save_every_steps=SAVE_EVERY)))()
