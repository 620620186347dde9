"""What a training script does that a restart would not reproduce, said once.

A restart resumes exactly only from what the checkpoint holds. Four mistakes leave
something out of it without any error: gradients accumulated across ``ctx.steps`` steps
(gradients are not saved), the model left untracked (a restart keeps the step count and
begins the weights afresh), an optimizer left untracked (its momentum, Adam's moments),
an LR scheduler left untracked (its schedule begins again). :class:`ScriptAdvice` looks
for each at the step boundaries and saves the manager reports, from the tracked objects,
and names the fix. The primary says it (every rank steps alike); each once per process,
since every life of a job would say it again.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ...lifecycle import said, say_once
from .capture import FollowsSteps, has_state_dict

log = logging.getLogger(__name__)

class ScriptAdvice:
    """One life's checks; the manager calls them with the tracked objects and the count
    of tracked optimizer (and GradScaler) steps begun."""

    def __init__(self, tracked: Mapping[str, Any], is_primary: bool) -> None:
        self._tracked = tracked   # read at each call: an object tracked later counts too
        self._is_primary = is_primary
        # At the first boundary, then at each save: the tracked modules' parameter version
        # sums, the count of optimizer steps, and the step.
        self._params_seen: tuple[dict[str, int], int, int] | None = None
        self._looked = False   # the life's first boundary is past

    def boundary(self, step: int, steps_called: int) -> None:
        """A step boundary. The first one looks at the schedulers and notes the
        parameters, from where the first save's check starts; the others cost nothing."""
        if not self._looked:
            self._looked = True
            self.saving(step, steps_called)
            self._untracked_scheduler()
            self._untracked_model()

    def saving(self, step: int, steps_called: int) -> None:
        """A save of ``step``: the parameters changed since the last look with no tracked
        optimizer step in between, so an optimizer that is not tracked updates them."""
        if said("untracked optimizer"):
            return
        versions = {name: sum(p._version for p in obj.parameters())
                    for name, obj in self._tracked.items() if isinstance(obj, torch.nn.Module)}
        before, self._params_seen = self._params_seen, (versions, steps_called, step)
        if before is None or steps_called != before[1]:
            return
        changed = [name for name, v in versions.items() if before[0].get(name, v) != v]
        if changed:
            self._say(
                "untracked optimizer",
                "the parameters of %s changed between steps %d and %d, but no tracked "
                "optimizer stepped: an optimizer that is not tracked updates them, and its "
                "state (momentum, Adam's moments, its step count) is in no checkpoint, so a "
                "restart begins it afresh and the run does not resume exactly. Track it "
                "with the model: ctx.track(model=model, optimizer=opt) (updates of your own "
                "that keep no state need nothing)", ", ".join(changed), before[2], step)

    def saving_without_a_step(self, step: int) -> None:
        """A save after a step that called no tracked optimizer's step, with gradients
        held: most likely gradients accumulated over several steps, whose partial sum no
        checkpoint holds."""
        if said("accumulation"):
            return
        optimizers = [o for o in self._tracked.values() if isinstance(o, torch.optim.Optimizer)]
        if any(p.grad is not None for o in optimizers for g in o.param_groups
               for p in g["params"]):
            self._say(
                "accumulation",
                "the checkpoint of step %d follows a step that ran no optimizer step, with "
                "gradients held. If gradients are accumulated over several ctx.steps steps, "
                "a restore loses their partial sum and the run does not resume exactly: "
                "make one ctx.steps step one optimizer step, with the micro-batches looped "
                'inside it (docs/checkpointing.md, "Exact data position")', step)

    def _untracked_scheduler(self) -> None:
        """A tracked optimizer that an LR scheduler drives (its param groups carry the
        scheduler's ``initial_lr``) with no tracked object driving it (a scheduler's
        ``.optimizer``, SequentialLR's too): a restart would begin the schedule afresh."""
        if said("untracked scheduler"):
            return
        scheduled = {id(getattr(obj, "optimizer", None)) for obj in self._tracked.values()}
        names = [name for name, obj in self._tracked.items()
                 if isinstance(obj, torch.optim.Optimizer) and id(obj) not in scheduled
                 and any("initial_lr" in g for g in obj.param_groups)]
        if names:
            self._say(
                "untracked scheduler",
                "the optimizer %s is driven by an LR scheduler (its param groups carry "
                "initial_lr) that is not tracked: a restart would begin its schedule afresh "
                "(a warmup again, or the full rate after a decay) and the run would not "
                "resume exactly. Track it too: ctx.track(..., sched=scheduler)",
                ", ".join(names))

    def tracked(self) -> None:
        """Objects were tracked: one object under two names (often a model and its DDP or
        torch.compile wrapper, both the module underneath) is saved, copied and restored
        twice."""
        names: dict[int, list[str]] = {}
        for name, obj in self._tracked.items():
            if has_state_dict(obj):
                names.setdefault(id(obj), []).append(name)
        for same in (n for n in names.values() if len(n) > 1):
            self._say("tracked twice " + " ".join(same),
                      "%s are one object (a model and its DDP or torch.compile wrapper are "
                      "tracked as the module underneath): every checkpoint holds it %d "
                      "times; track it once", " and ".join(repr(n) for n in same), len(same))

    def _untracked_model(self) -> None:
        """No tracked object holds weights (a module, or an object of the script's own
        with a state_dict): a restart would resume the step count, the RNGs and the
        values, with the model as built, not as trained."""
        sched = torch.optim.lr_scheduler
        aside = (torch.optim.Optimizer, sched.LRScheduler, sched.ReduceLROnPlateau,
                 torch.amp.GradScaler, FollowsSteps)
        if any(isinstance(obj, torch.nn.Module)
               or (has_state_dict(obj) and not isinstance(obj, aside))
               for obj in self._tracked.values()):
            return
        what = (f"only {', '.join(self._tracked)} tracked" if self._tracked
                else "nothing tracked")
        self._say(
            "untracked model",
            "no model is tracked (%s): every checkpoint holds the step count, the RNG "
            "states and ctx.values, but not the weights, so a restart resumes the step "
            "count with the model as built, not as trained. Track it before the loop: "
            "ctx.track(model=model, optimizer=opt)", what)

    def _say(self, key: str, message: str, *args: Any) -> None:
        say_once(log, key, logging.WARNING if self._is_primary else logging.DEBUG,
                 message, *args)
