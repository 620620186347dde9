"""What a launched job shows in TensorBoard: step time, goodput and each recovery, as
scalars under the job's ``AIP_TENSORBOARD_LOG_DIR``, in the run ``goodput`` (the
subdirectory Google's ml-goodput-measurement monitor writes), so TensorBoard pointed at
the job's log directory shows them beside the script's own.

The launcher follows the primary's telemetry as it goes (the job record's readers), so the
scalars come from what the goodput accounting reads, never from one event per step:

- ``step_time/seconds``: the primary's mean seconds per step over a window of at least
  STEP_TIME_EVERY_S (blocking saves left out), at the window's last step; a segment's last
  window is written when the segment ends, however short;
- ``goodput/goodput`` and ``badput/<type>``: percent of the wall time, the tags
  ml-goodput-measurement writes (its BadputType names, lowercased), and
  ``goodput_seconds/productive``, ``goodput_seconds/wall``, ``badput_seconds/<type>`` in
  seconds; every GOODPUT_EVERY_S while the job runs (until now), and the record's final
  figures once it is over, at the step = the steps trained so far;
- ``recovery/seconds``, ``recovery/steps_lost``, ``recovery/step`` (restored) and
  ``recovery/bytes_read_<tier>``: each entry of the record's ``recoveries`` once it is
  complete (every rank restored, a later recovery began, or the job ended), at the step =
  the recovery's number (1, 2, ...).

Writing never stops the job: a write that fails stops the scalars with a warning.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

from .events import epoch
from .goodput import Goodput
from .tbevents import INSTALL_HINT, ScalarWriter, is_url, tensorboard_installed
from .telemetry import RESTORE_TIERS, LifeTelemetry, Segment

__all__ = ["RUN", "JobScalars", "TensorBoardMode", "TensorBoardUnavailable",
           "open_scalars"]


class JobRecord(Protocol):
    """What the scalars read of the launcher's job record (launcher/jobrecord.py)."""

    @property
    def recoveries(self) -> list[dict[str, Any]]: ...

    @property
    def goodput(self) -> dict[str, Any] | None: ...

    def goodput_so_far(self, now: float) -> Goodput | None: ...

    def primary_lives(self, first: int = 0) -> list[LifeTelemetry]: ...

log = logging.getLogger(__name__)

RUN = "goodput"                # the run (subdirectory) of the log directory
STEP_TIME_EVERY_S = 10.0       # a step-time sample per window of at least this long
GOODPUT_EVERY_S = 60.0         # the goodput so far, while the job runs
_POLL_S = 1.0                  # the job record's readers are updated about this often


class TensorBoardMode(str, Enum):
    """``launch --tensorboard``."""

    AUTO = "auto"   # when the log directory is local and the tensorboard package is installed
    ON = "on"       # always (a gs:// directory too); an error without the package
    OFF = "off"


class TensorBoardUnavailable(Exception):
    """``--tensorboard on`` without a working ``tensorboard`` package."""


def open_scalars(mode: TensorBoardMode, log_dir: str, job_dir: Path,
                 replicas: int) -> JobScalars | None:
    """The job's scalars as ``mode`` decides for the log directory ``log_dir``; None when
    none are written. ``job_dir``: where a URL's event file is kept; ``replicas``: how
    many train (a recovery is complete when each has restored)."""
    if mode is TensorBoardMode.OFF:
        return None
    if mode is TensorBoardMode.AUTO and is_url(log_dir):
        return None   # a bucket is written only when asked (it costs, and needs credentials)
    if not tensorboard_installed():
        if mode is TensorBoardMode.ON:
            raise TensorBoardUnavailable(
                f"--tensorboard on: the tensorboard package is not installed; {INSTALL_HINT}")
        return None
    try:
        writer = ScalarWriter(f"{log_dir.rstrip('/')}/{RUN}",
                              staging=job_dir / "tensorboard" / RUN)
    except ImportError as exc:   # installed but broken (e.g. a protobuf it cannot use)
        if mode is TensorBoardMode.ON:
            raise TensorBoardUnavailable(
                f"--tensorboard on: cannot import the tensorboard package ({exc}); "
                f"{INSTALL_HINT}") from None
        log.warning("no TensorBoard scalars: cannot import the tensorboard package: %s", exc)
        return None
    return JobScalars(writer, replicas)


