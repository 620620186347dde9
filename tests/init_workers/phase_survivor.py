"""Four ranks train through one phase per generation; in each, one rank dies mid-phase and
is replaced by a new process (as the platform restarts a worker in place).

Generation g runs phase PHASES[g] and rank DEAD[g] dies one second into it, after
starting its own replacement. With four ranks, gloo's algorithms make some survivors wait
on *another survivor* rather than on the dead rank: those are released only because every
survivor shuts down its own connections (distributed/sever.py), not at the collective
timeout. After the last phase every rank trains a few DDP steps in the final generation
and writes ``RESULT_DIR/rank<R>.json``: per generation, how long after the death its
phase failed.

Phases: ``ddp`` (forward, backward's all-reduce, optimizer step), ``allreduce`` (one
large all-reduce), ``coordination`` (the checkpoint manager's broadcast, all-reduce and
gather on its own gloo groups), ``barrier`` (the group's named barrier on the store: it
ends when the replacement starts the next generation).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import resilient_train as rt
from resilient_train.checkpoint.schedule.coordination import TorchDistributed

rank = int(os.environ["RANK"])
phases = os.environ["PHASES"].split(",")
dead = [int(r) for r in os.environ["DEAD"].split(",")]
out = Path(os.environ["RESULT_DIR"])
group = rt.init_distributed(rt.DistributedOptions(
    join_timeout_s=60, collective_timeout_s=120, barrier_timeout_s=120))
failed_after: dict[int, float] = {}


def one_round(phase: str, ddp: nn.Module, opt: torch.optim.Optimizer,
              coord: TorchDistributed, i: int) -> None:
    if phase == "ddp":
        loss = ddp(torch.randn(64, 256)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    elif phase == "allreduce":
        dist.all_reduce(torch.ones(1 << 18))
    elif phase == "coordination":
        coord.broadcast({"step": i})
        coord.allreduce_max([i, rank])
        coord.gather([f"rank-{rank}-file-{i}"])
    elif phase == "barrier":
        group.barrier("phase")
    else:
        raise SystemExit(f"unknown phase {phase!r}")


def life() -> None:
    gen = group.generation
    coord = TorchDistributed(timeout_s=120)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dist.barrier()
    if gen >= len(phases):
        for i in range(5):
            one_round("ddp", ddp, opt, coord, i)
        return
    death = time.time() + 1.0
    try:
        i = 0
        while True:
            one_round(phases[gen], ddp, opt, coord, i)
            i += 1
            if rank == dead[gen] and time.time() >= death:
                subprocess.Popen([sys.executable, __file__])  # the platform's restart
                os._exit(9)
    finally:
        failed_after[gen] = time.time() - death


try:
    group.run(life)
    result: dict[str, object] = {"failed_after_s": failed_after,
                                 "generation": group.generation}
except Exception as exc:  # noqa: BLE001 - reported to the test
    result = {"unexpected": repr(exc)[:300]}
group.shutdown()
(out / f"rank{rank}.json").write_text(json.dumps(result))
sys.stdout.flush()
os._exit(0)
