"""``resilient-train report``: one self-contained HTML page about a finished (or running) job.

From ``JOB_DIR/job.json`` and the telemetry every worker life wrote (telemetry.py):

- a timeline (inline SVG, seconds since the job was created): one lane per replica, each
  life drawn as bars by what the process was doing (starting, training, recovering,
  stalled, down), the job's state as a band on top, markers for faults, exits and job
  retries, ticks for checkpoint saves; hover titles give exact times and messages;
- the goodput breakdown as a stacked bar;
- each fault with what it cost (how long training stalled, how many steps were redone);
- each recovery: the step restored, where each rank's state came from, the bytes read per
  storage tier and how long it took (the record's ``recoveries``);
- every event.

No network, no script, no plotting library: the page is HTML, CSS and SVG only. Every
string from the record is escaped. ``render_report`` is pure (data in, HTML out);
``write_report`` reads a job directory and writes the page. The record's events are read by
their typed fields (launcher/events.py), never by parsing their messages: a record written
before events had fields draws its lives and states, but not its faults' kinds or targets.
"""

from __future__ import annotations

import functools
import html
import itertools
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..text import format_duration
from .events import Event, EventKind, decision_summary, epoch, iso
from .goodput import redone_steps
from .jobdir import (
    JOB_FILE,
    JobRecordError,
    causes_words,
    format_bytes,
    mask_command,
    rank_names,
    read_job,
    read_recoveries,
    source_counts,
    telemetry_prefixes,
)
from .telemetry import LifeTelemetry, Segment, read_life

log = logging.getLogger(__name__)

REPORT_FILE = "report.html"


class ReportError(Exception):
    """The job directory cannot be reported on; the message says why and what to do."""


# --- what the colors mean (the timeline, the goodput bar and the legend share them) -------

@dataclass(frozen=True)
class _Kind:
    color: str
    label: str
    meaning: str


_BARS: dict[str, _Kind] = {
    "starting": _Kind("#f0c75e", "starting",
                      "process started, not training yet: imports, process group, restore"),
    "training": _Kind("#2e9e5b", "training", "computing steps whose result was kept"),
    "lost": _Kind("#e4572e", "training, redone later",
                  "steps a later restore threw away and computed again"),
    "recovering": _Kind("#4d7cc3", "recovering",
                        "between two training segments of one process: re-forming the "
                        "group, restoring"),
    "stalled": _Kind("#b5b5b5", "stalled / stopping",
                     "alive after its last step: waiting on a peer, saving, shutting down"),
    "running": _Kind("#9cc5ad", "running (no telemetry)",
                     "alive; the script reports no training progress (not @rt.main)"),
    "down": _Kind("#f6d3d3", "down", "no process: between an exit and the next start"),
}

_GOODPUT: list[tuple[str, str, _Kind]] = [
    ("productive_s", "productive", _Kind("#2e9e5b", "productive",
                                         "computing steps whose result survived")),
    ("lost_s", "lost", _Kind("#e4572e", "lost",
                             "computing steps that a later restore threw away")),
    ("checkpoint_s", "checkpoint", _Kind("#1f5f7a", "checkpoint",
                                         "the training loop blocked by saves")),
    ("recovery_s", "recovery", _Kind("#4d7cc3", "recovery",
                                     "from a fault to training again: restart, rendezvous, "
                                     "restore")),
    ("startup_s", "startup", _Kind("#f0c75e", "startup",
                                   "from RUNNING to the first training step")),
    ("other_s", "other", _Kind("#b5b5b5", "other",
                               "after the last step: final save, evaluation, shutdown")),
]

_STATE_COLORS = {
    "QUEUED": "#9e9e9e", "PENDING": "#f0c75e", "RUNNING": "#2e9e5b",
    "SUCCEEDED": "#1b5e20", "FAILED": "#c62828", "CANCELLING": "#ef6c00",
    "CANCELLED": "#6d4c41",
}
_FAULT_COLOR = "#c62828"
_RETRY_COLOR = "#7b1fa2"
_SAVE_COLOR = "#1f5f7a"

# Characters XML 1.0 forbids (a worker's output in an error message may carry them).
_XML_BAD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def _esc(value: object) -> str:
    """Text from the record, safe in HTML and in the SVG's XML."""
    return html.escape(_XML_BAD.sub("\ufffd", str(value)), quote=True)


# A duration in a column: 0.35 s, 12.3 s, 4 min 05 s, 2 h 03 min.
_dur = functools.partial(format_duration, fixed=True)


def _at(t: float) -> str:
    return f"{t:.3f} s"


def _short_state(state: str) -> str:
    return state.removeprefix("JOB_STATE_")


# --- the model of the page ----------------------------------------------------------------

@dataclass(frozen=True)
class _Life:
    replica: str
    start: float
    end: float | None            # None: still alive at the record's last update
    how: str | None              # "exited" or "stopped"
    exit_code: int | None
    cause: str | None
    attempt: int | None


@dataclass(frozen=True)
class _Bar:
    kind: str
    t0: float
    t1: float
    title: str
    text: str = ""


@dataclass(frozen=True)
class _Fault:
    t: float
    kind: str
    target: str | None           # None: the whole job
    message: str
    attempt: int | None
    index: int                   # in the record's events

    @property
    def label(self) -> str:
        return f"{self.kind} \u2192 {self.target}" if self.target else f"{self.kind} (whole job)"


@dataclass(frozen=True)
class _Cost:
    at_step: int | None          # the primary's step when the fault hit; None: not training
    consequence: str             # the decision that followed
    resumed_t: float | None      # training again (the primary's next segment)
    resumed_step: int | None
    redone: int | None


@dataclass(frozen=True)
class _Mark:
    t: float
    text: str
    title: str
    color: str


@dataclass
class _Lane:
    name: str
    bars: list[_Bar]
    saves: list[tuple[float, int, float]]
    exits: list[_Mark]
    title: str
    primary: bool


