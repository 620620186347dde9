"""Pick a free TCP port for a rendezvous store, outside the kernel's ephemeral range.

A client that retries connecting to a local port in the ephemeral range (32768-60999 on
Linux) before anything listens there can be handed that same port as its own source port:
TCP's simultaneous open then connects the socket *to itself*, and the client waits on its
own echo while the real server starts next to it. Ports the kernel never hands out as
source ports cannot meet this, which is why fixed rendezvous ports (29500) are safe and an
OS-assigned one (bind to port 0) is not.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOW, HIGH = 20000, 32000  # below Linux's default ephemeral range


def ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A port that is free now and outside the ephemeral range (when there is room)."""
    eph_low, eph_high = ephemeral_range()
    candidates = [p for p in range(LOW, HIGH) if not eph_low <= p <= eph_high]
    for port in random.sample(candidates, min(attempts, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # crowded host: any port
        s.bind((host, 0))
        return int(s.getsockname()[1])
