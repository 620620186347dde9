"""Whether this process was asked to stop (SIGTERM), and a guard for a main thread that
cannot hear it.

The checkpoint manager's handler (an emergency save at the next step boundary) calls
`note()`. Code that waits on peers (re-forming the group, a rendezvous, a barrier) asks
`received()` and leaves instead of waiting for peers that are being stopped too.

Python runs a signal handler only when the main thread next executes bytecode. A main
thread blocked inside torch (a collective whose peer is dead or frozen) never does, or
handles the signal and then blocks in the emergency save's own coordination with the same
peer; either way the process sits out the grace period until the SIGKILL, with no report.
`StallGuard` learns of the signal through the wakeup descriptor, which the C-level
handler writes at once, and then watches the main thread: when it stays in one place
inside torch for ``stall_s``, it calls ``unblock`` (the group ends its collectives, which
then raise, and the process exits transient); when it is still stuck ``stall_s`` later, it
writes a report with every thread's stack and exits with the transient code.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

_received = threading.Event()


def note() -> None:
    """Record a SIGTERM (called from the Python-level handler)."""
    _received.set()


def received() -> bool:
    return _received.is_set()


class StallGuard:
    """Reacts to a SIGTERM that the main thread does not handle within ``stall_s``."""

    def __init__(self, unblock: Callable[[], None], on_stuck: Callable[[str], None], *,
                 stall_s: float = 5.0) -> None:
        self.stall_s = stall_s
        self._unblock = unblock
        self._on_stuck = on_stuck
        self._read_fd = self._write_fd = -1
        self._thread: threading.Thread | None = None

    def install(self) -> bool:
        """Take the wakeup descriptor (main thread only). False, and nothing done, when
        someone else holds it (an asyncio loop, say): the guard then stays off."""
        if threading.current_thread() is not threading.main_thread():
            return False
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:
            os.close(r)
            os.close(w)
            return False
        if previous != -1:
            signal.set_wakeup_fd(previous)
            os.close(r)
            os.close(w)
            logger.debug("the signal wakeup descriptor is taken; no SIGTERM stall guard")
            return False
        self._read_fd, self._write_fd = r, w
        self._thread = threading.Thread(target=self._run, name="rt-sigterm-guard", daemon=True)
        self._thread.start()
        return True

    def _run(self) -> None:
        while True:
            try:
                data = os.read(self._read_fd, 64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGTERM in data and self._main_stuck():
                self._stalled()

    def _main_stuck(self) -> bool:
        """Whether the main thread stays at one instruction inside torch for ``stall_s``
        (polled, so a thread that moves on is never taken for a stuck one)."""
        main = threading.main_thread().ident
        seen: tuple[int, int] | None = None
        still_since = time.monotonic()
        while True:
            frame = sys._current_frames().get(main) if main is not None else None
            if frame is None:
                return False  # the main thread is gone: the process is exiting
            where = (id(frame.f_code), frame.f_lasti)
            inside_torch = f"{os.sep}torch{os.sep}" in frame.f_code.co_filename
            now = time.monotonic()
            if where != seen or not inside_torch:
                seen, still_since = where, now
            elif now - still_since >= self.stall_s:
                return True
            if self._write_fd == -1:
                return False  # closed meanwhile
            time.sleep(min(0.5, self.stall_s / 4))

    def _stalled(self) -> None:
        logger.warning("SIGTERM: the main thread has been blocked inside torch for %.0f s "
                       "(most likely a collective with a lost or frozen peer); ending the "
                       "process group's collectives so that it can exit", self.stall_s)
        try:
            self._unblock()
        except Exception as exc:  # the guard must reach the exit below whatever happens
            logger.warning("ending the collectives failed: %s", exc)
        if self._main_stuck():
            self._on_stuck(f"SIGTERM: the main thread stayed blocked inside torch for "
                           f"{2 * self.stall_s:.0f} s, even after its collectives were ended; "
                           f"exiting with the transient code before the grace period's SIGKILL")

    def close(self) -> None:
        if self._write_fd == -1:
            return
        try:
            if threading.current_thread() is threading.main_thread() and \
                    signal.set_wakeup_fd(-1) != self._write_fd:
                logger.debug("the wakeup descriptor changed hands while the guard was on")
        except ValueError:
            pass
        os.close(self._write_fd)   # the reader sees end-of-file and stops
        self._write_fd = -1
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        os.close(self._read_fd)
