"""The manager's tiers in order, fastest first: the one place that order is used.

A save goes to every tier that takes it, fastest first (the node-local copy is what a
restart in place reads); one that no tier on a disk takes also goes to the persistent
tier, whatever the cadence, since memory alone does not outlive the job. A restore takes
the first tier that can give every rank the same step; each faster one says why not, and
the reasons travel with the restore's record. The persistent tier is last and always
serves: its newest step that verifies, or a fresh start.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from .early import Early
from .restored import Restored
from .tier import SaveRequest, Tier


class TierChain:
    """Tiers, fastest first; the last is the persistent one."""

    def __init__(self, tiers: Sequence[Tier]) -> None:
        self.tiers = tuple(tiers)
        self.kept: dict[str, int] = {}   # each tier's last step kept

    def has(self, name: str) -> bool:
        return any(t.name == name for t in self.tiers)

    def taking(self, save: SaveRequest) -> tuple[SaveRequest, list[Tier]]:
        """``save`` as it goes (to the persistent tier too where no disk takes it), and
        the tiers that take it."""
        if not any(t.takes(save) for t in self.tiers[:-1] if t.storage is not None):
            save = replace(save, persistent=True)
        return save, [t for t in self.tiers if t.takes(save)]

    def write(self, save: SaveRequest, snap: dict[str, Any], tiers: list[Tier],
              ready: Callable[[], None], wrote: Callable[[str, float | None], None]) -> None:
        """Writer thread: each of ``tiers`` in turn. A tier that tolerates its own failure
        (a machine's disk: it warns) returns False, and ``wrote`` hears None: the
        persistent tier then takes every save until the failing tier works again."""
        for tier in tiers:
            t0 = time.perf_counter()
            ok = tier.write(save, snap, ready)
            wrote(tier.name, time.perf_counter() - t0 if ok else None)
            if ok:
                self.kept[tier.name] = save.step

    def begin_restore(self) -> Early[Restored] | None:
        """The first tier's restore that can start before the model is built, started."""
        for tier in self.tiers:
            early = tier.begin_restore()
            if early is not None:
                return early
        return None

    def restore(self, sharded: bool) -> Restored:
        """A collective: from the first tier that can serve every rank."""
        reason = ""
        for tier in self.tiers:
            got = tier.restore(sharded)
            if isinstance(got, Restored):
                return replace(got, record=replace(got.record, reason=reason))
            reason = f"{reason}; {got}" if reason else got
        raise AssertionError("the persistent tier, last, restores or raises")

    def restored(self, got: Restored) -> None:
        for tier in self.tiers:
            tier.restored(got)

    def hand_over(self, step: int) -> None:
        for tier in self.tiers:
            tier.hand_over(step)

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
