"""One interface for every recovery tier: a tier added by one class, and the manager's
order (fastest first, each faster tier saying why it could not serve)."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from resilient_train.checkpoint.commit.directory import scan
from resilient_train.checkpoint.manager import CheckpointManager, CheckpointOptions
from resilient_train.checkpoint.tiers.tier import SaveRequest, TierDefaults
from resilient_train.checkpoint.tiers.restored import Restored, RestoreRecord


class ShelfTier(TierDefaults):
    """A toy tier: every save kept in a dict (think: a cache service next to the job)."""

    name = "shelf"

    def __init__(self, shelf: dict[int, dict[str, Any]]) -> None:
        self.shelf = shelf
        self.loaded: list[int] = []   # restores this tier saw loaded (from any tier)

    def takes(self, save: SaveRequest) -> bool:
        return not save.sharded

    def needs_shared(self, save: SaveRequest) -> bool:
        return True

    def write(self, save: SaveRequest, snap: dict[str, Any],
              ready: Callable[[], None]) -> bool:
        ready()
        self.shelf[save.step] = copy.deepcopy({"shared": snap["shared"], "rank": snap["rank"],
                                               "at": time.time()})
        return True

    def restore(self, sharded: bool) -> Restored | str:
        if not self.shelf:
            return "the shelf is empty"
        step = max(self.shelf)
        kept = copy.deepcopy(self.shelf[step])
        return Restored(RestoreRecord(step=step, source=self.name, seconds=0.0,
                                      bytes_read={self.name: 1}),
                        step=step, shared=kept["shared"], mine=kept["rank"], last_commit=None,
                        save_point=(step, kept["at"]), message=f"restored step {step} from "
                                                                f"the shelf")

    def restored(self, got: Restored) -> None:
        self.loaded.append(got.step or 0)


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _train(directory: Path, shelf: dict[int, dict[str, Any]], steps: range,
           start_from: int | None = None) -> tuple[CheckpointManager, torch.nn.Module, int | None]:
    torch.manual_seed(0)
    model, opt = _model()
    mgr = CheckpointManager(directory, tiers=(ShelfTier(shelf),), options=CheckpointOptions(
        save_every_steps=2, async_save=False))
    mgr.track(model=model, optimizer=opt)
    restored = mgr.restore_latest()
    assert restored == start_from
    for step in steps:
        opt.zero_grad()
        model(torch.randn(8, 4)).square().mean().backward()
        opt.step()
        mgr.maybe_save(step)
    mgr.close()
    return mgr, model, restored


def test_a_tier_added_by_one_class_takes_every_save_and_serves_the_restore(
        tmp_path: Path) -> None:
    shelf: dict[int, dict[str, Any]] = {}
    _, model, _ = _train(tmp_path / "ckpt", shelf, range(1, 6))
    assert sorted(shelf) == [2, 4]
    # A tier in memory does not replace storage: every save reached the persistent tier.
    assert [i.step for i in scan(_storage(tmp_path / "ckpt")) if i.committed] \
        == [2, 4]

    shelf[4]["shared"]["model"]["weight"].fill_(7.0)   # the shelf's copy is the one loaded
    mgr, again, _ = _train(tmp_path / "ckpt", shelf, range(5, 5), start_from=4)
    assert mgr.last_restore is not None
    assert mgr.last_restore.source == "shelf" and mgr.last_restore.reason == ""
    assert torch.equal(again.weight, torch.full_like(again.weight, 7.0))


def test_an_empty_tier_says_why_and_the_next_one_serves(tmp_path: Path) -> None:
    _train(tmp_path / "ckpt", {}, range(1, 4))   # saved step 2 to both
    shelf: dict[int, dict[str, Any]] = {}          # ... and the shelf was lost since
    mgr, _, _ = _train(tmp_path / "ckpt", shelf, range(3, 3), start_from=2)
    assert mgr.last_restore is not None
    assert mgr.last_restore.source == "persistent"
    assert mgr.last_restore.reason == "the shelf is empty"


def test_the_restored_step_resumes_bitwise_like_a_run_without_a_restart(tmp_path: Path) -> None:
    _, whole, _ = _train(tmp_path / "a", {}, range(1, 9))
    shelf: dict[int, dict[str, Any]] = {}
    _train(tmp_path / "b", shelf, range(1, 5))
    mgr, resumed, _ = _train(tmp_path / "b", shelf, range(5, 9), start_from=4)
    assert mgr.last_restore is not None and mgr.last_restore.source == "shelf"
    # The RNG streams came back from the shelf too: the same batches, the same weights.
    assert torch.equal(whole.weight, resumed.weight) and torch.equal(whole.bias, resumed.bias)


def _storage(path: Path) -> Any:
    from resilient_train.checkpoint.storage.base import Storage

    return Storage(str(path))
