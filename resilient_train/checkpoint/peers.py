"""Recovery from live peers: a restarted rank gets the training state from the survivors,
and nobody reads storage.

When a peer restarts, the survivors re-form the group in-process and call the training
function again (distributed/group.py): the same objects are built anew and restored. Two
things make that restore possible without storage:

- **The replicated state stays in memory.** When a life ends on an error, the manager
  hands its tracked objects' state (model, optimizer, scheduler, scaler, the data
  position: references, no copy) to this process's :class:`PeerMemory`, which outlives
  the life. It is only usable if it is the state of a step *boundary*: a rank whose step
  in flight had already changed a parameter or buffer (an optimizer step, then a failed
  collective after it) is *torn* and holds nothing. Version counters, read at every
  boundary, tell (``Tensor._version`` moves with every in-place write).
- **Each rank's own state has two holders.** The RNG streams and ``ctx.values`` differ per
  rank; at every step boundary each rank sends its snapshot of them to the next rank in a
  ring (rank r's is held by r and r+1), without waiting: the message is posted at one
  boundary and collected at the next. The last :data:`KEEP` boundaries are kept, since
  survivors can be one step apart.

At the restore, every rank reports what it holds (:class:`Report`), and every rank
computes the same :func:`plan` from all reports: the newest step T that some rank holds
the replicated state of, and whose per-rank state every rank can get (its own, or from a
surviving holder). Ranks that hold T's state use their own; the others receive it from
the lowest such rank, point to point (transfer.py). When no such step exists (the whole
job restarted, both holders of a rank's state lost, every survivor torn), the plan says
why in one line and the manager reads storage instead.

Per-rank state travels pickled over the job's own gloo group, as torch's object
collectives (used by the checkpoint coordination) already do; the replicated state
travels as a weights-only skeleton and raw tensors (transfer.py).
"""

from __future__ import annotations

import logging
import pickle
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .state import tree_map_leaves, tree_map_tensors
from .transfer import Moved, recv_tree, send_tree

log = logging.getLogger(__name__)

# Boundaries of per-rank state kept (own and the partner's): survivors are at most one
# step apart (a step's collectives need every rank), so two always cover the agreed step.
KEEP = 2
# The ring's fixed message: step and length, then the payload (a larger one overflows
# into a second message). RNG states and small values fit: about 15 KB.
_HEAD = struct.Struct("<qqq")   # step, length, flags
_FINAL = 1   # sent at the step's end: the state the step ended in
_LATE = 2    # the sender changes its state after its optimizer step: an early copy is stale
_EARLY, _STEP_END = 1, 2   # message tags: before the optimizer step, at the step's end
RING_BYTES = 64 << 10


@dataclass
class PeerMemory:
    """What this process keeps for peer recovery across lives (one per process)."""

    own: dict[int, bytes] = field(default_factory=dict)       # step -> my per-rank state
    partner: dict[int, bytes] = field(default_factory=dict)   # step -> the previous rank's
    partner_rank: int | None = None
    replicated: dict[str, Any] | None = None   # the last life's tracked state, at a boundary
    replicated_step: int | None = None
    save_point: tuple[int | None, float] = (None, 0.0)   # last save's (step, time)
    last_commit_step: int | None = None
    why_not: str = ""   # why the last life's state is not usable, for the log line

    def keep_own(self, step: int, payload: bytes) -> None:
        self.own[step] = payload
        _trim(self.own)

    def keep_partner(self, rank: int, step: int, payload: bytes) -> None:
        if rank != self.partner_rank:
            self.partner = {}
            self.partner_rank = rank
        self.partner[step] = payload
        _trim(self.partner)

    def drop_replicated(self) -> None:
        self.replicated, self.replicated_step = None, None


def _trim(kept: dict[int, bytes]) -> None:
    for step in sorted(kept)[:-KEEP]:
        del kept[step]


_MEMORY = PeerMemory()


def process_memory() -> PeerMemory:
    """The process's one PeerMemory: a life hands over to it, the next one restores."""
    return _MEMORY


@dataclass(frozen=True)
class Report:
    """What one rank can contribute to a restore; plain values (all-gathered)."""

    rank: int
    replicated: int | None              # the step whose replicated state it holds
    own: tuple[int, ...]                # steps of its own per-rank state
    held_for: int | None                # the rank whose per-rank state it holds
    held: tuple[int, ...]               # ... for these steps
    last_commit: int | None
    save_point: tuple[int | None, float]
    why_not: str


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


