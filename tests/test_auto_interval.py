"""The auto save interval (issue 6): Daly's formula, its bounds, where the MTBF comes from,
the manager's measured save cost, and the simulator that shows it maximizes goodput."""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from resilient_train.checkpoint.manager import CheckpointManager, CheckpointOptions
from resilient_train.checkpoint.schedule.policies import (
    FOUR_HOURS,
    MTBF_ENV,
    PRIOR_MTBF_S,
    SaveContext,
    SavePolicy,
    auto_interval,
    daly_interval,
    every,
    every_n_steps,
    resolve_mtbf,
)
from resilient_train.checkpoint.schedule.simulate import SimResult, simulate
from resilient_train.observe.telemetry import FAILURES_ENV, ObservedMtbf, write_failures


@pytest.fixture(autouse=True)
def _no_mtbf_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MTBF_ENV, raising=False)
    monkeypatch.delenv(FAILURES_ENV, raising=False)


def ctx(step: int, now: float, last_step: int | None = None, last_time: float = 0.0,
        cost: float | None = None) -> SaveContext:
    return SaveContext(step, now, last_step, last_time, cost)


# --- the formula ----------------------------------------------------------------------------

def test_daly_formula_against_hand_computed_values() -> None:
    # C = 2 s, M = 600 s: sqrt(2400) = 48.98979, C/2M = 1/600,
    # factor 1 + 0.0408248/3 + 0.0016667/9 = 1.0137935 -> 49.66553 - 2
    assert daly_interval(2, 600) == pytest.approx(47.66553, abs=1e-4)
    # C = 10 s, M = 1 h: sqrt(72000) = 268.32816, C/2M = 1/720,
    # factor 1 + 0.0372678/3 + 0.0013889/9 = 1.0125769 -> 271.70290 - 10
    assert daly_interval(10, 3600) == pytest.approx(261.7029, abs=1e-3)
    # C = 0.12 s, M = 6 h: sqrt(5184) = 72, C/2M = 2.7778e-6,
    # factor 1 + 0.0016667/3 + 3.1e-7 = 1.00055586 -> 72.04002 - 0.12
    assert daly_interval(0.12, 6 * 3600) == pytest.approx(71.92002, abs=1e-4)
    assert daly_interval(100, 50) == 50          # C >= 2M: save once per MTBF
    assert daly_interval(0, 3600) == 0
    assert daly_interval(1, math.inf) == math.inf
    with pytest.raises(ValueError):
        daly_interval(1, 0)


def test_interval_is_bounded_to_floor_and_four_hours() -> None:
    p = auto_interval(24 * 3600)
    assert p.interval(1e-4) == 30.0                        # optimum 4.2 s: the floor
    assert p.interval(2.0) == pytest.approx(daly_interval(2.0, 24 * 3600))
    assert auto_interval(math.inf).interval(1.0) == FOUR_HOURS
    assert auto_interval(1e9).interval(600.0) == FOUR_HOURS  # optimum 31 h: the ceiling
    assert auto_interval(3600, floor_s=5, ceiling_s=60).interval(2.0) == 60
    assert auto_interval(3600, floor_s=5).interval(0.001) == 5
    with pytest.raises(ValueError, match="floor_s <= ceiling_s"):
        auto_interval(3600, floor_s=100, ceiling_s=10)
    with pytest.raises(ValueError, match="positive MTBF"):
        auto_interval(0)


