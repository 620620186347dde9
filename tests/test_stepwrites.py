"""A failed step's buffer writes put back, and buffers as each rank's own state
(checkpoint/stepwrites.py), on a real batch-norm model."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

from resilient_train.checkpoint.stepwrites import (
    StepWrites,
    current_buffers,
    put_buffers,
)


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
    handle = writes.watch(opt)
    writes.boundary()
    model(torch.randn(16, 4)).sum().backward()
    versions = [p._version for p in model.parameters()]
    opt.step()
    assert [p._version for p in model.parameters()] == versions   # why versions miss it
    assert writes.undo().startswith("had already changed the model's parameters")
    writes.boundary()   # the next step's boundary: nothing stepped since
    assert writes.undo() == ""
    handle.remove()


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
