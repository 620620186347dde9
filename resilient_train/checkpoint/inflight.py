"""The one save in flight: its writer thread, its failure kept for the next call, its
progress lines.

One save is in flight at a time (its host buffers are reused by the next). A failure on
the writer thread is never lost: it is kept here and raised by the next call of the
training thread, as a retryable error where its cause is (a storage outage, a lost peer),
permanent otherwise (a bug).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from ..errors import Classification, classify_exception
from .commit.manifest import CheckpointError
from .commit.stepwriter import WriterThread
from .errors import TransientCheckpointError
from .progress import Progress
from .schedule.emergency import remaining
from .state.capture import tree_nbytes
from .storage.base import Storage

log = logging.getLogger("resilient_train.checkpoint.manager")   # the manager's lines


class SaveInFlight:
    """The writer thread and the save it runs."""

    def __init__(self, is_primary: bool) -> None:
        self._is_primary = is_primary
        self._thread = WriterThread("rt-ckpt-writer")
        self.future: Future[None] | None = None
        self.error: BaseException | None = None
        self._started = (0, time.monotonic())   # the save's start: bytes moved, time
        self._to: list[Storage] = []             # ... the tiers' storage it writes
        self._tree: Any = None                    # ... what it writes to each (progress)
        self._what = ""                           # ... "saving step 7 to <urls>"

    def begin(self, step: int, to: list[Storage], tree: Any) -> None:
        """A save of ``step`` starts, writing ``tree`` (None: its size is not ours to
        know, a sharded save's) to each of ``to``."""
        self._to, self._tree = to, tree
        self._started = (self._moved(), time.monotonic())
        self._what = f"saving step {step} to {' and '.join(st.url for st in to)}"

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn`` on the writer thread: the save in flight from now."""
        self.future = self._thread.submit(fn, *args)

    def failed(self, exc: BaseException) -> None:
        """Writer thread: keep the first failure for the training thread."""
        self.error = self.error or exc

    def check(self) -> None:
        """Raise the failure of a save, keeping its cause's class: a save lost to a
        storage outage or a dead peer is worth a retry (exit 134), one that failed on a
        bug is not (exit 1)."""
        err, self.error = self.error, None
        if err is None:
            return
        transient = classify_exception(err) is Classification.TRANSIENT
        cls = TransientCheckpointError if transient else CheckpointError
        raise cls(f"a background checkpoint save failed: {err}") from err

    def wait(self) -> None:
        """Block until the save in flight is done; raise its failure."""
        fut, self.future = self.future, None
        if fut is not None:
            # The writer's jobs never raise: their failures land in self.error.
            with contextlib.nullcontext() if fut.done() else self.progress():
                fut.result()
        self.check()

    def finished_by(self, deadline: float) -> bool:
        """Whether the save in flight is done by ``deadline`` (monotonic)."""
        fut = self.future
        if fut is None:
            return True
        try:
            fut.result(timeout=remaining(deadline))
        except FutureTimeout:
            return False
        return True

    def abandon(self) -> threading.Thread | None:
        """Leave the save in flight to the exit (a daemon thread; what it writes is never
        committed) and start a new writer; returns the one left behind."""
        left = self._thread.abandon()
        self._thread = WriterThread("rt-ckpt-writer")
        self.future = None
        return left

    def shutdown(self) -> None:
        self._thread.shutdown()

    def _moved(self) -> int:
        """Bytes the save's tiers have written, in all (what its progress counts)."""
        return sum(st.bytes_moved for st in self._to)

    def progress(self) -> Progress:
        """Lines on the primary while the loop waits for a long write (the final save of
        tens of GB, a save that the next one waits for), counted from the save's start."""
        tree = self._tree if self._is_primary else None
        # What goes into the primary's files (the replicated state and its rank's) in each
        # tier, less their headers.
        total = tree_nbytes(tree) * len(self._to) if tree is not None else None
        return Progress(self._what or "saving", self._moved, total=total,
                        since=self._started, after_s=None if self._is_primary else math.inf,
                        log=log)
