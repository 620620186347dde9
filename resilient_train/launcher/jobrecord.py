"""What a launch leaves behind while it runs: ``job.json``, the launcher's event lines, the
failure log the workers read for the observed MTBF, and, at the end, the goodput.

:meth:`JobRecord.flush` is the supervision loop's one call, after each step: it prints the
events recorded since the last call, rewrites ``job.json`` (atomically) and keeps
``telemetry/failures.json`` current. :func:`launcher_alive` is the reader's side: whether
the launcher that writes a record still runs.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..goodput import account
from ..telemetry import read_life, write_failures
from .chaos import UnfiredFault
from .job import JobMachine
from .programs import PoolProgram
from .record import JOB_FILE, failures_path, mask_command, telemetry_prefixes, write_json_atomic
from .resources import process_start_time

__all__ = ["JobRecord", "job_spec", "launcher_alive"]

log = logging.getLogger(__name__)


def job_spec(pools: Sequence[tuple[str, int]], listed_only: Sequence[tuple[str, int]],
             programs: Mapping[str, PoolProgram], output_base: str,
             master_port: int) -> dict[str, Any]:
    """The record's ``job_spec``: what ran, secrets masked (no ``--token=...``)."""
    return {
        "command": mask_command(programs["workerpool0"].command),
        "worker_pool_specs": [
            {"pool": p, "replica_count": n,
             "command": mask_command(programs[p].command),
             "gpus_per_replica": programs[p].gpus_per_replica,
             "memory_limit_bytes": programs[p].memory_limit}
            for p, n in pools]
        + [{"pool": p, "replica_count": n, "listed_only": True} for p, n in listed_only],
        "base_output_directory": output_base,
        "master_port": master_port,
    }


class JobRecord:
    """The job directory's record of one launch.

    ``unfired()`` and ``exit_status()`` are asked once the job is over (the launcher's,
    which count faults that never fired); ``chaos``: the launch has a chaos spec."""

    def __init__(self, job_dir: Path, machine: JobMachine, spec: Mapping[str, Any],
                 primary: str, echo: Callable[[str], None], *, chaos: bool,
                 unfired: Callable[[], list[UnfiredFault]],
                 exit_status: Callable[[], int | None]) -> None:
        self.job_dir = job_dir
        self._machine = machine
        self._spec = dict(spec)
        self._primary = primary
        self._echo = echo
        self._chaos = chaos
        self._unfired = unfired
        self._exit_status = exit_status
        self._printed = 0                                   # events echoed so far
        self._failure_log: tuple[float, int] | None = None  # what failures.json says
        # Lets `status` tell a live job from the record of a launcher that was killed.
        self._launcher = {"pid": os.getpid(), "host": socket.gethostname(),
                          "started": process_start_time(os.getpid())}

    def flush(self, force: bool = False) -> None:
        """Print the new events and rewrite the record; nothing when nothing happened
        (unless ``force``)."""
        events = self._machine.events
        if self._printed == len(events) and not force:
            return
        for event in events[self._printed:]:
            when = self._machine.create_time + event.elapsed_s
            stamp = time.strftime("%H:%M:%S", time.localtime(when))
            self._echo(f"{stamp} [launcher] {event.message}")
        self._printed = len(events)
        write_json_atomic(self.job_dir / JOB_FILE, self.to_json())
        self._update_failure_log()

    def to_json(self) -> dict[str, Any]:
        m = self._machine
        rec = m.to_record()
        rec["job_spec"] = self._spec
        rec["job_dir"] = str(self.job_dir)
        if m.state.terminal:
            rec["goodput"] = self._goodput()
            if self._chaos:
                rec["unfired_faults"] = [u.to_json() for u in self._unfired()]
            rec["exit_status"] = self._exit_status()   # the launcher's, as run() returns it
        rec["launcher"] = dict(self._launcher)
        return rec

    def _update_failure_log(self) -> None:
        """Keep telemetry/failures.json current: the one channel by which every worker,
        restarted or one that survives failures (in-process recovery), learns the job's
        observed MTBF (telemetry.ObservedMtbf)."""
        start, failures = self._machine.start_time, self._machine.failures()
        if start is None or (start, failures) == self._failure_log:
            return
        try:
            write_failures(failures_path(self.job_dir), start, failures)
            self._failure_log = (start, failures)
        except OSError as exc:  # the interval then keeps what it knew
            log.warning("cannot write the failure log: %s", exc)

    def _goodput(self) -> dict[str, Any] | None:
        """The primary's training segments over every life, split into goodput buckets;
        None when the job never ran or its script does not report (no @rt.main)."""
        start, end = self._machine.start_time, self._machine.end_time
        if start is None or end is None:
            return None
        segments = [seg for prefix in telemetry_prefixes(self.job_dir, self._primary)
                    for seg in read_life(prefix).segments]
        return account(segments, start, end).to_json() if segments else None


def launcher_alive(record: Mapping[str, Any]) -> bool | None:
    """Whether the launcher that writes this record still runs (None: cannot tell here)."""
    info = record.get("launcher") or {}
    if info.get("host") != socket.gethostname() or not info.get("pid"):
        return None
    started = process_start_time(int(info["pid"]))
    return started is not None and (info.get("started") is None
                                    or abs(started - float(info["started"])) < 1.0)