class JobScalars:
    """Writes one job's scalars; :meth:`poll` after each flush of the job record,
    :meth:`close` once the job is over."""

    def __init__(self, writer: ScalarWriter, replicas: int) -> None:
        self.writer = writer
        self._replicas = replicas
        # Per segment (t_start, first_step): the last sample's (step, time, blocking_s).
        self._windows: dict[tuple[float, int], tuple[int, float, float]] = {}
        self._first_life = 0   # the primary's lives before it are written to their end
        self._recoveries_written = 0
        self._goodput_at = -float("inf")   # monotonic: the last goodput written
        self._polled = -float("inf")
        self._stopped = False

    @property
    def where(self) -> str:
        """Where TensorBoard finds the scalars (the run's directory)."""
        return self.writer.logdir

    def describe(self) -> str:
        """The launcher's line about them."""
        line = (f"tensorboard: step time, goodput and recoveries to {self.where} "
                f"(tensorboard --logdir {self.where.rsplit('/', 1)[0]})")
        if self.writer.remote:
            line += f"; written in {self.writer.path.parent} and copied there"
        return line

    def poll(self, now: float, record: JobRecord) -> None:
        """Write what is new: step-time windows, complete recoveries, and the goodput so
        far when GOODPUT_EVERY_S has passed."""
        mono = time.monotonic()
        if self._stopped or mono - self._polled < _POLL_S:
            return
        self._polled = mono

        def write() -> None:
            self._step_times(record, final=False)
            self._recoveries(record.recoveries, final=False)
            if mono - self._goodput_at >= GOODPUT_EVERY_S:
                goodput = record.goodput_so_far(now)
                if goodput is not None:
                    self._goodput(goodput.to_json(), now)
                    self._goodput_at = mono

        self._guarded(write)

    def close(self, record: JobRecord, end_time: float | None) -> None:
        """The rest: every last window and recovery, the record's final goodput."""
        if self._stopped:
            return

        def write() -> None:
            self._step_times(record, final=True)
            self._recoveries(record.recoveries, final=True)
            if record.goodput is not None:
                self._goodput(record.goodput, end_time or time.time())

        self._guarded(write)
        self._guarded(self.writer.close)
        self._stopped = True

    def _guarded(self, write: Any) -> None:
        try:
            write()
            self.writer.flush()
        except Exception as exc:  # noqa: BLE001 - scalars are never worth failing a job over
            log.warning("TensorBoard scalars stopped: cannot write %s: %s", self.where, exc)
            self._stopped = True

    # --- the scalars ----------------------------------------------------------------------

    def _step_times(self, record: JobRecord, *, final: bool) -> None:
        lives = record.primary_lives(self._first_life)
        segs = sorted((s for life in lives for s in life.segments), key=lambda s: s.t_start)
        for i, seg in enumerate(segs):
            step, t, blocking = self._window(seg)
            if seg.t_last is None or seg.last_step <= step:
                continue
            ended = final or i < len(segs) - 1   # a later segment began: this one is over
            if not ended and seg.t_last - t < STEP_TIME_EVERY_S:
                continue
            mean = max(0.0, seg.t_last - t - (seg.blocking_s - blocking)) / (seg.last_step - step)
            self.writer.scalar("step_time/seconds", mean, seg.last_step, seg.t_last)
            self._windows[(seg.t_start, seg.first_step)] = (seg.last_step, seg.t_last,
                                                            seg.blocking_s)
        # A life followed by another, written to its last step, is not read again.
        for life in lives[:-1]:
            if any(self._window(seg)[0] < seg.last_step for seg in life.segments
                   if seg.t_last is not None):
                break
            self._first_life += 1

    def _window(self, seg: Segment) -> tuple[int, float, float]:
        """The last sample of ``seg``: (step, time, blocking_s), its start before any."""
        return self._windows.get((seg.t_start, seg.first_step), (seg.first_step, seg.t_start, 0.0))

    def _recoveries(self, recoveries: Sequence[Mapping[str, Any]], *, final: bool) -> None:
        for n in range(self._recoveries_written, len(recoveries)):
            rec = recoveries[n]
            complete = (final or n < len(recoveries) - 1
                        or len({r.get("replica") for r in rec.get("ranks") or ()})
                        >= self._replicas)
            if not complete:
                return
            number, at = n + 1, epoch(rec.get("at"))
            if rec.get("seconds") is not None:
                self.writer.scalar("recovery/seconds", rec["seconds"], number, at)
            if rec.get("steps_lost") is not None:
                self.writer.scalar("recovery/steps_lost", rec["steps_lost"], number, at)
            self.writer.scalar("recovery/step", rec.get("step") or 0, number, at)
            read = rec.get("bytes_read") or {}
            for tier in RESTORE_TIERS:
                self.writer.scalar(f"recovery/bytes_read_{tier.replace('-', '_')}",
                                   read.get(tier) or 0, number, at)
            self._recoveries_written = number

    def _goodput(self, goodput: Mapping[str, Any], wall_time: float) -> None:
        """``goodput``: a job record's goodput section (Goodput.to_json)."""
        wall = float(goodput.get("wall_s") or 0.0)
        if wall <= 0:
            return
        step = int(goodput.get("steps") or 0)
        productive = float(goodput.get("productive_s") or 0.0)
        self.writer.scalar("goodput/goodput", 100 * productive / wall, step, wall_time)
        self.writer.scalar("goodput_seconds/productive", productive, step, wall_time)
        self.writer.scalar("goodput_seconds/wall", wall, step, wall_time)
        for name, secs in (goodput.get("badput_s") or {}).items():
            self.writer.scalar(f"badput/{name.lower()}", 100 * float(secs) / wall, step,
                               wall_time)
            self.writer.scalar(f"badput_seconds/{name.lower()}", float(secs), step, wall_time)
