"""A failed step's buffer writes put back, and buffers as each rank's own state
(checkpoint/stepwrites.py), on a real batch-norm model."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from resilient_train.checkpoint.state.stepwrites import StepWrites, current_buffers, put_buffers


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    model.register_buffer("cache", torch.zeros(3), persistent=False)
    return model


def test_a_forward_s_batch_norm_writes_are_put_back_at_the_boundary_values() -> None:
    model = bn_model()
    tracked = {"model": model}
    writes = StepWrites(tracked)
    model(torch.randn(16, 4))
    writes.boundary()
    at_boundary = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.randn(16, 4))   # the failed step's forward: statistics move
    model.cache.add_(1)         # not training state: left as it is
    assert not torch.equal(model[1].running_mean, at_boundary["1.running_mean"])
    assert writes.undo() == ""
    for k, v in model.state_dict().items():
        assert torch.equal(v, at_boundary[k]), k
    assert torch.equal(model.cache, torch.ones(3))


def test_a_step_whose_optimizer_already_stepped_cannot_be_undone() -> None:
    model = bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writes = StepWrites({"model": model, "optimizer": opt})
    writes.boundary()
    model(torch.randn(16, 4)).sum().backward()
    opt.step()
    assert writes.undo().startswith("had already changed the model's parameters")
    assert StepWrites({"model": model}).undo().startswith("had begun before any step")


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, fused=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True)])
def test_a_fused_optimizer_s_step_is_seen_though_it_moves_no_version(make: Any) -> None:
    model = bn_model()
    opt = make(model.parameters())
    writes = StepWrites({"model": model, "optimizer": opt})
    handle = opt.register_step_pre_hook(lambda *_: writes.began())   # as the manager does
    writes.boundary()
    model(torch.randn(16, 4)).sum().backward()
    versions = [p._version for p in model.parameters()]
    opt.step()
    assert [p._version for p in model.parameters()] == versions   # why versions miss it
    assert writes.undo().startswith("had already changed the model's parameters")
    writes.boundary()   # the next step's boundary: nothing stepped since
    assert writes.undo() == ""
    handle.remove()


@pytest.mark.parametrize("fused", [False, True])
def test_a_gans_step_torn_between_its_optimizers_is_taken_back_when_asked(
        fused: bool) -> None:
    """undo_torn_steps: the discriminator's optimizer (fused or not: no version moves) and
    its scheduler stepped, then the generator's all-reduce would fail: the parameters,
    both optimizers' state and the scheduler go back to the step's start, and the
    batch norm's statistics to the boundary's."""
    def gan() -> tuple[dict[str, Any], list[Any]]:
        d, g = bn_model(), nn.Linear(4, 4)
        opt_d = torch.optim.AdamW(d.parameters(), fused=fused)
        opt_g = torch.optim.AdamW(g.parameters())
        tracked = {"d": d, "g": g, "opt_d": opt_d, "opt_g": opt_g,
                   "sched_d": torch.optim.lr_scheduler.StepLR(opt_d, 1, gamma=0.5)}
        return tracked, [opt_d, opt_g]

    def half_a_step(tracked: dict[str, Any]) -> None:
        d, g = tracked["d"], tracked["g"]
        d(g(torch.randn(16, 4))).sum().backward()
        tracked["opt_d"].step()
        tracked["sched_d"].step()
        d(g(torch.randn(16, 4))).sum().backward()   # the generator's: its peer is gone

    for before_step in (False, True):
        torch.manual_seed(1)
        tracked, opts = gan()
        writes = StepWrites(tracked, before_step=before_step)
        hooks = [o.register_step_pre_hook(lambda *_: writes.began()) for o in opts]
        half_a_step(tracked)            # a whole first step: the optimizers have state
        tracked["opt_g"].step()
        writes.boundary()
        at_start = {n: {k: v.clone() if isinstance(v, torch.Tensor) else v
                        for k, v in o.state_dict().items()}
                    for n, o in tracked.items() if isinstance(o, nn.Module)}
        opt_state = {n: repr(tracked[n].state_dict()) for n in ("opt_d", "opt_g", "sched_d")}
        half_a_step(tracked)
        torn = writes.undo()
        for h in hooks:
            h.remove()
        if not before_step:
            assert torn.startswith("had already changed the model's parameters"), torn
            assert "CheckpointOptions(undo_torn_steps=True) takes such a step back" in torn
            continue
        assert torn == ""
        for n, state in at_start.items():
            for k, v in tracked[n].state_dict().items():
                assert torch.equal(v, state[k]), (n, k)
        for n, was in opt_state.items():
            assert repr(tracked[n].state_dict()) == was, n
        writes.boundary()               # the copy goes with the step: the next is whole
        assert writes.undo() == ""


def test_a_torn_step_whose_copy_will_not_load_stays_torn_and_says_why() -> None:
    class Refuses:
        def state_dict(self) -> dict[str, Any]:
            return {"n": 1}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            raise ValueError("read-only")

    model = bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writes = StepWrites({"model": model, "optimizer": opt, "odd": Refuses()},
                        before_step=True)
    handle = opt.register_step_pre_hook(lambda *_: writes.began())
    writes.boundary()
    model(torch.randn(16, 4)).sum().backward()
    opt.step()
    handle.remove()
    assert writes.undo() == "could not be taken back to its start (ValueError: read-only)"


def test_a_rank_s_own_buffers_go_over_the_replicated_ones() -> None:
    mine, theirs = bn_model(), bn_model()
    mine(torch.randn(16, 4))
    own = current_buffers({"model": mine})
    assert set(own["model"]) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    put_buffers({"model": theirs}, own)
    for k in own["model"]:
        assert torch.equal(theirs.get_buffer(k), mine.get_buffer(k)), k


def test_buffers_the_model_lacks_are_skipped_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    model = bn_model()
    with caplog.at_level(logging.WARNING):
        put_buffers({"model": model}, {"model": {"9.running_mean": torch.zeros(8),
                                                 "1.running_var": torch.full((8,), 2.0)}})
    assert "9.running_mean" in caplog.text
    assert torch.equal(model[1].running_var, torch.full((8,), 2.0))


def test_a_tracked_scalers_step_is_unwrapped_when_its_manager_closes(tmp_path: Path) -> None:
    """Each life's manager wraps a tracked GradScaler's step (its ring copy, its count of
    steps); a scaler built once, outside the training function, must not carry one
    wrapper per life, nor lose a wrapper of the user's own."""
    from resilient_train import CheckpointManager

    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for _life in range(2):
        with CheckpointManager(tmp_path / "ckpt") as mgr:
            mgr.track(scaler=scaler)
            assert "step" in vars(scaler)
        assert "step" not in vars(scaler)
        assert scaler.step.__func__ is torch.amp.GradScaler.step   # type: ignore[attr-defined]

    def theirs(*args: object) -> None: ...
    scaler.step = theirs   # type: ignore[method-assign]
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.track(scaler=scaler)
        assert scaler.step is not theirs
    assert scaler.step is theirs


