"""When to save: small composable conditions, like tenacity's stop conditions.

    every_n_steps(1000) | every(hours=4)      # whichever comes first (the default shape)

A condition sees the step just finished and the time since the last commit; ``|`` saves
when either says so, ``&`` when both do.

    auto_interval()                           # the interval that maximizes goodput

``auto_interval`` picks the interval from the measured cost of a save and the mean time
between failures (Young/Daly); ``schedule/simulate.py`` evaluates any policy on a simulated job.

The checkpoint options join the platform's 4-hour ceiling to whatever policy is given
(:func:`with_ceiling`): ``policy | every(max_interval_s)``; :func:`check_ceiling` refuses
a policy that the ceiling would silently overrule.
"""

from __future__ import annotations

import logging
import math
import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple

from ...observe.telemetry import ObservedMtbf  # the launcher's failure log: the job's own faults
from ...text import format_duration

log = logging.getLogger(__name__)

FOUR_HOURS = 4 * 3600.0
MTBF_ENV = "RESILIENT_TRAIN_MTBF_S"                    # declared by the user
PRIOR_MTBF_S = 24 * 3600.0


class SaveContext(NamedTuple):
    """What a policy sees after each step. Immutable; a NamedTuple because one is built per
    training step, and a frozen dataclass costs 1.7 us to build against 0.3 us."""

    step: int                      # the step just finished (1-based count of steps done)
    now: float                     # seconds, any monotonic-ish clock
    last_save_step: int | None     # step of the last commit (or of the restored checkpoint)
    last_save_time: float          # time of the last commit, or when training (re)started
    # How long one save blocks the training loop (an average), the same on every rank;
    # None until a save has been measured.
    save_cost_s: float | None = None
    # The job's observed mean time between failures (the launcher's failure log, read on
    # the primary), the same on every rank; None when unknown.
    mtbf_s: float | None = None


class SavePolicy(ABC):
    @abstractmethod
    def should_save(self, ctx: SaveContext) -> bool: ...

    def __or__(self, other: SavePolicy) -> SavePolicy:
        return _Any(self, other)

    def __and__(self, other: SavePolicy) -> SavePolicy:
        return _All(self, other)


@dataclass(frozen=True)
class _Any(SavePolicy):
    a: SavePolicy
    b: SavePolicy

    def should_save(self, ctx: SaveContext) -> bool:
        return self.a.should_save(ctx) or self.b.should_save(ctx)


@dataclass(frozen=True)
class _All(SavePolicy):
    a: SavePolicy
    b: SavePolicy

    def should_save(self, ctx: SaveContext) -> bool:
        return self.a.should_save(ctx) and self.b.should_save(ctx)


@dataclass(frozen=True)
class every_n_steps(SavePolicy):
    n: int

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int):
            raise TypeError(f"every_n_steps needs a whole number of steps, found {self.n!r}")
        if self.n < 1:
            raise ValueError(f"every_n_steps needs n >= 1, found {self.n}")

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step % self.n == 0 and ctx.step != ctx.last_save_step


@dataclass(frozen=True)
class every(SavePolicy):
    """At most ``seconds`` after the last commit (the platform asks for 4 hours)."""

    seconds: float = FOUR_HOURS

    def __post_init__(self) -> None:
        if not self.seconds > 0:  # NaN too
            raise ValueError(f"every needs a positive interval, found {self.seconds} s")

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.now - ctx.last_save_time >= self.seconds and ctx.step != ctx.last_save_step


@dataclass(frozen=True)
class never(SavePolicy):
    """No automatic saves. Under CheckpointOptions it needs ``max_interval_s=None`` too:
    the 4-hour ceiling would otherwise still save (see :func:`check_ceiling`)."""

    def should_save(self, ctx: SaveContext) -> bool:
        return False


def _nodes(policy: SavePolicy) -> list[SavePolicy]:
    """``policy`` and every condition it is composed of with ``|`` and ``&``."""
    out: list[SavePolicy] = []
    todo = [policy]
    while todo:
        p = todo.pop()
        out.append(p)
        if isinstance(p, (_Any, _All)):
            todo += [p.b, p.a]
    return out


def _hours(seconds: float) -> str:
    return f"{seconds:g} s" if seconds < 3600 else f"{seconds:g} s ({format_duration(seconds)})"


