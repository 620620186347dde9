"""The job's events: typed records that everyone reads by field.

The job state machine and the process layer record every state change, exit, decision,
fault and machine change as one :class:`Event`. ``job.json`` holds them in their JSON form
(:meth:`Event.to_json`, read back with :meth:`Event.from_json`); ``status``, ``report``,
goodput and the observed MTBF read their fields, never their ``message``, which is the
line a person reads (rendered once, when the event is made, from the same fields:
:func:`decision_summary` renders a decision's).
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import Enum
from functools import cached_property
from typing import Any

__all__ = ["EVENT_FIELDS", "Event", "EventKind", "decision_summary", "epoch", "iso"]


class EventKind(str, Enum):
    STATE = "state"            # the job's state changed (``state``)
    STOCKOUT = "stockout"      # the request exceeds what the machine has
    TIMEOUT = "timeout"        # the job's timeout was reached
    STARTED = "started"        # a replica's process started
    EXITED = "exited"          # a replica's process ended (``exit_code``, ``cause``)
    STOPPED = "stopped"        # a replica ended by a stop the job asked for
    DECISION = "decision"      # the policy's answer to an exit (``rule``, ``action``, budget)
    RESTARTING = "restarting"  # a replica is about to start again
    STOPPING = "stopping"      # the job stops replicas (a retry, the end)
    ERROR = "error"            # the job's error, as the platform words it (``code``)
    FAULT = "fault"            # a fault, injected or observed (``fault``, ``cause``)
    # A hang or slow-down ended (``fault``, ``replica``, ``duration_s``); ``detail`` says
    # what cut it short (a SIGTERM to deliver, a stall that replaces it), None when it ran
    # its course and the replica went on by itself.
    FAULT_OVER = "fault_over"
    SIGNAL = "signal"          # a signal the launcher sent of its own (grace over)
    MACHINE = "machine"        # a replica's machine: files wiped or kept, a file written
    WARNING = "warning"        # something the user should know; changes nothing


def iso(t: float | None) -> str | None:
    """An epoch time as the platform writes times: RFC 3339, UTC, milliseconds."""
    if t is None:
        return None
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).isoformat(timespec="milliseconds") \
        .replace("+00:00", "Z")


def decision_summary(action: str | None, rule: str | None, budget: str | None = None,
                     used: int | None = None, limit: int | None = None) -> str:
    """A decision for a person: ``restart_worker (infrastructure-fault), worker_restarts
    1/5`` (the budget part only when the step spent one)."""
    text = f"{action or '?'} ({rule or 'no rule'})"
    if budget is not None:
        text += f", {budget} {used}/{limit}"
    return text


def epoch(when: str | None) -> float | None:
    """The inverse of :func:`iso`: epoch seconds of a record's time (None stays None)."""
    if not when:
        return None
    return _dt.datetime.fromisoformat(str(when).replace("Z", "+00:00")).timestamp()


@dataclass(frozen=True)
class Event:
    """One thing that happened to the job. Fields that do not apply stay None."""

    kind: EventKind
    time: float                   # epoch seconds
    elapsed_s: float              # since the job was created
    message: str                  # the human line, rendered from the fields below
    attempt: int | None = None
    replica: str | None = None
    step: int | None = None       # the primary's (or the replica's) last reported step
    state: str | None = None      # STATE: the new JobState value
    exit_code: int | None = None  # EXITED / STOPPED: shell convention (128+N for signal N)
    cause: str | None = None      # EXITED / FAULT / DECISION: the Cause value
    fault: str | None = None      # FAULT / FAULT_OVER: the fault kind (kill, hang, oom...)
    injected: bool | None = None  # FAULT: chaos made it (True) or the launcher observed it
    rule: str | None = None       # DECISION: the rule that matched
    action: str | None = None     # DECISION: the action taken
    budget: str | None = None     # DECISION: the name of the budget the action spent
    budget_used: int | None = None   # DECISION: that budget's use, this action included
    budget_limit: int | None = None
    counts_as_failure: bool = False  # counts toward the job's observed MTBF
    duration_s: float | None = None  # FAULT_OVER: how long the hang or slow-down lasted
    code: int | None = None       # ERROR: the platform's error code
    detail: str | None = None     # anything else a field should say (e.g. "whole job")

    def to_json(self) -> dict[str, Any]:
        """The job record's form: None fields and a False ``counts_as_failure`` left out."""
        return dict(self._json)

    @cached_property
    def _json(self) -> dict[str, Any]:
        # Rendered once: the launcher rewrites the record, every event in it, at each event.
        out: dict[str, Any] = {"time": iso(self.time)}
        for f in fields(self):
            if f.name == "time":
                continue
            value = getattr(self, f.name)
            if value is None or (f.name == "counts_as_failure" and not value):
                continue
            out[f.name] = value.value if isinstance(value, Enum) else value
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Event:
        """Read an event back from a job record (unknown keys are ignored; a record from
        before typed events reads back with its new fields None)."""
        return cls(kind=EventKind(str(data["kind"])), time=epoch(data.get("time")) or 0.0,
                   elapsed_s=float(data["elapsed_s"]), message=str(data.get("message", "")),
                   **{k: data[k] for k in _OPTIONAL if data.get(k) is not None})


# Every field's name; those a caller may set on a note (the machine sets the rest).
EVENT_FIELDS = frozenset(f.name for f in fields(Event))
_OPTIONAL = EVENT_FIELDS - {"kind", "time", "elapsed_s", "message"}
