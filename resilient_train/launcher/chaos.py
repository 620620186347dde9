"""Fault injection: parse ``--chaos`` specs and turn them into a deterministic schedule.

Pure data and arithmetic; the launcher owns processes and signals. Fault times are seconds
after the job first reaches ``JOB_STATE_RUNNING`` (docs/platform.md, "Job lifecycle"), so a
schedule is reproducible regardless of how long the job spent queued.

Grammar (comma-separated items)::

    KIND[:TARGET]@TIME[SUFFIXES]          one fault at a fixed time
    KIND[:TARGET]@stepN[SUFFIXES]         one fault once the primary has finished step N
    KIND[:TARGET]~MEAN[xCOUNT][SUFFIXES]  seeded random faults, exponential inter-arrival times

    SUFFIXES, in this order, each optional:
    +DURATION   hang, slow: how long the fault lasts (without it: the rest of that life)
    *SPEED      slow: the fraction of its pace the replica keeps (0.25 or 25%; default 50%)
    /GRACE      maintenance, preempt: SIGTERM to SIGKILL

``hang`` stops the replica's whole process tree (SIGSTOP): alive and stuck, as in a hung
collective or a wedged GPU. ``wipe`` empties the replica's node-local disk and ``corrupt``
flips a byte in the newest committed checkpoint there (faults.py): neither stops the
replica; the next restore that would read that disk shows what happens. ``slow`` makes it a straggler: SIGSTOP / SIGCONT in
``SLOW_PERIOD_S`` periods, running SPEED of each. The launcher owns those signals
(faults.py); this module only says when and for how long.

Step-triggered faults read the primary's training progress (``@rt.main`` reports it to the
launcher), so they land at the same point of training however fast the machine is: the way
to test "killed after the checkpoint at step 100" reproducibly.

TIME, MEAN and GRACE are durations (``500ms``, ``20s``, ``1.5m``, ``2h`` or bare seconds).
TARGET is a replica name (``workerpool1-0``) or a rank (``1``); without it the seeded RNG
picks a replica.
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import random
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

from ..platform.rules import Cause
from ..text import MAX_DURATION_S, MAX_DURATION_TEXT

logger = logging.getLogger(__name__)

__all__ = [
    "MAX_DURATION_S",
    "MAX_DURATION_TEXT",
    "ChaosSchedule",
    "ChaosSpec",
    "ChaosSpecError",
    "Fault",
    "FaultKind",
    "RandomFault",
    "ScheduledFault",
    "UnfiredFault",
    "bare_time_hints",
    "load_chaos",
    "parse_chaos",
    "parse_duration",
]

# Random faults without a count stop here, so a forgotten xCOUNT cannot loop forever.
RANDOM_FAULT_CAP = 10_000

# A slowed replica runs SPEED of every period of this length and is stopped for the rest:
# short enough that a step of a few hundred milliseconds sees the average, long enough
# that the launcher's signals cost nothing.
SLOW_PERIOD_S = 0.1
DEFAULT_SLOW_SPEED = 0.5

_EXAMPLE = "kill:workerpool1-0@20s"
_GRAMMAR = (
    f"write KIND[:REPLICA]@TIME, KIND[:REPLICA]@stepN or KIND[:REPLICA]~MEAN[xCOUNT], "
    f"then optionally +DURATION (hang, slow), *SPEED (slow), /GRACE (maintenance, preempt) "
    f"in that order, e.g. {_EXAMPLE}, kill:1@step120, kill~30sx5, hang:1@step40+30s "
    f"or slow:1@20s+60s*0.25"
)


class ChaosSpecError(ValueError):
    """A chaos spec that cannot be parsed or does not match the job's replicas."""


