"""One rank of a multi-process checkpoint scenario (tests/test_checkpoint_distributed.py).

The test starts ranks with :func:`entry` as the target of a ``forkserver`` process whose
server has imported torch once (importing torch costs ~3 s of CPU per process, which is most
of a scenario's time on 2 cores). Run by hand, it is a script::

    RANK=0 WORLD_SIZE=2 MASTER_PORT=29500 python ckpt_worker.py SCENARIO CKPT_DIR OUT_DIR

With ``WORLD_SIZE=1`` no process group is created (a plain single-process restore). Each rank
writes what the test compares to ``OUT_DIR/<SCENARIO>.rank<R>.pt`` (tensors and plain
values, read back with ``weights_only=True``) and logs to ``OUT_DIR/<SCENARIO>.rank<R>.log``
(stderr when run by hand).
"""

from __future__ import annotations

import dataclasses
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

from resilient_train.checkpoint.manager import CheckpointManager, CheckpointOptions
from resilient_train.checkpoint.schedule.coordination import (
    Coordinator,
    SingleProcess,
    TorchDistributed,
)
from resilient_train.checkpoint.schedule.policies import every, every_n_steps, never

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


def full_disk(ckpt: str, coord: Coordinator) -> dict[str, Any]:
    """Rank 1's file of step 2 meets a full disk (ENOSPC after 1000 bytes, injected into its
    own write): it must still report to the primary, so nobody waits in the commit's gather
    for it; the primary removes step 2's directory; step 1 stays; step 3 commits."""
    import contextlib
    import errno

    from resilient_train.checkpoint.storage.base import Storage

    model, wrapped, opt = ddp_model(0)
    mgr = CheckpointManager(ckpt, options=CheckpointOptions(policy=never(), max_interval_s=None,
                                                            async_save=False),
                            coordinator=coord)
    mgr.track(model=model, optimizer=opt)
    train_step(wrapped, opt)
    mgr.save(1)
    real = Storage.open_write

    @contextlib.contextmanager
    def full(self: Storage, rel: str, **kw: Any) -> Any:
        with real(self, rel, **kw) as f:
            if RANK == 1 and "step-000000000002" in rel:
                f.write(b"x" * 1000)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            yield f

    Storage.open_write = full  # type: ignore[method-assign]
    train_step(wrapped, opt)
    error = ""
    try:
        mgr.save(2)
    except Exception as exc:  # noqa: BLE001 - the test reads it
        error = f"{type(exc).__name__}: {exc}"
    finally:
        Storage.open_write = real  # type: ignore[method-assign]
    coord.allreduce_max([0])  # both past the failed save (and the primary's clean-up)
    listing = sorted(os.listdir(ckpt))
    train_step(wrapped, opt)
    mgr.save(3)
    committed = mgr.last_commit_step
    mgr.close()
    return {"error": error, "listing": listing, "committed": committed}


