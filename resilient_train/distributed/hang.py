"""The hang watchdog: when no training step finishes for too long, write every thread's
stack to the error report and exit with the transient code, so the platform restarts the
job from its checkpoint instead of letting it sit in a collective for 30 minutes.

``beat()`` is one monotonic-clock read and an attribute store: cheap enough for every step.
The watchdog is armed by the first beat after ``arm()`` (so a slow start-up, a restore or a
rendezvous wait never counts as a hang) and ``disarm()`` pauses it. ``phase()`` says what
the rank is doing between two beats: only time in the ``step`` phase counts, so a long
save (a blocking one, or one waiting for the previous save's upload) never fires it.

Outside a step (a save, a restore: from ``arm()`` on) a rank may instead wait in a
collective on a peer that stopped for good (a frozen machine): then what counts is that
peer's silence, from ``listen()``'s source of heartbeats (heartbeat.py). A peer that is
merely slow (its own long save) still beats, and is waited for.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

from ..errors import EXIT_TRANSIENT, Classification, write_error_report
from ..frames import current_frames
from .heartbeat import OwnPause

logger = logging.getLogger(__name__)


def all_stacks() -> str:
    """Every Python thread's stack, the way a person reads them (thread name first)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in current_frames().items():
        parts.append(f'Thread "{names.get(ident, "?")}" (id {ident}), most recent call last:\n'
                     + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


def report_and_exit(message: str) -> None:
    """Log every thread's stack, write the error report (transient), exit 134 at once."""
    stacks = all_stacks()
    logger.critical("%s; stacks of all threads follow\n%s", message, stacks)
    try:
        write_error_report(message, exit_code=EXIT_TRANSIENT,
                           classification=Classification.TRANSIENT, traceback=stacks)
    except OSError as exc:
        logger.error("could not write the error report: %s", exc)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    # The main thread is stuck (that is the point): only _exit ends the process.
    os._exit(EXIT_TRANSIENT)


class HangWatchdog:
    """Exits the process when no ``beat()`` arrived for ``timeout_s`` while armed."""

    def __init__(self, timeout_s: float, *, on_hang: Callable[[str], None] = report_and_exit,
                 clock: Callable[[], float] = time.monotonic,
                 pace: Callable[[], float] = time.monotonic) -> None:
        """``clock`` times steps and silences; ``pace`` times this watchdog's own polls, to
        tell when the process itself did not run (both ``time.monotonic`` but in tests)."""
        if timeout_s <= 0:
            raise ValueError(f"hang timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s = timeout_s
        self._on_hang = on_hang
        self._clock = clock
        self._last = clock()
        self._armed = False
        self._arming = False
        self._step: int | None = None
        self._phase = "step"
        self._silent: Callable[[], tuple[str, float] | None] | None = None
        self._pace = pace
        self._resumed = -math.inf   # when this process last ran again after not running
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rt-hang-watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: int | None = None) -> None:
        self._last = self._clock()
        self._step = step
        if self._arming:
            self._armed, self._arming = True, False

    def phase(self, name: str) -> None:
        """The rank now does ``name`` ("step", "save", ...): time outside "step" does not
        count, and the count starts afresh when the steps resume."""
        if name == "step":
            self._last = self._clock()
        self._phase = name

    def listen(self, silent: Callable[[], tuple[str, float] | None] | None) -> None:
        """Where to learn what has been silent longest ("workerpool1-0 (rank 1) sent no
        heartbeat"), and since when on this watchdog's clock (None: nothing known yet)."""
        self._silent = silent

    @property
    def waiting(self) -> bool:
        """True while a silent peer would count: the group formed, outside a step."""
        return self._phase != "step" and (self._armed or self._arming)

    def arm(self) -> None:
        """Start counting at the next beat."""
        self._arming = True

    def disarm(self) -> None:
        self._armed = self._arming = False

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        poll = min(1.0, self.timeout_s / 10)
        pause = OwnPause(max(2.0, 5 * poll), self._pace)
        while not self._stop.wait(poll):
            if pause.paused():   # what it saw of its peers and the store is that old
                self._resumed = self._clock()
            if self._phase != "step":
                self._check_peers()
                continue
            if not self._armed:
                continue
            idle = self._clock() - self._last
            if idle >= self.timeout_s:
                after = "" if self._step is None else f" (the last one was step {self._step})"
                self._armed = False
                self._on_hang(f"hang: no training step finished for {idle:.0f} s{after}, "
                              f"above the watchdog's {self.timeout_s:.0f} s; exiting with "
                              f"the transient code so the job restarts from its checkpoint")

    def _check_peers(self) -> None:
        quiet = self._silent() if self._silent is not None and self.waiting else None
        if quiet is None:
            return
        who, since = quiet
        silent_s = self._clock() - max(since, self._resumed)
        if silent_s >= self.timeout_s:
            phase = self._phase
            self._armed = self._arming = False
            self._on_hang(f"hang: {who} for {silent_s:.0f} s while this rank waited in its "
                          f"{phase} (stopped, frozen or cut off from the network), above the "
                          f"watchdog's {self.timeout_s:.0f} s; exiting with the transient "
                          f"code so the job restarts from its checkpoint")