class FaultKind(str, Enum):
    KILL = "kill"  # node loss: SIGKILL from outside
    MAINTENANCE = "maintenance"  # SIGTERM, grace, restart elsewhere; not counted in budgets
    PREEMPT = "preempt"  # SIGTERM, grace, restart
    OOM = "oom"  # the launcher kills the worker as out of memory
    STOCKOUT = "stockout"  # the job's resources vanish: whole-job retry
    INTERNAL = "internal"  # the launcher's own failure for this attempt
    HANG = "hang"  # SIGSTOP the replica's process tree: alive, stuck (for good or +DURATION)
    SLOW = "slow"  # a straggler: stopped and continued so that it runs at SPEED of its pace
    WIPE = "wipe"  # the replica's node-local disk is emptied; the process runs on
    CORRUPT = "corrupt"  # a byte of the newest checkpoint on its node-local disk flips

    @property
    def targets_replica(self) -> bool:
        """True for faults that hit one replica; False for faults that hit the whole job."""
        return self in _REPLICA_KINDS

    @property
    def job_wide(self) -> bool:
        return not self.targets_replica

    @property
    def has_grace(self) -> bool:
        """True when the fault sends SIGTERM first, so a grace period applies."""
        return self in (FaultKind.MAINTENANCE, FaultKind.PREEMPT)

    @property
    def stalls(self) -> bool:
        """True when the replica stays alive, stopped or slowed (a duration applies)."""
        return self in (FaultKind.HANG, FaultKind.SLOW)

    @property
    def tampers(self) -> bool:
        """True when the fault changes the replica's disk and ends nothing."""
        return self in (FaultKind.WIPE, FaultKind.CORRUPT)

    @property
    def cause(self) -> Cause | None:
        """What the restart policy sees when this fault ends a replica (or the attempt);
        None for a hang or slow-down, which end nothing themselves."""
        return _CAUSES.get(self)


_REPLICA_KINDS = frozenset(
    {FaultKind.KILL, FaultKind.MAINTENANCE, FaultKind.PREEMPT, FaultKind.OOM,
     FaultKind.HANG, FaultKind.SLOW, FaultKind.WIPE, FaultKind.CORRUPT}
)
_CAUSES = {
    FaultKind.KILL: Cause.NODE_LOSS,   # SIGKILL from outside: the node is gone
    FaultKind.MAINTENANCE: Cause.MAINTENANCE,
    FaultKind.PREEMPT: Cause.PREEMPTION,
    FaultKind.OOM: Cause.OOM,
    FaultKind.STOCKOUT: Cause.STOCKOUT,
    FaultKind.INTERNAL: Cause.INTERNAL,
}
_VALID_KINDS = ", ".join(k.value for k in FaultKind)


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    at: float                  # seconds after RUNNING (inf for a step-triggered fault)
    target: str | None = None  # replica name or rank as written; None = seeded choice
    grace: float | None = None  # None = launcher default
    at_step: int | None = None  # once the primary has finished this step
    duration: float | None = None  # hang, slow: None = for the rest of the replica's life
    speed: float | None = None  # slow only: the fraction of its pace it keeps
    written: str | None = field(default=None, compare=False)  # the item as given in --chaos

    @property
    def text(self) -> str:
        """The fault as a ``--chaos`` item (``kill:1@step50``): as written, or the
        equivalent of a JSON entry."""
        if self.written is not None:
            return self.written
        when = f"step{self.at_step}" if self.at_step is not None else _seconds(self.at)
        return _item_text(self.kind, self.target, "@" + when, self.duration, self.speed,
                          self.grace)


@dataclass(frozen=True)
class RandomFault:
    kind: FaultKind
    mean_interval: float
    target: str | None = None
    max_count: int | None = None  # None = up to RANDOM_FAULT_CAP
    grace: float | None = None
    duration: float | None = None
    speed: float | None = None
    written: str | None = field(default=None, compare=False)

    @property
    def text(self) -> str:
        """The stream as a ``--chaos`` item (``kill~30sx5``)."""
        if self.written is not None:
            return self.written
        count = "" if self.max_count is None else f"x{self.max_count}"
        return _item_text(self.kind, self.target, "~" + _seconds(self.mean_interval) + count,
                          self.duration, self.speed, self.grace)


def _seconds(value: float) -> str:
    return f"{value:g}s"


