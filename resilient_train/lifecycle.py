"""What outlives one life of the training function in this process.

A life is one call of the function under ``@rt.main`` (or ``group.run``); after a peer's
restart the survivors call it again in-process. What the next life needs from the last
one lives in one :class:`Lifecycle` object that the loop running the lives owns and hands
to each life: the peers' state in memory (checkpoint/tiers/peers.py), the telemetry page,
the life running now (the data loader asks for it), what was said once. The modules that
use these keep none of it themselves.

The loop installs its Lifecycle for as long as it runs (:meth:`Lifecycle.installed`);
code deep in a life (a warning said once, a standalone checkpoint manager) reaches it
through :func:`current`. Without a loop, a process gets one of its own on first use, so
that a manager used on its own behaves as in one long life.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(eq=False)
class Lifecycle:
    """One process's state across the lives of its training function."""

    # What this process has said once (advice, a fallback's reason): every life would say
    # it again, and a job's log should say it once.
    said: set[str] = field(default_factory=set)
    context: Any = None      # the life running now (rt.main's Context), or None
    lives: int = 0           # lives begun
    # The parts' state that outlives a life, by name (kept()).
    _kept: dict[str, Any] = field(default_factory=dict)

    def kept(self, name: str, make: Callable[[], T]) -> T:
        """The state a part keeps across lives under ``name``, made by ``make()`` at first
        use: the peers' memory, the telemetry page."""
        if name not in self._kept:
            self._kept[name] = make()
        return self._kept[name]  # type: ignore[no-any-return]

    @contextlib.contextmanager
    def installed(self) -> Iterator[Lifecycle]:
        """This object is :func:`current` while the loop that owns it runs."""
        _installed.append(self)
        try:
            yield self
        finally:
            _installed.remove(self)

    @contextlib.contextmanager
    def running(self, context: Any) -> Iterator[None]:
        """For the duration of one life: ``context`` is the life running."""
        self.lives += 1
        self.context = context
        try:
            yield
        finally:
            self.context = None


# The Lifecycle of the loop running in this process (the innermost), else the process's
# own; set only by Lifecycle.installed(), read only by current().
_installed: list[Lifecycle] = []
_own: list[Lifecycle] = []


def current() -> Lifecycle:
    """The Lifecycle of the life loop running in this process; without one, the
    process's own."""
    if _installed:
        return _installed[-1]
    if not _own:
        _own.append(Lifecycle())
    return _own[0]


def running_context() -> Any | None:
    """The Context of the ``rt.main`` life running in this process, or None."""
    return current().context


def said(key: str) -> bool:
    """Whether ``key`` was said in this process (a caller whose message costs to build
    asks first)."""
    return key in current().said


def say_once(logger: logging.Logger, key: str, level: int, message: str, *args: Any) -> None:
    """Log ``message`` at ``level`` unless ``key`` was said before in this process."""
    seen = current().said
    if key not in seen:
        seen.add(key)
        logger.log(level, message, *args)


def unsay(key: str) -> None:
    """Forget that ``key`` was said (a test that checks a message says it again)."""
    current().said.discard(key)
