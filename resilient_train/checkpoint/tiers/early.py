"""A restore's first half, run in a thread while the training code builds its model.

A process starting a life spends seconds importing and building before it can restore
(torch.optim's first optimizer alone imports torch._dynamo: about 1.5-2 s on two cores), and
its peers wait for it meanwhile. A restore from live peers needs only what the processes
hold, not the objects the state goes into: the plan (the ranks agree on it by a collective)
and the transfers. So that half runs in this thread from the moment a life begins, and the
restore joins it and loads (CheckpointManager.start_restore says which restores start
early). Its collectives use the checkpoint manager's own gloo group, which has no other user
until the restore; the training code's collectives use the default group.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from ... import sigterm
from ...distributed.errors import StopRequestedError

T = TypeVar("T")


class Early(Generic[T]):
    """``fetch()`` in a thread, started now; :meth:`result` waits for it."""

    def __init__(self, fetch: Callable[[], T], what: str) -> None:
        self.what = what                 # for the SIGTERM message: "the state of step 7"
        self._fetch = fetch
        self._got: T | None = None
        self._error: BaseException | None = None
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="rt-restore", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            self._got = self._fetch()
        except BaseException as exc:  # noqa: BLE001 - raised again where the restore waits
            self._error = exc
        self.seconds = time.perf_counter() - t0

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s``; whether it is over."""
        self._thread.join(timeout_s)
        return self.done()

    def result(self) -> T:
        """Wait for the fetch; its failure (a peer lost meanwhile) is raised here. After a
        SIGTERM it gets sigterm.STALL_S more, as a main thread blocked in a collective does
        (sigterm.StallGuard, which does not see a wait on a thread): then the life leaves,
        transient, with nothing loaded and so nothing to save."""
        deadline: float | None = None
        while self._thread.is_alive():
            self._thread.join(0.1)
            if deadline is None and sigterm.received():
                deadline = time.monotonic() + sigterm.STALL_S
            if deadline is not None and time.monotonic() >= deadline \
                    and self._thread.is_alive():
                raise StopRequestedError(
                    f"SIGTERM while restoring {self.what}, and it did not end within "
                    f"{sigterm.STALL_S:g} s; leaving")
        if self._error is not None:
            raise self._error
        return self._got  # type: ignore[return-value]   # None is a valid T too
