"""Benchmark the launcher: restart latency and its own CPU use while a job idles.

    python benchmarks/bench_launcher.py [--restarts 10] [--idle-seconds 20] [--out PATH]

1. Restart latency, over N restarts of one replica, in two modes:
   - ``self-kill``: the worker writes a timestamp and SIGKILLs itself (a policy file makes
     exit 137 restartable, as the default table would fail the job);
   - ``chaos-kill``: ``--chaos kill:0@...`` (the launcher's own SIGKILL; death = its
     ``chaos: kill`` event).
   For each restart: death -> the launcher noticed (``exited`` event), death -> the
   replacement process is being started (``started`` event: the launcher's own reaction
   time), death -> the replacement's first line of user code (a ``python -c`` worker).
2. The launcher's CPU use while the job idles (a worker sleeping ``--idle-seconds``):
   CPU seconds of the launcher process itself (not its workers) / wall seconds, via psutil,
   with and without ``--memory-limit`` (which polls the workers' memory every 0.1 s).

Prints a small table and writes JSON to benchmarks/results/launcher.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from meta import stamp  # benchmarks/, on the path as the script's folder

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "launcher.json"

# The first line of user code records the time; then the worker dies (self-kill mode),
# waits to be killed (chaos mode), or exits 0 once the wanted number of restarts is done.
WORKER = """\
import time; t = time.time()
import os, signal, sys
d = os.environ["BENCH_DIR"]; r = int(os.environ["RESILIENT_TRAIN_RESTART_COUNT"])
open(f"{d}/start-{r}", "w").write(repr(t))
if r >= int(os.environ["BENCH_RESTARTS"]):
    sys.exit(0)
if os.environ["BENCH_MODE"] == "self-kill":
    open(f"{d}/death-{r}", "w").write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(3600)
