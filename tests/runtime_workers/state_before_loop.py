"""Code before the loop that reads restored state (``data.epoch``), as users write it.

Environment: CKPT (checkpoint directory), STEPS, EARLY (call ``ctx.restore()`` before
reading), LATE (track one more object after the loop). Prints what it read before the
loop (``data.epoch``, ``ctx.values["best"]``), what ``ctx.restore()`` returned, the first
step of the loop and whether the loop restored (again).
"""

from __future__ import annotations

import os

import torch

import resilient_train as rt


@rt.main(options=rt.MainOptions(checkpoint_dir=os.environ["CKPT"],
                                checkpoint=rt.CheckpointOptions(save_every_steps=4)))
def train(ctx: rt.Context) -> None:
    model = torch.nn.Linear(2, 1)
    data = rt.ResumableLoader(torch.arange(10.0), batch_size=2, shuffle=False)  # 5 a epoch
    ctx.track(model=model, data=data)
    restored = ctx.restore() if os.environ.get("EARLY") else "not called"
    ctx.values.setdefault("seen", 0)          # a default: the restore may replace it
    best = ctx.values.get("best", 100.0)      # a read: stale unless restored first
    print(f"restore()={restored} epoch_before_loop={data.epoch} best={best}", flush=True)
    record = ctx.checkpoints.last_restore   # a restore in the loop would make a new one
    batches = data.forever()
    for step in ctx.steps(int(os.environ["STEPS"])):
        if step == ctx.restored_step or (step == 0 and ctx.restored_step is None):
            print(f"first_step={step} restored_again={ctx.checkpoints.last_restore is not record}",
                  flush=True)
        next(batches)
        ctx.values["best"] = best = min(best, 50.0 - step)
        ctx.values["seen"] += 1
    if ctx.is_primary:   # a user's own artifact: loadable as weights only
        torch.save({"values": ctx.values}, os.path.join(os.environ["CKPT"], "values.pt"))
    if os.environ.get("LATE"):
        ctx.track(late=torch.nn.Linear(1, 1))


if __name__ == "__main__":
    train()
