"""Ending every gloo collective of this process at once, from any thread.

gloo has no working abort (``ProcessGroupGloo.abort()`` returns at once and leaves a
blocked collective blocked), and a collective only fails when one of *its* sockets fails.
When a peer dies, the ranks that exchange data with it directly get an error from the
kernel; a rank whose current exchange is with another survivor (two ranks away from the
dead one, from four ranks on) keeps waiting for data that survivor will never send, until
the collective timeout (10 minutes), and its group's destructor waits with it.

So a survivor that learns its generation is over shuts down (``shutdown(SHUT_RDWR)``, not
``close``: gloo still owns the descriptors) every gloo connection it *accepted*. Each pair
of a gloo mesh has exactly one accepting side, and every survivor severs, so every
connection among survivors goes down from one end or the other; the blocked reads and
writes fail with gloo's "Connection closed by peer", which every layer above already
treats as a lost peer. The dead peer's own connections were closed by the kernel.

A survivor can only sever its own end; a peer that is frozen (stopped, or wedged in a
driver) severs nothing, and the connections that *it* accepted stay up. For a process
that is leaving anyway (SIGTERM, sigterm.py) ``outgoing=True`` also shuts down every
connection this process opened since the baseline, except the rendezvous store's.

A gloo listener is told apart from the process's other listeners by three facts: it
appeared after the group was constructed (``Baseline``), it is bound to one interface
address (gloo never binds the wildcard; a user's HTTP or metrics server usually does),
and it is not one of the ports the rendezvous itself serves (``exclude_ports``).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

_WILDCARD = frozenset({"0.0.0.0", "::", ""})

# (fd, address, port) of a listening socket: the same triple later is the same socket.
_Listener = tuple[int, str, int]


@dataclass(frozen=True)
class Baseline:
    """The sockets this process had before its process groups existed."""

    listeners: frozenset[_Listener]
    connections: frozenset[tuple[int, str, int]] = frozenset()  # (fd, remote, remote port)

    @classmethod
    def now(cls) -> Baseline:
        conns = _connections()
        return cls(frozenset(_listeners(conns)),
                   frozenset((c.fd, c.raddr.ip, c.raddr.port) for c in conns if c.raddr))


def own_tcp_connections() -> list[Any]:
    """This process's TCP sockets, listeners included (psutil; raises its errors)."""
    import psutil

    proc = psutil.Process()
    list_them = getattr(proc, "net_connections", None) or proc.connections  # psutil < 6
    return list(list_them(kind="tcp"))   # IPv6 too: TCPStore clients can be IPv6 sockets


def _connections() -> list[Any]:
    import psutil

    try:
        return own_tcp_connections()
    except (psutil.Error, OSError) as exc:  # never fail a recovery over the inventory
        logger.debug("cannot list this process's sockets: %s", exc)
        return []


def _listeners(conns: list[Any] | None = None) -> list[_Listener]:
    return [(c.fd, c.laddr.ip, c.laddr.port) for c in (_connections() if conns is None else conns)
            if c.status == "LISTEN" and c.laddr]


def gloo_listen_ports(baseline: Baseline, exclude_ports: frozenset[int] = frozenset(),
                      conns: list[Any] | None = None) -> set[int]:
    """The ports of this process's listeners that are gloo's (see the module's doc)."""
    return {port for fd, ip, port in _listeners(conns)
            if (fd, ip, port) not in baseline.listeners and ip not in _WILDCARD
            and port not in exclude_ports}


def sever_gloo(baseline: Baseline, exclude_ports: frozenset[int] = frozenset(), *,
               outgoing: bool = False) -> int:
    """Shut down every connection that this process's gloo listeners accepted (and, with
    ``outgoing``, every other one opened since ``baseline`` that is not to or from one of
    ``exclude_ports``); returns how many. Safe from any thread, and idempotent."""
    conns = _connections()
    ports = gloo_listen_ports(baseline, exclude_ports, conns)
    severed = 0
    for c in conns:
        if c.status != "ESTABLISHED" or not c.laddr:
            continue
        accepted = c.laddr.port in ports
        opened = (outgoing and c.raddr and (c.fd, c.raddr.ip, c.raddr.port)
                  not in baseline.connections and c.raddr.port not in exclude_ports
                  and c.laddr.port not in exclude_ports)
        if not (accepted or opened):
            continue
        try:
            # A duplicate descriptor: shutdown acts on the connection, and closing the
            # duplicate leaves gloo's own descriptor (and its number) untouched.
            dup = socket.socket(fileno=os.dup(c.fd))
        except OSError:
            continue  # closed meanwhile
        try:
            dup.shutdown(socket.SHUT_RDWR)
            severed += 1
        except OSError:
            pass  # already down
        finally:
            dup.close()
    return severed
