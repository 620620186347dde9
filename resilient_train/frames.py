"""Every thread's current frame, without CPython 3.11's deadlock."""

from __future__ import annotations

import gc
import sys
from types import FrameType


def current_frames() -> dict[int, FrameType]:
    """``sys._current_frames()`` with the garbage collector held off. Before CPython 3.12
    (gh-106883) a collection that starts inside it, while it holds the interpreter's lock
    on the list of threads, can run a finalizer that waits for that same lock, with the GIL
    held: the whole process stops. A test's polling loop hit it once in this project's
    suite; the watchers here (sigterm.main_stuck_in_torch, the hang report) poll the same
    way."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return sys._current_frames()
    finally:
        if enabled:
            gc.enable()
