"""What can go wrong while the process group forms or runs; each message names the fix."""

from __future__ import annotations

from ..errors import PermanentError, TransientError


class RendezvousTimeoutError(TransientError):
    """Some ranks never arrived before the deadline; the message names them.

    Transient: on the platform a worker that is late (no capacity, slow image pull) usually
    arrives on a retry, and a retried job gets a fresh deadline.
    """

    def __init__(self, message: str, missing: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.missing = missing


class BarrierTimeoutError(RendezvousTimeoutError):
    """A barrier's deadline passed; the message names the ranks that never reached it."""


class PrimaryUnreachableError(RendezvousTimeoutError):
    """The primary's address never resolved or never accepted a connection."""


class PeerRestartedError(TransientError):
    """A peer restarted (or the primary's store went away): this generation is over."""

    def __init__(self, message: str, generation: int) -> None:
        super().__init__(message)
        self.generation = generation


class StopRequestedError(TransientError):
    """SIGTERM arrived while this process waited for its peers (to form the group, at a
    barrier): it leaves instead of waiting for peers that are being stopped too, so the
    grace period is not spent waiting. Transient: the platform restarts or retries."""

    one_line_exit = True   # being stopped is no crash: one line, no traceback in the log


class DistributedConfigError(PermanentError, ValueError):
    """A setting that can never work (bad backend, rank outside the world...)."""
