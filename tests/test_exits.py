"""One path from an exit to the job's error: ``classify_exit`` (what ended a process, as a
cause) and ``error_for`` (a cause, as the job's error). Pure: no process, no clock."""

from __future__ import annotations

import signal

import pytest

from resilient_train.launcher.exits import OUTSIDE_SIGNALS, ProcessExit, Verdict, classify_exit
from resilient_train.launcher.messages import (
    CODE_INTERNAL,
    CODE_INVALID_ARGUMENT,
    CODE_RESOURCE_EXHAUSTED,
    CODE_UNAVAILABLE,
    ERROR_TABLE,
    STATUS_INTERNAL,
    STATUS_OOM,
    STATUS_STOCKOUT,
    PeerLoss,
    error_for,
)
from resilient_train.platform.rules import Cause, Outcome, Strategy, default_policy

R = "workerpool1-0"


def ended(returncode: int | None, **facts: object) -> Verdict:
    return classify_exit(ProcessExit(R, 100.0, returncode, **facts))  # type: ignore[arg-type]


# (the ProcessExit's facts, the verdict): a case for each rule of classify_exit's docstring.
CASES = [
    # 1. no process: exec failed, or the launcher could not create one
    ("start error", dict(returncode=None, start_error="cannot start 'x': No such file"),
     Verdict(Cause.START_ERROR, 128)),
    ("spawn error", dict(returncode=None, spawn_error="fork: out of memory"),
     Verdict(Cause.INTERNAL, STATUS_INTERNAL)),
    # 2. the launcher ended it on purpose: its cause, whatever the status
    *[(f"injected {c.value}", dict(returncode=-9, injected=c), Verdict(c, 137))
      for c in Cause],
    ("injected SIGTERM, caught", dict(returncode=0, injected=Cause.PREEMPTION),
     Verdict(Cause.PREEMPTION, 0)),
    ("memory limit", dict(returncode=-9, injected=Cause.OOM, signalled=True),
     Verdict(Cause.OOM, 137)),
    # 3. its own report says torch ran out of memory, and it failed
    ("reported OOM", dict(returncode=1, reported_oom=True), Verdict(Cause.OOM, 1)),
    ("reported OOM, exit 0", dict(returncode=0, reported_oom=True), Verdict(Cause.EXIT, 0)),
    # 4. killed from outside: the kernel's OOM killer, else a lost node
    ("SIGKILL from outside", dict(returncode=-9),
     Verdict(Cause.NODE_LOSS, 137, "killed by SIGKILL from outside the launcher: a node loss",
             "kill")),
    ("SIGTERM from outside", dict(returncode=-15),
     Verdict(Cause.NODE_LOSS, 143, "killed by SIGTERM from outside the launcher: a node loss",
             "kill")),
    ("SIGHUP from outside", dict(returncode=-1),
     Verdict(Cause.NODE_LOSS, 129, "killed by SIGHUP from outside the launcher: a node loss",
             "kill")),
    ("SIGINT from outside", dict(returncode=-2),
     Verdict(Cause.NODE_LOSS, 130, "killed by SIGINT from outside the launcher: a node loss",
             "kill")),
    ("kernel OOM killer", dict(returncode=-9, kernel_oom_kills_rose=True),
     Verdict(Cause.OOM, 137, "killed by the kernel's out-of-memory killer (SIGKILL; the "
             "machine ran out of memory)", "oom")),
    ("SIGTERM while kernel OOM kills rose", dict(returncode=-15, kernel_oom_kills_rose=True),
     Verdict(Cause.NODE_LOSS, 143, "killed by SIGTERM from outside the launcher: a node loss",
             "kill")),
    ("the launcher's own stop", dict(returncode=-15, signalled=True), Verdict(Cause.EXIT, 143)),
    ("the grace period's SIGKILL", dict(returncode=-9, signalled=True),
     Verdict(Cause.EXIT, 137)),
    # A wrapper shell reports its child's SIGKILL as an exit status: an exit, unless the
    # kernel's OOM killer left its evidence.
    ("wrapper shell 137", dict(returncode=137), Verdict(Cause.EXIT, 137)),
    ("wrapper shell 137, kernel OOM", dict(returncode=137, kernel_oom_kills_rose=True),
     Verdict(Cause.OOM, 137, "exited with status 137 while the kernel's out-of-memory killer "
             "killed a process: out of memory", "oom")),
    ("wrapper shell 137 after our SIGKILL", dict(returncode=137, kernel_oom_kills_rose=True,
                                                 signalled=True), Verdict(Cause.EXIT, 137)),
    # 5. the program's own exit: a code, or a signal it raised at itself
    ("exit 0", dict(returncode=0), Verdict(Cause.EXIT, 0)),
    ("exit 1", dict(returncode=1), Verdict(Cause.EXIT, 1)),
    ("exit 134 (rt.record's transient)", dict(returncode=134), Verdict(Cause.EXIT, 134)),
    ("SIGABRT", dict(returncode=-6), Verdict(Cause.EXIT, 134)),
    ("SIGSEGV", dict(returncode=-11), Verdict(Cause.EXIT, 139)),
    ("SIGUSR1", dict(returncode=-10, step=7), Verdict(Cause.EXIT, 138)),
]


