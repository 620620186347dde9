"""What a worker tells the launcher about its training, for goodput accounting.

The launcher sets ``RESILIENT_TRAIN_TELEMETRY`` to a path prefix per worker life. The
worker writes two files there:

- ``PREFIX.progress``: one fixed-size record in a shared memory map, rewritten after every
  step (the segment's first and last step and their times). A store into a mapped page is
  a few hundred nanoseconds, no system call, and the page outlives the process: after a
  SIGKILL the launcher still reads the exact last step;
- ``PREFIX.jsonl``: rare events, one JSON object per line: a training *segment* closed (at
  an in-process recovery), a save and its blocking time, a commit, a *restore* (where the
  rank's state came from, per life or re-forming: :class:`Restore`). Each carries the
  writer's ``rank``: torchrun's processes on one machine inherit their replica's prefix
  and share its files. They step together, so the readers take the replica's segments
  and saves from its lowest rank alone, and every rank's restore.

A segment is one stretch of training: it starts after a restore (``first_step`` = the step
restored, 0 for a fresh start) and ends when the process dies or the group re-forms.
No torch import: the launcher reads these files too.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TELEMETRY_ENV = "RESILIENT_TRAIN_TELEMETRY"
# Seconds of running per failure, read by the auto checkpoint interval when set. The
# launcher does not set it: the failure log below is its one channel.
# The job's failures, live: a JSON file {"since": epoch seconds, "failures": N} that the
# launcher rewrites at each failure, so every worker life, restarted or one that survives
# failures, sees the job's observed MTBF (ObservedMtbf).
FAILURES_ENV = "RESILIENT_TRAIN_FAILURES_FILE"

# magic, first_step, t_start, t_first, blocking_s, then last_step, t_last (epoch seconds):
# the two that change every step are last and together, so a step stores 16 bytes.
_RECORD = struct.Struct("<4sqdddqd")
_TAIL = struct.Struct("<qd")
_TAIL_AT = _RECORD.size - _TAIL.size
_MAGIC = b"RTP1"
_EMPTY = -1


@dataclass(frozen=True)
class Segment:
    """One stretch of training in one process."""

    first_step: int        # the step restored from (steps done before the segment)
    last_step: int         # steps done when it ended (== first_step when no step finished)
    t_start: float         # training began (after the restore)
    t_first: float | None  # the first step finished
    t_last: float | None   # the last step finished
    blocking_s: float      # the loop was blocked by saves this long

    @property
    def steps(self) -> int:
        return self.last_step - self.first_step


class ObservedMtbf:
    """Reads the launcher's failure log: seconds of running per failure, as of ``now``.

    Cheap to call often: one stat() per call, the file is read again only when it changed.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._mtime: float | None = None
        self._since: float | None = None
        self._failures = 0

    @classmethod
    def from_env(cls) -> ObservedMtbf | None:
        path = os.environ.get(FAILURES_ENV)
        return cls(path) if path else None

    def at(self, now: float) -> float | None:
        """None before the first failure (or when the log cannot be read)."""
        try:
            mtime = os.stat(self.path).st_mtime
            if mtime != self._mtime:
                data = json.loads(self.path.read_text(encoding="utf-8"))
                self._since, self._failures = float(data["since"]), int(data["failures"])
                self._mtime = mtime
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if self._since is None:
            return None
        return observed_mtbf(self._since, self._failures, now)


def observed_mtbf(since: float | None, failures: int, now: float) -> float | None:
    """Seconds of running per failure: the one formula, for the launcher and the workers.
    None before the first failure (or before the job ran)."""
    if since is None or failures <= 0:
        return None
    return max(1.0, now - since) / failures


