"""DataLoader workers that never start: a fork that deadlocked in the child.

CPython 3.11 and older (gh-112275; fixed in 3.12 and in 3.11's late patch releases) can
deadlock a forked child in its after-fork code, when another thread of the parent held
the interpreter's thread-list lock at the moment of the fork (a C++ thread entering
Python takes it without the GIL). A DataLoader
worker forked then never runs a line: the loader waits for its batch forever, and so does
the job (seen here: a 2-worker train_charlm.py run sat 600 s in gloo, then for good).

The watch: each worker marks its start in shared memory (a wrapper of ``worker_init_fn``),
and a worker still unmarked ``FORK_START_S`` after its iterator forked it is killed. The
loader's fetch then fails at once (torch's SIGCHLD handler), and ResumableLoader starts its
workers again from the same position. Only for the fork start method: a spawned worker is
a fresh interpreter, and may legitimately take long to unpickle its dataset.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

# From fork to worker_init_fn is milliseconds; minutes only for a child that never runs.
FORK_START_S = 60.0
_POLL_S = 0.05


def forks(multiprocessing_context: Any) -> bool:
    """Whether a DataLoader with this ``multiprocessing_context`` forks its workers."""
    if multiprocessing_context is None:
        # Not get_start_method(allow_none=False): it would fix the default for good, and a
        # later set_start_method() of the program's would fail.
        method = multiprocessing.get_start_method(allow_none=True)
        return (method or multiprocessing.get_all_start_methods()[0]) == "fork"
    if isinstance(multiprocessing_context, str):
        return multiprocessing_context == "fork"
    return bool(multiprocessing_context.get_start_method() == "fork")


class StartMarks:
    """``worker_init_fn`` for a forking DataLoader: marks the worker started (a byte per
    worker in memory shared with the parent), then calls the user's own."""

    def __init__(self, num_workers: int, user_init: Callable[[int], Any] | None) -> None:
        self._flags = multiprocessing.get_context("fork").RawArray("b", num_workers)
        self.user_init = user_init

    def __call__(self, worker_id: int) -> None:
        self._flags[worker_id] = 1
        if self.user_init is not None:
            self.user_init(worker_id)

    def reset(self) -> None:
        for i in range(len(self._flags)):
            self._flags[i] = 0

    def started(self, worker_id: int) -> bool:
        return bool(self._flags[worker_id])


class StartWatch:
    """Kills the workers of ``iterator`` that are not marked started within ``FORK_START_S``
    (a thread; ``killed`` lists their pids once it has)."""

    def __init__(self, iterator: Any, marks: StartMarks) -> None:
        self.killed: list[int] = []
        self._workers = list(getattr(iterator, "_workers", ()))  # torch's, private
        self._marks = marks
        self._deadline = time.monotonic() + FORK_START_S
        if self._workers:
            threading.Thread(target=self._run, name="rt-loader-start-watch",
                             daemon=True).start()

    def _run(self) -> None:
        # Only the marks until the deadline: is_alive() reaps, and torch's own checks of
        # its workers should see their exits first.
        while not all(self._marks.started(i) for i in range(len(self._workers))):
            if time.monotonic() >= self._deadline:
                break
            time.sleep(_POLL_S)
        for i, worker in enumerate(self._workers):
            if self._marks.started(i) or not worker.is_alive():
                continue
            log.warning(
                "DataLoader worker %d (pid %d) has not started %g s after it was forked: a "
                "fork that deadlocked in the child (CPython gh-112275, Python 3.11 and older); "
                "killing it and starting the loader's workers again",
                i, worker.pid, FORK_START_S)
            self.killed.append(worker.pid)
            try:
                os.kill(worker.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
