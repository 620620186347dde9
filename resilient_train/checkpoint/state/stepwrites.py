"""The tracked modules' buffers: state each rank holds for itself, and what a failed step
wrote in them put back.

A survivor whose step failed in a collective hands its live state to the next life only
if that is the state of the last step boundary (tiers/peers.py):

- A **parameter** is written by an optimizer step. A survivor whose step had begun an
  optimizer step is partly a step ahead (a metric all-reduced after ``opt.step()``, or a
  step with two optimizers, a GAN's, that failed between them) and is not usable. The
  tracked optimizers' step pre-hooks say when one began: a fused optimizer
  (``fused=True``) writes without moving version counters (``Tensor._version``), which
  still catch other in-place writes to parameters (an untracked optimizer's).
- A **buffer** is written by the forward, before the backward's all-reduce where a lost
  peer is noticed: batch norm's running statistics, and DDP's broadcast of rank 0's
  buffers. Version counters do not tell: batch norm's kernel updates its statistics
  without moving them. So every persistent buffer is copied at each boundary (batch
  norm's statistics are small; one ``_foreach_copy_``), and a failed step's survivor
  copies them back.

Buffers are also **per-rank state**: each rank's batch norm updates its statistics from
its own batch (DDP broadcasts rank 0's at the next forward), so the primary's
checkpoint does not hold the others'. :func:`current_buffers` go into each rank's own
state with its RNG streams and ``values`` (the peer ring's copy and every save), and
:func:`put_buffers` loads them back over the replicated state's: a restarted rank 0 gets
its own statistics from its neighbour, not its neighbour's.

Non-persistent buffers are no training state (no checkpoint holds them) and are left out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist  # loaded with torch: here it costs nothing per step

from .capture import FollowsSteps, tree_map_tensors

log = logging.getLogger(__name__)


class StepWrites:
    """The tracked modules' state at the last step boundary, as far as a failed step can
    be taken back to it. With ``before_step``, also what the step's optimizer steps change:
    copied as the first one begins, put back for a survivor whose step failed after it."""

    def __init__(self, tracked: Mapping[str, Any], *, before_step: bool = False) -> None:
        self._tracked = tracked   # read at each call: a module tracked later counts too
        self._before_step = before_step
        self._before: BeforeStep | None = None   # the copy, in the step in flight
        self._params: int | None = None   # the parameters' version sum at the boundary
        self._stepped = False   # a tracked optimizer's step began since the boundary
        # The default process group's collectives counted when the step's first optimizer
        # step began: one issued after it (a metric's all-reduce, a GAN's second
        # optimizer's gradients) tears a survivor.
        self._seq_at_step: int | None = None
        self.collective_after_step = False   # ... in the step the last boundary ended
        # id(buffer) -> (buffer, its value at the boundary)
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def began(self) -> None:
        """A tracked optimizer's step begins (from its step pre-hook: manager.py)."""
        if self._stepped:
            return   # the step's second optimizer (a GAN's): its first began the step
        if self._before_step and self._params is not None \
                and self._walk()[0] == self._params:   # nothing else wrote them yet
            self._before = BeforeStep.take(self._tracked)
        self._stepped = True
        self._seq_at_step = _default_group_seq()

    @property
    def undoes_steps(self) -> bool:
        """Whether a step torn by its optimizer steps is taken back (``before_step``)."""
        return self._before_step

    def boundary(self) -> list[tuple[str, str, torch.Tensor]]:
        """A step ended (or a restore loaded one): keep its buffers' values. Returns the
        persistent buffers, as :func:`persistent_buffers` lists them."""
        self._params, buffers = self._walk()
        self.collective_after_step = self._stepped and self._seq_at_step is not None and \
            _default_group_seq() != self._seq_at_step
        self._stepped = False
        self._before = None
        copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for _, _, buf in buffers:
            held = self._copies.get(id(buf))
            copy = held[1] if held is not None and held[0] is buf and \
                held[1].shape == buf.shape and held[1].dtype == buf.dtype and \
                held[1].device == buf.device else torch.empty_like(buf)
            copies[id(buf)] = (buf, copy)
            dst.append(copy)
            src.append(buf)
        if src:
            with torch.no_grad():
                torch._foreach_copy_(dst, src)
        self._copies = copies
        return buffers

    def undo(self) -> str:
        """Put the buffers back as they were at the last boundary. '' when the tracked
        modules then hold the boundary's state; otherwise what the step did that cannot be
        undone, to follow "its step N"."""
        if self._params is None:
            return "had begun before any step boundary of this life"
        before, self._before = self._before, None   # set only once a step has begun
        if before is not None:
            try:
                before.put_back(self._tracked)     # the optimizer steps, taken back
            except Exception as exc:  # noqa: BLE001 - an object that refuses its own state
                return f"could not be taken back to its start ({type(exc).__name__}: {exc})"
            self._stepped = False
        params, buffers = self._walk()
        if before is not None:
            self._params = params                  # copy_ moved the version counters
        if self._stepped or params != self._params:
            return ("had already changed the model's parameters: its optimizer step had run "
                    "when a collective after it failed (a metric all-reduced after "
                    "opt.step(), which belongs before it, or a second optimizer's step: "
                    "CheckpointOptions(undo_torn_steps=True) takes such a step back; "
                    'docs/checkpointing.md, "Recovery from live peers")')
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for name, key, buf in buffers:
            held = self._copies.get(id(buf))
            if held is None or held[0] is not buf:
                return f"had replaced the buffer {name}.{key} since the last step boundary"
            dst.append(buf)
            src.append(held[1])
        if dst:
            with torch.no_grad():
                torch._foreach_copy_(dst, src)
        return ""

    def _walk(self) -> tuple[int, list[tuple[str, str, torch.Tensor]]]:
        """The parameters' version sum and the persistent buffers, in one pass (it runs at
        every step boundary)."""
        versions = 0
        buffers: list[tuple[str, str, torch.Tensor]] = []
        for tracked_name, prefix, module in _modules(self._tracked):
            for p in module._parameters.values():
                if p is not None:
                    versions += p._version
            buffers += _persistent(tracked_name, prefix, module)
        return versions, buffers


