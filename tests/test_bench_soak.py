"""benchmarks/bench_soak.py: the seeded kill plan, and a short real soak measured from the
job's own record (2 workers, 2 kills: about 10 s; the benchmark itself runs 4 and 20)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.slow
def test_two_kill_soak_measures_every_recovery(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    # --tail and --step-time leave training running well past the last kill, which lands a
    # few steps late (the launcher polls the primary's progress).
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_soak.py"), "--kills", "2",
         "--workers", "2", "--first-min", "12", "--first-max", "12", "--gap-min", "12",
         "--gap-max", "12", "--tail", "30", "--step-time", "0.02", "--workdir", str(tmp_path),
         "--job-timeout", "240", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=360, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    s = data["summary"]
    assert s["failures"] == [] and s["job_state"] == "JOB_STATE_SUCCEEDED"
    assert (s["kills_fired"], s["recovered"], s["recovered_in_place"]) == (2, 2, 2)
    assert s["job_retries"] == 0
    assert [(k["rank"], k["at_step"]) for k in data["kills"]] == [
        (p["rank"], p["step"]) for p in data["config"]["plan"]]
    for k in data["kills"]:
        # Both ranks trained again after the kill, the restarted one from a checkpoint
        # at or before the step the kill landed at.
        assert set(k["first_step_s"]) == {"workerpool0-0", "workerpool1-0"}
        assert k["recovery_s"] == max(k["first_step_s"].values()) > 0
        assert k["resumed_from"] <= k["steps_done_at_kill"]
        assert k["resumed_from"] % 10 == 0
        assert k["survivors_reformed_s"] is not None   # the survivor re-formed in-process
    assert s["recovery_s"]["min"] <= s["recovery_s"]["median"] <= s["recovery_s"]["max"]
    assert "load_average_start" in data["machine"]
    assert not (tmp_path / "job").exists() and not list(tmp_path.glob("bench-soak-*"))
