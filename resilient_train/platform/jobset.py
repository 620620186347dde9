"""The tested job as a Kubernetes JobSet (``jobset.x-k8s.io/v1alpha2``): the platform's
rules as far as Kubernetes can carry them, and a comment wherever it cannot.

The mapping (docs/export.md, "Kubernetes: a JobSet" has the table):

- each pool is a replicated job of one indexed Job whose pods are the pool's replicas, with
  stable DNS names (``NAME-workerpool1-0-2.NAME``);
- the job succeeds when workerpool0's Job does (``successPolicy`` Any on workerpool0), as
  the platform's job SUCCEEDS when the primary exits 0;
- per-worker restarts are ``backoffLimitPerIndex`` (the ``worker_restarts`` budget);
  ``podFailurePolicy`` sorts a pod's end as the platform's table does: a disruption
  (node loss, preemption, drain) is counted and the pod replaced; a transient exit code
  (6, 11, 134, 139) fails its index, and ``maxFailedIndexes: 0`` turns that into the
  Job's failure, which the JobSet's ``failurePolicy`` retries (``maxRestarts``, the
  ``job_retries`` budget); any other non-zero exit (a bug, an OOM kill's 137) fails the
  Job by the pod failure policy, which the JobSet fails for good;
- ``CLUSTER_SPEC``, ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE`` and ``RANK`` as the
  platform sets them, built from the DNS names and each pod's completion index.

Written as text (YAML with comments); pure, like platform/export.py.
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..cluster import DEFAULT_MASTER_PORT, cluster_spec_json
from ..errors import PLATFORM_TRANSIENT_EXIT_CODES
from .env import TRAINING_POOLS, output_dirs
from .platformjob import PlatformJob, PlatformPool, comment, labels, left_out_lines
from .rules import DEFAULT_BUDGETS, Strategy

__all__ = ["API_VERSION", "jobset_manifest", "jobset_name"]

API_VERSION = "jobset.x-k8s.io/v1alpha2"
CONTAINER = "trainer"
PORT = DEFAULT_MASTER_PORT
# Kubernetes gives each pod of an Indexed Job its index in this annotation (and in this
# variable, which is defined here too so that $(...) in the variables after it sees it).
INDEX_ENV = "JOB_COMPLETION_INDEX"
INDEX_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
WORKER_RESTARTS = DEFAULT_BUDGETS["worker_restarts"].limit
JOB_RETRIES = DEFAULT_BUDGETS["job_retries"].limit
TRANSIENT_EXIT_CODES = sorted(PLATFORM_TRANSIENT_EXIT_CODES)   # the API wants them sorted
# A pod's hostname NAME-workerpoolN-0-I is a DNS label (63 characters): 40 leave room.
_NAME_CHARS = 40
_WIDTH = 92


@dataclass(frozen=True)
class _Noted:
    """A value with a comment above its key."""

    value: Any
    lines: tuple[str, ...]


def _noted(value: Any, *lines: str) -> _Noted:
    return _Noted(value, lines)


def jobset_name(name: str) -> str:
    """``name`` as a JobSet name: a DNS label short enough for its pods' hostnames."""
    text = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    if not text[:1].isalpha():
        text = f"rt-{text}"
    return text[:_NAME_CHARS].rstrip("-")


