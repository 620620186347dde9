"""What the platform would run for a tested job: its pools, its scheduling, what a local
run had that the platform's job cannot carry. export.py writes it as a CustomJob,
jobset.py as a Kubernetes JobSet; the launcher records it in job.json."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..observe.jobdir import mask_command, mask_env
from .rules import Strategy

LEFT_OUT_LABEL = "resilient-train-left-out"
EXPORTED_LABEL = "resilient-train"
_LABEL_VALUE_CHARS = 63


@dataclass(frozen=True)
class PlatformPool:
    """One worker pool as the platform would run it."""

    pool: str                                   # "workerpool2"
    replicas: int
    command: tuple[str, ...] | None             # None: the image's ENTRYPOINT
    image: str | None = None                    # None: not known yet (--image gives it)
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    machine_type: str | None = None             # None: not known yet (DEFAULT_MACHINE_TYPE)
    accelerator_type: str | None = None
    accelerator_count: int = 0
    package_uris: tuple[str, ...] = ()          # a pythonPackageSpec's packages

    @property
    def index(self) -> int:
        return int(self.pool.removeprefix("workerpool"))


@dataclass(frozen=True)
class LeftOut:
    """A local-only option the launch used, which the platform's job cannot carry."""

    option: str     # "--chaos"
    value: str      # as given ("kill:1@30s"), "" for a flag
    why: str

    @property
    def text(self) -> str:
        given = f"{self.option} {self.value}" if self.value else self.option
        return f"{given}: {self.why}"


@dataclass(frozen=True)
class PlatformJob:
    """What the platform would run for a tested job. Scheduling values are the platform's:
    ``timeout`` None means "not set" (the platform's 7 days), ``max_wait`` None "forever"."""

    name: str
    pools: tuple[PlatformPool, ...]
    strategy: Strategy = Strategy.STANDARD
    timeout: float | None = None
    max_wait: float | None = None
    restart_job_on_worker_restart: bool = False
    disable_retries: bool = False
    output_dir: str | None = None               # gs:// only
    left_out: tuple[LeftOut, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def primary(self) -> PlatformPool:
        return self.pools[0]

    def to_json(self) -> dict[str, Any]:
        """The record's form (job.json's ``job_spec.platform``): commands and secret
        variables masked, as everywhere in a job's files."""
        return {
            "name": self.name,
            "pools": [{
                "pool": p.pool, "replicas": p.replicas,
                "command": None if p.command is None else mask_command(p.command),
                "image": p.image,
                "env": mask_env(p.env),
                "machine_type": p.machine_type, "accelerator_type": p.accelerator_type,
                "accelerator_count": p.accelerator_count,
                "package_uris": list(p.package_uris),
            } for p in self.pools],
            "scheduling": {
                "strategy": self.strategy.name, "timeout_s": self.timeout,
                "max_wait_s": self.max_wait,
                "restart_job_on_worker_restart": self.restart_job_on_worker_restart,
                "disable_retries": self.disable_retries,
            },
            "output_dir": self.output_dir,
            "left_out": [{"option": x.option, "value": x.value, "why": x.why}
                         for x in self.left_out],
            "notes": list(self.notes),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PlatformJob:
        s = data["scheduling"]
        return cls(
            name=data["name"],
            pools=tuple(PlatformPool(
                p["pool"], int(p["replicas"]),
                None if p["command"] is None else tuple(p["command"]), p.get("image"),
                MappingProxyType(dict(p.get("env") or {})), p.get("machine_type"),
                p.get("accelerator_type"), int(p.get("accelerator_count") or 0),
                tuple(p.get("package_uris") or ())) for p in data["pools"]),
            strategy=Strategy[s["strategy"]],
            timeout=s.get("timeout_s"),
            max_wait=s.get("max_wait_s"),
            restart_job_on_worker_restart=bool(s.get("restart_job_on_worker_restart")),
            disable_retries=bool(s.get("disable_retries")),
            output_dir=data.get("output_dir"),
            left_out=tuple(LeftOut(x["option"], x["value"], x["why"])
                           for x in data.get("left_out") or ()),
            notes=tuple(data.get("notes") or ()),
        )


def labels(job: PlatformJob) -> dict[str, str]:
    """The job's labels: that it was exported, and which local-only options were left out
    (their names without dashes, ``_``-joined: a label value is at most 63 lower-case
    letters, digits, ``_`` and ``-``)."""
    out = {EXPORTED_LABEL: "export"}
    if job.left_out:
        names = "_".join(dict.fromkeys(x.option.lstrip("-") for x in job.left_out))
        out[LEFT_OUT_LABEL] = names[:_LABEL_VALUE_CHARS].rstrip("_-")
    return out


def left_out_lines(job: PlatformJob) -> list[str]:
    """The header lines that say what the export left out, and its other notes."""
    lines = []
    if job.left_out:
        lines.append("Left out, local-only options of the tested run:")
        lines += [f"  {x.text}" for x in job.left_out]
    if job.notes:
        lines.append("Notes:")
        lines += [f"  {n}" for n in job.notes]
    return lines


_NEWLINES = re.compile(r"[\r\n]+")


def comment(lines: Sequence[str], indent: str = "") -> str:
    """``lines`` as YAML comment lines (one line each: a newline in a value would end the
    comment)."""
    return "".join(f"{indent}# {_NEWLINES.sub(' ', line)}".rstrip() + "\n" for line in lines)
