"""A small model trained with DDP that survives restarts: the README's main job.

Run it under the launcher (CPU: gloo; CUDA: nccl when a GPU is visible):

    resilient-train launch --workers 2 --chaos "kill:workerpool1-0@8s" -- python examples/train_demo.py

The CheckpointManager saves every ``--save-every`` steps (crash-proof, in the
background) to ``AIP_CHECKPOINT_DIR``, which the launcher and the platform set, and
every (re)started worker resumes from the latest committed step: weights, optimizer,
RNG states and the data position. A SIGTERM (maintenance, preemption) triggers an
emergency save and exit 134. A failed collective (a peer died) exits with the transient
code too, so the platform retries the job from the last checkpoint instead of failing it.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import resilient_train as rt


def batch(step: int, rank: int, world: int, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of a step depends only on the step: a resumed run sees the same batches."""
    g = torch.Generator().manual_seed(1000 + step * world + rank)
    x = torch.randn(size, 16, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True) - x[:, 4:8].prod(dim=1, keepdim=True)).tanh()
    return x, y


def _peer_lost(exc: BaseException) -> bool:
    text = str(exc)
    return (isinstance(exc, dist.DistError) or "Connection" in text or "Gloo" in text
            or "timed out" in text.lower())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--step-time", type=float, default=0.05, help="extra seconds per step, "
                   "so faults land mid-training")
    p.add_argument("--checkpoint-dir", default=None, help="default: AIP_CHECKPOINT_DIR, "
                   "else ./checkpoints")
    args = p.parse_args()

    info = rt.ClusterInfo.from_env()
    device = torch.device("cuda", info.local_rank) if torch.cuda.is_available() else torch.device("cpu")
    try:
        train(args, info, device)
    except (RuntimeError, dist.DistError) as exc:
        # A peer died or restarted (in a collective, or while the group forms): transient.
        if info.world_size > 1 and _peer_lost(exc):
            rt.exit_transient(f"a peer left the process group: {exc}", exc=exc)
        raise
    if info.world_size > 1:
        dist.destroy_process_group()


def train(args: argparse.Namespace, info: rt.ClusterInfo, device: torch.device) -> None:
    if info.world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    mgr = rt.CheckpointManager(args.checkpoint_dir, options=rt.CheckpointOptions(
        save_every_steps=args.save_every, save_on_sigterm=True))
    mgr.track(model=model, optimizer=opt)
    start = mgr.restore_latest() or 0
    if start:
        print(f"rank {info.rank}: resumed from step {start} ({mgr.storage.url})", flush=True)

    loss = torch.tensor(float("nan"))
    ddp = nn.parallel.DistributedDataParallel(model) if info.world_size > 1 else model
    for step in range(start, args.steps):
        x, y = (t.to(device) for t in batch(step, info.rank, info.world_size))
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()              # the gradient all-reduce: fails if a peer died
        opt.step()
        time.sleep(args.step_time)
        mgr.values["data_position"] = step + 1
        mgr.maybe_save(step + 1)      # by policy; on SIGTERM: emergency save, exit 134
        if info.is_primary and (step + 1) % 20 == 0:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f}", flush=True)
    if mgr.last_saved_step != args.steps:
        mgr.save(args.steps)
    mgr.close()                       # waits for the save in flight
    if info.is_primary:
        print(f"finished {args.steps} steps, final loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
