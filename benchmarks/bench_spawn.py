"""Several processes per machine: ``resilient-train spawn`` against torchrun when a machine
is lost.

    python benchmarks/bench_spawn.py [--steps 160] [--timeout 120] [--out PATH]

One launcher job per arm, 2 machines (replicas) of 2 processes each, running
examples/train_demo.py under ``@rt.main``; the second machine is killed at step 40, then
the first (the primary's, which hosts the rendezvous) at step 100. The arms differ only in
the replica's command:

- **spawn**: ``resilient-train spawn --nproc-per-node 2 -- python examples/train_demo.py``;
- **torchrun**: ``examples/torchrun_replica.sh`` (torchrun's static rendezvous, its
  defaults), what a user would run instead.

Per kill: the kill -> every machine finished a step again (telemetry), steps lost, where
the state came from. torchrun's first machine, restarted alone, waits in its rendezvous for
the other machine's agent (600 s by default): the job is stopped at ``--timeout``, and the
row says it did not train again. Writes JSON (with the load average) to
benchmarks/results/spawn.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import bench_soak  # noqa: E402 - benchmarks/, on the path as the script's folder
from meta import stamp  # noqa: E402

DEMO = REPO / "examples" / "train_demo.py"
ARMS = {
    "spawn": [sys.executable, "-m", "resilient_train.cli.main", "spawn", "--nproc-per-node", "2",
              "--", sys.executable, str(DEMO)],
    "torchrun": ["bash", str(REPO / "examples" / "torchrun_replica.sh")],
}
KILLS = "kill:workerpool1-0@step40,kill:workerpool0-0@step100"


def run_arm(work: Path, name: str, cfg: argparse.Namespace) -> dict[str, Any]:
    """One job; its kills' rows (bench_soak.measure) and how it ended."""
    job_dir = work / "job"
    cmd = [sys.executable, "-m", "resilient_train.cli.main", "launch", "--workers", "2",
           "--job-dir", str(job_dir), "--quiet", "--timeout", f"{cfg.timeout:g}s",
           "--chaos", KILLS, "--", *ARMS[name], "--steps", str(cfg.steps), "--step-time",
           f"{cfg.step_time:g}", "--save-every", "10"]
    t0 = time.monotonic()
    done = subprocess.run(cmd, cwd=REPO, env=bench_soak.job_env(work), capture_output=True,
                          text=True, timeout=cfg.timeout + 120, check=False)
    wall = time.monotonic() - t0
    try:
        measured = bench_soak.measure(job_dir)
    except (FileNotFoundError, json.JSONDecodeError, KeyError) as exc:
        return {"error": f"no job record ({type(exc).__name__}: {exc})",
                "output_tail": (done.stdout + done.stderr)[-2000:], "rows": []}
    job = measured["job"]
    return {"state": job.get("state"), "exit_status": done.returncode,
            "wall_s": round(wall, 1), "rows": measured["kills"],
            "recoveries": [{"step": r.get("step"), "steps_lost": r.get("steps_lost"),
                            "sources": sorted({x["source"] for x in r.get("ranks") or []})}
                           for r in job.get("recoveries") or []]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=120.0,
                   help="each job's timeout (torchrun's first machine waits past it)")
    p.add_argument("--arms", default="spawn,torchrun")
    p.add_argument("--out", type=Path, default=HERE / "results" / "spawn.json")
    args = p.parse_args()
    load_before = os.getloadavg()
    arms: dict[str, Any] = {}
    for name in args.arms.split(","):
        with tempfile.TemporaryDirectory(prefix=f"bench-spawn-{name}-") as tmp:
            print(f"{name}: one job, {KILLS}", flush=True)
            arms[name] = run_arm(Path(tmp), name, args)
        for row in arms[name]["rows"]:
            said = (f"every machine trained again in {row['recovery_s']:.2f} s, "
                    f"{row['steps_lost']} steps lost" if row["recovered"] else row["why"])
            print(f"  {name}: kill of {row['replica']} at step {row['at_step']}: {said}",
                  flush=True)
        print(f"  {name}: {arms[name].get('state')} in {arms[name].get('wall_s')} s",
              flush=True)
    result = {"benchmark": "spawn", **stamp(load_before=load_before,
                                           load_after=os.getloadavg()),
              "config": {"steps": args.steps, "step_time_s": args.step_time,
                         "timeout_s": args.timeout, "kills": KILLS, "machines": 2,
                         "processes_per_machine": 2},
              "arms": arms}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
