"""A small model trained with DDP that survives restarts: the README's main job.

Run it under the launcher (CPU: gloo; CUDA: nccl when a GPU is visible):

    resilient-train launch --workers 2 --chaos "kill:workerpool1-0@8s" -- python examples/train_demo.py

`rt.main` forms the process group whatever order the workers start in, and `ctx.steps`
saves every ``--save-every`` steps (crash-proof, in the background) to
``AIP_CHECKPOINT_DIR``, which the launcher and the platform set. When a peer dies and is
restarted, the survivors notice within a second, re-form the group and call `train`
again in-process, and every rank resumes from the step the survivors had finished, out of
their memory (weights, optimizer, RNG states and the data position; at most the step in
flight is lost), so the platform's job-retry budget is not spent. A worker with no
survivor to copy from (the whole job restarted) resumes from the latest committed step. A SIGTERM (maintenance, preemption)
triggers an emergency save and exit 134; an exception becomes an error report and the
exit code the platform understands.
"""

from __future__ import annotations

import argparse
import os
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


def train(ctx: rt.Context, args: argparse.Namespace) -> None:
    """One life of the run (a restarted worker, or the survivors after an in-process re-form,
    call it again): build, then `ctx.steps` restores the latest checkpoint and trains on."""
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)).to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx.track(model=model, optimizer=opt)
    ddp = nn.parallel.DistributedDataParallel(model) if ctx.world_size > 1 else model
    loss = torch.tensor(float("nan"))
    for step in ctx.steps(args.steps):   # after each step: save by policy, feed the watchdog
        if step == ctx.restored_step:
            print(f"rank {ctx.rank}: resumed from step {step} "
                  f"(from {ctx.checkpoints.last_restore.describe()})", flush=True)
        x, y = (t.to(ctx.device) for t in batch(step, ctx.rank, ctx.world_size))
        # Saved with every checkpoint. Set before opt.step(): the copy a peer holds for
        # this rank is taken there, and is then already final (docs/checkpointing.md).
        ctx.values["data_position"] = step + 1
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()                  # the gradient all-reduce: fails if a peer died
        opt.step()
        time.sleep(args.step_time)
        if (step == args.hang_at_step and ctx.rank == ctx.world_size - 1
                and os.environ.get("RESILIENT_TRAIN_ATTEMPT", "1") == "1"):
            time.sleep(10_000)           # a hung worker: the watchdog must notice
        if ctx.is_primary and (step + 1) % 20 == 0:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f}", flush=True)
    if ctx.is_primary:
        print(f"finished {args.steps} steps, final loss {loss.item():.4f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
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
    # Options that depend on the command line: decorate at run time instead of with @.
    options = rt.MainOptions(
        checkpoint_dir=args.checkpoint_dir,
        checkpoint=rt.CheckpointOptions(save_every_steps=args.save_every),
        distributed=rt.DistributedOptions(hang_timeout_s=args.hang_timeout))
    rt.main(train, options=options)(args)


if __name__ == "__main__":
    main()