def plan(reports: list[Report]) -> Plan | NoPlan:
    """The newest step all ranks can restore from memory, or why not (in one line)."""
    survivors = [r for r in reports if r.replicated is not None or r.own]
    if not survivors:
        return NoPlan("no process holds training state in memory (a fresh start, or every "
                      "process restarted)", survivors=False)
    newest_commit = max((r.last_commit for r in reports if r.last_commit is not None),
                        default=None)
    steps = sorted({r.replicated for r in reports if r.replicated is not None}, reverse=True)
    if not steps:
        whys = "; ".join(f"rank {r.rank}: {r.why_not}" for r in survivors if r.why_not)
        return NoPlan(f"no survivor holds the replicated state of a step boundary "
                      f"({whys or 'none'})", survivors=True)
    why = ""
    for step in steps:
        if newest_commit is not None and newest_commit > step:
            why = why or (f"a newer checkpoint (step {newest_commit}) is committed than the "
                          f"newest step in memory ({step})")
            break
        source: dict[int, int] = {}
        for r in reports:
            if step in r.own:
                source[r.rank] = r.rank
                continue
            givers = [h.rank for h in reports if h.held_for == r.rank and step in h.held]
            if not givers:
                why = why or (f"no survivor holds rank {r.rank}'s RNG and values of step "
                              f"{step} (the rank and the one after it were both lost, or it "
                              f"died before sending them)")
                break
            source[r.rank] = min(givers)
        else:
            holders = [r for r in reports if r.replicated == step]
            holder = min(holders, key=lambda r: r.rank)
            return Plan(step=step, holder=holder.rank,
                        needs_state=tuple(r.rank for r in reports if r.replicated != step),
                        rank_source=source, save_point=holder.save_point,
                        last_commit=newest_commit)
    return NoPlan(why, survivors=True)


@dataclass(frozen=True)
class Recovered:
    """What a peer restore gives this rank: the trees the manager loads."""

    step: int
    shared: dict[str, Any]
    mine: dict[str, Any]
    from_rank: int | None          # who sent the replicated state (None: held it itself)
    nbytes: int                    # bytes received from peers
    save_point: tuple[int | None, float]
    last_commit: int | None


class PeerRing:
    """One life's side of peer recovery: the per-step ring and the restore."""

    def __init__(self, rank: int, world_size: int, group: Any, memory: PeerMemory,
                 versions: Callable[[], int]) -> None:
        self.rank, self.world_size, self.group = rank, world_size, group
        self.memory = memory
        self._versions = versions          # the tracked tensors' in-place write count
        self._boundary_versions: int | None = None
        self._next = (rank + 1) % world_size
        self._prev = (rank - 1) % world_size
        self._inbox = torch.empty(RING_BYTES, dtype=torch.uint8)
        self._outbox = torch.empty(RING_BYTES, dtype=torch.uint8)
        self._final_in = torch.empty(_HEAD.size, dtype=torch.uint8)
        self._final_out = torch.empty(_HEAD.size, dtype=torch.uint8)
        self._pending: list[Any] = []       # the last step-end message: [recv, sends...]
        self._sent_for: int | None = None   # the step whose early copy went round the ring
        self._sent: bytes = b""             # ... and what it was
        self._late = False   # the last step changed RNG or values after the optimizer step
        self._done = 0                      # steps finished (the last boundary)
        self._hooked: set[int] = set()

    # --- every step ---------------------------------------------------------------------

    def watch_optimizer(self, optimizer: Any, rank_state: Callable[[], Mapping[str, Any]]
                        ) -> None:
        """Send this rank's state round the ring just before ``optimizer`` steps, and wait
        for the previous rank's.

        Before, not after: a rank that dies between the gradient all-reduce and the end of
        its step has then already sent the state its step ends in (an optimizer step draws
        no random numbers), or the others wait for it here, *before* their own optimizer
        step, and stay at the previous boundary, whose state every rank has. After the
        step, a rank lost in that window would take its state with it while the others
        moved on, leaving no step that all could restore. A step that changes the RNGs or
        ``values`` after the optimizer step sends its final state again at its end (see
        :meth:`boundary`), and its early copies stop counting."""
        if id(optimizer) in self._hooked:
            return
        self._hooked.add(id(optimizer))

        def before_step(_opt: Any, _args: Any, _kwargs: Any) -> None:
            step = self._done + 1
            if self._sent_for != step:   # the first optimizer of the step sends
                self._collect(block=True)
                self._sent_for, self._sent = step, _dumps(rank_state())
                self._exchange(step, self._sent, _LATE if self._late else 0)

        optimizer.register_step_pre_hook(before_step)

    def boundary(self, step: int, rank_state: Mapping[str, Any]) -> None:
        """Step ``step`` is done: keep this rank's state, and tell the next rank, without
        waiting, whether it differs from the early copy (then with the state itself)."""
        import torch.distributed as dist

        self._collect(block=True)
        self._done = step
        payload = _dumps(rank_state)
        self.memory.keep_own(step, payload)
        self._boundary_versions = self._versions()
        if self._sent_for == step:
            self._late = payload != self._sent
        final = payload if self._sent_for != step or self._late else b""
        self._final_out.copy_(torch.frombuffer(
            bytearray(_HEAD.pack(step, len(final), _FINAL)), dtype=torch.uint8))
        sends = [dist.isend(self._final_out, self._next, group=self.group, tag=_STEP_END)]
        if final:
            sends.append(dist.isend(torch.frombuffer(bytearray(final), dtype=torch.uint8),
                                    self._next, group=self.group, tag=_STEP_END))
        recv = dist.irecv(self._final_in, self._prev, group=self.group, tag=_STEP_END)
        self._pending = [recv, *sends]

    def _collect(self, *, block: bool) -> None:
        """The previous rank's last step-end message: keep its final state, if it sent one.
        Not blocking (a life's end), only if it has arrived."""
        import torch.distributed as dist

        if not self._pending:
            return
        recv, *sends = self._pending
        if not block and not recv.is_completed():
            self._pending = []
            return
        self._pending = []
        recv.wait()
        step, length, _ = _HEAD.unpack_from(self._final_in.numpy().tobytes())
        if length:
            data = torch.empty(length, dtype=torch.uint8)
            dist.recv(data, self._prev, group=self.group, tag=_STEP_END)
            self.memory.keep_partner(self._prev, step, data.numpy().tobytes())
        for work in sends:
            work.wait()

    def _exchange(self, step: int, payload: bytes, flags: int) -> None:
        """Send ``payload`` to the next rank and receive the previous rank's, both ways at
        once, and wait for both."""
        import torch.distributed as dist

        room = RING_BYTES - _HEAD.size
        head = _HEAD.pack(step, len(payload), flags) + payload[:room]
        self._outbox[:len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        sends = [dist.isend(self._outbox, self._next, group=self.group, tag=_EARLY)]
        if len(payload) > room:
            rest = torch.frombuffer(bytearray(payload[room:]), dtype=torch.uint8)
            sends.append(dist.isend(rest, self._next, group=self.group, tag=_EARLY))
        dist.recv(self._inbox, self._prev, group=self.group, tag=_EARLY)
        # Kept before the sends are waited for: what arrived counts even when the next
        # rank is the one that died.
        got, length, their = _HEAD.unpack_from(self._inbox.numpy().tobytes()[:_HEAD.size])
        data = self._inbox[_HEAD.size:_HEAD.size + min(length, room)].numpy().tobytes()
        if length > room:
            more = torch.empty(length - room, dtype=torch.uint8)
            dist.recv(more, self._prev, group=self.group, tag=_EARLY)
            data += more.numpy().tobytes()
        if not their & _LATE:   # a late rank's early copy is stale: its final one counts
            self.memory.keep_partner(self._prev, got, data)
        for work in sends:
            work.wait()

    # --- the end of a life --------------------------------------------------------------

    def hand_over(self, step: int, state: Callable[[], dict[str, Any]],
                  save_point: tuple[int | None, float], last_commit: int | None) -> None:
        """The life ends on an error after ``step`` steps: keep what the next life needs.
        ``state`` gives the tracked objects' state (references to live tensors)."""
        m = self.memory
        try:
            self._collect(block=False)
        except Exception as exc:  # noqa: BLE001 - the group is failing: keep what arrived
            log.debug("the last step-end message did not complete: %s", exc)
        m.save_point, m.last_commit_step = save_point, last_commit
        m.drop_replicated()
        if step not in m.own:
            m.why_not = f"no snapshot of its own state at step {step}"
            return
        if self._boundary_versions is None or self._versions() != self._boundary_versions:
            m.why_not = (f"its step {step + 1} had already changed the model's parameters or "
                         f"buffers (an optimizer step before the failed collective)")
            return
        m.replicated, m.replicated_step, m.why_not = state(), step, ""

    # --- the start of a life ------------------------------------------------------------

    def report(self) -> Report:
        m = self.memory
        return Report(rank=self.rank, replicated=m.replicated_step, own=tuple(sorted(m.own)),
                      held_for=m.partner_rank, held=tuple(sorted(m.partner)),
                      last_commit=m.last_commit_step, save_point=m.save_point,
                      why_not=m.why_not)

    def restore(self, the_plan: Plan) -> Recovered:
        """Carry out ``the_plan``: every rank calls it (the transfers are point to point,
        in one order on every rank, so no two ranks wait on each other)."""
        import torch.distributed as dist

        m, step = self.memory, the_plan.step
        shared: dict[str, Any] | None = m.replicated if m.replicated_step == step else None
        from_rank: int | None = None
        nbytes = 0
        for dst in the_plan.needs_state:
            if self.rank == the_plan.holder:
                assert shared is not None
                send_tree(shared, dst, self.group)
            elif self.rank == dst:
                moved: Moved = recv_tree(the_plan.holder, self.group)
                shared, from_rank, nbytes = moved.tree, the_plan.holder, moved.nbytes
        mine_bytes: bytes | None = m.own.get(step)
        for rank, giver in sorted(the_plan.rank_source.items()):
            if giver == rank:
                continue
            if self.rank == giver:
                data = m.partner[step]
                dist.send(torch.tensor([len(data)], dtype=torch.int64), rank, group=self.group)
                dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), rank,
                          group=self.group)
            elif self.rank == rank:
                size = torch.zeros(1, dtype=torch.int64)
                dist.recv(size, giver, group=self.group)
                buf = torch.empty(int(size.item()), dtype=torch.uint8)
                dist.recv(buf, giver, group=self.group)
                mine_bytes = buf.numpy().tobytes()
                nbytes += len(mine_bytes)
        assert shared is not None and mine_bytes is not None
        mine = _loads(mine_bytes)
        # This rank's memory now describes the restored step.
        m.own = {step: mine_bytes}
        m.partner = {s: d for s, d in m.partner.items() if s == step}
        m.drop_replicated()
        return Recovered(step=step, shared=shared, mine=mine, from_rank=from_rank,
                         nbytes=nbytes, save_point=the_plan.save_point,
                         last_commit=the_plan.last_commit)

    def restored(self, step: int, rank_state: Mapping[str, Any]) -> None:
        """Step ``step`` is loaded (from peers or storage): the boundary that a hand-over
        before the next step compares to, with this rank's state as it is now."""
        self.memory.keep_own(step, _dumps(rank_state))
        self._boundary_versions = self._versions()
        self._done = self._sent_for = step


@dataclass(frozen=True)
class _Raw:
    """A tensor as plain bytes: pickling a tensor embeds storage keys that differ from one
    call to the next, and a step's two copies of a rank's state are compared as bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


def _dumps(rank_state: Mapping[str, Any]) -> bytes:
    def raw(t: torch.Tensor) -> _Raw:
        flat = t.detach().to("cpu").contiguous()
        return _Raw(str(flat.dtype).removeprefix("torch."), tuple(flat.shape),
                    flat.reshape(-1).view(torch.uint8).numpy().tobytes() if flat.numel()
                    else b"")

    return pickle.dumps(tree_map_tensors(raw, dict(rank_state)),
                        protocol=pickle.HIGHEST_PROTOCOL)


def _loads(payload: bytes) -> dict[str, Any]:
    def tensor(leaf: Any) -> Any:
        if not isinstance(leaf, _Raw):
            return leaf
        dtype = getattr(torch, leaf.dtype)
        flat = torch.frombuffer(bytearray(leaf.data), dtype=dtype) if leaf.data else \
            torch.empty(0, dtype=dtype)
        return flat.reshape(leaf.shape)

    # A peer of this job, over its own group, as torch's object collectives do.
    return tree_map_leaves(tensor, pickle.loads(payload))  # noqa: S301


def tensor_versions(tracked: Mapping[str, Any]) -> Callable[[], int]:
    """A function that sums the in-place write counters of the tracked modules' parameters
    and buffers (``tracked`` is read at each call): the sum changes when anything writes
    them in place (an optimizer step, batch norm's running statistics)."""

    def versions() -> int:
        total = 0
        for obj in tracked.values():
            if isinstance(obj, torch.nn.Module):
                for p in obj.parameters():
                    total += p._version
                for b in obj.buffers():
                    total += b._version
        return total

    return versions
