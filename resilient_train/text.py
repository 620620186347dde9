"""Text for a person, written the same way everywhere: one line of a message, a duration."""

from __future__ import annotations

import math
import re

__all__ = ["error_line", "first_line", "format_duration"]


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


# What gloo's errors begin with (the C++ source of the error) and the advice torch appends
# to them: in a one-line summary they crowd out what happened.
_CPP_LOCATION = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|cu|h|hpp):[0-9]+\]\s*")
_TORCH_ADVICE = re.compile(r"\.?\s*This is typically caused by .*", re.DOTALL)
# What torch's store client adds to a failed read, whatever the cause.
_STORE_ADVICE = re.compile(r"\.?\s*Connection was likely closed\. Did the remote server "
                           r"shutdown or crash\?")


def error_line(what: BaseException | str, *, limit: int = 200) -> str:
    """:func:`first_line` of an error, less a leading C++ source location and torch's
    advice: ``RuntimeError: Connection closed by peer [127.0.0.1]:22428`` for gloo's
    ``[/__w/.../pair.cc:553] Connection closed by peer [127.0.0.1]:22428. This is
    typically caused by a remote worker crashing. Check the logs ...``, and ``Failed to
    recv, got 0 bytes`` for the store's ``... got 0 bytes. Connection was likely closed.
    Did the remote server shutdown or crash?``."""
    text = _STORE_ADVICE.sub("", str(what))
    location = _CPP_LOCATION.match(text)
    if location is not None:
        text = _TORCH_ADVICE.sub("", text[location.end():])
    if not text.strip():
        return first_line(what, limit=limit)
    if isinstance(what, BaseException):
        text = f"{type(what).__name__}: {text}"
    return first_line(text, limit=limit)


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


# The longest duration any option, fault or job spec field means: a year. Longer is a
# typo, or a number float() reads as infinity, which no sleep, timer or deadline takes.
MAX_DURATION_S = 365 * 24 * 3600.0
MAX_DURATION_TEXT = "at most 8760h (365 days)"