@dataclass(frozen=True)
class BeforeStep:
    """What a step's optimizer steps change, as its first one begins: every tracked
    module's parameters, every tracked optimizer's state, and the state of what else is
    tracked and stepped after it (LR schedulers, a GradScaler); copies on their devices.
    A ResumableLoader follows the steps itself, and buffers are put back from the
    boundary's copies."""

    params: list[torch.Tensor]
    values: list[torch.Tensor]
    states: dict[str, Any]   # tracked name -> a copy of its state_dict()

    @staticmethod
    def take(tracked: Mapping[str, Any]) -> BeforeStep:
        seen: dict[int, torch.Tensor] = {}
        for _, _, module in _modules(tracked):
            for p in module._parameters.values():
                if p is not None:
                    seen.setdefault(id(p), p)
        params = list(seen.values())
        with torch.no_grad():
            values = [p.detach().clone() for p in params]
            # A copy of each container and tensor (copy.deepcopy: 6x the time).
            states = {name: tree_map_tensors(torch.Tensor.clone, obj.state_dict())
                      for name, obj in tracked.items()
                      if not isinstance(obj, (torch.nn.Module, FollowsSteps))}
        return BeforeStep(params, values, states)

    def put_back(self, tracked: Mapping[str, Any]) -> None:
        if self.params:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.values)
        for name, state in self.states.items():
            tracked[name].load_state_dict(state)


def _default_group_seq() -> int | None:
    """How many collectives the default process group (the user's and DDP's) has issued;
    None without one, or where its backend does not count them."""
    if not dist.is_initialized():
        return None
    try:
        return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())
    except Exception:  # noqa: BLE001 - a backend without sequence numbers: no check
        return None


