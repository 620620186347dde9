"""Copy a child process's output to ours in whole lines.

Several processes writing to one pipe mix their output mid-line when a line reaches the
pipe in more than one write: ``print`` writes its text and its newline apart when the
output is unbuffered (``PYTHONUNBUFFERED=1``, common in training images), so one rank's
"resumed from step 31" ran on into another's. A relay reads the child's pipe and writes
what it got up to the last line end (``\\n``, or a progress bar's ``\\r``) in one write,
holding back a line's unfinished rest until it ends. One lock per destination makes the
writes of every relay to it whole.
"""

from __future__ import annotations

import os
import threading
from typing import BinaryIO

_CHUNK = 1 << 16
_HOLD_LIMIT = 1 << 20   # a "line" this long without an end goes out as it is


class LineRelay:
    """A thread copying ``fd`` (a pipe's read end, which it closes at the end) to
    ``out`` in whole lines, under ``lock``."""

    def __init__(self, fd: int, out: BinaryIO, lock: threading.Lock, name: str) -> None:
        self._fd, self._out, self._lock = fd, out, lock
        self._broken = False   # our output is gone: read on (the child must not block)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        """Wait for the end of the child's output (a grandchild that kept the pipe open can
        hold it: at most ``timeout`` seconds)."""
        self._thread.join(timeout)

    def _run(self) -> None:
        held = b""
        try:
            while chunk := os.read(self._fd, _CHUNK):
                held += chunk
                end = max(held.rfind(b"\n"), held.rfind(b"\r")) + 1
                if end == 0 and len(held) < _HOLD_LIMIT:
                    continue
                self._write(held[:end] if end else held)
                held = held[end:] if end else b""
        except OSError:
            pass   # the pipe failed: nothing more will come
        finally:
            if held:
                self._write(held)
            os.close(self._fd)

    def _write(self, data: bytes) -> None:
        if self._broken:
            return
        with self._lock:
            try:
                self._out.write(data)
                self._out.flush()
            except (OSError, ValueError):   # closed, or a broken pipe: drop from now on
                self._broken = True
