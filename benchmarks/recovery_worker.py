"""The training job of benchmarks/bench_recovery.py (not a test; run by the benchmark).

    resilient-train launch --workers 3 -- python benchmarks/recovery_worker.py \
        --steps 60 --save-every 10 [--checkpoint-dir DIR|gs://bucket/run] [--no-peer]
        [--node-local K]
    torchrun --nproc-per-node 3 benchmarks/recovery_worker.py --steps 60 ...

DDP over gloo under ``rt.main`` with a synthetic model whose training state is about
0.5 GiB per rank: ``--params-m`` million float32 parameters (default 45: 180 MB) in a few
square Linear layers, plus AdamW's two moments (360 MB). The forward and backward run on
a tiny batch so that a step costs mostly what state of that size costs anyway: the
gradient all-reduce and the optimizer's pass over the state.

``--no-peer`` is ``CheckpointOptions(peer_recovery=False)``: every restore then reads the
checkpoint storage (read once: the primary reads the shared file and broadcasts it).
``--keep-last`` (default 1) bounds what the checkpoint directory holds: the GCS emulator
keeps every object in RAM. ``BENCH_RECOVERY_ARGS``, when set, holds more arguments, read
before the command line's.

Under torchrun the same file runs unchanged. When bench_soak.run_torchrun starts it
(``BENCH_SOAK_DIR`` set, no telemetry prefix yet), benchmarks/soak_torchrun_worker.py
first gives the process what the launcher gives a worker life (the telemetry prefix, a
pid file for the harness's SIGKILL), then runs this file again, in this process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

import torch
from torch import nn

import resilient_train as rt

T_IMPORTED = time.time()   # torch and resilient_train imported
ARGS_ENV = "BENCH_RECOVERY_ARGS"
MARK = "BENCH_RECOVERY_LIFE"   # the line this worker prints per life, for the benchmark
BATCH = 4   # tiny: the state's size, not the arithmetic, is what this job measures


def model_for(params_m: float, layers: int = 4) -> nn.Sequential:
    """``layers`` square Linear layers holding about ``params_m`` million parameters."""
    width = max(8, int(math.sqrt(params_m * 1e6 / layers)))
    mods: list[nn.Module] = []
    for i in range(layers):
        mods.append(nn.Linear(width, width))
        if i < layers - 1:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def process_start() -> float | None:
    """When this process was created (epoch s, to about 10 ms): /proc's start time in
    clock ticks since boot, against /proc/uptime (btime has whole seconds only)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])   # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def batch(step: int, rank: int, world: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's data depends only on the step and rank: a resumed run sees the same."""
    g = torch.Generator().manual_seed(1000 + step * world + rank)
    x = torch.randn(BATCH, width, generator=g)
    return x, x.roll(1, dims=1).tanh()


def train(ctx: rt.Context, args: argparse.Namespace) -> None:
    """One life: build, restore (``ctx.steps``), train on."""
    t_train = time.time()   # rt.main formed the group and made the checkpoint manager
    t_build = time.perf_counter()
    torch.manual_seed(0)   # every rank builds the same initial weights
    model = model_for(args.params_m)
    width = int(next(model.parameters()).shape[1])   # the first Linear's input width
    # foreach=False (CPU's default anyway): the foreach kernels make temporaries as large
    # as the state, memory that 3 ranks x 0.5 GiB on this machine do not have to spare.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    ctx.track(model=model, optimizer=opt)
    # init_sync=False: every rank built the same seeded weights and the restore below
    # gives every rank the same state, so DDP's own broadcast of the parameters (180 MB)
    # at construction would only repeat it. gradient_as_bucket_view: no second gradient copy.
    ddp = nn.parallel.DistributedDataParallel(model, init_sync=False,
                                              gradient_as_bucket_view=True)
    build_s = time.perf_counter() - t_build
    # This life's start-up, for bench_recovery.py: spawn -> imports -> rt.main's group
    # formation -> the model and optimizer built (the restore follows at once).
    print(MARK, json.dumps({"rank": ctx.rank, "pid": os.getpid(), "t_spawn": process_start(),
                            "t_imported": T_IMPORTED, "t_train": t_train,
                            "t_built": time.time()}), flush=True)
    for step in ctx.steps(args.steps):
        if step == ctx.restored_step or (ctx.restored_step is None and step == 0):
            nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
            rec = ctx.checkpoints.last_restore
            print(f"rank {ctx.rank}: at step {step} (restored from "
                  f"{rec.describe() if rec else '-'}); built the model in "
                  f"{build_s:.2f} s; parameters {nbytes / 2**20:.0f} MiB", flush=True)
        x, y = batch(step, ctx.rank, ctx.world_size, width)
        # Before opt.step(): the copy a peer holds for this rank is taken there.
        ctx.values["data_position"] = step + 1
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad(set_to_none=False)   # keep the gradients as DDP's bucket views
        loss.backward()                    # the gradient all-reduce: fails if a peer died
        opt.step()
        if args.step_time:
            time.sleep(args.step_time)
        if ctx.is_primary and (step + 1) % 10 == 0:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.5f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--step-time", type=float, default=0.0,
                   help="extra seconds of sleep per step (default none)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="a path or gs:// URL (default: AIP_CHECKPOINT_DIR, else ./checkpoints)")
    p.add_argument("--no-peer", action="store_true",
                   help="CheckpointOptions(peer_recovery=False): restores read storage")
    p.add_argument("--keep-last", type=int, default=1, help="RetentionPolicy(keep_last=N)")
    p.add_argument("--node-local", type=int, default=0, metavar="K",
                   help="a node-local tier, every K-th save to the checkpoint directory too "
                        "(NodeLocal(persistent_every=K); default none)")
    p.add_argument("--params-m", type=float, default=45.0,
                   help="million float32 parameters (default 45: 0.5 GiB with AdamW's moments)")
    # A harness whose command line is fixed (bench_soak's run_job and run_torchrun) adds
    # arguments through the environment; the command line's own come after and win.
    args = p.parse_args([*shlex.split(os.environ.get(ARGS_ENV, "")), *sys.argv[1:]])
    options = rt.MainOptions(
        checkpoint_dir=args.checkpoint_dir,
        checkpoint=rt.CheckpointOptions(
            save_every_steps=args.save_every, peer_recovery=not args.no_peer,
            retention=rt.RetentionPolicy(keep_last=args.keep_last),
            node_local=rt.NodeLocal(persistent_every=args.node_local)
            if args.node_local else None),
        final_save=False)   # the benchmark measures recoveries, not a last 0.5 GiB write
    rt.main(train, options=options)(args)


if __name__ == "__main__":
    if os.environ.get("BENCH_SOAK_DIR") and not os.environ.get("RESILIENT_TRAIN_TELEMETRY"):
        # Started by bench_soak.run_torchrun: its wrapper sets this life's telemetry prefix
        # and pid file, then runs this file again (the prefix set: the branch below).
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import soak_torchrun_worker

        soak_torchrun_worker.DEMO = Path(__file__).resolve()
        soak_torchrun_worker.main()
    else:
        main()
