"""A seeded discrete-event simulation of a training job, to evaluate any SavePolicy.

    simulate(auto_interval(), step_time_s=0.5, save_block_s=2, save_write_s=20,
             restart_s=60, mtbf_s=3600, total_steps=500_000, seed=0).goodput

The job runs ``total_steps`` steps of ``step_time_s``. After every step but the last the
policy is asked, with a SaveContext built as CheckpointManager builds it. A save first
waits for the one in flight to commit (one at a time, as the manager), then blocks training
for ``save_block_s`` (the snapshot) and commits ``save_write_s`` after it started (or
after the block, when that is longer: a blocking save). Failures arrive as a Poisson
process on wall time (mean ``mtbf_s``, also during saves and restarts); each costs
everything since the last *committed* save plus ``restart_s``, and the job resumes from
that save's step, in a fresh process: with a fresh copy of the policy, the measured save
cost forgotten, and the time of the last save the restored checkpoint's commit time
(``manifest.created``).

Every second of wall time lands in exactly one bucket: ``productive_s`` (the steps that
survive: ``total_steps * step_time_s``), ``lost_s`` (steps computed again after a failure,
including the one it interrupted), ``recovery_s`` (restarts) and ``checkpoint_s`` (time
the loop was blocked by saves). ``goodput = productive_s / wall_s``.

Fast: it skips from event to event (a save, a failure, the end). For the built-in
conditions (``every_n_steps``, ``every``, ``auto_interval``, ``never`` and their ``|``
and ``&``) it computes the next step at which the policy would save, checking the answer
against the policy itself; any other policy is asked step by step.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from .policies import (
    SaveContext,
    SavePolicy,
    _All,
    _Any,
    auto_interval,
    every,
    every_n_steps,
    never,
)


@dataclass(frozen=True)
class SimResult:
    wall_s: float
    productive_s: float
    lost_s: float
    recovery_s: float
    checkpoint_s: float
    failures: int
    saves: int          # saves that finished blocking (whether or not they committed)
    goodput: float      # productive_s / wall_s
    finished: bool = True   # False: stopped at max_wall_s (productive_s: the steps kept)


def simulate(policy: SavePolicy, *, step_time_s: float, save_block_s: float,
             save_write_s: float, restart_s: float, mtbf_s: float, total_steps: int,
             seed: int = 0, max_wall_s: float | None = None) -> SimResult:
    """Run the job once; the same ``seed`` gives the same failure times (on wall time)
    whatever the policy, so policies compare on common random numbers.

    A policy that saves too rarely for the failure rate may never finish: the run stops
    at ``max_wall_s`` (default: 20 times the failure-free time) with ``finished=False``.
    """
    if step_time_s <= 0 or total_steps < 1:
        raise ValueError("simulate needs step_time_s > 0 and total_steps >= 1")
    if min(save_block_s, save_write_s, restart_s) < 0 or not mtbf_s > 0:
        raise ValueError("simulate needs non-negative save and restart times and mtbf_s > 0")
    dt, block = float(step_time_s), float(save_block_s)
    write = max(block, float(save_write_s))
    rng = random.Random(seed)
    cap = 20 * total_steps * dt if max_wall_s is None else float(max_wall_s)

    def next_failure(after: float) -> float:
        return math.inf if math.isinf(mtbf_s) else after + rng.expovariate(1.0 / mtbf_s)

    t = 0.0                        # wall clock
    fail_at = next_failure(t)
    step = 0                       # steps done (and kept, so far)
    committed: tuple[int, float] | None = None   # (step, commit time) restored on a failure
    inflight: tuple[int, float] | None = None    # (step, commit time) of the last save
    last_save_step: int | None = None
    last_save_time = 0.0
    cost: float | None = None      # the manager's measured blocking (an EMA)
    live = copy.deepcopy(policy)   # each process builds its own: a fresh copy per life
    lost = recovery = checkpoint = 0.0
    failures = saves = 0

    while True:
        # Steps run from (t, step) until the policy saves, the job ends or a failure.
        seg_t, seg_step = t, step
        ctx = _contexts(seg_t, seg_step, dt, last_save_step, last_save_time, cost)
        want = _first_save(live, ctx, step + 1, total_steps - 1)
        target = total_steps if want is None else want
        t_target = seg_t + (target - seg_step) * dt
        if min(t_target, fail_at) > cap:         # give up: keep what is done at the cap
            step = min(target, seg_step + int((cap - seg_t) / dt)) if cap > seg_t else step
            t = max(t, seg_t + (step - seg_step) * dt)
            return SimResult(t, step * dt, lost, recovery, checkpoint, failures, saves,
                             step * dt / t if t else 0.0, finished=False)
        at: float | None = None    # when a failure struck, if one did
        if fail_at < t_target:
            at = fail_at
            done = min(target - seg_step - 1, int((fail_at - seg_t) / dt))
            step = seg_step + done
            lost += fail_at - (seg_t + done * dt)          # the step it interrupted
        else:
            t, step = t_target, target
            if want is None:
                break
            # save(): wait for the save in flight, then the snapshot blocks the loop.
            t0 = t
            if inflight is not None and inflight[1] > t:
                if fail_at < inflight[1]:
                    at = fail_at
                else:
                    t = inflight[1]
            if at is None:
                if inflight is not None:
                    committed = inflight
                if fail_at < t + block:
                    at = fail_at
                else:
                    t += block
                    checkpoint += t - t0
                    saves += 1
                    inflight = (step, t - block + write)
                    last_save_step, last_save_time = step, t
                    cost = t - t0 if cost is None else 0.7 * cost + 0.3 * (t - t0)
                    continue
            checkpoint += at - t0
        # A failure at `at`: back to the last committed save, after a restart.
        failures += 1
        if inflight is not None and inflight[1] <= at:
            committed = inflight
        resume = committed[0] if committed else 0
        lost += (step - resume) * dt
        while True:
            fail_at = next_failure(at)
            if fail_at >= at + restart_s:
                break
            failures += 1
            recovery += fail_at - at
            at = fail_at
        recovery += restart_s
        t = at + restart_s
        step, inflight, cost = resume, None, None
        live = copy.deepcopy(policy)
        last_save_step = committed[0] if committed else None
        last_save_time = committed[1] if committed else t

    productive = total_steps * dt
    return SimResult(t, productive, lost, recovery, checkpoint, failures, saves,
                     productive / t)


def _contexts(t0: float, step0: int, dt: float, last_save_step: int | None,
              last_save_time: float, cost: float | None) -> Callable[[int], SaveContext]:
    """The SaveContext at each step of a run of steps from (t0, step0) without a save."""
    def ctx(s: int) -> SaveContext:
        return SaveContext(s, t0 + (s - step0) * dt, last_save_step, last_save_time, cost)
    return ctx


def _first_save(policy: SavePolicy, ctx: Callable[[int], SaveContext], lo: int,
                hi: int) -> int | None:
    """The first step in [lo, hi] at which ``policy`` saves (None if none), where
    ``ctx(s)`` is the context at step s with no save in between."""
    if lo > hi:
        return None
    kind = type(policy)
    if kind is never:
        return None
    if kind is every_n_steps:
        assert isinstance(policy, every_n_steps)
        s = -(-lo // policy.n) * policy.n
        if s == ctx(s).last_save_step:
            s += policy.n
        return s if s <= hi else None
    if kind is every or kind is auto_interval:
        c = ctx(lo)   # first: auto_interval's clock starts at the first step it sees
        due = (c.last_save_time + policy.seconds if isinstance(policy, every)
               else cast(auto_interval, policy).due(c))
        if math.isinf(due):
            return None
        # The estimate, then corrected against the policy itself (float rounding).
        s = max(lo, lo + math.ceil((due - c.now) / (ctx(lo + 1).now - c.now)))
        while s > lo and policy.should_save(ctx(s - 1)):
            s -= 1
        while s <= hi and not policy.should_save(ctx(s)):
            s += 1
        return s if s <= hi else None
    if kind is _Any:
        assert isinstance(policy, _Any)
        found = [s for s in (_first_save(policy.a, ctx, lo, hi),
                             _first_save(policy.b, ctx, lo, hi)) if s is not None]
        return min(found) if found else None
    if kind is _All:
        assert isinstance(policy, _All)
        sa, sb = _first_save(policy.a, ctx, lo, hi), _first_save(policy.b, ctx, lo, hi)
        while sa is not None and sb is not None and sa != sb:
            if sa < sb:
                sa = _first_save(policy.a, ctx, sb, hi)
            else:
                sb = _first_save(policy.b, ctx, sa, hi)
        return sa if sa is not None and sa == sb else None
    for s in range(lo, hi + 1):    # any other policy: ask at every step
        if policy.should_save(ctx(s)):
            return s
    return None
