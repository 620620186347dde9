"""Whether this process was asked to stop (SIGTERM), and a guard for a main thread that
cannot hear it.

The checkpoint manager's handler (an emergency save at the next step boundary) calls
`note()`. Code that waits on peers (re-forming the group, a rendezvous, a barrier) asks
`received()` and leaves instead of waiting for peers that are being stopped too.

Python runs a signal handler only when the main thread next executes bytecode. A main
thread blocked inside torch (a collective whose peer is dead or frozen) never does, or
handles the signal and then blocks in the emergency save's own coordination with the same
peer, or handles it inside a wait on the peer ring (checkpoint/ringlink.py), which goes on
waiting; either way the process sits out the grace period until the SIGKILL, with no report.
`StallGuard` learns of the signal through the wakeup descriptor, which the C-level
handler writes at once, and then watches the main thread: when it stays in one place
inside torch (or in a wait marked `waits_on_peers`) for ``stall_s``, it calls ``unblock``
(the group ends its collectives, which then raise, and the process exits transient); when
it is still stuck ``stall_s`` later, it writes a report with every thread's stack and exits
with the transient code.

A SIGTERM to the whole process group (``timeout``, ``docker stop`` with an init, Slurm's
``scancel``) also kills the DataLoader's worker processes, and torch's SIGCHLD handler then
raises "DataLoader worker ... is killed by signal" in the main thread, at whatever line it
runs: in the middle of ``opt.step()`` as well, where no consistent state can be saved.
`defer_loader_failures` (``ctx.steps`` calls it once torch's handler exists, and a SIGTERM
does) makes it raise only while the main thread is inside the DataLoader (fetching a batch,
before the step changes anything); elsewhere the failure is kept, and ResumableLoader
raises it before its next fetch, so the step stops at a batch or reaches its boundary.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import CodeType, FrameType
from typing import Any, TypeVar

from .frames import current_frames

logger = logging.getLogger(__name__)

# The SIGTERM-to-SIGKILL grace period the worker can count on, in seconds: set by the
# launcher (its --grace), read by the emergency save (checkpoint/emergency.py).
GRACE_ENV = "RESILIENT_TRAIN_SIGTERM_GRACE_S"

_received_at: float | None = None    # time.monotonic() of the first SIGTERM noted
_loader_failure: str | None = None   # a DataLoader worker's death, deferred

# torch's SIGCHLD handler (torch/utils/data/_utils/signal_handling.py) and the module whose
# frames mean "the main thread is fetching a batch".
_TORCH_SIGCHLD_MODULE = "torch.utils.data._utils.signal_handling"
_DATALOADER_FILE = os.path.join("torch", "utils", "data", "dataloader.py")


class _Flag:
    """A flag that a signal handler may set while the thread it interrupts waits on it.

    Not a threading.Event: the handler runs in the main thread between two bytecodes, also
    inside ``Event.wait`` while that holds the Event's (non-reentrant) lock, and its
    ``set()`` would then wait for that lock forever. Here the handler takes no lock: it sets
    a bool and writes a byte to a pipe, and a wait polls the pipe's read end (the
    byte stays there until `clear`, so every waiter, in any thread, sees it)."""

    def __init__(self) -> None:
        self._open()

    def _open(self) -> None:
        self.is_set = False
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def after_fork_in_child(self) -> None:
        # A forked child (a DataLoader worker) has its own signals: a SIGTERM it handles
        # must not wake its parent through the inherited pipe, nor the parent's its.
        for fd in (self._r, self._w):
            os.close(fd)
        self._open()

    def set(self) -> None:
        if self.is_set:
            return
        self.is_set = True
        try:
            os.write(self._w, b"\0")
        except OSError:
            pass   # full (cannot be: one byte until clear) or closed: the bool still says so

    def clear(self) -> None:
        self.is_set = False
        try:
            while os.read(self._r, 64):
                pass
        except OSError:   # BlockingIOError: drained
            pass

    def wait(self, timeout_s: float) -> bool:
        if not self.is_set:
            # A signal interrupts poll(); Python runs its handler and resumes the poll with
            # the time that is left (PEP 475), and the handler's byte then ends it. poll,
            # not select: a descriptor numbered past 1024 is fine.
            poller = select.poll()
            poller.register(self._r, select.POLLIN)
            poller.poll(max(0, math.ceil(timeout_s * 1000)))
        return self.is_set


_received = _Flag()
os.register_at_fork(after_in_child=_received.after_fork_in_child)


def note() -> None:
    """Record a SIGTERM (called from the Python-level handler, so in the main thread)."""
    global _received_at
    if _received_at is None:   # the grace period runs from the first one
        _received_at = time.monotonic()
    _received.set()
    defer_loader_failures()   # from here on, a worker's death raises at a batch only


def received() -> bool:
    return _received.is_set


def since() -> float | None:
    """Seconds since the first SIGTERM was noted (the grace period's clock); None: none."""
    return None if _received_at is None else time.monotonic() - _received_at


def forget() -> None:
    """Forget a noted SIGTERM (tests: the flag is process-wide)."""
    global _received_at
    _received_at = None
    _received.clear()


def wait(timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for a SIGTERM; True once one was received. The Python handler
    runs during the wait (poll is interrupted by signals), so this returns as soon as it
    has run, with no polling."""
    return _received.wait(timeout_s)


def pause(seconds: float) -> None:
    """Sleep ``seconds``, or less: a SIGTERM ends the pause at once (a retry loop's sleep)."""
    _received.wait(seconds)


def take_loader_failure() -> str | None:
    """torch's message for a DataLoader worker that died while the main thread was not
    fetching a batch (deferred: see `defer_loader_failures`), once; else None."""
    global _loader_failure
    failure, _loader_failure = _loader_failure, None
    return failure


def is_data_loading(code: CodeType) -> bool:
    """Whether ``code`` is the DataLoader iterator's (torch/utils/data/dataloader.py)."""
    return code.co_filename.endswith(_DATALOADER_FILE)


def in_data_loading(frame: FrameType | None) -> bool:
    """Whether ``frame`` (or a caller of it) is inside a DataLoader iterator: the point where
    a training step fetches its batch, before it changes the model."""
    while frame is not None:
        if is_data_loading(frame.f_code):
            return True
        frame = frame.f_back
    return False


def defer_loader_failures() -> bool:
    """Wrap torch's SIGCHLD handler, once a multi-process DataLoader has installed it, so
    that a worker's death raises only inside the DataLoader (fetching a batch, before the
    step changes anything) and is kept for `take_loader_failure` elsewhere. Main thread
    only. False while there is nothing to wrap yet (call again later); True once done, or
    when the handler is someone else's (left alone)."""
    if threading.current_thread() is not threading.main_thread():
        return False   # signal.signal works in the main thread only (the handler runs there)
    torch_handler = signal.getsignal(signal.SIGCHLD)
    module = getattr(torch_handler, "__module__", None)
    if module != _TORCH_SIGCHLD_MODULE:
        # Wrapped already, or a handler of the program's own (True), or none yet (False).
        return callable(torch_handler)
    assert callable(torch_handler)

    def deferring(signum: int, frame: FrameType | None) -> None:
        global _loader_failure
        if in_data_loading(frame):
            torch_handler(signum, frame)   # raises if a worker died: at a safe point
            return
        try:
            torch_handler(signum, frame)   # also chains to the handler torch replaced
        except RuntimeError as exc:
            _loader_failure = str(exc)

    signal.signal(signal.SIGCHLD, deferring)
    return True


def quiet_loader_failures() -> Callable[[], None]:
    """No "DataLoader worker ... is killed" from torch's SIGCHLD handler from now on (main
    thread only): the first one was caught, and the other workers' deaths must not raise
    again in the emergency save that follows, nor in the exit after it. Returns the undo."""
    previous = signal.getsignal(signal.SIGCHLD)
    # SIG_DFL, not SIG_IGN: ignoring SIGCHLD would reap every child, also the ones that
    # subprocess and multiprocessing wait for.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)

    def undo() -> None:
        if previous is not None and signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL:
            signal.signal(signal.SIGCHLD, previous)

    return undo


@contextlib.contextmanager
def noted(enabled: bool = True) -> Iterator[None]:
    """Note SIGTERM meanwhile (main thread; elsewhere, or not ``enabled``: nothing changes).

    ``@rt.main`` holds this for the whole run: before its checkpoint manager exists (forming
    the process group) and between two lives (re-forming it), a SIGTERM then makes the waits
    for peers leave with exit 134 instead of killing the process outright or, under a
    handler of the previous life, being ignored."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        note()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is on_sigterm:   # not if someone took it over
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


@contextlib.contextmanager
def ctrl_c_saves(enabled: bool = True) -> Iterator[None]:
    """A run on its own at a terminal (``python train.py``): the first Ctrl-C asks for what
    a SIGTERM asks (an emergency checkpoint at the end of the step, then exit 134), so that
    a run stopped by hand loses no step; a second one stops at once, as Ctrl-C does
    without this (KeyboardInterrupt). Main thread only; elsewhere nothing changes."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return
    pressed = 0

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        nonlocal pressed
        pressed += 1
        if pressed > 1:
            raise KeyboardInterrupt
        logger.warning("Ctrl-C: saving a checkpoint at the end of this step, then stopping "
                       "(Ctrl-C again to stop at once)")
        os.kill(os.getpid(), signal.SIGTERM)   # the one path of a stop: the SIGTERM's

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is on_sigint:   # not if someone took it over
            signal.signal(signal.SIGINT, previous)


# How long a wait that cannot end by itself (a collective whose peer may be frozen) may go
# on after a SIGTERM before the process stops waiting and leaves.
STALL_S = 5.0


# This package's own blocking waits on a peer outside torch (the peer ring's read): a main
# thread held in one is held as surely as in a collective, and the same severing of the
# group's connections ends both.
_PEER_WAITS: set[CodeType] = set()

_F = TypeVar("_F", bound=Callable[..., Any])


def waits_on_peers(fn: _F) -> _F:
    """Mark ``fn`` as a blocking wait on peers that :func:`main_stuck_in_torch` counts as
    inside torch (a Python handler runs during it, but the wait goes on)."""
    _PEER_WAITS.add(fn.__code__)
    return fn


def main_stuck_in_torch(stall_s: float, watching: Callable[[], bool]) -> bool:
    """Whether the main thread stays at one instruction inside torch (or in a wait marked
    :func:`waits_on_peers`) for ``stall_s``. Polled, so a thread that moves on is never
    taken for a stuck one; False once the main thread is gone or ``watching()`` turns
    False."""
    main = threading.main_thread().ident
    seen: tuple[int, int] | None = None
    still_since = time.monotonic()
    while True:
        frame = current_frames().get(main) if main is not None else None
        if frame is None:
            return False  # the main thread is gone: the process is exiting
        where = (id(frame.f_code), frame.f_lasti)
        held = f"{os.sep}torch{os.sep}" in frame.f_code.co_filename or \
            frame.f_code in _PEER_WAITS
        now = time.monotonic()
        if where != seen or not held:
            seen, still_since = where, now
        elif now - still_since >= stall_s:
            return True
        if not watching():
            return False
        time.sleep(min(0.5, stall_s / 4))


class StallGuard:
    """Reacts to a SIGTERM that the main thread does not handle within ``stall_s``."""

    def __init__(self, unblock: Callable[[], None], on_stuck: Callable[[str], None], *,
                 stall_s: float = STALL_S) -> None:
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
            if not data or self._write_fd == -1:
                return   # closed
            if signal.SIGTERM in data and self._main_stuck():
                self._stalled()

    def _main_stuck(self) -> bool:
        return main_stuck_in_torch(self.stall_s, lambda: self._write_fd != -1)

    def _stalled(self) -> None:
        logger.warning("SIGTERM: the main thread has been blocked inside torch (or on the "
                       "peer ring) for %.0f s (most likely a collective with a lost or frozen "
                       "peer); ending the process group's collectives so that it can exit",
                       self.stall_s)
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
        # A byte, not only end-of-file, wakes the reader: forked DataLoader workers hold
        # copies of the write end, so closing ours would not end its read.
        fd, self._write_fd = self._write_fd, -1
        try:
            os.write(fd, b"\0")
        except OSError:
            pass
        os.close(fd)
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        os.close(self._read_fd)
