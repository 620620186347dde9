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

import io
import logging
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .ringlink import Frame, RingLink
from .state import rng_fingerprint
from .transfer import Moved, recv_tree, send_tree

log = logging.getLogger(__name__)

# Boundaries of per-rank state kept (own and the partner's): survivors are at most one
# step apart (a step's collectives need every rank), so two always cover the agreed step.
KEEP = 2
# The ring's messages (ringlink.py frames): a rank's state sent just before its optimizer
# step, and at the step's end when that early copy does not count. About 15 KB each.
_EARLY, _STEP_END = 1, 2
_FINAL = 1   # flags: sent at the step's end, the state the step ended in
_LATE = 2    # the sender changes its state after its optimizer step: an early copy is stale


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

    def __init__(self, rank: int, world_size: int, group: Any, link: RingLink,
                 memory: PeerMemory, versions: Callable[[], int]) -> None:
        self.rank, self.world_size = rank, world_size
        self.group = group                  # the restore's transfers (transfer.py)
        self.link = link                    # the per-step messages (ringlink.py)
        self.memory = memory
        self._versions = versions          # the tracked tensors' in-place write count
        self._boundary_versions: int | None = None
        self._sent_for: int | None = None   # the step whose early copy went round the ring
        self._sent: bytes = b""             # ... and what it was
        self._sent_print: Any = None        # ... and its fingerprint
        self._early_flags = 0               # ... and its flags
        self._late = False   # a step changed RNG or values after its optimizer step
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
        :meth:`boundary`), and from then on its early copies do not count."""
        if id(optimizer) in self._hooked:
            return
        self._hooked.add(id(optimizer))

        def before_step(_opt: Any, _args: Any, _kwargs: Any) -> None:
            step = self._done + 1
            if self._sent_for != step:   # the first optimizer of the step sends
                self._take_arrived()
                # A life's first copy does not count yet: whether the step changes its
                # state after the optimizer step is known at its end.
                self._early_flags = _LATE if self._late or self._sent_for is None else 0
                state = rank_state()
                self._sent_for, self._sent = step, _dumps(state)
                self._sent_print = _fingerprint(state["values"], state["rng"])
                self.link.send(_EARLY, step, self._early_flags, self._sent)
                self._keep(self.link.receive(_EARLY))

        optimizer.register_step_pre_hook(before_step)

    def boundary(self, step: int, rank_state: Callable[[], Mapping[str, Any]],
                 values: Mapping[str, Any]) -> None:
        """Step ``step`` is done: keep this rank's state; send it to the next rank (without
        waiting) when its early copy does not count (see :meth:`watch_optimizer`).
        ``values`` alone (with the RNGs) tells whether it changed since the early copy,
        which is cheaper than capturing it all again."""
        self._take_arrived()
        self._done = step
        self._boundary_versions = self._versions()
        early = self._sent_for == step
        same = early and _fingerprint(values) == self._sent_print
        if same:
            payload = self._sent
        else:
            payload = _dumps(rank_state())
            self._late = self._late or early   # for good: a step that changed it after
        self.memory.keep_own(step, payload)    # its optimizer step once may do so again
        if same and not self._early_flags & _LATE:
            return   # the early copy counts: nothing more to send (the common case)
        self._sent_for = step
        self.link.send(_STEP_END, step, _FINAL, payload)

    def _keep(self, frame: Frame) -> None:
        # A late rank's early copy may be stale: only its step-end copy counts.
        if frame.kind == _STEP_END or not frame.flags & _LATE:
            self.memory.keep_partner(self.link.prev, frame.step, frame.payload)

    def _take_arrived(self) -> None:
        """Keep the previous rank's messages that have arrived, without waiting."""
        for frame in self.link.arrived(_STEP_END):
            self._keep(frame)

    # --- the end of a life --------------------------------------------------------------

    def hand_over(self, step: int, state: Callable[[], dict[str, Any]],
                  save_point: tuple[int | None, float], last_commit: int | None) -> None:
        """The life ends on an error after ``step`` steps: keep what the next life needs.
        ``state`` gives the tracked objects' state (references to live tensors)."""
        m = self.memory
        try:   # what the previous rank sent before the failure still counts
            self._take_arrived()
            for frame in self.link.arrived(_EARLY):
                self._keep(frame)
        except Exception as exc:  # noqa: BLE001 - the ring is failing: keep what arrived
            log.debug("the ring's last messages: %s", exc)
        finally:
            self.link.close()
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


def _fingerprint(values: Mapping[str, Any], rng: Mapping[str, Any] | None = None
                 ) -> tuple[Any, ...]:
    """Equal for two moments exactly when the RNGs (``rng``: as captured; None: now) and
    ``values`` did not change between them."""
    return rng_fingerprint(rng), pickle.dumps(dict(values), protocol=pickle.HIGHEST_PROTOCOL)


def _dumps(rank_state: Mapping[str, Any]) -> bytes:
    out = io.BytesIO()
    _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(dict(rank_state))
    return out.getvalue()


def _loads(payload: bytes) -> dict[str, Any]:
    # A peer of this job, over its own group, as torch's object collectives do.
    return pickle.loads(payload)  # noqa: S301


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