"""

POLICY = {
    "budgets": {"worker_restarts": {"limit": 1000, "scope": "worker"}},
    "rules": [
        {"name": "primary-done", "match": {"causes": ["exit"], "exit_codes": [0],
                                           "primary": True}, "actions": ["succeed_job"]},
        {"name": "killed", "match": {"causes": ["exit", "node_loss"], "exit_codes": [137]},
         "actions": ["restart_worker:worker_restarts"]},
        {"name": "other", "match": {}, "actions": ["fail_job"]},
    ],
}


def _event_time(event: dict[str, Any]) -> float:
    return dt.datetime.fromisoformat(event["time"].replace("Z", "+00:00")).timestamp()


def _stats(values: list[float]) -> dict[str, float]:
    ms = sorted(v * 1000 for v in values)
    p90 = ms[min(len(ms) - 1, max(0, round(0.9 * len(ms)) - 1))]
    return {"n": len(ms), "median_ms": round(statistics.median(ms), 1),
            "p90_ms": round(p90, 1), "min_ms": round(ms[0], 1), "max_ms": round(ms[-1], 1)}


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"RESILIENT_TRAIN_QUOTA_DIR": str(tmp / "quota"), "RESILIENT_TRAIN_GPUS": "none",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))})
    env.update(extra)
    return env


def restart_latency(mode: str, restarts: int, tmp: Path) -> dict[str, Any]:
    work = tmp / mode
    marks = work / "marks"
    marks.mkdir(parents=True)
    policy = work / "policy.json"
    policy.write_text(json.dumps(POLICY))
    job_dir = work / "job"
    args = [sys.executable, "-m", "resilient_train.cli.main", "launch", "--quiet",
            "--job-dir", str(job_dir), "--policy", str(policy), "--timeout", "120s"]
    if mode == "chaos-kill":
        kills = ",".join(f"kill:0@{0.5 * (i + 1):g}s" for i in range(restarts))
        args += ["--chaos", kills]
    args += ["--", sys.executable, "-c", WORKER]
    env = _env(work, BENCH_DIR=str(marks), BENCH_RESTARTS=str(restarts), BENCH_MODE=mode)
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, cwd=REPO,
                          check=False)
    if done.returncode != 0:
        raise SystemExit(f"{mode}: the launcher exited {done.returncode}:\n{done.stdout}\n"
                         f"{done.stderr}")
    job = json.loads((job_dir / "job.json").read_text())
    events = job["events"]
    started = [_event_time(e) for e in events if e["message"] == "workerpool0-0: started"]
    exited = [_event_time(e) for e in events
              if e["message"].startswith("workerpool0-0: exited with status 137")]
    if mode == "chaos-kill":
        deaths = [_event_time(e) for e in events
                  if e["message"] == "chaos: kill on workerpool0-0"]
    else:
        deaths = [float((marks / f"death-{r}").read_text()) for r in range(restarts)]
    first_line = [float((marks / f"start-{r}").read_text()) for r in range(1, restarts + 1)]
    assert len(deaths) == len(exited) == restarts and len(started) == restarts + 1, (
        len(deaths), len(exited), len(started))
    return {
        "mode": mode,
        "restarts": restarts,
        "death_to_noticed": _stats([x - d for d, x in zip(deaths, exited)]),
        "death_to_replacement_started": _stats([s - d for d, s in zip(deaths, started[1:])]),
        "death_to_user_code": _stats([f - d for d, f in zip(deaths, first_line)]),
    }


def python_startup(samples: int) -> dict[str, float]:
    """The floor under death -> user code: a bare subprocess start to the same first line."""
    times = []
    for _ in range(samples):
        t0 = time.time()
        out = subprocess.run([sys.executable, "-c", "import time; print(repr(time.time()))"],
                             capture_output=True, text=True, check=True)
        times.append(float(out.stdout) - t0)
    return _stats(times)


def idle_cpu(idle_seconds: float, tmp: Path) -> list[dict[str, Any]]:
    """Two launchers at once (their workers sleep): default options, and --memory-limit."""
    configs = {"default": [], "memory-limit 1GiB": ["--memory-limit", "1GiB"]}
    runs = []
    for i, (name, extra) in enumerate(configs.items()):
        work = tmp / f"idle-{i}"
        work.mkdir()
        job_dir = work / "job"
        args = [sys.executable, "-m", "resilient_train.cli.main", "launch", "--quiet",
                "--job-dir", str(job_dir), *extra, "--", sys.executable, "-c",
                f"import time; time.sleep({idle_seconds})"]
        proc = subprocess.Popen(args, env=_env(work), stdout=subprocess.DEVNULL, cwd=REPO)
        runs.append((name, proc, job_dir))
    results = []
    try:
        deadline = time.monotonic() + 30
        for name, proc, job_dir in runs:
            while True:
                try:
                    if json.loads((job_dir / "job.json").read_text())["state"] == \
                            "JOB_STATE_RUNNING":
                        break
                except (FileNotFoundError, json.JSONDecodeError):
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit(f"{name}: the job never reached RUNNING")
                time.sleep(0.05)
        # Measure while every worker still sleeps: leave a margin at both ends.
        window = max(1.0, idle_seconds - 4.0)
        handles = [(name, psutil.Process(proc.pid)) for name, proc, _ in runs]
        before = {name: p.cpu_times() for name, p in handles}
        t0 = time.monotonic()
        time.sleep(window)
        wall = time.monotonic() - t0
        for name, p in handles:
            after = p.cpu_times()
            cpu = (after.user - before[name].user) + (after.system - before[name].system)
            results.append({"config": name, "wall_s": round(wall, 2), "cpu_s": round(cpu, 4),
                            "cpu_fraction": round(cpu / wall, 5)})
        for _, proc, _ in runs:
            proc.wait(timeout=idle_seconds + 30)
    finally:
        for _, proc, _ in runs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", type=int, default=10)
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-launcher-") as tmp_name:
        tmp = Path(tmp_name)
        latency = [restart_latency(mode, args.restarts, tmp) for mode in ("self-kill",
                                                                           "chaos-kill")]
        cpu = idle_cpu(args.idle_seconds, tmp)
        startup = python_startup(args.restarts)

    print(f"restart latency over {args.restarts} restarts (ms, median / p90)")
    print(f"{'mode':12} {'death->noticed':>16} {'death->respawn':>16} {'death->user code':>18}")
    for row in latency:
        cells = [f"{row[k]['median_ms']:7.1f} / {row[k]['p90_ms']:6.1f}" for k in (
            "death_to_noticed", "death_to_replacement_started", "death_to_user_code")]
        print(f"{row['mode']:12} {cells[0]:>16} {cells[1]:>16} {cells[2]:>18}")
    print(f"(for scale: a bare subprocess.run of the same python -c to its first line: "
          f"{startup['median_ms']:.1f} / {startup['p90_ms']:.1f} ms; event times have 1 ms "
          f"resolution)")
    print()
    print("launcher CPU while the job idles")
    print(f"{'config':20} {'wall s':>8} {'cpu s':>8} {'cpu/wall':>10}")
    for row in cpu:
        print(f"{row['config']:20} {row['wall_s']:8.2f} {row['cpu_s']:8.3f} "
              f"{row['cpu_fraction'] * 100:9.3f}%")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "launcher",
        **stamp(),
        "restart_latency": latency,
        "python_startup_to_first_line": startup,
        "idle_cpu": cpu,
    }, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
