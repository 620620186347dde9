"""A small model trained with DDP that survives restarts: the README's main job.

Run it under the launcher (CPU: gloo; CUDA: nccl when a GPU is visible):

    resilient-train launch --workers 2 --chaos "kill:workerpool1-0@8s" -- python examples/train_demo.py

It checkpoints every ``--save-every`` steps with an atomic write (temp file, fsync,
rename) and resumes from the latest checkpoint after any restart. Until the SDK's
CheckpointManager and decorator land, this file does by hand what they will do.
A failed collective (a peer died) exits with the transient code, so the platform
retries the job from the last checkpoint instead of failing it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from resilient_train.cluster import ClusterInfo
from resilient_train.errors import exit_transient


def batch(step: int, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of a step depends only on the step: a resumed run sees the same batches."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size, 16, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True) - x[:, 4:8].prod(dim=1, keepdim=True)).tanh()
    return x, y


def save(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # a crash leaves the old checkpoint or the new one, never half
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _peer_lost(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, dist.DistBackendError) or "Connection" in text or "Gloo" in text


def train(ddp: nn.Module, model: nn.Module, opt: torch.optim.Optimizer, ckpt: Path, start: int,
          args: argparse.Namespace, info: ClusterInfo, device: torch.device,
          stop: dict[str, bool]) -> torch.Tensor:
    loss = torch.tensor(float("nan"))
    for step in range(start, args.steps):
        x, y = (t.to(device) for t in batch(step * info.world_size + info.rank))
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()          # the gradient all-reduce: fails if a peer died
        opt.step()
        time.sleep(args.step_time)
        done = step + 1
        if info.is_primary and (done % args.save_every == 0 or done == args.steps or stop["signal"]):
            save(ckpt, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": done})
        if info.is_primary and done % 20 == 0:
            print(f"step {done}/{args.steps} loss {loss.item():.4f}", flush=True)
        if stop["signal"]:
            exit_transient(f"SIGTERM at step {done}: checkpoint saved, run me again")
    return loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--step-time", type=float, default=0.05, help="extra seconds per step, "
                   "so faults land mid-training")
    p.add_argument("--checkpoint-dir", default=os.environ.get("AIP_CHECKPOINT_DIR", "checkpoints"))
    args = p.parse_args()

    info = ClusterInfo.from_env()
    device = torch.device("cuda", info.local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if info.world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=60))
    stop = {"signal": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(signal=True))

    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ckpt = Path(args.checkpoint_dir) / "demo.pt"
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"])
        print(f"rank {info.rank}: resumed from step {start} ({ckpt})", flush=True)
    try:
        ddp = nn.parallel.DistributedDataParallel(model) if info.world_size > 1 else model
        loss = train(ddp, model, opt, ckpt, start, args, info, device, stop)
    except (RuntimeError, dist.DistBackendError) as exc:
        if info.world_size > 1 and _peer_lost(exc):
            exit_transient(f"a peer left the process group: {exc}", exc=exc)
        raise
    if info.world_size > 1:
        dist.destroy_process_group()
    if info.is_primary:
        print(f"finished {args.steps} steps, final loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
