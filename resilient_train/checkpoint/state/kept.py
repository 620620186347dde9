"""Objects a life keeps from the last one in the same process: a model, optimizer or
GradScaler built outside the training function (at the script's top, or passed to it),
which an in-process recovery trains on, where a restarted process would build new ones.

A new process's objects are untouched; kept ones carry what the last life left in them.
Each of these made a recovered job end with wrong weights, or fail, until handled here:

- the peer state in memory references their tensors, and the new life writes into them
  before its restore (DDP's constructor broadcasts rank 0's fresh parameters): copied
  first (``PeerMemory.detach``);
- a sharded (FSDP2) model is bound to the process group the loss ended: the life exits
  transient, saying so (``take_over``);
- after a restore, half-made gradients and a GradScaler's half-done step are dropped
  (``state.clear_step_leftovers``) and a module left in evaluation mode is put back in the
  mode of the step boundary restored (``after_restore``);
- a restore that finds nothing must not start afresh from trained objects with the step
  count, the schedule and the data back at 0: the life exits transient for the job to
  start afresh (``after_restore``).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from typing import Any

from ...errors import TransientError
from ..commit.sharded import uses_sharded_layout
from ..tiers.peers import PeerMemory
from .capture import clear_step_leftovers

log = logging.getLogger(__name__)


class KeptObjects:
    """One manager's view of its tracked objects across lives in this process."""

    def __init__(self, tracked: Mapping[str, Any], memory: PeerMemory, rank: int) -> None:
        self._tracked = tracked
        self._memory = memory
        self.rank = rank
        # The tracked modules, and whether each was in training mode at the last step
        # boundary: a life that ends between model.eval() and model.train() (an evaluation
        # whose collective met a lost peer) leaves them in evaluation mode.
        self._modules: list[Any] = []
        self._modes: list[bool] = []
        # The last life's objects, still alive as this life began, when they had trained.
        self._trained: list[weakref.ref[Any]] = []

    def tracked(self) -> None:
        """The tracked objects changed."""
        import torch

        self._modules = [obj for obj in self._tracked.values()
                         if isinstance(obj, torch.nn.Module)]

    def boundary(self) -> None:
        """A step boundary: note each module's mode (a few booleans)."""
        self._modes = [m.training for m in self._modules]

    def hand_over(self, trained: bool) -> None:
        """The life ends on an error; ``trained``: its objects hold training (a step, or a
        restore). The next life checks whether they are gone before its training code runs."""
        import torch

        memory = self._memory
        memory.owners = [weakref.ref(obj) for obj in self._tracked.values()
                         if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))]
        memory.owners_trained = trained
        memory.modes = [(weakref.ref(m), mode) for m, mode in zip(self._modules, self._modes)]

    def take_over(self) -> None:
        """As a life begins, before the training code runs: copy the peer state that the
        last life's objects still alive reference (PeerMemory.detach), and refuse a kept
        sharded (FSDP2) model: torch cannot shard it again for the new process group, and
        the training code would fail on its "can only be applied to a module once" as if
        it were a bug. The job restarts from its last checkpoint instead."""
        import torch

        kept = self._memory.detach(self.rank)
        if kept and self._memory.owners_trained:
            self._trained = [weakref.ref(obj) for obj in kept]
        sharded = [obj for obj in kept if isinstance(obj, torch.nn.Module)
                   and uses_sharded_layout({"kept": obj})]
        if sharded:
            raise TransientError(
                f"rank {self.rank}: the last life's {type(sharded[0]).__name__} is sharded "
                "(its parameters are DTensors: FSDP2) over the process group that a peer's "
                "loss ended, and it is still in use (built outside the training function): "
                "it cannot be sharded again or trained in the new group, so this process "
                "exits for the job to restart from its last checkpoint. Build the model and "
                "shard it inside the training function to recover in place")

    def after_restore(self, step: int | None, nothing_from: str) -> None:
        """The restore loaded ``step`` (None: nothing was found; ``nothing_from`` says where
        nothing was) into the tracked objects: leave them as a new process's would be."""
        trained, self._trained = self._trained, []
        modes, self._memory.modes = self._memory.modes, []
        if step is not None:
            clear_step_leftovers(self._tracked)
            self._put_back_modes(modes, step)
        else:
            self._refuse_a_fresh_start_on(trained, nothing_from)

    def _tracked_again(self, ref: weakref.ref[Any]) -> Any:
        """The last life's object behind ``ref`` when this life tracks it again, else None."""
        obj = ref()
        return obj if obj is not None and any(obj is t for t in self._tracked.values()) \
            else None

    def _put_back_modes(self, modes: list[tuple[weakref.ref[Any], bool]], step: int) -> None:
        """A module that this life tracks again in another mode than at the last life's last
        step boundary was left so by a failure between ``model.eval()`` and
        ``model.train()``: back to the boundary's mode (by its own ``train()``, which a
        module that keeps parts frozen overrides), as at the step restored, where a new
        process's module is too."""
        for ref, mode in modes:
            module = self._tracked_again(ref)
            if module is not None and module.training != mode:
                module.train(mode)
                log.info("rank %d: the last life left the %s in %s mode (it ended between "
                         "model.eval() and model.train()); put back in %s mode for step %d",
                         self.rank, type(module).__name__,
                         "training" if not mode else "evaluation",
                         "training" if mode else "evaluation", step)

    def _refuse_a_fresh_start_on(self, trained: list[weakref.ref[Any]],
                                 nothing_from: str) -> None:
        """Nothing to restore after a peer's loss: when this life tracks the last life's
        objects again, which hold its training, a fresh start from them would train on from
        where they are with the step count, the schedule and the data back at 0, unlike a
        new process. A new process it is: every survivor gets here alike (the same plan),
        so the job starts afresh."""
        again = [obj for obj in map(self._tracked_again, trained) if obj is not None]
        if not again:
            return
        trained_on = " and ".join(type(obj).__name__ for obj in again)
        raise TransientError(
            f"rank {self.rank}: nothing to restore after a peer's loss ({nothing_from}), and "
            f"this life trains the last life's {trained_on} on (built outside the training "
            "function), which hold its training: a fresh start must not begin from them, so "
            "this process exits for the job to start afresh. Build the model and optimizer "
            "inside the training function (each life then starts from new ones), or save "
            "checkpoints sooner (rt.CheckpointOptions(save_every_steps=...))")
