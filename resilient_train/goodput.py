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
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .telemetry import Segment


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

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**{k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()},
                "goodput": round(self.goodput, 4)}


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


def account(segments: Iterable[Segment], start_time: float, end_time: float) -> Goodput:
    """Split ``end_time - start_time`` into the buckets above."""
    segs: Sequence[Segment] = sorted(segments, key=lambda s: s.t_start)
    wall = max(0.0, end_time - start_time)
    if not segs:
        return Goodput(wall, wall, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, 0, 0)
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
    for prev_end, seg in zip(ends, segs[1:]):
        recovery += max(0.0, seg.t_start - prev_end)
    startup = max(0.0, segs[0].t_start - start_time)
    other = max(0.0, end_time - ends[-1])
    trained = covered_steps(0, max(s.last_step for s in segs),
                            [(s.first_step, s.last_step) for s in segs if s.steps > 0])
    return Goodput(wall, startup, productive, lost, checkpoint, recovery, other, trained,
                   steps_lost, len(segs), len(segs) - 1)
