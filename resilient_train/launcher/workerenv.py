"""The environment each replica gets: the platform's variables plus torchrun's."""

from __future__ import annotations

import logging
import os
import secrets
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..cluster import (
    JOB_ID_ENV,
    NODE_LOCAL_DIR_ENV,
    cluster_spec_json,
    replica_name,
    tf_config_json,
)
from ..errors import ERROR_FILE_ENV
from ..observe.telemetry import FAILURES_ENV, TELEMETRY_ENV
from ..platform.env import TRAINING_POOLS, output_dirs
from ..sigterm import GRACE_ENV
from .machines import Placement

# Pools 0 (primary) and 1 (workers) form the training process group; pools 2 (parameter
# or reduction servers) and 3 (evaluators) do not.
LAUNCH_ID_ENV = "RESILIENT_TRAIN_LAUNCH_ID"
# The rendezvous store's secret, as distributed/storeauth.py reads it (not imported from
# there: the launcher does not load the distributed package).
SECRET_ENV = "RESILIENT_TRAIN_JOB_SECRET"


@dataclass(frozen=True)
class Replica:
    name: str          # "workerpool1-0"
    pool: str          # "workerpool1"
    index: int         # index inside the pool
    rank: int | None   # training rank; None for pools 2 and 3


def replicas_for(pools: Sequence[tuple[str, int]]) -> tuple[Replica, ...]:
    """Replicas in rank order: workerpool0-0 first, then workerpool1-*, then pools 2 and 3."""
    counts = dict(pools)
    if counts.get("workerpool0") != 1:
        raise ValueError(
            f"workerpool0 must have exactly one replica (the primary), found "
            f"{counts.get('workerpool0', 0)}; use --workers N or --pool workerpool0=1")
    out: list[Replica] = []
    rank = 0
    for pool in sorted(counts, key=lambda p: int(p.removeprefix("workerpool"))):
        for i in range(counts[pool]):
            is_training = pool in TRAINING_POOLS
            out.append(Replica(replica_name(pool, i), pool, i, rank if is_training else None))
            rank += 1 if is_training else 0
    return tuple(out)


@dataclass(frozen=True)
class JobEnv:
    """What is the same for every replica of a job."""

    job_id: str
    replicas: tuple[Replica, ...]
    master_addr: str
    master_port: int
    output_base: str                 # local path or gs:// URI, no trailing slash
    job_dir: str
    # Unique per launch; every worker (and whatever it spawns) inherits it, so the launcher
    # can find the processes of its job that left their process group.
    launch_id: str = ""
    # The rendezvous store's secret (distributed/storeauth.py), new per launch. Only the
    # replicas' environment carries it: never the job record, the logs or a repr.
    job_secret: str = field(default_factory=lambda: secrets.token_hex(32), repr=False)
    running: int = 0   # replicas that run on this machine (0: all of ``replicas``)
    # SIGTERM to SIGKILL (the launcher's --grace): what an emergency save plans for.
    grace_s: float | None = None


LOCAL_PROJECT_NUMBER = "000000000000"


def create_output_dirs(output_base: str) -> None:
    """Create the AIP_* directories of a local output base. On the platform they are
    ``gs://`` prefixes, which exist for every write: a script that saves its model to
    ``AIP_MODEL_DIR`` without creating it works there, and so it must here. Raises
    OSError."""
    if "://" in output_base:
        return
    for path in output_dirs(output_base).values():
        os.makedirs(path, exist_ok=True)


def fuse_path_note(output: str | None) -> str | None:
    """A line for an output directory under ``/gcs/`` where nothing is mounted: on the
    platform ``/gcs/BUCKET`` is the bucket (Cloud Storage FUSE), here a plain directory."""
    if output is None or not output.startswith("/gcs/"):
        return None
    parts = output.rstrip("/").split("/")[1:]   # gcs, BUCKET, ...
    if any(os.path.ismount("/" + "/".join(parts[:i])) for i in range(1, len(parts) + 1)):
        return None
    return (f"--output-dir {output}: nothing is mounted at /gcs/ here (on the platform it is "
            f"Cloud Storage FUSE), so the outputs go to this machine's disk; for the bucket "
            f"itself use gs://{'/'.join(parts[1:])}")


def gcs_credentials_problem(output: str, environ: Mapping[str, str]) -> str | None:
    """Why every write under a ``gs://`` output would fail here, or None: no Google Cloud
    credentials on this machine (no emulator in ``STORAGE_EMULATOR_HOST`` either). gcsfs
    then falls back to anonymous access, and the workers find out at their first write,
    after minutes of retries where the network is down; on the platform the job's service
    account is always there."""
    if not output.startswith("gs://"):
        return None
    # Imported for gs:// only (fsspec; not torch): the emulator rule of the storage itself.
    from ..checkpoint.storage.gcs import uses_gcs_emulator

    if uses_gcs_emulator({}, environ):
        return None
    try:
        import google.auth
        from google.auth.exceptions import DefaultCredentialsError
    except ImportError:   # gcsfs brings it; without gcsfs the worker's error says more
        return None
    # Only whether there are credentials: not its lines on the project id or the
    # metadata server, which would read as the launcher's own.
    quiet = logging.getLogger("google.auth._default")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        google.auth.default()
    except DefaultCredentialsError:
        return (f"the job's outputs and checkpoints go to {output}, but this machine has no "
                f"Google Cloud credentials (Application Default Credentials not found), so "
                f"every write there would fail: run `gcloud auth application-default "
                f"login`, or set GOOGLE_APPLICATION_CREDENTIALS to a key file; or pass "
                f"--output-dir DIR to keep this run local")
    finally:
        quiet.setLevel(level)
    return None


