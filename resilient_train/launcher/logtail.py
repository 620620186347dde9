"""What the last lines of a worker's log say: its traceback, and whether a peer's
connection failed under it. Pure functions of the lines, so they are tested on real logs.

torch prefixes every line of an uncaught exception's report with the process's rank once
the process group exists (``init_process_group`` installs a ``sys.excepthook`` that writes
``[rank0]: Traceback ...``), and its C++ log lines start ``[rank0]:[W1201 23:53:48 ...]``;
torchrun's log tee adds ``[default0]:`` in front of both.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..errors import traceback_excerpt

__all__ = ["PEER_CONNECTION_ERROR", "BacktraceFolder", "peer_connection_error", "strip_prefix",
           "traceback_from_log"]

# A run of "[rank0]:" / "[default1]:" tags, then a space for a line of Python's own report;
# a C++ log line follows the tags with "[" at once (its severity and time).
_PREFIX = re.compile(r"^((?:\[[A-Za-z_]*\d+\]:)+)(?: (.*)|(.*))$", re.DOTALL)

# What a process says in its log when a peer of its process group (or the store's host)
# went away under one of its collectives: gloo, NCCL, the TCPStore and torch's error types.
# The one place that knows these words; the launcher matches it against a failed replica's
# log tail. (errors.PEER_LOST_MESSAGES classifies exceptions in-process, a wider net.)
PEER_CONNECTION_ERROR = re.compile(
    r"Connection (?:closed|reset) by peer|Broken pipe|Connection was likely closed"
    r"|Socket closed|DistNetworkError|DistBackendError|remote process exited"
    r"|ncclRemoteError|NCCL communicator was aborted",
    re.IGNORECASE)

_MAX_QUOTED = 300   # characters of the matching line kept for the job record


def strip_prefix(line: str) -> tuple[str, str | None]:
    """(the rank tags, the line without them) for a line of Python's report under torch;
    (``""``, the line) for an untagged one; (the tags, None) for a tagged C++ log line."""
    m = _PREFIX.match(line)
    if m is None:
        return "", line
    if m.group(2) is not None:
        return m.group(1), m.group(2)
    # "[rank0]:" alone is an empty line of the report; "[rank0]:[W...]" a C++ log line.
    return m.group(1), None if m.group(3) else ""


def traceback_from_log(lines: Iterable[str]) -> str | None:
    """The log's last traceback, bounded by ``traceback_excerpt``; None without one.

    A tagged traceback (``[rank0]: Traceback ...``) is read from the lines with the same
    tags only, untagged: another rank's lines, C++ log lines (``[rank0]:[W...]``) and
    untagged output around it stay out. An untagged one runs to the end of the log."""
    parsed = [(line, *strip_prefix(line)) for line in lines]
    starts = [i for i, (_, _, body) in enumerate(parsed)
              if body is not None and body.startswith("Traceback")]
    if not starts:
        return None
    start = starts[-1]
    tags = parsed[start][1]
    if not tags:
        text = [raw for raw, _, _ in parsed[start:]]
    else:
        text = [body for _, t, body in parsed[start:] if t == tags and body is not None]
    return traceback_excerpt("\n".join(text))


def peer_connection_error(lines: Iterable[str]) -> str | None:
    """The last line that says a peer's connection failed (without rank tags, shortened),
    or None."""
    found = None
    for line in lines:
        if PEER_CONNECTION_ERROR.search(line):
            found = line
    if found is None:
        return None
    _, body = strip_prefix(found)
    text = (body if body is not None else found).strip()
    return text if len(text) <= _MAX_QUOTED else text[:_MAX_QUOTED - 3] + "..."


# A C++ exception's backtrace as torch's C++ warnings print it (a TCPStore whose host went
# away prints one per waiting call): a head line, then one line per frame, then a blank.
_TRACE_HEAD = re.compile(r"Exception raised from .* \(most recent call first\):$")
_TRACE_FRAME = re.compile(r"frame #\d+: |<omitting python frames>$")


class BacktraceFolder:
    """Folds the C++ backtraces in a worker's output into one line each, for the console
    (its log keeps them): a store's host lost prints 25 lines of frames per waiting call,
    between the lines that say what happened. Feed it lines; it returns those to show."""

    def __init__(self, where: str) -> None:
        self._where = where      # the log that keeps the whole of them
        self._frames = -1        # frames of the backtrace being folded; -1: none

    def feed(self, line: str) -> list[str]:
        tags, body = strip_prefix(line)
        text = line[len(tags):] if body is None else body
        if self._frames < 0:
            if _TRACE_HEAD.search(text):
                self._frames = 0
                return []
            return [line]
        if _TRACE_FRAME.match(text):
            self._frames += text.startswith("frame #")
            return []
        # The trace has ended; the blank line after it goes with it.
        return [self._summary()] + ([] if not text.strip() else [line])

    def flush(self) -> list[str]:
        """At the end of the output: a backtrace still being folded."""
        return [self._summary()] if self._frames >= 0 else []

    def _summary(self) -> str:
        frames, self._frames = self._frames, -1
        return f"(a C++ backtrace of {frames} frames, kept in {self._where})"
