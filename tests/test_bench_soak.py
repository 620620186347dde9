"""benchmarks/bench_soak.py: the seeded kill plan, and a short real soak measured from the
job's own record (2 workers, 2 kills: about 10 s; the benchmark itself runs 4 and 20), and
the same plan against torchrun (2 workers, 1 kill: about 20 s for both jobs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from jobs import preloaded

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_soak  # noqa: E402

from resilient_train.launcher.chaos import FaultKind, parse_chaos  # noqa: E402


def test_plan_spreads_kills_evenly_over_ranks_with_seeded_gaps() -> None:
    plan = bench_soak.plan_kills(20, 4, seed=3, first=(20, 40), gap=(20, 40))
    assert plan == bench_soak.plan_kills(20, 4, seed=3, first=(20, 40), gap=(20, 40))
    assert plan != bench_soak.plan_kills(20, 4, seed=4, first=(20, 40), gap=(20, 40))
    assert sorted(r for r, _ in plan) == [0] * 5 + [1] * 5 + [2] * 5 + [3] * 5
    steps = [s for _, s in plan]
    assert 20 <= steps[0] <= 40
    assert all(20 <= b - a <= 40 for a, b in zip(steps, steps[1:]))
    faults = parse_chaos(bench_soak.chaos_spec(plan)).faults
    assert [(f.kind, f.target, f.at_step) for f in faults] == [
        (FaultKind.KILL, str(r), s) for r, s in plan]
    # 5 kills per replica is the platform's default budget; 6 needs a policy file.
    assert bench_soak.policy_for(plan) is None
    more = bench_soak.plan_kills(24, 4, seed=3, first=(20, 40), gap=(20, 40))
    policy = bench_soak.policy_for(more)
    assert policy is not None and policy["budgets"]["worker_restarts"]["limit"] == 6


@pytest.mark.parametrize("kwargs, word", [
    ({"kills": 0}, "--kills"), ({"workers": 1}, "--workers"),
    ({"gap": (3, 10)}, "--gap-min"), ({"first": (30, 20)}, "--first-min")])
def test_plan_rejects_bad_options(kwargs: dict, word: str) -> None:
    args = {"kills": 4, "workers": 2, "seed": 0, "first": (10, 20), "gap": (10, 20), **kwargs}
    with pytest.raises(ValueError, match=word):
        bench_soak.plan_kills(**args)


def test_torchrun_side_rejects_a_recovery_over_the_limit() -> None:
    rows = [{"kill": 1, "rank": 1, "at_step": 12, "recovered": True, "recovery_s": 3.0},
            {"kill": 2, "rank": 0, "at_step": 30, "recovered": True, "recovery_s": 70.0}]
    res = {"rows": rows, "rc": 0, "why": None, "restarts_used": 2, "connectFullMesh": False}
    s = bench_soak.summarize_torchrun(res, planned=3, limit=60.0, max_restarts=3)
    assert (s["kills_fired"], s["recovered"], s["restarts_used"]) == (2, 1, 2)
    assert s["recovery_s"]["median"] == 3.0
    assert "limit 60 s" in s["failures"][0] and "1 of 3 planned kills never fired" in \
        s["failures"][1]


@pytest.mark.slow
def test_a_two_kill_soak_measures_every_recovery_here_and_under_torchrun(tmp_path: Path) -> None:
    # One run of both sides: each real job costs the suite 10-25 s.
    out = tmp_path / "soak.json"
    # --tail and --step-time leave training running well past the last kill, which lands a
    # few steps late (the launcher polls the primary's progress).
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_soak.py"), "--kills", "2",
         "--workers", "2", "--first-min", "12", "--first-max", "12", "--gap-min", "12",
         "--gap-max", "12", "--tail", "30", "--step-time", "0.02", "--workdir", str(tmp_path),
         "--job-timeout", "240", "--against", "torchrun", "--out", str(out)],
        # Our side's lives forked from a process that imported torch (tests/jobs.py): the
        # test checks what the benchmark measures and records, not the ratio's value.
        env=dict(os.environ, **preloaded()), cwd=ROOT, capture_output=True, text=True,
        timeout=420, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    s = data["summary"]
    assert s["failures"] == [] and s["job_state"] == "JOB_STATE_SUCCEEDED"
    assert (s["kills_fired"], s["recovered"], s["recovered_in_place"]) == (2, 2, 2)
    assert s["job_retries"] == 0
    assert [(k["rank"], k["at_step"]) for k in data["kills"]] == [
        (p["rank"], p["step"]) for p in data["config"]["plan"]]
    for k in data["kills"]:
        # Both ranks trained again after the kill, from the survivor's memory: at most
        # the step in flight lost, no checkpoint (saved every 10 steps) gone back to. (A
        # killed primary may have joined one more step's all-reduce than its progress
        # record says: the survivor finishes that step, one past "done at the kill".)
        assert set(k["first_step_s"]) == {"workerpool0-0", "workerpool1-0"}
        assert k["recovery_s"] == max(k["first_step_s"].values()) > 0
        assert abs(k["resumed_from"] - k["steps_done_at_kill"]) <= 1, k
        assert k["survivors_reformed_s"] is not None   # the survivor re-formed in-process
    assert s["recovery_s"]["min"] <= s["recovery_s"]["median"] <= s["recovery_s"]["max"]
    assert "load_average_start" in data["machine"]

    tr = data["torchrun"]
    ts = tr["summary"]
    assert ts["failures"] == [] and ts["torchrun_exit"] == 0
    assert (ts["kills_fired"], ts["recovered"], ts["restarts_used"]) == (2, 2, 2)
    assert [(k["rank"], k["at_step"]) for k in tr["kills"]] == [
        (k["rank"], k["at_step"]) for k in data["kills"]]       # the same plan
    for k in tr["kills"]:
        # torchrun restarted both workers: each trained again in a new process, from the
        # checkpoint, and nobody re-formed in-process.
        assert set(k["first_step_s"]) == {"rank0", "rank1"}
        assert k["recovery_s"] == max(k["first_step_s"].values()) > 0
        assert k["resumed_from"] <= k["steps_done_at_kill"] and k["resumed_from"] % 10 == 0
        assert k["survivors_reformed_s"] is None
    med = (s["recovery_s"]["median"], ts["recovery_s"]["median"])
    assert data["median_ratio_torchrun_to_ours"] == round(med[1] / med[0], 2)
    assert "torchrun" in data["config"]
    assert not (tmp_path / "job").exists() and not list(tmp_path.glob("bench-soak-*"))
