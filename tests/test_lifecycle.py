"""What outlives a life: one Lifecycle object, owned by the loop that runs the lives."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

import resilient_train as rt
from resilient_train import lifecycle
from resilient_train.checkpoint.tiers.peers import PeerMemory, process_memory


def test_a_part_keeps_one_object_across_lives_made_at_first_use() -> None:
    life = lifecycle.Lifecycle()
    made: list[int] = []

    def make() -> list[int]:
        made.append(1)
        return []

    first = life.kept("thing", make)
    assert life.kept("thing", make) is first and made == [1]


def test_the_installed_lifecycle_is_current_and_the_outer_one_comes_back() -> None:
    outer, inner = lifecycle.Lifecycle(), lifecycle.Lifecycle()
    with outer.installed():
        assert lifecycle.current() is outer
        with inner.installed():
            assert lifecycle.current() is inner
            assert process_memory() is inner.kept("peer memory", PeerMemory)
        assert lifecycle.current() is outer
    assert lifecycle.current() not in (outer, inner)   # the process's own


def test_each_life_is_counted_and_its_context_is_the_running_one() -> None:
    life = lifecycle.Lifecycle()
    with life.installed():
        for n in (1, 2):
            ctx = object()
            with life.running(ctx):
                assert lifecycle.running_context() is ctx and life.lives == n
            assert lifecycle.running_context() is None


def test_said_once_is_per_lifecycle(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("rt-test-lifecycle")
    with caplog.at_level(logging.WARNING, logger=log.name):
        for _ in range(2):   # two runs of a job in one process: each says it once
            with lifecycle.Lifecycle().installed():
                for _ in range(3):   # three lives of one run
                    lifecycle.say_once(log, "k", logging.WARNING, "said")
    assert [r.getMessage() for r in caplog.records] == ["said", "said"]


def test_each_rt_main_call_owns_the_lifecycle_its_lives_share(tmp_path: Path) -> None:
    seen: list[tuple[Any, Any, Any]] = []

    @rt.main(options=rt.MainOptions(checkpoint_dir=str(tmp_path), final_save=False))
    def train(ctx: rt.Context) -> None:
        life = lifecycle.current()
        seen.append((life, process_memory(), lifecycle.running_context() is ctx))

    train()
    train()
    (life1, memory1, running1), (life2, memory2, running2) = seen
    assert running1 and running2
    # A second run in the same process starts from nothing the first one left.
    assert life1 is not life2 and memory1 is not memory2
    assert life1.lives == life2.lives == 1
    assert lifecycle.current() not in (life1, life2)   # each call's, for its duration only
