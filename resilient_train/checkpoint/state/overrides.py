"""The script's own settings that a restore replaces, named before it does.

``Optimizer.load_state_dict`` keeps the checkpoint's hyperparameters, not those the script
built the optimizer with, and an LR scheduler's ``load_state_dict`` keeps the checkpoint's
schedule. A script edited between two runs (a lower weight decay, a longer ``T_max`` or
``total_steps``, a learning rate scaled by another world size) therefore resumes with
the old settings, and nothing says so. :func:`overridden` lists what differs, before the
load; the manager's primary says it.

What a schedule changes as it runs is not a setting: ``lr`` itself (a schedule set by hand
writes it every step; a scheduler's base rate is ``initial_lr``), the momentum that
``OneCycleLR`` and ``CyclicLR`` cycle, and a scheduler's position (``last_epoch``, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

# Written by the optimizer's schedule as it runs, not set by the script.
_SCHEDULED_GROUP_KEYS = frozenset({"params", "lr"})
_CYCLED_MOMENTUM = frozenset({"momentum", "betas"})   # where "max_momentum" says so
# A scheduler's position, and what it derives from its settings or the param groups.
_SCHEDULER_PROGRESS = frozenset({
    "last_epoch", "_step_count", "_is_initial", "_get_lr_called_within_step", "_last_lr",
    "base_lrs", "T_i", "T_cur", "best", "num_bad_epochs", "cooldown_counter", "mode_worse",
    "_schedule_phases"})
_MAX_LISTED = 5
_MAX_REPR = 60


@dataclass(frozen=True)
class Replaced:
    """A setting that a restore replaces: where it is (``"optimizer: weight_decay"``),
    the checkpoint's value and the script's."""

    what: str
    saved: str
    live: str

    def __str__(self) -> str:
        return f"{self.what} {self.saved} (the script's {self.live})"


def overridden(tracked: Mapping[str, Any], state: Mapping[str, Any]) -> list[Replaced]:
    """Each setting of a tracked optimizer or LR scheduler that loading ``state``
    (collect()'s tree) would replace."""
    found: list[Replaced] = []
    for name, obj in tracked.items():
        saved = state.get(name)
        if not isinstance(saved, Mapping):
            continue
        if isinstance(obj, torch.optim.Optimizer):
            found += _optimizer(name, obj, saved)
        elif _is_scheduler(obj):
            found += _settings(f"{name}: ", saved, obj.state_dict(), _SCHEDULER_PROGRESS)
    return found


def describe(found: list[Replaced]) -> str:
    """One line for the log."""
    more = len(found) - _MAX_LISTED
    listed = "; ".join(map(str, found[:_MAX_LISTED])) + (
        f"; and {more} more" if more > 0 else "")
    return ("restore: the checkpoint's settings replace the script's, as load_state_dict "
            f"does: {listed}. To train on with the script's, set them after ctx.restore() "
            "(opt.param_groups[i][key] = value, or the scheduler's attribute)")


def _is_scheduler(obj: Any) -> bool:
    sched = torch.optim.lr_scheduler
    return isinstance(obj, (sched.LRScheduler, sched.ReduceLROnPlateau))


def _optimizer(name: str, opt: torch.optim.Optimizer,
               saved: Mapping[str, Any]) -> list[Replaced]:
    groups = saved.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(opt.param_groups):
        return []   # not this optimizer's: restore's own check names it
    found: list[Replaced] = []
    for i, (ck, live) in enumerate(zip(groups, opt.param_groups)):
        if not isinstance(ck, Mapping):
            continue
        skip = _SCHEDULED_GROUP_KEYS
        if "max_momentum" in ck and "max_momentum" in live:
            skip = skip | _CYCLED_MOMENTUM
        where = f"{name}: " if len(groups) == 1 else f"{name}: param group {i} "
        found += _settings(where, ck, live, skip)
    return found


def _settings(where: str, ck: Mapping[str, Any], live: Mapping[str, Any],
              skip: frozenset[str]) -> list[Replaced]:
    """Plain values under the same key that differ; a chained scheduler's own schedulers
    (SequentialLR's ``_schedulers``) compared one by one."""
    found: list[Replaced] = []
    for key, theirs in ck.items():
        if key in skip or key not in live:
            continue
        ours = live[key]
        if key == "_schedulers" and isinstance(theirs, list) and isinstance(ours, list) \
                and len(theirs) == len(ours):
            for j, (a, b) in enumerate(zip(theirs, ours)):
                if isinstance(a, Mapping) and isinstance(b, Mapping):
                    found += _settings(f"{where}_schedulers[{j}].", a, b, skip)
        elif _plain(theirs) and _plain(ours) and _normal(theirs) != _normal(ours):
            found.append(Replaced(f"{where}{key}", _short(theirs), _short(ours)))
    return found


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_REPR else text[:_MAX_REPR - 3] + "..."


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, Mapping):   # MultiStepLR's milestones: a Counter
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return value is None or isinstance(value, (bool, int, float, str))


def _normal(value: Any) -> Any:
    """A tuple and a list of the same values are the same setting (betas), and so are two
    mappings of the same items (a Counter of milestones)."""
    if isinstance(value, (list, tuple)):
        return tuple(_normal(v) for v in value)
    if isinstance(value, Mapping):
        return sorted((_normal(k), _normal(v)) for k, v in value.items())
    return value
