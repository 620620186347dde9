"""Hangs and stragglers (chaos ``hang`` and ``slow``): when to stop and continue a replica.

A replica that is stopped (SIGSTOP to its whole process tree) keeps its memory, its
sockets and its GPU context and answers nothing: to its peers it is a worker stuck in a
collective or on a wedged GPU, and nothing on the machine restarts it, since it has not
exited. A straggler is stopped and continued in ``SLOW_PERIOD_S`` periods and runs SPEED
of each, so its steps take 1/SPEED as long on average.

`Stall` is the arithmetic (pure, given the time); `signal_tree` sends the signals. The
launcher (faults.py) owns both and must continue a stopped replica before it sends it
SIGTERM: a stopped process does not act on SIGTERM until it is continued.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

from .chaos import DEFAULT_SLOW_SPEED, SLOW_PERIOD_S, FaultKind, ScheduledFault

__all__ = ["Stall", "StallStep", "signal_tree"]


class StallStep(enum.Enum):
    STOP = "stop"   # SIGSTOP the tree now
    CONT = "cont"   # SIGCONT the tree now; the stall goes on
    OVER = "over"   # the duration is over: SIGCONT if stopped, and forget the stall


@dataclass
class Stall:
    """One hang or slow-down of one replica's life."""

    kind: FaultKind
    since: float
    until: float | None           # None: for the rest of the life
    speed: float                  # the fraction of each period it runs (0 for a hang)
    stopped: bool = False
    next_switch: float | None = None  # slow: when the current phase ends
    tree_at: float = float("-inf")    # the launcher's last look for new descendants

    @classmethod
    def begin(cls, fault: ScheduledFault, now: float) -> Stall:
        if not fault.kind.stalls:
            raise ValueError(f"{fault.kind.value} is not a hang or a slow-down")
        speed = 0.0 if fault.kind is FaultKind.HANG else (
            fault.speed if fault.speed is not None else DEFAULT_SLOW_SPEED)
        until = None if fault.duration is None else now + fault.duration
        return cls(fault.kind, now, until, speed)

    def deadline(self) -> float | None:
        """When `advance` next has something to do; None: not before the life ends."""
        times = [t for t in (self.until, self.next_switch) if t is not None]
        if not self.stopped and self.next_switch is None:
            times.append(self.since)   # not stopped yet: at once
        return min(times) if times else None

    def advance(self, now: float) -> StallStep | None:
        """What to do at ``now``. A late call shortens nothing that already happened: the
        next phase is measured from ``now``, so a busy launcher makes a straggler slower,
        never faster."""
        if self.until is not None and now >= self.until:
            return StallStep.OVER
        if self.kind is FaultKind.HANG:
            if self.stopped:
                return None
            self.stopped = True
            return StallStep.STOP
        if self.next_switch is not None and now < self.next_switch:
            return None
        self.stopped = not self.stopped
        running = self.speed * SLOW_PERIOD_S
        self.next_switch = now + (SLOW_PERIOD_S - running if self.stopped else running)
        return StallStep.STOP if self.stopped else StallStep.CONT


def signal_tree(pid: int, tree: Iterable[psutil.Process], sig: int) -> None:
    """``sig`` to the process group led by ``pid`` and to every known descendant (some
    leave the group). Unlike the launcher's kills this does not mark the worker as
    signalled: a stopped worker that then dies of an outside SIGKILL is still a node loss."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for proc in tree:
        try:
            proc.send_signal(sig)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass

