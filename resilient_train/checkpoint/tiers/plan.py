"""How the ranks restore from state that some of them hold (in memory or on their own
machine's disk) without the persistent tier: who holds what, which step all can get, and
moving it to those that lack it.

Every rank reports what it holds (:class:`Report`: the steps whose replicated state it
has, the steps of its own per-rank state, the steps of one other rank's per-rank state);
every rank computes the same :func:`plan` from all reports: the newest step whose
replicated state some rank has and whose per-rank state every rank can get (its own, or
from the rank holding a copy). :func:`carry_out` then moves it: the lowest holder sends
the replicated state point to point to each rank that lacks it (transport/transfer.py), and each
copy of a rank's state goes to its rank. Both tiers use it: live peers' memory
(tiers/peers.py) and machines' disks (tiers/nodelocal.py).

Per-rank state (RNG streams, ``ctx.values``) travels as bytes: pickled with tensors as
raw bytes (:func:`dumps_rank_state`), between the processes of this job only, as torch's
object collectives do.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..progress import Progress
from ..transport.channel import Transport
from ..transport.transfer import Moved


@dataclass(frozen=True)
class Report:
    """What one rank can contribute to a restore; plain values (all-gathered)."""

    rank: int
    replicated: tuple[int, ...]         # steps whose replicated state it holds
    own: tuple[int, ...]                # steps of its own per-rank state
    held_for: int | None                # the rank whose per-rank state it holds
    held: tuple[int, ...]               # ... for these steps
    last_commit: int | None
    save_point: tuple[int | None, float]
    why_not: str
    # The first step at which the rank it holds for changed its RNG or values after its
    # optimizer step (its early copies stopped counting then; tiers/peers.py), or None.
    held_changed: int | None = None


@dataclass(frozen=True)
class Plan:
    """Every rank computes the same plan from the same reports."""

    step: int
    holder: int                          # sends the replicated state to who lacks it
    needs_state: tuple[int, ...]         # ranks that receive it
    rank_source: Mapping[int, int]       # rank -> who gives it its per-rank state
    save_point: tuple[int | None, float]
    last_commit: int | None


@dataclass(frozen=True)
class NoPlan:
    """Why memory cannot serve this restore; ``survivors``: some rank held state (so the
    fallback to storage loses work, worth a warning)."""

    reason: str
    survivors: bool


def plan(reports: list[Report], *, where: str = "in memory",
         nothing: str = "a fresh start, or every process restarted") -> Plan | NoPlan:
    """The newest step all ranks can restore from what they hold, or why not (one line).
    ``where`` names the holdings in that line, ``nothing`` the usual reason for none."""
    survivors = [r for r in reports if r.replicated or r.own]
    if not survivors:
        return NoPlan(f"no process holds training state {where} ({nothing})", survivors=False)
    newest_commit = max((r.last_commit for r in reports if r.last_commit is not None),
                        default=None)
    steps = sorted({s for r in reports for s in r.replicated}, reverse=True)
    if not steps:
        whys = "; ".join(f"rank {r.rank}: {r.why_not}" for r in survivors if r.why_not)
        return NoPlan(f"no survivor holds the replicated state of a step boundary "
                      f"({whys or 'none'})", survivors=True)
    why = ""
    for step in steps:
        if newest_commit is not None and newest_commit > step:
            why = why or (f"a newer checkpoint (step {newest_commit}) is committed than the "
                          f"newest step held {where} ({step})")
            break
        source: dict[int, int] = {}
        for r in reports:
            if step in r.own:
                source[r.rank] = r.rank
                continue
            givers = [h.rank for h in reports if h.held_for == r.rank and step in h.held]
            if not givers:
                why = why or _no_copy(r.rank, step, reports)
                break
            source[r.rank] = min(givers)
        else:
            holders = [r for r in reports if step in r.replicated]
            holder = min(holders, key=lambda r: r.rank)
            return Plan(step=step, holder=holder.rank,
                        needs_state=tuple(r.rank for r in reports if step not in r.replicated),
                        rank_source=source, save_point=holder.save_point,
                        last_commit=newest_commit)
    return NoPlan(why, survivors=True)


def _no_copy(rank: int, step: int, reports: list[Report]) -> str:
    """Why no survivor holds ``rank``'s per-rank state of ``step``, in one line."""
    changed = [h.held_changed for h in reports
               if h.held_for == rank and h.held_changed is not None]
    if changed:
        # Its early copies stopped counting (tiers/peers.py): only a step's end sends one. The
        # first sentence fits the 200 characters of `status`'s line.
        return (f"no survivor has rank {rank}'s RNG, values and buffers of step {step}: "
                f"it changes them after opt.step() (as in step {min(changed)}) and died "
                f"before its step's end; change them before it to recover from memory. (An "
                f"evaluation DataLoader's iterator draws a seed from torch's RNG; an EMA's "
                f"update follows opt.step() by nature.)")
    return (f"no survivor has rank {rank}'s RNG, values and buffers of step {step} (the "
            f"rank and the next one in the peer ring, which holds their copy, were both lost, "
            f"or it died before sending them)")