def _item_text(kind: FaultKind, target: str | None, when: str, duration: float | None,
               speed: float | None, grace: float | None) -> str:
    text = kind.value + (f":{target}" if target is not None else "") + when
    if duration is not None:
        text += "+" + _seconds(duration)
    if speed is not None and kind is FaultKind.SLOW:
        text += f"*{speed:g}"
    if grace is not None:
        text += "/" + _seconds(grace)
    return text


@dataclass(frozen=True)
class ChaosSpec:
    faults: tuple[Fault, ...] = ()
    random: tuple[RandomFault, ...] = ()
    seed: int = 0

    def __bool__(self) -> bool:
        return bool(self.faults or self.random)


@dataclass(frozen=True)
class ScheduledFault:
    kind: FaultKind
    at: float
    target: str | None  # a replica name; None only for job-wide kinds
    grace: float | None = None
    at_step: int | None = None
    duration: float | None = None
    speed: float | None = None
    # Which item of the spec it comes from: its index in (*faults, *random). Not part of
    # its identity (equality), only of its bookkeeping (which items fired).
    source: int | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class UnfiredFault:
    """A spec item that did not do what it says: a fixed fault that never fired, or a
    random stream of which some never fired before the job ended."""

    spec: str                  # the item as a --chaos item
    kind: FaultKind
    target: str | None         # the replica it was set on; None: job-wide, or a random pick
    at_s: float | None         # fixed time (seconds after RUNNING)
    at_step: int | None        # fixed step of the primary
    random: bool               # a ~MEAN stream: only listed, never an exit status
    why: str
    fired: int = 0             # random streams: how many of its faults did fire
    count: int | None = None   # random streams: its xCOUNT (None: unbounded)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"spec": self.spec, "kind": self.kind.value,
                               "target": self.target, "random": self.random}
        if self.random:
            out.update(fired=self.fired, count=self.count)
        else:
            out.update(at_s=None if self.at_step is not None else self.at_s,
                       at_step=self.at_step)
        out["why"] = self.why
        return out


# ---------------------------------------------------------------------------- parsing

