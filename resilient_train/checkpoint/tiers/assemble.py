"""The fast tiers that a manager's options ask for, built in the order they are tried.

The manager receives them as a list (chain.py) and builds none of them itself: the peers'
memory first (where peer recovery is on and there are peers), then the machine's own disk
(where a node-local tier is given). Both ride the ring that carries each rank's own state
to the next rank every step (peers.py), which is connected here, once per life.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..commit.sharded import ShardedCheckpointer
from ..options import CheckpointOptions
from ..schedule.coordination import Coordinator
from .nodelocal import LocalTier, PersistentCadence
from .peers import PeerMemory, PeerRing, connect_ring
from .peertier import PeerTier
from .tier import Tier


@dataclass(frozen=True)
class FastTiers:
    tiers: tuple[Tier, ...]                # fastest first
    ring: PeerRing | None                  # the per-step ring, where one runs
    cadence: PersistentCadence | None      # which saves reach storage too; None: all


def fast_tiers(opts: CheckpointOptions, coord: Coordinator, memory: PeerMemory,
               tracked: Mapping[str, Any], *, url: str, token: str,
               sharded: ShardedCheckpointer, newest: Callable[[], int | None],
               save_point: Callable[[], tuple[tuple[int | None, float], int | None]]
               ) -> FastTiers:
    """A collective (the ring connects). ``url``: the checkpoint directory; ``token``:
    this run's name for its saves in flight; ``newest``: the persistent tier's newest
    committed step; ``save_point``: the save policy's last save point and the newest
    commit, for a hand-over."""
    ring = connect_ring(coord, memory, tracked,
                        wanted=opts.peer_recovery or opts.node_local is not None,
                        undo_torn_steps=opts.undo_torn_steps)
    tiers: list[Tier] = []
    if ring is not None and opts.peer_recovery:
        tiers.append(PeerTier(ring, coord, url, tracked, save_point))
    if opts.node_local is None:
        return FastTiers(tuple(tiers), ring, None)
    local = LocalTier(opts.node_local, coord, token, sharded, url, newest=newest,
                      partner=ring.partner_copy if ring else lambda step: None,
                      ceiling_s=opts.max_interval_s)
    return FastTiers((*tiers, local), ring, local.cadence)
