"""What a launch leaves behind while it runs: ``job.json``, the launcher's event lines, the
failure log the workers read for the observed MTBF, the recoveries (from the workers'
restore events) and, at the end, the goodput.

:meth:`JobRecord.flush` is the supervision loop's one call, after each step: it prints the
events recorded since the last call, rewrites ``job.json`` (atomically) when they or the
recoveries changed, and keeps ``telemetry/failures.json`` current. :func:`launcher_alive` is the reader's side: whether
the launcher that writes a record still runs. The TensorBoard scalars (scalars.py) read the
primary's progress, the recoveries and the goodput from the same telemetry readers.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..observe.events import EventKind
from ..observe.goodput import Goodput, account
from ..observe.jobdir import (
    JOB_FILE,
    TelemetryLife,
    failures_path,
    job_recoveries,
    mask_command,
    telemetry_lives,
    telemetry_prefixes,
    write_json_atomic,
)
from ..observe.telemetry import LifeReader, LifeTelemetry, read_life, write_failures
from ..platform.programs import PoolProgram
from ..platform.resources import process_start_time
from .chaos import UnfiredFault
from .job import JobMachine

if TYPE_CHECKING:
    from ..platform.export import PlatformJob

__all__ = ["JobRecord", "job_spec", "launcher_alive"]

log = logging.getLogger(__name__)

# How often a running job's telemetry is looked at for new restores: a directory listing
# and a stat per life, well within the loop's one wake-up a second.
TELEMETRY_CHECK_S = 1.0


def job_spec(pools: Sequence[tuple[str, int]], listed_only: Sequence[tuple[str, int]],
             programs: Mapping[str, PoolProgram], output_base: str,
             master_port: int, platform: PlatformJob | None = None) -> dict[str, Any]:
    """The record's ``job_spec``: what ran, secrets masked (no ``--token=...``); with
    ``platform``, also what the platform would run (``export --from-job`` reads it)."""
    spec: dict[str, Any] = {
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
    if platform is not None:
        spec["platform"] = platform.to_json()
    return spec


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
        # The record's goodput section, once the job is over (what job.json says).
        self.goodput: dict[str, Any] | None = None

    @property
    def recoveries(self) -> list[dict[str, Any]]:
        """The record's ``recoveries`` as of the last :meth:`flush`."""
        return list(self._recoveries)

    def primary_lives(self, first: int = 0) -> list[LifeTelemetry]:
        """The primary's lives as followed so far, in the order they began, from number
        ``first`` on (each open segment read now: one small read per life)."""
        readers = [reader for life, reader in self._readers.values()
                   if life.replica == self._primary]
        return [reader.life() for reader in readers[first:]]

    def goodput_so_far(self, now: float) -> Goodput | None:
        """The goodput from RUNNING until ``now``, from the telemetry followed so far;
        None once the job is over (the record's ``goodput`` then says it)."""
        if self._machine.state.terminal:
            return None
        return self._account(self.primary_lives(), now)

    def flush(self, force: bool = False) -> None:
        """Print the new events and rewrite the record; nothing when nothing happened
        (unless ``force``): no new event and no change in the recoveries."""
        events = self._machine.events
        new_events = self._printed != len(events)
        recovered = self._update_recoveries(force or new_events or self._machine.state.terminal)
        if not new_events and not recovered and not force:
            return
        # The record first: an output that fails (a closed pipe) must not lose it.
        write_json_atomic(self.job_dir / JOB_FILE, self.to_json())
        self._update_failure_log()
        for event in events[self._printed:]:
            when = self._machine.create_time + event.elapsed_s
            stamp = time.strftime("%H:%M:%S", time.localtime(when))
            self._echo(f"{stamp} [launcher] {event.message}")
        self._printed = len(events)

    def to_json(self) -> dict[str, Any]:
        m = self._machine
        rec = m.to_record()
        rec["job_spec"] = self._spec
        rec["job_dir"] = str(self.job_dir)
        rec["recoveries"] = list(self._recoveries)
        if m.state.terminal:
            rec["goodput"] = self.goodput = self._goodput()
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
        end = self._machine.end_time
        if end is None:
            return None
        lives = [read_life(prefix) for prefix in telemetry_prefixes(self.job_dir, self._primary)]
        goodput = self._account(lives, end)
        return None if goodput is None else goodput.to_json()

    def _account(self, lives: Sequence[LifeTelemetry], end: float) -> Goodput | None:
        """The primary's ``lives`` (their segments and restores, and when the launcher
        started each) accounted from RUNNING to ``end``; None before RUNNING or without
        a segment."""
        start = self._machine.start_time
        segments = [seg for life in lives for seg in life.segments]
        if start is None or not segments:
            return None
        starts = [e.time for e in self._machine.events
                  if e.kind is EventKind.STARTED and e.replica == self._primary]
        return account(segments, start, end, [r for life in lives for r in life.restores],
                       starts)


def launcher_alive(record: Mapping[str, Any]) -> bool | None:
    """Whether the launcher that writes this record still runs (None: cannot tell here)."""
    info = record.get("launcher") or {}
    if info.get("host") != socket.gethostname() or not info.get("pid"):
        return None
    started = process_start_time(int(info["pid"]))
    return started is not None and (info.get("started") is None
                                    or abs(started - float(info["started"])) < 1.0)
