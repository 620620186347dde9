"""Recovery from live peers: a restarted rank gets the training state from the survivors,
and nobody reads storage.

When a peer restarts, the survivors re-form the group in-process and call the training
function again (distributed/group.py): the same objects are built anew and restored. Two
things make that restore possible without storage:

- **The replicated state stays in memory.** When a life ends on an error, the manager
  hands its tracked objects' state (model, optimizer, scheduler, scaler, the data
  position: references, no copy) to this process's :class:`PeerMemory`, which outlives
  the life. It is only usable if it is the state of a step *boundary*: a rank whose step
  in flight had already changed a parameter (an optimizer step, then a failed collective
  after it) is *torn* and holds nothing. The forward's writes to buffers (batch norm's
  statistics) are put back from copies taken at the boundary (state/stepwrites.py).
- **Each rank's own state has two holders.** The RNG streams, ``ctx.values`` and the
  modules' buffers (state/stepwrites.py) differ per rank; every step, just before its first
  optimizer (or GradScaler) step, each rank sends its snapshot of them to the next rank in
  a ring that runs across machines (ringlink.ring_order: with one process per machine,
  rank r's is held by r and r+1) and waits for the previous rank's
  (:meth:`PeerRing.send_early` says why then). A step that changes them after that
  sends them again at its end, without waiting. The last :data:`KEEP` boundaries are
  kept, since survivors can be one step apart.

At the restore, every rank reports what it holds (:class:`Report`), and every rank
computes the same :func:`plan` from all reports: the newest step T that some rank holds
the replicated state of, and whose per-rank state every rank can get (its own, or from a
surviving holder). Ranks that hold T's state use their own; the others receive it from
the lowest such rank, point to point (transport/transfer.py). When no such step exists (the whole
job restarted, both holders of a rank's state lost, every survivor torn), the plan says
why in one line and the manager reads storage instead.

Per-rank state travels pickled over the job's own gloo group, as torch's object
collectives (used by the checkpoint coordination) already do; the replicated state
travels as a weights-only skeleton and raw tensors (transport/transfer.py).
"""

from __future__ import annotations

import logging
import os
import pickle
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...lifecycle import current, said, say_once
from ..schedule.coordination import Coordinator
from ..state.capture import rng_fingerprint, tree_map_tensors, tree_nbytes
from ..state.stepwrites import StepWrites, buffers_print
from ..storage.base import format_bytes
from ..transport.channel import GroupTransport
from ..transport.ringlink import Frame, RingLink, local_address, new_token
from .plan import Plan, Recovered, Report, carry_out, dumps_rank_state, loads_rank_state

log = logging.getLogger(__name__)

# How long a ring neighbour may take to connect, or to send its state at a step: as long
# as a collective may take (DistributedOptions.collective_timeout_s's default).
RING_TIMEOUT_S = 600.0
# A rank's own state larger than this is named once: the ring pickles and sends it every
# step (a loss history kept in ctx.values grows it, and the step's cost, without end).
LARGE_RANK_STATE = 1 << 20
# Boundaries of per-rank state kept (own and the partner's): survivors are at most one
# step apart (a step's collectives need every rank), so two always cover the agreed step.
KEEP = 2
# The ring's messages (transport/ringlink.py frames): a rank's state sent just before its optimizer
# step, and at the step's end when that early copy does not count. About 15 KB each.
_EARLY, _STEP_END = 1, 2
_FINAL = 1   # flags: sent at the step's end, the state the step ended in
_LATE = 2    # the sender changes its state after its optimizer step: an early copy is stale
_CHANGED = 4  # ... and did in this step (the receiver names it when the copy is missing)