# The events drawn as faults: the launcher's notes of one, and the job-wide ends.
_FAULT_EVENTS = (EventKind.FAULT, EventKind.TIMEOUT, EventKind.STOCKOUT)
_STALL_KINDS = ("hang", "slow")   # the replica stays alive: no restart needed to recover


def _fault(event: Event, index: int) -> _Fault:
    # A fault note names its kind; a timeout or a stockout is its own kind.
    kind = event.fault or event.kind.value
    return _Fault(event.elapsed_s, kind, event.replica, event.message, event.attempt, index)


def _events(job: Mapping[str, Any]) -> list[Event]:
    """The record's events, in the order things happened in (an injected fault is noted a
    few microseconds after the decision it causes was stamped)."""
    return [Event.from_json(e) for e in job.get("events") or []]


def _replicas(job: Mapping[str, Any], events: Sequence[Event],
              telemetry: Mapping[str, Any]) -> list[str]:
    """Every replica of any attempt, the job's rank order first."""
    names: list[str] = [str(r) for r in job.get("replicas") or []]
    for att in job.get("attempts") or []:
        names += [str(r) for r in att.get("replicas") or {}]
    names += [e.replica for e in events if e.replica]
    names += list(telemetry)
    return list(dict.fromkeys(names))


def _lives(events: Sequence[Event], replica: str) -> list[_Life]:
    lives: list[_Life] = []
    open_start: float | None = None
    open_attempt: int | None = None
    for e in events:
        if e.replica != replica:
            continue
        if e.kind is EventKind.STARTED:
            if open_start is not None:   # a start without an exit in between: close it here
                lives.append(_Life(replica, open_start, e.elapsed_s, None, None, None,
                                   open_attempt))
            open_start, open_attempt = e.elapsed_s, e.attempt
        elif e.kind in (EventKind.EXITED, EventKind.STOPPED) and open_start is not None:
            lives.append(_Life(replica, open_start, e.elapsed_s, e.kind.value, e.exit_code,
                               e.cause, open_attempt))
            open_start = None
    if open_start is not None:
        lives.append(_Life(replica, open_start, None, None, None, None, open_attempt))
    return lives


def _rel(seg: Segment, t0: float) -> Segment:
    return Segment(seg.first_step, seg.last_step, seg.t_start - t0,
                   None if seg.t_first is None else seg.t_first - t0,
                   None if seg.t_last is None else seg.t_last - t0, seg.blocking_s)


def _seg_end(seg: Segment) -> float:
    return seg.t_last if seg.t_last is not None else seg.t_start


def _lane(replica: str, primary: bool, lives: list[_Life], segments: list[Segment],
          saves: list[tuple[float, int, float]], end: float, any_telemetry: bool) -> _Lane:
    """The bars of one replica: its lives split by what it did, and the gaps between."""
    bars: list[_Bar] = []
    redone = redone_steps(segments)
    # A segment belongs to the last life that started before it (launcher and worker read
    # the same clock; the launcher notes a start before the process runs a line).
    owner: dict[int, list[int]] = {}
    for i, seg in enumerate(segments):
        n = max((k for k, life in enumerate(lives) if life.start <= seg.t_start + 0.01),
                default=-1)
        owner.setdefault(n, []).append(i)
    for n, life in enumerate(lives):
        life_end = life.end if life.end is not None else end
        idx = owner.get(n, [])
        where = f"{replica}, life {n + 1}" + (f" (attempt {life.attempt})" if life.attempt else "")
        if not idx:
            kind = "starting" if any_telemetry else "running"
            what = "never trained" if any_telemetry else "alive"
            bars.append(_Bar(kind, life.start, life_end,
                             f"{where}: {what}, {_at(life.start)} to {_at(life_end)} "
                             f"({_dur(life_end - life.start)})"))
        else:
            first = segments[idx[0]]
            if first.t_start > life.start:
                bars.append(_Bar("starting", life.start, first.t_start,
                                 f"{where}: starting, {_at(life.start)} to "
                                 f"{_at(first.t_start)} ({_dur(first.t_start - life.start)})"))
            for k, i in enumerate(idx):
                bars += _segment_bars(where, segments[i], redone[i])
                seg_end = _seg_end(segments[i])
                if k + 1 < len(idx):
                    nxt = segments[idx[k + 1]].t_start
                    bars.append(_Bar("recovering", seg_end, nxt,
                                     f"{where}: recovering in-process, {_at(seg_end)} to "
                                     f"{_at(nxt)} ({_dur(nxt - seg_end)})"))
            last_end = _seg_end(segments[idx[-1]])
            if life_end > last_end:
                bars.append(_Bar("stalled", last_end, life_end,
                                 f"{where}: not training after its last step, {_at(last_end)} "
                                 f"to {_at(life_end)} ({_dur(life_end - last_end)})"))
        if n + 1 < len(lives) and life.end is not None and lives[n + 1].start > life.end:
            nxt = lives[n + 1].start
            bars.append(_Bar("down", life.end, nxt,
                             f"{replica}: down, {_at(life.end)} to {_at(nxt)} "
                             f"({_dur(nxt - life.end)})"))
    for i in owner.get(-1, []):   # training before any recorded start: draw it anyway
        bars += _segment_bars(replica, segments[i], redone[i])
    exits = []
    for life in lives:
        if life.end is None or life.how is None:
            continue
        code = "?" if life.exit_code is None else str(life.exit_code)
        if life.how == "stopped":
            text, color = f"stopped {code}", "#616161"
            title = f"{replica}: stopped by the launcher at {_at(life.end)}, exit {code}"
        else:
            cause = f" {life.cause}" if life.cause and life.cause != "exit" else ""
            text = f"exit {code}{cause}"
            color = "#1b5e20" if life.exit_code == 0 and not cause else _FAULT_COLOR
            title = f"{replica}: exited at {_at(life.end)} with status {code}{cause}"
        exits.append(_Mark(life.end, text, title, color))
    restarts = max(0, len(lives) - 1)
    title = (f"{replica}{' (primary)' if primary else ''}: {len(lives)} "
             f"li{'fe' if len(lives) == 1 else 'ves'}, {restarts} restart"
             f"{'' if restarts == 1 else 's'}, {len(segments)} training segment"
             f"{'' if len(segments) == 1 else 's'}, {len(saves)} save"
             f"{'' if len(saves) == 1 else 's'}")
    return _Lane(replica, bars, saves, exits, title, primary)


