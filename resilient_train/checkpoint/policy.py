"""When to save: small composable conditions, like tenacity's stop conditions.

    every_n_steps(1000) | every(hours=4)      # whichever comes first (the default shape)

A condition sees the step just finished and the time since the last commit; ``|`` saves
when either says so, ``&`` when both do.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

FOUR_HOURS = 4 * 3600.0


@dataclass(frozen=True)
class SaveContext:
    step: int                      # the step just finished (1-based count of steps done)
    now: float                     # seconds, any monotonic-ish clock
    last_save_step: int | None     # step of the last commit (or of the restored checkpoint)
    last_save_time: float          # time of the last commit, or when training (re)started


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
        if self.n < 1:
            raise ValueError(f"every_n_steps needs n >= 1, found {self.n}")

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step % self.n == 0 and ctx.step != ctx.last_save_step


@dataclass(frozen=True)
class every(SavePolicy):
    """At most ``seconds`` after the last commit (the platform asks for 4 hours)."""

    seconds: float = FOUR_HOURS

    def __post_init__(self) -> None:
        if self.seconds <= 0:
            raise ValueError(f"every needs a positive interval, found {self.seconds} s")

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.now - ctx.last_save_time >= self.seconds and ctx.step != ctx.last_save_step


@dataclass(frozen=True)
class never(SavePolicy):
    def should_save(self, ctx: SaveContext) -> bool:
        return False


def default_save_policy(every_steps: int | None = None, max_interval_s: float = FOUR_HOURS) -> SavePolicy:
    """Every N steps (when given) or at most ``max_interval_s`` after the last commit."""
    timed: SavePolicy = every(max_interval_s)
    return every_n_steps(every_steps) | timed if every_steps else timed