def write_failures(path: str | os.PathLike[str], since: float, failures: int) -> None:
    """The launcher's side of :class:`ObservedMtbf` (atomic: write, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"since": since, "failures": failures}), encoding="utf-8")
    os.replace(tmp, path)


class Telemetry:
    """The worker's side. ``Telemetry.from_env()`` is a no-op object when not launched."""

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        self.prefix = Path(prefix)
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        # No O_TRUNC: torchrun's processes of one replica inherit its prefix, and one
        # truncating the file between another's ftruncate and mmap made that mmap fail.
        fd = os.open(f"{self.prefix}.progress", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size < _RECORD.size:
                os.ftruncate(fd, _RECORD.size)
            self._map: mmap.mmap | None = mmap.mmap(fd, _RECORD.size)
        finally:
            os.close(fd)
        self._events = open(f"{self.prefix}.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        self._lock = threading.Lock()   # the checkpoint writer thread reports commits
        self._seg: list[Any] | None = None
        self._rank: int | None = None   # this process's, once a segment began

    @classmethod
    def from_env(cls) -> Telemetry | None:
        prefix = os.environ.get(TELEMETRY_ENV)
        if not prefix:
            return None
        try:
            return cls(prefix)
        except (OSError, ValueError) as exc:  # accounting must never stop training
            log.warning("telemetry disabled: cannot write %s: %s", prefix, exc)
            return None

    # --- the training loop's calls ----------------------------------------------------

    def begin_segment(self, restored_step: int, rank: int | None = None) -> None:
        """Training (re)starts after restoring ``restored_step``: close the previous segment.
        ``rank``: this process's, which every event from now on carries."""
        self._close_segment()
        self._rank = rank
        now = time.time()
        self._seg = [restored_step, restored_step, now, None, None, 0.0]
        self._store()

    def step(self, done: int) -> None:
        """``done`` steps are finished. The hot path: one pack into the mapped page."""
        seg = self._seg
        if seg is None or self._map is None:
            return
        now = time.time()
        seg[1], seg[4] = done, now
        if seg[3] is None:
            seg[3] = now
            self._store()
        elif _TAIL.unpack_from(self._map, _TAIL_AT)[0] < done:
            # torchrun's processes of a replica share the record, one of them up to a step
            # ahead of the other (they step together): it keeps the replica's furthest step.
            _TAIL.pack_into(self._map, _TAIL_AT, done, now)

    def saved(self, step: int, blocking_s: float) -> None:
        """A save after step ``step`` blocked the loop: the segment now ends after it."""
        if self._seg is not None:
            self._seg[5] += blocking_s
            self._seg[4] = time.time()
            self._store()
        self.event("save", step=step, blocking_s=blocking_s)

    def event(self, kind: str, **fields: Any) -> None:
        tag = {} if self._rank is None else {"rank": self._rank}
        line = json.dumps({"kind": kind, "t": time.time(), **tag, **fields})
        with self._lock:
            if not self._events.closed:
                self._events.write(line + "\n")
                self._events.flush()   # rare events: each reaches the file at once

    def close(self) -> None:
        self._close_segment()
        with self._lock:
            self._events.close()
        if self._map is not None:
            self._map.close()
            self._map = None

    # --- internals ----------------------------------------------------------------------

    def _store(self) -> None:
        seg = self._seg
        if seg is None or self._map is None:
            return
        _RECORD.pack_into(self._map, 0, _MAGIC, seg[0], seg[2],
                          _EMPTY if seg[3] is None else seg[3], seg[5], seg[1],
                          _EMPTY if seg[4] is None else seg[4])

    def _close_segment(self) -> None:
        if self._seg is None:
            return
        first, last, t_start, t_first, t_last, blocking = self._seg
        self.event("segment", **asdict(Segment(first, last, t_start, t_first, t_last, blocking)))
        self._seg = None
        if self._map is not None:   # the open segment is now in the log, not the map
            self._map[:4] = b"\0\0\0\0"


# --- the launcher's side ------------------------------------------------------------------

# The storage tiers a restore reads from, fastest first (the order every reader shows them).
RESTORE_TIERS = ("peer", "node-local", "persistent")
RESTORE_SOURCES = (*RESTORE_TIERS, "none")   # "none": a fresh start, nothing restored


@dataclass(frozen=True)
class Restore:
    """One ``restore`` event: where a rank's state came from at the start of a life (or
    of an in-process re-forming of the group)."""

    t: float                   # when the event was written (epoch seconds)
    step: int                  # the step restored; 0 = a fresh start
    source: str                # one of RESTORE_SOURCES (another string is kept as it is)
    from_rank: int | None      # "peer": the rank that sent the replicated state
    generation: int            # the process group's generation of this life
    seconds: float | None      # how long the restore took on this rank; None: not said
    bytes_read: tuple[tuple[str, int], ...]   # (tier, bytes), RESTORE_TIERS first
    reason: str                # why a faster tier could not be used; "" when it could
    # The rank that restored: several processes of one replica (torchrun) share its file.
    rank: int | None = None

    @property
    def read(self) -> dict[str, int]:
        """``bytes_read`` as a dict: every tier of RESTORE_TIERS, 0 when not read."""
        return {**dict.fromkeys(RESTORE_TIERS, 0), **dict(self.bytes_read)}

    @classmethod
    def from_json(cls, rec: dict[str, Any]) -> Restore:
        """From an event line; only ``t`` is required: a field left out reads as not said
        (step 0, source "none", generation 0, seconds None, no bytes, no reason, no rank).
        Raises ValueError, TypeError or KeyError for a line it cannot read."""
        raw = rec.get("bytes_read") or {}
        if not isinstance(raw, dict):
            raise TypeError(f"bytes_read is {type(raw).__name__}, not an object")
        tiers = [t for t in RESTORE_TIERS if t in raw] + sorted(set(raw) - set(RESTORE_TIERS))
        from_rank, seconds, rank = rec.get("from_rank"), rec.get("seconds"), rec.get("rank")
        return cls(t=float(rec["t"]), step=int(rec.get("step") or 0),
                   source=str(rec.get("source") or "none"),
                   from_rank=None if from_rank is None else int(from_rank),
                   generation=int(rec.get("generation") or 0),
                   seconds=None if seconds is None else float(seconds),
                   bytes_read=tuple((str(t), int(raw[t] or 0)) for t in tiers),
                   reason=str(rec.get("reason") or ""),
                   rank=None if rank is None else int(rank))


@dataclass(frozen=True)
class LifeTelemetry:
    segments: tuple[Segment, ...]
    saves: tuple[tuple[float, int, float], ...]   # (time, step, blocking_s)
    restores: tuple[Restore, ...] = ()            # in the order written


def _open_segment(prefix: str | os.PathLike[str]) -> Segment | None:
    """The segment in a life's memory-mapped progress record (one small read); None when
    the life has not reported one."""
    try:
        with open(f"{prefix}.progress", "rb") as f:
            raw = f.read(_RECORD.size)
    except OSError:
        return None
    if len(raw) < _RECORD.size:
        return None
    magic, first, t_start, t_first, blocking, last, t_last = _RECORD.unpack_from(raw)
    if magic != _MAGIC:
        return None
    return Segment(first, last, t_start, None if t_first == _EMPTY else t_first,
                   None if t_last == _EMPTY else t_last, blocking)


def read_step(prefix: str | os.PathLike[str]) -> int | None:
    """Steps done so far by a live worker life (its open segment); None before its first
    report. The launcher calls it while step-triggered faults wait."""
    seg = _open_segment(prefix)
    return None if seg is None else seg.last_step


class LifeReader:
    """One life's event log, read incrementally: each :meth:`update` parses only the lines
    appended since the last one, so a launcher can follow a long job's logs (thousands of
    saves) every second for the cost of a stat and a short read."""

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        self.prefix = Path(prefix)
        self._reset()

    def _reset(self) -> None:
        self._offset = 0          # bytes of the log parsed so far (whole lines only)
        # Per writing rank (-1: not said): the processes sharing a replica's file.
        self._segments: dict[int, list[Segment]] = {}
        self._saves: dict[int, list[tuple[float, int, float]]] = {}
        self._restores: list[Restore] = []

    def update(self, *, final: bool = False) -> bool:
        """Parse what was appended; True when a segment or a restore was (saves change no
        recovery, so they do not count). ``final``: the writer is gone, so a last line
        without its newline is parsed too (a SIGKILL may cut the newline alone)."""
        path = f"{self.prefix}.jsonl"
        try:
            size = os.stat(path).st_size
            if size < self._offset:   # the log was replaced: read it again from the start
                self._reset()
            if size == self._offset:
                return False
            with open(path, "rb") as f:
                f.seek(self._offset)
                data = f.read(size - self._offset)
        except FileNotFoundError:
            return False
        # A live writer may be mid-line: leave an unterminated tail for the next call.
        end = len(data) if final else data.rfind(b"\n") + 1
        self._offset += end
        changed = False
        for raw in data[:end].splitlines():
            changed |= self._parse(raw)
        return changed

    def _parse(self, raw: bytes) -> bool:
        try:
            rec = json.loads(raw.decode("utf-8", errors="replace"))
            kind = rec.get("kind") if isinstance(rec, dict) else None
            rank = -1 if not isinstance(rec, dict) or rec.get("rank") is None else int(rec["rank"])
            if kind == "segment":
                self._segments.setdefault(rank, []).append(
                    Segment(**{k: rec[k] for k in Segment.__dataclass_fields__}))
            elif kind == "save":
                self._saves.setdefault(rank, []).append(
                    (float(rec["t"]), int(rec["step"]), float(rec["blocking_s"])))
            elif kind == "restore":
                self._restores.append(Restore.from_json(rec))
            else:
                return False
        except (ValueError, TypeError, KeyError) as exc:
            # A line cut by a SIGKILL, or one this version cannot read: skip it, never fail
            # the launcher or a report over one line.
            if raw.strip():
                log.debug("%s.jsonl: skipped a line (%s): %.80r", self.prefix, exc, raw)
            return False
        return kind != "save"

    def life(self) -> LifeTelemetry:
        """What was parsed so far, plus the segment still open in the progress record
        (read now: it is the exact last step even of a SIGKILLed life). Of several processes
        sharing the file, the lowest rank's segments and saves: they are the replica's."""
        voice = min(self._segments.keys() | self._saves.keys(), default=-1)
        segments = list(self._segments.get(voice, ()))
        seg = _open_segment(self.prefix)
        if seg is not None:
            segments.append(seg)
        return LifeTelemetry(tuple(segments), tuple(self._saves.get(voice, ())),
                             tuple(self._restores))


def read_life(prefix: str | os.PathLike[str]) -> LifeTelemetry:
    """The segments, saves and restores one worker life reported; empty when it reported
    nothing. A line cut short (a SIGKILL mid-write) or missing a required field is skipped."""
    reader = LifeReader(prefix)
    reader.update(final=True)
    return reader.life()
