from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient_train.launcher.chaos import (
    DEFAULT_SLOW_SPEED,
    RANDOM_FAULT_CAP,
    ChaosSchedule,
    ChaosSpec,
    ChaosSpecError,
    Fault,
    FaultKind,
    RandomFault,
    ScheduledFault,
    load_chaos,
    parse_chaos,
    parse_duration,
)

REPLICAS = ["workerpool0-0", "workerpool1-0", "workerpool1-1"]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("500ms", 0.5), ("20s", 20.0), ("1.5m", 90.0), ("2h", 7200.0),
        ("7", 7.0), ("0", 0.0), ("3S", 3.0),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["9" * 400, "9" * 400 + "h", "8761h", "1000000000",
                                   math.inf, math.nan])
def test_parse_duration_refuses_what_no_option_can_mean(value: str | float) -> None:
    """A duration that float() reads as infinity (or one longer than a year) is no
    time any option or fault can mean: refused, the range named."""
    with pytest.raises(ValueError, match="at most 8760h"):
        parse_duration(value)


def test_fault_kind_scope() -> None:
    replica = {k for k in FaultKind if k.targets_replica}
    assert replica == {FaultKind.KILL, FaultKind.MAINTENANCE, FaultKind.PREEMPT, FaultKind.OOM,
                       FaultKind.HANG, FaultKind.SLOW, FaultKind.WIPE, FaultKind.CORRUPT}
    assert {k for k in FaultKind if k.stalls} == {FaultKind.HANG, FaultKind.SLOW}
    assert {k for k in FaultKind if k.tampers} == {FaultKind.WIPE, FaultKind.CORRUPT}
    assert {k for k in FaultKind if k.job_wide} == {FaultKind.STOCKOUT, FaultKind.INTERNAL}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("kill@20s", ChaosSpec(faults=(Fault(FaultKind.KILL, 20.0),))),
        (
            "kill@20s,maintenance@45s",
            ChaosSpec(faults=(Fault(FaultKind.KILL, 20.0), Fault(FaultKind.MAINTENANCE, 45.0))),
        ),
        (
            "preempt:workerpool1-0@1m/5s",
            ChaosSpec(faults=(Fault(FaultKind.PREEMPT, 60.0, "workerpool1-0", 5.0),)),
        ),
        ("oom:1@3s", ChaosSpec(faults=(Fault(FaultKind.OOM, 3.0, "1"),))),
        ("kill~30s", ChaosSpec(random=(RandomFault(FaultKind.KILL, 30.0),))),
        ("kill~30sx5", ChaosSpec(random=(RandomFault(FaultKind.KILL, 30.0, max_count=5),))),
        ("stockout@10s", ChaosSpec(faults=(Fault(FaultKind.STOCKOUT, 10.0),))),
        ("internal@2s", ChaosSpec(faults=(Fault(FaultKind.INTERNAL, 2.0),))),
        (
            "  kill@1 ,  OOM@500ms ",
            ChaosSpec(faults=(Fault(FaultKind.KILL, 1.0), Fault(FaultKind.OOM, 0.5))),
        ),
        ("", ChaosSpec()),
    ],
)
def test_parse_examples(text: str, expected: ChaosSpec) -> None:
    assert parse_chaos(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("hang:1@step40", Fault(FaultKind.HANG, math.inf, "1", at_step=40)),
        ("hang:1@step40+30s", Fault(FaultKind.HANG, math.inf, "1", at_step=40, duration=30.0)),
        ("hang@1m+1.5m", Fault(FaultKind.HANG, 60.0, duration=90.0)),
        ("slow:1@20s+60s*0.25",
         Fault(FaultKind.SLOW, 20.0, "1", duration=60.0, speed=0.25)),
        ("slow:workerpool1-0@step5*25%",
         Fault(FaultKind.SLOW, math.inf, "workerpool1-0", at_step=5, speed=0.25)),
        ("slow:1@2s", Fault(FaultKind.SLOW, 2.0, "1", speed=DEFAULT_SLOW_SPEED)),
        (" SLOW : 1 @ 2s + 3s * 0.1 ", Fault(FaultKind.SLOW, 2.0, "1", duration=3.0, speed=0.1)),
        ("hang~30s+10s", RandomFault(FaultKind.HANG, 30.0, duration=10.0)),
        ("slow:2~1mx3+20s*0.5",
         RandomFault(FaultKind.SLOW, 60.0, "2", 3, duration=20.0, speed=0.5)),
        ("preempt:1@5s/2s", Fault(FaultKind.PREEMPT, 5.0, "1", 2.0)),   # unchanged
    ],
)
def test_parse_hang_and_slow(text: str, expected: Fault | RandomFault) -> None:
    spec = parse_chaos(text)
    assert (*spec.faults, *spec.random) == (expected,)