@pytest.mark.parametrize("facts, verdict", [(f, v) for _, f, v in CASES],
                         ids=[name for name, _, _ in CASES])
def test_each_rule_of_classify_exit(facts: dict[str, object], verdict: Verdict) -> None:
    assert ended(**facts) == verdict   # type: ignore[arg-type]


def test_every_cause_comes_out_of_classify_exit_and_the_outside_signals_are_named() -> None:
    assert {v.cause for _, _, v in CASES} == set(Cause)
    assert OUTSIDE_SIGNALS == {signal.SIGKILL, signal.SIGTERM, signal.SIGHUP, signal.SIGINT}


def test_a_verdict_feeds_the_policy_by_its_cause_and_status() -> None:
    policy = default_policy()
    rule = policy.first_match(Outcome(R, False, *_pair(ended(-9))))
    assert rule is not None and rule.name == "infrastructure-fault"
    rule = policy.first_match(Outcome(R, False, *_pair(ended(137))))
    assert rule is not None and rule.name == "user-code-error"
    rule = policy.first_match(Outcome(R, False, *_pair(ended(-6))))
    assert rule is not None and rule.name == "transient-exit-code"


def _pair(v: Verdict) -> tuple[Cause, int]:
    return v.cause, v.exit_code


# --- the one table: cause -> error -----------------------------------------------------

EXPECTED = {
    Cause.EXIT: (CODE_INVALID_ARGUMENT, f"The replica {R} exited with a non-zero status of 3. "
                 "Termination reason: Error.", "Error", 3),
    Cause.START_ERROR: (CODE_INVALID_ARGUMENT, f"The replica {R} exited with a non-zero status "
                        "of 3. Termination reason: StartError.", "StartError", 3),
    Cause.OOM: (CODE_INVALID_ARGUMENT, f"The replica {R} ran out of memory and exited with a "
                "non-zero status of 3.", "OutOfMemory", STATUS_OOM),
    Cause.STOCKOUT: (CODE_RESOURCE_EXHAUSTED, "Resources are insufficient in region: "
                     "us-central1. Try a different region or use a different accelerator.",
                     "Stockout", STATUS_STOCKOUT),
    Cause.INTERNAL: (CODE_INTERNAL, "Internal error occurred for the current attempt.",
                     "Internal", STATUS_INTERNAL),
    Cause.PREEMPTION: (CODE_UNAVAILABLE, f"The replica {R} exited with a non-zero status of 3. "
                       "Termination reason: Preempted.", "Preempted", 3),
    Cause.NODE_LOSS: (CODE_UNAVAILABLE, f"The replica {R} exited with a non-zero status of 3. "
                      "Termination reason: NodeLost.", "NodeLost", 3),
    Cause.MAINTENANCE: (CODE_UNAVAILABLE, f"The replica {R} exited with a non-zero status of "
                        "3. Termination reason: Maintenance.", "Maintenance", 3),
}


@pytest.mark.parametrize("cause", list(Cause), ids=[c.value for c in Cause])
def test_every_cause_has_an_error_with_code_message_and_reason(cause: Cause) -> None:
    error = error_for(cause, R, 3, region="us-central1")
    code, message, reason, status = EXPECTED[cause]
    assert (error.code, error.message, error.reason, error.exit_status) == (
        code, message, reason, status)
    assert error.to_json() == {"code": code, "message": message}   # the reason stays out


def test_the_table_covers_every_cause() -> None:
    assert set(ERROR_TABLE) == set(Cause)
    assert all(w.reason for w in ERROR_TABLE.values())


def test_a_spot_preemption_surfaces_as_a_stockout() -> None:
    spot = error_for(Cause.PREEMPTION, R, 143, strategy=Strategy.SPOT, region="europe-west4")
    assert (spot.code, spot.reason, spot.exit_status) == (
        CODE_RESOURCE_EXHAUSTED, "Stockout", STATUS_STOCKOUT)
    assert spot.message.startswith("Resources are insufficient in region: europe-west4.")
    standard = error_for(Cause.PREEMPTION, R, 143, strategy=Strategy.FLEX_START)
    assert standard.reason == "Preempted"


def test_the_wording_names_the_traceback_the_lost_peer_and_a_missing_status() -> None:
    loss = PeerLoss("workerpool1-1", "node_loss", 0.8, "Connection reset by peer")
    error = error_for(Cause.EXIT, R, 1, "Traceback ...", loss)
    lines = error.message.splitlines()
    assert lines[0] == f"The replica {R} exited with a non-zero status of 1. Termination " \
                       "reason: Error."
    assert lines[1].startswith("Likely cause: workerpool1-1 was lost 0.8 s earlier")
    assert lines[2] == "Traceback ..."
    assert [d["reason"] for d in error.details] == ["PEER_LOST"]
    oom = error_for(Cause.OOM, R, 1, "torch.OutOfMemoryError: CUDA out of memory")
    assert oom.message.endswith("\ntorch.OutOfMemoryError: CUDA out of memory")
    # A job-wide fault has no status of its own: it reads as 1.
    assert error_for(Cause.NODE_LOSS, R).message.endswith("status of 1. Termination reason: "
                                                          "NodeLost.")
    # An infrastructure fault's exit 0 (a caught SIGTERM) never makes the launcher exit 0.
    assert error_for(Cause.MAINTENANCE, R, 0).exit_status == 1