def check_ceiling(policy: SavePolicy, max_interval_s: float | None) -> None:
    """Refuse a policy that the ceiling ``max_interval_s`` (None: none) would overrule in
    silence: ``never()`` (it would still save at the ceiling), ``every(s)`` or
    ``auto_interval(ceiling_s=s)`` with ``s`` above it (they would save at the ceiling)."""
    if max_interval_s is None:
        return
    ceiling = f"max_interval_s={max_interval_s:g}"   # the field of CheckpointOptions
    if isinstance(policy, never):
        raise ValueError(  # noqa: TRY004 - two values that contradict, not a wrong type
            f"CheckpointOptions: policy=never() contradicts {ceiling} (the ceiling, on by "
            f"default, saves {_hours(max_interval_s)} after the last commit): for no "
            f"automatic saves write "
            f"CheckpointOptions(policy=never(), max_interval_s=None); to save only at the "
            f"ceiling, drop policy")
    for node in _nodes(policy):
        if isinstance(node, every) and node.seconds > max_interval_s:
            asked, field_ = node.seconds, f"every({node.seconds:g})"
        elif isinstance(node, auto_interval) and node.ceiling_s > max_interval_s:
            asked, field_ = node.ceiling_s, f"auto_interval(ceiling_s={node.ceiling_s:g})"
        else:
            continue
        raise ValueError(
            f"CheckpointOptions: policy={field_} contradicts {ceiling}: the ceiling would "
            f"save {_hours(max_interval_s)} after the last commit, before the "
            f"{_hours(asked)} the policy asks for; to save less often, raise the ceiling "
            f"by name (max_interval_s={asked:g}, or None for no ceiling)")


def with_ceiling(policy: SavePolicy | None, max_interval_s: float | None) -> SavePolicy:
    """``policy``, and a save at most ``max_interval_s`` after the last commit (the
    platform's 4 hours) whatever the policy says; None: no ceiling. The policy is asked
    first, on every step: a stateful one (auto_interval) sees every step."""
    if max_interval_s is None:
        return policy if policy is not None else never()
    return every(max_interval_s) if policy is None else policy | every(max_interval_s)


def default_save_policy(every_steps: int | None = None,
                        max_interval_s: float | None = FOUR_HOURS) -> SavePolicy:
    """Every N steps (when given) or at most ``max_interval_s`` after the last commit."""
    return with_ceiling(every_n_steps(every_steps) if every_steps else None, max_interval_s)


# --- auto: the interval that maximizes goodput ------------------------------------------

def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """The optimum compute time between two saves that each cost ``cost_s``, for failures
    arriving at rate ``1/mtbf_s`` (a Poisson process).

    J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart
    dumps", Future Generation Computer Systems 22(3), 2006, eq. (37):
    ``tau = sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C`` for ``C < 2M``, else
    ``M``. Its first term is Young's (1974) ``sqrt(2 C M)``. Neither the restart time nor
    the delay of an async commit (a constant added to every failure's loss) moves it.
    """
    if cost_s < 0 or not mtbf_s > 0:
        raise ValueError(f"daly_interval needs cost >= 0 and MTBF > 0, found {cost_s}, {mtbf_s}")
    if math.isinf(mtbf_s):
        return math.inf
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    x = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - cost_s


def resolve_mtbf(mtbf_s: float | None = None) -> tuple[float, str]:
    """The mean time between failures to plan for, and where it came from: the argument,
    else ``RESILIENT_TRAIN_MTBF_S`` (declared by the user), else the job's own faults so
    far (the launcher's failure log, ``RESILIENT_TRAIN_FAILURES_FILE``: the one channel
    by which the observed MTBF reaches a worker), else a 24-hour prior."""
    if mtbf_s is not None:
        if not mtbf_s > 0:
            raise ValueError(f"auto_interval needs a positive MTBF, found {mtbf_s} s")
        return float(mtbf_s), "given"
    raw = os.environ.get(MTBF_ENV, "").strip()
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not value > 0:
            raise ValueError(f"{MTBF_ENV}={raw!r}: expected a positive number of seconds")
        return value, "declared"
    log_file = ObservedMtbf.from_env()
    observed = log_file.at(time.time()) if log_file is not None else None
    if observed is not None:   # None too when the log is unreadable: never fatal
        return observed, "observed"
    return PRIOR_MTBF_S, f"prior; set {MTBF_ENV} to declare it"


