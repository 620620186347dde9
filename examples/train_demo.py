"""A small model trained with DDP that survives restarts: the README's main job.

Run it under the launcher (CPU: gloo; CUDA: nccl when a GPU is visible):

    resilient-train launch --workers 2 --chaos "kill:workerpool1-0@8s" -- python examples/train_demo.py

`rt.init_distributed()` forms the process group whatever order the workers start in.
The CheckpointManager saves every ``--save-every`` steps (crash-proof, in the background)
to ``AIP_CHECKPOINT_DIR``, which the launcher and the platform set, and every (re)started
worker resumes from the latest committed step: weights, optimizer, RNG states and the data
position. When a peer dies and is restarted, the survivors notice within a second,
re-form the group and resume from the same checkpoint in-process (`group.run`), so the
platform's job-retry budget is not spent. A SIGTERM (maintenance, preemption) triggers an
emergency save and exit 134.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn

import resilient_train as rt


def batch(step: int, rank: int, world: int, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of a step depends only on the step: a resumed run sees the same batches."""
    g = torch.Generator().manual_seed(1000 + step * world + rank)
    x = torch.randn(size, 16, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True) - x[:, 4:8].prod(dim=1, keepdim=True)).tanh()
    return x, y


@rt.record  # an escaping exception: an error report and the right exit code (134: transient)
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--step-time", type=float, default=0.05, help="extra seconds per step, "
                   "so faults land mid-training")
    p.add_argument("--checkpoint-dir", default=None, help="default: AIP_CHECKPOINT_DIR, "
                   "else ./checkpoints")
    p.add_argument("--hang-timeout", type=float, default=None,
                   help="exit transient when no step finishes for this many seconds")
    p.add_argument("--hang-at-step", type=int, default=None,
                   help="(fault injection) rank 1 sleeps forever inside this step, once")
    args = p.parse_args()

    group = rt.init_distributed(rt.DistributedOptions(hang_timeout_s=args.hang_timeout))
    with group:  # destroys the process group on every way out
        group.run(train, args, group)  # called again after an in-process recovery


def train(args: argparse.Namespace, group: rt.DistributedGroup) -> None:
    """What a (re)started worker runs: build, restore the latest checkpoint, train on."""
    device = group.device
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    with rt.CheckpointManager(args.checkpoint_dir, options=rt.CheckpointOptions(
            save_every_steps=args.save_every, save_on_sigterm=True)) as mgr:
        mgr.track(model=model, optimizer=opt)
        start = mgr.restore_latest() or 0
        if start:
            print(f"rank {group.rank}: resumed from step {start} (generation "
                  f"{group.generation}, {mgr.storage.url})", flush=True)
        loss = torch.tensor(float("nan"))
        ddp = nn.parallel.DistributedDataParallel(model) if group.world_size > 1 else model
        for step in range(start, args.steps):
            x, y = (t.to(device) for t in batch(step, group.rank, group.world_size))
            loss = nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()              # the gradient all-reduce: fails if a peer died
            opt.step()
            time.sleep(args.step_time)
            if (step == args.hang_at_step and group.rank == 1
                    and os.environ.get("RESILIENT_TRAIN_ATTEMPT", "1") == "1"):
                time.sleep(10_000)       # a hung worker: the watchdog must notice
            mgr.values["data_position"] = step + 1
            mgr.maybe_save(step + 1)      # by policy; on SIGTERM: emergency save, exit 134
            group.step_done(step + 1)     # hang watchdog; raises if a peer restarted
            if group.is_primary and (step + 1) % 20 == 0:
                print(f"step {step + 1}/{args.steps} loss {loss.item():.4f}", flush=True)
        if mgr.last_saved_step != args.steps:
            mgr.save(args.steps)
    if group.is_primary:
        print(f"finished {args.steps} steps, final loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