def replicated_restore(ckpt: str, coord: Coordinator,
                       storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    model, _wrapped, opt = ddp_model(7)  # different weights: the restore must replace them
    seed_all(999)
    mgr = CheckpointManager(ckpt, options=CheckpointOptions(
        policy=never(), max_interval_s=None, storage_options=storage_options),
        coordinator=coord)
    mgr.track(model=model, optimizer=opt)
    step = mgr.restore_latest()
    assert mgr.last_restore is not None
    out = {"step": step, "weights": params(model), "values": dict(mgr.values),
           "rng_after": rng_probe(), "opt_steps": [int(s["step"]) for s in opt.state.values()],
           "bytes_read": dict(mgr.last_restore.bytes_read)}
    mgr.close()
    return out


def save_damage_restore(ckpt: str, coord: Coordinator, damaged: str,
                        storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Save steps 2 and 4, flip one byte (same size) of step 4's file ``damaged``, restore
    with fresh objects (one launch instead of two: the restart itself is covered by the
    replicated scenario)."""
    from resilient_train.checkpoint.storage.base import Storage

    model, wrapped, opt = ddp_model(0)
    seed_all(100 + RANK)
    mgr = CheckpointManager(ckpt, options=CheckpointOptions(
        policy=every_n_steps(2), async_save=False, storage_options=storage_options),
        coordinator=coord)
    mgr.track(model=model, optimizer=opt)
    weights = {}
    for step in range(1, 5):
        train_step(wrapped, opt)
        mgr.values["position"] = step
        if mgr.maybe_save(step):
            weights[step] = params(model)
    mgr.close()
    dist.barrier()
    if RANK == 0:  # the disk's (or the store's) doing, in that one file only
        st = Storage(ckpt, storage_options=storage_options)
        name = next(n for n in st.listdir("") if n.startswith("step-000000000004"))
        data = bytearray(st.read_bytes(f"{name}/{damaged}"))
        data[len(data) // 2] ^= 0xFF
        st.write_bytes(f"{name}/{damaged}", bytes(data))
    dist.barrier()
    return {"weights": weights,
            "restored": replicated_restore(ckpt, coord, storage_options)}


def corrupt(ckpt: str, coord: Coordinator) -> dict[str, Any]:
    """A flipped byte in rank 1's file of step 4, on local disk: every rank takes step 2."""
    return save_damage_restore(ckpt, coord, "rank-00001.pt")


def corrupt_gcs(ckpt: str, coord: Coordinator) -> dict[str, Any]:
    """On an object store (the emulator) the primary alone reads the replicated file and
    streams it to the others: a flipped byte in step 4's shared.pt fails its checksum at
    the stream's end, and every rank takes step 2."""
    return save_damage_restore(ckpt, coord, "shared.pt", {
        "endpoint_url": os.environ["RT_GCS_ENDPOINT"], "token": "anon"})


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


def auto_saves(ckpt: str, coord: Coordinator) -> dict[str, Any]:
    # auto_interval keeps state read from this process's environment: here the ranks were
    # told different MTBFs, so left alone they would save at different steps.
    from resilient_train.checkpoint.schedule.policies import auto_interval

    os.environ["RESILIENT_TRAIN_MTBF_S"] = "0.5" if RANK == 0 else "1000000"
    mgr = CheckpointManager(
        ckpt, options=CheckpointOptions(policy=auto_interval(floor_s=0.1),
                                        sync_interval_s=0.05),
        coordinator=coord)
    mgr.track(values_only=torch.zeros(3))
    saved_steps = []
    for step in range(1, 81):
        time.sleep(0.01)
        if mgr.maybe_save(step):
            saved_steps.append(step)
    mgr.close()
    return {"saved_steps": saved_steps}


# --- SIGTERM ------------------------------------------------------------------------------

def sigterm(ckpt: str, coord: Coordinator) -> dict[str, Any]:
    model, wrapped, opt = ddp_model(0)
    mgr = CheckpointManager(
        ckpt, options=CheckpointOptions(policy=never(), max_interval_s=None, save_on_sigterm=True,
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
            from resilient_train.checkpoint.commit.directory import scan

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
    for layer in model.children():
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def full(t: torch.Tensor) -> torch.Tensor:
    """An unsharded copy (collective for a DTensor: full_tensor all-gathers)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Unsharded copies of the weights and the AdamW moments, keyed by parameter name."""
    weights = {k: full(v) for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    moments = {}
    for p, st in opt.state.items():
        moments[names[id(p)]] = {k: full(v) for k, v in st.items() if isinstance(v, torch.Tensor)}
    return {"weights": weights, "moments": moments}


def table(model: nn.Module, fill: torch.Tensor) -> torch.Tensor:
    """A tensor outside any module, sharded like the model's parameters when they are."""
    param = next(model.parameters())
    if not hasattr(param, "device_mesh"):
        return fill.clone()
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(fill, param.device_mesh, [Shard(0)])


def sharded_save(ckpt: str, coord: Coordinator) -> dict[str, Any]:
    model, opt = fsdp_mlp(0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)  # -> shared.pt
    aux = {"table": table(model, torch.arange(8.0))}  # a plain tree with a DTensor -> DCP
    seed_all(100 + RANK)
    mgr = CheckpointManager(ckpt, options=CheckpointOptions(policy=every_n_steps(3)),
                            coordinator=coord)
    mgr.track(model=model, optimizer=opt, sched=sched, aux=aux)
    saved: dict[str, Any] = {}
    for step in range(1, 6):
        train_step(model, opt, inputs=16)
        sched.step()
        aux["table"].add_(1.0)
        mgr.values["position"] = 1000 * RANK + step
        if mgr.maybe_save(step):
            # Expected state taken after the async save started: training has not moved yet.
            saved = {"step": step, **full_state(model, opt), "values": dict(mgr.values),
                     "rng_after": rng_probe(), "blocking_s": mgr.last_blocking_s,
                     "sched": sched.state_dict(), "table": full(aux["table"])}
        # Later steps change the weights while the writer may still be writing step 3.
    mgr.close()
    saved["final"] = full_state(model, opt)["weights"]
    return saved


def sharded(ckpt: str, coord: Coordinator) -> dict[str, Any]:
    """Save with 2 ranks, then restore into fresh FSDP objects and a fresh manager (one
    launch; the 1-rank restore in its own process covers the restart)."""
    saved = sharded_save(ckpt, coord)
    return {"saved": saved, "restored": sharded_restore(ckpt, coord)}


def sharded_restore(ckpt: str, coord: Coordinator) -> dict[str, Any]:
    if WORLD > 1:
        model, opt = fsdp_mlp(7)
    else:  # a different world size: one process, a plain model
        model = mlp(7)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    aux = {"table": table(model, torch.zeros(8))}
    seed_all(999)
    mgr = CheckpointManager(ckpt, options=CheckpointOptions(policy=never(), max_interval_s=None),
                            coordinator=coord)
    mgr.track(model=model, optimizer=opt, sched=sched, aux=aux)
    step = mgr.restore_latest()
    out = {"step": step, **full_state(model, opt), "values": dict(mgr.values),
           "rng_after": rng_probe(), "sharded": any(hasattr(p, "full_tensor")
                                                   for p in model.parameters()),
           "sched": sched.state_dict(), "table": full(aux["table"]),
           "lrs": [g["lr"] for g in opt.param_groups]}
    # The restored objects train on.
    train_step(model, opt, inputs=16)
    mgr.close()
    return out


def sharded_gcs(ckpt: str, coord: Coordinator) -> dict[str, Any]:
    """Sharded save and restore on an object store (the GCS emulator): DCP through fsspec,
    the step written in place with the marker last."""
    options = CheckpointOptions(policy=every_n_steps(3), storage_options={
        "endpoint_url": os.environ["RT_GCS_ENDPOINT"], "token": "anon"})
    model, opt = fsdp_mlp(0)
    mgr = CheckpointManager(ckpt, options=options, coordinator=coord)
    mgr.track(model=model, optimizer=opt)
    saved: dict[str, Any] = {}
    for step in range(1, 4):
        train_step(model, opt, inputs=16)
        if mgr.maybe_save(step):
            mgr.wait()
            saved = full_state(model, opt)
    mgr.close()
    model, opt = fsdp_mlp(7)
    mgr = CheckpointManager(ckpt, options=dataclasses.replace(options, policy=never(),
                                                                max_interval_s=None),
                            coordinator=coord)
    mgr.track(model=model, optimizer=opt)
    restored_step = mgr.restore_latest()
    mgr.close()
    return {"saved": saved, "restored": {"step": restored_step, **full_state(model, opt)}}


def local_tier_full(ckpt: str, coord: Coordinator) -> dict[str, Any]:
    """Rank 1's node-local disk is full for its saves of steps 1-3 (its tier's write
    raises what a full disk does): from the agreement after its failure on, every rank
    sends each save to storage too, together (a rank alone would leave the commit
    waiting), until its disk works again; then every 5th."""
    from resilient_train.checkpoint.commit.retention import RetentionPolicy
    from resilient_train.checkpoint.storage.base import StorageFullError
    from resilient_train.checkpoint.tiers.nodelocal import LocalTier, NodeLocal

    real = LocalTier.write_step

    def write(self: LocalTier, step: int, *args: Any) -> None:
        if RANK == 1 and step <= 3:
            raise StorageFullError("no space left on the device", free_bytes=0)
        real(self, step, *args)

    LocalTier.write_step = write  # type: ignore[method-assign]
    model, wrapped, opt = ddp_model(0)
    # An agreement at every step (sync_interval_s): the steps here take microseconds.
    mgr = CheckpointManager(ckpt, coordinator=coord, options=CheckpointOptions(
        save_every_steps=1, async_save=False, sync_interval_s=1e-6,
        retention=RetentionPolicy(keep_last=20),
        node_local=NodeLocal(directory=os.path.join(ckpt, f"local{RANK}"), persistent_every=5)))
    mgr.track(model=model, optimizer=opt)
    for step in range(1, 11):
        train_step(wrapped, opt)
        assert mgr.maybe_save(step)
    mgr.close()
    return {"done": 10}


SCENARIOS: dict[str, Callable[[str, Coordinator], dict[str, Any]]] = {
    "sharded_gcs": sharded_gcs,
    "corrupt_gcs": corrupt_gcs,
    "replicated_save": replicated_save,
    "replicated_restore": replicated_restore,
    "full_disk": full_disk,
    "local_tier_full": local_tier_full,
    "corrupt": corrupt,
    "timed_saves": timed_saves,
    "auto_saves": auto_saves,
    "sigterm": sigterm,
    "sharded": sharded,
    "sharded_restore": sharded_restore,
}


def run(scenario: str, ckpt: str, out: str) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True,
                        format=f"%(asctime)s rank{RANK} %(name)s %(levelname)s %(message)s")
    os.environ["WORKER_OUT"] = out
    coord = init()
    result = SCENARIOS[scenario](ckpt, coord)
    finish(coord, out, scenario, result)


def entry(scenario: str, ckpt: str, out: str, env: dict[str, str]) -> None:
    """Process target: this rank's environment, output to its log file, then the scenario.
    A SystemExit (the SIGTERM scenario's 134) becomes the process's exit code."""
    global RANK, WORLD, TIMEOUT_S
    os.environ.update(env)
    RANK, WORLD = int(env["RANK"]), int(env["WORLD_SIZE"])
    TIMEOUT_S = float(env.get("WORKER_TIMEOUT_S", TIMEOUT_S))
    if "OMP_NUM_THREADS" in env:  # torch read the variable at import, in the server
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    fd = os.open(os.path.join(out, f"{scenario}.rank{RANK}.log"),
                 os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    run(scenario, ckpt, out)


if __name__ == "__main__":
    run(*sys.argv[1:4])