def test_mtbf_comes_from_the_argument_then_declared_then_observed_then_prior(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert resolve_mtbf() == (PRIOR_MTBF_S, f"prior; set {MTBF_ENV} to declare it")
    log_file = tmp_path / "failures.json"     # the launcher's failure log: one failure
    write_failures(log_file, time.time() - 7200, 1)   # in two hours of running
    monkeypatch.setenv(FAILURES_ENV, str(log_file))
    mtbf, source = resolve_mtbf()
    assert source == "observed" and mtbf == pytest.approx(7200, abs=60)
    monkeypatch.setenv(MTBF_ENV, "21600")
    assert resolve_mtbf() == (21600.0, "declared")
    assert resolve_mtbf(600) == (600.0, "given")
    p = auto_interval()
    assert (p.mtbf_s, p.mtbf_source) == (21600.0, "declared")

    monkeypatch.setenv(MTBF_ENV, "six hours")
    with pytest.raises(ValueError, match=MTBF_ENV):
        auto_interval()
    monkeypatch.delenv(MTBF_ENV)
    log_file.write_text("not json")                     # the launcher's: never fatal
    assert resolve_mtbf()[0] == PRIOR_MTBF_S


def test_saves_after_the_floor_until_a_save_has_been_measured() -> None:
    p = auto_interval(3600)
    assert not p.should_save(ctx(1, now=0.0))               # the clock starts here
    assert not p.should_save(ctx(50, now=29.9))
    assert p.should_save(ctx(51, now=30.0))                 # the first opportunity
    assert not p.should_save(ctx(51, now=30.0, last_step=51))
    # measured: the Daly interval from the end of that save
    tau = daly_interval(0.5, 3600)
    assert not p.should_save(ctx(52, now=30.5 + tau - 0.1, last_step=51, last_time=30.5,
                                 cost=0.5))
    assert p.should_save(ctx(53, now=30.5 + tau, last_step=51, last_time=30.5, cost=0.5))


def test_after_a_restart_the_interval_runs_from_the_restart_the_ceiling_from_the_save() -> None:
    # The restored checkpoint was committed 10 min before this process's first step: saving
    # its state again at once would only cost a save.
    p = auto_interval(3600)
    assert not p.should_save(ctx(101, now=1000.0, last_step=100, last_time=400.0))
    assert not p.should_save(ctx(150, now=1029.0, last_step=100, last_time=400.0))
    assert p.should_save(ctx(151, now=1030.0, last_step=100, last_time=400.0))
    # ...but the platform's 4 hours count from the last commit
    q = auto_interval(1e9)
    old = 1000.0 - FOUR_HOURS + 60
    assert not q.should_save(ctx(101, now=1000.0, last_step=100, last_time=old, cost=600))
    assert q.should_save(ctx(150, now=1060.0, last_step=100, last_time=old, cost=600))


def test_logs_one_line_when_the_interval_changes_by_more_than_ten_percent(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(MTBF_ENV, str(6 * 3600))
    p = auto_interval()
    with caplog.at_level(logging.INFO, logger="resilient_train.checkpoint.schedule.policies"):
        p.should_save(ctx(1, now=0.0))
        for cost in (0.12, 0.121, 0.125, 0.2, 0.0001):
            p.should_save(ctx(2, now=1.0, cost=cost))
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("auto checkpoint interval 30 s until the first save")
    assert lines[1] == ("auto checkpoint interval 72 s: a save blocks training 0.12 s, mean "
                        "time between failures 6 h (declared), Young/Daly optimum, "
                        "bounded to [30 s, 4 h]")
    assert lines[2].startswith("auto checkpoint interval 93 s: a save blocks training 0.2 s")
    assert "raised to the floor" in lines[3]
    assert len(lines) == 4                                  # 0.121 and 0.125: within 10 %


def test_save_cost_defaults_to_none_and_the_fixed_conditions_ignore_it() -> None:
    assert SaveContext(5, 1.0, None, 0.0).save_cost_s is None
    for cost in (None, 3.0):
        assert every_n_steps(5).should_save(ctx(5, now=0, cost=cost))
        assert not every_n_steps(5).should_save(ctx(6, now=0, cost=cost))
        assert every(60).should_save(ctx(7, now=60, cost=cost))
        assert not every(60).should_save(ctx(7, now=59, cost=cost))


# --- the manager measures the cost ------------------------------------------------------------

@dataclass
class Spy(SavePolicy):
    inner: SavePolicy
    seen: list[SaveContext]

    def should_save(self, ctx: SaveContext) -> bool:
        self.seen.append(ctx)
        return self.inner.should_save(ctx)


def test_manager_passes_the_measured_blocking_time(tmp_path: Path) -> None:
    spy = Spy(every_n_steps(2), [])
    # max_interval_s=None: mgr.policy is then the spy itself, not spy | every(4 h).
    with CheckpointManager(tmp_path / "c", options=CheckpointOptions(
            policy=spy, max_interval_s=None)) as mgr:
        mgr.track(model=torch.nn.Linear(4, 4))
        for step in range(1, 6):
            mgr.maybe_save(step)
    assert spy.seen == []                                   # each life uses its own copy
    costs = [c.save_cost_s for c in mgr.policy.seen]        # type: ignore[attr-defined]
    assert costs[:2] == [None, None]                        # until the first save
    assert all(c is not None and 0 < c < 10 for c in costs[2:])
    assert costs[2] != costs[4]                             # an EMA: the second save moved it


class TwoRanks:
    """Rank 0 of two; the other rank reports ``theirs`` to every all-reduce."""

    rank, world_size = 0, 2

    def __init__(self, theirs: list[int]) -> None:
        self.theirs = theirs

    def broadcast(self, obj: Any) -> Any:
        return obj

    def allreduce_max(self, values: list[int]) -> list[int]:
        assert len(values) == len(self.theirs)
        return [max(a, b) for a, b in zip(values, self.theirs)]

    def gather(self, payload: Any) -> list[Any] | None:
        raise AssertionError("no save in this test")


def test_multi_rank_uses_the_slowest_ranks_cost(tmp_path: Path) -> None:
    spy = Spy(every_n_steps(10**9), [])
    # The peer's clock, stride, SIGTERM (-1: none), save cost, MTBF, tier write times.
    coord = TwoRanks([0, 1, -1, -1, -1, -1, -1, 0])        # the peer has not saved yet
    with CheckpointManager(tmp_path / "c", options=CheckpointOptions(
            policy=spy, max_interval_s=None),               # mgr.policy: the spy itself
            coordinator=coord) as mgr:                      # type: ignore[arg-type]
        spy = mgr.policy                                    # type: ignore[assignment]
        mgr.maybe_save(1)
        assert spy.seen[-1].save_cost_s is None
        mgr.scheduler.save_cost = 0.25                      # as if this rank had saved
        coord.theirs = [0, 1, -1, 1_500_000, -1, -1, -1, 0]   # the peer: 1.5 s
        mgr.scheduler.next_sync_step = 0
        mgr.maybe_save(2)
        assert spy.seen[-1].save_cost_s == 1.5
        coord.theirs = [0, 1, -1, 100_000, -1, -1, -1, 0]
        mgr.scheduler.next_sync_step = 0
        mgr.maybe_save(3)
        assert spy.seen[-1].save_cost_s == 0.25


def test_observed_mtbf_follows_the_launchers_failure_log(tmp_path: Path) -> None:
    log_file = tmp_path / "failures.json"
    observed = ObservedMtbf(log_file)
    assert observed.at(1000.0) is None                      # no log: unknown
    write_failures(log_file, since=100.0, failures=2)
    assert observed.at(1100.0) == 500.0                     # 1000 s of running, 2 failures
    assert observed.at(1300.0) == 600.0                     # time between failures grows
    write_failures(log_file, since=100.0, failures=4)
    os.utime(log_file, (os.stat(log_file).st_atime, os.stat(log_file).st_mtime + 1))
    assert observed.at(1300.0) == 300.0


def test_auto_interval_takes_the_observed_mtbf_over_the_prior_only() -> None:
    prior = auto_interval(floor_s=1.0)
    assert prior.mtbf_source.startswith("prior")
    long_interval = prior.interval(2.0)
    prior.observe(600.0)                                    # failures every 10 min
    assert (prior.mtbf_s, prior.mtbf_source) == (600.0, "observed")
    assert prior.interval(2.0) == pytest.approx(daly_interval(2.0, 600.0))
    assert prior.interval(2.0) < long_interval / 5
    prior.observe(630.0)                                    # within 10%: no churn
    assert prior.mtbf_s == 600.0
    given = auto_interval(3600.0)
    given.observe(600.0)                                    # the user's figure stands
    assert (given.mtbf_s, given.mtbf_source) == (3600.0, "given")


def test_the_primarys_observed_mtbf_reaches_every_ranks_policy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A surviving primary started before any failure: only the live log tells it.
    log_file = tmp_path / "failures.json"
    monkeypatch.setenv(FAILURES_ENV, str(log_file))
    spy = Spy(every_n_steps(10**9), [])
    coord = TwoRanks([0, 1, -1, -1, -1, -1, -1, 0])
    with CheckpointManager(tmp_path / "c", options=CheckpointOptions(
            policy=spy, max_interval_s=None),               # mgr.policy: the spy itself
            coordinator=coord) as mgr:                      # type: ignore[arg-type]
        spy = mgr.policy                                    # type: ignore[assignment]
        mgr.maybe_save(1)
        assert spy.seen[-1].mtbf_s is None
        write_failures(log_file, since=mgr.clock() - 120.0, failures=3)
        mgr.scheduler.next_sync_step = 0
        mgr.maybe_save(2)
        assert spy.seen[-1].mtbf_s == pytest.approx(40.0, abs=1.0)


# --- the simulator ------------------------------------------------------------------------------

JOB: dict[str, Any] = {"step_time_s": 0.5, "save_block_s": 2.0, "save_write_s": 20.0,
                       "restart_s": 60.0}


def accounted(r: SimResult) -> float:
    return r.productive_s + r.lost_s + r.recovery_s + r.checkpoint_s


@pytest.mark.parametrize("policy", [every_n_steps(10), every_n_steps(300), every(600),
                                    auto_interval(900), every_n_steps(50) | every(20)])
def test_simulator_accounting_adds_up(policy: SavePolicy) -> None:
    for seed in range(3):
        r = simulate(policy, mtbf_s=900, total_steps=20_000, seed=seed, **JOB)
        assert r.finished and r.failures > 0 and r.saves > 0
        assert accounted(r) == pytest.approx(r.wall_s, rel=1e-12, abs=1e-6)
        assert r.productive_s == 20_000 * 0.5 and min(r.lost_s, r.recovery_s) > 0
        assert r.goodput == pytest.approx(r.productive_s / r.wall_s)
        assert r == simulate(policy, mtbf_s=900, total_steps=20_000, seed=seed, **JOB)


def test_simulator_without_failures_saves_exactly_every_n() -> None:
    r = simulate(every_n_steps(100), mtbf_s=math.inf, total_steps=10_000, seed=0, **JOB)
    assert (r.failures, r.saves) == (0, 99)      # asked after every step but the last
    assert r.lost_s == r.recovery_s == 0
    assert r.wall_s == pytest.approx(10_000 * 0.5 + 99 * 2.0)
    # saves closer than the write: each one waits for the previous commit
    r = simulate(every_n_steps(10), mtbf_s=math.inf, total_steps=1_000, seed=0, **JOB)
    # (a save blocks 2 s, the next comes 5 s later, 13 s before the commit)
    assert r.saves == 99 and r.checkpoint_s == pytest.approx(2.0 + 98 * (2.0 + 13.0))


class Opaque(SavePolicy):
    """Hides the policy's type: the simulator must ask it step by step."""

    def __init__(self, inner: SavePolicy) -> None:
        self.inner = inner

    def should_save(self, ctx: SaveContext) -> bool:
        return self.inner.should_save(ctx)


@pytest.mark.parametrize("make", [lambda: every_n_steps(70), lambda: every(45.0),
                                  lambda: auto_interval(600),
                                  lambda: every_n_steps(100) | every(30.0),
                                  lambda: every_n_steps(7) & every(40.0)])
def test_simulator_skipping_ahead_equals_asking_every_step(make: Any) -> None:
    for seed in range(2):
        fast = simulate(make(), mtbf_s=600, total_steps=6_000, seed=seed, **JOB)
        slow = simulate(Opaque(make()), mtbf_s=600, total_steps=6_000, seed=seed, **JOB)
        assert fast == slow and fast.failures > 0


def test_simulator_gives_up_on_a_job_that_cannot_finish() -> None:
    r = simulate(every(FOUR_HOURS), mtbf_s=600, total_steps=100_000, seed=0, **JOB)
    assert not r.finished and r.goodput < 0.01
    assert accounted(r) == pytest.approx(r.wall_s)


# --- the check: auto beats every fixed interval at every failure rate -------------------

FIXED: dict[str, Any] = {
    "every 10": lambda: every_n_steps(10),
    "every 100": lambda: every_n_steps(100),
    "every 1000": lambda: every_n_steps(1000),
    "every 4 h": lambda: every(FOUR_HOURS),
}


def sweep(mtbf_s: float, seeds: range, total_steps: int) -> dict[str, float]:
    policies = {"auto": lambda: auto_interval(mtbf_s), **FIXED}
    return {name: statistics.mean(
        simulate(make(), mtbf_s=mtbf_s, total_steps=total_steps, seed=seed, **JOB).goodput
        for seed in seeds) for name, make in policies.items()}


@pytest.mark.parametrize("mtbf_s", [600, 3600, 6 * 3600, 24 * 3600])
def test_auto_goodput_is_at_least_every_fixed_interval(mtbf_s: float) -> None:
    goodput = sweep(mtbf_s, range(3), total_steps=2 * 86400 * 2)   # 2 days of 0.5 s steps
    best_fixed = max(goodput[name] for name in FIXED)
    assert goodput["auto"] >= best_fixed - 0.005, goodput
