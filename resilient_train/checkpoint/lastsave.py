"""SIGTERM's save: committed before the grace period ends, or abandoned, and the exit.

After a SIGTERM the platform sends SIGKILL once the grace period has passed (30 s on a
Spot VM). The save of the step being finished must commit before then, or be abandoned
in time for this rank to say so and leave (exit 134) on its own: a commit after the
deadline would race the kill and may leave a step that only some ranks wrote.
The deadline's arithmetic and the gate that refuses a late commit are
schedule/emergency.py; this is its use by the manager's save in flight.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout

from .inflight import SaveInFlight
from .schedule.coordination import Coordinator
from .schedule.emergency import CommitGate, Grace, Outcome, abandoned_line
from .schedule.scheduler import SaveScheduler

log = logging.getLogger("resilient_train.checkpoint.manager")   # the manager's lines

# How often a wait for the save in flight looks for a SIGTERM that came meanwhile.
SIGTERM_POLL_S = 0.1


class LastSave:
    """One manager's save under a SIGTERM's deadline."""

    def __init__(self, inflight: SaveInFlight, scheduler: SaveScheduler, coord: Coordinator,
                 gate: CommitGate, grace: Grace, *, watching: bool,
                 save: Callable[[int], None], close: Callable[[], None],
                 last_commit: Callable[[], int | None],
                 on_disk: Callable[[int], bool]) -> None:
        self._inflight, self._scheduler, self._coord = inflight, scheduler, coord
        self._gate, self._grace = gate, grace
        self._watching = watching   # save_on_sigterm: waits look for a SIGTERM
        self._save, self._close = save, close   # an async save of every tier; the close
        self._last_commit = last_commit   # the persistent tier's newest commit
        self._on_disk = on_disk   # whether a step is on this machine's node-local disk
        self.abandoned = ""   # why the save was abandoned, for the exit's line
        self.left_behind: threading.Thread | None = None   # its writer, left to the exit

    def save(self, step: int) -> bool:
        """Save ``step`` to every tier, the fastest first, and have it committed before
        the grace period ends; True once it is. False: abandoned at the deadline
        (logged), and the last committed step stays the latest."""
        inflight, sched = self._inflight, self._scheduler
        inflight.check()
        # The ranks' agreed clock; the handler's own when no step boundary agreed on it.
        budget = self._grace.budget(max(sched.sigterm_elapsed_s, sched.watch.elapsed() or 0.0))
        deadline = time.monotonic() + budget
        # The save before it (its host buffers are reused), then this one.
        if budget > 0 and inflight.finished_by(deadline):
            inflight.wait()
            self._save(step)
            if self._coord.world_size > 1:   # and the primary's commit, which ends the save
                inflight.submit(self._await_commit)
            if inflight.finished_by(deadline):
                inflight.wait()
                return True
        return self._abandon(step, budget)

    def wait_or_leave(self) -> None:
        """Wait for the save in flight; but once a SIGTERM has come (before or during the
        wait), only until its deadline: then the save is abandoned and this rank leaves
        (exit 134)."""
        fut, watch = self._inflight.future, self._scheduler.watch
        while fut is not None and self._watching and not watch.received:
            try:   # slices: the handler runs during the wait but cannot end it
                fut.result(timeout=SIGTERM_POLL_S)
                break
            except FutureTimeout:
                continue
        if fut is not None and watch.received:
            budget = self._grace.budget(watch.elapsed() or 0.0)
            if not self._inflight.finished_by(time.monotonic() + budget):
                step = self._scheduler.last_save_step or 0   # the step that save writes
                self.leave(step, self._abandon(step, budget))
        self._inflight.wait()

    def leave(self, step: int, committed: bool) -> None:
        """The signalled rank leaves (exit 134), saying whether its save committed; the
        others saved with it and go on (they learn of its exit at the next collective)."""
        from ..errors import exit_transient

        if self._scheduler.sigterm_received:
            self._close()
            exit_transient(f"SIGTERM: emergency checkpoint of step {step} committed"
                           if committed else f"SIGTERM: {self.abandoned}", one_line=True)

    def _await_commit(self) -> None:
        """Writer thread: the ranks wait for the primary, which commits before it joins."""
        try:
            self._coord.writer_barrier()
        except Exception as exc:  # noqa: BLE001 - a peer lost meanwhile: raised by wait()
            self._inflight.failed(exc)

    def _abandon(self, step: int, budget: float) -> bool:
        """The deadline passed: refuse the commit, leave the writer thread to the exit.
        True when the step's commit got in first after all."""
        outcome = self._gate.close(step, timeout_s=self._grace.reserve_s / 2)
        self.left_behind = self._inflight.abandon()
        primary = self._coord.rank == 0
        if primary and outcome is Outcome.COMMITTED:
            return True
        self.abandoned = abandoned_line(step, outcome, primary, self._last_commit(),
                                        self._grace, budget, on_disk=self._on_disk(step))
        if not self._scheduler.sigterm_received:   # the signalled rank says it as it exits
            log.warning("SIGTERM on a peer: %s", self.abandoned)
        return False
