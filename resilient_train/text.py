"""Text for a person, written the same way everywhere: one line of a message, a duration."""

from __future__ import annotations

import math

__all__ = ["first_line", "format_duration"]


def first_line(what: BaseException | str | None, *, limit: int = 200) -> str:
    """The first non-blank line of a message, at most ``limit`` characters ("..." marks a
    cut). An exception reads ``Type: message`` (its type alone when it has no message);
    None reads "no answer" (a call that returned nothing to show)."""
    if what is None:
        return "no answer"
    if isinstance(what, BaseException):
        text = f"{type(what).__name__}: {what}" if str(what).strip() else type(what).__name__
    else:
        text = what
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[:limit - 3] + "..."


def format_duration(seconds: float, *, fixed: bool = False) -> str:
    """A duration for a person, in the fewest digits that say it: 0.2 s, 72 s, 12.5 min,
    6 h (inf for never). ``fixed`` keeps a fixed number of places, for columns that are
    read side by side: 0.35 s, 2.00 s, 12.3 s, 4 min 05 s, 2 h 03 min."""
    if math.isinf(seconds):
        return "inf"
    if not fixed:
        if seconds < 10:
            return f"{seconds:.3g} s"
        if seconds < 600:
            return f"{seconds:.0f} s"
        if seconds < 7200:
            return f"{seconds / 60:.1f} min".replace(".0 ", " ")
        return f"{seconds / 3600:.1f} h".replace(".0 ", " ")
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        m, s = divmod(round(seconds), 60)
        return f"{m} min {s:02d} s"
    h, m = divmod(round(seconds / 60), 60)
    return f"{h} h {m:02d} min"
