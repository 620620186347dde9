"""Each rank's heartbeat in the rendezvous store, so that a rank waiting on its peers can
tell a peer that works slowly (a long save, a long upload: it still beats) from one that
stopped (a frozen machine, a SIGSTOP, a host cut off from the network: it beats no more).

The peer watcher thread calls ``beat()`` (one ``add`` on the store) every ``period_s``
and, while the hang watchdog wants to know (its rank waits outside a training step),
``observe()`` (one ``multi_get`` of the peers' counters). A counter is compared with its
own last value on this process's clock, so the machines' clocks never meet. A rank that
leaves on purpose (``leave()``, at shutdown) is never taken for a silent one.

The store itself can be what stopped: its host (the primary) frozen. Then torch's store
client does not time out: a ``get``, ``add`` or ``multi_get`` waits for good (its timeout
only logs "waitForInput ... timed out"). So the group notes when the store last answered
its watcher, and a watcher stuck in a call counts as the store's silence (``quietest``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

LEFT = 1 << 40   # added to a counter by a rank that shut down: it beats no more, on purpose


class OwnPause:
    """Tells, at each round of a polling loop, whether this process did not run since the
    last round for longer than ``bound_s`` (stopped by SIGSTOP, a paused VM): whatever
    silence it sees across that gap is as old as its own pause, not the peer's or the
    store's."""

    def __init__(self, bound_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._bound_s = bound_s
        self._clock = clock
        self._last = clock()

    def paused(self) -> bool:
        now = self._clock()
        gap, self._last = now - self._last, now
        return gap > self._bound_s


class PeerBeats:
    """The heartbeats of one generation of the group, as one rank writes and reads them."""

    def __init__(self, key: Callable[[int], str], rank: int, world_size: int, *,
                 period_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._key = key
        self.rank = rank
        self.period_s = period_s
        self._peers = [r for r in range(world_size) if r != rank]
        self._clock = clock
        self._next_beat = 0.0
        self._next_look = 0.0
        self._created = False
        self._last: dict[int, int] = {}
        self._changed: dict[int, float] = {}
        # (rank, since when on this clock) of the peer silent longest; the watchdog's
        # thread reads it (one attribute: it sees the old pair or the new one).
        self.silent: tuple[int, float] | None = None

    def quietest(self, heard: float) -> tuple[int | None, float] | None:
        """Who has been silent longest while this rank watched, and since when: a peer's
        rank, or None for the store (it last answered the watcher at ``heard``, more than
        two periods ago, and what the peers did since is unknown). None when nothing is
        known yet."""
        if self._clock() - heard > 2 * self.period_s:
            return None, heard
        return self.silent

    def beat(self, store: Any) -> None:
        """This rank is alive: bump its counter, at most once a period."""
        now = self._clock()
        if now >= self._next_beat:
            store.add(self._key(self.rank), 1)
            self._next_beat = now + self.period_s

    def leave(self, store: Any) -> None:
        """This rank stops beating on purpose (it shut down): peers must not wait on it."""
        store.add(self._key(self.rank), LEFT)

    def observe(self, store: Any) -> None:
        """Read the peers' counters (at most once a period) and note who has not moved."""
        now = self._clock()
        if now < self._next_look or not self._peers:
            return
        self._next_look = now + self.period_s
        keys = [self._key(r) for r in self._peers]
        if not self._created and not store.check(keys):
            for key in keys:   # a peer frozen before its first beat: its counter is 0
                store.add(key, 0)
        self._created = True
        values = [int(bytes(v)) for v in store.multi_get(keys)]
        for peer, value in zip(self._peers, values, strict=True):
            if value >= LEFT or self._last.get(peer) != value:
                self._last[peer], self._changed[peer] = value, now
        peer = min(self._peers, key=lambda r: self._changed[r])
        self.silent = (peer, self._changed[peer])

    def stop_observing(self) -> None:
        """The rank trains again: the next ``observe()`` starts every peer's count afresh
        (a peer's silence counts only while this rank waits)."""
        self._last.clear()
        self._changed.clear()
        self._next_look = 0.0
        self.silent = None
