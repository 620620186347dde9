"""Who this process is in the cluster: rank, replica name and rendezvous address.

Reads the environment the way the platform (docs/platform.md, "What a replica sees") and torchrun set it, and
builds the platform's CLUSTER_SPEC / TF_CONFIG for the local launcher. No torch import: the
launcher imports this module and must start fast.

Training ranks: workerpool0 (exactly one replica, the primary) is rank 0 and workerpool1
replica j is rank 1+j. workerpool2 (parameter / reduction servers) and workerpool3
(evaluators) do not join the process group: they get rank -1 and the training world size.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

CLUSTER_SPEC_ENV = "CLUSTER_SPEC"
TF_CONFIG_ENV = "TF_CONFIG"
# The platform's job id (the launcher sets its own): a job's restarts and retries share it.
JOB_ID_ENV = "CLOUD_ML_JOB_ID"
# The replica's own machine disk (set by the launcher; the node-local checkpoint tier's default).
NODE_LOCAL_DIR_ENV = "RESILIENT_TRAIN_NODE_LOCAL_DIR"
POOLS = ("workerpool0", "workerpool1", "workerpool2", "workerpool3")
POOL_TO_TF_TYPE = {
    "workerpool0": "chief",
    "workerpool1": "worker",
    "workerpool2": "ps",
    "workerpool3": "evaluator",
}
TF_TYPE_TO_POOL = {
    "chief": "workerpool0",
    "master": "workerpool0",  # legacy name of the chief
    "worker": "workerpool1",
    "ps": "workerpool2",
    "evaluator": "workerpool3",
}
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
NON_TRAINING_RANK = -1

_INT_RE = re.compile(r"-?[0-9]+")  # int() alone would accept "1_0" and non-ASCII digits


def replica_name(pool: str, index: int) -> str:
    """A replica's name, as the platform gives it for a hostname: ``workerpool1-0``."""
    return f"{pool}-{index}"


def training_replica(node: int) -> tuple[str, int]:
    """The pool and index of the training node ``node`` (a group rank): node 0 is the
    primary, workerpool0-0; node k is workerpool1-(k-1)."""
    return ("workerpool0", 0) if node == 0 else ("workerpool1", node - 1)


class ClusterSpecError(ValueError):
    """The cluster environment is malformed; the message names the variable, field and fix."""


def _error(var: str, field: str, expected: str, found: Any, fix: str) -> ClusterSpecError:
    shown = repr(found)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    where = f"{var} {field}" if field else var
    return ClusterSpecError(f"{where}: expected {expected}; found {shown}. {fix}")


def _is_set(env: Mapping[str, str], name: str) -> bool:
    # An empty variable counts as unset: shells and k8s manifests often export "" by default.
    return env.get(name, "").strip() != ""


def _env_int(env: Mapping[str, str], name: str, default: int, *, minimum: int = 0) -> int:
    if not _is_set(env, name):
        return default
    raw = env[name].strip()
    if not _INT_RE.fullmatch(raw) or int(raw) < minimum:
        raise _error(
            name,
            "",
            f"an integer >= {minimum}",
            env[name],
            f"Set {name} to a whole number or unset it.",
        )
    return int(raw)


def _split_address(address: Any, var: str, field: str) -> tuple[str, int]:
    fix = f"Write each address of {var} as 'host:port', e.g. 'workerpool0-0:2222'."
    if not isinstance(address, str):
        raise _error(var, field, "a 'host:port' string", address, fix)
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")  # IPv6 literals are written [::1]:2222
    if not sep or not host:
        raise _error(var, field, "a 'host:port' string", address, fix)
    if not _INT_RE.fullmatch(port) or not 0 < int(port) < 65536:
        raise _error(var, field, "an integer port in 1-65535 after the ':'", address, fix)
    return host, int(port)


@dataclass(frozen=True)
class _Spec:
    """A validated CLUSTER_SPEC or TF_CONFIG, with pools under their platform names."""

    var: str
    cluster: dict[str, list[str]]
    pool: str
    index: int