@dataclass
class PeerMemory:
    """What this process keeps for peer recovery across lives (one per process)."""

    own: dict[int, bytes] = field(default_factory=dict)       # step -> my per-rank state
    partner: dict[int, bytes] = field(default_factory=dict)   # step -> the previous rank's
    partner_rank: int | None = None
    partner_changed: int | None = None   # the first step it changed after its opt.step
    # Whether this process has said (or need not say) that its state changes after its
    # optimizer step: a process that began from a restore was told so in an earlier one.
    said_changed: bool = False
    replicated: dict[str, Any] | None = None   # the last life's tracked state, at a boundary
    replicated_step: int | None = None
    # The last life's modules and optimizers, whose tensors ``replicated`` references, and
    # whether they held trained state (a step, or a restore) when it ended.
    owners: list[weakref.ref[Any]] = field(default_factory=list)
    owners_trained: bool = False
    # The last life's tracked modules and whether each was in training mode at its last
    # step boundary (state/kept.py).
    modes: list[tuple[weakref.ref[Any], bool]] = field(default_factory=list)
    save_point: tuple[int | None, float] = (None, 0.0)   # last save's (step, time)
    last_commit_step: int | None = None
    why_not: str = ""   # why the last life's state is not usable, for the log line
    # Sharded (DTensor) state: packed copies of the last saves (tiers/shards.py), step ->
    # this rank's and the previous rank's, and when each save was taken.
    shards: dict[int, bytes] = field(default_factory=dict)
    partner_shards: dict[int, bytes] = field(default_factory=dict)
    shard_partner: int | None = None
    shard_times: dict[int, float] = field(default_factory=dict)
    shard_url: str = ""                 # the checkpoint directory they are saves of
    shards_handed_over: bool = False    # a life ended on an error: the next one may use them

    def keep_own(self, step: int, payload: bytes) -> None:
        self.own[step] = payload
        _trim(self.own)

    def keep_partner(self, rank: int, step: int, payload: bytes) -> None:
        if rank != self.partner_rank:
            self.partner = {}
            self.partner_rank, self.partner_changed = rank, None
        self.partner[step] = payload
        _trim(self.partner)

    def drop_replicated(self) -> None:
        self.replicated, self.replicated_step = None, None

    def detach(self, rank: int) -> list[Any]:
        """Called as a life begins, before the training code runs: ``replicated`` holds
        references to the last life's tensors, which nothing writes while that life's
        objects are gone (the training function builds new ones, the usual case). An
        owner still alive is held from outside the life (a model built at the script's
        top, or passed to the training function) and is trained on again, and the new
        life writes into it before its restore: DDP's constructor broadcasts rank 0's
        parameters into every rank's, so a restarted primary's fresh ones would become a
        survivor's "state" of the last step. The state is copied first then (on the
        host: a model filling an accelerator has no room for a second copy there).
        Returns the owners still alive."""
        if not self.owners:   # no life handed over, or detached already
            return []
        alive = [o for o in (ref() for ref in self.owners) if o is not None]
        self.owners = []
        if self.replicated is None or not alive:
            return alive
        self.replicated = tree_map_tensors(_host_copy, self.replicated)
        log.info("rank %d: the last life's %s %s still in use (built outside the training "
                 "function), so its state of step %s is copied (%s) before this life writes "
                 "into %s", rank, " and ".join(type(o).__name__ for o in alive),
                 "is" if len(alive) == 1 else "are", self.replicated_step,
                 format_bytes(tree_nbytes(self.replicated)), "it" if len(alive) == 1 else "them")
        return alive


def _host_copy(t: Any) -> Any:
    return t.detach().to("cpu", copy=True)


def _trim(kept: dict[int, bytes]) -> None:
    for step in sorted(kept)[:-KEEP]:
        del kept[step]


class MemoryHoldings:
    """A :class:`PeerMemory` as the plan's source of state."""

    where = "memory"

    def __init__(self, memory: PeerMemory) -> None:
        self.memory = memory

    def shared(self, step: int) -> dict[str, Any]:
        assert self.memory.replicated_step == step and self.memory.replicated is not None
        return self.memory.replicated

    def rank_state(self, rank: int, step: int, own: bool) -> bytes:
        return self.memory.own[step] if own else self.memory.partner[step]


def process_memory() -> PeerMemory:
    """The process's one PeerMemory, kept by the loop that runs its lives (lifecycle.py):
    a life hands over to it, the next one restores."""
    return current().kept("peer memory", PeerMemory)