def worker_env(job: JobEnv, replica: Replica, *, attempt: int, restart: int,
               error_file: str, gpu_ids: Sequence[int] | None,
               base: Mapping[str, str], telemetry: str = "", failures_file: str = "",
               placement: Placement | None = None) -> dict[str, str]:
    cluster: dict[str, list[str]] = {}
    for i, r in enumerate(job.replicas):
        # Locally every replica is this host; ports are distinct so the addresses are too.
        cluster.setdefault(r.pool, []).append(f"{job.master_addr}:{job.master_port + i}")
    world = sum(1 for r in job.replicas if r.rank is not None)
    env = dict(base)
    env.update({
        "CLUSTER_SPEC": cluster_spec_json(cluster, replica.pool, replica.index,
                                          job={"job_id": job.job_id}),
        "MASTER_ADDR": job.master_addr,
        "MASTER_PORT": str(job.master_port),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        JOB_ID_ENV: job.job_id,
        # The platform sets the project *number*; locally there is none: a number that
        # no real project has, unless the user's environment names one.
        "CLOUD_ML_PROJECT_ID": base.get("CLOUD_ML_PROJECT_ID") or LOCAL_PROJECT_NUMBER,
        **output_dirs(job.output_base),
        # torchrun's variables, so scripts written for torchrun run unchanged.
        "TORCHELASTIC_RESTART_COUNT": str(restart),
        "TORCHELASTIC_RUN_ID": job.job_id,
        ERROR_FILE_ENV: error_file,
        TELEMETRY_ENV: telemetry,   # where this life reports its training progress
        "RESILIENT_TRAIN_REPLICA": replica.name,
        "RESILIENT_TRAIN_ATTEMPT": str(attempt),
        "RESILIENT_TRAIN_RESTART_COUNT": str(restart),
        "RESILIENT_TRAIN_JOB_DIR": job.job_dir,
    })
    if job.launch_id:
        env[LAUNCH_ID_ENV] = job.launch_id
    if job.grace_s is not None:
        env[GRACE_ENV] = f"{job.grace_s:g}"
    # A secret the user set (the job spec's env, as on the platform) wins: it is the same
    # for every replica too.
    if not env.get(SECRET_ENV, "").strip():
        env[SECRET_ENV] = job.job_secret
    if replica.rank is not None:
        env["RANK"] = env["GROUP_RANK"] = str(replica.rank)
    else:
        env.pop("RANK", None)
        env.pop("GROUP_RANK", None)
    tf_config = tf_config_json(cluster, replica.pool, replica.index)
    if tf_config is not None:
        env["TF_CONFIG"] = tf_config
    else:
        env.pop("TF_CONFIG", None)
    if failures_file:
        # The job's failures so far, kept current by the launcher: the one channel by which
        # a worker learns the job's observed MTBF (CheckpointOptions(policy=auto_interval()),
        # telemetry.ObservedMtbf), restarted or one that outlives failures.
        env[FAILURES_ENV] = failures_file
    if placement is not None:   # the replica's own machine (machines.py)
        env["TMPDIR"] = str(placement.tmpdir)
        env[NODE_LOCAL_DIR_ENV] = str(placement.node_local)
        if placement.workdir is not None:
            env["PWD"] = str(placement.workdir)
    if gpu_ids is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpu_ids)
    if sys.platform.startswith("linux"):
        # Every replica is on this host: keep gloo's listeners on loopback (they have no
        # authentication) unless the user chose an interface.
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return started_as_worker(env, job.running or len(job.replicas))


def started_as_worker(env: Mapping[str, str], replicas: int) -> dict[str, str]:
    """``env`` with what the launcher sets, of the variables read at start-up, for each
    worker of a job of ``replicas`` replicas (a preload server's lives must match it)."""
    out = dict(env, PYTHONUNBUFFERED="1")
    # On the platform each replica has its VM's cores; here they share this machine's.
    # Without a share each process starts one thread per core, and N replicas thrash
    # (we measured a 2-worker CPU job 6x slower). torchrun sets 1 for the same reason.
    out.setdefault("OMP_NUM_THREADS", str(cpu_share(replicas)))
    return out


def cpu_share(replicas: int) -> int:
    """This machine's usable cores divided among the job's replicas, at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, replicas))
