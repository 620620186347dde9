"""A script edited between runs: the settings the restore replaces are named.

torch's ``load_state_dict`` keeps the checkpoint's optimizer hyperparameters and the
checkpoint's schedule; a script whose weight decay or ``T_max`` changed resumes with the
old ones. Real checkpoints on disk, a real restore.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import resilient_train as rt
from resilient_train.checkpoint.state.overrides import overridden

LOGGER = "resilient_train.checkpoint.state.tracked"   # where a restore loads
Build = Callable[[torch.nn.Module], tuple[torch.optim.Optimizer, Any]]


def cosine(wd: float, t_max: int) -> Build:
    def build(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=wd)
        return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=t_max)
    return build


def run(tmp_path: Path, build: Build, steps: int) -> tuple[torch.optim.Optimizer, Any]:
    """Train ``steps`` steps and save (``steps`` > 0), or restore the latest (0)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt, sched = build(model)
    mgr = rt.CheckpointManager(tmp_path, options=rt.CheckpointOptions(async_save=False))
    mgr.track(model=model, optimizer=opt, scheduler=sched)
    if steps:
        for step in range(steps):
            model(torch.randn(8, 4)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            mgr.maybe_save(step + 1)
        mgr.save(steps)
    else:
        assert mgr.restore_latest() == 5
    mgr.close()
    return opt, sched


def test_an_edited_weight_decay_and_schedule_are_named_and_the_checkpoints_win(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run(tmp_path, cosine(wd=0.1, t_max=100), steps=5)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        opt, sched = run(tmp_path, cosine(wd=0.01, t_max=200), steps=0)
    said = [r.getMessage() for r in caplog.records if "settings replace" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert "optimizer: weight_decay 0.1 (the script's 0.01)" in said[0]
    assert "scheduler: T_max 100 (the script's 200)" in said[0]
    assert "set them after ctx.restore()" in said[0]
    # What torch does, and what the line says: the checkpoint's settings are in force.
    assert opt.param_groups[0]["weight_decay"] == 0.1 and sched.T_max == 100
    # Once per setting in a process: the next life (here with other values, as a script
    # that sets its weight decay by hand each step has) does not say it again.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        run(tmp_path, cosine(wd=0.02, t_max=300), steps=0)
    assert "settings replace" not in caplog.text


def test_an_unchanged_script_is_not_named_although_its_rates_moved(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The scheduled lr, OneCycleLR's cycled betas and the schedulers' positions differ
    between a fresh build and a checkpoint five steps in: none is a setting."""
    def one_cycle(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        first = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=20)
        return opt, first

    for build in (cosine(wd=0.1, t_max=100), one_cycle):
        run(tmp_path / build.__name__, build, steps=5)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            run(tmp_path / build.__name__, build, steps=0)
    assert "settings replace" not in caplog.text


def test_chained_schedules_grouped_params_and_milestones_are_compared() -> None:
    def state(t_max: int, milestones: list[int], wd: float) -> tuple[dict[str, Any], Any]:
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD([{"params": [model.weight]},
                               {"params": [model.bias], "weight_decay": wd}],
                              lr=0.1, momentum=0.9)
        warm = torch.optim.lr_scheduler.LinearLR(opt, 0.1, total_iters=3)
        cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=t_max)
        seq = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[3])
        steps = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=milestones)
        tracked = {"optimizer": opt, "schedule": seq, "decay": steps}
        return tracked, {k: v.state_dict() for k, v in tracked.items()}

    _, saved = state(t_max=50, milestones=[10, 20], wd=0.0)
    tracked, _ = state(t_max=80, milestones=[10, 30], wd=0.0)
    assert list(map(str, overridden(tracked, saved))) == [
        "schedule: _schedulers[1].T_max 50 (the script's 80)",
        "decay: milestones Counter({10: 1, 20: 1}) (the script's Counter({10: 1, 30: 1}))"]
    tracked, _ = state(t_max=50, milestones=[10, 20], wd=0.5)
    assert list(map(str, overridden(tracked, saved))) == [
        "optimizer: param group 1 weight_decay 0.0 (the script's 0.5)"]
