"""A training script written the way README.md ("Your training script") shows, for the runtime
tests.

Environment: CKPT (checkpoint directory), STEPS, FAIL_AT (raise at this step, once: the
marker file FAIL_ONCE says it already happened), FAIL_KIND (transient | bug | network), OUT (where
the final weights go), BARRIER_EVERY (a named group barrier every N steps), STEP_S (a sleep
per step), PAUSE_AT (this step sleeps PAUSE_S, 120 s by default), GATE_AT (this step
creates the file GATE and goes on once the test has removed it), SHOW_LIVES (each life
prints its storage handle and the writable probes this process has run so far).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
from torch import nn

import resilient_train as rt


class _Probes(logging.Handler):
    """Counts the checkpoint directory's writable probes (storage/base.py's debug line)."""

    count = 0

    def emit(self, record: logging.LogRecord) -> None:
        _Probes.count += record.getMessage().endswith(" is writable")


if os.environ.get("SHOW_LIVES"):
    _storage_log = logging.getLogger("resilient_train.checkpoint.storage.base")
    _storage_log.setLevel(logging.DEBUG)
    _storage_log.addHandler(_Probes())


@rt.main(options=rt.MainOptions(
    checkpoint_dir=os.environ["CKPT"],
    checkpoint=rt.CheckpointOptions(save_every_steps=5, async_save=True)))
def train(ctx: rt.Context) -> None:
    if os.environ.get("SHOW_LIVES"):
        print(f"life rank={ctx.rank} storage={id(ctx.checkpoints.storage)} "
              f"probes={_Probes.count}", flush=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ctx.track(model=model, optimizer=opt)
    fail_at = int(os.environ.get("FAIL_AT", "-1"))
    once = Path(os.environ.get("FAIL_ONCE", "/nonexistent/x"))
    for step in ctx.steps(int(os.environ.get("STEPS", "20"))):
        x = torch.randn(32, 8)  # the global RNG: restored exactly from the checkpoint
        loss = (model(x) - x[:, :1]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.values["data_position"] = step + 1
        if os.environ.get("BARRIER_EVERY") and (step + 1) % int(os.environ["BARRIER_EVERY"]) == 0:
            ctx.group.barrier("eval", timeout_s=30)   # all ranks meet, as for an evaluation
        time.sleep(float(os.environ.get("STEP_S", "0")))
        if step == int(os.environ.get("GATE_AT", "-1")):
            gate = Path(os.environ["GATE"])
            gate.touch()
            while gate.exists():
                time.sleep(0.02)
        if step == int(os.environ.get("PAUSE_AT", "-1")):
            time.sleep(float(os.environ.get("PAUSE_S", "120")))   # a signal lands inside it
        if step == fail_at and not once.exists():
            once.touch()
            if os.environ.get("FAIL_KIND") == "bug":
                raise ValueError("a bug in the training step")
            if os.environ.get("FAIL_KIND") == "network":
                raise ConnectionResetError(104, "Connection reset by peer (the data service)")
            raise rt.TransientError("the data loader lost its connection")
    if ctx.is_primary:
        torch.save(model.state_dict(), os.environ["OUT"])
    print(f"restored_step={ctx.restored_step} data_position={ctx.values['data_position']}",
          flush=True)


if __name__ == "__main__":
    train()
