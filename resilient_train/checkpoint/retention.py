"""What to keep: the last K committed steps plus milestones kept forever."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RetentionPolicy:
    keep_last: int = 3
    milestone_every_steps: int | None = None     # e.g. 10_000: steps divisible by it stay
    milestone_every_seconds: float | None = None  # the first commit in each window stays

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (one committed step always stays), "
                             f"found {self.keep_last}")


@dataclass(frozen=True)
class CommittedStep:
    step: int
    time: float  # commit time, epoch seconds


def to_delete(committed: Sequence[CommittedStep], policy: RetentionPolicy) -> list[int]:
    """Steps that may go. Only committed steps are considered, so an old step is deleted
    only once newer ones exist; the newest ``keep_last`` and every milestone stay."""
    ordered = sorted(committed, key=lambda c: c.step)
    keep = {c.step for c in ordered[-policy.keep_last:]}
    if policy.milestone_every_steps:
        keep |= {c.step for c in ordered if c.step % policy.milestone_every_steps == 0}
    if policy.milestone_every_seconds:
        windows: set[int] = set()
        for c in sorted(ordered, key=lambda c: (c.time, c.step)):
            window = int(c.time // policy.milestone_every_seconds)
            if window not in windows:
                windows.add(window)
                keep.add(c.step)
    return [c.step for c in ordered if c.step not in keep]
