"""Soak: one 4-worker job killed 20 times at seeded random steps, over every rank.

    python benchmarks/bench_soak.py [--kills 20] [--seed 1] [--workers 4] [--out PATH]
        [--against torchrun|none] [--torchrun-store shared|own] [--recovery-limit 60]
    python benchmarks/bench_soak.py --chaos "kill:1@step40,kill:2@step90" --steps 300 \
        --against none

One launcher job, ``python -m resilient_train.cli.main launch --workers 4 --chaos
kill:R@stepN,...`` running ``examples/train_demo.py`` (DDP over gloo, a save every 10
steps). The kills are SIGKILLs from the launcher, each once the primary has finished step
N: the first at a seeded random step in ``[--first-min, --first-max]``, each next one
``[--gap-min, --gap-max]`` steps later, the ranks a seeded shuffle of 0..W-1 repeated, so
every rank dies ``kills / W`` times (20 kills, 4 workers: 5 each, exactly the platform's
default ``worker_restarts`` budget; a larger share gets a policy file that raises it, so
the soak measures restarts in place, not the budget). A step-triggered kill reads the
primary's current life, and DDP keeps the ranks in step, so a kill can only fire once
every rank trains again after the previous one. It lands a step or a few after N (the
launcher polls the primary's progress): the primary's step when training stopped is
recorded too.

Measured from the job's own record, nothing added to the worker:

- the kill: the launcher's ``chaos: kill on REPLICA at step N`` event in ``job.json``
  (written just before its SIGKILL);
- every rank training again: each replica's telemetry (``JOB_DIR/telemetry``, the
  launcher's goodput accounting) has one segment per stretch of training, from the restore
  (``t_start``, ``first_step`` = the step restored) to the first step done after it
  (``t_first``). A kill's **recovery** = the last of the W ranks' ``t_first`` in the
  first segment that starts after the kill, minus the kill's time: a restarted process's
  start, ``import torch``, joining the group and restoring, or a survivor's noticing, in-
  process re-form and restore, whichever is slower, plus one training step;
- survivors' re-form: the ``process group re-formed at generation G in X s`` lines in
  ``JOB_DIR/logs``, the j-th of a life matched to that life's (j+1)-th segment;
- steps lost: the primary's last step before the kill minus the step restored;
- job retries: ``len(attempts) - 1`` in job.json; a kill whose recovery segment is in a
  later attempt recovered by a job retry, not in place.

A failure: a kill after which some rank never trained again (before the next kill, or
before the job ended), a planned kill that never fired, or the job not SUCCEEDED. Prints a
table and writes JSON (with the load average at start and end: other jobs on this 2-core
machine swing these numbers) to benchmarks/results/soak.json. ``--chaos`` runs a spec
given verbatim instead of the seeded plan (``--steps`` then sets the job's length).

Then, in the same run (``--against torchrun``, the default; ``none`` skips it), the tool a
user would pick instead: ``torchrun --standalone --nnodes 1 --nproc-per-node W
--max-restarts K`` (K = the kills: one restart round per kill) on the same training,
``train_demo.py`` unchanged (it reads torchrun's variables and resumes from its own
checkpoint directory), started by benchmarks/soak_torchrun_worker.py, which gives each
process the per-life telemetry prefix the launcher would and writes its pid. The same
plan: once the primary's current life has finished step N (its telemetry, polled every
0.02 s; the launcher polls every 0.05 s) the harness SIGKILLs rank R's process; torchrun
then stops the other workers (SIGTERM) and starts all W again. Recovery is measured the
same way, from the same telemetry: the harness's time just before its SIGKILL -> the
last rank's first step done in a segment that began after it. The differences: the kill
time is the harness's clock, not a job.json event; no rank re-forms in-process (every one
is a new process), so "re-formed s" is empty; a kill not recovered from within
``--recovery-limit`` (60 s) is a failure and ends that job (the rest count as never
fired); restarts used = the highest ``TORCHELASTIC_RESTART_COUNT`` seen. ``--torchrun-store
own`` sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (see bench_distributed.py: plain
``init_process_group`` scripts need it; ``rt.main`` keeps one store namespace per restart
round, so it recovers either way). Printed side by side with the ratio of the medians
(torchrun / ours), and written under ``torchrun`` in the JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from meta import stamp  # benchmarks/, on the path as the script's folder  # noqa: E402

from resilient_train.launcher.chaos import ChaosSpecError, FaultKind, parse_chaos  # noqa: E402
from resilient_train.observe.jobdir import telemetry_prefixes  # noqa: E402
from resilient_train.observe.telemetry import Segment, read_life, read_step  # noqa: E402
from resilient_train.platform.rules import DEFAULT_BUDGETS  # noqa: E402

DEMO = REPO / "examples" / "train_demo.py"
TORCHRUN_WORKER = REPO / "benchmarks" / "soak_torchrun_worker.py"
RESULTS = REPO / "benchmarks" / "results" / "soak.json"
DEFAULT_RESTARTS = DEFAULT_BUDGETS["worker_restarts"].limit

_KILL_RE = re.compile(r"^chaos: kill on (\S+)(?: at step (\d+))?$")
_REFORM_RE = re.compile(r"process group re-formed at generation (\d+) in ([\d.]+) s")
_LIFE_RE = re.compile(r"^===== (\S+) attempt (\d+) restart (\d+) at ")


# --- the plan ----------------------------------------------------------------------------

def plan_kills(kills: int, workers: int, seed: int, first: tuple[int, int],
               gap: tuple[int, int]) -> list[tuple[int, int]]:
    """(rank, step) per kill: steps from the seeded RNG, ranks a shuffled even share."""
    if kills < 1:
        raise ValueError(f"--kills must be >= 1, found {kills}")
    if workers < 2:
        raise ValueError(f"--workers must be >= 2 (a kill needs survivors), found {workers}")
    if not 1 <= first[0] <= first[1]:
        raise ValueError(f"--first-min/--first-max must satisfy 1 <= min <= max, found {first}")
    # A step-triggered kill fires a few steps late (the launcher polls the primary): a gap
    # under 5 steps could fire two kills in one poll.
    if not 5 <= gap[0] <= gap[1]:
        raise ValueError(f"--gap-min/--gap-max must satisfy 5 <= min <= max, found {gap}")
    rng = random.Random(seed)
    ranks = [i % workers for i in range(kills)]
    rng.shuffle(ranks)
    step = rng.randint(*first)
    out = []
    for rank in ranks:
        out.append((rank, step))
        step += rng.randint(*gap)
    return out


def chaos_spec(plan: list[tuple[int, int]]) -> str:
    return ",".join(f"kill:{rank}@step{step}" for rank, step in plan)


def policy_for(plan: list[tuple[int, int]]) -> dict[str, Any] | None:
    """A policy that lets every replica restart as often as the plan kills it; None when
    the platform's default budget already does."""
    most = max(sum(1 for r, _ in plan if r == rank) for rank in {r for r, _ in plan})
    if most <= DEFAULT_RESTARTS:
        return None
    return {"budgets": {"worker_restarts": {"limit": most, "scope": "worker"}},
            "rules": [{"name": "soak-node-loss", "match": {"causes": ["node_loss"]},
                       "actions": ["restart_worker:worker_restarts", "retry_job:job_retries"]}]}


