"""What a launch leaves behind while it runs: ``job.json``, the launcher's event lines, the
failure log the workers read for the observed MTBF, the recoveries (from the workers'
restore events) and, at the end, the goodput.

:meth:`JobRecord.flush` is the supervision loop's one call, after each step: it prints the
events recorded since the last call, rewrites ``job.json`` (atomically) when they or the
recoveries changed, and keeps ``telemetry/failures.json`` current. :func:`launcher_alive` is the reader's side: whether
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
from ..telemetry import LifeReader, read_life, write_failures
from .chaos import UnfiredFault
from .job import JobMachine
from .programs import PoolProgram
from .record import (
    JOB_FILE,
    TelemetryLife,
    failures_path,
    job_recoveries,
    mask_command,
    telemetry_lives,
    telemetry_prefixes,
    write_json_atomic,
)
from .resources import process_start_time

__all__ = ["JobRecord", "job_spec", "launcher_alive"]

log = logging.getLogger(__name__)

# How often a running job's telemetry is looked at for new restores: a directory listing
# and a stat per life, well within the loop's one wake-up a second.
TELEMETRY_CHECK_S = 1.0


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
        self._readers: dict[Path, tuple[TelemetryLife, LifeReader]] = {}
        self._recoveries: list[dict[str, Any]] = []
        self._checked = -float("inf")   # monotonic time of the last telemetry check
        self._events_seen = -1          # len(events) at the last recoveries computed

    def flush(self, force: bool = False) -> None:
        """Print the new events and rewrite the record; nothing when nothing happened
        (unless ``force``): no new event and no change in the recoveries."""
        events = self._machine.events
        new_events = self._printed != len(events)
        recovered = self._update_recoveries(force or new_events or self._machine.state.terminal)
        if not new_events and not recovered and not force:
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
        rec["recoveries"] = list(self._recoveries)
        if m.state.terminal:
            rec["goodput"] = self._goodput()
            if self._chaos:
                rec["unfired_faults"] = [u.to_json() for u in self._unfired()]
            rec["exit_status"] = self._exit_status()   # the launcher's, as run() returns it
        rec["launcher"] = dict(self._launcher)
        return rec

    def _update_recoveries(self, now: bool) -> bool:
        """Follow the workers' telemetry (every TELEMETRY_CHECK_S, or ``now``) and recompute
        the recoveries when a restore or a segment was written or an event recorded; True
        when they changed. Reading is incremental: a long job's logs are not read again."""
        mono = time.monotonic()
        if not now and mono - self._checked < TELEMETRY_CHECK_S:
            return False
        self._checked = mono
        try:
            changed = False
            for life in telemetry_lives(self.job_dir):
                if life.prefix not in self._readers:
                    self._readers[life.prefix] = (life, LifeReader(life.prefix))
                    changed = True
            # Once the job is over no worker writes: a last line that lost only its
            # newline to a SIGKILL is read too.
            final = self._machine.state.terminal
            for _, reader in self._readers.values():
                changed |= reader.update(final=final)
            events = self._machine.events
            if not changed and self._events_seen == len(events):
                return False
            self._events_seen = len(events)
            first = self._machine.attempts[0].number if self._machine.attempts else 1
            recoveries = job_recoveries(
                ((life, reader.life()) for life, reader in self._readers.values()),
                events, self._machine.config.replicas, first)
        except OSError as exc:   # the record keeps what it had; training is unaffected
            log.warning("cannot read the workers' telemetry: %s", exc)
            return False
        if recoveries == self._recoveries:
            return False
        self._recoveries = recoveries
        return True

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