class PeerRing:
    """One life's side of peer recovery: the per-step ring and the restore."""

    def __init__(self, rank: int, world_size: int, group: Any, link: RingLink,
                 memory: PeerMemory, writes: StepWrites) -> None:
        self.rank, self.world_size = rank, world_size
        self.group = group                  # the restore's transfers (transport/transfer.py)
        self.link = link                    # the per-step messages (transport/ringlink.py)
        self.memory = memory
        self.writes = writes                # what the step in flight wrote in place
        self._sent_for: int | None = None   # the step whose early copy went round the ring
        self._sent: bytes = b""             # ... and what it was
        self._sent_print: Any = None        # ... and its fingerprint
        self._early_flags = 0               # ... and its flags
        self._late = False   # a step changed its state after its optimizer step
        self._done = 0                      # steps finished (the last boundary)

    # --- every step ---------------------------------------------------------------------

    def send_early(self, rank_state: Callable[[], Mapping[str, Any]]) -> None:
        """Send this rank's state round the ring and wait for the previous rank's: called
        by the manager just before the step's first optimizer (or GradScaler) step, once
        per step. The scaler too: a step skipped for an inf or NaN gradient (frequent while
        the scale is being found) calls it without the optimizer's.

        Before, not after: a rank that dies between the gradient all-reduce and the end of
        its step has then already sent the state its step ends in (an optimizer step draws
        no random numbers), or the others wait for it here, *before* their own optimizer
        step, and stay at the previous boundary, whose state every rank has. After the
        step, a rank lost in that window would take its state with it while the others
        moved on, leaving no step that all could restore. A step that changes the RNGs or
        ``values`` after the optimizer step sends its final state again at its end (see
        :meth:`boundary`), and from then on its early copies do not count."""
        step = self._done + 1
        if self._sent_for != step:   # the first optimizer (or scaler) of the step sends
            self._take_arrived()
            # A life's first copy does not count yet: whether the step changes its
            # state after the optimizer step is known at its end.
            self._early_flags = _LATE if self._late or self._sent_for is None else 0
            state = rank_state()
            self._sent_for, self._sent = step, dumps_rank_state(state)
            if len(self._sent) > LARGE_RANK_STATE:
                _say_large(self.rank, len(self._sent), state)
            self._sent_print = _fingerprint(state["values"], _listed(state.get("buffers")),
                                            state["rng"])
            self.link.send(_EARLY, step, self._early_flags, self._sent)
            self._keep(self.link.receive(_EARLY))

    def boundary(self, step: int, rank_state: Callable[[], Mapping[str, Any]],
                 values: Mapping[str, Any]) -> None:
        """Step ``step`` is done: keep this rank's state; send it to the next rank (without
        waiting) when its early copy does not count (see :meth:`send_early`).
        ``values``, the RNGs and the buffers' bits tell whether it changed since the early
        copy, which is cheaper than capturing it all again."""
        self._take_arrived()
        self._done = step
        buffers = self.writes.boundary()
        if self.writes.collective_after_step and not self.writes.undoes_steps:
            _say_collective(self.rank, step)
        early = self._sent_for == step
        same = early and _fingerprint(values, buffers) == self._sent_print
        if same:
            payload = self._sent
        else:
            state = rank_state()
            payload = dumps_rank_state(state)
            if early and not self._late and not self.memory.said_changed:
                self.memory.said_changed = True
                _say_changed(self.rank, step, loads_rank_state(self._sent), state)
            self._late = self._late or early   # for good: a step that changed it after
        self.memory.keep_own(step, payload)    # its optimizer step once may do so again
        if same and not self._early_flags & _LATE:
            return   # the early copy counts: nothing more to send (the common case)
        self._sent_for = step
        changed = _CHANGED if early and not same else 0
        self.link.send(_STEP_END, step, _FINAL | changed, payload)

    def _keep(self, frame: Frame) -> None:
        # A late rank's early copy may be stale: only its step-end copy counts.
        if frame.kind == _STEP_END or not frame.flags & _LATE:
            self.memory.keep_partner(self.link.prev, frame.step, frame.payload)
        if frame.flags & _CHANGED and self.memory.partner_changed is None:
            self.memory.partner_changed = frame.step

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
        except Exception as exc:
            log.debug("the ring's last messages: %s", exc)
        finally:
            self.link.close()
        m.save_point, m.last_commit_step = save_point, last_commit
        m.drop_replicated()
        if step not in m.own:
            m.why_not = f"no snapshot of its own state at step {step}"
            return
        torn = self.writes.undo()   # the forward's buffer writes are put back
        if torn:
            m.why_not = f"its step {step + 1} {torn}"
            return
        m.replicated, m.replicated_step, m.why_not = state(), step, ""

    # --- the start of a life ------------------------------------------------------------

    def report(self) -> Report:
        m = self.memory
        return Report(rank=self.rank, replicated=() if m.replicated_step is None else
                      (m.replicated_step,), own=tuple(sorted(m.own)),
                      held_for=m.partner_rank, held=tuple(sorted(m.partner)),
                      held_changed=m.partner_changed,
                      last_commit=m.last_commit_step, save_point=m.save_point,
                      why_not=m.why_not)

    def transfer(self, the_plan: Plan) -> Recovered:
        """The moves of ``the_plan`` from this process's memory (every rank calls it); the
        memory is left as it was until :meth:`adopt`."""
        return carry_out(the_plan, MemoryHoldings(self.memory), self.rank,
                         GroupTransport(self.group))

    def adopt(self, the_plan: Plan, got: Recovered) -> Recovered:
        """``got`` is being loaded: this rank's memory now describes the restored step."""
        m, step = self.memory, the_plan.step
        m.own = {step: got.mine_bytes}
        m.partner = {s: d for s, d in m.partner.items() if s == step}
        m.drop_replicated()
        return got

    def partner_copy(self, step: int) -> tuple[int, dict[str, Any]] | None:
        """The previous rank's per-rank state of ``step`` that the ring gave this rank,
        for its machine's copy (nodelocal.py); None without one."""
        payload = self.memory.partner.get(step)
        if payload is None or self.memory.partner_rank is None:
            return None
        return self.memory.partner_rank, loads_rank_state(payload)

    def restored(self, step: int, rank_state: Mapping[str, Any]) -> None:
        """Step ``step`` is loaded (from peers or storage): the boundary that a hand-over
        before the next step compares to, with this rank's state as it is now."""
        if not self.memory.own:   # this process's first life: it began from a restore
            self.memory.said_changed = True
        self.memory.keep_own(step, dumps_rank_state(rank_state))
        self.writes.boundary()
        self._done = self._sent_for = step