def _parse_spec(var: str, raw: str) -> _Spec:
    """Parse and validate CLUSTER_SPEC or TF_CONFIG; any defect is a ClusterSpecError."""
    is_tf = var == TF_CONFIG_ENV
    names = TF_TYPE_TO_POOL if is_tf else {p: p for p in POOLS}
    shape = ('{"cluster": {"chief": ["host:2222"], "worker": [...]}, "task": {"type": '
             '"chief", "index": 0}}' if is_tf else
             '{"cluster": {"workerpool0": ["host:2222"], "workerpool1": [...]}, "task": '
             '{"type": "workerpool0", "index": 0}}')
    fix = f"Fix {var} (its shape: {shape}) or unset it."
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise _error(var, "", "a JSON object", f"unparsable JSON ({exc})", fix) from None
    if not isinstance(data, dict):
        raise _error(var, "", "a JSON object", data, fix)

    cluster_raw = data.get("cluster")
    if not isinstance(cluster_raw, dict):
        raise _error(
            var, "cluster", "an object of pool name -> ['host:port', ...]", cluster_raw, fix
        )
    cluster: dict[str, list[str]] = {}
    for key, addresses in cluster_raw.items():
        if key not in names:
            raise _error(var, "cluster", f"pool names among {sorted(names)}", key, fix)
        if names[key] in cluster:
            raise _error(
                var, "cluster", "only one of 'chief' and 'master'", sorted(cluster_raw), fix
            )
        if not isinstance(addresses, list):
            raise _error(var, f"cluster.{key}", "a list of 'host:port' strings", addresses, fix)
        for i, address in enumerate(addresses):
            _split_address(address, var, f"cluster.{key}[{i}]")
        cluster[names[key]] = list(addresses)

    task = data.get("task")
    if not isinstance(task, dict):
        raise _error(var, "task", 'an object like {"type": ..., "index": 0}', task, fix)
    task_type = task.get("type")
    if not isinstance(task_type, str) or task_type not in names:
        raise _error(var, "task.type", f"one of {sorted(names)}", task_type, fix)
    pool = names[task_type]
    index = task.get("index")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise _error(var, "task.index", "an integer >= 0", index, fix)
    if pool in cluster:
        if index >= len(cluster[pool]):
            raise _error(
                var,
                "task.index",
                f"an index below {len(cluster[pool])} (the size of cluster.{task_type})",
                index,
                fix,
            )
    elif not (is_tf and pool == "workerpool3"):  # TF_CONFIG never lists evaluators
        raise _error(
            var, "task.type", f"a pool listed in cluster {sorted(cluster_raw)}", task_type, fix
        )

    primary = cluster.get("workerpool0", [])
    if len(primary) > 1 or (not is_tf and not primary):
        key = "chief" if is_tf else "workerpool0"
        raise _error(
            var, f"cluster.{key}", "exactly one address (the primary replica)", primary, fix
        )
    if not primary and not cluster.get("workerpool1"):
        raise _error(
            var, "cluster", "a chief/master or at least one worker", sorted(cluster_raw), fix
        )
    return _Spec(var=var, cluster=cluster, pool=pool, index=index)


def _try_spec(env: Mapping[str, str]) -> _Spec | None:
    """The first present CLUSTER_SPEC / TF_CONFIG; raises when the present one is malformed."""
    for var in (CLUSTER_SPEC_ENV, TF_CONFIG_ENV):
        if _is_set(env, var):
            return _parse_spec(var, env[var])
    return None