def test_hang_and_slow_in_json_and_in_the_schedule(tmp_path: Path) -> None:
    path = tmp_path / "chaos.json"
    path.write_text(json.dumps({
        "faults": [{"kind": "hang", "at_step": 40, "target": 1, "duration": "30s"},
                   {"kind": "slow", "at": "20s", "target": "workerpool1-1", "duration": 60,
                    "speed": "25%"},
                   {"kind": "hang", "at": 5}],
        "random": [{"kind": "slow", "mean": "1m", "count": 2, "speed": 0.5,
                    "duration": "10s"}]}))
    spec = load_chaos(f"@{path}")
    assert spec.faults == (
        Fault(FaultKind.HANG, math.inf, "1", at_step=40, duration=30.0),
        Fault(FaultKind.SLOW, 20.0, "workerpool1-1", duration=60.0, speed=0.25),
        Fault(FaultKind.HANG, 5.0))
    assert spec.random == (RandomFault(FaultKind.SLOW, 60.0, None, 2, None, 10.0, 0.5),)
    sched = ChaosSchedule(spec, REPLICAS)
    assert sched.due_at_step(40) == [ScheduledFault(FaultKind.HANG, math.inf, "workerpool1-0",
                                                    None, 40, 30.0)]
    timed = sched.due(float("inf"))
    assert ScheduledFault(FaultKind.SLOW, 20.0, "workerpool1-1", None, None, 60.0,
                          0.25) in timed
    randoms = [f for f in timed if f.kind is FaultKind.SLOW and f.target != "workerpool1-1"]
    assert len(randoms) == 2 and {(f.duration, f.speed) for f in randoms} == {(10.0, 0.5)}
    for bad, fragment in [({"kind": "kill", "at": 1, "duration": "5s"}, "only to hang and slow"),
                          ({"kind": "hang", "at": 1, "speed": 0.5}, "only to slow"),
                          ({"kind": "slow", "at": 1, "speed": True}, "between 0 and 1"),
                          ({"kind": "slow", "at": 1, "speed": 1}, "between 0 and 1"),
                          ({"kind": "hang", "at": 1, "for": "5s"}, "allowed: at, at_step")]:
        path.write_text(json.dumps({"faults": [bad]}))
        with pytest.raises(ChaosSpecError, match=fragment):
            load_chaos(f"@{path}")


