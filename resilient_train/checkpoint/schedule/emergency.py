"""SIGTERM's emergency save: committed before the grace period ends, or abandoned cleanly.

A preemption or a maintenance event sends SIGTERM and, a grace period later, SIGKILL: 30 s
on a Spot VM, 120 s on a standard one. The ranks agree on the SIGTERM at the next step
boundary (schedule/scheduler.py) and save that step to every tier, the fastest first (the
node-local disk, then the persistent tier: the machine and its disk go with the event).
The save has a deadline: the grace period, counted from the first rank's SIGTERM, less a
reserve for the exit itself. A save that has not committed by then is abandoned: its
commit is refused (:class:`CommitGate`), so the previous committed step stays the latest
and the process exits 134 on its own, with one line that says so, rather than being
killed in the middle of a write by the SIGKILL. (A SIGKILL mid-save would leave no torn
step either, the commit protocol sees to that, but nobody would learn why.)

The grace period is ``CheckpointOptions.sigterm_grace_s``, else ``$RESILIENT_TRAIN_
SIGTERM_GRACE_S`` (the launcher sets it to its ``--grace``), else Spot's 30 s: the
shortest the platform gives, so a save planned for it fits every VM.
"""

from __future__ import annotations

import contextlib
import enum
import os
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from ...sigterm import GRACE_ENV
from ..commit.manifest import CheckpointError

SPOT_GRACE_S = 30.0


class SaveAbandoned(CheckpointError):
    """The emergency save's deadline passed before its commit: the commit is refused."""


@dataclass(frozen=True)
class Grace:
    """The grace period between SIGTERM and SIGKILL, and where that number came from."""

    seconds: float
    source: str   # "given", the environment variable's name, or "Spot VM's"

    @classmethod
    def resolve(cls, given: float | None, env: Mapping[str, str] | None = None) -> Grace:
        if given is not None:
            return cls(float(given), "given")
        env = os.environ if env is None else env
        raw = env.get(GRACE_ENV, "").strip()
        if raw:
            try:
                value = float(raw)
            except ValueError:
                value = float("nan")
            if not 0 < value < float("inf"):
                raise ValueError(f"{GRACE_ENV}={raw!r}: expected a positive number of "
                                 f"seconds (the SIGTERM-to-SIGKILL grace period)")
            return cls(value, GRACE_ENV)
        return cls(SPOT_GRACE_S, "a Spot VM's, the shortest")

    @property
    def reserve_s(self) -> float:
        """Kept back from the save for the exit after it (the error report, closing)."""
        return min(2.0, 0.2 * self.seconds)

    def budget(self, elapsed_s: float) -> float:
        """Seconds the save may take, ``elapsed_s`` after the SIGTERM (may be <= 0)."""
        return self.seconds - elapsed_s - self.reserve_s

    def describe(self) -> str:
        return f"{self.seconds:g} s ({self.source})"


class Outcome(enum.Enum):
    """What became of a step whose save was cut at the deadline."""

    ABANDONED = "abandoned"      # its commit never started and never will
    COMMITTED = "committed"      # its commit finished first
    UNDER_WAY = "under way"      # its marker was being written: it may yet land


class CommitGate:
    """Either a step's commit or its abandonment happens, never both: they take one lock,
    which the commit holds while it writes the manifest and the marker.

    The writer thread commits inside :meth:`commit`; the main thread, at the deadline,
    calls :meth:`close`. A commit that finds the gate closed raises SaveAbandoned (and the
    writer discards what it wrote). A commit still writing at the deadline cannot be
    called back (its request may already be at the store): ``close`` says UNDER_WAY.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._closed = False
        self.last: int | None = None   # the last step committed through the gate

    @contextlib.contextmanager
    def commit(self, step: int) -> Iterator[None]:
        with self._lock:
            if self._closed:
                raise SaveAbandoned(f"step {step} was abandoned at the SIGTERM's deadline; "
                                    f"not committing it")
            yield
            self.last = step

    def close(self, step: int, timeout_s: float) -> Outcome:
        """Refuse any later commit, and say what became of ``step``."""
        if not self._lock.acquire(timeout=max(0.0, timeout_s)):
            return Outcome.UNDER_WAY
        try:
            self._closed = True
            return Outcome.COMMITTED if self.last == step else Outcome.ABANDONED
        finally:
            self._lock.release()


def remaining(deadline: float) -> float:
    """Seconds to ``deadline`` (time.monotonic()), at least 0."""
    return max(0.0, deadline - time.monotonic())


def abandoned_line(step: int, outcome: Outcome, is_primary: bool, last_commit: int | None,
                   grace: Grace, budget: float, *, on_disk: bool) -> str:
    """Why the emergency save of ``step`` was not committed, and what the latest is, for
    the exit's line. ``on_disk``: the step is on this machine's node-local disk."""
    before = "none" if last_commit is None else f"step {last_commit}"
    if is_primary and outcome is Outcome.ABANDONED:
        last = f"{before} stays the latest"
    else:   # the primary commits: only it knows whether the marker lands
        last = f"the latest is step {step} if its commit landed, else {before}"
    local = f"; step {step} is on this machine's node-local disk" if on_disk else ""
    spent = f"the grace period, {grace.describe()}, had " + (
        f"{budget:.1f} s left for it" if budget > 0 else "no time left for it")
    what = "was abandoned" if outcome is Outcome.ABANDONED else \
        "was still committing at the deadline"
    return (f"the checkpoint of step {step} {what}: not committed in time ({spent}); "
            f"{last}{local}")
