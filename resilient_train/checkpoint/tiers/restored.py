"""What every recovery tier gives the manager: a restore's record and the state it restored.

A tier is a place a step can be restored from: the live peers' memory (peers.py,
shards.py), the machines' own disks (nodelocal.py), the persistent checkpoint directory
(persistent.py). Each restore ends in a :class:`Restored`, which the manager loads into the
tracked objects the same way whatever the tier, and a :class:`RestoreRecord`, the job
record's unit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# The tiers' names, fastest first: the keys of a restore's bytes read per tier.
TIERS = ("peer", "node-local", "persistent")


@dataclass(frozen=True)
class RestoreRecord:
    """Where this rank's state came from at the start of a life: the job record's unit."""

    step: int                      # 0: a fresh start
    source: str                    # "peer", "node-local", "persistent" or "none"
    seconds: float
    bytes_read: Mapping[str, int]  # per tier: "peer", "node-local", "persistent"
    from_rank: int | None = None   # peer, node-local: who sent the replicated state
    reason: str = ""               # why a faster tier was not used
    where: str = ""                # persistent, node-local: the directory's URL

    def describe(self) -> str:
        """Where the state came from, for a person: "rank 0's memory", a URL."""
        if self.source == "peer":
            return "its own memory" if self.from_rank is None else \
                f"rank {self.from_rank}'s memory"
        if self.source == "node-local" and self.from_rank is not None:
            return f"rank {self.from_rank}'s node-local disk"
        return self.where or self.source


def bytes_read(**per_tier: int) -> dict[str, int]:
    """A record's bytes per tier, every tier named (``node_local=`` for "node-local")."""
    return {tier: int(per_tier.get(tier.replace("-", "_"), 0)) for tier in TIERS}


@dataclass(frozen=True)
class Restored:
    """What a tier's restore gives this rank to load."""

    record: RestoreRecord               # lacks only the restore's seconds
    step: int | None                    # None: nothing to restore (a fresh start)
    shared: dict[str, Any] | None       # the replicated state; None: ``load`` puts it
    mine: dict[str, Any]                # this rank's RNG streams, values, buffers
    last_commit: int | None             # the persistent tier's newest committed step
    save_point: tuple[int | None, float]   # (step, time) the save policy counts from
    # Puts what ``shared`` cannot carry (a sharded model's DCP state) into the tracked
    # objects, or takes the restored step as its own (the peers' memory), given them and
    # ``strict``; None: nothing.
    load: Callable[[Mapping[str, Any], bool], None] | None = None
    message: str = ""                   # the log line that says where it came from
    name: str = ""                      # the step's directory in its tier, where it has one
    # Saves since the last one that reached the persistent tier (the node-local cadence
    # counts on from it, alike on every rank).
    since_persistent: int = 0