# --- the job -----------------------------------------------------------------------------

def job_env(work: Path) -> dict[str, str]:
    """The caller's environment without a launcher's or torchrun's variables, so the job
    is this benchmark's own (quota in its own directory, no GPUs, gloo on loopback)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC_", "RESILIENT_TRAIN_", "MASTER_", "AIP_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                         "GROUP_RANK", "CLUSTER_SPEC", "TF_CONFIG")}
    env.update({"GLOO_SOCKET_IFNAME": "lo", "RESILIENT_TRAIN_GPUS": "none",
                "RESILIENT_TRAIN_QUOTA_DIR": str(work / "quota"),
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                            os.environ.get("PYTHONPATH")]))})
    return env


def run_job(work: Path, spec: str, steps: int, workers: int, step_time: float,
            save_every: int, policy: dict[str, Any] | None,
            timeout: float) -> tuple[int | None, str, float]:
    """The launcher job; (its exit status or None when it was stopped at ``timeout``, the
    tail of its output, wall seconds)."""
    job_dir = work / "job"
    out_path = work / "launcher.out"
    cmd = [sys.executable, "-m", "resilient_train.cli.main", "launch", "--workers", str(workers),
           "--job-dir", str(job_dir), "--quiet", "--timeout", f"{int(timeout)}s",
           "--chaos", spec]
    if policy is not None:
        (work / "policy.json").write_text(json.dumps(policy))
        cmd += ["--policy", str(work / "policy.json")]
    cmd += ["--", sys.executable, str(DEMO), "--steps", str(steps), "--step-time",
            f"{step_time:g}", "--save-every", str(save_every)]
    t0 = time.monotonic()
    with out_path.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=job_env(work), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    rc: int | None
    try:
        rc = proc.wait(timeout=timeout + 60)   # the launcher's own --timeout first
    except subprocess.TimeoutExpired:
        proc.terminate()   # the launcher stops its workers on SIGTERM
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        rc = None
    wall = time.monotonic() - t0
    return rc, out_path.read_text(errors="replace")[-3000:], wall


# --- the torchrun job -------------------------------------------------------------------

def _current_life(bench: Path, rank: int) -> tuple[int, Path] | None:
    """(restart round, pid file) of ``rank``'s newest life; None before its first."""
    best = None
    for f in (bench / "pids").glob(f"rank{rank}.restart-*"):
        n = int(f.name.rsplit("-", 1)[1])
        if best is None or n > best[0]:
            best = (n, f)
    return best


