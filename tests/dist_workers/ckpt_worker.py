"""One rank of a multi-process checkpoint scenario (tests/test_checkpoint_distributed.py).

    python ckpt_worker.py SCENARIO CKPT_DIR OUT_DIR

Environment: ``RANK``, ``WORLD_SIZE``, ``MASTER_PORT`` (gloo on 127.0.0.1). With
``WORLD_SIZE=1`` no process group is created (a plain single-process restore). Each rank
writes what the test compares to ``OUT_DIR/<SCENARIO>.rank<R>.pt`` (tensors and plain
values, read back with ``weights_only=True``); logs go to stderr.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from resilient_train.checkpoint.coordination import Coordinator, SingleProcess, TorchDistributed
from resilient_train.checkpoint.manager import CheckpointManager, CheckpointOptions
from resilient_train.checkpoint.policy import every, every_n_steps, never

log = logging.getLogger("ckpt_worker")

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
TIMEOUT_S = float(os.environ.get("WORKER_TIMEOUT_S", "60"))
HIDDEN = 32


def init() -> Coordinator:
    if WORLD == 1:
        return SingleProcess()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=RANK,
        world_size=WORLD, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    return TorchDistributed(timeout_s=TIMEOUT_S)


def finish(coord: Coordinator, out: str, scenario: str, result: dict[str, Any]) -> None:
    torch.save(result, os.path.join(out, f"{scenario}.rank{RANK}.pt"))
    if WORLD > 1:
        if scenario != "sigterm":  # there the signalled peer is gone already
            dist.barrier()
        if isinstance(coord, TorchDistributed):
            coord.close()
        dist.destroy_process_group()


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def rng_probe() -> dict[str, Any]:
    """Draws from every RNG the manager restores: equal draws = equal streams."""
    import random

    import numpy as np

    return {"torch": torch.rand(4), "python": random.random(), "numpy": float(np.random.rand())}


def seed_all(seed: int) -> None:
    import random

    import numpy as np

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


# --- replicated layout (DDP) ------------------------------------------------------------

def ddp_model(seed: int) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 4))
    wrapped = nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's weights
    return model, wrapped, torch.optim.AdamW(model.parameters(), lr=0.01)


def train_step(wrapped: nn.Module, opt: torch.optim.Optimizer, inputs: int = 8) -> None:
    loss = wrapped(torch.randn(4, inputs)).pow(2).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()


def replicated_save(ckpt: str, coord: Coordinator) -> dict[str, Any]:
    model, wrapped, opt = ddp_model(0)
    seed_all(100 + RANK)  # each rank its own data/RNG stream
    mgr = CheckpointManager(ckpt, options=CheckpointOptions(policy=every_n_steps(3)),
                            coordinator=coord)
    mgr.track(model=model, optimizer=opt)
    saved: dict[str, Any] = {}
    for step in range(1, 6):
        train_step(wrapped, opt)
        mgr.values["position"] = 1000 * RANK + step
        if mgr.maybe_save(step):
            mgr.wait()  # the test wants the files now; training would not wait
            saved = {"step": step, "weights": params(model), "values": dict(mgr.values),
                     "rng_after": rng_probe()}
    mgr.close()
    return saved


def replicated_restore(ckpt: str, coord: Coordinator) -> dict[str, Any]:
    model, _wrapped, opt = ddp_model(7)  # different weights: the restore must replace them
    seed_all(999)
    mgr = CheckpointManager(ckpt, options=CheckpointOptions(policy=never()), coordinator=coord)
    mgr.track(model=model, optimizer=opt)
    step = mgr.restore_latest()
    out = {"step": step, "weights": params(model), "values": dict(mgr.values),
           "rng_after": rng_probe(), "opt_steps": [int(s["step"]) for s in opt.state.values()]}
    mgr.close()
    return out


def corrupt_save(ckpt: str, coord: Coordinator) -> dict[str, Any]:
    model, wrapped, opt = ddp_model(0)
    seed_all(100 + RANK)
    mgr = CheckpointManager(
        ckpt, options=CheckpointOptions(policy=every_n_steps(2), async_save=False),
        coordinator=coord)
    mgr.track(model=model, optimizer=opt)
    weights = {}
    for step in range(1, 5):
        train_step(wrapped, opt)
        mgr.values["position"] = step
        if mgr.maybe_save(step):
            weights[step] = params(model)
    mgr.close()
    return {"weights": weights}


# --- the shared time decision -----------------------------------------------------------

def timed_saves(ckpt: str, coord: Coordinator) -> dict[str, Any]:
    start = time.time()
    # Clocks that disagree: rank 1's is a day ahead and runs 3x fast. Deciding on local
    # clocks, rank 1 would save at other steps than rank 0 (and deadlock the commit).
    clock: Callable[[], float] = time.time if RANK == 0 else (
        lambda: start + 86_400 + 3 * (time.time() - start))
    step_s = 0.01 if RANK == 0 else 0.03  # and steps that take different times
    mgr = CheckpointManager(
        ckpt, options=CheckpointOptions(policy=every(seconds=0.4), sync_interval_s=0.1),
        coordinator=coord, clock=clock)
    mgr.track(values_only=torch.zeros(3))
    saved_steps = []
    for step in range(1, 81):
        time.sleep(step_s)
        if mgr.maybe_save(step):
            saved_steps.append(step)
    mgr.close()
    return {"saved_steps": saved_steps, "elapsed": time.time() - start}


# --- SIGTERM ------------------------------------------------------------------------------

def sigterm(ckpt: str, coord: Coordinator) -> dict[str, Any]:
    model, wrapped, opt = ddp_model(0)
    mgr = CheckpointManager(
        ckpt, options=CheckpointOptions(policy=never(), save_on_sigterm=True,
                                        sync_interval_s=0.05),
        coordinator=coord)
    mgr.track(model=model, optimizer=opt)
    ready = os.path.join(os.environ["WORKER_OUT"], f"sigterm.rank{RANK}.ready")
    result: dict[str, Any] = {"saved_step": None}
    for step in range(1, 2001):
        train_step(wrapped, opt)
        time.sleep(0.005)
        if step == 5:
            with open(ready, "w") as f:
                f.write(str(os.getpid()))
        try:
            saved = mgr.maybe_save(step)
        except SystemExit as exc:  # the signalled rank: record, then leave with its code
            from resilient_train.checkpoint.manager import scan

            committed = [i.step for i in scan(mgr.storage) if i.committed]
            result.update(saved_step=step, exit_code=exc.code, committed_at_exit=committed)
            torch.save(result, os.path.join(os.environ["WORKER_OUT"], f"sigterm.rank{RANK}.pt"))
            raise
        if saved:  # a peer was signalled: we saved with it; the job is going down
            result["saved_step"] = step
            break
    mgr.close()
    return result


# --- sharded layout (FSDP2) ---------------------------------------------------------------

def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, 4))


def fsdp_mlp(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    model = mlp(seed)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Unsharded copies of the weights and the AdamW moments, keyed by parameter name
    (collective for FSDP models: full_tensor all-gathers)."""
    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    weights = {k: full(v) for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    moments = {}
    for p, st in opt.state.items():
        moments[names[id(p)]] = {k: full(v) for k, v in st.items() if isinstance(v, torch.Tensor)}
    return {"weights": weights, "moments": moments}


def sharded_save(ckpt: str, coord: Coordinator) -> dict[str, Any]:
    model, opt = fsdp_mlp(0)
    seed_all(100 + RANK)
    mgr = CheckpointManager(ckpt, options=CheckpointOptions(policy=every_n_steps(3)),
                            coordinator=coord)
    mgr.track(model=model, optimizer=opt)
    saved: dict[str, Any] = {}
    for step in range(1, 6):
        train_step(model, opt, inputs=16)
        mgr.values["position"] = 1000 * RANK + step
        if mgr.maybe_save(step):
            # Expected state taken after the async save started: training has not moved yet.
            saved = {"step": step, **full_state(model, opt), "values": dict(mgr.values),
                     "rng_after": rng_probe(), "blocking_s": mgr.last_blocking_s}
        # Later steps change the weights while the writer may still be writing step 3.
    mgr.close()
    saved["final"] = full_state(model, opt)["weights"]
    return saved


def sharded_restore(ckpt: str, coord: Coordinator) -> dict[str, Any]:
    if WORLD > 1:
        model, opt = fsdp_mlp(7)
    else:  # a different world size: one process, a plain model
        model = mlp(7)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    seed_all(999)
    mgr = CheckpointManager(ckpt, options=CheckpointOptions(policy=never()), coordinator=coord)
    mgr.track(model=model, optimizer=opt)
    step = mgr.restore_latest()
    out = {"step": step, **full_state(model, opt), "values": dict(mgr.values),
           "rng_after": rng_probe(), "sharded": any(hasattr(p, "full_tensor")
                                                   for p in model.parameters())}
    # The restored objects train on: one more step works and the next save is sharded too.
    train_step(model, opt, inputs=16)
    mgr.close()
    return out


SCENARIOS: dict[str, Callable[[str, Coordinator], dict[str, Any]]] = {
    "replicated_save": replicated_save,
    "replicated_restore": replicated_restore,
    "corrupt_save": corrupt_save,
    "corrupt_restore": replicated_restore,
    "timed_saves": timed_saves,
    "sigterm": sigterm,
    "sharded_save": sharded_save,
    "sharded_restore": sharded_restore,
}


def main() -> None:
    scenario, ckpt, out = sys.argv[1:4]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s rank{RANK} %(name)s %(levelname)s %(message)s")
    os.environ["WORKER_OUT"] = out
    coord = init()
    result = SCENARIOS[scenario](ckpt, coord)
    finish(coord, out, scenario, result)


if __name__ == "__main__":
    main()
