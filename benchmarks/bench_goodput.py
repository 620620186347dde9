"""Goodput under chaos: which checkpoint policy keeps the most of the wall time productive.

    python benchmarks/bench_goodput.py [--quick] [--rates 20,10] [--policies steps:10,auto]
                                       [--kills 5] [--seed 2] [--steps N] [--out PATH]

Each arm is one real job: ``python -m resilient_train.cli.main launch --workers 2 --chaos
"kill~MEANsxCOUNT" --chaos-seed SEED -- python benchmarks/goodput_worker.py --policy P``.
The worker (goodput_worker.py) is a small data-parallel job under ``@rt.main``: 32 MiB of
tracked state (so a save costs something), a fixed step time (a small forward/backward,
one gradient all-reduce, a 20 ms sleep), ``CheckpointOptions(policy=P)``. The launcher
SIGKILLs a seeded random replica at exponential intervals of mean MEAN seconds (at most
COUNT kills) counted from the job's first RUNNING, restarts it, the survivor re-forms
in-process, and both resume from the latest committed checkpoint. Goodput, lost and
recovery time come from the ``goodput`` section of the job's job.json (resilient_train/
goodput.py): productive step time / wall time from RUNNING to the end.

Every policy at a given rate runs with the same ``--chaos-seed``, so it faces the same
fault times and targets (the schedule is printed and stored). The default seed 2 puts the
first kill at 1.19 x MEAN, after the workers' ~9 s start on this 2-core machine (seed 1's
first kill lands 0.2 x MEAN after RUNNING, before any step). A kill that lands after the
job ended never happens: slower policies may take more of the schedule's kills.

Policies: ``steps:N`` (every N steps), ``seconds:S`` (every S seconds; 14400 = the
platform's 4 hours, i.e. never within these jobs: only the final save), ``auto``
(``auto_interval()``: Young/Daly from the measured save cost and the MTBF the launcher
observed, with its floor scaled from 30 s to ``--auto-floor`` for these compressed jobs).
The ``auto`` arm is skipped, with a note, when resilient_train has no auto_interval.

``--quick`` (about 3 minutes here): one rate (mean 10 s, 3 kills), 800 steps, policies
every 10 / every 100 steps, every 4 h, auto. Default: rates none / 20 s / 10 s, 5 kills,
3000 steps, policies every 10 / 100 / 1000 steps, every 4 h, auto (15 jobs, ~30 min).

Prints a table (policy x fault rate -> goodput, lost, recovery) and writes JSON to
benchmarks/results/goodput.json; exits 1 when any job failed (the JSON says which and why).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from meta import stamp  # benchmarks/, on the path as the script's folder

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "benchmarks" / "goodput_worker.py"
RESULTS = REPO / "benchmarks" / "results" / "goodput.json"

QUICK: dict[str, Any] = {"rates": "10", "kills": 3, "steps": 800,
         "policies": "steps:10,steps:100,seconds:14400,auto"}
FULL: dict[str, Any] = {"rates": "none,20,10", "kills": 5, "steps": 3000,
        "policies": "steps:10,steps:100,steps:1000,seconds:14400,auto"}


def policy_label(spec: str) -> str:
    kind, _, value = spec.partition(":")
    if kind == "steps":
        return f"every {value} steps"
    if kind == "seconds":
        s = float(value)
        if s >= 3600 and s % 3600 == 0:
            return f"every {s / 3600:g} h"
        return f"every {s:g} s"
    if kind == "auto":
        return "auto (Young/Daly)" + (f", MTBF {value} s" if value else "")
    return spec


def rate_label(mean: float | None) -> str:
    return "no faults" if mean is None else f"kill every ~{mean:g} s"


def auto_available() -> str | None:
    """None when auto_interval exists, else why not."""
    try:
        from resilient_train.checkpoint.schedule import policies as policy
    except ImportError as exc:
        return f"resilient_train.checkpoint.schedule.policies cannot be imported: {exc}"
    if not hasattr(policy, "auto_interval"):
        return "resilient_train.checkpoint.schedule.policies has no auto_interval yet"
    return None


def replica_names(workers: int) -> list[str]:
    return ["workerpool0-0"] + [f"workerpool1-{i}" for i in range(workers - 1)]


def schedule(chaos: str, seed: int, workers: int) -> list[dict[str, Any]]:
    """The launcher's own fault schedule for this spec and seed (deterministic)."""
    try:
        from resilient_train.launcher.chaos import ChaosSchedule, parse_chaos

        sched = ChaosSchedule(parse_chaos(chaos, seed=seed), replica_names(workers))
        return [{"at_s": round(f.at, 2), "target": f.target} for f in sched.due(math.inf)]
    except Exception as exc:  # noqa: BLE001  (informational only)
        return [{"error": f"{type(exc).__name__}: {exc}"}]


