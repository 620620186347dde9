"""A machine-wide quota (GPUs, CPU slots) shared by concurrent launches.

Locally the platform's "project quota" (docs/platform.md, "Job lifecycle") is the machine:
a job waits in ``JOB_STATE_QUEUED`` until its request fits. Launches coordinate through a
JSON ledger (``leases.json``) guarded by ``fcntl.flock``; each lease records its launcher's
pid and the process create time, and leases of dead launchers are dropped on every read, so
a SIGKILLed launcher never holds quota forever.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from ..platform.resources import process_start_time

logger = logging.getLogger(__name__)

__all__ = ["Capacity", "Lease", "LocalQuota", "Request", "default_quota_dir"]

LEDGER_NAME = "leases.json"
LOCK_NAME = "leases.lock"
# psutil derives create_time from boot time + clock ticks; equal processes agree exactly,
# the tolerance only absorbs float formatting.
_CREATE_TIME_TOLERANCE = 0.05


@dataclass(frozen=True)
class Request:
    gpus: int = 0
    cpu_slots: int = 0

    def __post_init__(self) -> None:
        if self.gpus < 0 or self.cpu_slots < 0:
            raise ValueError(
                f"a quota request needs non-negative gpus and cpu_slots, found {self}; "
                "ask for 0 or more"
            )


@dataclass(frozen=True)
class Capacity:
    gpu_ids: tuple[int, ...] = ()
    cpu_slots: int = 0


@dataclass(frozen=True)
class Lease:
    job_id: str
    pid: int
    gpu_ids: tuple[int, ...]
    cpu_slots: int


def default_quota_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$RESILIENT_TRAIN_QUOTA_DIR``, else ``$XDG_CACHE_HOME/resilient-train/quota``."""
    env = os.environ if env is None else env
    if env.get("RESILIENT_TRAIN_QUOTA_DIR"):
        return Path(env["RESILIENT_TRAIN_QUOTA_DIR"]).expanduser()
    cache = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "resilient-train" / "quota"


def _alive(pid: int, create_time: float | None) -> bool:
    if not psutil.pid_exists(pid):
        return False
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:  # exited, not yet reaped: holds nothing
            return False
        # A different create time means the pid was reused by another process.
        if create_time is None:
            return True
        return abs(proc.create_time() - create_time) <= _CREATE_TIME_TOLERANCE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # another user's live process: cannot prove it is dead


class LocalQuota:
    """GPU ids and CPU slots of one machine, leased to jobs by concurrent launchers."""

    def __init__(self, directory: Path, capacity: Capacity) -> None:
        self.directory = Path(directory)
        self.capacity = capacity
        self.directory.mkdir(parents=True, exist_ok=True)
        self._ledger = self.directory / LEDGER_NAME
        self._lock = self.directory / LOCK_NAME

    def fits_ever(self, request: Request) -> bool:
        """False when the machine can never grant the request (a stockout for the caller)."""
        return (
            request.gpus <= len(self.capacity.gpu_ids)
            and request.cpu_slots <= self.capacity.cpu_slots
        )

    def try_acquire(self, job_id: str, request: Request, pid: int | None = None) -> Lease | None:
        """Grant the lowest free GPU ids and CPU slots, or None when they are not free now."""
        pid = os.getpid() if pid is None else pid
        create_time = process_start_time(pid)
        if create_time is None:
            raise ValueError(
                f"quota lease for job {job_id!r} names pid {pid}, which is not a live process; "
                "pass the pid of the running launcher (the default is this process)"
            )
        if not self.fits_ever(request):
            return None
        with self._locked() as entries:
            used_gpus = {g for e in entries for g in e["gpu_ids"]}
            used_cpus = sum(e["cpu_slots"] for e in entries)
            free = sorted(set(self.capacity.gpu_ids) - used_gpus)
            if len(free) < request.gpus or used_cpus + request.cpu_slots > self.capacity.cpu_slots:
                return None
            lease = Lease(job_id, pid, tuple(free[: request.gpus]), request.cpu_slots)
            entry = {**asdict(lease), "gpu_ids": list(lease.gpu_ids), "create_time": create_time}
            entries.append(entry)
        logger.debug("quota: granted %s", lease)
        return lease

    def release(self, lease: Lease) -> None:
        """Return a lease; releasing one already gone (reclaimed, released) is a no-op."""
        with self._locked() as entries:
            for index, entry in enumerate(entries):
                if _lease(entry) == lease:
                    del entries[index]
                    logger.debug("quota: released %s", lease)
                    return
        logger.debug("quota: %s was already released or reclaimed", lease)

    def usage(self) -> list[Lease]:
        """The live leases, oldest first."""
        with self._locked() as entries:
            return [_lease(e) for e in entries]

    @contextmanager
    def _locked(self) -> Iterator[list[dict[str, Any]]]:
        """Yield the live ledger entries under an exclusive lock; write back any change."""
        with open(self._lock, "a+", encoding="utf-8") as lock_file:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
            try:
                raw = self._read()
                entries = [e for e in raw if _alive(e["pid"], e.get("create_time"))]
                for gone in (e for e in raw if e not in entries):
                    logger.info(
                        "quota: reclaimed lease of job %r from dead launcher pid %s",
                        gone["job_id"],
                        gone["pid"],
                    )
                snapshot = json.dumps(entries)
                yield entries
                if len(raw) != len(entries) or json.dumps(entries) != snapshot:
                    self._write(entries)
            finally:
                fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)

    def _read(self) -> list[dict[str, Any]]:
        try:
            text = self._ledger.read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        try:
            data = json.loads(text)
            entries = data["leases"]
            for e in entries:  # validate the shape so a bad entry cannot crash a grant
                _lease(e)
                if not isinstance(e.get("create_time", 0.0), (int, float)):
                    raise TypeError("create_time is not a number")
            return list(entries)
        except (ValueError, KeyError, TypeError) as exc:
            # Never crash the launcher over its bookkeeping: start over with an empty ledger.
            logger.warning(
                "quota: ledger %s is corrupt (%s); treating it as empty. Delete it if this "
                "repeats.",
                self._ledger,
                exc,
            )
            return []

    def _write(self, entries: list[dict[str, Any]]) -> None:
        tmp = self._ledger.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"version": 1, "leases": entries}, indent=1), encoding="utf-8")
        os.replace(tmp, self._ledger)  # atomic: readers see the old or the new ledger


def _lease(entry: Mapping[str, Any]) -> Lease:
    job_id, pid, gpu_ids, cpu_slots = (
        entry["job_id"], entry["pid"], entry["gpu_ids"], entry["cpu_slots"]
    )
    if not (
        isinstance(job_id, str)
        and isinstance(pid, int)
        and isinstance(cpu_slots, int)
        and isinstance(gpu_ids, list)
        and all(isinstance(g, int) for g in gpu_ids)
    ):
        raise TypeError(f"bad lease entry {dict(entry)!r}")
    return Lease(job_id, pid, tuple(gpu_ids), cpu_slots)