def _segment_bars(where: str, seg: Segment, redone: int) -> list[_Bar]:
    end = _seg_end(seg)
    steps = f"steps {seg.first_step + 1}\u2013{seg.last_step}" if seg.steps > 0 else "no step"
    base = (f"{where}: training {steps}, {_at(seg.t_start)} to {_at(end)} "
            f"({_dur(end - seg.t_start)}), saves blocked {seg.blocking_s:.3f} s")
    if redone <= 0 or seg.steps <= 0:
        return [_Bar("training", seg.t_start, end, base,
                     f"{seg.first_step}\u2192{seg.last_step}" if seg.steps > 0 else "")]
    per_step = (end - seg.t_start) / seg.steps
    split = max(seg.t_start, end - redone * per_step)
    kept = seg.last_step - redone
    return [
        _Bar("training", seg.t_start, split, base + f"; steps {seg.first_step + 1}\u2013{kept} "
             f"kept", f"{seg.first_step}\u2192{kept}"),
        _Bar("lost", split, end, base + f"; steps {kept + 1}\u2013{seg.last_step} "
             f"({redone}) redone by a later segment, about {_dur(end - split)} lost"),
    ]


def _step_at(segments: Sequence[Segment], t: float) -> int | None:
    """The primary's training progress at ``t``; None when it had not trained yet."""
    best: int | None = None
    for s in segments:
        if s.t_start > t:
            continue
        if s.t_last is None or s.t_last <= t or s.steps <= 0:
            step = s.last_step if (s.t_last is not None and s.t_last <= t) else s.first_step
        else:
            frac = (t - s.t_start) / max(1e-9, s.t_last - s.t_start)
            step = s.first_step + int(frac * s.steps)
        best = step if best is None else max(best, step)
    return best


def _consequence(decision: Event, job_name: str) -> str:
    """A decision as the record's line for it says it, rendered from its fields."""
    if decision.action is None:   # a record from before typed events
        return ""
    who = decision.replica or f"job {job_name}"
    return f"{who}: " + decision_summary(decision.action, decision.rule, decision.budget,
                                         decision.budget_used, decision.budget_limit)


def _costs(faults: Sequence[_Fault], events: Sequence[Event],
           primary_segments: Sequence[Segment], job_name: str) -> list[_Cost]:
    """What each fault cost, judged by the primary: it trains in lockstep with the others."""
    out = []
    for f in faults:
        after = events[f.index + 1:]
        decision = next((_consequence(e, job_name) for e in after
                         if e.kind is EventKind.DECISION), "")
        # The disruption lasts until the target (any replica, for a job-wide fault) starts
        # again; training resumes in the primary's first segment after that.
        restart = next((e.elapsed_s for e in after
                        if e.kind is EventKind.STARTED
                        and (f.target is None or e.replica == f.target)), f.t)
        if f.kind in _STALL_KINDS:
            # A hang or slow-down whose duration ran out before anything restarted: the
            # replica went on where it was, so its end is the recovery and nothing is redone.
            # One that something cut short (a SIGTERM to deliver, a stall replacing it) says
            # so in its detail, and is no recovery.
            end = next((i for i, e in enumerate(after)
                        if e.kind is EventKind.FAULT_OVER and e.replica == f.target
                        and e.detail is None), None)
            if end is not None and not any(e.kind in (EventKind.STARTED, EventKind.DECISION)
                                           for e in after[:end]):
                t_end = after[end].elapsed_s
                out.append(_Cost(_step_at(primary_segments, f.t), "", t_end,
                                 _step_at(primary_segments, t_end), 0))
                continue
        resumed = next((s for s in primary_segments if s.t_start >= restart), None)
        redone: int | None = None
        if resumed is not None:
            before = [s.last_step for s in primary_segments if s.t_start < resumed.t_start]
            redone = max(0, max(before) - resumed.first_step) if before else 0
        out.append(_Cost(_step_at(primary_segments, f.t), decision,
                         None if resumed is None else resumed.t_start,
                         None if resumed is None else resumed.first_step, redone))
    return out


# --- SVG ----------------------------------------------------------------------------------

_FONT = "font-family=\"-apple-system, 'Segoe UI', Helvetica, Arial, sans-serif\""


def _text_width(text: str, size: float) -> float:
    return len(text) * size * 0.58


def _place(labels: Sequence[tuple[float, str]], size: float, left: float, right: float,
           max_rows: int) -> list[tuple[int, float, str]]:
    """Rows for labels at x positions so that none overlap: (row or -1, x, text-anchor)."""
    rows: list[float] = []   # the right end of the last label in each row
    placed = []
    for x, text in labels:
        w = _text_width(text, size)
        anchor, x0 = ("start", x + 3) if x + 3 + w <= right else ("end", x - 3 - w)
        x0 = max(left, x0)
        row = next((r for r, row_end in enumerate(rows) if row_end + 6 <= x0), -1)
        if row < 0 and len(rows) < max_rows:
            rows.append(0.0)
            row = len(rows) - 1
        if row >= 0:
            rows[row] = x0 + w
        placed.append((row, x + 3 if anchor == "start" else x - 3, anchor))
    return placed


_TICK_STEPS = [0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200,
               10800, 21600, 43200, 86400, 172800, 604800]


def _ticks(span: float, target: int = 10) -> tuple[float, list[float]]:
    raw = span / target
    step = next((s for s in _TICK_STEPS if s >= raw), _TICK_STEPS[-1])
    return step, [i * step for i in range(int(span / step + 1e-9) + 1)]