@contextlib.contextmanager
def _told(key: str) -> Iterator[list[str]]:
    """What checkpoint/advice.py tells the script meanwhile, with ``key`` (said once per
    process) unsaid first."""
    from resilient_train import lifecycle

    lifecycle.unsay(key)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("resilient_train.checkpoint.state.advice")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def _accumulating_run(tmp_path: Path, *, accumulate: int, skip_all: bool = False) -> str:
    """Six steps, saved every second one; the optimizer steps every ``accumulate``-th
    (a GradScaler that skips every step when ``skip_all``). What the script is told."""
    from resilient_train import CheckpointManager, CheckpointOptions

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=float("inf") if skip_all else 1.0,
                                  enabled=skip_all)
    with _told("accumulation") as told, CheckpointManager(
            tmp_path / "ckpt", options=CheckpointOptions(save_every_steps=2,
                                                         async_save=False)) as mgr:
        mgr.track(model=model, optimizer=opt, scaler=scaler)
        for step in range(6):
            scaler.scale(model(torch.randn(8, 4)).pow(2).mean()).backward()
            if (step + 1) % accumulate == 0:
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
            mgr.maybe_save(step + 1)
    return "\n".join(told)


def test_a_save_in_the_middle_of_gradients_accumulated_over_steps_is_named(
        tmp_path: Path) -> None:
    """Gradients accumulated over three ctx.steps steps: the saves at steps 2 and 4 hold
    no partial sum, so a restore would not resume exactly. Said once, at the first; not
    for one optimizer step per step, nor for a GradScaler skipping its steps."""
    log = _accumulating_run(tmp_path / "acc", accumulate=3)
    assert log.count("follows a step that ran no optimizer step") == 1, log
    assert "the checkpoint of step 2 follows" in log
    assert "make one ctx.steps step one optimizer step" in log
    assert "no optimizer step" not in _accumulating_run(tmp_path / "one", accumulate=1)
    assert "no optimizer step" not in _accumulating_run(tmp_path / "skip", accumulate=1,
                                                         skip_all=True)


def _untracked_run(tmp_path: Path, *, track_optimizer: bool, manual: bool = False) -> str:
    """Six steps of Adam (or SGD by hand, ``manual``), saved every second one, with the
    optimizer tracked or not. What the script is told."""
    from resilient_train import CheckpointManager, CheckpointOptions

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    with _told("untracked optimizer") as told, CheckpointManager(
            tmp_path / "ckpt", options=CheckpointOptions(save_every_steps=2,
                                                         async_save=False)) as mgr:
        mgr.track(model=model, **({"optimizer": opt} if track_optimizer else {}))
        for step in range(6):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            if manual:
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 0.1 * p.grad
            else:
                opt.step()
            mgr.maybe_save(step + 1)
    return "\n".join(told)


