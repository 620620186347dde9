"""Wait until a host name resolves: on the platform a peer's DNS record can appear after the
peer's code is already running (docs/platform.md).

torch does its own lookup inside TCPStore and, when it fails, keeps retrying until its
timeout and then reports a *socket timeout* (docs/libraries.md): we resolve first, with
tenacity's full-jitter backoff and a deadline, and say "does not resolve" when it is so.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from typing import Any

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_delay,
    wait_random_exponential,
)

from .. import sigterm
from .errors import PrimaryUnreachableError, StopRequestedError

logger = logging.getLogger(__name__)

Resolver = Callable[..., Any]  # the signature of socket.getaddrinfo


def resolve(
    host: str,
    port: int,
    *,
    deadline_s: float,
    what: str = "the primary",
    resolver: Resolver = socket.getaddrinfo,
    max_wait_s: float = 5.0,
    progress_every_s: float = 10.0,
    on_wait: Callable[[], None] | None = None,
) -> str:
    """The first address of ``host``; retries name errors until ``deadline_s`` seconds.

    Logs a line a person can read about every ``progress_every_s``; calls ``on_wait``
    between attempts (a long wait is no hang). Raises PrimaryUnreachableError naming the
    host when it never resolves.
    """
    start = time.monotonic()
    last_log = [start]

    def log_progress(state: RetryCallState) -> None:
        if sigterm.received():   # the peers are being stopped too: leave (exit 134)
            raise StopRequestedError(f"SIGTERM while waiting for {what}'s address {host!r} "
                                     f"to resolve; leaving")
        if on_wait is not None:
            on_wait()
        now = time.monotonic()
        if now - last_log[0] >= progress_every_s:
            last_log[0] = now
            exc = state.outcome.exception() if state.outcome else None
            logger.warning("waiting for %s: %r does not resolve yet (%s), %.0f s of %.0f s",
                           what, host, exc, now - start, deadline_s)

    retrying = Retrying(
        retry=retry_if_exception_type(OSError),  # socket.gaierror is an OSError
        wait=wait_random_exponential(multiplier=0.05, max=max_wait_s),
        stop=stop_after_delay(deadline_s),
        sleep=sigterm.pause,   # a SIGTERM ends the pause at once
        before_sleep=log_progress,
        reraise=True,
    )
    try:
        infos = retrying(resolver, host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise PrimaryUnreachableError(
            f"{what}'s address {host!r} did not resolve within {deadline_s:.0f} s ({exc}). "
            f"Check MASTER_ADDR / CLUSTER_SPEC, or raise the join timeout if the peer's "
            f"DNS record appears late.") from exc
    if not infos:
        raise PrimaryUnreachableError(f"{what}'s address {host!r} resolved to nothing")
    address = str(infos[0][4][0])
    if time.monotonic() - start > 1.0:
        logger.info("%s's address %r resolved to %s after %.1f s", what, host, address,
                    time.monotonic() - start)
    return address