def _tick_label(t: float, step: float) -> str:
    if step >= 3600:
        return f"{t / 3600:g} h"
    if step >= 60:
        return f"{t / 60:g} min"
    return f"{t:g} s"


def _legend(lanes: Sequence[_Lane], faults: bool, retries: bool, left: float, right: float,
            top: float) -> tuple[list[str], float]:
    """The legend of what this picture uses, and the height it takes."""
    used = {bar.kind for lane in lanes for bar in lane.bars if bar.t1 > bar.t0}
    items = [(k.color, k.label, k.meaning, "rect") for name, k in _BARS.items() if name in used]
    if any(lane.saves for lane in lanes):
        items.append((_SAVE_COLOR, "checkpoint save", "the loop saved (tick above the bar)",
                      "tick"))
    if faults:
        items.append((_FAULT_COLOR, "fault",
                      "an injected or detected fault; the triangle marks its target", "dash"))
    if retries:
        items.append((_RETRY_COLOR, "job retry", "a new attempt of the whole job", "line"))
    out: list[str] = []
    lx, lrow = left, 0
    for color, label, meaning, shape in items:
        w = 16 + _text_width(label, 11) + 14
        if lx + w > right and lx > left:
            lx, lrow = left, lrow + 1
        yy = top + lrow * 20
        out.append(f'<g><title>{_esc(label)}: {_esc(meaning)}</title>')
        if shape == "rect":
            out.append(f'<rect x="{lx:.1f}" y="{yy - 9:.1f}" width="12" height="12" '
                       f'fill="{color}"/>')
        elif shape == "tick":
            out.append(f'<line x1="{lx + 6:.1f}" y1="{yy - 10:.1f}" x2="{lx + 6:.1f}" '
                       f'y2="{yy + 3:.1f}" stroke="{color}" stroke-width="1.5"/>')
        else:
            dash = ' stroke-dasharray="4 2"' if shape == "dash" else ""
            out.append(f'<line x1="{lx + 6:.1f}" y1="{yy - 10:.1f}" x2="{lx + 6:.1f}" '
                       f'y2="{yy + 3:.1f}" stroke="{color}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{lx + 16:.1f}" y="{yy + 1:.1f}" fill="#333">{_esc(label)}</text>'
                   f'</g>')
        lx += w
    return out, (lrow + 1) * 20


