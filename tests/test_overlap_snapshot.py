"""The overlapped snapshot (state.HostSnapshot's ``defer``): an async save copies the
parameters and optimizer state while the next step's forward and backward run, and the next
optimizer step waits for that copy. What is saved is the state at the save, exactly."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

import resilient_train as rt
from resilient_train.checkpoint.state.capture import HostSnapshot


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.BatchNorm1d(2048),
                                torch.nn.Linear(2048, 512))
    return model, torch.optim.Adam(model.parameters(), lr=0.5)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 512)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_the_save_holds_the_state_it_was_taken_at_while_the_next_step_runs(
        tmp_path: Path, monkeypatch) -> None:
    # The background copy starts only once the next optimizer step is about to run, and
    # then takes its time: an optimizer step that did not wait for it would change the
    # parameters under it, and the checkpoint would hold the next step's.
    reached_step = threading.Event()
    copy = HostSnapshot._copy_later

    def late_copy(self: HostSnapshot, pairs: list) -> None:
        reached_step.wait(timeout=30)
        time.sleep(0.2)   # gives an optimizer step that does not wait the time to finish
        copy(self, pairs)

    monkeypatch.setattr(HostSnapshot, "_copy_later", late_copy)
    model, opt = make()
    opt.register_step_pre_hook(lambda *_: reached_step.set())   # before the manager's
    mgr = rt.CheckpointManager(tmp_path, options=rt.CheckpointOptions(async_save=True))
    mgr.track(model=model, optimizer=opt)
    step(model, opt)                                 # optimizer state exists now
    reached_step.clear()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_moments = opt.state_dict()["state"][0]["exp_avg"].clone()
    mgr.save(1)
    # Parameters and moments (what only the optimizer writes) are copied in the background;
    # batch norm's running statistics (which a forward writes) were copied before save()
    # returned.
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert mgr._snapshot.deferred_bytes >= 3 * params   # params + two Adam moments
    step(model, opt)                                 # the forward writes running stats; the
    mgr.close()                                      # optimizer step waits for the copy
    assert not torch.equal(model.state_dict()["1.running_mean"], want["1.running_mean"])

    model2, opt2 = make()
    mgr2 = rt.CheckpointManager(tmp_path)
    mgr2.track(model=model2, optimizer=opt2)
    assert mgr2.restore_latest() == 1
    got = model2.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], want_moments)
    mgr2.close()


def test_without_overlap_nothing_is_deferred(tmp_path: Path) -> None:
    model, opt = make()
    mgr = rt.CheckpointManager(tmp_path, options=rt.CheckpointOptions(
        async_save=True, overlap_snapshot=False))
    mgr.track(model=model, optimizer=opt)
    step(model, opt)
    mgr.save(1)
    assert mgr._snapshot.deferred_bytes == 0
    mgr.close()
