"""What each worker pool runs: a job spec's pools merged with the command line.

On the platform every pool of a CustomJob runs its own program (``containerSpec`` or
``pythonPackageSpec``: command, args, env) on its own machine type. Locally the image is
not run: each pool's command runs on this host, in this environment plus the pool's env,
with the memory limit of its machine type and its own accelerator count. Pure: nothing
here starts a process or probes the machine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .env import TRAINING_POOLS
from .jobspec import JobSpec, JobSpecError, PoolSpec

__all__ = ["PoolPlan", "PoolProgram", "plan_pools", "pool_spec_for"]


@dataclass(frozen=True)
class PoolProgram:
    """What the replicas of one pool run, when it is not the job's own ``command``."""

    pool: str                             # "workerpool2"
    command: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)   # over the launcher's environment
    memory_limit: int | None = None       # bytes per replica
    gpus_per_replica: int = 0


@dataclass(frozen=True)
class PoolPlan:
    pools: tuple[tuple[str, int], ...]          # the pools that run, with their replicas
    listed_only: tuple[tuple[str, int], ...]    # in CLUSTER_SPEC, not run
    programs: tuple[PoolProgram, ...]
    notes: tuple[str, ...]


def plan_pools(spec: JobSpec, *, source: str, command: tuple[str, ...] | None,
               counts: Mapping[str, int], workers: int | None, memory_limit: int | None,
               gpus_per_replica: int | None, gpus_available: int) -> PoolPlan:
    """Each pool's program, from ``spec`` and what the command line says explicitly.

    ``command`` (after --) replaces workerpool0's command and that of every pool that runs
    the same one; ``counts`` (--pool POOL=N) sets a pool's replicas, 0 leaving it out;
    ``workers`` (--workers N) sets workerpool0 + workerpool1 to N replicas; a pool the spec
    does not have runs workerpool0's program. ``memory_limit`` and ``gpus_per_replica``,
    when given, hold for every pool. ``source`` names the spec in messages."""
    primary = spec.pool_specs[0]
    wanted: dict[str, int] = {p.pool: p.replicas for p in spec.pool_specs}
    if workers is not None:
        wanted.pop("workerpool1", None)
        if workers > 1:
            wanted["workerpool1"] = workers - 1
    wanted.update(counts)
    notes: list[str] = []
    pools: list[tuple[str, int]] = []
    listed: list[tuple[str, int]] = []
    programs: list[PoolProgram] = []
    replaced: list[str] = []
    by_image: dict[str, list[str]] = {}
    for name in sorted(wanted, key=lambda p: int(p.removeprefix("workerpool"))):
        replicas = wanted[name]
        if replicas <= 0:
            continue
        pool = pool_spec_for(spec, name)
        if command is not None and pool.command == primary.command:
            replaced.append(name)
            pool_command: tuple[str, ...] | None = command
        else:
            pool_command = pool.command
        if pool_command is None:
            if pool.is_reduction_server and name not in TRAINING_POOLS:
                listed.append((name, replicas))
                notes.append(
                    f"{name} runs the platform's Reduction Server image ({pool.image}) by its "
                    f"own entrypoint, which cannot run here: left out. As on the platform, "
                    f"CLUSTER_SPEC lists its {replicas} replica(s) under {name}, and it is no "
                    f"training rank: WORLD_SIZE counts workerpool0 and workerpool1 only")
                continue
            raise JobSpecError(_no_command(source, pool, name))
        pools.append((name, replicas))
        by_image.setdefault(pool.image, []).append(name)
        gpus = pool.accelerator_count if gpus_per_replica is None else gpus_per_replica
        programs.append(PoolProgram(
            name, pool_command, dict(pool.env),
            memory_limit if memory_limit is not None else pool.memory_limit, gpus))
    if not pools or pools[0][0] != "workerpool0":
        raise JobSpecError(f"job spec {source}: workerpool0 (the primary) must run; "
                           f"--pool workerpool0=0 leaves the job without one")
    if replaced:
        notes.append(f"the command after -- replaces the spec's for {', '.join(replaced)}")
    for image, names in by_image.items():
        notes.append(f"{', '.join(names)}: the image {image} is not run locally; "
                     f"{'its' if len(names) == 1 else 'their'} command runs on this host, in "
                     f"this environment plus the pool's env")
    programs = _fit_gpus(programs, pools, gpus_per_replica is not None, gpus_available, notes)
    return PoolPlan(tuple(pools), tuple(listed), tuple(programs), tuple(notes))


def pool_spec_for(spec: JobSpec, name: str) -> PoolSpec:
    """The spec's pool ``name``; one the spec leaves empty (asked for by --pool or
    --workers) runs workerpool0's program on workerpool0's machine."""
    return spec.pool(name) or _like(spec.pool_specs[0], name)


def _like(primary: PoolSpec, name: str) -> PoolSpec:
    """A pool the spec leaves empty but the command line asks for: workerpool0's program."""
    return PoolSpec(name, f"--pool {name}", 0, primary.command, primary.image, primary.env,
                    primary.machine_type, primary.memory_limit, primary.accelerator_type,
                    primary.accelerator_count, primary.package_uris)


def _no_command(source: str, pool: PoolSpec, name: str) -> str:
    if name == "workerpool0":
        return (f"job spec {source}: {pool.path} has no command: locally no image is run, so "
                f"its ENTRYPOINT is unknown; add command: [python, train.py] (and args) to the "
                f"pool's containerSpec, or give the command after --")
    return (f"job spec {source}: {pool.path} ({name}) has no command: on the platform it runs "
            f"the ENTRYPOINT of its image {pool.image}, which the launcher cannot run; add "
            f"command: [...] (and args) to its containerSpec, or leave the pool out with "
            f"--pool {name}=0")


def _fit_gpus(programs: Sequence[PoolProgram], pools: Sequence[tuple[str, int]],
              explicit: bool, available: int, notes: list[str]) -> list[PoolProgram]:
    """The spec's accelerators, only where this machine has GPUs: a spec written for the
    platform still runs on a laptop; too few GPUs is the platform's stockout."""
    out = list(programs)
    if explicit:
        return out
    counts = dict(pools)
    total = sum(p.gpus_per_replica * counts[p.pool] for p in out)
    if not total:
        return out
    asked = ", ".join(f"{p.pool} {p.gpus_per_replica} per replica" for p in out
                      if p.gpus_per_replica)
    if available == 0:
        notes.append(f"the spec asks for GPUs ({asked}); this machine has no GPUs, so the "
                     f"replicas run without (pass --gpus-per-worker K to get the platform's "
                     f"stockout instead)")
        return [PoolProgram(p.pool, p.command, p.env, p.memory_limit, 0) for p in out]
    if total > available:
        notes.append(f"the spec asks for {total} GPUs ({asked}); this machine has "
                     f"{available}: the job is a stockout, as on the platform (pass "
                     f"--gpus-per-worker K to fit, 0 for none)")
    return out