def _all_trained_since(bench: Path, workers: int, t: float) -> bool:
    """Every rank has finished a step in a segment that began after ``t`` (telemetry)."""
    for r in range(workers):
        segs = [s for _, _, ss in _lives(bench, f"rank{r}") for s in ss]
        if not any(s.t_start > t and s.t_first is not None for s in segs):
            return False
    return True


def run_torchrun(work: Path, plan: list[tuple[int, int]], steps: int, workers: int,
                 step_time: float, save_every: int, max_restarts: int, limit: float,
                 share_store: bool, timeout: float) -> dict[str, Any]:
    """``torchrun --standalone`` on the same training and the same plan: the harness
    SIGKILLs rank R's process once the primary's current life has finished step N (its
    telemetry, polled every 0.02 s), then waits up to ``limit`` s for
    every rank to train again; a kill not recovered from by then ends the job."""
    bench = work / "torchrun"
    bench.mkdir()
    out_path = work / "torchrun.out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", str(workers), "--max-restarts", str(max_restarts),
           str(TORCHRUN_WORKER), "--steps", str(steps), "--step-time", f"{step_time:g}",
           "--save-every", str(save_every), "--checkpoint-dir", str(bench / "checkpoints")]
    env = job_env(work)
    env["BENCH_SOAK_DIR"] = str(bench)
    if not share_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    t0 = time.monotonic()
    with out_path.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    kills: list[dict[str, Any]] = []
    why = None
    try:
        for rank, at in plan:
            fired = False
            while proc.poll() is None and time.monotonic() - t0 < timeout:
                primary, victim = _current_life(bench, 0), _current_life(bench, rank)
                done = None if primary is None else read_step(
                    bench / "telemetry" / "attempt-1" / f"rank0.restart-{primary[0]}")
                # The victim's life in the primary's round: a kill is one restart round.
                if (done is not None and done >= at and primary is not None
                        and victim is not None and victim[0] == primary[0]):
                    pid = int(victim[1].read_text())
                    t_kill = time.time()
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        break   # it was leaving: recorded below as never fired
                    kills.append({"replica": f"rank{rank}", "rank": rank, "at_step": at,
                                  "attempt": 1, "t": t_kill})
                    fired = True
                    break
                time.sleep(0.02)   # about a step: the kill lands a step or so late
            if not fired:
                why = "torchrun exited" if proc.poll() is not None else "no progress"
                break
            deadline = time.monotonic() + limit
            while (proc.poll() is None and time.monotonic() < deadline
                   and not _all_trained_since(bench, workers, t_kill)):
                time.sleep(0.2)
            if not _all_trained_since(bench, workers, t_kill):
                why = (f"not every rank trained again within {limit:g} s" if proc.poll() is None
                       else f"torchrun exited ({proc.returncode}) before every rank trained "
                            f"again")
                break
        if why is None:
            proc.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        why = f"torchrun did not finish within {timeout:g} s"
    finally:
        if proc.poll() is None:   # stopped by the harness: no exit status of its own
            proc.terminate()   # torchrun stops its workers on SIGTERM
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc: int | None = None
        else:
            rc = proc.returncode
    end = time.time()
    wall = time.monotonic() - t0
    rows = kill_rows(bench, [f"rank{r}" for r in range(workers)], kills, end)
    rounds = [_current_life(bench, r) for r in range(workers)]
    restarts = max((life[0] for life in rounds if life), default=0)
    tail = out_path.read_text(errors="replace")[-3000:]
    return {"rows": rows, "rc": rc, "why": why, "restarts_used": restarts,
            "tail": tail, "wall": wall, "connectFullMesh": "connectFullMesh" in tail}