def _timeline_svg(lanes: Sequence[_Lane], states: Sequence[tuple[float, float, str]],
                  faults: Sequence[_Fault], costs: Sequence[_Cost],
                  retries: Sequence[tuple[float, str, str]], end: float) -> str:
    width, left, right = 1100.0, 170.0, 24.0
    plot_w = width - left - right
    span = max(end, 1e-3)

    def x(t: float) -> float:
        return left + max(0.0, min(t, span)) / span * plot_w

    out: list[str] = []
    # Labels on top: faults and job retries, staggered so that none overlap.
    top_items = sorted(
        [(f.t, f.label, "fault", i) for i, f in enumerate(faults)]
        + [(t, label, "retry", i) for i, (t, label, _) in enumerate(retries)])
    placed = _place([(x(t), label) for t, label, _, _ in top_items], 11, 0, width, 6)
    label_rows = max([r for r, _, _ in placed] + [-1]) + 1
    y = 26.0 + label_rows * 14
    state_y = y
    lane_top = state_y + 22

    # Lanes: the height of each grows with the rows its exit labels need.
    lane_layout = []
    ly = lane_top
    for lane in lanes:
        marks = sorted(lane.exits, key=lambda m: m.t)
        exit_place = _place([(x(m.t), m.text) for m in marks], 9.5, left, width, 3)
        rows = max([r for r, _, _ in exit_place] + [-1]) + 1
        height = 34 + rows * 11
        lane_layout.append((lane, ly, marks, exit_place))
        ly += height
    lanes_bottom = ly
    axis_y = lanes_bottom + 4
    legend_y = axis_y + 52
    legend, legend_h = _legend(lanes, bool(faults), bool(retries), left, width - right,
                               legend_y)
    total_h = legend_y + legend_h - 4

    out.append(f'<svg id="timeline" xmlns="http://www.w3.org/2000/svg" '
               f'viewBox="0 0 {width:.0f} {total_h:.0f}" width="{width:.0f}" '
               f'height="{total_h:.0f}" {_FONT} font-size="11">')
    out.append(f'<rect x="0" y="0" width="{width:.0f}" height="{total_h:.0f}" fill="#ffffff"/>')
    # Grid and axis.
    step, ticks = _ticks(span)
    for t in ticks:
        xt = x(t)
        out.append(f'<line x1="{xt:.1f}" y1="{state_y:.1f}" x2="{xt:.1f}" y2="{axis_y:.1f}" '
                   f'stroke="#ececec"/>')
        out.append(f'<line x1="{xt:.1f}" y1="{axis_y:.1f}" x2="{xt:.1f}" y2="{axis_y + 5:.1f}" '
                   f'stroke="#555"/>')
        out.append(f'<text x="{xt:.1f}" y="{axis_y + 17:.1f}" text-anchor="middle" '
                   f'fill="#333">{_esc(_tick_label(t, step))}</text>')
    out.append(f'<line x1="{left:.1f}" y1="{axis_y:.1f}" x2="{left + plot_w:.1f}" '
               f'y2="{axis_y:.1f}" stroke="#555"/>')
    out.append(f'<text x="{left + plot_w:.1f}" y="{axis_y + 30:.1f}" text-anchor="end" '
               f'fill="#555">time since the job was created</text>')

    # The job's state band.
    out.append(f'<text x="{left - 8:.1f}" y="{state_y + 10:.1f}" text-anchor="end" '
               f'fill="#333">job state</text>')
    for t0, t1, state in states:
        short = _short_state(state)
        color = _STATE_COLORS.get(short, "#9e9e9e")
        w = max(x(t1) - x(t0), 0.0)
        out.append(f'<rect x="{x(t0):.2f}" y="{state_y:.1f}" width="{max(w, 1.0):.2f}" '
                   f'height="13" fill="{color}"><title>{_esc(short)}: {_at(t0)} to {_at(t1)} '
                   f'({_dur(t1 - t0)})</title></rect>')
        if w > _text_width(short, 9) + 6:
            out.append(f'<text x="{x(t0) + 3:.2f}" y="{state_y + 10:.1f}" font-size="9" '
                       f'fill="#ffffff" pointer-events="none">{_esc(short)}</text>')

    # Lanes.
    for n, (lane, ly0, marks, exit_place) in enumerate(lane_layout):
        bar_y = ly0 + 8
        out.append(f'<g class="lane"><title>{_esc(lane.title)}</title>')
        if n % 2 == 1:
            out.append(f'<rect x="0" y="{ly0:.1f}" width="{left - 4:.0f}" height="30" '
                       f'fill="#f7f7f7"/>')
        name_y = bar_y + (9 if lane.primary else 13)
        out.append(f'<text x="{left - 8:.1f}" y="{name_y:.1f}" text-anchor="end" '
                   f'font-weight="600" fill="#222">{_esc(lane.name)}</text>')
        if lane.primary:
            out.append(f'<text x="{left - 8:.1f}" y="{name_y + 11:.1f}" text-anchor="end" '
                       f'font-size="9.5" fill="#777">primary</text>')
        out.append('</g>')
        out.append(f'<line x1="{left:.1f}" y1="{bar_y + 9:.1f}" x2="{left + plot_w:.1f}" '
                   f'y2="{bar_y + 9:.1f}" stroke="#dddddd" stroke-dasharray="2 3"/>')
        for bar in lane.bars:
            if bar.t1 <= bar.t0:
                continue
            kind = _BARS[bar.kind]
            bx, bw = x(bar.t0), x(bar.t1) - x(bar.t0)
            out.append(f'<rect x="{bx:.2f}" y="{bar_y:.1f}" width="{bw:.2f}" height="18" '
                       f'fill="{kind.color}"><title>{_esc(bar.title)}</title></rect>')
            if bar.text and bw > _text_width(bar.text, 9.5) + 6:
                out.append(f'<text x="{bx + bw / 2:.2f}" y="{bar_y + 12.5:.1f}" '
                           f'text-anchor="middle" font-size="9.5" fill="#ffffff" '
                           f'pointer-events="none">{_esc(bar.text)}</text>')
        last_x = -10.0
        for t, step_no, blocking in sorted(lane.saves):
            sx = x(t)
            if sx - last_x < 1.0:
                continue   # thousands of saves: one tick per pixel
            last_x = sx
            out.append(f'<line x1="{sx:.2f}" y1="{bar_y - 4:.1f}" x2="{sx:.2f}" '
                       f'y2="{bar_y + 3:.1f}" stroke="{_SAVE_COLOR}" stroke-width="1.2">'
                       f'<title>{_esc(lane.name)}: saved step {step_no} at {_at(t)}, '
                       f'blocked {blocking * 1000:.1f} ms</title></line>')
        for mark, (row, tx, anchor) in zip(marks, exit_place):
            mx = x(mark.t)
            out.append(f'<g><title>{_esc(mark.title)}</title>'
                       f'<line x1="{mx:.2f}" y1="{bar_y - 2:.1f}" x2="{mx:.2f}" '
                       f'y2="{bar_y + 21:.1f}" stroke="{mark.color}" stroke-width="2"/>')
            if row >= 0:
                out.append(f'<text x="{tx:.2f}" y="{bar_y + 29 + row * 11:.1f}" '
                           f'text-anchor="{anchor}" font-size="9.5" '
                           f'fill="{mark.color}">{_esc(mark.text)}</text>')
            out.append('</g>')

    # Faults and retries: a line across every lane, a flag on the target, a label on top
    # (the labels last, on a white backing, so that no line runs through one).
    lane_y = {lane.name: ly0 for lane, ly0, _, _ in lane_layout}
    labels = []
    for (t, label, what, i), (row, tx, anchor) in zip(top_items, placed):
        xt = x(t)
        label_y = 20.0 + max(row, 0) * 14
        if what == "fault":
            f = faults[i]
            title = f"{f.message} at {_at(f.t)}" + _cost_sentence(f, costs[i])
            color, dash = _FAULT_COLOR, ' stroke-dasharray="5 3"'
        else:
            title = retries[i][2]
            color, dash = _RETRY_COLOR, ""
        out.append(f'<g class="{what}"><title>{_esc(title)}</title>')
        out.append(f'<line x1="{xt:.2f}" y1="{label_y + 3:.1f}" x2="{xt:.2f}" '
                   f'y2="{lanes_bottom:.1f}" stroke="{color}" stroke-width="1.5"{dash}/>')
        if what == "fault":
            target = faults[i].target
            for name in [target] if target in lane_y else list(lane_y):
                fy = lane_y[str(name)] + 8
                out.append(f'<path d="M{xt - 5:.2f},{fy - 7:.1f} L{xt + 5:.2f},{fy - 7:.1f} '
                           f'L{xt:.2f},{fy + 1:.1f} Z" fill="{color}"/>')
        out.append('</g>')
        if row >= 0:
            w = _text_width(label, 11)
            bx = tx if anchor == "start" else tx - w
            labels.append(f'<g class="{what}-label"><title>{_esc(title)}</title>'
                          f'<rect x="{bx - 2:.2f}" y="{label_y - 11:.1f}" width="{w + 4:.2f}" '
                          f'height="14" fill="#ffffff" fill-opacity="0.9"/>'
                          f'<text x="{tx:.2f}" y="{label_y:.1f}" text-anchor="{anchor}" '
                          f'font-weight="600" fill="{color}">{_esc(label)}</text></g>')
    out += labels

    out += legend
    out.append('</svg>')
    return "\n".join(out)