def jobset_manifest(job: PlatformJob) -> str:
    """The JobSet manifest of a ``complete``d job, as YAML text with comments."""
    name = jobset_name(job.name)
    hosts = {p.pool: [f"{_host(name, p.pool, i)}:{PORT}" for i in range(p.replicas)]
             for p in job.pools}
    world = sum(p.replicas for p in job.pools if p.pool in TRAINING_POOLS)
    spec: dict[str, Any] = {
        "successPolicy": _noted(
            {"operator": "Any", "targetReplicatedJobs": ["workerpool0"]},
            "The platform's job SUCCEEDS when the primary, workerpool0-0, exits 0, whatever "
            "the other replicas do; the JobSet then completes and deletes the jobs still "
            "running."),
        "failurePolicy": _noted(
            {"maxRestarts": _noted(
                0 if job.disable_retries else JOB_RETRIES,
                "The platform's job retries (the job_retries budget; 0: disableRetries)."
                + (" Spot: the platform retries a preempted job up to "
                   f"{DEFAULT_BUDGETS['spot_retries'].limit} times; here a preemption is a "
                   "disruption, counted per pod (podFailurePolicy)."
                   if job.strategy is Strategy.SPOT else "")),
             "restartStrategy": _noted(
                 "Recreate",
                 "A retry deletes every pod and creates it anew, maybe on another node, as "
                 "the platform starts every replica of a retried job again."),
             "rules": [
                 {"name": "user_code_error", "action": "FailJobSet",
                  "onJobFailureReasons": ["PodFailurePolicy"]},
                 {"name": "timeout", "action": "FailJobSet",
                  "onJobFailureReasons": ["DeadlineExceeded"]},
                 {"name": "retry_job", "action": "RestartJobSet",
                  "onJobFailureReasons": ["MaxFailedIndexesExceeded", "FailedIndexes",
                                          "BackoffLimitExceeded"]},
             ]},
            "The platform's restart table (docs/platform.md, \"Restart rules\"), first match "
            "wins: a Job failed by its pod failure policy (a permanent exit: a bug, an OOM "
            "kill) fails the job; a timeout fails it; a transient exit code or a replica "
            "past its restarts retries the whole job."),
        "startupPolicy": _noted(
            {"startupPolicyOrder": "AnyOrder"},
            "Replicas start in parallel and in no order, as on the platform: training code "
            "waits for its peers (rt.init_distributed does)."),
        "network": _noted(
            {"enableDNSHostnames": True, "subdomain": name, "publishNotReadyAddresses": True},
            f"Stable names: replica I of pool P is {name}-P-0-I.{name} (the platform's "
            f"hostname is P-I); a replaced pod keeps its name. Names resolve before a pod "
            f"is ready, so a worker can wait for the primary."),
        "replicatedJobs": [_replicated_job(job, pool, name, hosts, world) for pool in job.pools],
    }
    manifest = {
        "apiVersion": API_VERSION,
        "kind": "JobSet",
        "metadata": {"name": name, "labels": labels(job)},
        "spec": spec,
    }
    flex = (" (the platform's FLEX_START waits at most maxWaitDuration)"
            if job.strategy is Strategy.FLEX_START else "")
    header = [
        f"A JobSet ({API_VERSION}): the job {job.name} as tested with resilient-train launch.",
        ("Apply it with kubectl apply -f FILE on a cluster with the JobSet controller "
         "installed; the image must be one the cluster can pull."),
        "What Kubernetes cannot say as the platform does:",
        ("  a failed replica is a new pod (maybe on another node, its local files gone), not "
         "the same container restarted in place on its VM;"),
        ("  there is no stockout or internal error: a pod that does not fit waits Pending, "
         f"with no maximum wait{flex};"),
        ("  a disruption (DisruptionTarget) is counted against the pod's restarts, maintenance "
         "too (the platform does not count maintenance restarts)."),
    ]
    if job.restart_job_on_worker_restart:
        header.append("  restartJobOnWorkerRestart (any worker restart restarts every "
                      "replica) has no JobSet counterpart: only the failed pod is replaced.")
    header += [line for line in left_out_lines(job) if "--timeout 0:" not in line]
    return comment(header) + "\n".join(_block(manifest, 0)) + "\n"


def _host(name: str, pool: str, index: int) -> str:
    # <jobset>-<replicatedJob>-<job index>-<pod index>.<subdomain>: one Job per pool.
    return f"{name}-{pool}-0-{index}.{name}"


