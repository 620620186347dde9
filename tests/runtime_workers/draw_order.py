"""One training run, its loop written in one of the orders users write (ORDER):

- ``steps-first``: README.md's, ``for step in ctx.steps(n)``, then ``next(batches)``;
- ``draw-first``: an epoch loop, ``for x, y in data: step = next(steps)``: a step's batch
  is drawn before ctx.steps has ended the step before it;
- ``prefetch``: the next batch is drawn at the end of the body, after ``opt.step()``;
- ``zip``: ``for (x, y), step in zip(data, ctx.steps(n))`` over one epoch: the data runs
  out first, so ctx.steps never sees the last step end; ``zip-unrestored`` leaves out
  the ``ctx.restore()`` that must come before the loader's iterator starts.

Every order trains the same batches in the same order. ``ctx.values["seen"]`` lists the
batches each step trained on (saved and restored with the checkpoint). Environment: CKPT,
OUT (the final weights, the seen list), ORDER, FAIL_AT (a transient failure after that
step's optimizer step, once: FAIL_ONCE marks it done), UNTRACKED_DATA (the loader is left
untracked).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

import resilient_train as rt

EPOCHS, BATCH = 3, 4


class Indexed(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x = torch.Generator().manual_seed(i)
        return torch.randn(6, generator=x), torch.tensor([float(i % 3)]), i


@rt.main(options=rt.MainOptions(
    checkpoint_dir=os.environ["CKPT"],
    checkpoint=rt.CheckpointOptions(save_every_steps=4, async_save=False)))
def train(ctx: rt.Context) -> None:
    torch.manual_seed(0)
    model = nn.Linear(6, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)   # per epoch
    data = rt.ResumableLoader(Indexed(), batch_size=BATCH, shuffle=True)
    if os.environ.get("UNTRACKED_DATA"):   # a mistake: the position is in no checkpoint
        ctx.track(model=model, optimizer=opt, sched=sched)
    else:
        ctx.track(model=model, optimizer=opt, sched=sched, data=data)
    ctx.values.setdefault("seen", [])
    fail_at = int(os.environ.get("FAIL_AT", "-1"))
    once = Path(os.environ.get("FAIL_ONCE", "/nonexistent/x"))

    def step_on(step: int, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        x, y, ids = batch
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        ctx.values["seen"] = [*ctx.values["seen"], ids.tolist()]
        opt.step()
        if (step + 1) % len(data) == 0:
            sched.step()                          # the epoch's last step
        if step == fail_at and not once.exists():
            once.touch()
            raise rt.TransientError("the data service went away")

    order, total = os.environ["ORDER"], EPOCHS * len(data)
    if order == "steps-first":
        batches = data.forever()
        for step in ctx.steps(total):
            step_on(step, next(batches))
    elif order == "draw-first":
        ctx.restore()
        steps = iter(ctx.steps(total))
        for _ in range(data.epoch, EPOCHS):
            for batch in data:
                step_on(next(steps), batch)
    elif order == "prefetch":
        ctx.restore()          # before the first batch is drawn
        batches = data.forever()
        batch = next(batches)
        for step in ctx.steps(total):
            step_on(step, batch)
            batch = next(batches)
    elif order in ("zip", "zip-unrestored"):   # one epoch per run
        if order == "zip":
            ctx.restore()      # before the loader's iterator starts
        for batch, step in zip(data, ctx.steps(total)):
            step_on(step, batch)
    torch.save({"weights": model.state_dict(), "seen": ctx.values["seen"],
                "restored": ctx.restored_step}, os.environ["OUT"])


if __name__ == "__main__":
    train()
