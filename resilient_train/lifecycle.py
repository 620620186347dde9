"""What outlives one life of the training function in this process.

A life is one call of the function under ``@rt.main``; after a peer's restart the
survivors call it again in-process. What the next life needs from the last one is owned
here, not by the modules that use it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

# The life running in this process, if one is: data.py asks, to say once that a loader
# iterated under rt.main is not tracked. One pointer per process, as a life is one per
# process at a time; set and cleared only by running().
_running: list[Any] = []


@contextlib.contextmanager
def running(context: Any) -> Iterator[None]:
    """For the duration of a life: ``context`` is the one :func:`current` returns."""
    _running.append(context)
    try:
        yield
    finally:
        _running.remove(context)


def current() -> Any | None:
    """The Context of the ``rt.main`` life running in this process, or None."""
    return _running[-1] if _running else None


# What this process has said once (advice, a fallback's reason): every life would say it
# again, and a job's log should say it once.
_said: set[str] = set()


def said(key: str) -> bool:
    """Whether ``key`` was said in this process (a caller whose message costs to build
    asks first)."""
    return key in _said


def say_once(logger: logging.Logger, key: str, level: int, message: str, *args: Any) -> None:
    """Log ``message`` at ``level`` unless ``key`` was said before in this process."""
    if key not in _said:
        _said.add(key)
        logger.log(level, message, *args)


def unsay(key: str) -> None:
    """Forget that ``key`` was said (a test that checks a message says it again)."""
    _said.discard(key)
