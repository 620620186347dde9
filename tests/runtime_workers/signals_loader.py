"""A training loop fed by ``rt.ResumableLoader(num_workers=2)``, for the signal tests.

Environment: CKPT (checkpoint directory), STEPS, MICRO (batches per step: micro-batches),
STEP_S (a sleep per step), PAUSE_AT (a step index: after its first batch it prints
``paused N``, sleeps PAUSE_S, prints ``resumed N``, then draws the next), PLAIN=1 (a plain
DataLoader over the same data instead of the ResumableLoader), DRAW_FIRST=1 (an epoch
loop's order, one batch per step: each step's batch is drawn before ctx.steps ends the
step before it; PAUSE_AT pauses at the end of that step, after its optimizer step).
Prints ``step N batch FIRST`` once step N (0-based) has its batches (FIRST: the first
sample of its first batch) and ``done N`` after it, so a test waits on a line, not on a
sleep; ``restored R position P`` at the start.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import time
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import resilient_train as rt


@rt.main(options=rt.MainOptions(
    checkpoint_dir=os.environ["CKPT"],
    checkpoint=rt.CheckpointOptions(save_every_steps=1000)))
def train(ctx: rt.Context) -> None:
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = TensorDataset(torch.arange(4096, dtype=torch.float32).unsqueeze(1))
    plain = os.environ.get("PLAIN") == "1"
    resumable = rt.ResumableLoader(dataset, batch_size=4, seed=1, num_workers=2)
    batches: Iterator[list[torch.Tensor]]
    if plain:
        batches = iter(DataLoader(dataset, batch_size=4, num_workers=2))
        ctx.track(model=model, optimizer=opt)
    else:
        batches = resumable.forever()
        ctx.track(model=model, optimizer=opt, data=resumable)
    micro = int(os.environ.get("MICRO", "1"))
    step_s = float(os.environ.get("STEP_S", "0.02"))
    pause_at = int(os.environ.get("PAUSE_AT", "-1"))
    if os.environ.get("DRAW_FIRST") == "1":
        steps = iter(ctx.steps(int(os.environ.get("STEPS", "1000"))))
        for (x,) in batches:
            step = next(steps, None)
            if step is None:
                break
            print(f"step {step} batch {int(x[0, 0])}", flush=True)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            print(f"done {step}", flush=True)
            if step == pause_at:
                print(f"paused {step}", flush=True)
                time.sleep(float(os.environ.get("PAUSE_S", "1.0")))
        return
    for step in ctx.steps(int(os.environ.get("STEPS", "1000"))):
        if step == ctx.restored_step or (step == 0 and ctx.restored_step is None):
            position = resumable.state_dict()["consumed"] if not plain else -1
            print(f"restored {ctx.restored_step} position {position}", flush=True)
        for i in range(micro):
            (x,) = next(batches)
            if i == 0:
                print(f"step {step} batch {int(x[0, 0])}", flush=True)
            model(x).pow(2).mean().backward()
            time.sleep(step_s / micro)
            if step == pause_at and i == 0:
                print(f"paused {step}", flush=True)
                time.sleep(float(os.environ.get("PAUSE_S", "1.0")))
                print(f"resumed {step}", flush=True)
        opt.step()
        opt.zero_grad()
        print(f"done {step}", flush=True)


if __name__ == "__main__":
    # A test that finds this process stuck sends SIGUSR1 for every thread's stack.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if os.environ.get("LOG_LEVEL"):
        logging.basicConfig(level=os.environ["LOG_LEVEL"])
    train()
