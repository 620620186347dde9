"""A line now and then while a long transfer runs (a restore of tens of GB from Cloud
Storage takes minutes): nothing for a short one, then every so often how much has moved,
of how much, and how fast, from a counter the transfer keeps (``Storage.bytes_moved``, or
the Progress's own, which the transfer adds to)."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from types import TracebackType

from .storage.base import format_bytes

__all__ = ["Progress"]

logger = logging.getLogger(__name__)

# A transfer says how far it has got once it has taken this long, and again this often:
# silence for the minutes of a large one reads as a hang.
AFTER_S = EVERY_S = 15.0


class Progress:
    """``with Progress("restoring step 30 from gs://b/ckpt", moved, total=n):`` logs,
    from a thread, ``restoring step 30 from gs://b/ckpt: 4.1 GiB of 12.0 GiB (34%, 210
    MiB/s)`` ``after_s`` into the work and every ``every_s`` after, and one closing line
    where it logged any. ``moved()`` is a running count of bytes (its value at the start
    is the zero; None: the count that :meth:`add` keeps); ``total`` may be set once known.
    ``after_s`` and ``every_s`` default to :data:`AFTER_S` and :data:`EVERY_S`."""

    def __init__(self, what: str, moved: Callable[[], int] | None = None, *,
                 total: int | None = None, since: tuple[int, float] | None = None,
                 after_s: float | None = None, every_s: float | None = None,
                 log: logging.Logger = logger) -> None:
        """``since``: (the count, ``time.monotonic()``) where the work began, for a wait on
        work already under way (a save in flight); else the start of the ``with``. The
        first line comes ``after_s`` after it."""
        self.what, self.total = what, total
        self._count = 0
        self._moved = moved if moved is not None else (lambda: self._count)
        self._after_s = AFTER_S if after_s is None else after_s
        self._every_s = EVERY_S if every_s is None else every_s
        self._log = log
        self._since = since
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._base, self._t0, self._lines = 0, 0.0, 0

    def __enter__(self) -> Progress:
        self._base, self._t0 = self._since or (self._moved(), time.monotonic())
        if self._after_s != math.inf:   # inf: a rank that leaves the telling to another
            self._thread = threading.Thread(target=self._run, name="rt-progress",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._lines and kind is None:
            seconds = time.monotonic() - self._t0
            done = self.done()
            self._log.info("%s: done, %s in %.0f s (%s/s)", self.what, format_bytes(done),
                           seconds, format_bytes(done / max(seconds, 1e-9)))

    def add(self, nbytes: int) -> None:
        """``nbytes`` more have moved (a Progress built without ``moved``)."""
        self._count += nbytes

    def done(self) -> int:
        """Bytes moved since the start."""
        return self._moved() - self._base

    def line(self) -> str:
        """What has moved so far, for a person."""
        done, seconds = self.done(), time.monotonic() - self._t0
        rate = f"{format_bytes(done / max(seconds, 1e-9))}/s"
        if self.total:
            return (f"{self.what}: {format_bytes(done)} of {format_bytes(self.total)} "
                    f"({min(100.0, 100 * done / self.total):.0f}%, {rate})")
        return f"{self.what}: {format_bytes(done)} so far ({rate})"

    def _run(self) -> None:
        wait = max(0.0, self._after_s - (time.monotonic() - self._t0))   # from the start
        while not self._stop.wait(wait):
            self._log.info("%s", self.line())
            self._lines += 1
            wait = self._every_s