def connect_ring(coord: Coordinator, memory: PeerMemory, tracked: Mapping[str, Any], *,
                 wanted: bool, undo_torn_steps: bool) -> PeerRing | None:
    """This life's ring, where ``wanted`` and there are peers: a collective, every rank
    connects to its ring neighbours (transport/ringlink.py)."""
    group = getattr(coord, "main_group", None)
    if not wanted or coord.world_size == 1 or group is None:
        return None
    link = RingLink.connect(
        coord.rank, coord.world_size, coord.allgather,
        local_address(os.environ.get("MASTER_ADDR", "127.0.0.1"),
                      int(os.environ.get("MASTER_PORT", "0") or 0)),
        coord.broadcast(new_token()), timeout_s=RING_TIMEOUT_S)
    return PeerRing(coord.rank, coord.world_size, group, link, memory,
                    StepWrites(tracked, before_step=undo_torn_steps))


def _say_changed(rank: int, step: int, early: Mapping[str, Any],
                 now: Mapping[str, Any]) -> None:
    """Say, once, that step ``step`` changed this rank's RNG, values or buffers after its
    optimizer step, and what: from then on its early copies do not count (see
    :meth:`PeerRing.send_early`), so a loss of this rank between its optimizer step and
    its step's end goes back to the last checkpoint. Most scripts do it by accident: an
    evaluation after ``opt.step()`` stores its metric, and its DataLoader's iterator draws a
    seed from torch's RNG."""
    was, is_ = early["values"], now["values"]
    keys = sorted((k for k in was.keys() | is_.keys()
                   if _pickled(was.get(k, _NONE)) != _pickled(is_.get(k, _NONE))), key=str)
    what = [f"ctx.values {', '.join(repr(k) for k in keys)}"] if keys else []
    was_b, is_b = early.get("buffers") or {}, now.get("buffers") or {}
    bufs = [f"{name}.{key}" for name in sorted(was_b.keys() | is_b.keys())
            for key in sorted(was_b.get(name, {}).keys() | is_b.get(name, {}).keys())
            if _buffer_bits(was_b, name, key) != _buffer_bits(is_b, name, key)]
    what += [f"the buffer{'s' if len(bufs) > 1 else ''} {', '.join(bufs[:3])}"
             f"{' ...' if len(bufs) > 3 else ''}"] if bufs else []
    rngs = rng_fingerprint(early["rng"]), rng_fingerprint(now["rng"])
    names = ("torch's RNG", "Python's random", "CUDA's RNG", "NumPy's random")
    what += [n for n, a, b in zip(names, *rngs) if a != b]
    # The primary says it; any rank says it at the recovery it costs (tiers/plan.py).
    (log.warning if rank == 0 else log.info)(
        "rank %d: step %d changed %s after opt.step(). From now on a peer holds this rank's "
        "copy of a step only once the step has ended, so losing the rank between its "
        "optimizer step and its step's end sends the job back to its last checkpoint. "
        "Set ctx.values and draw random numbers before opt.step() (an evaluation "
        "DataLoader's iterator draws one from torch's RNG) to recover from memory there too "
        "(an EMA's or SWA model's update, which follows opt.step() by nature, has that cost)",
        rank, step, " and ".join(what) or "its state")