class auto_interval(SavePolicy):
    """Save when the time since the last save reaches the interval that maximizes goodput.

    The interval is Daly's optimum (:func:`daly_interval`) for ``C`` = the time one save
    blocks the training loop (async saves block only for the snapshot, plus any wait for
    the previous save; the manager measures it and passes it as ``SaveContext.save_cost_s``)
    and ``M`` = the mean time between failures (:func:`resolve_mtbf`), bounded to
    ``[floor_s, ceiling_s]`` (the ceiling is the platform's 4 hours; CheckpointOptions
    refuses a ``ceiling_s`` above its ``max_interval_s``). Before a save has been
    measured it saves after ``floor_s``: that first save measures the cost. Logs one line
    (INFO) whenever the interval changes by more than 10 %::

        CheckpointOptions(policy=rt.auto_interval())          # or auto_interval(6 * 3600)

    The interval runs from the last save or from the first step this policy saw, whichever
    is later: after a restart the restored checkpoint may be older than the interval, but
    the work at risk starts at the restart, and saving the restored state again at once
    would only cost a save. The ceiling still runs from the last save.
    """

    def __init__(self, mtbf_s: float | None = None, *, floor_s: float = 30.0,
                 ceiling_s: float = FOUR_HOURS) -> None:
        if not 0 < floor_s <= ceiling_s:
            raise ValueError(f"auto_interval needs 0 < floor_s <= ceiling_s, "
                             f"found {floor_s}, {ceiling_s}")
        self.floor_s, self.ceiling_s = float(floor_s), float(ceiling_s)
        self.mtbf_s, self.mtbf_source = resolve_mtbf(mtbf_s)
        self._cost: float | None = None
        self._interval = self.floor_s
        self._logged: float | None = None
        self._origin: float | None = None   # ctx.now of the first step seen

    def __repr__(self) -> str:
        return (f"auto_interval(mtbf_s={self.mtbf_s:g} ({self.mtbf_source}), "
                f"floor_s={self.floor_s:g}, ceiling_s={self.ceiling_s:g})")

    def interval(self, save_cost_s: float | None) -> float:
        """Seconds from the end of one save to the start of the next."""
        if save_cost_s is None:
            return self.floor_s
        if save_cost_s != self._cost:
            self._cost = save_cost_s
            tau = daly_interval(max(0.0, save_cost_s), self.mtbf_s)
            self._interval = min(max(tau, self.floor_s), self.ceiling_s)
            self._log_change(save_cost_s, tau)
        return self._interval

    def observe(self, mtbf_s: float | None) -> None:
        """The job's observed MTBF, as it changes: replaces a prior or an older observation
        (never a given or declared one) once it differs by more than 10%."""
        if mtbf_s is None or not mtbf_s > 0 or self.mtbf_source in ("given", "declared"):
            return
        if self.mtbf_source == "observed" and abs(mtbf_s - self.mtbf_s) <= 0.1 * self.mtbf_s:
            return
        self.mtbf_s, self.mtbf_source = float(mtbf_s), "observed"
        self._cost = None   # recompute the interval at the next call

    def due(self, ctx: SaveContext) -> float:
        """The time (on ``ctx.now``'s clock) from which it saves, given ``ctx``'s last save
        and cost."""
        if ctx.mtbf_s is not None:
            self.observe(ctx.mtbf_s)
        if self._origin is None:
            self._origin = ctx.now
            if ctx.save_cost_s is None:
                log.info("auto checkpoint interval %s until the first save measures its "
                         "cost (mean time between failures %s, %s)",
                         format_duration(self.floor_s), format_duration(self.mtbf_s),
                         self.mtbf_source)
        start = max(ctx.last_save_time, self._origin)
        return min(start + self.interval(ctx.save_cost_s), ctx.last_save_time + self.ceiling_s)

    def should_save(self, ctx: SaveContext) -> bool:
        due = self.due(ctx)
        return ctx.step != ctx.last_save_step and ctx.now >= due

    def _log_change(self, cost: float, tau: float) -> None:
        new, old = self._interval, self._logged
        if old is not None and abs(new - old) <= 0.1 * old:
            return
        self._logged = new
        if tau < self.floor_s:
            how = f"Young/Daly optimum {format_duration(tau)} raised to the floor"
        elif tau > self.ceiling_s:
            how = f"Young/Daly optimum {format_duration(tau)} lowered to the ceiling"
        else:
            how = "Young/Daly optimum"
        log.info("auto checkpoint interval %s: a save blocks training %s, mean time between "
                 "failures %s (%s), %s, bounded to [%s, %s]", format_duration(new),
                 format_duration(cost), format_duration(self.mtbf_s), self.mtbf_source, how,
                 format_duration(self.floor_s), format_duration(self.ceiling_s))