@dataclass(frozen=True)
class Recovered:
    """What a restore by plan gives this rank: the trees the manager loads."""

    step: int
    shared: dict[str, Any]
    mine: dict[str, Any]
    mine_bytes: bytes
    from_rank: int | None          # who sent the replicated state (None: held it itself)
    nbytes: int                    # bytes received from other ranks
    save_point: tuple[int | None, float]
    last_commit: int | None


class Holdings(Protocol):
    """Where a rank's reported state is: memory (tiers/peers.py) or its disk
    (tiers/nodelocal.py)."""

    where: str   # for a person: "memory", "node-local disk"

    def shared(self, step: int) -> dict[str, Any]: ...

    def rank_state(self, rank: int, step: int, own: bool) -> bytes:
        """Rank ``rank``'s state of ``step``: this rank's own, or the copy it holds."""


def carry_out(the_plan: Plan, holdings: Holdings, rank: int, transport: Transport
              ) -> Recovered:
    """Move what ``the_plan`` says to the ranks that lack it, over ``transport``; every
    rank calls it, and the transfers are point to point in one order on every rank, so no
    two ranks ever wait on each other."""
    step = the_plan.step
    shared: dict[str, Any] | None = None
    from_rank: int | None = None
    nbytes = 0
    if rank not in the_plan.needs_state:
        shared = holdings.shared(step)
    for dst in the_plan.needs_state:
        if rank == the_plan.holder:
            assert shared is not None
            # Tens of GB over the network take a while: both ends say how far they got
            # (the sender's line tells a stuck receiver from a stuck sender).
            with Progress(f"rank {rank}: sending step {step} from its {holdings.where} to "
                          f"rank {dst}") as progress:
                transport.send_tree(shared, dst, progress)
        elif rank == dst:
            with Progress(f"rank {rank}: receiving step {step} from rank {the_plan.holder}'s "
                          f"{holdings.where}") as progress:
                moved: Moved = transport.recv_tree(the_plan.holder, progress)
            shared, from_rank, nbytes = moved.tree, the_plan.holder, moved.nbytes
    mine_bytes: bytes | None = None
    for owner, giver in sorted(the_plan.rank_source.items()):
        if giver == owner:
            if rank == owner:
                mine_bytes = holdings.rank_state(owner, step, own=True)
            continue
        if rank == giver:
            transport.send_bytes(holdings.rank_state(owner, step, own=False), owner)
        elif rank == owner:
            mine_bytes = transport.recv_bytes(giver)
            nbytes += len(mine_bytes)
    assert shared is not None and mine_bytes is not None
    return Recovered(step=step, shared=shared, mine=loads_rank_state(mine_bytes),
                     mine_bytes=mine_bytes, from_rank=from_rank, nbytes=nbytes,
                     save_point=the_plan.save_point, last_commit=the_plan.last_commit)


def _tensor(dtype: str, shape: tuple[int, ...], data: bytes) -> torch.Tensor:
    """A tensor back from what :class:`_Pickler` wrote."""
    kind = getattr(torch, dtype)
    flat = torch.frombuffer(bytearray(data), dtype=kind) if data else torch.empty(0, dtype=kind)
    return flat.reshape(shape)


class _Pickler(pickle.Pickler):
    """Pickles tensors as (dtype, shape, raw bytes): torch's own pickling embeds storage
    keys that differ from one call to the next, and a step's two copies of a rank's state
    are compared as bytes. No tree walk in Python: the RNG states alone are ~1,300 leaves."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            flat = obj.detach().to("cpu").contiguous()
            data = flat.reshape(-1).view(torch.uint8).numpy().tobytes() if flat.numel() else b""
            return _tensor, (str(flat.dtype).removeprefix("torch."), tuple(flat.shape), data)
        return NotImplemented


def dumps_rank_state(rank_state: Mapping[str, Any]) -> bytes:
    out = io.BytesIO()
    _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(dict(rank_state))
    return out.getvalue()


def loads_rank_state(payload: bytes) -> dict[str, Any]:
    # A peer of this job, over its own group, as torch's object collectives do.
    return pickle.loads(payload)