_NONE = "<not set>"


def _say_collective(rank: int, step: int) -> None:
    """Say, once, that step ``step`` ran a collective after its optimizer step: a peer
    lost during it leaves every survivor torn (state/stepwrites.py), and the job goes back to its
    checkpoint instead of recovering from memory."""
    say_once(
        log, "collective after opt.step()", logging.WARNING if rank == 0 else logging.INFO,
        "rank %d: step %d ran a collective on the default process group after opt.step() "
        "(an all-reduce of a metric, a barrier, a second optimizer's gradients). A peer "
        "lost during it leaves the survivors past their optimizer step, so the job goes "
        "back to its last checkpoint instead of recovering from memory: run a metric's "
        "before opt.step(), after loss.backward(); for a step of two optimizers (a GAN's), "
        "CheckpointOptions(undo_torn_steps=True) takes such a step back (a copy of the "
        "parameters and optimizer state per step)", rank, step)


def _say_large(rank: int, size: int, state: Mapping[str, Any]) -> None:
    """Say, once, that this rank's own state is large, and what makes it so: peer
    recovery pickles it and sends it to the next rank at every step."""
    if said("large rank state"):   # what fills it costs a pickle of every value
        return
    parts = {f"ctx.values[{k!r}]": len(_pickled(v)) for k, v in state["values"].items()}
    parts.update({f"the buffers of {name}": sum(b.numel() * b.element_size()
                                                for b in held.values())
                  for name, held in (state.get("buffers") or {}).items()})
    top = sorted(parts.items(), key=lambda kv: -kv[1])[:3]
    say_once(
        log, "large rank state", logging.WARNING if rank == 0 else logging.INFO,
        "rank %d: its own state (RNG, ctx.values, buffers) is %.1f MB, mostly %s; peer "
        "recovery pickles it and sends it to the next rank at every step, which costs the "
        "step time in proportion. Keep histories and large data out of ctx.values (write "
        "them to a file; ctx.values is for positions, counters and metrics)",
        rank, size / 1e6, ", ".join(f"{name} ({n / 1e6:.1f} MB)" for name, n in top))


def _buffer_bits(buffers: Mapping[str, Mapping[str, Any]], name: str, key: str) -> Any:
    buf = buffers.get(name, {}).get(key)
    return None if buf is None else buffers_print([(name, key, buf)])


def _pickled(value: Any) -> bytes:   # values may hold tensors, where == is elementwise
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _fingerprint(values: Mapping[str, Any], buffers: list[tuple[str, str, Any]],
                 rng: Mapping[str, Any] | None = None) -> tuple[Any, ...]:
    """Equal for two moments exactly when the RNGs (``rng``: as captured; None: now),
    ``values`` and the modules' buffers (an EMA's ``n_averaged``, written after the
    optimizer step) did not change between them."""
    return (rng_fingerprint(rng), pickle.dumps(dict(values), protocol=pickle.HIGHEST_PROTOCOL),
            buffers_print(buffers))


def _listed(buffers: Mapping[str, Mapping[str, Any]] | None) -> list[tuple[str, str, Any]]:
    """A rank state's buffers (stepwrites.current_buffers) as persistent_buffers lists
    them."""
    return [(name, key, buf) for name, held in (buffers or {}).items()
            for key, buf in held.items()]
