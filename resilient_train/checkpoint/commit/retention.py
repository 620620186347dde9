"""What to keep: the last K committed steps plus milestones kept forever."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...validate import options


@options
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
    time: float          # commit time, epoch seconds
    usable: bool = True  # False: committed but does not verify (truncated, corrupt)
    name: str = ""       # its directory: object stores may hold two of one step


def to_delete(committed: Sequence[CommittedStep], policy: RetentionPolicy
              ) -> list[CommittedStep]:
    """Steps that may go. Only committed steps are considered, so an old step is deleted
    only once newer ones exist; the newest ``keep_last`` *usable* steps and every milestone
    stay. A step that does not verify never counts towards ``keep_last`` (counting it
    would delete the good ones that a restore falls back to); it goes once a usable step
    as new or newer exists, and stays while newer (the save of that step moves it aside)."""
    ordered = sorted(committed, key=lambda c: (c.step, c.name))
    usable = [c for c in ordered if c.usable]
    keep = set(usable[-policy.keep_last:])
    newest_usable = usable[-1].step if usable else None
    keep |= {c for c in ordered
             if not c.usable and (newest_usable is None or c.step > newest_usable)}
    if policy.milestone_every_steps:
        keep |= {c for c in usable if c.step % policy.milestone_every_steps == 0}
    if policy.milestone_every_seconds:
        windows: set[int] = set()
        for c in sorted(usable, key=lambda c: (c.time, c.step)):
            window = int(c.time // policy.milestone_every_seconds)
            if window not in windows:
                windows.add(window)
                keep.add(c)
    return [c for c in ordered if c not in keep]