def _cost_sentence(f: _Fault, cost: _Cost) -> str:
    parts = []
    if cost.consequence:
        parts.append(f"decision: {cost.consequence}")
    if cost.resumed_t is not None:
        parts.append(f"training resumed at {_at(cost.resumed_t)} from step {cost.resumed_step} "
                     f"({_dur(cost.resumed_t - f.t)} after the fault), "
                     f"{cost.redone} step{'' if cost.redone == 1 else 's'} redone")
    return "; " + "; ".join(parts) if parts else ""


def _goodput_svg(goodput: Mapping[str, Any]) -> str:
    width, height = 1100.0, 34.0
    wall = float(goodput.get("wall_s") or 0.0)
    total = sum(float(goodput.get(key) or 0.0) for key, _, _ in _GOODPUT) or 1.0
    out = [(f'<svg id="goodput-bar" xmlns="http://www.w3.org/2000/svg" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" width="{width:.0f}" '
            f'height="{height:.0f}" {_FONT} font-size="11">')]
    bx = 0.0
    for key, name, kind in _GOODPUT:
        secs = float(goodput.get(key) or 0.0)
        if secs <= 0:
            continue
        w = secs / total * width
        pct = 100 * secs / wall if wall > 0 else 0.0
        out.append(f'<rect x="{bx:.2f}" y="0" width="{w:.2f}" height="{height:.0f}" '
                   f'fill="{kind.color}"><title>{_esc(name)}: {_dur(secs)} ({pct:.1f}% of the '
                   f'wall time): {_esc(kind.meaning)}</title></rect>')
        text = f"{name} {pct:.0f}%"
        if w > _text_width(text, 11) + 8:
            out.append(f'<text x="{bx + w / 2:.2f}" y="{height / 2 + 4:.1f}" '
                       f'text-anchor="middle" fill="#ffffff" font-weight="600" '
                       f'pointer-events="none">{_esc(text)}</text>')
        bx += w
    out.append('</svg>')
    return "\n".join(out)


# --- HTML ---------------------------------------------------------------------------------

_CSS = """
body { font: 14px/1.45 -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; color: #222;
       margin: 24px auto; max-width: 1140px; padding: 0 16px; }
h1 { font-size: 22px; margin: 0 0 6px; word-break: break-all; }
h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
.badge { display: inline-block; padding: 1px 8px; border-radius: 10px; color: #fff;
         font-weight: 600; font-size: 13px; }
dl.summary { display: grid; grid-template-columns: max-content 1fr; gap: 2px 16px; margin: 8px 0; }
dl.summary dt { color: #666; } dl.summary dd { margin: 0; }
pre.error { background: #fdecea; border-left: 4px solid #c62828; padding: 8px 12px;
            white-space: pre-wrap; word-break: break-word; }
.svgwrap { overflow-x: auto; }
.note { color: #666; font-size: 13px; }
.goodput-figure { font-size: 20px; font-weight: 600; }
table { border-collapse: collapse; width: 100%; font-size: 13px; }
th, td { text-align: left; padding: 3px 8px; border-bottom: 1px solid #eee; vertical-align: top; }
th { background: #f5f5f5; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.swatch { display: inline-block; width: 11px; height: 11px; margin-right: 6px;
          vertical-align: -1px; }
tr.fault td { background: #fdecea; } tr.exited td { background: #fff4e5; }
tr.state td { background: #f1f8f1; } tr.error td { background: #fdecea; font-weight: 600; }
"""


def _state_spans(events: Sequence[Event], end: float) -> list[tuple[float, float, str]]:
    changes = [(e.elapsed_s, e.state) for e in events
               if e.kind is EventKind.STATE and e.state]
    spans = []
    for i, (t, state) in enumerate(changes):
        t1 = changes[i + 1][0] if i + 1 < len(changes) else end
        spans.append((t, max(t, t1), state))
    return spans


def _header(job: Mapping[str, Any], wall: float | None, finished: bool) -> str:
    state = _short_state(str(job.get("state", "?")))
    color = _STATE_COLORS.get(state, "#9e9e9e")
    attempts = job.get("attempts") or []
    rows = [("state", f'<span class="badge" style="background:{color}">{_esc(state)}</span>'
             + ("" if finished else " <span class=\"note\">(not finished at the record's "
                "last update)</span>")),
            ("created", _esc(job.get("create_time") or "-")),
            ("ended", _esc(job.get("end_time") or "-")),
            ("wall time", _dur(wall) + " (created to ended)" if wall is not None else "-"),
            ("attempts", str(len(attempts)) + (
                " (" + "; ".join(f"{_esc(a.get('attempt'))}: {_esc(a.get('result') or 'running')}"
                                 for a in attempts) + ")" if attempts else "")),
            ("replicas", _esc(", ".join(str(r) for r in job.get("replicas") or [])))]
    command = (job.get("job_spec") or {}).get("command")
    if command:
        # Masked again: a record written before masking may hold a --token=... verbatim.
        rows.append(("command", f"<code>{_esc(' '.join(mask_command(command)))}</code>"))
    exit_status = job.get("exit_status")
    if exit_status is not None:
        rows.append(("exit status", _esc(exit_status)))
    out = [f"<h1>Job {_esc(job.get('name', '?'))}</h1>", '<dl class="summary">']
    out += [f"<dt>{k}</dt><dd>{v}</dd>" for k, v in rows]
    out.append("</dl>")
    error = job.get("error")
    if error:
        out.append(f'<pre class="error">error {_esc(error.get("code", "?"))}: '
                   f'{_esc(error.get("message", ""))}</pre>')
    return "\n".join(out)


