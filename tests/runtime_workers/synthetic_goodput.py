"""A synthetic job with known step times for the goodput accounting test.

Every step sleeps STEP_S; every 10th step a synchronous save of a 16 MB state blocks the
loop. Besides the launcher's telemetry, the script keeps its own oracle: one line per
finished step with its exact start and end and the process, appended and flushed, so a
SIGKILL loses at most the step it interrupted (which is not finished, so it is not
productive anyway).
"""

from __future__ import annotations

import gc
import json
import os
import time

import torch

import resilient_train as rt

STEPS = int(os.environ.get("STEPS", "100"))
STEP_S = float(os.environ.get("STEP_S", "0.1"))


@rt.main(options=rt.MainOptions(
    checkpoint=rt.CheckpointOptions(save_every_steps=10, async_save=False)))
def train(ctx: rt.Context) -> None:
    state = torch.nn.Linear(2048, 2048)
    ctx.track(model=state)
    # A full collection walks every object that importing torch made: 70-110 ms here, a
    # pause the oracle would charge to the save when it lands in a save's gap. Frozen,
    # those objects are not walked again (torchtitan does the same in its trainer).
    gc.freeze()
    with open(os.environ["ORACLE"], "a", encoding="utf-8") as oracle:
        for step in ctx.steps(STEPS):
            t0 = time.time()
            time.sleep(STEP_S)
            t1 = time.time()
            oracle.write(json.dumps([step, t0, t1, os.getpid()]) + "\n")
            oracle.flush()


if __name__ == "__main__":
    train()
