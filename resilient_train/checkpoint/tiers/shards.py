"""Sharded (FSDP2 / DTensor) state from live peers: each rank keeps its own shard of the
last save and a copy of the previous rank's, in host memory, so that a lost rank is rebuilt
from its neighbour's copy without storage (Gemini's ring placement, SOSP '23).

Replicated state can come from any survivor (tiers/peers.py); a shard exists on one rank only, so
its second holder must have received it *before* the fault. That copy is made at each save
of a sharded step, from the save's own host snapshot (the DCP stager's copy), on the writer
thread: every rank packs its shard with its RNG streams, ``values`` and the small replicated
part (a scheduler, say), sends it to the next rank of the peer ring (ringlink.ring_order: on
another machine whenever there are two) and receives the previous rank's over the writer's
gloo group. Once every rank has both copies (a barrier) the older save's are
dropped; until then both are kept, so a rank lost in the middle of an exchange leaves the
survivors a step they all hold.

At a restore the ranks plan as peer recovery does (tiers/plan.py), with a save's step for
a boundary: the newest save whose shard every rank can get, its own or from the next rank.
So a sharded job goes back to its last save (as from storage, but without reading it), and
two neighbouring ranks lost at once fall back to storage. Memory: two packed shards per rank
(its own and its neighbour's), four during an exchange, besides the stager's buffers.
DTensors travel as their local tensors and are rebuilt on the live objects' mesh and
placements (the same job: same world size and sharding).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..commit.manifest import CheckpointError
from ..commit.sharded import _is_dtensor, owner_module
from ..state.capture import collect, restore
from .peers import PeerMemory
from .plan import Report, dumps_rank_state, loads_rank_state

log = logging.getLogger(__name__)

KEEP = 2   # saves whose copies are kept until every rank confirmed the newer one


@dataclass(frozen=True)
class LocalShard:
    """A DTensor's local tensor, in a packed copy (the mesh is the live object's)."""

    local: torch.Tensor


def _strip(tree: Any) -> Any:
    """``tree`` with every DTensor replaced by its (host) local tensor."""
    if _is_dtensor(tree):
        return LocalShard(tree.to_local().detach().cpu())
    if isinstance(tree, Mapping):
        return {k: _strip(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_strip(v) for v in tree)
    return tree


def _dress(tree: Any, template: Any, where: str) -> Any:
    """``tree`` with each LocalShard rebuilt as a DTensor like ``template``'s at its place."""
    if isinstance(tree, LocalShard):
        if not _is_dtensor(template):
            raise CheckpointError(f"{where}: a shard in the peer copy, no DTensor here")
        from torch.distributed.tensor import DTensor

        if tuple(template.to_local().shape) != tuple(tree.local.shape):
            raise CheckpointError(f"{where}: the peer copy's shard is "
                                  f"{tuple(tree.local.shape)}, this rank's is "
                                  f"{tuple(template.to_local().shape)}")
        local = tree.local.to(template.to_local().device)
        return DTensor.from_local(local, template.device_mesh, template.placements,
                                  shape=template.shape, stride=template.stride(),
                                  run_check=False)
    if isinstance(tree, Mapping):
        tmpl = template if isinstance(template, Mapping) else {}
        return {k: _dress(v, tmpl.get(k), f"{where}.{k}") for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        tmpl = template if isinstance(template, (list, tuple)) else ()
        return type(tree)(_dress(v, tmpl[i] if i < len(tmpl) else None, f"{where}[{i}]")
                          for i, v in enumerate(tree))
    return tree


def pack(dcp_state: Mapping[str, Any], shared: Mapping[str, Any],
         rank_state: Mapping[str, Any]) -> bytes:
    """One rank's copy of a save: its shard (a DCP state tree, as staged), the replicated
    part and its per-rank state."""
    return dumps_rank_state({"dcp": _strip(dict(dcp_state)), "shared": dict(shared),
                             "rank": dict(rank_state)})


def unpack(payload: bytes) -> dict[str, Any]:
    return loads_rank_state(payload)


def keep(memory: PeerMemory, url: str, step: int, own: bytes, partner: bytes,
         partner_rank: int, saved_at: float) -> None:
    """This rank's copies of save ``step`` of the checkpoint directory ``url`` (the older
    ones stay until :func:`confirm`)."""
    if memory.shard_url != url:
        memory.shards, memory.partner_shards, memory.shard_times = {}, {}, {}
        memory.shard_url = url
    memory.shards[step] = own
    memory.partner_shards[step] = partner
    memory.shard_partner = partner_rank
    memory.shard_times[step] = saved_at
    for kept in (memory.shards, memory.partner_shards, memory.shard_times):
        for old in sorted(kept)[:-KEEP]:
            del kept[old]


def confirm(memory: PeerMemory, step: int) -> None:
    """Every rank holds the copies of ``step``: the older saves' are not needed."""
    for kept in (memory.shards, memory.partner_shards, memory.shard_times):
        for old in [s for s in kept if s < step]:
            del kept[old]


def report(memory: PeerMemory, rank: int, url: str) -> Report:
    """What this rank holds of the sharded saves of the checkpoint directory ``url``, for
    the plan (recovery_plan.plan). Only after a hand-over (a life of this job ended on an
    error): a manager that merely starts in the same process restores from storage."""
    if not memory.shards_handed_over or memory.shard_url != url:
        return Report(rank=rank, replicated=(), own=(), held_for=None, held=(),
                      last_commit=memory.last_commit_step, save_point=(None, 0.0),
                      why_not="")
    steps = tuple(sorted(memory.shards))
    newest = steps[-1] if steps else None
    return Report(rank=rank, replicated=steps, own=steps,
                  held_for=memory.shard_partner if memory.partner_shards else None,
                  held=tuple(sorted(memory.partner_shards)),
                  last_commit=memory.last_commit_step,
                  save_point=(newest, memory.shard_times.get(newest, 0.0)) if newest
                  is not None else (None, 0.0),
                  why_not="" if steps else "no copy of its shard in memory (no save yet)")


class ShardHoldings:
    """A :class:`PeerMemory`'s sharded copies as the plan's source (recovery_plan.Holdings)."""

    where = "memory"

    def __init__(self, memory: PeerMemory) -> None:
        self.memory = memory

    def shared(self, step: int) -> dict[str, Any]:
        return dict(unpack(self.memory.shards[step])["shared"])

    def rank_state(self, rank: int, step: int, own: bool) -> bytes:
        return self.memory.shards[step] if own else self.memory.partner_shards[step]


def load(tracked: Mapping[str, Any], dcp_tree: Mapping[str, Any], shared: Mapping[str, Any],
         *, strict: bool = True) -> None:
    """Load a packed copy's shard (``dcp_tree``) and replicated part into the tracked
    objects, on their own meshes."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    missing = sorted(set(dcp_tree) - set(tracked))
    if missing and strict:
        raise CheckpointError(f"the peer copy holds sharded state of {missing}, which this "
                              f"life does not track")
    restore({n: o for n, o in tracked.items() if n not in dcp_tree}, shared, strict=strict)
    options = StateDictOptions(strict=strict)
    for name, saved in dcp_tree.items():
        obj = tracked.get(name)
        if obj is None:
            continue
        if isinstance(obj, torch.nn.Module):
            state = _dress(saved, get_model_state_dict(obj, options=options), name)
            set_model_state_dict(obj, state, options=options)
        elif isinstance(obj, torch.optim.Optimizer):
            owner = owner_module(name, obj, tracked)
            # A fresh optimizer gets its state initialised here: the shards' templates.
            state = _dress(saved, get_optimizer_state_dict(owner, obj), name)
            set_optimizer_state_dict(owner, obj, state, options=options)
        else:   # another stateful object, or a plain tree of tensors (filled in place)
            restore({name: obj}, {name: _dress(saved, collect({name: obj})[name], name)},
                    strict=strict)