# --- measuring ---------------------------------------------------------------------------

def _epoch(iso: str) -> float:
    return dt.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _lives(job_dir: Path, replica: str) -> list[tuple[int, int, list[Segment]]]:
    """(attempt, restart, segments) of every life of ``replica`` that reported, in order."""
    out = []
    for prefix in telemetry_prefixes(job_dir, replica):
        attempt = int(prefix.parent.name.split("-")[1])
        restart = int(prefix.name.rsplit(".restart-", 1)[1])
        segs = sorted(read_life(prefix).segments, key=lambda s: s.t_start)
        out.append((attempt, restart, segs))
    return sorted(out)


def _reforms(job_dir: Path, replica: str) -> dict[tuple[int, int], list[tuple[int, float]]]:
    """(generation, seconds) of each in-process re-form, per (attempt, restart) life."""
    out: dict[tuple[int, int], list[tuple[int, float]]] = {}
    for log in sorted((job_dir / "logs").glob(f"attempt-*/{replica}.log")):
        life: tuple[int, int] | None = None
        for line in log.read_text(errors="replace").splitlines():
            head = _LIFE_RE.match(line)
            if head and head.group(1) == replica:
                life = (int(head.group(2)), int(head.group(3)))
                out.setdefault(life, [])
                continue
            m = _REFORM_RE.search(line)
            if m and life is not None:
                out[life].append((int(m.group(1)), float(m.group(2))))
    return out


def measure(job_dir: Path) -> dict[str, Any]:
    """Per kill: when it landed, whether and how fast every rank trained again."""
    job = json.loads((job_dir / "job.json").read_text())
    replicas: list[str] = job["replicas"]
    kills = []
    for e in job.get("events", []):
        m = _KILL_RE.match(e.get("message", "")) if e.get("kind") == "fault" else None
        if m:
            kills.append({"replica": m.group(1), "rank": replicas.index(m.group(1)),
                          "at_step": int(m.group(2)) if m.group(2) else None,
                          "attempt": e.get("attempt"), "t": _epoch(e["time"])})
    end = _epoch(job["end_time"]) if job.get("end_time") else math.inf
    return {"job": job, "kills": kill_rows(job_dir, replicas, kills, end)}


