"""What a checkpoint manager saves and restores on this rank, and the steps that change it.

The tracked objects (model, optimizer, scheduler, scaler, data loader) are replicated: the
primary's copy is saved once. ``values`` (a script's own counters), the RNG streams and the
buffers a step writes in place (batch norm's statistics) are each rank's own. The steps the
tracked optimizers and GradScalers begin are counted by hooks: a save after a boundary
without one may cut accumulated gradients in two (advice.py says so), and the peer ring
sends each rank's state just before a step's first optimizer step (tiers/peers.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ...lifecycle import say_once
from .capture import (
    capture_rng,
    refuse_rank_local_state,
    refuse_stateless,
    restore,
    restore_rng,
    unwrap_model,
)
from .overrides import describe, overridden
from .stepwrites import before_each_call, current_buffers, put_buffers

log = logging.getLogger(__name__)


class Tracked:
    """The tracked objects, ``values``, and the optimizer steps begun in this life."""

    def __init__(self, is_primary: bool, world_size: int,
                 step_begins: Callable[[bool], None]) -> None:
        self.objects: dict[str, Any] = {}
        self.values: dict[str, Any] = {}
        self._is_primary, self._world_size = is_primary, world_size
        # Called as a tracked optimizer's step (True) or a GradScaler's (False) begins,
        # before it is counted: a step whose exchange failed began nothing.
        self._step_begins = step_begins
        # The step pre-hooks, removed at close: a hook would keep the manager (and its
        # process groups) alive as long as the optimizer.
        self._hooks: list[Any] = []
        self._hooked: set[int] = set()
        self.steps_called = self.steps_at_boundary = 0

    def add(self, **objects: Any) -> None:
        """Objects with ``state_dict``/``load_state_dict``; a compiled or wrapped (DDP)
        model as the module underneath, so that its keys do not depend on the wrapping."""
        objects = {name: unwrap_model(obj) for name, obj in objects.items()}
        for name, obj in objects.items():
            refuse_rank_local_state(name, obj)
            refuse_stateless(name, obj)
        self.objects.update(objects)
        import torch

        for obj in objects.values():
            if id(obj) in self._hooked:
                continue
            if isinstance(obj, torch.optim.Optimizer):
                self._hooked.add(id(obj))
                self._hooks.append(obj.register_step_pre_hook(
                    lambda *_: self._begins(optimizer=True)))
            elif isinstance(obj, torch.amp.GradScaler):
                # A step the scaler skips (an inf gradient) calls no optimizer's step but
                # is one all the same.
                self._hooked.add(id(obj))
                self._hooks.append(before_each_call(obj, "step",
                                                    lambda: self._begins(optimizer=False)))

    def _begins(self, optimizer: bool) -> None:
        self._step_begins(optimizer)
        self.steps_called += 1

    def boundary(self) -> bool:
        """A step boundary: whether an optimizer or scaler step began since the last."""
        stepped = self.steps_called != self.steps_at_boundary
        self.steps_at_boundary = self.steps_called
        return stepped

    def rank_state(self) -> dict[str, Any]:
        """What differs per rank and is saved per rank: the RNG streams, ``values``, and
        the buffers that steps write (batch norm's statistics: each rank's own)."""
        state: dict[str, Any] = {"rng": capture_rng(), "values": dict(self.values)}
        buffers = current_buffers(self.objects) if self._world_size > 1 else None
        if buffers:
            state["buffers"] = buffers
        return state

    def deferrable(self) -> frozenset[int]:
        """Storage addresses of what only the tracked optimizers' steps write: their
        parameters and their state. A snapshot may copy these while the next step's
        forward and backward run (HostSnapshot.snapshot)."""
        import torch

        ptrs: set[int] = set()
        for obj in self.objects.values():
            if isinstance(obj, torch.optim.Optimizer):
                ptrs.update(p.data_ptr() for g in obj.param_groups for p in g["params"])
                ptrs.update(v.data_ptr() for st in obj.state.values() for v in st.values()
                            if isinstance(v, torch.Tensor))
        return frozenset(ptrs)

    def load(self, shared: dict[str, Any] | None, mine: dict[str, Any], strict: bool) -> None:
        """A replicated tree into the tracked objects (None: loaded already, sharded) and a
        per-rank tree into the RNGs (when it has them), the buffers and ``values``."""
        if shared is not None:
            replaced = overridden(self.objects, shared) if self._is_primary else []
            restore(self.objects, shared, strict=strict)
            if replaced:   # once per setting: every life would say it again, and a
                # script that sets one by hand each step (a weight decay schedule) too
                say_once(log, "overridden " + "; ".join(r.what for r in replaced),
                         logging.WARNING, "%s", describe(replaced))
        if "rng" in mine:
            restore_rng(mine["rng"])
        if mine.get("buffers"):
            put_buffers(self.objects, mine["buffers"])
        self.values.clear()
        self.values.update(mine["values"])

    def remove_hooks(self) -> None:
        for hook in reversed(self._hooks):   # a wrapper puts back what it found
            hook.remove()
        self._hooks.clear()
