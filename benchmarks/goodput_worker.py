"""The training job of benchmarks/bench_goodput.py (not a test; run by the benchmark).

    resilient-train launch --workers 2 --chaos "kill~8sx3" --chaos-seed 1 -- \\
        python benchmarks/goodput_worker.py --policy steps:100 --steps 1500 --step-time 0.02

A small synthetic job that is real where goodput is concerned: ``@rt.main`` forms the gloo
group, ``ctx.steps`` restores and saves by the chosen policy, and the workers step in
lockstep (one all-reduce of a small network's gradients per step, so a dead peer stops
the others and they re-form in-process). The tracked state is ``--state-mb`` MiB of float32
(a "table" parameter, a slice of which every step updates) plus the small network, so a save
costs what a checkpoint of that size costs on this disk. A step takes the small network's
forward/backward plus ``--step-time`` seconds of sleep: a fixed, known step time that does
not fight the launcher, the other worker and the background save for the 2 cores.

``--policy``: ``steps:N`` (every_n_steps(N)), ``seconds:S`` (every(S), e.g. 14400 for the
platform's 4 hours), ``auto`` (auto_interval(): the MTBF the launcher observed, else its
prior), ``auto:MTBF`` (auto_interval(MTBF), declared), ``never`` (only the final save).
``--auto-floor`` scales auto_interval's floor to this compressed job (30 s by default in
the SDK, for jobs of hours).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import resilient_train as rt
from resilient_train.checkpoint.schedule.policies import SavePolicy, every, every_n_steps, never


def make_policy(spec: str, auto_floor: float) -> SavePolicy:
    kind, _, value = spec.partition(":")
    if kind == "steps":
        return every_n_steps(int(value))
    if kind == "seconds":
        return every(float(value))
    if kind == "never":
        return never()
    if kind == "auto":
        try:
            from resilient_train.checkpoint.schedule.policies import auto_interval  # type: ignore[attr-defined]
        except ImportError as exc:  # being added by another change
            raise SystemExit(f"--policy auto: {exc}") from None
        return auto_interval(float(value) if value else None, floor_s=auto_floor)
    raise SystemExit(f"--policy: expected steps:N, seconds:S, auto[:MTBF] or never, "
                     f"found {spec!r}")


class Model(nn.Module):
    def __init__(self, state_mb: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
        rows = max(1, int(state_mb * 2**20) // (4 * 1024))
        self.table = nn.Parameter(torch.zeros(rows, 1024), requires_grad=False)


def train(ctx: rt.Context, args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    model = Model(args.state_mb)
    ctx.track(model=model)
    params = list(model.net.parameters())
    world = ctx.world_size
    rows = model.table.shape[0]
    for step in ctx.steps(args.steps):
        g = torch.Generator().manual_seed(step * world + ctx.rank)
        x = torch.randn(64, 32, generator=g)
        loss = (model.net(x) - x[:, :1]).pow(2).mean()
        for p in params:
            p.grad = None
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
        if world > 1:
            dist.all_reduce(flat)   # lockstep; fails when a peer died
        with torch.no_grad():
            i = 0
            for p in params:
                n = p.numel()
                p.sub_(flat[i:i + n].view_as(p), alpha=0.01 / world)
                i += n
            r = (step * 7) % rows
            model.table[r:r + 1].add_(loss.detach())
        ctx.values["data_position"] = step + 1
        if args.step_time > 0:
            time.sleep(args.step_time)
    if ctx.is_primary:
        print(f"done: {args.steps} steps, restored from {ctx.restored_step}, "
              f"policy {args.policy}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", required=True,
                   help="steps:N | seconds:S | auto | auto:MTBF_S | never")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--step-time", type=float, default=0.02, help="sleep per step (s)")
    p.add_argument("--state-mb", type=float, default=32.0, help="checkpointed state (MiB)")
    p.add_argument("--auto-floor", type=float, default=1.0,
                   help="auto_interval floor_s (s)")
    p.add_argument("--sync-save", action="store_true", help="async_save=False")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # auto_interval logs its interval (INFO): worth seeing in the worker log.
    logging.getLogger("resilient_train.checkpoint.schedule.policies").setLevel(logging.INFO)
    policy = make_policy(args.policy, args.auto_floor)
    options = rt.MainOptions(
        checkpoint=rt.CheckpointOptions(
            policy=policy, async_save=not args.sync_save,
            # never: no automatic saves, so the 4-hour ceiling goes too (by name)
            **({"max_interval_s": None} if isinstance(policy, never) else {})),
        distributed=rt.DistributedOptions(join_timeout_s=120))
    rt.main(train, options=options)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