def test_an_optimizer_left_untracked_is_named_once(tmp_path: Path) -> None:
    """ctx.track(model=model) without the optimizer: Adam's moments and step count are in
    no checkpoint, and a restart begins them afresh. The parameters changed with no tracked
    optimizer step: said once, at the first save; not when the optimizer is tracked."""
    log = _untracked_run(tmp_path / "untracked", track_optimizer=False)
    assert log.count("no tracked optimizer stepped") == 1, log
    assert "the parameters of model changed between steps 1 and 2" in log
    assert "ctx.track(model=model, optimizer=opt)" in log
    assert "no tracked optimizer" not in _untracked_run(tmp_path / "tracked",
                                                        track_optimizer=True)
    # Updates by hand are named too (nothing tells them apart), with that case in it.
    assert "updates of your own that keep no state need nothing" in _untracked_run(
        tmp_path / "manual", track_optimizer=False, manual=True)


def test_an_lr_scheduler_left_untracked_is_named_once(tmp_path: Path) -> None:
    """An optimizer driven by a StepLR that is not tracked: a restart would begin the
    schedule afresh. Said at the first step, naming the optimizer; not when the scheduler
    (or a SequentialLR over it) is tracked."""
    from resilient_train import CheckpointManager

    def first_step_log(tmp: Path, track_sched: bool, sequential: bool = False) -> str:
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched: torch.optim.lr_scheduler.LRScheduler = torch.optim.lr_scheduler.StepLR(opt, 2)
        if sequential:
            sched = torch.optim.lr_scheduler.SequentialLR(
                opt, [torch.optim.lr_scheduler.LinearLR(opt, total_iters=2), sched], [2])
        with _told("untracked scheduler") as told, CheckpointManager(tmp / "ckpt") as mgr:
            mgr.track(model=model, opt=opt, **({"sched": sched} if track_sched else {}))
            for step in range(3):
                model(torch.randn(8, 4)).pow(2).mean().backward()
                opt.step()
                sched.step()
                mgr.maybe_save(step + 1)
        return "\n".join(told)

    log = first_step_log(tmp_path / "untracked", track_sched=False)
    assert log.count("is driven by an LR scheduler") == 1, log
    assert "the optimizer opt is driven by an LR scheduler" in log
    assert "LR scheduler" not in first_step_log(tmp_path / "tracked", track_sched=True)
    assert "LR scheduler" not in first_step_log(tmp_path / "seq", track_sched=True,
                                                sequential=True)


def test_a_model_left_untracked_is_named_once(tmp_path: Path) -> None:
    """Nothing tracked, or only the optimizer: every checkpoint holds the step count but
    not the weights, so a restart would resume the count with the model as built. Said at
    the first step; not when a module, or an object of the script's own with a
    state_dict, holds the weights."""
    from resilient_train import CheckpointManager

    class Weights:   # the script's own holder of its weights
        def __init__(self, model: nn.Module) -> None:
            self.model = model

        def state_dict(self) -> dict[str, Any]:
            return self.model.state_dict()

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.model.load_state_dict(sd)

    def first_step_log(tmp: Path, which: str) -> str:
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tracked = {"none": {}, "opt": {"optimizer": opt},
                   "model": {"model": model, "optimizer": opt},
                   "own": {"weights": Weights(model), "optimizer": opt}}[which]
        with _told("untracked model") as told, CheckpointManager(tmp / "ckpt") as mgr:
            mgr.track(**tracked)
            for step in range(2):
                model(torch.randn(8, 4)).pow(2).mean().backward()
                opt.step()
                mgr.maybe_save(step + 1)
        return "\n".join(told)

    log = first_step_log(tmp_path / "none", "none")
    assert log.count("no model is tracked") == 1, log
    assert "no model is tracked (nothing tracked): every checkpoint holds the step count" in log
    assert "ctx.track(model=model, optimizer=opt)" in log
    assert "no model is tracked (only optimizer tracked)" in first_step_log(
        tmp_path / "opt", "opt")
    for which in ("model", "own"):
        assert "no model" not in first_step_log(tmp_path / which, which)


def test_one_object_tracked_under_two_names_is_named_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A model and its wrapper tracked side by side are one module: saved twice."""
    from resilient_train import CheckpointManager

    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="resilient_train.checkpoint.state.advice"), \
            CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.track(model=model, optimizer=opt)
        mgr.track(wrapped=nn.DataParallel(model))   # the module underneath: the same one
        mgr.track(other=nn.Linear(4, 1))
    said = [r.getMessage() for r in caplog.records if "are one object" in r.getMessage()]
    assert said == ["'model' and 'wrapped' are one object (a model and its DDP or "
                    "torch.compile wrapper are tracked as the module underneath): every "
                    "checkpoint holds it 2 times; track it once"], caplog.text
