"""Scheduled chaos, carried out: the ``--chaos`` faults that are due, hit their targets.

``chaos.py`` says when each fault comes and whom it hits; ``stall.py`` when a hung or slowed
replica is stopped and continued. :class:`Faults` does it to the job's workers: the
supervision loop calls :meth:`Faults.poll` at each step and :meth:`Faults.wake` for how long
it may sleep. A fault whose target is between two lives waits for the next one; a
KIND@stepN fault waits for the primary's step (its telemetry), and if the primary reports
none, a warning says so once. Each fault is recorded as a typed FAULT event.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ..observe.events import EventKind
from ..observe.jobdir import telemetry_prefix
from ..observe.telemetry import read_step
from .chaos import ChaosSchedule, FaultKind, ScheduledFault, UnfiredFault
from .job import Command, JobMachine
from .messages import JobState
from .processes import TREE_REFRESH_S, Worker
from .stall import Stall, StallStep, signal_tree
from .tamper import corrupt_newest_checkpoint, wipe_disk

__all__ = ["NO_STEP_WARNING_S", "Faults"]

# A KIND@stepN fault waits for the primary's steps, which only scripts under @rt.main (or
# that report to the telemetry) send: a primary that has reported none this long into its
# life, the job RUNNING, likely never will, and the launcher says so (once).
NO_STEP_WARNING_S = 60.0
# While faults wait for a target, or for the primary's next step, the loop looks this often.
_PENDING_POLL_S = 0.25
_STEP_POLL_S = 0.05


class Faults:
    """The job's chaos schedule, applied to its workers.

    ``note(kind, message, **fields)`` records an event; ``execute(commands)`` carries out
    the job machine's commands (a whole-job fault's retry)."""

    def __init__(self, schedule: ChaosSchedule, machine: JobMachine,
                 workers: Mapping[str, Worker], *, primary: str, job_dir: Path,
                 grace: float, no_step_warning_s: float, note: Callable[..., None],
                 execute: Callable[[Sequence[Command]], None],
                 node_local: Callable[[str], Path]) -> None:
        self.schedule = schedule
        self._machine = machine
        self._workers = workers
        self._primary = primary
        self._job_dir = job_dir
        self._grace = grace
        self._no_step_warning_s = no_step_warning_s
        self._note = note
        self._execute = execute
        self._node_local = node_local   # a replica -> its node-local disk (machines.py)
        self._pending: list[ScheduledFault] = []
        self._stalls: dict[str, tuple[Worker, Stall]] = {}   # hung or slowed lives, by name
        self.last_step: int | None = None   # the highest step the primary reported
        self._step_life: tuple[Worker, float] | None = None   # primary life watched, since
        self._warned_no_steps = False

    # --- the loop's calls -------------------------------------------------------------

    def poll(self, now: float) -> None:
        """Drive the stalls, then inject every fault that is due and has its target."""
        self._drive_stalls(now)
        m = self._machine
        start = m.start_time
        if start is None or m.state.terminal:
            return
        self._pending.extend(self.schedule.due(now - start))
        if self.schedule.waits_for_steps:
            step = self._primary_step()
            if step is not None:
                self.last_step = max(step, self.last_step or 0)
                self._pending.extend(self.schedule.due_at_step(step))
            else:
                self._warn_no_steps(now)
        waiting = []
        for fault in self._pending:
            if self._inject(fault, now):
                self.schedule.fired(fault)
            else:
                waiting.append(fault)   # its target is between lives: hit the next one
        self._pending = waiting

    def wake(self, now: float) -> float | None:
        """Seconds until a fault, a stall's next phase or a look at the primary's step is
        due; None when nothing is."""
        times = [t for _, st in self._stalls.values() if (t := st.deadline()) is not None]
        start = self._machine.start_time
        if start is not None:
            fault_at = self.schedule.next_time()
            if fault_at is not None:
                times.append(start + fault_at)
        bounds = [max(0.0, t - now) for t in times]
        if self._pending:
            bounds.append(_PENDING_POLL_S)
        if self.schedule.waits_for_steps and start is not None:
            bounds.append(_STEP_POLL_S)   # watch the primary's step count closely
        return min(bounds) if bounds else None

    def end_stall(self, name: str, now: float, why: str = "") -> None:
        """Continue the replica if a hang or slow-down holds it (a stopped process acts on
        SIGTERM only once continued), and record how long it lasted."""
        entry = self._stalls.pop(name, None)
        if entry is None:
            return
        w, stall = entry
        if self._workers.get(name) is not w:
            return
        if stall.stopped:
            signal_tree(w.popen.pid, w.tree, signal.SIGCONT)
        what = "resumed" if stall.kind is FaultKind.HANG else "resumed full speed"
        lasted = now - stall.since
        cut_short = {"detail": why.strip(" ()")} if why else {}   # what cut it short
        self._note(EventKind.FAULT_OVER, f"chaos: {name} {what} after {lasted:.1f} s{why}",
                   replica=name, fault=stall.kind.value, duration_s=round(lasted, 3),
                   **cut_short)

    def unfired(self) -> list[UnfiredFault]:
        """The ``--chaos`` items that never fired, with why; empty until the job is over."""
        m = self._machine
        if not self.schedule.spec or not m.state.terminal:
            return []
        ran_for = (m.end_time - m.start_time
                   if m.start_time is not None and m.end_time is not None else None)
        return self.schedule.never_fired(ran_for=ran_for, last_step=self.last_step,
                                         pending=self._pending)

    # --- injecting --------------------------------------------------------------------

    def _warn_no_steps(self, now: float) -> None:
        """Once per job: step faults wait, and the primary's life has reported no step
        ``no_step_warning_s`` into RUNNING (its script likely reports none)."""
        w = self._workers.get(self._primary)
        if self._warned_no_steps or w is None or self._machine.state is not JobState.RUNNING:
            return
        if self._step_life is None or self._step_life[0] is not w:
            self._step_life = (w, now)   # a new life (or RUNNING just began): count afresh
            return
        waited = now - self._step_life[1]
        if waited < self._no_step_warning_s:
            return
        self._warned_no_steps = True
        faults = ", ".join(self.schedule.waiting_for_steps())
        self._note(EventKind.WARNING,
                   f"chaos: {faults} cannot fire yet: the primary {w.replica.name} has "
                   f"reported no step {waited:.0f} s into its life, and only a script under "
                   f"@rt.main (ctx.steps) reports steps; against one that does not, a "
                   f"KIND@stepN fault never fires: give it a time instead (e.g. kill:1@30s)",
                   replica=w.replica.name)

    def _primary_step(self) -> int | None:
        """Steps the primary's current life has finished (its telemetry), for faults
        written KIND@stepN; None while it has not reported any."""
        w = self._workers.get(self._primary)
        if w is None:
            return None
        return read_step(telemetry_prefix(self._job_dir, w.attempt, self._primary, w.restart))

    def _inject(self, fault: ScheduledFault, now: float) -> bool:
        if fault.kind.stalls:
            return self._begin_stall(fault, now)
        if fault.kind.tampers:
            return self._tamper(fault)
        cause = fault.kind.cause
        assert cause is not None   # every kind that is no stall ends something
        m = self._machine
        if fault.kind.job_wide:
            # Not while the attempt is being stopped for a retry: the fault would be lost.
            if m.state is not JobState.RUNNING or m.stopping:
                return False
            self._note(EventKind.FAULT, f"chaos: {fault.kind.value} (whole job) at "
                       + (f"step {fault.at_step}" if fault.at_step is not None
                          else f"{now - m.create_time:.1f} s"),
                       fault=fault.kind.value, cause=cause.value, injected=True,
                       step=fault.at_step, counts_as_failure=True, detail="whole job")
            self._execute(m.job_fault(cause, now))
            return True
        w = self._workers.get(fault.target or "")
        if w is None or w.injected is not None or w.kill_at is not None:
            return False
        # replica and cause: a peer's exit soon after is put down to this loss (job.py).
        self._note(EventKind.FAULT, f"chaos: {fault.kind.value} on {w.replica.name}"
                   + (f" at step {fault.at_step}" if fault.at_step is not None else ""),
                   replica=w.replica.name, fault=fault.kind.value, cause=cause.value,
                   injected=True, step=fault.at_step, counts_as_failure=True)
        if fault.kind.has_grace:
            w.injected = cause
            w.snapshot_tree()
            grace = fault.grace if fault.grace is not None else self._grace
            self.end_stall(w.replica.name, now, " to deliver the SIGTERM")
            w.terminate()
            w.kill_at = now + grace
        else:
            w.end(cause)
        return True

    def _tamper(self, fault: ScheduledFault) -> bool:
        """A wipe or a corruption of the replica's node-local disk; the replica runs on."""
        w = self._workers.get(fault.target or "")
        if w is None:
            return False
        name = w.replica.name
        disk = self._node_local(name)
        when = f" at step {fault.at_step}" if fault.at_step is not None else ""
        if fault.kind is FaultKind.WIPE:
            gone = wipe_disk(disk)
            message = (f"chaos: wipe on {name}{when}: its node-local disk emptied"
                       + (f" ({', '.join(gone[:5])})" if gone else " (it was empty)"))
        else:
            hit = corrupt_newest_checkpoint(disk)
            message = (f"chaos: corrupt on {name}{when}: " +
                       (f"flipped a byte of {hit.relative_to(disk)}" if hit else
                        "no committed checkpoint on its node-local disk to corrupt"))
        self._note(EventKind.FAULT, message, replica=name, fault=fault.kind.value,
                   injected=True, step=fault.at_step, counts_as_failure=False)
        return True

    def _begin_stall(self, fault: ScheduledFault, now: float) -> bool:
        """A hang or slow-down: the replica's tree is stopped now (and continued by
        `_drive_stalls`). A later hang or slow-down of the same life replaces this one."""
        w = self._workers.get(fault.target or "")
        if w is None or w.injected is not None or w.kill_at is not None:
            return False
        name = w.replica.name
        self.end_stall(name, now, f" ({fault.kind.value} replaces it)")
        when = f" at step {fault.at_step}" if fault.at_step is not None else ""
        lasts = "" if fault.duration is None else f" for {fault.duration:g} s"
        stall = Stall.begin(fault, now)
        if fault.kind is FaultKind.SLOW:
            message = (f"chaos: slow on {name}{when}: {stall.speed:.0%} speed"
                       + (lasts or " for the rest of its life"))
        else:
            message = f"chaos: hang on {name}{when}{lasts}"
        # A hang is a failure (the job must recover from it); a slow-down only costs time.
        self._note(EventKind.FAULT, message, replica=name, fault=fault.kind.value,
                   injected=True, step=fault.at_step,
                   counts_as_failure=fault.kind is FaultKind.HANG)
        w.snapshot_tree()
        stall.tree_at = now
        self._stalls[name] = (w, stall)
        self._drive_stalls(now)
        return True

    def _drive_stalls(self, now: float) -> None:
        """Stop, continue or release the hung and slowed replicas whose time has come."""
        for name, (w, stall) in list(self._stalls.items()):
            if self._workers.get(name) is not w:
                del self._stalls[name]   # that life is over; a restart runs at full speed
                continue
            step = stall.advance(now)
            if step is StallStep.OVER:
                self.end_stall(name, now)
            elif step is StallStep.CONT:
                signal_tree(w.popen.pid, w.tree, signal.SIGCONT)
            elif step is StallStep.STOP:
                if now - stall.tree_at >= TREE_REFRESH_S:
                    w.snapshot_tree()   # children started while it ran get stopped too
                    stall.tree_at = now
                signal_tree(w.popen.pid, w.tree, signal.SIGSTOP)