def kill_rows(job_dir: Path, replicas: list[str], kills: list[dict[str, Any]],
              end: float) -> list[dict[str, Any]]:
    """One row per kill ({replica, rank, at_step, attempt, t}) from the replicas'
    telemetry under ``job_dir``: the launcher's job, or a torchrun job laid out the same
    way (soak_torchrun_worker.py)."""
    lives = {r: _lives(job_dir, r) for r in replicas}
    reforms = {r: _reforms(job_dir, r) for r in replicas}
    rows = []
    for k, kill in enumerate(kills):
        t_kill = kill["t"]
        t_next = kills[k + 1]["t"] if k + 1 < len(kills) else end
        row: dict[str, Any] = {"kill": k + 1, "rank": kill["rank"], "replica": kill["replica"],
                               "at_step": kill["at_step"], "attempt": kill["attempt"]}
        firsts: dict[str, float] = {}
        attempts: set[int] = set()
        reform_s: list[float] = []
        generation = None
        resumed = None
        missing = []
        for r in replicas:
            found = None
            for attempt, restart, segs in lives[r]:
                for i, seg in enumerate(segs):
                    if seg.t_start > t_kill and seg.t_first is not None:
                        found = (attempt, restart, i, seg)
                        break
                if found:
                    break
            if found is None or found[3].t_first is None or found[3].t_first > t_next:
                missing.append(r)
                continue
            attempt, restart, i, seg = found
            firsts[r] = seg.t_first - t_kill
            attempts.add(attempt)
            if r == replicas[0]:
                resumed = seg.first_step
            # Segment i > 0 of a life began after that life's i-th in-process re-form.
            life_reforms = reforms[r].get((attempt, restart), [])
            if i > 0 and len(life_reforms) >= i:
                generation, secs = life_reforms[i - 1]
                reform_s.append(secs)
        # The primary's last step before the kill: its latest segment that began before.
        before = [s for _, _, segs in lives[replicas[0]] for s in segs if s.t_start <= t_kill]
        last = max(before, key=lambda s: s.t_start).last_step if before else None
        row["steps_done_at_kill"] = last
        row["resumed_from"] = resumed
        # ``last`` is what the primary's telemetry showed when the kill fired; a step it
        # finished after that write is resumed from (resumed > last): nothing was lost.
        row["steps_lost"] = (max(0, last - resumed) if last is not None and resumed is not None
                             else None)
        row["survivors_reformed_s"] = round(max(reform_s), 3) if reform_s else None
        row["generation"] = generation
        row["first_step_s"] = {r: round(v, 3) for r, v in firsts.items()}
        if missing:
            where = "the next kill" if k + 1 < len(kills) else "the job ended"
            row.update(recovered=False, recovery_s=None,
                       why=f"{', '.join(missing)} did not train again before {where}")
        else:
            row["recovered"] = True
            row["recovery_s"] = round(max(firsts.values()), 3)
            row["slowest"] = max(firsts, key=lambda r: firsts[r])
            row["job_retry"] = any(a != kill["attempt"] for a in attempts)
        rows.append(row)
    return rows


def summarize(rows: list[dict[str, Any]], planned: int, job: dict[str, Any],
              rc: int | None, steps: int) -> dict[str, Any]:
    for r in rows:
        done = r.get("steps_done_at_kill")
        if not r["recovered"] and done is not None and done >= steps:
            # Training had finished: the kill hit a worker leaving, not a training step.
            r["why"] += (f"; it landed after the last step ({done} of {steps}: raise --tail "
                         f"or --step-time)")
    secs = sorted(r["recovery_s"] for r in rows if r["recovered"])
    failures = [f"kill {r['kill']} (rank {r['rank']} at step {r['at_step']}): {r['why']}"
                for r in rows if not r["recovered"]]
    if len(rows) < planned:
        failures.append(f"{planned - len(rows)} of {planned} planned kills never fired")
    state = job.get("state")
    if state != "JOB_STATE_SUCCEEDED":
        failures.append(f"the job ended {state} (launcher exit {rc})"
                        + (f": {job.get('error')}" if job.get("error") else ""))
    out: dict[str, Any] = {
        "planned_kills": planned, "kills_fired": len(rows),
        "recovered": len(secs), "recovered_in_place": sum(
            1 for r in rows if r["recovered"] and not r.get("job_retry")),
        "job_retries": max(0, len(job.get("attempts") or []) - 1),
        "job_state": state, "launcher_exit": rc, "failures": failures,
    }
    if secs:
        out["recovery_s"] = {"min": secs[0], "median": round(statistics.median(secs), 3),
                             "max": secs[-1], "mean": round(statistics.fmean(secs), 3)}
    by_rank: dict[int, list[float]] = {}
    for r in rows:
        if r["recovered"]:
            by_rank.setdefault(r["rank"], []).append(r["recovery_s"])
    out["median_by_victim_rank"] = {str(k): round(statistics.median(v), 3)
                                    for k, v in sorted(by_rank.items())}
    gp = job.get("goodput") or {}
    out["goodput"] = {k: gp.get(k) for k in ("wall_s", "goodput", "recoveries", "recovery_s",
                                             "steps_lost", "steps")}
    return out