def test_spec_truthiness_and_seed() -> None:
    assert not ChaosSpec()
    assert parse_chaos("kill@1s", seed=7).seed == 7
    assert parse_chaos("kill~1s")


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        (
            "kill@1s,explode@3s",
            ["unknown fault kind 'explode'", "item 2", "column 9", "kill, maintenance", "@TIME"],
        ),
        ("kill", ["no @TIME or ~MEAN", "item 1", "e.g. kill:workerpool1-0@20s"]),
        ("kill@soon", ["bad time", "'soon'", "500ms"]),
        ("stockout:1@3s", ["whole job", "stockout@TIME"]),
        ("kill@1s/2s", ["grace period applies only to maintenance and preempt"]),
        ("kill~0s", ["must be > 0"]),
        ("kill~5sx0", ["integer >= 1"]),
        ("kill@1s,,oom@2s", ["empty item 2"]),
        ("kill:@1s", ["bad target ''"]),
        ("kill:1@5s+30s", ["duration applies only to hang and slow", "on kill", "+DURATION"]),
        ("hang:1@5s*0.5", ["speed applies only to slow", "drop the *SPEED"]),
        ("hang:1@5s/5s", ["grace period applies only to maintenance and preempt"]),
        ("preempt:1@5s+3s/2s", ["duration applies only to hang and slow"]),
        ("slow:1@5s*1.5", ["between 0 and 1", "25%", "'1.5'", "is a hang"]),
        ("slow:1@5s*0", ["between 0 and 1"]),
        ("slow:1@5s*fast", ["between 0 and 1", "'fast'"]),
        ("slow:1@5s*0.5+30s", ["out of order", "@WHEN+DURATION*SPEED/GRACE"]),
        ("hang:1@step40+0s", ["duration", "must be > 0"]),
        ("hang:1@step40+soon", ["bad duration", "'soon'"]),
        ("hang:1@", ["bad time", "hang:1@step40+30s", "slow:1@20s+60s*0.25"]),
        ("hang~0s+1s", ["must be > 0"]),
        # SIGTERM and SIGKILL at once: no grace period at all.
        ("preempt:1@5s/0", ["grace in item 1", "must be > 0", "at most 8760h"]),
        ("maintenance:1@5s/0ms", ["grace in item 1", "must be > 0"]),
        ("preempt:1@5s/" + "9" * 400, ["bad grace in item 1", "at most 8760h"]),
        ("kill@" + "9" * 400, ["bad time in item 1", "at most 8760h"]),
    ],
)
def test_parse_errors_name_item_and_fix(text: str, fragments: list[str]) -> None:
    with pytest.raises(ChaosSpecError) as info:
        parse_chaos(text)
    assert isinstance(info.value, ValueError)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_load_inline_json_and_text_files(tmp_path: Path) -> None:
    assert load_chaos("kill@2s", seed=3) == parse_chaos("kill@2s", seed=3)

    js = tmp_path / "chaos.json"
    js.write_text(
        json.dumps(
            {
                "seed": 1,
                "faults": [
                    {"kind": "preempt", "at": "20s", "target": "workerpool1-0", "grace": "5s"}
                ],
                "random": [{"kind": "kill", "mean": "30s", "count": 3}],
            }
        )
    )
    assert load_chaos(f"@{js}", seed=9) == ChaosSpec(
        faults=(Fault(FaultKind.PREEMPT, 20.0, "workerpool1-0", 5.0),),
        random=(RandomFault(FaultKind.KILL, 30.0, None, 3),),
        seed=1,
    )

    txt = tmp_path / "chaos.txt"
    txt.write_text("# a drill\nkill@20s   # first\n\nmaintenance:1@45s/3s\nkill~1mx2\n")
    assert load_chaos(f"@{txt}", seed=4) == parse_chaos(
        "kill@20s,maintenance:1@45s/3s,kill~1mx2", seed=4
    )


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(ChaosSpecError, match="not found"):
        load_chaos(f"@{tmp_path / 'missing.json'}")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"faults": [{"kind": "kill", "at": 1, "when": 2}], "sede": 1}))
    with pytest.raises(ChaosSpecError, match="unknown key.*sede"):
        load_chaos(f"@{bad}")
    bad.write_text(json.dumps({"faults": [{"kind": "kill", "at": 1, "when": 2}]}))
    with pytest.raises(ChaosSpecError, match=r"unknown key\(s\) when in .*faults\[0\]"):
        load_chaos(f"@{bad}")
    txt = tmp_path / "bad.txt"
    txt.write_text("kill@1s\nboom@2s\n")
    with pytest.raises(ChaosSpecError, match="bad.txt.*'boom'"):
        load_chaos(f"@{txt}")


def test_schedule_resolves_ranks_and_orders_faults() -> None:
    spec = parse_chaos("stockout@4s,oom:1@3s,kill:workerpool0-0@1s,preempt:2@3s/7s")
    # Replicas in any order: ranks follow pool then index.
    schedule = ChaosSchedule(spec, list(reversed(REPLICAS)))
    assert schedule.next_time() == 1.0
    assert schedule.due(0.5) == []
    assert schedule.due(3.0) == [
        ScheduledFault(FaultKind.KILL, 1.0, "workerpool0-0"),
        ScheduledFault(FaultKind.OOM, 3.0, "workerpool1-0"),
        ScheduledFault(FaultKind.PREEMPT, 3.0, "workerpool1-1", 7.0),
    ]
    assert schedule.next_time() == 4.0
    assert schedule.due(100) == [ScheduledFault(FaultKind.STOCKOUT, 4.0, None)]
    assert schedule.next_time() is None and schedule.due(1e9) == []


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("kill:3@1s", "rank 3"),
        ("kill:workerpool2-0@1s", "unknown replica 'workerpool2-0'"),
        ("kill~1s", "has none"),
    ],
)
def test_schedule_rejects_bad_targets(text: str, fragment: str) -> None:
    replicas = [] if "~" in text else REPLICAS
    with pytest.raises(ChaosSpecError) as info:
        ChaosSchedule(parse_chaos(text), replicas)
    assert fragment in str(info.value)
    if replicas:
        assert "workerpool1-1 (rank 2)" in str(info.value)


def test_schedule_is_deterministic_and_random_targets_are_replicas() -> None:
    spec = parse_chaos("kill@5s,oom@6s,kill~10sx20,maintenance:1~30sx4/2s", seed=42)
    first = ChaosSchedule(spec, REPLICAS).due(float("inf"))
    again = ChaosSchedule(spec, REPLICAS).due(float("inf"))
    assert first == again
    assert len(first) == 2 + 20 + 4
    assert [f.at for f in first] == sorted(f.at for f in first)
    assert {f.target for f in first} <= set(REPLICAS)
    maint = [f for f in first if f.kind is FaultKind.MAINTENANCE]
    assert {f.target for f in maint} == {"workerpool1-0"} and {f.grace for f in maint} == {2.0}
    other = ChaosSchedule(parse_chaos("kill@5s,oom@6s,kill~10sx20", seed=43), REPLICAS)
    assert [f.at for f in other.due(float("inf"))] != [f.at for f in first[:22]]


