"""A Vertex AI CustomJob spec, as ``gcloud ai custom-jobs create --config`` reads it, read
into the launcher's options.

Pure: ``parse_job_spec`` turns the decoded document into a frozen ``JobSpec``; nothing
here starts processes or probes GPUs. ``cli.py`` merges it with the command line, where
options given explicitly win.

Accepted documents: a bare ``CustomJobSpec`` (``workerPoolSpecs`` at the top, what gcloud's
``--config`` takes) or a whole ``CustomJob`` (``jobSpec:`` at the top, as the REST API
takes and ``gcloud ai custom-jobs describe`` prints). Field names are the API's camelCase
JSON names; like gcloud, a name with an underscore is an error. A field the API does not
have, or a value of the wrong type, is a ``JobSpecError`` naming the field's path and the
fix, so a spec that runs here is also one the platform accepts.

Which fields the API has: with the cloud extra, the platform's own types say
(platform/aiplatform_types.py: aiplatform_v1's descriptors for the fields read here, and the whole
document parsed into ``CustomJob`` / ``CustomJobSpec`` for the rest, at any depth);
without it, the tables below, our reading of the same API.
"""

from __future__ import annotations

import copy
import json
import re
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ..observe.jobdir import SECRET_MASK, mask_env
from ..text import MAX_DURATION_S, MAX_DURATION_TEXT
from . import aiplatform_types as platform_types
from .errors import QUOTE_CHARS, JobSpecError, suggest_field
from .resources import MACHINE_TYPES, memory_limit_for
from .rules import Strategy

__all__ = ["JobSpec", "JobSpecError", "PoolSpec", "load_job_spec", "parse_job_spec"]

MAX_POOLS = 4  # workerpool0 primary, 1 workers, 2 parameter/reduction servers, 3 evaluators
# Bounds on what a spec may cost to read. A real one is a few KiB and about ten levels deep.
# YAML aliases (&name / *name) are allowed (a pool's containerSpec shared with the next, say),
# but each one counts as a copy of what it names: a "billion laughs" document of a few
# hundred bytes, nine aliases of nine aliases of ..., is refused before anything walks it.
MAX_SPEC_BYTES = 1 << 20
MAX_SPEC_EXPANDED = 4 * MAX_SPEC_BYTES   # nodes + scalar characters, aliases expanded
MAX_SPEC_DEPTH = 64
_MESSAGE_CHARS = 2000    # of a whole message, whatever it quotes

# --- the schema (Vertex AI v1 REST names) ----------------------------------------------
# Per message: the fields the launcher uses. Every other field of the message is accepted
# but cannot be reproduced on one machine (listed in a note, never silently dropped).
# Which fields a message has comes from the platform's own types when the cloud extra is
# installed (platform/aiplatform_types.py); without it, from _FIELDS, our reading of the same API.
_USED = {
    "CustomJob": {"jobSpec", "displayName"},
    "CustomJobSpec": {"workerPoolSpecs", "scheduling", "baseOutputDirectory"},
    "WorkerPoolSpec": {"replicaCount", "machineSpec", "containerSpec", "pythonPackageSpec"},
    "MachineSpec": {"machineType", "acceleratorType", "acceleratorCount"},
    "ContainerSpec": {"imageUri", "command", "args", "env"},
    "PythonPackageSpec": {"executorImageUri", "packageUris", "pythonModule", "args", "env"},
    "Scheduling": {"timeout", "restartJobOnWorkerRestart", "strategy", "disableRetries",
                   "maxWaitDuration"},
    "GcsDestination": {"outputUriPrefix"},
    "EnvVar": {"name", "value"},
}
_FIELDS = {   # without the extra: each message's fields, used or not
    **_USED,
    "CustomJob": _USED["CustomJob"] | {  # output-only too: `describe` output can be read
        "name", "labels", "encryptionSpec", "state", "createTime", "startTime", "endTime",
        "updateTime", "error", "webAccessUris", "satisfiesPzs", "satisfiesPzi"},
    "CustomJobSpec": _USED["CustomJobSpec"] | {
        "serviceAccount", "network", "reservedIpRanges", "tensorboard", "enableWebAccess",
        "enableDashboardAccess", "experiment", "experimentRun", "models",
        "persistentResourceId", "protectedArtifactLocationId", "pscInterfaceConfig"},
    "WorkerPoolSpec": _USED["WorkerPoolSpec"] | {"diskSpec", "nfsMounts", "lustreMounts"},
    "MachineSpec": _USED["MachineSpec"] | {"tpuTopology", "reservationAffinity",
                                           "gpuPartitionSize"},
}