def _goodput_section(goodput: Mapping[str, Any] | None) -> str:
    out = ["<h2>Goodput</h2>"]
    if not goodput:
        out.append('<p class="note">No goodput for this job: its script reported no training '
                   'progress (it does not use <code>@rt.main</code> / <code>ctx.steps</code>), '
                   'or the job never ran. The timeline is drawn from the launcher\'s events '
                   'alone.</p>')
        return "\n".join(out)
    wall = float(goodput.get("wall_s") or 0.0)
    fraction = float(goodput.get("goodput") or 0.0)
    out.append(f'<p><span class="goodput-figure">Goodput {100 * fraction:.1f}%</span> '
               f'&#160;{_dur(float(goodput.get("productive_s") or 0.0))} productive of '
               f'{_dur(wall)} from RUNNING to the end; {_esc(goodput.get("steps", "?"))} steps '
               f'trained, {_esc(goodput.get("steps_lost", "?"))} computed again; '
               f'recoveries {_esc(goodput.get("recoveries", "?"))}, '
               f'training segments {_esc(goodput.get("segments", "?"))} (the primary\'s).</p>')
    out.append(f'<div class="svgwrap">{_goodput_svg(goodput)}</div>')
    out.append('<table><tr><th>bucket</th><th class="num">seconds</th><th class="num">'
               'share</th><th>what it is</th></tr>')
    for key, name, kind in _GOODPUT:
        secs = float(goodput.get(key) or 0.0)
        pct = 100 * secs / wall if wall > 0 else 0.0
        out.append(f'<tr><td><span class="swatch" style="background:{kind.color}"></span>'
                   f'{_esc(name)}</td><td class="num">{secs:.3f}</td>'
                   f'<td class="num">{pct:.1f}%</td><td>{_esc(kind.meaning)}</td></tr>')
    out.append(f'<tr><th>wall</th><th class="num">{wall:.3f}</th><th class="num">100%</th>'
               f'<th></th></tr></table>')
    badput = goodput.get("badput_s")
    if isinstance(badput, Mapping) and badput:
        # The same time in the names of Google's ml-goodput-measurement, whose dashboards
        # and TensorBoard tags a user may compare with (docs/launcher.md has the mapping).
        out.append('<p class="note">The time not productive, by ml-goodput-measurement\'s '
                   'badput types:</p>')
        out.append('<table><tr><th>badput type</th><th class="num">seconds</th>'
                   '<th class="num">share</th></tr>')
        for name, secs in badput.items():
            secs = float(secs or 0.0)
            pct = 100 * secs / wall if wall > 0 else 0.0
            out.append(f'<tr><td><code>{_esc(name)}</code></td><td class="num">{secs:.3f}'
                       f'</td><td class="num">{pct:.1f}%</td></tr>')
        out.append('</table>')
    return "\n".join(out)


def _faults_section(faults: Sequence[_Fault], costs: Sequence[_Cost], has_telemetry: bool) -> str:
    out = ["<h2>Faults and what they cost</h2>"]
    if not faults:
        out.append('<p class="note">No fault was injected or detected.</p>')
        return "\n".join(out)
    out.append('<p class="note">Judged by the primary, which trains in lockstep with the '
               'others: its step when the fault hit, and when its training resumed after the '
               'target (every replica, for a whole-job fault) was started again. When faults '
               'overlap, so do their stalls.</p>')
    out.append('<table><tr><th class="num">time</th><th>fault</th><th>target</th>'
               '<th class="num">at step</th><th>decision</th><th class="num">training again at'
               '</th><th class="num">fault to training</th><th class="num">steps redone</th></tr>')
    for f, c in zip(faults, costs):
        if not has_telemetry:
            at = resumed = stall = redone = "\u2013"
        else:
            at = "before training" if c.at_step is None else str(c.at_step)
            if c.resumed_t is None:
                resumed, stall, redone = "never", "\u2013", "\u2013"
            else:
                resumed = f"{_at(c.resumed_t)} from step {c.resumed_step}"
                stall = _dur(c.resumed_t - f.t)
                redone = str(c.redone)
        out.append(f'<tr class="fault"><td class="num">{_at(f.t)}</td><td>{_esc(f.kind)}</td>'
                   f'<td>{_esc(f.target or "whole job")}</td><td class="num">{_esc(at)}</td>'
                   f'<td>{_esc(c.consequence)}</td><td class="num">{_esc(resumed)}</td>'
                   f'<td class="num">{_esc(stall)}</td><td class="num">{_esc(redone)}</td></tr>')
    out.append("</table>")
    return "\n".join(out)


def _recoveries_section(recoveries: Sequence[Mapping[str, Any]], created: float) -> str:
    out = ["<h2>Recoveries</h2>"]
    if not recoveries:
        out.append('<p class="note">No recovery: no rank restored state after the job\'s '
                   'first start (or the script does not report restores).</p>')
        return "\n".join(out)
    out.append('<p class="note">One row per re-forming of the process group, restart of '
               'every worker or job retry: the step every rank restored (the lowest), the steps '
               'computed again, the slowest rank\'s restore time, where each rank\'s state '
               'came from, the bytes read per storage tier, and why a faster tier could not '
               'serve a rank.</p>')
    out.append('<table id="recoveries"><tr><th class="num">#</th><th class="num">time</th>'
               '<th class="num">attempt</th><th class="num">gen</th><th>after</th>'
               '<th class="num">step</th><th class="num">steps lost</th>'
               '<th class="num">seconds</th><th>ranks</th><th>read</th><th>why not faster</th>'
               '</tr>')
    for n, rec in enumerate(recoveries, 1):
        t = epoch(rec.get("at"))
        when = "\u2013" if t is None else _at(t - created)
        lost = rec.get("steps_lost")
        secs = rec.get("seconds")
        ranks, why = [], []
        for name, r in zip(rank_names(rec), rec.get("ranks") or []):
            source = str(r.get("source"))
            if r.get("from_rank") is not None:
                source += f" (rank {r.get('from_rank')})"
            nbytes = sum(int(b or 0) for b in (r.get("bytes_read") or {}).values())
            took = "" if r.get("seconds") is None else f", {float(r['seconds']):.2f} s"
            ranks.append(f'{_esc(name)}: {_esc(source)}, '
                         f'{_esc(format_bytes(nbytes))}{_esc(took)}')
            if r.get("reason"):
                why.append(_esc(f"{name}: {r.get('reason')}"))
        read = ", ".join(f"{tier} {format_bytes(float(b or 0))}"
                         for tier, b in (rec.get("bytes_read") or {}).items())
        out.append(f'<tr><td class="num">{n}</td><td class="num">{_esc(when)}</td>'
                   f'<td class="num">{_esc(rec.get("attempt"))}</td>'
                   f'<td class="num">{_esc(rec.get("generation"))}</td>'
                   f'<td>{_esc(causes_words(rec))}</td>'
                   f'<td class="num">{_esc(rec.get("step"))}</td>'
                   f'<td class="num">{_esc("?" if lost is None else lost)}</td>'
                   f'<td class="num">{_esc("?" if secs is None else f"{float(secs):.2f}")}</td>'
                   f'<td>{_esc(source_counts(rec))}<br/>{"<br/>".join(ranks)}</td>'
                   f'<td>{_esc(read)}</td><td>{"<br/>".join(why)}</td></tr>')
    out.append("</table>")
    return "\n".join(out)