def summarize_torchrun(res: dict[str, Any], planned: int, limit: float,
                       max_restarts: int) -> dict[str, Any]:
    """The torchrun job's counterpart of ``summarize``: every recovery is a restart of all
    workers (torchrun's only way), so none is "in place"."""
    rows = res["rows"]
    for r in rows:
        if r["recovered"] and r["recovery_s"] > limit:
            r.update(recovered=False, why=f"every rank trained again only after "
                                          f"{r['recovery_s']:.1f} s (limit {limit:g} s)")
    secs = sorted(r["recovery_s"] for r in rows if r["recovered"])
    failures = [f"kill {r['kill']} (rank {r['rank']} at step {r['at_step']}): {r['why']}"
                for r in rows if not r["recovered"]]
    if len(rows) < planned:
        failures.append(f"{planned - len(rows)} of {planned} planned kills never fired"
                        + (f" ({res['why']})" if res["why"] else ""))
    if res["rc"] != 0:
        failures.append("torchrun " + (f"exited {res['rc']}" if res["rc"] is not None
                                       else "was stopped by the harness")
                        + (" (Gloo connectFullMesh failed in its output)"
                           if res["connectFullMesh"] else ""))
    out: dict[str, Any] = {"planned_kills": planned, "kills_fired": len(rows),
                           "recovered": len(secs), "restarts_used": res["restarts_used"],
                           "max_restarts": max_restarts, "recovery_limit_s": limit,
                           "torchrun_exit": res["rc"], "failures": failures}
    if secs:
        out["recovery_s"] = {"min": secs[0], "median": round(statistics.median(secs), 3),
                             "max": secs[-1], "mean": round(statistics.fmean(secs), 3)}
    return out


def print_comparison(ours: dict[str, Any], theirs: dict[str, Any], workers: int,
                     ratio: float | None) -> None:
    def cell(s: dict[str, Any]) -> str:
        rec = s.get("recovery_s") or {}
        return f"{rec.get('min', '-')} / {rec.get('median', '-')} / {rec.get('max', '-')}"
    # Processes restarted: ours restarts the killed worker only, torchrun all of them.
    rows = [("resilient-train launch", ours, str(ours["kills_fired"])),
            (f"torchrun --max-restarts {theirs['max_restarts']}", theirs,
             f"{theirs['restarts_used']} x {workers}")]
    print(f"\n{'':<28} {'recovered':>9} {'recovery s min / median / max':>30} "
          f"{'restarted':>10} {'failures':>8}")
    for name, s, restarted in rows:
        print(f"{name:<28} {str(s['recovered']) + '/' + str(s['planned_kills']):>9} "
              f"{cell(s):>30} {restarted:>10} {len(s['failures']):>8}")
    if ratio is not None:
        print(f"median recovery, torchrun / ours: {ratio:.2f}x")
    for f in theirs["failures"]:
        print(f"  TORCHRUN FAILURE: {f}")