def fields_of(message: str) -> frozenset[str]:
    """The JSON names of ``message``'s fields: the platform's types' when installed."""
    return platform_types.known_fields(message) or frozenset(_FIELDS[message])


_STRATEGIES = {
    "STRATEGY_UNSPECIFIED": Strategy.STANDARD,
    "STANDARD": Strategy.STANDARD,
    "ON_DEMAND": Strategy.STANDARD,   # deprecated name of STANDARD
    "SPOT": Strategy.SPOT,
    "LOW_COST": Strategy.SPOT,        # deprecated: "may use spot resources"
    "FLEX_START": Strategy.FLEX_START,
}
# google.protobuf.Duration in JSON: seconds with up to 9 fractional digits and an "s".
_DURATION_RE = re.compile(r"^(\d+)(\.\d{1,9})?s$")
_INT_RE = re.compile(r"^-?\d+$")   # proto3 JSON writes int64 (replicaCount) as a string
_ACCELERATOR_RE = re.compile(r"^[A-Z][A-Z0-9_]*$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
# The platform's Reduction Server image (...-docker.pkg.dev/vertex-ai-restricted/training/
# reductionserver:TAG): its own entrypoint, no training rank.
_REDUCTION_SERVER_RE = re.compile(r"/reductionserver(?:[:@]|$)")


@dataclass(frozen=True)
class PoolSpec:
    """One worker pool as the spec gives it: its own program, environment and machine."""

    pool: str                                # "workerpool2"
    path: str                                # "workerPoolSpecs[2]", for messages
    replicas: int
    command: tuple[str, ...] | None          # command + args; None: the image's ENTRYPOINT
    image: str
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    machine_type: str = ""
    memory_limit: int | None = None          # from machine_type; None: not in the table
    accelerator_type: str | None = None
    accelerator_count: int = 0
    # A pythonPackageSpec's packageUris (its command is then python -m MODULE ARGS), kept
    # so that an export writes the pool as the spec did.
    package_uris: tuple[str, ...] = ()

    @property
    def is_reduction_server(self) -> bool:
        """The platform's Reduction Server image, run by its own entrypoint."""
        return self.command is None and bool(_REDUCTION_SERVER_RE.search(self.image))


@dataclass(frozen=True)
class JobSpec:
    """What a CustomJob spec sets. ``None`` means the spec does not say (keep the
    launcher's default); ``notes`` are lines for the user, keyed by the option they
    concern (``command``, ``env``, ``gpus``, ``memory``, ``output``, ``fields``), so the
    CLI prints only those whose option the spec actually decided."""

    pool_specs: tuple[PoolSpec, ...]         # every pool that is not empty, in order
    output_dir: str | None = None            # baseOutputDirectory.outputUriPrefix
    timeout: float | None = None             # seconds
    max_wait: float | None = None            # seconds; 0 = wait forever
    strategy: Strategy | None = None
    restart_job_on_worker_restart: bool | None = None
    disable_retries: bool | None = None
    display_name: str | None = None
    notes: tuple[tuple[str, str], ...] = ()

    # The primary's pool, and the pools' replica counts (what the pool specs say).
    @property
    def pools(self) -> tuple[tuple[str, int], ...]:
        return tuple((p.pool, p.replicas) for p in self.pool_specs)

    @property
    def command(self) -> tuple[str, ...] | None:
        return self.pool_specs[0].command

    @property
    def env(self) -> Mapping[str, str]:
        return self.pool_specs[0].env

    @property
    def machine_type(self) -> str:
        return self.pool_specs[0].machine_type

    @property
    def memory_limit(self) -> int | None:
        return self.pool_specs[0].memory_limit

    @property
    def gpus_per_worker(self) -> int:
        return self.pool_specs[0].accelerator_count

    @property
    def accelerator_type(self) -> str | None:
        return self.pool_specs[0].accelerator_type

    def pool(self, name: str) -> PoolSpec | None:
        return next((p for p in self.pool_specs if p.pool == name), None)

    def notes_for(self, *topics: str) -> list[str]:
        return [text for topic, text in self.notes if topic in topics]


# --- loading ----------------------------------------------------------------------------


def load_job_spec(path: str | Path) -> JobSpec:
    """Read ``path`` (YAML, or JSON when it ends in .json) and parse it.

    At most MAX_SPEC_BYTES are read; a YAML document whose aliases would expand it past
    MAX_SPEC_EXPANDED, or that nests deeper than MAX_SPEC_DEPTH, is refused unparsed."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)   # (a device or a FIFO has no size to check)
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise JobSpecError(f"job spec {path}: cannot read it: {reason}") from None
    if len(raw) > MAX_SPEC_BYTES:
        raise JobSpecError(
            f"job spec {path}: larger than {MAX_SPEC_BYTES >> 20} MiB; a CustomJob spec is a "
            f"few KiB (pools, commands, env): is it the right file?")
    try:
        data = _load_json(text) if path.suffix.lower() == ".json" else _load_yaml(text)
        return parse_job_spec(data)
    except JobSpecError as exc:
        raise JobSpecError(_bounded(f"job spec {path}: {exc}")) from None


def _load_json(text: str) -> Any:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise JobSpecError(
            f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise JobSpecError(f"nested more than {MAX_SPEC_DEPTH} levels deep; a CustomJob "
                           f"spec needs about ten") from None
    except ValueError as exc:   # e.g. an integer longer than Python converts
        raise JobSpecError(f"not valid JSON: {_clip(str(exc))}") from None
    todo: list[tuple[Any, int]] = [(data, 1)]   # (JSON has no aliases: its size is its own)
    while todo:
        value, depth = todo.pop()
        if depth > MAX_SPEC_DEPTH:
            raise JobSpecError(f"nested more than {MAX_SPEC_DEPTH} levels deep; a CustomJob "
                               f"spec needs about ten")
        if isinstance(value, dict):
            value = list(value.values())
        if isinstance(value, list):
            todo.extend((item, depth + 1) for item in value)
    return data


def _load_yaml(text: str) -> Any:
    import yaml  # only when a YAML spec is read

    try:
        return yaml.load(text, Loader=_bounded_loader())   # (a SafeLoader)
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1} column {mark.column + 1}"
        problem = getattr(exc, "problem", None) or str(exc)
        raise JobSpecError(f"not valid YAML: {_clip(problem)}{where}") from None
    except JobSpecError:   # (a ValueError too) a bound of _bounded_loader's
        raise
    except ValueError as exc:   # e.g. an integer longer than Python converts
        raise JobSpecError(f"not valid YAML: {_clip(str(exc))}") from None


_LOADER: Any = None


def _bounded_loader() -> Any:
    """yaml.SafeLoader that refuses a document nesting deeper than MAX_SPEC_DEPTH, or
    one whose aliases expand it past MAX_SPEC_EXPANDED (checked on the composed node
    graph, each shared node sized once: the check itself never expands anything)."""
    global _LOADER
    if _LOADER is not None:
        return _LOADER
    import yaml

    class BoundedLoader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            self.depth += 1
            try:
                if self.depth > MAX_SPEC_DEPTH:
                    mark = self.peek_event().start_mark
                    raise JobSpecError(
                        f"nested more than {MAX_SPEC_DEPTH} levels deep at line "
                        f"{mark.line + 1}; a CustomJob spec needs about ten")
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

        def compose_document(self) -> Any:
            node = super().compose_document()
            _expanded_size(node, yaml, {}, set(), 0)
            return node

    _LOADER = BoundedLoader
    return _LOADER


def _expanded_size(node: Any, yaml: Any, sizes: dict[int, int], open_: set[int],
                   depth: int) -> int:
    """Nodes plus scalar characters below ``node``, an alias counting what it names."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_:
        raise JobSpecError(f"an alias at line {node.start_mark.line + 1} refers to a node that "
                           f"contains it; a job spec cannot be recursive")
    if depth > MAX_SPEC_DEPTH:
        raise JobSpecError(f"nested more than {MAX_SPEC_DEPTH} levels deep once its aliases "
                           f"are expanded (at line {node.start_mark.line + 1})")
    if isinstance(node, yaml.ScalarNode):
        size = 1 + len(node.value)
    else:
        open_.add(key)
        children = node.value if isinstance(node, yaml.SequenceNode) else [
            part for pair in node.value for part in pair]
        size = 1
        for child in children:
            size += _expanded_size(child, yaml, sizes, open_, depth + 1)
            if size > MAX_SPEC_EXPANDED:
                raise JobSpecError(
                    f"its aliases (*name) expand it to more than {MAX_SPEC_EXPANDED} nodes "
                    f"and characters (from line {node.start_mark.line + 1}): a YAML alias "
                    f"bomb? A CustomJob spec is a few KiB; write out the repeated parts, "
                    f"or alias fewer")
        open_.discard(key)
    sizes[key] = size
    return size


# --- parsing ----------------------------------------------------------------------------


def _as_gcloud_reads(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with a repeated field that holds one value (not a list) made a list of it,
    as gcloud reads a --config file (protorpc's JSON decoding wraps it): gcloud's own
    example writes ``workerPoolSpecs:`` with one pool's fields under it, and ``command:
    train``. A command with spaces stays as it is: gcloud would make it one executable
    named "python train.py", which no container has, and the parser says so."""
    out = copy.deepcopy(dict(data))
    spec = out["jobSpec"] if "jobSpec" in out else out
    if not isinstance(spec, dict):
        return out
    pools = spec.get("workerPoolSpecs")
    if isinstance(pools, Mapping):
        spec["workerPoolSpecs"] = pools = [pools]
    for pool in pools if isinstance(pools, list) else ():
        for kind in ("containerSpec", "pythonPackageSpec"):
            inner = pool.get(kind) if isinstance(pool, dict) else None
            if not isinstance(inner, dict):
                continue
            for name in ("command", "args", "packageUris"):
                value = inner.get(name)
                if isinstance(value, str) and value and not (
                        name == "command" and len(value.split()) > 1):
                    inner[name] = [value]
            env = inner.get("env")
            if isinstance(env, Mapping) and "name" in env:
                inner["env"] = [env]
    return out


def parse_job_spec(data: Any) -> JobSpec:
    """A ``JobSpec`` from a decoded CustomJob or CustomJobSpec document."""
    if data is None:
        raise JobSpecError("the file is empty; expected a CustomJobSpec with workerPoolSpecs")
    if not isinstance(data, Mapping):
        raise JobSpecError(
            f"expected a mapping at the top (workerPoolSpecs: ..., or jobSpec: ...), found "
            f"{_kind(data)}")
    data = _as_gcloud_reads(data)
    p = _Parser()
    display_name: str | None = None
    if "jobSpec" in data:                       # a whole CustomJob
        job = p.obj(data, "", "CustomJob", report_ignored=False)
        if "displayName" in job:
            display_name = p.string(job["displayName"], "displayName")
        if job.get("labels"):
            labels = job["labels"]
            shown = (", ".join(f"{k}={v}" for k, v in labels.items())
                     if isinstance(labels, Mapping) else _show(labels))
            p.notes.append(("fields", (
                f"labels ({_clip(shown)}) are not used locally; on the platform they tag "
                f"the job (billing, filters)")))
        if job.get("encryptionSpec"):
            key = (job["encryptionSpec"].get("kmsKeyName", "")
                   if isinstance(job["encryptionSpec"], Mapping) else "")
            p.notes.append(("fields", (
                f"encryptionSpec{f' ({_clip(str(key))})' if key else ''} is not used "
                f"locally: nothing here is encrypted with that key; the platform encrypts "
                f"the job's data with it")))
        spec = p.obj(job["jobSpec"], "jobSpec", "CustomJobSpec")
        prefix = "jobSpec."
    else:
        spec = p.obj(data, "", "CustomJobSpec")
        prefix = ""
    parsed = p.spec(spec, prefix, display_name)
    if platform_types.available():
        # The rest as the API reads it: the fields not walked above (diskSpec, nfsMounts,
        # encryptionSpec, ...) at any depth, and every value's type and enum.
        if prefix:
            platform_types.custom_job_message(data)
        else:
            platform_types.spec_message(data)
    return parsed


@dataclass
class _Pool:
    index: int
    replicas: int
    command: tuple[str, ...] | None
    image: str
    env: dict[str, str]
    machine_type: str
    accelerator_type: str | None
    accelerator_count: int
    package_uris: tuple[str, ...] = ()


class _Parser:
    def __init__(self) -> None:
        self.ignored: list[str] = []
        self.notes: list[tuple[str, str]] = []

    # --- the messages ---

    def spec(self, spec: Mapping[str, Any], prefix: str, display_name: str | None) -> JobSpec:
        wps = f"{prefix}workerPoolSpecs"
        if "workerPoolSpecs" not in spec:
            raise JobSpecError(
                f"{wps}: missing; a CustomJobSpec needs workerPoolSpecs, a list with the "
                f"primary's pool first (a whole CustomJob puts it under jobSpec:)")
        raw_pools = spec["workerPoolSpecs"]
        if not isinstance(raw_pools, list) or not raw_pools:
            raise JobSpecError(
                f"{wps}: expected a non-empty list of worker pools (one '- ' item per pool, "
                f"the primary's first), found {_kind(raw_pools)}")
        if len(raw_pools) > MAX_POOLS:
            raise JobSpecError(
                f"{wps}: at most {MAX_POOLS} worker pools (primary, workers, servers, "
                f"evaluators), found {len(raw_pools)}")
        pools = [self.pool(raw, i, f"{wps}[{i}]") for i, raw in enumerate(raw_pools)]
        present = [pool for pool in pools if pool is not None]
        primary = pools[0]
        if primary is None:
            raise JobSpecError(
                f"{wps}[0]: the primary's pool cannot be empty; only the pools after it may "
                f"be {{}}")

        out: dict[str, Any] = {}
        if "scheduling" in spec:
            out.update(self.scheduling(spec["scheduling"], f"{prefix}scheduling"))
        if "baseOutputDirectory" in spec:
            out["output_dir"] = self.output(spec["baseOutputDirectory"],
                                            f"{prefix}baseOutputDirectory")
        pool_specs = []
        for pool in present:
            memory = None
            if pool.machine_type in MACHINE_TYPES:
                memory = memory_limit_for(pool.machine_type)
            else:
                self.notes.append(("memory", (
                    f"{wps}[{pool.index}]: machine type {pool.machine_type} is not in the "
                    f"launcher's table: no memory limit for workerpool{pool.index} (pass "
                    f"--memory-limit SIZE to set one)")))
            pool_specs.append(PoolSpec(
                f"workerpool{pool.index}", f"{wps}[{pool.index}]", pool.replicas,
                pool.command, pool.image, MappingProxyType(dict(pool.env)), pool.machine_type,
                memory, pool.accelerator_type, pool.accelerator_count, pool.package_uris))
        if self.ignored:
            self.notes.append(("fields", "not reproduced locally, ignored: "
                               + ", ".join(self.ignored)))
        return JobSpec(
            pool_specs=tuple(pool_specs),
            display_name=display_name,
            notes=tuple((topic, _bounded(text)) for topic, text in self.notes),
            **out,
        )

    def pool(self, raw: Any, index: int, path: str) -> _Pool | None:
        if raw is None or (isinstance(raw, Mapping) and not raw):
            return None      # an empty pool: the platform skips it, and so do we
        pool = self.obj(raw, path, "WorkerPoolSpec")
        if "replicaCount" not in pool:
            raise JobSpecError(
                f"{path}.replicaCount: missing; give the number of replicas "
                f"({'the primary pool has exactly 1' if index == 0 else 'at least 1'}), or "
                f"write the whole pool as {{}} to leave it out")
        replicas = self.integer(pool["replicaCount"], f"{path}.replicaCount", "replicaCount: 2")
        if index == 0 and replicas != 1:
            raise JobSpecError(
                f"{path}.replicaCount: the primary pool must have exactly 1 replica, found "
                f"{replicas}; put the other replicas in workerPoolSpecs[1]")
        if replicas < 1:
            raise JobSpecError(
                f"{path}.replicaCount: must be at least 1, found {replicas}; to leave the pool "
                f"out write it as {{}}")
        if "machineSpec" not in pool:
            raise JobSpecError(
                f"{path}.machineSpec: missing; every pool needs one, e.g. machineSpec: "
                f"{{machineType: n1-standard-8}}")
        machine = self.obj(pool["machineSpec"], f"{path}.machineSpec", "MachineSpec")
        mpath = f"{path}.machineSpec"
        if "machineType" not in machine:
            raise JobSpecError(f"{mpath}.machineType: missing; e.g. machineType: n1-standard-8")
        machine_type = self.string(machine["machineType"], f"{mpath}.machineType")
        acc_type = None
        if "acceleratorType" in machine:
            acc_type = self.string(machine["acceleratorType"], f"{mpath}.acceleratorType")
            if not _ACCELERATOR_RE.match(acc_type):
                raise JobSpecError(
                    f"{mpath}.acceleratorType: expected an accelerator name like NVIDIA_L4 or "
                    f"NVIDIA_TESLA_T4 (upper case, as the API writes it), found {_show(acc_type)}")
        count = 0
        if "acceleratorCount" in machine:
            count = self.integer(machine["acceleratorCount"], f"{mpath}.acceleratorCount",
                                 "acceleratorCount: 1")
            if count < 0:
                raise JobSpecError(f"{mpath}.acceleratorCount: must be 0 or more, found {count}")
        if count and acc_type is None:
            raise JobSpecError(
                f"{mpath}.acceleratorType: missing; acceleratorCount {count} needs the "
                f"accelerator's type, e.g. acceleratorType: NVIDIA_L4")
        self._check_machine_gpus(machine_type, acc_type, count, mpath)

        has_container = "containerSpec" in pool
        has_package = "pythonPackageSpec" in pool
        if has_container == has_package:
            raise JobSpecError(
                f"{path}: give exactly one of containerSpec (a custom container) and "
                f"pythonPackageSpec (a Python package on a prebuilt image), found "
                f"{'both' if has_container else 'neither'}")
        packages: tuple[str, ...] = ()
        if has_container:
            command, image, env = self.container(pool["containerSpec"], f"{path}.containerSpec")
        else:
            command, image, env, packages = self.python_package(pool["pythonPackageSpec"],
                                                                f"{path}.pythonPackageSpec")
        return _Pool(index, replicas, command, image, env, machine_type, acc_type, count,
                     packages)

    def container(self, raw: Any, path: str) -> tuple[tuple[str, ...] | None, str, dict[str, str]]:
        spec = self.obj(raw, path, "ContainerSpec")
        if "imageUri" not in spec:
            raise JobSpecError(
                f"{path}.imageUri: missing; the platform needs the image to run, e.g. "
                f"imageUri: us-docker.pkg.dev/PROJECT/REPO/IMAGE:TAG (locally it is not used)")
        image = self.string(spec["imageUri"], f"{path}.imageUri")
        command = self.strings(spec["command"], f"{path}.command") if "command" in spec else None
        args = self.strings(spec["args"], f"{path}.args") if "args" in spec else ()
        env = self.env(spec["env"], f"{path}.env") if "env" in spec else {}
        if command is None and args:
            # The image's ENTRYPOINT with these args: unknown here, so no local command.
            self.notes.append(("command", (
                f"{path} has args but no command: on the platform they go to the image's "
                f"ENTRYPOINT, which the launcher cannot see")))
        return (None if command is None else command + args), image, env

    def python_package(self, raw: Any, path: str
                       ) -> tuple[tuple[str, ...], str, dict[str, str], tuple[str, ...]]:
        spec = self.obj(raw, path, "PythonPackageSpec")
        for name, example in (("executorImageUri", "IMAGE (a prebuilt training image)"),
                              ("packageUris", "[gs://BUCKET/trainer-0.1.tar.gz]"),
                              ("pythonModule", "trainer.task")):
            if name not in spec:
                raise JobSpecError(f"{path}.{name}: missing; e.g. {name}: {example}")
        image = self.string(spec["executorImageUri"], f"{path}.executorImageUri")
        packages = self.strings(spec["packageUris"], f"{path}.packageUris")
        module = self.string(spec["pythonModule"], f"{path}.pythonModule")
        args = self.strings(spec["args"], f"{path}.args") if "args" in spec else ()
        env = self.env(spec["env"], f"{path}.env") if "env" in spec else {}
        self.notes.append(("command", (
            f"{path}: runs python -m {module} here; its packageUris "
            f"({', '.join(packages)}) are not installed locally: install the package in "
            f"this environment first")))
        return ("python", "-m", module, *args), image, env, packages

    def env(self, raw: Any, path: str) -> dict[str, str]:
        if not isinstance(raw, list):
            raise JobSpecError(
                f"{path}: expected a list of {{name: NAME, value: VALUE}} items, found "
                f"{_kind(raw)}")
        env: dict[str, str] = {}
        for i, item in enumerate(raw):
            ipath = f"{path}[{i}]"
            var = self.obj(item, ipath, "EnvVar")
            if "name" not in var:
                raise JobSpecError(f"{ipath}.name: missing; each item is {{name: NAME, value: VALUE}}")
            name = self.string(var["name"], f"{ipath}.name")
            if not _ENV_NAME_RE.match(name):
                raise JobSpecError(
                    f"{ipath}.name: not a valid variable name: {_show(name)}; use letters, "
                    f"digits and _, not starting with a digit")
            value = self.string(var["value"], f"{ipath}.value") if "value" in var else ""
            if "$(" in value:
                shown = mask_env({name: value})[name]
                self.notes.append(("env", (
                    f"{ipath}.value: $(VAR) references are expanded by the platform, not by "
                    f"the launcher: {name} gets "
                    f"{shown if shown == SECRET_MASK else _show(shown)} as written")))
            env[name] = value
        return env

    def scheduling(self, raw: Any, path: str) -> dict[str, Any]:
        spec = self.obj(raw, path, "Scheduling")
        out: dict[str, Any] = {}
        if "timeout" in spec:
            timeout = self.duration(spec["timeout"], f"{path}.timeout")
            if timeout <= 0:
                raise JobSpecError(
                    f"{path}.timeout: must be positive, found {_show(spec['timeout'])}; leave it "
                    f"out for the platform's default of 7 days (604800s)")
            out["timeout"] = timeout
        if "maxWaitDuration" in spec:
            out["max_wait"] = self.duration(spec["maxWaitDuration"], f"{path}.maxWaitDuration")
        if "strategy" in spec:
            value = spec["strategy"]
            if not isinstance(value, str) or value not in _STRATEGIES:
                raise JobSpecError(
                    f"{path}.strategy: expected one of STANDARD, SPOT, FLEX_START (upper case, "
                    f"as the API writes it), found {_show(value)}")
            out["strategy"] = _STRATEGIES[value]
        for key, name in (("restartJobOnWorkerRestart", "restart_job_on_worker_restart"),
                          ("disableRetries", "disable_retries")):
            if key in spec:
                value = spec[key]
                if not isinstance(value, bool):
                    raise JobSpecError(
                        f"{path}.{key}: expected true or false, found {_show(value)}")
                out[name] = value
        return out

    def output(self, raw: Any, path: str) -> str:
        spec = self.obj(raw, path, "GcsDestination")
        if "outputUriPrefix" not in spec:
            raise JobSpecError(f"{path}.outputUriPrefix: missing; e.g. outputUriPrefix: "
                               f"gs://BUCKET/charlm")
        uri = self.string(spec["outputUriPrefix"], f"{path}.outputUriPrefix")
        if not uri.startswith("gs://") or len(uri) <= len("gs://"):
            raise JobSpecError(
                f"{path}.outputUriPrefix: the platform takes only a Cloud Storage URI "
                f"(gs://BUCKET/PREFIX), found {_show(uri)}; to write elsewhere locally, pass "
                f"--output-dir DIR on the command line")
        self.notes.append(("output", (
            f"outputs and checkpoints go to {uri} (AIP_CHECKPOINT_DIR={uri.rstrip('/')}"
            f"/checkpoints/), which needs Cloud Storage credentials here; pass --output-dir "
            f"DIR to keep this run local")))
        return uri

    # --- cross-pool and machine checks ---

    def _check_machine_gpus(self, machine_type: str, acc_type: str | None, count: int,
                            path: str) -> None:
        machine = MACHINE_TYPES.get(machine_type)
        if machine is None or not machine.gpus:
            return
        # Accelerator-optimized shapes (A2, A3, G2) come with their GPUs attached: the spec
        # must name exactly those.
        if count != machine.gpus or acc_type != machine.accelerator:
            raise JobSpecError(
                f"{path}: machine type {machine_type} comes with {machine.gpus} "
                f"{machine.accelerator}; set acceleratorType: {machine.accelerator} and "
                f"acceleratorCount: {machine.gpus} (found {acc_type or 'no type'} x {count})")

    # --- value types ---

    def obj(self, raw: Any, path: str, message: str, *,
            report_ignored: bool = True) -> Mapping[str, Any]:
        """``raw``, a mapping of ``message``'s fields; the unused ones are noted."""
        if not isinstance(raw, Mapping):
            raise JobSpecError(f"{path or 'the top'}: expected a mapping, found {_kind(raw)}")
        known = set(fields_of(message))
        ignored = known - _USED[message]
        for key in raw:
            shown = _clip(str(key))
            kpath = f"{path}.{shown}" if path else shown
            if not isinstance(key, str):
                raise JobSpecError(f"{kpath}: field names are strings, found {_show(key)}")
            if key in known:
                if key in ignored and report_ignored:
                    self.ignored.append(kpath)
                continue
            raise JobSpecError(f"{kpath}: unknown field; {suggest_field(key, known)}")
        return raw

    def integer(self, value: Any, path: str, example: str) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and _INT_RE.match(value.strip()):
            return int(value)
        raise JobSpecError(f"{path}: expected an integer, found {_show(value)}; write e.g. "
                           f"{example}")

    def string(self, value: Any, path: str) -> str:
        if isinstance(value, str) and value:
            return value
        if isinstance(value, str):
            raise JobSpecError(f"{path}: must not be empty")
        fix = f'; quote it: "{_clip(str(value))}"' if isinstance(value, (int, float)) else ""
        raise JobSpecError(f"{path}: expected a string, found {_show(value)}{fix}")

    def strings(self, value: Any, path: str) -> tuple[str, ...]:
        if not isinstance(value, list):
            example = ""
            if isinstance(value, str):
                example = (f"; write one item per argument, e.g. "
                           f"[{_clip(', '.join(value[:4 * QUOTE_CHARS].split()))}]")
            raise JobSpecError(f"{path}: expected a list of strings, found {_kind(value)}"
                               f"{example}")
        out = []
        for i, item in enumerate(value):
            if not isinstance(item, str):
                fix = (f'; quote it: "{_clip(str(item))}"' if isinstance(item, (int, float))
                       and not isinstance(item, bool) else "")
                raise JobSpecError(f"{path}[{i}]: expected a string, found {_show(item)}{fix}")
            out.append(item)
        return tuple(out)

    def duration(self, value: Any, path: str) -> float:
        if isinstance(value, str):
            match = _DURATION_RE.match(value.strip())
            if match:
                seconds = float(match.group(1) + (match.group(2) or ""))
                if not seconds <= MAX_DURATION_S:   # 400 digits: float() says infinity
                    raise JobSpecError(f"{path}: a duration is {MAX_DURATION_TEXT}, found "
                                       f"{_show(value)}")
                return seconds
        raise JobSpecError(
            f"{path}: expected a duration in seconds with an s, as the API writes it (e.g. "
            f"\"3600s\" or \"1.5s\"), found {_show(value)}")


def _kind(value: Any) -> str:
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list" if value else "an empty list"
    return _show(value)


def _show(value: Any) -> str:
    """``value`` as the spec would write it (JSON), cut to QUOTE_CHARS characters. Encoded
    piece by piece and stopped there: a list of a million items is not written out first."""
    pieces: list[str] = []
    size = 0
    try:
        for piece in json.JSONEncoder(ensure_ascii=False).iterencode(value):
            pieces.append(piece)
            size += len(piece)
            if size > QUOTE_CHARS:
                break
    except (TypeError, ValueError):   # not JSON (a YAML date), or recursive (an API caller's)
        return _clip(reprlib.repr(value))
    return _clip("".join(pieces))


def _clip(text: str, limit: int = QUOTE_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def _bounded(message: str) -> str:
    """A message at most _MESSAGE_CHARS long, keeping its start (where) and its end (the
    fix); each value it quotes is already cut, so this is the last resort."""
    if len(message) <= _MESSAGE_CHARS:
        return message
    keep = _MESSAGE_CHARS // 2
    left_out = len(message) - 2 * keep
    return f"{message[:keep]} … ({left_out} characters left out) … {message[-keep:]}"
