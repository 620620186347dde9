"""The job you tested, as the platform's ``CustomJob``: what ``resilient-train export``
writes.

One job per step. ``tested_job`` turns a launch's merged options (``cli._options``: the
command line over the job spec) into a :class:`PlatformJob`, what the platform would run;
the launcher records it in job.json (``job_spec.platform``, secrets masked) and
:func:`job_from_record` reads it back. :func:`complete` fills in what only the platform
needs (a container image, a machine type, an accelerator type) or says what is missing,
and :func:`custom_job_spec` / :func:`custom_job` write the documents, checked by reading
them back with ``jobspec.parse_job_spec`` (through the platform's own types, aiplatform_v1,
when the cloud extra is installed): what is exported is what ``launch --job-spec`` runs
and what the API accepts. ``platform/jobset.py`` writes the same job for Kubernetes.

Pure: nothing here starts a process, probes the machine or reads the environment.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import fields, replace
from types import MappingProxyType
from typing import Any, Protocol

from ..observe.jobdir import SECRET_MASK, holds_mask
from .jobset import jobset_manifest
from .jobspec import JobSpec, JobSpecError, parse_job_spec
from .platformjob import LeftOut, PlatformJob, PlatformPool, comment, labels, left_out_lines
from .programs import PoolProgram, pool_spec_for
from .resources import MACHINE_TYPES, memory_limit_for
from .rules import DEFAULT_BUDGETS, Policy, Strategy, default_policy


class LaunchOptions(Protocol):
    """What a tested job is made from: the launch's merged options, as the launcher's
    ``LaunchOptions`` holds them (``cli._options``: the command line over the job spec)."""

    @property
    def job_name(self) -> str: ...
    @property
    def strategy(self) -> Strategy: ...
    @property
    def timeout(self) -> float | None: ...
    @property
    def max_wait(self) -> float | None: ...
    @property
    def restart_job_on_worker_restart(self) -> bool: ...
    @property
    def chaos(self) -> Any: ...        # the launcher's ChaosSpec: left out, named
    @property
    def policy(self) -> Policy | None: ...
    @property
    def pools(self) -> tuple[tuple[str, int], ...]: ...
    @property
    def output_dir(self) -> str | None: ...
    @property
    def listed_only(self) -> tuple[tuple[str, int], ...]: ...

    def program(self, pool: str) -> PoolProgram: ...

__all__ = [
    "DEFAULT_MACHINE_TYPE", "FORMATS", "ExportError", "LeftOut", "PlatformJob",
    "PlatformPool", "complete", "custom_job", "custom_job_spec", "job_from_record",
    "labels", "render", "tested_job", "with_overrides",
]

# What `--format` takes: a bare CustomJobSpec (gcloud's --config), a whole CustomJob (the
# REST body, with displayName and labels), a JobSet manifest (platform/jobset.py).
FORMATS = ("spec", "custom-job", "jobset")
# The platform needs a machine type for every pool; a local run without --machine-type
# had none. The smallest general-purpose shape of the launcher's table.
DEFAULT_MACHINE_TYPE = "n1-standard-4"
_IMAGE_EXAMPLE = "us-central1-docker.pkg.dev/PROJECT/REPO/IMAGE:TAG"


class ExportError(ValueError):
    """The job cannot be exported as it is; the message names what is missing and the fix."""


# --- from a launch's options ------------------------------------------------------------


def tested_job(options: LaunchOptions, spec: JobSpec | None, *, machine_type: str | None,
               gpus: int | None, disable_retries: bool) -> PlatformJob:
    """The platform's job for a launch: ``options`` as ``cli._options`` merged them, the
    job spec they came from (None without one), and what the options no longer say:
    ``--machine-type``, ``--gpus-per-worker`` (None: not given) and ``--disable-retries``
    (folded into the policy)."""
    machine_type = machine_type.strip().lower() if machine_type else None
    listed = {pool for pool, _ in options.listed_only}
    pools: list[PlatformPool] = []
    notes: list[str] = []
    for name, replicas in sorted((*options.pools, *options.listed_only),
                                 key=lambda p: int(p[0].removeprefix("workerpool"))):
        source = pool_spec_for(spec, name) if spec is not None else None
        program = None if name in listed else options.program(name)
        # The spec's (or --gpus-per-worker's) accelerators, not what this machine could
        # give: launch runs a GPU spec without GPUs on a laptop; the platform gives them.
        count = gpus if gpus is not None else (source.accelerator_count if source else 0)
        machine = machine_type or (source.machine_type if source is not None else None)
        count, acc_type = _attached(name, machine, count,
                                    source.accelerator_type if source is not None else None,
                                    gpus is not None, notes)
        command: tuple[str, ...] | None = None
        env: Mapping[str, str] = {}
        if program is not None:
            command, env = program.command, program.env
        elif source is not None:     # a pool listed only: the Reduction Server's image
            command, env = source.command, source.env
        pools.append(PlatformPool(
            name, replicas, command, source.image if source is not None else None,
            MappingProxyType(dict(env)), machine, acc_type if count else None, count,
            source.package_uris if source is not None else ()))
    local_paths: dict[str, list[str]] = {}
    for pool in pools:
        if pool.command and pool.command[0].startswith("/"):
            local_paths.setdefault(pool.command[0], []).append(pool.pool)
    for path, names in local_paths.items():
        # sys.executable of a virtualenv, say: a path the image rarely has.
        notes.append(f"the command of {', '.join(names)} starts with a path of this "
                     f"machine, {path}: make sure the image has it (or run python)")
    if spec is not None:
        notes += [f"from the job spec, not exported: {n}" for n in spec.notes_for("fields")]
    output = options.output_dir if options.output_dir and options.output_dir.startswith(
        "gs://") else None
    return PlatformJob(
        name=options.job_name,
        pools=tuple(pools),
        strategy=options.strategy,
        timeout=options.timeout,
        max_wait=options.max_wait,
        restart_job_on_worker_restart=options.restart_job_on_worker_restart,
        disable_retries=disable_retries,
        output_dir=output,
        left_out=tuple(_left_out(options, pools, disable_retries)),
        notes=tuple(notes),
    )


def _attached(pool: str, machine: str | None, count: int, acc_type: str | None,
              explicit: bool, notes: list[str]) -> tuple[int, str | None]:
    """A pool's accelerators on ``machine``: the platform's accelerator-optimized shapes
    (A2, A3, G2) come with their GPUs attached, whatever the local run used (unless
    ``explicit``, when the spec's check names the mismatch)."""
    shape = MACHINE_TYPES.get(machine or "")
    if shape is None or not shape.gpus:
        return count, acc_type
    if not explicit and count != shape.gpus:
        notes.append(f"{pool}: machine type {machine} comes with {shape.gpus} "
                     f"{shape.accelerator} per replica on the platform (the local run used "
                     f"{count})")
        count = shape.gpus
    return count, shape.accelerator


def _left_out(options: LaunchOptions, pools: Sequence[PlatformPool],
              disable_retries: bool) -> Iterable[LeftOut]:
    """The options of the launch that only the local launcher has."""
    defaults = {f.name: f.default for f in fields(options)}
    if options.chaos:
        items = [f.text for f in options.chaos.faults] + [f.text for f in options.chaos.random]
        yield LeftOut("--chaos", ",".join(items),
                      "faults are injected by the local launcher only; on the platform they "
                      "come by themselves")
    platform_policy = default_policy(options.strategy, disable_retries=disable_retries)
    if options.policy is not None and options.policy != platform_policy:
        mine = [r.name for r in options.policy.rules if r not in platform_policy.rules]
        budgets = [n for n, b in options.policy.budgets.items()
                   if platform_policy.budgets.get(n) != b]
        yield LeftOut("--policy", ", ".join(mine + [f"budget {n}" for n in budgets]),
                      "the platform applies its own restart rules "
                      "(docs/platform.md, \"Restart rules\"); "
                      "rules and budgets of yours do not travel")
    running = dict(options.pools)
    limits = {limit for p in pools if p.pool in running
              for limit in [options.program(p.pool).memory_limit] if limit is not None}
    machine_limits = {memory_limit_for(p.machine_type) for p in pools
                      if p.machine_type is not None and p.machine_type in MACHINE_TYPES}
    if limits - machine_limits:
        shown = ", ".join(f"{n / (1 << 30):.3g}GiB" for n in sorted(limits))
        yield LeftOut("--memory-limit", shown,
                      "a replica's memory on the platform is its machine type's; give "
                      "--machine-type TYPE to test that machine's limit here")
    if options.output_dir is None or not options.output_dir.startswith("gs://"):
        yield LeftOut("--output-dir", options.output_dir or "JOB_DIR/output",
                      "the platform writes outputs to Cloud Storage only: give --output-dir "
                      "gs://BUCKET/PREFIX (without it the platform sets no AIP_CHECKPOINT_DIR, "
                      "and a restarted replica finds no checkpoint)")
    if options.timeout is None:
        yield LeftOut("--timeout", "0", "the platform has no unlimited timeout; its default "
                      "of 7 days applies")
    for name, why in (("cpu_slots", "a share of this machine's CPU quota"),
                      ("start_jitter", "the platform starts replicas in no order by itself"),
                      ("grace", "the platform's own SIGTERM-to-SIGKILL grace applies"),
                      ("shared_workdir", ("on the platform each replica has a machine and "
                                          "disk of its own"))):
        value = getattr(options, name)
        if value != defaults[name]:
            yield LeftOut("--" + name.replace("_", "-"),
                          "" if isinstance(value, bool) else f"{value:g}", why)


# --- from a job's record ----------------------------------------------------------------


def job_from_record(record: Mapping[str, Any]) -> PlatformJob:
    """The platform's job from a job.json (``read_job``). A record written before job.json
    kept ``job_spec.platform`` gives its pools, commands, GPUs and scheduling only."""
    try:
        return _from_record(record)
    except ExportError:
        raise
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ExportError(
            f"job record of {record.get('name', '?')}: not in the shape resilient-train "
            f"launch writes ({exc!r}); export from the launch's options instead") from None


def with_overrides(job: PlatformJob, *, name: str | None = None, output_dir: str | None = None,
                   machine_type: str | None = None) -> PlatformJob:
    """A recorded job with what ``export --from-job`` may still say: its display name,
    a ``gs://`` output directory (a local run's is left out), every pool's machine type."""
    if output_dir is not None and not output_dir.startswith("gs://"):
        raise ExportError(f"--output-dir {output_dir}: the platform writes outputs to Cloud "
                          f"Storage only; give gs://BUCKET/PREFIX")
    notes = list(job.notes)
    pools = job.pools
    if machine_type is not None:
        machine = machine_type.strip().lower()
        pools = tuple(replace(p, machine_type=machine, accelerator_count=count,
                              accelerator_type=acc if count else None)
                      for p in job.pools
                      for count, acc in [_attached(p.pool, machine, p.accelerator_count,
                                                   p.accelerator_type, False, notes)])
    left_out = tuple(x for x in job.left_out
                     if not (output_dir is not None and x.option == "--output-dir"))
    return replace(job, name=name or job.name, pools=pools, left_out=left_out,
                   output_dir=output_dir or job.output_dir, notes=tuple(notes))


def _from_record(record: Mapping[str, Any]) -> PlatformJob:
    spec = record.get("job_spec") or {}
    if spec.get("platform"):
        return PlatformJob.from_json(spec["platform"])
    pools = [p for p in spec.get("worker_pool_specs") or () if "pool" in p]
    if not pools:
        raise ExportError(f"job record of {record.get('name', '?')}: no job_spec with worker "
                          f"pools; is it a job.json that resilient-train launch wrote?")
    sched = record.get("scheduling") or {}
    budgets = record.get("budgets") or {}
    retries = budgets.get("job_retries", {}).get("limit", DEFAULT_BUDGETS["job_retries"].limit)
    output = spec.get("base_output_directory") or ""
    return PlatformJob(
        name=record.get("name") or "rt-job",
        pools=tuple(PlatformPool(
            p["pool"], int(p["replica_count"]),
            None if p.get("listed_only") else tuple(p["command"]),
            accelerator_count=int(p.get("gpus_per_replica") or 0)) for p in pools),
        strategy=Strategy(sched.get("strategy", Strategy.STANDARD.value)),
        timeout=sched.get("timeout_s"),
        max_wait=sched.get("max_wait_duration_s"),
        restart_job_on_worker_restart=bool(sched.get("restart_job_on_worker_restart")),
        disable_retries=retries == 0,
        output_dir=output if output.startswith("gs://") else None,
        notes=(("the record predates job.json's platform section: each pool's env, image, "
                "machine and accelerator type are not in it, nor the local-only options it "
                "used; give --image, --machine-type and --accelerator-type, or export from "
                "the launch's options"),),
    )


# --- what only the platform needs -------------------------------------------------------


def complete(job: PlatformJob, *, image: str | None = None,
             accelerator_type: str | None = None) -> PlatformJob:
    """``job`` with every pool's image, machine type and accelerator type, or an
    :class:`ExportError` naming what is missing and the option that gives it.

    ``image`` replaces workerpool0's image and that of every pool with the same one (a
    Reduction Server's keeps its own), and is the image of pools that have none;
    ``accelerator_type`` is the type of every pool with accelerators."""
    primary_image = job.primary.image
    notes = list(job.notes)
    pools = []
    defaulted = []
    for pool in job.pools:
        pool_image = pool.image
        if image is not None and (pool_image is None or pool_image == primary_image):
            pool_image = image
        machine = pool.machine_type
        if machine is None:
            machine = DEFAULT_MACHINE_TYPE
            defaulted.append(pool.pool)
        acc = accelerator_type if accelerator_type and pool.accelerator_count else (
            pool.accelerator_type)
        if pool.accelerator_count and acc is None:
            raise ExportError(
                f"{pool.pool} asks for {pool.accelerator_count} GPU(s) per replica but names "
                f"no accelerator type: give --accelerator-type TYPE (e.g. NVIDIA_TESLA_T4 with "
                f"an n1 machine type), or a --machine-type that comes with its GPUs "
                f"(g2-standard-8: 1 NVIDIA_L4)")
        pools.append(replace(pool, image=pool_image, machine_type=machine,
                             accelerator_type=acc if pool.accelerator_count else None))
    missing = [p.pool for p in pools if p.image is None]
    if missing:
        raise ExportError(
            f"no container image for {', '.join(missing)}: the platform runs each pool's "
            f"command in a container image; give --image {_IMAGE_EXAMPLE} (an image with "
            f"your code and its dependencies, e.g. built from examples/platform/Dockerfile), "
            f"or launch from a --job-spec whose pools name their imageUri")
    masked = [f"{p.pool} command" for p in pools if p.command and holds_mask(p.command)]
    masked += [f"{p.pool} env {k}" for p in pools for k, v in p.env.items() if holds_mask([v])]
    if masked:
        raise ExportError(
            f"the job record masks secrets ({', '.join(masked)}): exported, they would be "
            f"{SECRET_MASK}. Export from the launch's options instead (resilient-train "
            f"export --image IMAGE [the launch's options] -- COMMAND), and keep secrets in "
            f"Secret Manager rather than in a spec")
    if defaulted:
        notes.append(f"no machine type for {', '.join(defaulted)}: {DEFAULT_MACHINE_TYPE} "
                     f"assumed; give --machine-type TYPE to choose (and to test its memory "
                     f"limit locally)")
    return replace(job, pools=tuple(pools), notes=tuple(notes))


# --- the platform's documents -----------------------------------------------------------


def custom_job_spec(job: PlatformJob) -> dict[str, Any]:
    """The ``CustomJobSpec`` (the API's JSON names; what ``gcloud ai custom-jobs create
    --config`` takes) of a :func:`complete` job, checked by reading it back."""
    return _checked(_spec_doc(job), "spec")


def custom_job(job: PlatformJob) -> dict[str, Any]:
    """The whole ``CustomJob``: display name, labels (what was left out) and the spec,
    checked by reading it back (through aiplatform_v1.CustomJob with the cloud extra)."""
    return _checked({"displayName": job.name, "labels": labels(job),
                     "jobSpec": _spec_doc(job)}, "job")


def _checked(doc: dict[str, Any], what: str) -> dict[str, Any]:
    """``doc`` once ``parse_job_spec`` reads it (the platform's types too, when installed)."""
    try:
        parse_job_spec(doc)
    except JobSpecError as exc:
        raise ExportError(f"the exported {what} would be refused: {exc}") from None
    return doc


def _spec_doc(job: PlatformJob) -> dict[str, Any]:
    by_index = {p.index: p for p in job.pools}
    doc: dict[str, Any] = {"workerPoolSpecs": [
        _pool_doc(by_index[i]) if i in by_index else {} for i in range(max(by_index) + 1)]}
    scheduling: dict[str, Any] = {}
    if job.timeout is not None:
        scheduling["timeout"] = _duration(job.timeout)
    scheduling["restartJobOnWorkerRestart"] = job.restart_job_on_worker_restart
    scheduling["disableRetries"] = job.disable_retries
    scheduling["strategy"] = job.strategy.name   # STANDARD, SPOT, FLEX_START: the API's names
    if job.strategy is Strategy.FLEX_START:
        scheduling["maxWaitDuration"] = _duration(job.max_wait or 0)   # "0s": forever
    doc["scheduling"] = scheduling
    if job.output_dir is not None:
        doc["baseOutputDirectory"] = {"outputUriPrefix": job.output_dir}
    return doc


def _pool_doc(pool: PlatformPool) -> dict[str, Any]:
    machine: dict[str, Any] = {"machineType": pool.machine_type}
    if pool.accelerator_count:
        machine["acceleratorType"] = pool.accelerator_type
        machine["acceleratorCount"] = pool.accelerator_count
    env = [{"name": k, "value": v} for k, v in pool.env.items()]
    doc: dict[str, Any] = {"replicaCount": pool.replicas, "machineSpec": machine}
    command = pool.command
    if pool.package_uris and command and command[:2] == ("python", "-m") and len(command) > 2:
        package: dict[str, Any] = {"executorImageUri": pool.image,
                                   "packageUris": list(pool.package_uris),
                                   "pythonModule": command[2]}
        if command[3:]:
            package["args"] = list(command[3:])
        if env:
            package["env"] = env
        doc["pythonPackageSpec"] = package
        return doc
    container: dict[str, Any] = {"imageUri": pool.image}
    if command is not None:
        container["command"] = list(command)
    if env:
        container["env"] = env
    doc["containerSpec"] = container
    return doc


def _duration(seconds: float) -> str:
    """A google.protobuf.Duration in JSON: ``7200s``, ``1.5s``."""
    if seconds == int(seconds):
        return f"{int(seconds)}s"
    return f"{seconds:.9f}".rstrip("0") + "s"


# --- as text ----------------------------------------------------------------------------


def render(job: PlatformJob, fmt: str, *, as_json: bool = False) -> str:
    """The document for ``--format`` ``fmt`` as text: YAML with a comment header saying how
    to submit it and what was left out, or JSON (``as_json``; not for a JobSet)."""
    if fmt == "jobset":
        return jobset_manifest(job)
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    doc = custom_job_spec(job) if fmt == "spec" else custom_job(job)
    if as_json:
        return json.dumps(doc, indent=2) + "\n"
    import yaml

    what = "A Vertex AI CustomJobSpec" if fmt == "spec" else "A Vertex AI CustomJob"
    header = [f"{what}: the job {job.name} as tested with resilient-train launch."]
    if fmt == "spec":
        label = ",".join(f"{k}={v}" for k, v in labels(job).items())
        header += ["Submit it:",
                   (f"  gcloud ai custom-jobs create --region=REGION --display-name={job.name} "
                    f"--config=FILE --labels={label}")]
    else:
        header += [("Submit it as the body of projects.locations.customJobs.create (REST), or "
                    "through the JobService client's create_custom_job.")]
    header += ["Run it here again: resilient-train launch --job-spec FILE"]
    header += left_out_lines(job)
    return comment(header) + yaml.safe_dump(doc, sort_keys=False, width=100)
