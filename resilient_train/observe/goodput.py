"""Goodput: how a job's wall time split between useful training and everything else.

From the primary's training segments (telemetry.py) and the job's start and end:

- **startup**: from the job's first RUNNING to the first segment's training start;
- **productive**: computing steps whose result survived (the last computation of each step);
- **lost**: computing steps that a later restore threw away and computed again;
- **checkpoint**: the training loop blocked by saves;
- **recovery**: from the end of a segment (a fault) to training again: restart, rendezvous,
  restore;
- **other**: after the last step until the job ended (final save, evaluation, shutdown).

They add up to the wall time exactly. The primary stands for the job: in data-parallel
training every rank steps in lockstep with it. Time inside a segment is split between its
steps evenly (its blocking time excluded), so a step's cost is the segment's mean.

Two of them hold parts that the primary's telemetry times on their own, kept as "of which"
fields: the restore before each segment (its ``restore`` event's ``seconds``), and, in a
recovery, the primary's new process starting up (from the launcher's start of it to
training again, less the restore). With them, :meth:`Goodput.badput_s` names the buckets
as Google's ml-goodput-measurement does (:data:`BADPUT_TYPES`), adding up to the same wall
time with ``productive_s``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .telemetry import Restore, Segment

# ml-goodput-measurement's BadputType names (its goodput_utils.py), spelled as it spells
# them, for the ones this accounting can say; its TensorBoard tags are these lowercased.
# Left out: TPU_INITIALIZATION (no TPU; a GPU's initialization is part of the program's
# start), DATA_LOADING_ASYNC (overlaps steps, not badput there either),
# CUSTOM_BADPUT_EVENTS and the ELASTIC_* types (nothing here records them).
PROGRAM_STARTUP = "PROGRAM_STARTUP"
TRAINING_PREP = "TRAINING_PREP"
DATA_LOADING_SYNC = "DATA_LOADING_SYNC"
CHECKPOINT_SAVE = "UNPRODUCTIVE_CHECKPOINT_SAVE_TIME"
CHECKPOINT_RESTORE = "UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME"
WASTED_PROGRESS = "WASTED_PROGRESS_FROM_DISRUPTION"
INFRASTRUCTURE_RECOVERY = "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION"
OTHER = "OTHER"
BADPUT_TYPES = (PROGRAM_STARTUP, TRAINING_PREP, DATA_LOADING_SYNC, CHECKPOINT_SAVE,
                CHECKPOINT_RESTORE, WASTED_PROGRESS, INFRASTRUCTURE_RECOVERY, OTHER)


@dataclass(frozen=True)
class Goodput:
    wall_s: float
    startup_s: float
    productive_s: float
    lost_s: float
    checkpoint_s: float
    recovery_s: float
    other_s: float
    steps: int            # distinct steps trained
    steps_lost: int       # steps computed again after a restore
    segments: int
    recoveries: int
    # Of startup_s: restoring before the first segment (0 when no restore was reported).
    startup_restore_s: float = 0.0
    # Of recovery_s: restoring after each fault, and the primary's new process starting up.
    recovery_restore_s: float = 0.0
    recovery_startup_s: float = 0.0

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def badput_s(self) -> dict[str, float]:
        """The time that was not productive, in seconds, by ml-goodput-measurement's
        BadputType names: with ``productive_s`` they add up to ``wall_s``. TRAINING_PREP
        and DATA_LOADING_SYNC are 0: not told apart here (the script's preparation is part
        of its start; waiting for a batch is part of its step)."""
        return {
            PROGRAM_STARTUP: self.startup_s - self.startup_restore_s + self.recovery_startup_s,
            TRAINING_PREP: 0.0,
            DATA_LOADING_SYNC: 0.0,
            CHECKPOINT_SAVE: self.checkpoint_s,
            CHECKPOINT_RESTORE: self.startup_restore_s + self.recovery_restore_s,
            WASTED_PROGRESS: self.lost_s,
            INFRASTRUCTURE_RECOVERY: (self.recovery_s - self.recovery_restore_s
                                      - self.recovery_startup_s),
            OTHER: self.other_s,
        }

    def to_json(self) -> dict[str, Any]:
        return {**{k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()},
                "goodput": round(self.goodput, 4),
                "badput_s": {k: round(v, 3) for k, v in self.badput_s().items()}}


def covered_steps(n_lo: int, n_hi: int, later: list[tuple[int, int]]) -> int:
    """How many step numbers in (n_lo, n_hi] lie in the union of the intervals ``later``."""
    count, pos = 0, n_lo
    for lo, hi in sorted(later):
        lo, hi = max(lo, pos), min(hi, n_hi)
        if hi > lo:
            count += hi - lo
            pos = hi
    return count


def redone_steps(segs: Sequence[Segment]) -> list[int]:
    """For each segment (in start order): how many of its steps a later one computed again."""
    later: list[tuple[int, int]] = []   # step intervals (lo, hi] computed by later segments
    out = [0] * len(segs)
    for i in range(len(segs) - 1, -1, -1):
        seg = segs[i]
        if seg.steps > 0:
            out[i] = covered_steps(seg.first_step, seg.last_step, later)
            later.append((seg.first_step, seg.last_step))
    return out


def restore_times(segs: Sequence[Segment], restores: Iterable[Restore]) -> list[float]:
    """For each segment (in start order): how long the restore before it took. Each life
    writes its ``restore`` event just after the segment begins, so a segment's restore is
    the first one written between its start and the next segment's; 0 when there is none
    or it did not say how long it took."""
    events = sorted((r.t, r.seconds or 0.0) for r in restores)
    times = [t for t, _ in events]
    out = []
    for i, seg in enumerate(segs):
        until = segs[i + 1].t_start if i + 1 < len(segs) else float("inf")
        j = bisect_left(times, seg.t_start)
        out.append(max(0.0, events[j][1]) if j < len(events) and times[j] < until else 0.0)
    return out


def account(segments: Iterable[Segment], start_time: float, end_time: float,
            restores: Iterable[Restore] = (), starts: Iterable[float] = ()) -> Goodput:
    """Split ``end_time - start_time`` into the buckets above. ``restores``: the primary's
    restore events; ``starts``: when the launcher started the primary's processes. Without
    them every restore and restart is in startup_s and recovery_s alone."""
    segs: Sequence[Segment] = sorted(segments, key=lambda s: s.t_start)
    wall = max(0.0, end_time - start_time)
    if not segs:
        return Goodput(wall, wall, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, 0, 0)
    restored = restore_times(segs, restores)
    started = sorted(starts)
    productive = lost = checkpoint = recovery = 0.0
    steps_lost = 0
    for seg, redone in zip(segs, redone_steps(segs)):
        if seg.steps > 0 and seg.t_last is not None:
            compute = max(0.0, seg.t_last - seg.t_start - seg.blocking_s)
            per_step = compute / seg.steps
            lost += redone * per_step
            productive += compute - redone * per_step
            steps_lost += redone
            checkpoint += seg.blocking_s
    ends = [s.t_last if s.t_last is not None else s.t_start for s in segs]
    recovery_restore = recovery_startup = 0.0
    for prev_end, seg, restore in zip(ends, segs[1:], restored[1:]):
        gap = max(0.0, seg.t_start - prev_end)
        recovery += gap
        # The primary's last process start in the gap (none: the group re-formed in
        # process): before it the job was down or restarting, after it starting up.
        began = max((t for t in started if prev_end < t < seg.t_start), default=None)
        since = gap if began is None else seg.t_start - began
        restore = min(restore, since)
        recovery_restore += restore
        if began is not None:
            recovery_startup += since - restore
    startup = max(0.0, segs[0].t_start - start_time)
    other = max(0.0, end_time - ends[-1])
    trained = covered_steps(0, max(s.last_step for s in segs),
                            [(s.first_step, s.last_step) for s in segs if s.steps > 0])
    return Goodput(wall, startup, productive, lost, checkpoint, recovery, other, trained,
                   steps_lost, len(segs), len(segs) - 1, min(restored[0], startup),
                   recovery_restore, recovery_startup)