def _modules(tracked: Mapping[str, Any]) -> Iterator[tuple[str, str, torch.nn.Module]]:
    for tracked_name, obj in tracked.items():
        if isinstance(obj, torch.nn.Module):
            for prefix, module in obj.named_modules():
                yield tracked_name, prefix, module


def _persistent(tracked_name: str, prefix: str, module: torch.nn.Module
                ) -> Iterator[tuple[str, str, torch.Tensor]]:
    skip = module._non_persistent_buffers_set
    for name, buf in module._buffers.items():
        # A DTensor buffer is sharded state, which the sharded layout saves (commit/sharded.py).
        if buf is not None and name not in skip and type(buf) is torch.Tensor:
            yield tracked_name, f"{prefix}.{name}" if prefix else name, buf


def persistent_buffers(tracked: Mapping[str, Any]) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(tracked name, state_dict key, buffer) of every persistent buffer of the tracked
    modules."""
    for tracked_name, prefix, module in _modules(tracked):
        yield from _persistent(tracked_name, prefix, module)


def current_buffers(tracked: Mapping[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's persistent buffers as they are now, ``{tracked name: {state_dict key:
    tensor}}`` (references, not copies), for its own state."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, key, buf in persistent_buffers(tracked):
        out.setdefault(name, {})[key] = buf
    return out


def buffers_print(buffers: Iterable[tuple[str, str, torch.Tensor]]) -> tuple[Any, ...]:
    """Something that compares equal exactly when the buffers hold the same bits (NaN
    included): their names, kinds and bytes, one copy per device."""
    layout: list[tuple[str, str, torch.dtype, tuple[int, ...]]] = []
    flat: dict[torch.device, list[torch.Tensor]] = {}
    for name, key, buf in buffers:
        layout.append((name, key, buf.dtype, tuple(buf.shape)))
        flat.setdefault(buf.device, []).append(buf.detach().reshape(-1).view(torch.uint8))
    data = tuple(bytes(torch.cat(parts).cpu().numpy()) for parts in flat.values())
    return tuple(layout), data


def put_buffers(tracked: Mapping[str, Any], buffers: Mapping[str, Mapping[str, Any]]) -> None:
    """Load a rank's own buffers (:func:`current_buffers`, from its state) into the
    tracked modules, over the replicated state's. One a module does not have is skipped
    with a warning (the model changed since they were saved)."""
    found = {(name, key): buf for name, key, buf in persistent_buffers(tracked)}
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    missing: list[str] = []
    for name, held in buffers.items():
        for key, value in held.items():
            buf = found.get((name, key))
            if buf is None or not isinstance(value, torch.Tensor) or value.shape != buf.shape:
                missing.append(f"{name}.{key}")
                continue
            dst.append(buf)
            src.append(value.to(buf.device, buf.dtype))
    if missing:
        log.warning("this rank's own buffers %s are not in the tracked modules (or have "
                    "another shape): they keep the replicated state's values", missing[:5])
    if dst:
        with torch.no_grad():
            torch._foreach_copy_(dst, src)


@dataclass
class CallWatch:
    """A handle for :func:`before_each_call`: ``remove()`` takes the wrapper off again."""

    obj: Any
    name: str
    wrapper: Callable[..., Any]
    own: Callable[..., Any] | None   # an instance attribute it replaced, if any

    def remove(self) -> None:
        if vars(self.obj).get(self.name) is self.wrapper:
            if self.own is None:
                delattr(self.obj, self.name)
            else:
                setattr(self.obj, self.name, self.own)


def before_each_call(obj: Any, name: str, before: Callable[[], None]) -> CallWatch:
    """Run ``before()`` first at each call of ``obj.name`` (an instance wrapper: what has
    no hooks of its own, a GradScaler's ``step``). Remove the handles in the reverse order
    of their making: each one puts back what it found."""
    original = getattr(obj, name)
    own = vars(obj).get(name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        before()
        return original(*args, **kwargs)

    setattr(obj, name, wrapper)
    return CallWatch(obj, name, wrapper, own)