@dataclass(frozen=True)
class ClusterInfo:
    """This process's place in the job. Build it with `ClusterInfo.from_env()`."""

    rank: int  # -1 for workerpool2/3 replicas, which do not train
    world_size: int
    local_rank: int
    local_world_size: int
    replica_name: str  # "workerpool1-0": the hostname, stable across restarts
    pool: str
    pool_index: int
    master_addr: str
    master_port: int
    source: str  # "torchrun" | "cluster_spec" | "tf_config" | "standalone"
    job_id: str | None
    restart_count: int
    group_rank: int  # replica (node) rank

    @property
    def is_primary(self) -> bool:
        return self.rank == 0

    @property
    def on_platform(self) -> bool:
        return self.job_id is not None

    @classmethod
    def from_env_or_none(cls) -> ClusterInfo | None:
        """``from_env()``, or None where a variable is malformed: for code that only
        consults the job's layout (a checkpoint manager on a process group of the user's
        own making, whose environment need not describe a job)."""
        try:
            return cls.from_env()
        except ClusterSpecError:
            return None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClusterInfo:
        """Read the environment; precedence: torchrun vars, CLUSTER_SPEC, TF_CONFIG, standalone.

        Torchrun mode needs both RANK and WORLD_SIZE; a lone one is ignored when a
        CLUSTER_SPEC / TF_CONFIG is present (the launcher gives workerpool2/3 replicas
        WORLD_SIZE but no RANK) and an error otherwise. Raises ClusterSpecError for any
        malformed variable that decides the result.
        """
        env = os.environ if env is None else env
        local_rank = _env_int(env, "LOCAL_RANK", 0)
        local_world_size = _env_int(env, "LOCAL_WORLD_SIZE", 1, minimum=1)
        if local_rank >= local_world_size:
            raise _error(
                "LOCAL_RANK",
                "",
                f"an integer below LOCAL_WORLD_SIZE={local_world_size}",
                local_rank,
                "Set LOCAL_WORLD_SIZE to the number of processes on this node.",
            )
        restart_var = "TORCHELASTIC_RESTART_COUNT"
        if not _is_set(env, restart_var):
            restart_var = "RESILIENT_TRAIN_RESTART_COUNT"
        common: dict[str, Any] = {
            "local_rank": local_rank,
            "local_world_size": local_world_size,
            "job_id": env.get(JOB_ID_ENV) or None,
            "restart_count": _env_int(env, restart_var, 0),
        }

        has_rank, has_world = _is_set(env, "RANK"), _is_set(env, "WORLD_SIZE")
        if has_rank and has_world:
            return cls._from_torchrun(env, common)
        # A lone WORLD_SIZE is what workerpool2/3 replicas get (no rank): the spec decides.
        spec = _try_spec(env)
        if spec is None:
            if has_rank != has_world:
                missing = "WORLD_SIZE" if has_rank else "RANK"
                raise _error(
                    missing,
                    "",
                    "an integer (RANK and WORLD_SIZE come together)",
                    None,
                    f"Set {missing} too, or unset both.",
                )
            return cls(
                rank=0,
                world_size=1,
                replica_name=replica_name("workerpool0", 0),
                pool="workerpool0",
                pool_index=0,
                master_addr=env.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR,
                master_port=_env_int(env, "MASTER_PORT", DEFAULT_MASTER_PORT, minimum=1),
                source="standalone",
                group_rank=_env_int(env, "GROUP_RANK", 0),
                **common,
            )
        primary = spec.cluster.get("workerpool0", [])
        workers = spec.cluster.get("workerpool1", [])
        if spec.pool == "workerpool0":
            rank = 0
        elif spec.pool == "workerpool1":
            rank = len(primary) + spec.index  # a worker-only TF_CONFIG makes worker 0 rank 0
        else:
            rank = NON_TRAINING_RANK
        addr, port = _split_address((primary or workers)[0], spec.var, "cluster")
        return cls(
            rank=rank,
            world_size=len(primary) + len(workers),
            replica_name=f"{spec.pool}-{spec.index}",
            pool=spec.pool,
            pool_index=spec.index,
            master_addr=env.get("MASTER_ADDR") or addr,
            master_port=_env_int(env, "MASTER_PORT", port, minimum=1),
            source="cluster_spec" if spec.var == CLUSTER_SPEC_ENV else "tf_config",
            group_rank=_env_int(env, "GROUP_RANK", rank, minimum=NON_TRAINING_RANK),
            **common,
        )

    @classmethod
    def _from_torchrun(cls, env: Mapping[str, str], common: dict[str, Any]) -> ClusterInfo:
        world_size = _env_int(env, "WORLD_SIZE", 1, minimum=1)
        rank = _env_int(env, "RANK", 0)
        if rank >= world_size:
            raise _error(
                "RANK",
                "",
                f"an integer below WORLD_SIZE={world_size}",
                rank,
                "Set RANK to 0..WORLD_SIZE-1.",
            )
        group_rank = _env_int(env, "GROUP_RANK", rank)
        try:
            spec = _try_spec(env)
        except ClusterSpecError as exc:
            # RANK/WORLD_SIZE already say everything needed to train; the name is cosmetic.
            logger.warning("ignoring a malformed cluster description: %s", exc)
            spec = None
        if spec is not None:
            pool, index = spec.pool, spec.index
            _warn_if_contradicting(spec, group_rank, common["local_world_size"])
            addr, port = _split_address(
                (spec.cluster.get("workerpool0") or spec.cluster["workerpool1"])[0],
                spec.var,
                "cluster",
            )
        else:
            pool, index = training_replica(group_rank)
            addr, port = DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT
        return cls(
            rank=rank,
            world_size=world_size,
            replica_name=replica_name(pool, index),
            pool=pool,
            pool_index=index,
            master_addr=env.get("MASTER_ADDR") or addr,
            master_port=_env_int(env, "MASTER_PORT", port, minimum=1),
            source="torchrun",
            group_rank=group_rank,
            **common,
        )