def print_table(rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    print(f"\n{'kill':>4} {'rank':>4} {'step':>5} {'landed':>6} {'resumed':>7} {'lost':>4} "
          f"{'re-formed s':>11} {'recovery s':>10}  slowest / note")
    for r in rows:
        def num(v: Any, fmt: str) -> str:
            return "-" if v is None else format(v, fmt)
        note = (r.get("slowest", "") + (" (job retry)" if r.get("job_retry") else "")
                if r["recovered"] else f"FAILED: {r['why']}")
        print(f"{r['kill']:>4} {r['rank']:>4} {num(r['at_step'], 'd'):>5} "
              f"{num(r['steps_done_at_kill'], 'd'):>6} "
              f"{num(r['resumed_from'], 'd'):>7} {num(r['steps_lost'], 'd'):>4} "
              f"{num(r['survivors_reformed_s'], '.2f'):>11} {num(r['recovery_s'], '.2f'):>10}  "
              f"{note}")
    s = summary
    rec = s.get("recovery_s") or {}
    print(f"\nrecovered {s['recovered']}/{s['planned_kills']} kills "
          f"({s['recovered_in_place']} in place); recovery s min {rec.get('min', '-')}, "
          f"median {rec.get('median', '-')}, max {rec.get('max', '-')}; job retries "
          f"{s['job_retries']}; job {s['job_state']}; failures {len(s['failures'])}")
    for f in s["failures"]:
        print(f"  FAILURE: {f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=20, help="kills in the job (default 20)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1, help="seeds the kill steps and ranks")
    ap.add_argument("--first-min", type=int, default=20, help="earliest first kill step")
    ap.add_argument("--first-max", type=int, default=40, help="latest first kill step")
    ap.add_argument("--gap-min", type=int, default=20, help="fewest steps between kills")
    ap.add_argument("--gap-max", type=int, default=40, help="most steps between kills")
    ap.add_argument("--tail", type=int, default=40, help="steps after the last kill")
    ap.add_argument("--steps", type=int, default=None,
                    help="the job's steps (default: the last kill's step + --tail)")
    ap.add_argument("--step-time", type=float, default=0.02,
                    help="train_demo.py --step-time: sleep per step (s)")
    ap.add_argument("--save-every", type=int, default=10, help="train_demo.py --save-every")
    ap.add_argument("--chaos", default=None,
                    help="run this chaos spec verbatim instead of the seeded plan "
                         "(needs --steps)")
    ap.add_argument("--job-timeout", type=float, default=1200.0,
                    help="the launcher's --timeout (s); the job is stopped after it")
    ap.add_argument("--workdir", default=None, help="where the job directory goes (default: "
                    "a temporary directory, removed afterwards unless --keep or a failure)")
    ap.add_argument("--keep", action="store_true", help="keep the job directory")
    ap.add_argument("--against", choices=["torchrun", "none"], default="torchrun",
                    help="also run the same plan under torchrun --max-restarts (default), "
                         "or not (none: the quick and test sizes)")
    ap.add_argument("--torchrun-store", choices=["shared", "own"], default="shared",
                    help="shared: torch's default, the agent's TCPStore serves the workers; "
                         "own: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    ap.add_argument("--max-restarts", type=int, default=None,
                    help="torchrun --max-restarts (default: --kills, one round per kill)")
    ap.add_argument("--recovery-limit", type=float, default=60.0,
                    help="a torchrun kill not recovered from within this many s is a "
                         "failure and ends that job")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()

    plan: list[tuple[int, int]] = []
    try:
        if args.chaos is not None:
            if args.steps is None:
                ap.error("--chaos needs --steps (the job's length: train_demo.py --steps)")
            faults = parse_chaos(args.chaos, seed=args.seed).faults
            spec = args.chaos
            planned = sum(1 for f in faults if f.kind is FaultKind.KILL)
            last = max((f.at_step or 0 for f in faults), default=0)
        else:
            plan = plan_kills(args.kills, args.workers, args.seed,
                              (args.first_min, args.first_max), (args.gap_min, args.gap_max))
            spec = chaos_spec(plan)
            planned = len(plan)
            last = plan[-1][1]
    except (ValueError, ChaosSpecError) as exc:
        ap.error(str(exc))
    steps = args.steps if args.steps is not None else last + args.tail
    if steps <= last:
        ap.error(f"--steps {steps} ends before the last kill at step {last}: raise it")
    policy = policy_for(plan) if plan else None
    if args.against == "torchrun" and not plan:
        ap.error("--against torchrun needs the seeded plan: add --against none to --chaos")
    max_restarts = args.max_restarts if args.max_restarts is not None else planned
    if max_restarts < 0:
        ap.error(f"--max-restarts must be >= 0, found {max_restarts}")
    if args.recovery_limit <= 0:
        ap.error(f"--recovery-limit must be > 0 s, found {args.recovery_limit:g}")
    print(f"{args.workers} workers, {steps} steps, {planned} kills: {spec}", flush=True)

    load_start = [round(x, 2) for x in os.getloadavg()]
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="bench-soak-", dir=args.workdir))
    keep = args.keep
    try:
        rc, tail, wall = run_job(work, spec, steps, args.workers, args.step_time,
                                 args.save_every, policy, args.job_timeout)
        try:
            measured = measure(work / "job")
        except (FileNotFoundError, json.JSONDecodeError, KeyError) as exc:
            print(f"no job record to measure ({type(exc).__name__}: {exc}); launcher "
                  f"output:\n{tail}", file=sys.stderr)
            keep = True
            return 1
        rows, job = measured["kills"], measured["job"]
        summary = summarize(rows, planned, job, rc, steps)
        if summary["failures"]:
            keep = True
        torchrun: dict[str, Any] | None = None
        if args.against == "torchrun":
            print(f"torchrun --standalone --max-restarts {max_restarts}, the same plan",
                  flush=True)
            tr = run_torchrun(work, plan, steps, args.workers, args.step_time,
                              args.save_every, max_restarts, args.recovery_limit,
                              args.torchrun_store == "shared", args.job_timeout)
            torchrun = {"summary": summarize_torchrun(tr, planned, args.recovery_limit,
                                                      max_restarts),
                        "kills": tr["rows"], "job_wall_s": round(tr["wall"], 1)}
            if torchrun["summary"]["failures"]:
                torchrun["output_tail"] = tr["tail"]
                keep = True
    finally:
        if keep:
            print(f"job directory kept: {work / 'job'}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    elapsed = time.monotonic() - t0
    print_table(rows, summary)
    ratio = None
    if torchrun is not None:
        print("\ntorchrun:")
        print_table(torchrun["kills"], {**torchrun["summary"], "recovered_in_place": 0,
                                        "job_retries": 0, "job_state": "-"})
        ours_med = (summary.get("recovery_s") or {}).get("median")
        theirs_med = (torchrun["summary"].get("recovery_s") or {}).get("median")
        if ours_med and theirs_med:
            ratio = round(theirs_med / ours_med, 2)
        print_comparison(summary, torchrun["summary"], args.workers, ratio)
    load_end = [round(x, 2) for x in os.getloadavg()]
    print(f"\njob {wall:.0f} s; load average at start {load_start}, at end {load_end}")


    result = {
        "benchmark": "soak",
        **stamp(load_average_start=load_start, load_average_end=load_end),
        "config": {"workers": args.workers, "kills": planned, "seed": args.seed,
                   "steps": steps, "step_time_s": args.step_time,
                   "save_every": args.save_every, "chaos": spec,
                   "plan": [{"rank": r, "step": s} for r, s in plan] or None,
                   "gap_steps": None if args.chaos else [args.gap_min, args.gap_max],
                   "policy": policy},
        "summary": summary,
        "kills": rows,
        "job_wall_s": round(wall, 1),
        "elapsed_s": round(elapsed, 1),
    }
    if torchrun is not None:
        result["config"]["torchrun"] = {
            "command": f"torchrun --standalone --nnodes 1 --nproc-per-node {args.workers} "
                       f"--max-restarts {max_restarts} benchmarks/soak_torchrun_worker.py",
            "store": args.torchrun_store, "recovery_limit_s": args.recovery_limit}
        result["torchrun"] = torchrun
        result["median_ratio_torchrun_to_ours"] = ratio
    if summary["failures"]:
        result["launcher_output_tail"] = tail
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