def _replicated_job(job: PlatformJob, pool: PlatformPool, name: str,
                    hosts: Mapping[str, Sequence[str]], world: int) -> dict[str, Any]:
    restarts = [(f"The platform restarts a failed worker up to {WORKER_RESTARTS} times "
                 f"(worker_restarts), then retries the job; here each pod index gets "
                 f"{WORKER_RESTARTS} replacements.")]
    if job.restart_job_on_worker_restart:
        restarts.append("restartJobOnWorkerRestart is not carried: only the pod is replaced.")
    spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": pool.replicas,
        "parallelism": pool.replicas,
        "backoffLimitPerIndex": _noted(WORKER_RESTARTS, *restarts),
        "maxFailedIndexes": _noted(
            0, "A replica past its restarts, or one that exited with a transient code, "
               "fails this Job at once: the JobSet's failurePolicy retries the job."),
    }
    if job.timeout is not None:
        spec["activeDeadlineSeconds"] = _noted(
            math.ceil(job.timeout),
            "The platform's timeout counts from the job's first RUNNING; this one counts "
            "from this Job's start, again after each retry.")
    spec["podFailurePolicy"] = _noted(
        {"rules": [
            {"action": "Count",
             "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            {"action": "FailIndex",
             "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                             "values": TRANSIENT_EXIT_CODES}},
            {"action": "FailJob",
             "onExitCodes": {"containerName": CONTAINER, "operator": "NotIn",
                             "values": TRANSIENT_EXIT_CODES}},
        ]},
        "First match wins. A node loss, preemption or drain is counted (the pod's own exit "
        "code, 137 or 143, does not decide); the platform's transient codes "
        f"({', '.join(map(str, TRANSIENT_EXIT_CODES))}) fail the index, which retries the "
        "job; any other non-zero exit (a bug; an OOM kill, 137) is permanent.")
    spec["template"] = {"spec": _pod_spec(job, pool, name, hosts, world)}
    return {"name": pool.pool,
            "replicas": _noted(1, f"One Job whose {pool.replicas} pod(s) are the pool's "
                                  f"replicas."),
            "template": {"spec": spec}}


def _pod_spec(job: PlatformJob, pool: PlatformPool, name: str,
              hosts: Mapping[str, Sequence[str]], world: int) -> dict[str, Any]:
    container: dict[str, Any] = {"name": CONTAINER, "image": pool.image}
    command = list(pool.command) if pool.command is not None else None
    offset = _rank_offset(job, pool)
    rank_note: str | None = None
    if offset is not None and (offset, pool.replicas) != (0, 1):   # else RANK is "0"
        if command is not None:
            # The downward API gives the index; only a shell can add the pool's offset.
            command = ["/bin/sh", "-c",
                       f'export RANK=$(({INDEX_ENV} + {offset})); exec "$0" "$@"', *command]
            rank_note = (f"RANK = {offset} + the pod's completion index: Kubernetes cannot "
                         f"add, so /bin/sh does before it runs the command.")
        else:
            rank_note = ("No RANK: this pool runs its image's entrypoint, which a shell cannot "
                         "wrap; CLUSTER_SPEC says the replica's pool and index.")
    if pool.package_uris:
        rank_note = ((rank_note + " ") if rank_note else "") + (
            f"On the platform this pool installs {', '.join(pool.package_uris)} first; "
            f"build it into the image here.")
    if command is not None:
        container["command"] = _noted(command, rank_note) if rank_note else command
    container["env"] = _env(job, pool, name, hosts, world, offset)
    if pool.accelerator_count:
        container["resources"] = {"limits": {"nvidia.com/gpu": pool.accelerator_count}}
    selector: dict[str, str] = {}
    if pool.accelerator_count and pool.accelerator_type:
        selector["cloud.google.com/gke-accelerator"] = pool.accelerator_type.lower().replace(
            "_", "-")
    if pool.machine_type:
        selector["node.kubernetes.io/instance-type"] = pool.machine_type
    if job.strategy is Strategy.SPOT:
        selector["cloud.google.com/gke-spot"] = "true"
    spec: dict[str, Any] = {
        "restartPolicy": _noted(
            "Never", "A failed pod is replaced by a new one (podFailurePolicy needs Never)."),
    }
    if selector:
        spec["nodeSelector"] = _noted(
            selector, "The pool's machineSpec as GKE's node labels; on another cluster, use "
                      "its own.")
    spec["containers"] = [container]
    return spec


def _rank_offset(job: PlatformJob, pool: PlatformPool) -> int | None:
    """The training rank of the pool's replica 0 (the replicas of the training pools
    before it); None for pools 2 and 3, which have no rank."""
    if pool.pool not in TRAINING_POOLS:
        return None
    return sum(p.replicas for p in job.pools
               if p.pool in TRAINING_POOLS and p.index < pool.index)


def _env(job: PlatformJob, pool: PlatformPool, name: str, hosts: Mapping[str, Sequence[str]],
         world: int, offset: int | None) -> list[Any]:
    cluster = cluster_spec_json(hosts, pool.pool, 0, job={"job_id": job.name})
    if pool.replicas > 1 or pool.pool != "workerpool0":
        # The task's index is the pod's: $(VAR) is expanded from the variables before it.
        cluster = cluster.replace('"index": 0, "trial"', f'"index": $({INDEX_ENV}), "trial"')
    ours: dict[str, Any] = {
        INDEX_ENV: {"fieldRef": {"fieldPath": INDEX_FIELD}},
        "CLUSTER_SPEC": cluster,
        "MASTER_ADDR": _host(name, "workerpool0", 0),
        "MASTER_PORT": str(PORT),
        "WORLD_SIZE": str(world),
    }
    if offset == 0 and pool.replicas == 1:
        ours["RANK"] = "0"
    if job.output_dir is not None:
        ours.update(output_dirs(job.output_dir.rstrip("/")))
    # The pool's own variables first; the platform's win, as the platform sets them.
    env: list[Any] = [{"name": k, "value": v} for k, v in pool.env.items() if k not in ours]
    for key, value in ours.items():
        env.append({"name": key, "valueFrom": value} if isinstance(value, dict)
                   else {"name": key, "value": value})
    return env


# --- YAML with comments -----------------------------------------------------------------


def _block(node: Mapping[str, Any], indent: int) -> list[str]:
    """Block-style YAML lines for a mapping; a _Noted value gets its comment above its key."""
    pad = " " * indent
    out: list[str] = []
    for key, value in node.items():
        if isinstance(value, _Noted):
            out += _comment_lines(value.lines, indent)
            value = value.value
        head = f"{pad}{_scalar(key)}:"
        if isinstance(value, Mapping) and value:
            out.append(head)
            out += _block(value, indent + 2)
        elif isinstance(value, list) and value:
            out.append(head)
            out += _items(value, indent)
        else:
            out.append(f"{head} {_scalar(value)}")
    return out


def _items(items: Sequence[Any], indent: int) -> list[str]:
    pad = " " * indent
    out: list[str] = []
    for item in items:
        if isinstance(item, Mapping) and item:
            lines = _block(item, indent + 2)
            first = next(i for i, line in enumerate(lines) if not line.lstrip().startswith("#"))
            lines[first] = f"{pad}- {lines[first][indent + 2:]}"
            out += lines
        else:
            out.append(f"{pad}- {_scalar(item)}")
    return out


def _comment_lines(lines: Sequence[str], indent: int) -> list[str]:
    width = max(40, _WIDTH - indent - 2)
    return [f"{' ' * indent}# {part}" for line in lines
            for part in textwrap.wrap(" ".join(line.split()), width)]


def _scalar(value: Any) -> str:
    """One YAML scalar (or empty collection) in flow style, quoted where YAML needs it."""
    import yaml

    return yaml.safe_dump([value], default_flow_style=True, width=1 << 30).strip()[1:-1]
