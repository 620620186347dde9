"""The worker of benchmarks/bench_distributed.py (not a test; run by the benchmark).

    python benchmarks/dist_worker.py form-rt | form-plain | train-rt | train-plain

Environment: torchrun style (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), plus BENCH_DIR
(where ``rank<R>.log`` gets one JSON line per event, appended, so a restarted process adds
to its predecessor's file), BENCH_STEP_S (sleep per training step), BENCH_END_AT (a
time.time() after which rank 0 stops training whatever happens: a safety net; normally the
harness creates ``BENCH_DIR/stop``).

- ``form-*``: time ``rt.init_distributed()`` or ``init_process_group("gloo", "env://")``,
  one all-reduce as a check, then leave.
- ``train-*``: a small model; per step a forward/backward, one all-reduce of the
  gradients plus a stop flag, then one log line ``{"ev": "step", "t": time.time(), ...}``.
  ``train-rt`` runs the loop inside ``group.run`` and calls ``group.step_done``;
  ``train-plain`` is what a torchrun script without our SDK does.
"""

from __future__ import annotations

import time

T_FIRST = time.time()  # the first line of user code: before importing torch

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

RANK = int(os.environ["RANK"])
BENCH_DIR = Path(os.environ["BENCH_DIR"])
LOG = open(BENCH_DIR / f"rank{RANK}.log", "a", buffering=1)  # noqa: SIM115 (whole process)
STATE: dict[str, Any] = {"step": 0, "gen": 0, "rec": 0}


def log(ev: str, **fields: Any) -> None:
    LOG.write(json.dumps({"ev": ev, "rank": RANK, "pid": os.getpid(), "t": time.time(),
                          **fields}) + "\n")


def form(mode: str) -> None:
    log("start", t_first=T_FIRST)
    t0 = time.time()
    group = None
    if mode == "form-rt":
        import resilient_train as rt

        group = rt.init_distributed(rt.DistributedOptions(join_timeout_s=60))
    else:
        import datetime

        dist.init_process_group("gloo", init_method="env://",
                                timeout=datetime.timedelta(seconds=60))
    t1 = time.time()
    x = torch.ones(1)
    dist.all_reduce(x)
    log("formed", t_init=t0, t_formed=t1, t_first=T_FIRST, sum=x.item())
    if group is not None:
        group.shutdown()
    else:
        dist.barrier()
        dist.destroy_process_group()


def train(group: Any = None) -> None:
    """One life of the training loop: called again by group.run after a recovery."""
    world = dist.get_world_size()
    step_s = float(os.environ.get("BENCH_STEP_S", "0.02"))
    end_at = float(os.environ.get("BENCH_END_AT", "inf"))
    stop_file = BENCH_DIR / "stop"
    if group is not None:
        STATE["gen"], STATE["rec"] = group.generation, group.recoveries
        log("train-start", gen=group.generation, rec=group.recoveries,
            last_recovery_s=group.last_recovery_s)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 1))
    params = list(model.parameters())
    # A hand-written SGD step, not torch.optim: the first optimizer a process creates
    # imports torch._dynamo and sympy (2.3 s here when idle), a cost any restarted process
    # pays the same way, whatever restarts it; the benchmark measures the mechanism.
    # Agree on where to go on (a restarted process knows nothing).
    step_t = torch.tensor([float(STATE["step"])])
    dist.all_reduce(step_t, op=dist.ReduceOp.MAX)
    step = int(step_t.item())
    while True:
        g = torch.Generator().manual_seed(step * world + RANK)
        x = torch.randn(64, 32, generator=g)
        loss = (model(x) - x[:, :1]).pow(2).mean()
        for p in params:
            p.grad = None
        loss.backward()
        stop = RANK == 0 and (stop_file.exists() or time.time() > end_at)
        flat = torch.cat([p.grad.reshape(-1) for p in params] + [torch.tensor([float(stop)])])
        dist.all_reduce(flat)  # fails when a peer died
        done = time.time()
        i = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                p -= 0.01 / world * flat[i:i + n].view_as(p)
                i += n
        step += 1
        STATE["step"] = step
        log("step", step=step, t=done, gen=STATE["gen"], rec=STATE["rec"])
        if flat[-1].item() > 0:
            return
        if group is not None:
            group.step_done(step)
        time.sleep(step_s)


def main() -> int:
    mode = sys.argv[1]
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if mode.startswith("form-"):
        form(mode)
        return 0
    log("start", t_first=T_FIRST, restart=os.environ.get("TORCHELASTIC_RESTART_COUNT"))
    if mode == "train-rt":
        import resilient_train as rt

        with rt.init_distributed(rt.DistributedOptions(join_timeout_s=120)) as group:
            log("formed", gen=group.generation)
            group.run(train, group)
    else:
        import datetime

        dist.init_process_group("gloo", init_method="env://",
                                timeout=datetime.timedelta(seconds=60))
        log("formed", gen=0)
        train()
        dist.destroy_process_group()
    log("done", step=STATE["step"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