def test_uncounted_random_faults_are_lazy_and_capped() -> None:
    schedule = ChaosSchedule(parse_chaos("kill~1ms"), REPLICAS)
    early = schedule.due(0.5)
    assert 100 < len(early) < RANDOM_FAULT_CAP  # mean 1 ms: hundreds within half a second
    assert len(early) + len(schedule.due(float("inf"))) == RANDOM_FAULT_CAP


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    polls=st.lists(st.floats(0, 300, allow_nan=False), max_size=30),
)
def test_schedule_does_not_depend_on_polling(seed: int, polls: list[float]) -> None:
    spec = parse_chaos("kill~20sx8,preempt~45sx5,oom@30s,stockout@90s", seed=seed)
    reference = ChaosSchedule(spec, REPLICAS).due(float("inf"))
    schedule = ChaosSchedule(spec, REPLICAS)
    seen: list[ScheduledFault] = []
    for elapsed in sorted(polls):
        nxt = schedule.next_time()
        batch = schedule.due(elapsed)
        assert all(f.at <= elapsed for f in batch)
        if batch:
            assert batch[0].at == nxt
        seen += batch
    seen += schedule.due(float("inf"))
    assert seen == reference


def test_step_triggered_faults_parse_and_wait_for_their_step(tmp_path: Path) -> None:
    spec = parse_chaos("kill:1@step120, internal@step60, preempt:0@STEP 30/5s, kill:0@2s")
    assert [(f.kind, f.at_step, f.grace) for f in spec.faults] == [
        (FaultKind.KILL, 120, None), (FaultKind.INTERNAL, 60, None),
        (FaultKind.PREEMPT, 30, 5.0), (FaultKind.KILL, None, None)]
    sched = ChaosSchedule(spec, ["workerpool0-0", "workerpool1-0"])
    assert sched.waits_for_steps and sched.next_time() == 2.0   # times and steps apart
    assert sched.due_at_step(29) == []
    assert [(f.kind, f.target) for f in sched.due_at_step(61)] == [
        (FaultKind.PREEMPT, "workerpool0-0"), (FaultKind.INTERNAL, None)]
    assert sched.due_at_step(61) == []                           # each fires once
    assert [f.target for f in sched.due_at_step(500)] == ["workerpool1-0"]
    assert not sched.waits_for_steps
    path = tmp_path / "faults.json"
    path.write_text('{"faults": [{"kind": "kill", "at_step": 40, "target": 1}]}')
    assert load_chaos(f"@{path}").faults[0].at_step == 40
    path.write_text('{"faults": [{"kind": "kill", "at_step": 40, "at": "2s"}]}')
    with pytest.raises(ChaosSpecError, match="exactly one of 'at'"):
        load_chaos(f"@{path}")
    with pytest.raises(ChaosSpecError, match=r"KIND\[:REPLICA\]@stepN"):
        parse_chaos("kill@stepX")


def test_a_bare_number_is_seconds_and_says_step_n_may_have_been_meant() -> None:
    """``kill:1@85`` is 85 s after RUNNING, as the grammar has always said (and specs in
    use write it); a hint says so and names ``@step85``. Nothing with a unit, a step or a
    mean gets one."""
    from resilient_train.launcher.chaos import bare_time_hints

    spec = parse_chaos("kill:1@85,preempt:0@2.5/5s,kill@20s,kill:1@step85,kill~30,oom@1m")
    assert bare_time_hints(spec) == [
        "chaos: kill:1@85 fires 85 s after RUNNING (a bare number is seconds): write "
        "kill:1@85s to say so, or kill:1@step85 for the primary's step 85",
        "chaos: preempt:0@2.5/5s fires 2.5 s after RUNNING (a bare number is seconds): write "
        "preempt:0@2.5s/5s to say so",
    ]
    assert spec.faults[0].at == 85.0   # still seconds


def test_launch_prints_the_hint_before_the_job_starts(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "resilient_train.cli", "launch", "--job-dir",
         str(tmp_path / "job"), "--chaos", "kill:0@85", "--", sys.executable, "-c", "pass"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    lines = done.stdout.splitlines()
    hint = ("chaos: kill:0@85 fires 85 s after RUNNING (a bare number is seconds): write "
            "kill:0@85s to say so, or kill:0@step85 for the primary's step 85")
    assert hint in lines, done.stdout + done.stderr
    assert lines.index(hint) < next(i for i, ln in enumerate(lines) if "JOB_STATE_QUEUED" in ln)
    assert done.returncode == 78   # the job ended first: the fault never fired, as before