def primary_saves(job_dir: Path) -> list[tuple[float, int, float]]:
    from resilient_train.observe.jobdir import telemetry_prefixes
    from resilient_train.observe.telemetry import read_life

    saves: list[tuple[float, int, float]] = []
    for prefix in telemetry_prefixes(job_dir, "workerpool0-0"):
        saves.extend(read_life(prefix).saves)
    return sorted(saves)


def auto_log_lines(job_dir: Path) -> list[str]:
    lines = []
    for log in sorted((job_dir / "logs").glob("attempt-*/workerpool0-0.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "auto checkpoint interval" in line:
                lines.append(line.strip()[-300:])
    return lines[:20]


def root_cause(output: str) -> str | None:
    """The last ``SomethingError: message`` line of a worker's output, if any."""
    found = None
    for line in output.splitlines():
        m = re.match(r"^([\w.]*(?:Error|Exception)): (.*)", line.strip())
        if m:
            found = f"{m.group(1)}: {m.group(2)}"
    return found[:600] if found else None


def run_arm(policy: str, mean: float | None, args: argparse.Namespace, root: Path,
            index: int) -> dict[str, Any]:
    name = f"{index:02d}-{policy.replace(':', '-')}-{'none' if mean is None else f'{mean:g}s'}"
    job_dir = root / name
    chaos = None if mean is None else f"kill~{mean:g}sx{args.kills}"
    cmd = [sys.executable, "-m", "resilient_train.cli.main", "launch", "--workers",
           str(args.workers), "--quiet", "--job-dir", str(job_dir), "--name", f"goodput-{name}",
           "--timeout", f"{args.job_timeout:g}s"]
    if chaos:
        cmd += ["--chaos", chaos, "--chaos-seed", str(args.seed)]
    cmd += ["--", sys.executable, str(WORKER), "--policy", policy, "--steps", str(args.steps),
            "--step-time", f"{args.step_time:g}", "--state-mb", f"{args.state_mb:g}",
            "--auto-floor", f"{args.auto_floor:g}"]
    row: dict[str, Any] = {"policy": policy, "label": policy_label(policy), "mean_s": mean,
                           "chaos": chaos, "seed": args.seed if chaos else None,
                           "command": " ".join(cmd)}
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, check=False, cwd=root, capture_output=True, text=True,
                              timeout=args.job_timeout + 60)
        row["launcher_exit"] = proc.returncode
        tail = (proc.stdout + proc.stderr)[-1500:]
    except subprocess.TimeoutExpired as exc:
        row["launcher_exit"] = None
        tail = str(exc)[-1500:]
        row["error"] = f"launcher still running after {args.job_timeout + 60:g} s: killed"
    row["elapsed_s"] = round(time.monotonic() - t0, 1)
    try:
        job = json.loads((job_dir / "job.json").read_text())
    except (OSError, ValueError) as exc:
        row.setdefault("error", f"no job.json: {exc}")
        row["output_tail"] = tail
        return row
    row["state"] = job.get("state")
    gp = job.get("goodput")
    row["goodput"] = gp
    events = job.get("events", [])
    faults = [e for e in events if e.get("kind") == "fault"]
    row["faults"] = len(faults)
    startup = (gp or {}).get("startup_s")
    row["faults_before_training"] = (sum(1 for e in faults if e["elapsed_s"] < startup)
                                     if startup is not None else None)
    row["fault_times_s"] = [e["elapsed_s"] for e in faults]
    saves = primary_saves(job_dir)
    row["saves"] = len(saves)
    row["save_blocking_mean_s"] = (round(sum(s[2] for s in saves) / len(saves), 4)
                                   if saves else None)
    if policy.startswith("auto"):
        row["auto_log"] = auto_log_lines(job_dir)
    if row["state"] != "JOB_STATE_SUCCEEDED":
        why = ((job.get("error") or {}).get("message") or "").strip()
        row.setdefault("error", f"job ended {row['state']} (launcher exit "
                                f"{row['launcher_exit']})" + (f": {why[:400]}" if why else ""))
        row["output_tail"] = tail
        cause = root_cause(tail)
        if cause:
            row["root_cause"] = cause
    elif gp is None:
        row.setdefault("error", "job.json has no goodput section")
    if not args.keep:
        shutil.rmtree(job_dir / "output", ignore_errors=True)   # the checkpoints
    return row


def fmt_cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    gp = row.get("goodput")
    if not gp:
        return "FAILED"
    return (f"{100 * gp['goodput']:5.1f}% lost {gp['lost_s']:5.1f} "
            f"rec {gp['recovery_s']:5.1f}")


def print_table(result: dict[str, Any]) -> None:
    rates = [r["mean_s"] for r in result["rates"]]
    runs = result["runs"]
    by = {(r["policy"], r["mean_s"]): r for r in runs}
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    print()
    print("goodput (productive / wall), lost s = steps computed again, rec s = recovery")
    head = f"{'policy':24}" + "".join(f" | {rate_label(m):^30}" for m in rates)
    print(head)
    print("-" * len(head))
    for p in policies:
        print(f"{policy_label(p):24}" + "".join(f" | {fmt_cell(by.get((p, m))):^30}"
                                                 for m in rates))
    print()
    print(f"{'policy':24} {'rate':>18} {'wall':>6} {'startup':>7} {'ckpt':>6} {'other':>6} "
          f"{'steps lost':>10} {'faults':>6} {'saves':>6} {'blocking':>8}")
    for r in runs:
        gp = r.get("goodput") or {}
        blocking = r.get("save_blocking_mean_s")
        print(f"{policy_label(r['policy']):24} {rate_label(r['mean_s']):>18} "
              f"{gp.get('wall_s', float('nan')):6.1f} {gp.get('startup_s', float('nan')):7.1f} "
              f"{gp.get('checkpoint_s', float('nan')):6.2f} {gp.get('other_s', float('nan')):6.1f} "
              f"{gp.get('steps_lost', '-'):>10} {r.get('faults', '-'):>6} "
              f"{r.get('saves', '-'):>6} "
              f"{'-' if blocking is None else f'{blocking * 1000:.0f} ms':>8}"
              + (f"  ERROR: {r['error']}" if r.get("error") else ""))
    for note in result.get("notes", []):
        print(f"note: {note}")


def parse_rates(text: str) -> list[float | None]:
    out: list[float | None] = []
    for item in text.split(","):
        item = item.strip().removesuffix("s")
        if not item:
            continue
        out.append(None if item in ("none", "0") else float(item))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one rate, four policies, short jobs")
    ap.add_argument("--rates", default=None,
                    help="mean seconds between kills, comma-separated; 'none' = no faults "
                         f"(default {FULL['rates']}; --quick {QUICK['rates']})")
    ap.add_argument("--policies", default=None,
                    help=f"comma-separated (default {FULL['policies']}; --quick "
                         f"{QUICK['policies']})")
    ap.add_argument("--kills", type=int, default=None,
                    help=f"at most this many kills per job (default {FULL['kills']}; "
                         f"--quick {QUICK['kills']})")
    ap.add_argument("--seed", type=int, default=2, help="--chaos-seed, the same for every "
                    "policy")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"steps per job (default {FULL['steps']}; --quick {QUICK['steps']})")
    ap.add_argument("--step-time", type=float, default=0.02, help="sleep per step (s)")
    ap.add_argument("--state-mb", type=float, default=32.0, help="checkpointed state (MiB)")
    ap.add_argument("--auto-floor", type=float, default=1.0,
                    help="auto_interval's floor_s in these compressed jobs")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--job-timeout", type=float, default=600.0,
                    help="the launcher's --timeout per job (s)")
    ap.add_argument("--workdir", default=None, help="where job directories go (default: a "
                    "temporary directory, removed afterwards unless --keep)")
    ap.add_argument("--keep", action="store_true", help="keep job directories and checkpoints")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    preset = QUICK if args.quick else FULL
    rates = parse_rates(args.rates or preset["rates"])
    policies = [p.strip() for p in (args.policies or preset["policies"]).split(",") if p.strip()]
    args.kills = args.kills if args.kills is not None else preset["kills"]
    args.steps = args.steps if args.steps is not None else preset["steps"]

    notes: list[str] = []
    skipped: list[dict[str, str]] = []
    why = auto_available()
    if why is not None:
        for p in [p for p in policies if p.startswith("auto")]:
            policies.remove(p)
            skipped.append({"policy": p, "why": why})
            notes.append(f"arm {p!r} skipped: {why}")
    rate_info: list[dict[str, Any]] = []
    for mean in rates:
        chaos = None if mean is None else f"kill~{mean:g}sx{args.kills}"
        rate_info.append({"mean_s": mean, "chaos": chaos, "seed": args.seed if chaos else None,
                          "schedule": schedule(chaos, args.seed, args.workers) if chaos else []})

    t_start = time.monotonic()
    load_start = os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="bench-goodput-", dir=args.workdir))
    runs: list[dict[str, Any]] = []
    try:
        index = 0
        for info in rate_info:
            mean = info["mean_s"]
            sched = ", ".join(f"{f['at_s']:g}s {f.get('target', '?')}"
                              for f in info["schedule"]) or "none"
            print(f"{rate_label(mean)} (seed {args.seed}): schedule {sched}", flush=True)
            for policy in policies:
                index += 1
                row = run_arm(policy, mean, args, root, index)
                runs.append(row)
                gp = row.get("goodput") or {}
                print(f"  {policy_label(policy):24} {fmt_cell(row):32} wall "
                      f"{gp.get('wall_s', float('nan')):5.1f} s, faults {row.get('faults', '?')}, "
                      f"saves {row.get('saves', '?')}, took {row['elapsed_s']:.0f} s"
                      + (f"  ERROR: {row['error']}" if row.get("error") else ""), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    elapsed = time.monotonic() - t_start


    result = {
        "benchmark": "goodput",
        **stamp(load_average_start=[round(x, 2) for x in load_start],
                load_average_end=[round(x, 2) for x in os.getloadavg()]),
        "config": {"quick": args.quick, "workers": args.workers, "steps": args.steps,
                   "step_time_s": args.step_time, "state_mb": args.state_mb,
                   "kills": args.kills, "seed": args.seed, "auto_floor_s": args.auto_floor,
                   "policies": policies, "rates_mean_s": rates},
        "rates": rate_info,
        "runs": runs,
        "skipped": skipped,
        "notes": notes,
        "elapsed_s": round(elapsed, 1),
    }
    print_table(result)
    print(f"\ntotal {elapsed:.0f} s; load average at start {load_start[0]:.2f}, "
          f"at end {os.getloadavg()[0]:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    failed = [r for r in runs if r.get("error")]
    if failed:
        print(f"{len(failed)} of {len(runs)} jobs failed: "
              + "; ".join(f"{r['policy']} at {rate_label(r['mean_s'])}: {r['error']}"
                          for r in failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