_DURATION_RE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)?$", re.IGNORECASE)
_UNIT_SECONDS = {None: 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_TARGET_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


def parse_duration(text: str | float, *, positive: bool = False,
                   what: str = "a duration") -> float:
    """Seconds from ``500ms``, ``20s``, ``1.5m``, ``2h`` or a bare (non-negative) number,
    at most MAX_DURATION_S and, where ``positive``, more than 0. ``what`` names the value
    in the error (``a grace period``), which says the range."""
    if isinstance(text, bool):
        raise ValueError(f"expected a duration like 20s, found {text!r}")
    if isinstance(text, (int, float)):
        if text < 0:
            raise ValueError(f"expected a non-negative duration, found {text!r}")
        value = float(text)
    else:
        match = _DURATION_RE.match(text.strip())
        if not match:
            raise ValueError(
                f"expected a duration like 500ms, 20s, 1.5m, 2h or a number of seconds, "
                f"found {_clip(text)}")
        unit = match.group(2).lower() if match.group(2) else None
        value = float(match.group(1)) * _UNIT_SECONDS[unit]
    # Written as a negation, so that NaN and infinity (float() of 400 digits) fail too.
    if not (value > 0 if positive else value >= 0) or not value <= MAX_DURATION_S:
        low = "more than 0 s and " if positive else ""
        raise ValueError(f"{what} is {low}{MAX_DURATION_TEXT}, found {_clip(text)}")
    return value


def _clip(value: Any) -> str:
    """``value`` quoted, cut short: a typo of 400 digits need not fill the screen."""
    text = repr(value)
    return text if len(text) <= 40 else text[:30] + "..." + text[-6:]


def _kind(name: str, where: str) -> FaultKind:
    try:
        return FaultKind(name.strip().lower())
    except ValueError:
        raise ChaosSpecError(
            f"unknown fault kind {name.strip()!r} in {where}; valid kinds: {_VALID_KINDS}; "
            f"{_GRAMMAR}"
        ) from None


def _duration(text: Any, what: str, where: str, *, positive: bool = False) -> float:
    try:
        value = parse_duration(text)
    except ValueError as exc:
        raise ChaosSpecError(f"bad {what} in {where}: {exc}; {_GRAMMAR}") from None
    if positive and value <= 0:
        raise ChaosSpecError(f"{what} in {where} must be > 0 and {MAX_DURATION_TEXT}, found "
                             f"{text!r}; {_GRAMMAR}")
    return value


def _target(kind: FaultKind, target: Any, where: str) -> str | None:
    if target is None:
        return None
    if isinstance(target, int) and not isinstance(target, bool):
        target = str(target)
    if not isinstance(target, str) or not _TARGET_RE.match(target):
        raise ChaosSpecError(
            f"bad target {target!r} in {where}: expected a replica name like workerpool1-0 "
            f"or a rank like 1; {_GRAMMAR}"
        )
    if kind.job_wide:
        raise ChaosSpecError(
            f"{kind.value} hits the whole job and takes no target, found {target!r} in {where}; "
            f"write {kind.value}@TIME"
        )
    return target


def _grace(kind: FaultKind, grace: Any, where: str) -> float | None:
    if grace is None:
        return None
    if not kind.has_grace:
        raise ChaosSpecError(
            f"a grace period applies only to maintenance and preempt, found one on "
            f"{kind.value} in {where}; drop the /GRACE part"
        )
    # 0 would be SIGKILL on the heels of the SIGTERM: no grace at all.
    return _duration(grace, "grace", where, positive=True)


def _stall_duration(kind: FaultKind, duration: Any, where: str) -> float | None:
    if duration is None:
        return None
    if not kind.stalls:
        raise ChaosSpecError(
            f"a duration applies only to hang and slow, found one on {kind.value} in {where}; "
            f"drop the +DURATION part")
    return _duration(duration, "duration", where, positive=True)


def _speed(kind: FaultKind, speed: Any, where: str) -> float | None:
    if kind is not FaultKind.SLOW:
        if speed is None:
            return None
        raise ChaosSpecError(
            f"a speed applies only to slow, found one on {kind.value} in {where}; "
            f"drop the *SPEED part")
    if speed is None:
        return DEFAULT_SLOW_SPEED
    value: float | None = None
    if isinstance(speed, (int, float)) and not isinstance(speed, bool):
        value = float(speed)
    elif isinstance(speed, str):
        text = speed.strip()
        try:
            value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
        except ValueError:
            value = None
    if value is None or not 0 < value < 1:
        raise ChaosSpecError(
            f"speed in {where} must be a fraction between 0 and 1 (exclusive) like 0.25 or "
            f"25%, found {speed!r}; a replica that does not run at all is a hang")
    return value


def _count(count: Any, where: str) -> int | None:
    if count is None:
        return None
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ChaosSpecError(f"count in {where} must be an integer >= 1, found {count!r}")
    return count


def _parse_item(item: str, where: str) -> Fault | RandomFault:
    at_pos, tilde_pos = item.find("@"), item.find("~")
    if at_pos < 0 and tilde_pos < 0:
        raise ChaosSpecError(f"no @TIME or ~MEAN in {where}; {_GRAMMAR}")
    random_fault = at_pos < 0 or (0 <= tilde_pos < at_pos)
    sep = tilde_pos if random_fault else at_pos
    head, tail = item[:sep], item[sep + 1 :]
    kind_text, _, target_text = head.partition(":")
    kind = _kind(kind_text, where)
    target = _target(kind, target_text.strip() if ":" in head else None, where)
    parts = _TAIL_RE.match(tail)
    if parts is None:
        raise ChaosSpecError(
            f"the parts after {item[sep]} in {where} are out of order: write "
            f"{item[sep]}WHEN+DURATION*SPEED/GRACE (each part optional); {_GRAMMAR}")
    when = parts.group("when")
    grace = _grace(kind, _part(parts, "grace"), where)
    duration = _stall_duration(kind, _part(parts, "duration"), where)
    speed = _speed(kind, _part(parts, "speed"), where)
    if not random_fault:
        step = re.fullmatch(r"\s*step\s*(\d+)\s*", when, re.IGNORECASE)
        if step:
            return Fault(kind, math.inf, target, grace, int(step.group(1)), duration, speed)
        return Fault(kind, _duration(when, "time", where), target, grace, None, duration, speed)
    match = re.match(r"^(.+?)(?:x(\d+))?$", when.strip())
    if not match:
        raise ChaosSpecError(f"missing mean interval after ~ in {where}; {_GRAMMAR}")
    mean = _duration(match.group(1), "mean interval", where, positive=True)
    count = _count(int(match.group(2)), where) if match.group(2) else None
    return RandomFault(kind, mean, target, count, grace, duration, speed)


# WHEN, then +DURATION, *SPEED, /GRACE in this order; none of them holds + * or /.
_TAIL_RE = re.compile(
    r"^(?P<when>[^+*/]*)(?:\+(?P<duration>[^+*/]*))?(?:\*(?P<speed>[^+*/]*))?"
    r"(?:/(?P<grace>[^+*/]*))?$")


def _part(match: re.Match[str], name: str) -> str | None:
    value = match.group(name)
    return None if value is None else value.strip()


def _build(items: list[Fault | RandomFault], seed: int) -> ChaosSpec:
    return ChaosSpec(
        faults=tuple(i for i in items if isinstance(i, Fault)),
        random=tuple(i for i in items if isinstance(i, RandomFault)),
        seed=seed,
    )


def parse_chaos(text: str, *, seed: int = 0) -> ChaosSpec:
    """Parse a comma-separated chaos spec; blank text is an empty spec."""
    if not text.strip():
        return ChaosSpec(seed=seed)
    items: list[Fault | RandomFault] = []
    column = 1
    for number, raw in enumerate(text.split(","), start=1):
        item = raw.strip()
        where = f"item {number} {item!r} (column {column + len(raw) - len(raw.lstrip())})"
        column += len(raw) + 1
        if not item:
            raise ChaosSpecError(f"empty item {number} (column {column - 1}); {_GRAMMAR}")
        items.append(replace(_parse_item(item, where), written=item))
    return _build(items, seed)


# A fixed fault's item whose TIME is a bare number: KIND[:TARGET]@N, then its suffixes.
_BARE_TIME_RE = re.compile(
    r"(?P<head>[^@~]*@)\s*(?P<n>\d+(?:\.\d*)?|\.\d+)\s*(?P<rest>[+*/].*)?", re.DOTALL)


def bare_time_hints(spec: ChaosSpec) -> list[str]:
    """A line for each fault written at a bare number (``kill:1@85``): seconds, as the
    grammar has always said and specs in use write it, though ``@step85`` may have been
    meant; kept, and said aloud. A JSON file's ``at`` and ``at_step`` are two keys: no
    doubt there."""
    hints = []
    for fault in spec.faults:
        bare = _BARE_TIME_RE.fullmatch(fault.written or "")
        if bare is None or fault.at_step is not None:
            continue
        head, n, rest = bare.group("head"), bare.group("n"), bare.group("rest") or ""
        hint = (f"chaos: {fault.written} fires {n} s after RUNNING (a bare number is "
                f"seconds): write {head}{n}s{rest} to say so")
        if n.isdigit():
            hint += f", or {head}step{n}{rest} for the primary's step {n}"
        hints.append(hint)
    return hints


_FAULT_KEYS = {"kind", "at", "at_step", "target", "grace", "duration", "speed"}
_RANDOM_KEYS = {"kind", "mean", "count", "target", "grace", "duration", "speed"}
_TOP_KEYS = {"seed", "faults", "random"}


def _check_keys(obj: Any, allowed: set[str], required: set[str], where: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ChaosSpecError(f"{where} must be a JSON object, found {type(obj).__name__}")
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise ChaosSpecError(
            f"unknown key(s) {', '.join(unknown)} in {where}; allowed: {', '.join(sorted(allowed))}"
        )
    missing = sorted(required - set(obj))
    if missing:
        raise ChaosSpecError(f"missing key(s) {', '.join(missing)} in {where}")
    return obj


def _from_json(data: Any, seed: int, source: str) -> ChaosSpec:
    data = _check_keys(data, _TOP_KEYS, set(), source)
    file_seed = data.get("seed", seed)
    if isinstance(file_seed, bool) or not isinstance(file_seed, int):
        raise ChaosSpecError(f"seed in {source} must be an integer, found {file_seed!r}")
    items: list[Fault | RandomFault] = []
    for section in ("faults", "random"):
        entries = data.get(section, [])
        if not isinstance(entries, list):
            raise ChaosSpecError(f"{section!r} in {source} must be a list of objects")
        for index, entry in enumerate(entries):
            where = f"{source} {section}[{index}]"
            if section == "faults":
                entry = _check_keys(entry, _FAULT_KEYS, {"kind"}, where)
                kind = _kind(str(entry["kind"]), where)
                at_step = entry.get("at_step")
                if ("at" in entry) == (at_step is not None):
                    raise ChaosSpecError(f"{where} needs exactly one of 'at' (a time) and "
                                         "'at_step' (a step of the primary)")
                if at_step is not None and (isinstance(at_step, bool)
                                            or not isinstance(at_step, int) or at_step < 0):
                    raise ChaosSpecError(f"at_step in {where} must be an integer >= 0, "
                                         f"found {at_step!r}")
                items.append(
                    Fault(
                        kind,
                        math.inf if at_step is not None else _duration(entry["at"], "time", where),
                        _target(kind, entry.get("target"), where),
                        _grace(kind, entry.get("grace"), where),
                        at_step,
                        _stall_duration(kind, entry.get("duration"), where),
                        _speed(kind, entry.get("speed"), where),
                    )
                )
            else:
                entry = _check_keys(entry, _RANDOM_KEYS, {"kind", "mean"}, where)
                kind = _kind(str(entry["kind"]), where)
                items.append(
                    RandomFault(
                        kind,
                        _duration(entry["mean"], "mean interval", where, positive=True),
                        _target(kind, entry.get("target"), where),
                        _count(entry.get("count"), where),
                        _grace(kind, entry.get("grace"), where),
                        _stall_duration(kind, entry.get("duration"), where),
                        _speed(kind, entry.get("speed"), where),
                    )
                )
    return _build(items, file_seed)


def load_chaos(value: str, *, seed: int = 0) -> ChaosSpec:
    """A spec from ``--chaos``: inline text, or ``@PATH`` to a JSON or one-item-per-line file.

    A ``seed`` inside a JSON file wins over the ``seed`` argument (the file is the more
    specific, reproducible record).
    """
    if not value.startswith("@"):
        return parse_chaos(value, seed=seed)
    path = Path(value[1:]).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ChaosSpecError(
            f"chaos file {str(path)!r} not found; write --chaos @PATH with an existing file, "
            f"or an inline spec like --chaos {_EXAMPLE}"
        ) from None
    except OSError as exc:
        raise ChaosSpecError(f"cannot read chaos file {str(path)!r}: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if data is not None or text.strip() == "null":
        return _from_json(data, seed, str(path))
    lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    try:
        return parse_chaos(",".join(line for line in lines if line), seed=seed)
    except ChaosSpecError as exc:
        raise ChaosSpecError(f"{path}: {exc}") from None


# ---------------------------------------------------------------------------- schedule

_POOL_RE = re.compile(r"^workerpool(\d+)-(\d+)$")


def _rank_key(name: str) -> tuple[int, int]:
    match = _POOL_RE.match(name)
    # Names outside the workerpoolI-J scheme keep their given order after the pools.
    return (int(match.group(1)), int(match.group(2))) if match else (1 << 30, 0)


class ChaosSchedule:
    """The concrete times and targets of a spec's faults for one job's replicas.

    Fixed faults are resolved up front with ``random.Random(seed)``; each random stream has
    its own RNG seeded from (seed, stream index) and is generated lazily, so the result does
    not depend on how often or with which ``elapsed`` values the launcher polls.
    """

    def __init__(self, spec: ChaosSpec, replicas: Sequence[str]) -> None:
        self.spec = spec
        self.replicas: tuple[str, ...] = tuple(sorted(replicas, key=_rank_key))
        items: tuple[Fault | RandomFault, ...] = (*spec.faults, *spec.random)
        for item in items:
            self._resolve(item.kind, item.target, None)  # validate before anything runs
        rng = random.Random(spec.seed)
        # Heap entries: (time, source order, sequence in source, fault); ties break stably.
        self._heap: list[tuple[float, int, int, ScheduledFault]] = []
        self._by_step: list[ScheduledFault] = []   # step-triggered, by step then order
        self._fixed: list[ScheduledFault] = []     # every fixed fault, in spec order
        self._fired: Counter[int] = Counter()      # by source: how many of its faults fired
        for index, fault in enumerate(spec.faults):
            scheduled = ScheduledFault(
                fault.kind, fault.at, self._resolve(fault.kind, fault.target, rng), fault.grace,
                fault.at_step, fault.duration, fault.speed, source=index,
            )
            self._fixed.append(scheduled)
            if fault.at_step is not None:
                self._by_step.append(scheduled)
            else:
                self._heap.append((fault.at, 0, index, scheduled))
        heapq.heapify(self._heap)
        self._by_step.sort(key=lambda f: f.at_step or 0)
        self._streams: list[Iterator[ScheduledFault]] = []
        for index, rfault in enumerate(spec.random):
            stream_rng = random.Random(f"{spec.seed}/random/{index}")
            self._streams.append(self._stream(rfault, stream_rng, len(spec.faults) + index))
            self._push_next(index)

    def _resolve(
        self, kind: FaultKind, target: str | None, rng: random.Random | None
    ) -> str | None:
        if kind.job_wide:
            return None
        listing = ", ".join(f"{name} (rank {r})" for r, name in enumerate(self.replicas)) or "none"
        if target is None:
            if not self.replicas:
                raise ChaosSpecError(
                    f"{kind.value} needs a replica but the job has none; add a worker pool"
                )
            return rng.choice(self.replicas) if rng else None
        if target.isdigit():
            rank = int(target)
            if rank >= len(self.replicas):
                raise ChaosSpecError(
                    f"rank {rank} in {kind.value}:{target} is out of range; "
                    f"the job's replicas are {listing}"
                )
            return self.replicas[rank]
        if target not in self.replicas:
            raise ChaosSpecError(
                f"unknown replica {target!r} in {kind.value}:{target}; "
                f"the job's replicas are {listing}"
            )
        return target

    def _stream(self, rfault: RandomFault, rng: random.Random,
                source: int) -> Iterator[ScheduledFault]:
        limit = rfault.max_count if rfault.max_count is not None else RANDOM_FAULT_CAP
        at = 0.0
        for _ in range(limit):
            at += rng.expovariate(1.0 / rfault.mean_interval)
            target = self._resolve(rfault.kind, rfault.target, rng)
            yield ScheduledFault(rfault.kind, at, target, rfault.grace, None, rfault.duration,
                                 rfault.speed, source=source)

    def _push_next(self, stream: int) -> None:
        nxt = next(self._streams[stream], None)
        if nxt is not None:
            # A stream has at most one entry in the heap, so (time, source) is unique.
            heapq.heappush(self._heap, (nxt.at, 1 + stream, 0, nxt))

    def next_time(self) -> float | None:
        """Time of the next pending fault, or None when none is left."""
        return self._heap[0][0] if self._heap else None

    @property
    def waits_for_steps(self) -> bool:
        """Step-triggered faults are pending (the launcher then watches the primary)."""
        return bool(self._by_step)

    def due_at_step(self, step: int) -> list[ScheduledFault]:
        """Remove and return the step-triggered faults whose step is <= ``step``."""
        out = [f for f in self._by_step if (f.at_step or 0) <= step]
        self._by_step = self._by_step[len(out):]
        return out

    def due(self, elapsed: float) -> list[ScheduledFault]:
        """Remove and return, in time order, every pending fault with time <= elapsed."""
        out: list[ScheduledFault] = []
        while self._heap and self._heap[0][0] <= elapsed:
            _, source, _, fault = heapq.heappop(self._heap)
            out.append(fault)
            if source > 0:
                self._push_next(source - 1)
        return out

    # --- what fired ---------------------------------------------------------------

    def text_of(self, fault: ScheduledFault) -> str:
        """The spec item that a fault comes from, as a ``--chaos`` item."""
        items: tuple[Fault | RandomFault, ...] = (*self.spec.faults, *self.spec.random)
        if fault.source is None or not 0 <= fault.source < len(items):
            return fault.kind.value
        return items[fault.source].text

    def waiting_for_steps(self) -> tuple[str, ...]:
        """The step-triggered faults that have not come due yet, as spec items."""
        return tuple(self.text_of(f) for f in self._by_step)

    def fired(self, fault: ScheduledFault) -> None:
        """The launcher injected ``fault`` (it was taken from ``due`` or ``due_at_step``)."""
        if fault.source is not None:
            self._fired[fault.source] += 1

    def never_fired(self, *, ran_for: float | None, last_step: int | None,
                    pending: Sequence[ScheduledFault] = ()) -> list[UnfiredFault]:
        """The spec's items that did not fire, with why, once the job is over.

        ``ran_for``: seconds from the first RUNNING to the end (None: never RUNNING);
        ``last_step``: the highest step the primary reported (None: none); ``pending``:
        faults that came due but found no target to hit. Random streams are listed when
        some of their xCOUNT faults never fired, or, unbounded, when none did."""
        out: list[UnfiredFault] = []
        pending_by_source = {f.source: f for f in pending if f.source is not None}
        for index, (fault, scheduled) in enumerate(zip(self.spec.faults, self._fixed)):
            if self._fired[index]:
                continue
            if index in pending_by_source:
                why = _no_target(scheduled)
            elif fault.at_step is not None:
                why = ("the primary never reported a step (steps are reported under "
                       "@rt.main, by ctx.steps)" if last_step is None else
                       f"the primary's last reported step was {last_step}, before step "
                       f"{fault.at_step}")
            else:
                why = _ended_before(ran_for, fault.at, "")
            out.append(UnfiredFault(fault.text, fault.kind, scheduled.target,
                                    None if fault.at_step is not None else fault.at,
                                    fault.at_step, False, why))
        next_at = {source - 1: at for at, source, _, _ in self._heap if source > 0}
        for stream, rfault in enumerate(self.spec.random):
            source = len(self.spec.faults) + stream
            fired = self._fired[source]
            if (fired >= rfault.max_count) if rfault.max_count is not None else fired:
                continue
            if source in pending_by_source:
                why = _no_target(pending_by_source[source], "one")
            elif stream in next_at:
                why = _ended_before(ran_for, next_at[stream], "the next at ")
            else:
                why = "the job ended first"
            out.append(UnfiredFault(rfault.text, rfault.kind,
                                    self._resolve(rfault.kind, rfault.target, None),
                                    None, None, True, why, fired, rfault.max_count))
        return out


def _no_target(fault: ScheduledFault, subject: str = "it") -> str:
    if fault.target is None:
        return (f"{subject} came due while the job was not running (starting, or stopping "
                f"for a retry), and the job ended before it ran again")
    return f"{subject} came due, but its target {fault.target} was never running again"


def _ended_before(ran_for: float | None, at: float, what: str) -> str:
    if ran_for is None:
        return "the job never reached JOB_STATE_RUNNING"
    when = f"{at:g}" if at == round(at, 1) else f"{at:.1f}"
    if ran_for >= at:
        return f"the job ended at {ran_for:.1f} s, as {what or 'it'} came due ({when} s)"
    return f"the job ended at {ran_for:.1f} s, before {what}{when} s"
