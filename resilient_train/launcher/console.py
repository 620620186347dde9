"""A worker's output as the console shows it: whole lines, and progress bars as progress.

A progress bar (tqdm, a ``print(..., end="\\r")`` of the user's own) redraws one line with
carriage returns and ends it with a newline only when it is done. Read by newline, an
epoch's bar reached the console once, at its end, as every update of the epoch run
together on one line. Here a line with carriage returns shows as a terminal would leave it
(its last update), and a bar still drawing shows its latest update every
``PROGRESS_EVERY_S``. The worker's log keeps the bytes as they came.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["PROGRESS_EVERY_S", "ConsoleLines"]

PROGRESS_EVERY_S = 10.0


class ConsoleLines:
    """Feed it a worker's output in chunks as they come; it returns ``(text, whole)``
    pairs to show: ``whole`` for a line (ended by a newline), not for a progress update."""

    def __init__(self, every_s: float = PROGRESS_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._every_s, self._clock = every_s, clock
        self._pending = b""              # the line being written, from its last \r on
        self._shown_at = float("-inf")   # when the last progress update was shown
        self._last = ""                  # that update

    def feed(self, chunk: bytes) -> list[tuple[str, bool]]:
        out: list[tuple[str, bool]] = []
        *lines, self._pending = (self._pending + chunk).split(b"\n")
        for raw in lines:
            out.append((_as_left(raw), True))
            self._shown_at, self._last = float("-inf"), ""   # the next bar starts afresh
        cut = self._pending.rfind(b"\r")
        if cut >= 0:
            # The updates before the last \r are whole; what follows it may still be
            # arriving. A terminal keeps only the last: so does the memory here.
            update = _as_left(self._pending[:cut])
            self._pending = self._pending[cut:]
            now = self._clock()
            if update and update != self._last and now - self._shown_at >= self._every_s:
                out.append((update, False))
                self._shown_at, self._last = now, update
        return out

    def flush(self) -> list[tuple[str, bool]]:
        """At the end of the output: a last line without its newline."""
        rest, self._pending = self._pending, b""
        text = _as_left(rest)
        return [(text, True)] if text else []


def _as_left(raw: bytes) -> str:
    """What a terminal shows of ``raw`` after its carriage returns: the last non-empty
    update (a line ended ``\\r\\n`` is its text)."""
    parts = [p for p in raw.split(b"\r") if p]
    return parts[-1].decode("utf-8", "replace") if parts else ""
