"""Distributed init that survives parallel start, peer restarts and hangs."""

from .errors import (
    BarrierTimeoutError,
    DistributedConfigError,
    PeerRestartedError,
    PrimaryUnreachableError,
    RendezvousTimeoutError,
    StopRequestedError,
)
from .group import DistributedGroup, DistributedOptions, init_distributed, is_peer_failure
from .hang import HangWatchdog

__all__ = [
    "BarrierTimeoutError", "DistributedConfigError", "DistributedGroup", "DistributedOptions",
    "HangWatchdog", "PeerRestartedError", "PrimaryUnreachableError", "RendezvousTimeoutError",
    "StopRequestedError",
    "init_distributed", "is_peer_failure",
]
