"""The peer tier: a restore from the live ranks' memory, behind the one tier interface.

What the ranks keep and how it moves every step is peers.py (replicated state handed over
at a life's end, each rank's own state on two ranks of the ring) and shards.py (a sharded
save's shards, each also in the next rank's memory). This module is the tier: a restore by
the plan all ranks compute from their reports (plan.py), run early where it can be (while
the model is built: early.py), the hand-over at a life's end, and a sharded save's copies.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..schedule.coordination import Coordinator
from ..state.capture import collect, has_dtensor
from ..storage.base import format_bytes
from ..transport.channel import GroupTransport
from . import shards as shard_copies
from .early import Early
from .peers import PeerRing
from .plan import Plan, carry_out, plan
from .restored import Restored, RestoreRecord, bytes_read
from .tier import SaveRequest, TierDefaults

log = logging.getLogger(__name__)


class _Sharded(Exception):
    """Raised inside a hand-over: the state holds DTensors (shards.py restores it)."""


class PeerTier(TierDefaults):
    """The survivors' memory: restored from, with no storage read, after a peer's loss."""

    name = "peer"

    def __init__(self, ring: PeerRing, coord: Coordinator, url: str,
                 tracked: Mapping[str, Any],
                 save_point: Callable[[], tuple[tuple[int | None, float], int | None]]
                 ) -> None:
        self.ring, self.coord = ring, coord
        self.rank = coord.rank
        self.url = url   # the checkpoint directory: a sharded save's copies name it
        self._tracked = tracked
        # The save policy's last save point and the persistent tier's newest commit, as
        # the life ends: the next life counts on from them.
        self._save_point = save_point

    # --- saving: a sharded save's copies (a replicated save needs none: peers.py) ----------

    def takes(self, save: SaveRequest) -> bool:
        return save.sharded

    def needs_shared(self, save: SaveRequest) -> bool:
        return True   # the neighbour's copy holds the replicated part too

    def write(self, save: SaveRequest, snap: dict[str, Any],
              ready: Callable[[], None]) -> bool:
        """Writer thread: this rank's shard to the next rank's memory, the previous rank's
        into ours (shards.py); the older save's copies are dropped once every rank holds
        these."""
        t0 = time.perf_counter()
        own = shard_copies.pack(snap["dcp"].dcp_state, snap["shared"], snap["rank"])
        link = self.ring.link
        got = GroupTransport(getattr(self.coord, "writer_group", None)).exchange(
            own, link.next, link.prev)
        saved_at = self._save_point()[0][1]   # this save's, on the policy's agreed clock
        shard_copies.keep(self.ring.memory, self.url, save.step, own, got, link.prev, saved_at)
        self.coord.writer_barrier()
        shard_copies.confirm(self.ring.memory, save.step)
        log.debug("step %d: shard copies exchanged (%s out, %s in) in %.2f s", save.step,
                  format_bytes(len(own)), format_bytes(len(got)), time.perf_counter() - t0)
        return True

    # --- restoring ------------------------------------------------------------------------

    def begin_restore(self) -> Early[Restored] | None:
        """Agree on the plan now and move the state in a thread (early.py): a plan from
        memory needs no tracked object. Replicated state only: whether the state is
        sharded is known once the model is built."""
        the_plan = plan(self.coord.allgather(self.ring.report()))
        if not isinstance(the_plan, Plan):
            return None
        t0 = time.perf_counter()
        return Early(lambda: self._fetch(the_plan, sharded=False, early_since=t0),
                     f"the state of step {the_plan.step} from peers")

    def restore(self, sharded: bool) -> Restored | str:
        memory = self.ring.memory
        mine = shard_copies.report(memory, self.rank, self.url) if sharded \
            else self.ring.report()
        the_plan = plan(self.coord.allgather(mine))
        if isinstance(the_plan, Plan):
            return self._fetch(the_plan, sharded)
        if self.rank == 0:   # one line for the job: every rank computed the same plan
            (log.warning if the_plan.survivors else log.info)(
                "restoring from %s, not from peers: %s", self.url, the_plan.reason)
        return the_plan.reason

    def _fetch(self, the_plan: Plan, sharded: bool,
               early_since: float | None = None) -> Restored:
        """The moves of ``the_plan``: every rank's bytes, nothing of the tracked objects
        (it may run in a thread while they are built)."""
        ring = self.ring
        load: Callable[[Mapping[str, Any], bool], None]
        if sharded:   # a save's shards, from each rank's memory or its neighbour's
            got = carry_out(the_plan, shard_copies.ShardHoldings(ring.memory), self.rank,
                            GroupTransport(ring.group))
            giver = the_plan.rank_source[self.rank]   # where its shard, the bulk, came from
            from_rank = None if giver == self.rank else giver
            shared, mine = None, got.mine["rank"]
            dcp_tree, replicated = got.mine["dcp"], got.shared

            def load(tracked: Mapping[str, Any], strict: bool) -> None:
                shard_copies.load(tracked, dcp_tree, replicated, strict=strict)
        else:
            got = ring.transfer(the_plan)
            from_rank, shared, mine = got.from_rank, got.shared, got.mine

            def load(tracked: Mapping[str, Any], strict: bool) -> None:
                ring.adopt(the_plan, got)   # this rank's memory now describes the step
        early = "" if early_since is None else \
            f" in {time.perf_counter() - early_since:.2f} s while the model was built"
        return Restored(
            RestoreRecord(step=got.step, source=self.name, seconds=0.0,
                          bytes_read=bytes_read(peer=got.nbytes), from_rank=from_rank),
            step=got.step, shared=shared, mine=mine, last_commit=got.last_commit,
            save_point=got.save_point, load=load,
            message=f"restored step {got.step} from "
                    f"{'memory' if from_rank is None else f'rank {from_rank}'} "
                    f"({format_bytes(got.nbytes)} of state received{early}), "
                    f"no storage read")

    # --- the end of a life ------------------------------------------------------------------

    def hand_over(self, step: int) -> None:
        """Leave the tracked objects' state (references, no copy) in the process's memory
        for the next life's restore (peers.py), where it is that of step ``step``'s
        boundary."""
        memory = self.ring.memory
        memory.shards_handed_over = True   # sharded saves' copies: usable now

        def state() -> dict[str, Any]:
            tree = collect(self._tracked)
            if has_dtensor(tree):
                raise _Sharded
            return tree

        save_point, last_commit = self._save_point()
        try:
            self.ring.hand_over(step, state, save_point, last_commit)
        except _Sharded:
            # Not the live state: a shard has no second holder but the last save's copy.
            memory.why_not = ("sharded (DTensor) state: restored from the last save's "
                              "copies in memory (tiers/shards.py)")