def _warn_if_contradicting(spec: Any, group_rank: int, local_world_size: int) -> None:
    """RANK says one replica and the cluster description another: usually a RANK baked
    into an image or a job spec, and then two replicas take the same rank and fail with
    errors that point elsewhere (a port in use, a rank that never arrived). RANK wins,
    as torchrun's variables always do; say so."""
    if spec.pool not in ("workerpool0", "workerpool1"):
        return
    primaries = len(spec.cluster.get("workerpool0", []))
    spec_rank = 0 if spec.pool == "workerpool0" else primaries + spec.index
    if group_rank != spec_rank:
        logger.warning(
            "%s says this replica is %s-%d (rank %d), but %s=%d: %s wins. If the variable "
            "was set by hand (an image's ENV, a job spec), remove it", spec.var, spec.pool,
            spec.index, spec_rank, "GROUP_RANK" if local_world_size > 1 else "RANK",
            group_rank, "GROUP_RANK" if local_world_size > 1 else "RANK")


def _normalise_cluster(cluster: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    pools: dict[str, list[str]] = {}
    for name in sorted(cluster):
        addresses = cluster[name]
        if isinstance(addresses, str):  # list("h:1") would silently split it into characters
            raise _error(
                "cluster",
                name,
                "a list of 'host:port' strings",
                addresses,
                f"Pass cluster[{name!r}] as a list, e.g. [{addresses!r}].",
            )
        if addresses:  # the platform omits pools the user left empty
            pools[name] = list(addresses)
    return pools


def cluster_spec_json(
    cluster: Mapping[str, Sequence[str]],
    task_type: str,
    task_index: int,
    *,
    job: Mapping[str, Any] | None = None,
    trial: str = "",
) -> str:
    """The CLUSTER_SPEC the platform gives replica `task_type`-`task_index` (pools workerpoolN)."""
    text = json.dumps(
        {
            "cluster": _normalise_cluster(cluster),
            "environment": "cloud",
            "task": {"type": task_type, "index": task_index, "trial": trial},
            "job": dict(job or {}),
        }
    )
    _parse_spec(CLUSTER_SPEC_ENV, text)  # refuse to hand out what from_env would reject
    return text


def tf_config_json(
    cluster: Mapping[str, Sequence[str]],
    task_type: str,
    task_index: int,
    *,
    trial: str = "",
    cloud: str = "",
) -> str | None:
    """The TF_CONFIG the platform gives that replica, or None for a single-replica job.

    `cluster` and `task_type` use pool names (workerpoolN), as for cluster_spec_json.
    Evaluators are never listed in the cluster; an evaluator gets task type "evaluator".
    """
    cluster_spec_json(cluster, task_type, task_index)  # same validation, same messages
    pools = _normalise_cluster(cluster)
    if sum(len(addresses) for addresses in pools.values()) <= 1:
        return None
    text = json.dumps(
        {
            "cluster": {POOL_TO_TF_TYPE[p]: a for p, a in pools.items() if p != "workerpool3"},
            "environment": "cloud",
            "task": {
                "type": POOL_TO_TF_TYPE[task_type],
                "index": task_index,
                "trial": trial,
                "cloud": cloud,
            },
        }
    )
    _parse_spec(TF_CONFIG_ENV, text)
    return text
