"""The memory limit: a worker whose process tree uses more than its pool's limit is ended
as out of memory, as the platform's container limit ends it.

The supervision loop calls :meth:`MemoryLimit.poll` at each step; :meth:`MemoryLimit.wake`
says how soon it must be called again. A worker over its limit is SIGKILLed with the cause
``oom`` recorded on it (``Worker.injected``), and a FAULT event says what was measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import psutil

from ..observe.events import EventKind
from ..platform.resources import process_tree, tree_pss, tree_rss
from ..platform.rules import Cause
from .processes import TREE_REFRESH_S, Worker

__all__ = ["MemoryLimit"]

# How often an exact (PSS) reading may be taken while the RSS sum is over the limit.
_PSS_REFRESH_S = 1.0


@dataclass
class _Reading:
    """What the last polls learned of one worker's tree."""

    tree: list[psutil.Process] = field(default_factory=list)   # whose memory counts
    tree_at: float = float("-inf")
    pss: int = 0                  # the last exact read
    pss_rss: int = 0              # the RSS sum when it was taken
    pss_at: float = float("-inf")


class MemoryLimit:
    """Each pool's memory limit (bytes per replica; None: no limit), enforced at each poll.

    ``note(kind, message, **fields)`` records an event (the launcher's ``note``)."""

    def __init__(self, limits: Mapping[str, int | None], workers: Mapping[str, Worker],
                 note: Callable[..., None], poll_s: float) -> None:
        self._limits = dict(limits)
        self._workers = workers
        self._note = note
        self._poll_s = poll_s
        self._readings: dict[Worker, _Reading] = {}
        self.active = any(limit is not None for limit in self._limits.values())

    def poll(self, now: float) -> None:
        """End, as out of memory, each worker over its pool's limit."""
        if not self.active:
            return
        if len(self._readings) > len(self._workers):   # forget the lives that are over
            live = set(self._workers.values())
            self._readings = {w: r for w, r in self._readings.items() if w in live}
        for w in self._workers.values():
            limit = self._limits[w.replica.pool]
            if w.injected is not None or limit is None:
                continue
            used = self._tree_memory(w, limit)
            if used > limit:
                self._note(EventKind.FAULT, f"{w.replica.name}: out of memory: "
                           f"{used / 2**20:.0f} MiB > limit {limit / 2**20:.0f} MiB",
                           replica=w.replica.name, fault="oom", cause=Cause.OOM.value,
                           injected=False, counts_as_failure=True)
                w.end(Cause.OOM)

    def wake(self, now: float) -> float | None:
        """Seconds until the next poll is due; None when nothing is measured."""
        return self._poll_s if self.active and self._workers else None

    def _tree_memory(self, w: Worker, limit: int) -> int:
        """Memory of the worker's process tree, each shared page once (resources.tree_pss).

        Finding the tree scans every process on the machine (psutil's ppid map), so it is
        redone at most every TREE_REFRESH_S (the worker process itself is measured at every
        poll). The RSS sum is read at every poll; PSS <= RSS,
        so under the limit that answers. Over it, PSS decides, read afresh when the last
        exact value plus all RSS growth since (a safe estimate) is over the limit too, or
        every _PSS_REFRESH_S: a read costs a page-table walk per process.
        """
        r = self._readings.setdefault(w, _Reading())
        now = time.monotonic()
        if now - r.tree_at >= TREE_REFRESH_S or not r.tree:
            r.tree = process_tree(w.popen.pid)
            r.tree_at = now
        rss = tree_rss(r.tree)
        if rss <= limit:
            return rss
        if now - r.pss_at < _PSS_REFRESH_S:
            estimate = r.pss + max(0, rss - r.pss_rss)
            if estimate <= limit:
                return estimate
        r.pss, r.pss_rss, r.pss_at = tree_pss(r.tree), rss, now
        return r.pss