def _events_section(events: Sequence[Event]) -> str:
    out = ["<h2>Events</h2>",
           ('<table><tr><th class="num">time</th><th class="num">attempt</th><th>replica</th>'
            '<th>kind</th><th>message</th></tr>')]
    for e in events:
        kind = e.kind.value
        css = kind if kind in ("fault", "exited", "state", "error") else ""
        attempt = e.attempt
        out.append(f'<tr class="{css}" title="{_esc(iso(e.time) if e.time else "")}">'
                   f'<td class="num">{e.elapsed_s:.3f} s</td>'
                   f'<td class="num">{_esc("" if attempt is None else attempt)}</td>'
                   f'<td>{_esc(e.replica or "")}</td><td>{_esc(kind)}</td>'
                   f'<td>{_esc(e.message)}</td></tr>')
    out.append("</table>")
    return "\n".join(out)


def render_report(job: Mapping[str, Any],
                  telemetry: Mapping[str, Sequence[LifeTelemetry]] | None = None) -> str:
    """The page for ``job`` (a parsed job.json) and the telemetry of each replica's lives
    (``read_life`` of each of its prefixes; missing or empty when the script reports none)."""
    telemetry = telemetry or {}
    created = epoch(job.get("create_time"))
    if created is None:
        raise ValueError("the job record has no create_time")
    events = _events(job)
    ended = epoch(job.get("end_time"))
    finished = ended is not None
    segments = {r: sorted((_rel(s, created) for life in lives for s in life.segments),
                          key=lambda s: s.t_start) for r, lives in telemetry.items()}
    saves = {r: sorted((t - created, step, blocking) for life in lives
                       for t, step, blocking in life.saves) for r, lives in telemetry.items()}
    end = max([ended - created if ended is not None else 0.0]
              + [e.elapsed_s for e in events]
              + [_seg_end(s) for segs in segments.values() for s in segs]
              + [t for sv in saves.values() for t, _, _ in sv] + [1e-3])
    any_telemetry = any(segments.values())
    replicas = _replicas(job, events, telemetry)
    primary = replicas[0] if replicas else ""
    lanes = [_lane(r, r == primary, _lives(events, r), segments.get(r, []), saves.get(r, []),
                   end, any_telemetry) for r in replicas]
    faults = [_fault(e, i) for i, e in enumerate(events) if e.kind in _FAULT_EVENTS]
    name = str(job.get("name", "?"))
    costs = _costs(faults, events, segments.get(primary, []), name)
    retries = []
    attempts = job.get("attempts") or []
    for prev, att in itertools.pairwise(attempts):
        t = epoch(att.get("start_time"))
        if t is not None:
            retries.append((t - created, f"attempt {att.get('attempt')}",
                            (f"attempt {att.get('attempt')} starts at {_at(t - created)}; "
                             f"attempt {prev.get('attempt')} ended: {prev.get('result')}")))
    timeline = _timeline_svg(lanes, _state_spans(events, end), faults, costs, retries, end)
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8"/>',
        f"<title>{_esc(name)}: job report</title>", f"<style>{_CSS}</style></head><body>",
        _header(job, None if ended is None else ended - created, finished),
        "<h2>Timeline</h2>",
        '<p class="note">One lane per replica; hover over any bar, marker or tick for exact '
        'times and messages.'
        + ("" if any_telemetry else " No replica reported training progress: lives are "
           "drawn from the launcher's events alone.") + "</p>",
        f'<div class="svgwrap">{timeline}</div>',
        _goodput_section(job.get("goodput")),
        _faults_section(faults, costs, bool(segments.get(primary))),
        _recoveries_section(job.get("recoveries") or [], created),
        _events_section(events),
        (f'<p class="note">From {_esc(job.get("job_dir") or JOB_FILE)}, last updated '
         f'{_esc(job.get("update_time") or "-")}; written by <code>resilient-train report'
         f'</code>.</p>'),
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def read_telemetry(job_dir: Path, replicas: Iterable[str]) -> dict[str, list[LifeTelemetry]]:
    """Every life's telemetry of each replica, by replica."""
    return {r: [read_life(p) for p in telemetry_prefixes(job_dir, r)] for r in replicas}


def write_report(job_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the report of the job in ``job_dir`` (default ``JOB_DIR/report.html``)."""
    job_dir = Path(job_dir)
    if job_dir.is_file():   # the job.json itself
        job_dir = job_dir.parent
    try:
        job = read_job(job_dir)
    except (FileNotFoundError, JobRecordError) as exc:
        raise ReportError(str(exc)) from None
    try:
        if "recoveries" not in job:   # a record written before job.json had them
            job = {**job, "recoveries": read_recoveries(job_dir, job)}
        replicas = _replicas(job, _events(job), {})
        page = render_report(job, read_telemetry(job_dir, replicas))
    except (KeyError, TypeError, ValueError) as exc:
        raise ReportError(f"{job_dir / JOB_FILE} is not a job record this version can read: "
                          f"{type(exc).__name__}: {exc}") from None
    path = Path(out) if out is not None else job_dir / REPORT_FILE
    path.write_text(page, encoding="utf-8")
    log.info("wrote %s", path)
    return path
