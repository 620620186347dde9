"""Benchmark resilient_train.distributed: forming a group, and recovering when a peer dies.

    python benchmarks/bench_distributed.py [--repeats N] [--quick] [--out PATH]

1. Forming a 4-process gloo group on 127.0.0.1 (GLOO_SOCKET_IFNAME=lo, a free port), the
   four processes spawned at once, ``--form-repeats`` times (default 5), our
   ``rt.init_distributed()`` and plain ``init_process_group("gloo", init_method="env://")``
   alternating in the same run. Per repeat: the ``init`` call of each rank (call to return;
   a rank that arrives early waits for the slowest one's ``import torch``), the last rank
   into init -> all formed (the protocol's own cost), and spawn -> all formed (wall).
2. A peer's death -> every worker training again: 3 workers (``--workers``) run a small
   training loop (benchmarks/dist_worker.py: per step a forward/backward, one all-reduce of
   the gradients and a stop flag, a hand-written SGD update, then a timestamped line per
   rank; no torch.optim, whose first use imports torch._dynamo and sympy, 2.3 s here, a
   cost any restarted process pays whatever restarted it) under
   - our launcher, one job per repeat: ``resilient-train launch --workers 3 --chaos
     kill:workerpool1-0@Xs,kill:workerpool0-0@(X+GAP)s``, i.e. a non-primary dies, then
     the primary. The launcher restarts the killed worker in place; the survivors re-form
     in-process (``group.run``). Death = the launcher's ``chaos: kill on ...`` event in
     job.json (written just before its SIGKILL). A kill that lands before training
     started is retried with X + 6 s;
   - ``torchrun --standalone --nnodes 1 --nproc-per-node 3 --max-restarts 3`` on the same
     loop with plain ``init_process_group``, one job per repeat: the harness SIGKILLs rank
     1, and once every rank has trained again for a second, rank 2; torchrun restarts all
     workers each time. With torch's defaults, and with
     ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (docs/libraries.md, "torch.distributed":
     restarts fail with ``Gloo connectFullMesh failed`` without it). A death not recovered from within
     ``--recovery-limit`` (45 s) counts as a failure and ends that job.
   Recovered = the first step completed after the death by EVERY rank with a process or
   in-process recovery count different from before the death (so a step that finished in
   the instant between the kill being logged and the kill itself never counts). Also
   reported: the survivors' ``group.last_recovery_s`` and, for the restarted process,
   death -> its first line of Python, -> group formed, -> first step.

Prints a table and writes JSON to benchmarks/results/distributed.json. The machine has 2
cores: 3-4 processes importing torch at once (about 2.5 s each alone) dominate every
"process restarted" number; the load average at start and end is recorded because other
jobs on the machine swing these numbers.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meta import stamp  # benchmarks/, on the path as the script's folder

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "benchmarks" / "dist_worker.py"
RESULTS = REPO / "benchmarks" / "results" / "distributed.json"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stats(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    s = sorted(values)
    p90 = s[min(len(s) - 1, max(0, round(0.9 * len(s)) - 1))]
    return {"n": len(s), "median_s": round(statistics.median(s), 3), "p90_s": round(p90, 3),
            "min_s": round(s[0], 3), "max_s": round(s[-1], 3)}


def base_env(bench_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC_", "RESILIENT_TRAIN_", "MASTER_", "GROUP_RANK"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update({"GLOO_SOCKET_IFNAME": "lo", "BENCH_DIR": str(bench_dir),
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                            os.environ.get("PYTHONPATH")]))})
    env.update(extra)
    return env


def read_logs(bench_dir: Path, world: int) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for r in range(world):
        path = bench_dir / f"rank{r}.log"
        lines = []
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    lines.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a line being written
        out[r] = lines
    return out


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# --- 1. forming a group ------------------------------------------------------------------


def form_once(mode: str, world: int, tmp: Path) -> dict[str, Any]:
    bench_dir = Path(tempfile.mkdtemp(prefix=f"{mode}-", dir=tmp))
    port = free_port()
    procs = []
    t_spawn = time.time()
    for r in range(world):
        env = base_env(bench_dir, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world))
        procs.append(subprocess.Popen([sys.executable, str(WORKER), mode], env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        outputs.append((p.returncode, out))
    logs = read_logs(bench_dir, world)
    formed = [next((e for e in logs[r] if e["ev"] == "formed"), None) for r in range(world)]
    if any(f is None for f in formed) or any(rc != 0 for rc, _ in outputs):
        bad = [(r, rc, out[-2000:]) for r, (rc, out) in enumerate(outputs) if rc != 0]
        return {"ok": False, "errors": bad}
    fs = [f for f in formed if f is not None]
    return {
        "ok": True,
        "init_call_s": [round(f["t_formed"] - f["t_init"], 4) for f in fs],
        "last_into_init_to_all_formed_s": round(max(f["t_formed"] for f in fs)
                                                - max(f["t_init"] for f in fs), 4),
        "spawn_to_all_formed_s": round(max(f["t_formed"] for f in fs) - t_spawn, 4),
        "spawn_to_first_line_s": round(max(f["t_first"] for f in fs) - t_spawn, 4),
    }


def bench_form(repeats: int, world: int, tmp: Path) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"rt.init_distributed": [], "init_process_group": []}
    modes = {"rt.init_distributed": "form-rt", "init_process_group": "form-plain"}
    for i in range(repeats):
        order = list(modes) if i % 2 == 0 else list(reversed(modes))
        for name in order:
            res = form_once(modes[name], world, tmp)
            runs[name].append(res)
            print(f"  form {name:20} #{i + 1}: " + (
                f"slowest init {max(res['init_call_s']):.3f} s, last-in -> formed "
                f"{res['last_into_init_to_all_formed_s']:.3f} s, spawn -> formed "
                f"{res['spawn_to_all_formed_s']:.3f} s" if res["ok"] else f"FAILED {res}"),
                flush=True)
    summary = {}
    for name, rs in runs.items():
        ok = [r for r in rs if r["ok"]]
        summary[name] = {
            "runs": len(rs), "ok": len(ok),
            "init_call_slowest_rank": stats([max(r["init_call_s"]) for r in ok]),
            "init_call_all_ranks": stats([x for r in ok for x in r["init_call_s"]]),
            "last_into_init_to_all_formed": stats([r["last_into_init_to_all_formed_s"]
                                                   for r in ok]),
            "spawn_to_all_formed": stats([r["spawn_to_all_formed_s"] for r in ok]),
            "spawn_to_last_first_line": stats([r["spawn_to_first_line_s"] for r in ok]),
            "raw": rs,
        }
    return {"world_size": world, "repeats": repeats, "results": summary}


# --- 2. recovery -------------------------------------------------------------------------


def recovery_from_logs(logs: dict[int, list[dict[str, Any]]], death: float,
                       victim: int) -> dict[str, Any]:
    """Death -> first step of every rank after it, from a new process or a new recovery."""
    out: dict[str, Any] = {"ranks": {}}
    firsts = []
    for r, lines in logs.items():
        steps = [e for e in lines if e["ev"] == "step"]
        before = [e for e in steps if e["t"] <= death]
        if not before:
            return {"ok": False, "why": f"rank {r} had not trained before the death "
                                        f"(choose a later kill time)"}
        state = (before[-1]["pid"], before[-1].get("rec"))
        after = [e for e in steps if e["t"] > death and (e["pid"], e.get("rec")) != state]
        if not after:
            return {"ok": False, "why": f"rank {r} never trained again after the death"}
        first = after[0]
        firsts.append(first["t"])
        row: dict[str, Any] = {"first_step_s": round(first["t"] - death, 3),
                               "restarted": first["pid"] != state[0]}
        if row["restarted"]:
            new = [e for e in lines if e["pid"] == first["pid"]]
            t_first = next((e["t_first"] for e in new if e["ev"] == "start"), None)
            t_formed = next((e["t"] for e in new if e["ev"] == "formed"), None)
            if t_first is not None:
                row["first_line_s"] = round(t_first - death, 3)
            if t_formed is not None:
                row["formed_s"] = round(t_formed - death, 3)
        else:
            rec = [e.get("last_recovery_s") for e in lines
                   if e["ev"] == "train-start" and e["pid"] == first["pid"]
                   and e.get("rec") == first.get("rec")]
            if rec and rec[-1] is not None:
                row["last_recovery_s"] = round(rec[-1], 3)
        out["ranks"][r] = row
    out["ok"] = True
    out["all_training_again_s"] = round(max(firsts) - death, 3)
    out["victim"] = victim
    return out


def _spawn(args: list[str], env: dict[str, str], out_path: Path) -> subprocess.Popen[bytes]:
    with out_path.open("wb") as out:
        return subprocess.Popen(args, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _stop(bench_dir: Path, proc: subprocess.Popen[bytes], out_path: Path,
          grace: float = 45.0) -> tuple[int, str]:
    """Ask rank 0 to finish (the stop file), then SIGTERM, then SIGKILL the session."""
    (bench_dir / "stop").touch()
    try:
        rc = proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the launcher and torchrun stop their workers on SIGTERM
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        rc = -9
    return rc, out_path.read_text(errors="replace")


def _await_recovery(bench_dir: Path, world: int, proc: subprocess.Popen[bytes],
                    death_of: Callable[[], float | None], victim: int,
                    deadline: float) -> dict[str, Any]:
    """Poll until every rank trained again after the death, or give up at ``deadline``."""
    while time.monotonic() < deadline and proc.poll() is None:
        death = death_of()
        if death is not None:
            res = recovery_from_logs(read_logs(bench_dir, world), death, victim)
            if res["ok"] or "had not trained" in res.get("why", ""):
                return res
        time.sleep(0.2)
    why = "no recovery within the time limit" if proc.poll() is None else (
        f"the launcher/torchrun exited ({proc.returncode}) before every rank trained again")
    return {"ok": False, "why": why, "victim": victim}


FAILURES = Path(tempfile.gettempdir()) / "bench-distributed-failures"


def _diagnose(bench_dir: Path, world: int) -> dict[str, Any]:
    """For a death nobody recovered from: every rank's Python stacks (py-spy, if installed)
    and a copy of the run's logs that outlives the benchmark's temporary directory."""
    out: dict[str, Any] = {}
    spy = shutil.which("py-spy")
    for r, lines in read_logs(bench_dir, world).items():
        if not lines:
            continue
        pid = lines[-1]["pid"]
        if spy is None:
            continue
        try:
            dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True,
                                  text=True, timeout=30, check=False)
            out[f"rank{r}_pid{pid}_stacks"] = (dump.stdout + dump.stderr)[-6000:]
        except (OSError, subprocess.TimeoutExpired) as exc:
            out[f"rank{r}_pid{pid}_stacks"] = f"py-spy failed: {exc}"
    keep = FAILURES / bench_dir.name
    shutil.copytree(bench_dir, keep, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("quota"))
    out["kept_logs"] = str(keep)
    return out


def launcher_run(kills: list[tuple[str, float]], workers: int, tmp: Path,
                 recovery_limit: float) -> list[dict[str, Any]]:
    """One job under our launcher with the given chaos kills (replica, seconds after
    RUNNING); one result per kill."""
    bench_dir = Path(tempfile.mkdtemp(prefix="rt-", dir=tmp))
    job_dir = bench_dir / "job"
    out_path = bench_dir / "launcher.out"
    last_kill = max(at for _, at in kills)
    limit = last_kill + recovery_limit + 30
    spec = ",".join(f"kill:{replica}@{at:g}s" for replica, at in kills)
    args = [sys.executable, "-m", "resilient_train.cli.main", "launch", "--workers", str(workers),
            "--job-dir", str(job_dir), "--timeout", f"{int(limit + 60)}s", "--chaos", spec,
            "--", sys.executable, str(WORKER), "train-rt"]
    env = base_env(bench_dir, RESILIENT_TRAIN_QUOTA_DIR=str(bench_dir / "quota"),
                   RESILIENT_TRAIN_GPUS="none", BENCH_END_AT=str(time.time() + limit))
    proc = _spawn(args, env, out_path)
    t0 = time.monotonic()

    def death_of(k: int) -> float | None:
        marker = f"chaos: kill on {kills[k][0]}"
        try:
            events = json.loads((job_dir / "job.json").read_text())["events"]
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            return None
        times = [dt.datetime.fromisoformat(e["time"].replace("Z", "+00:00")).timestamp()
                 for e in events if e["message"] == marker]
        n = sum(1 for replica, _ in kills[:k] if replica == kills[k][0])
        return times[n] if len(times) > n else None

    results: list[dict[str, Any]] = []
    for k, (replica, at) in enumerate(kills):
        victim = 0 if replica == "workerpool0-0" else 1 + int(replica.split("-")[1])
        res = _await_recovery(bench_dir, workers, proc, lambda k=k: death_of(k), victim,
                              t0 + at + recovery_limit + 15)
        res["case"] = "kill primary" if victim == 0 else "kill non-primary"
        res["chaos"] = f"kill:{replica}@{at:g}s"
        results.append(res)
        if not res["ok"]:
            if "had not trained" not in res.get("why", ""):
                res["diagnosis"] = _diagnose(bench_dir, workers)
            break
    rc, out = _stop(bench_dir, proc, out_path)
    deaths = [death_of(k) for k in range(len(kills))]
    job: dict[str, Any] = {}
    try:
        job = json.loads((job_dir / "job.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        pass
    for k, res in enumerate(results):
        nxt = deaths[k + 1] if k + 1 < len(deaths) else None
        this = deaths[k]
        if res["ok"] and nxt is not None and this is not None and \
                this + res["all_training_again_s"] > nxt:
            res.update(ok=False, why="the next kill landed before every rank trained again "
                                     "(raise --kill-gap)")
        res["launcher_exit"] = rc
        res["job_state"] = job.get("state")
        res["events"] = [e["message"] for e in job.get("events", [])
                         if e.get("kind") in ("fault", "exited", "restarting")]
        if not res["ok"] or rc != 0:
            res["output_tail"] = out[-3000:]
    return results


def torchrun_run(workers: int, kills: int, tmp: Path, recovery_limit: float,
                 disable_share: bool) -> list[dict[str, Any]]:
    """One torchrun job; SIGKILL rank 1, 2, ... (never rank 0) one after the other, each
    once every rank has trained for a second; one result per kill."""
    bench_dir = Path(tempfile.mkdtemp(prefix="torchrun-", dir=tmp))
    out_path = bench_dir / "torchrun.out"
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(workers), "--max-restarts", "3",
            str(WORKER), "train-plain"]
    extra = {"BENCH_END_AT": str(time.time() + 60 + kills * (recovery_limit + 20))}
    if disable_share:
        extra["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    proc = _spawn(args, base_env(bench_dir, **extra), out_path)
    results: list[dict[str, Any]] = []
    since = 0.0
    for k in range(kills):
        victim = 1 + k % (workers - 1)
        deadline = time.monotonic() + 60
        death: float | None = None
        while time.monotonic() < deadline and proc.poll() is None:
            logs = read_logs(bench_dir, workers)
            steps = [[e for e in ls if e["ev"] == "step" and e["t"] > since]
                     for ls in logs.values()]
            if all(s and s[-1]["t"] - s[0]["t"] >= 1.0 for s in steps):
                death = time.time()
                os.kill(steps[victim][-1]["pid"], signal.SIGKILL)
                break
            time.sleep(0.1)
        if death is None:
            results.append({"ok": False, "why": "training never started", "victim": victim})
            break
        res = _await_recovery(bench_dir, workers, proc, lambda d=death: d, victim,
                              time.monotonic() + recovery_limit)
        res["case"] = f"SIGKILL rank {victim}"
        results.append(res)
        if not res["ok"]:
            res["diagnosis"] = _diagnose(bench_dir, workers)
            break
        since = death + res["all_training_again_s"]
    rc, out = _stop(bench_dir, proc, out_path)
    for res in results:
        res["torchrun_exit"] = rc
        res["connectFullMesh_in_output"] = "connectFullMesh" in out
        if not res["ok"] or rc != 0:
            res["output_tail"] = out[-3000:]
    return results


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if r.get("ok")]
    out: dict[str, Any] = {"kills": len(runs), "recovered": len(ok),
                           "all_training_again": stats([r["all_training_again_s"] for r in ok])}
    restarted = [row for r in ok for row in r["ranks"].values() if row.get("restarted")]
    survivors = [row for r in ok for row in r["ranks"].values() if not row.get("restarted")]
    for key in ("first_line_s", "formed_s", "first_step_s"):
        vals = [row[key] for row in restarted if key in row]
        if vals:
            out[f"restarted_{key.removesuffix('_s')}"] = stats(vals)
    if survivors:
        out["survivor_first_step"] = stats([row["first_step_s"] for row in survivors])
        rec = [row["last_recovery_s"] for row in survivors if "last_recovery_s" in row]
        if rec:
            out["survivor_last_recovery_s"] = stats(rec)
    out["raw"] = runs
    return out


def bench_recovery(repeats: int, workers: int, kill_at: float, kill_gap: float, tmp: Path,
                   recovery_limit: float, torchrun_variants: list[bool]) -> dict[str, Any]:
    cases: dict[str, list[dict[str, Any]]] = {}
    rt_names = {"kill non-primary": "rt launcher: kill:workerpool1-0 (non-primary)",
                "kill primary": "rt launcher: kill:workerpool0-0 (primary)"}
    for i in range(repeats):
        # One job per repeat: the non-primary dies at kill_at, the primary kill_gap later.
        for attempt in range(2):
            kills = [("workerpool1-0", kill_at), ("workerpool0-0", kill_at + kill_gap)]
            results = launcher_run(kills, workers, tmp, recovery_limit)
            if attempt == 0 and not results[0]["ok"] and \
                    "had not trained" in results[0].get("why", ""):
                kill_at += 6
                print(f"  rt launcher #{i + 1}: {results[0]['why']}; kill time now "
                      f"{kill_at:g} s, running again", flush=True)
                continue
            break
        for res in results:
            name = rt_names[res["case"]]
            cases.setdefault(name, []).append(res)
            _print_run(name, i, res)
        for disable in torchrun_variants:
            name = "torchrun --standalone --max-restarts 3" + (
                " +TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" if disable else "")
            results = torchrun_run(workers, 2, tmp, recovery_limit, disable)
            for res in results:
                cases.setdefault(name, []).append(res)
                _print_run(name + f" ({res['case']})", i, res)
    return {"workers": workers, "repeats": repeats, "chaos_kill_at_s": kill_at,
            "chaos_kill_gap_s": kill_gap, "recovery_limit_s": recovery_limit,
            "results": {name: summarize(runs) for name, runs in cases.items()}}


def _print_run(name: str, i: int, res: dict[str, Any]) -> None:
    if res.get("ok"):
        ranks = ", ".join(f"r{r} {row['first_step_s']:.2f}" + ("*" if row["restarted"] else "")
                          for r, row in res["ranks"].items())
        print(f"  {name} #{i + 1}: all training again {res['all_training_again_s']:.2f} s "
              f"({ranks}; *restarted)", flush=True)
    else:
        print(f"  {name} #{i + 1}: FAILED: {res.get('why')}", flush=True)


# --- the table ---------------------------------------------------------------------------


def _cell(st: dict[str, Any] | None) -> str:
    if not st or not st.get("n"):
        return "-"
    return f"{st['median_s']:.3f} / {st['p90_s']:.3f}"


def print_table(form: dict[str, Any], rec: dict[str, Any]) -> None:
    print()
    print(f"forming a {form['world_size']}-process gloo group, {form['repeats']} repeats "
          f"(s, median / p90)")
    print(f"{'':22} {'ok':>5} {'init, slowest rank':>20} {'last in -> formed':>20} "
          f"{'spawn -> all formed':>20}")
    for name, r in form["results"].items():
        print(f"{name:22} {r['ok']:>2}/{r['runs']:<2} {_cell(r['init_call_slowest_rank']):>20} "
              f"{_cell(r['last_into_init_to_all_formed']):>20} "
              f"{_cell(r['spawn_to_all_formed']):>20}")
    print()
    print(f"a peer's death -> every one of {rec['workers']} workers training again "
          f"(s, median / p90)")
    print(f"{'':78} {'ok':>5} {'all training':>15} {'restarted: 1st line':>20} "
          f"{'survivors':>15} {'last_recovery_s':>16}")
    for name, r in rec["results"].items():
        print(f"{name:78} {r['recovered']:>2}/{r['kills']:<2} {_cell(r['all_training_again']):>15} "
              f"{_cell(r.get('restarted_first_line')):>20} "
              f"{_cell(r.get('survivor_first_step')):>15} "
              f"{_cell(r.get('survivor_last_recovery_s')):>16}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=None,
                        help="recovery repeats per case (default 3; --quick 1)")
    parser.add_argument("--form-repeats", type=int, default=None,
                        help="group-forming repeats (default 5; --quick 2)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer repeats, torchrun with default settings only")
    parser.add_argument("--workers", type=int, default=3, help="recovery: workers (3 or 4)")
    parser.add_argument("--form-world", type=int, default=4)
    parser.add_argument("--kill-at", type=float, default=12.0,
                        help="chaos kill time, seconds after the job is RUNNING (must be "
                             "after training started; raised by 6 s if not)")
    parser.add_argument("--kill-gap", type=float, default=15.0,
                        help="seconds between the non-primary's and the primary's kill")
    parser.add_argument("--recovery-limit", type=float, default=45.0,
                        help="a death not recovered from in this many seconds is a failure")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    form_repeats = args.form_repeats if args.form_repeats is not None else (
        2 if args.quick else 5)
    torchrun_variants = [False] if args.quick else [False, True]

    t0 = time.monotonic()
    load_start = load()
    with tempfile.TemporaryDirectory(prefix="bench-distributed-") as tmp_name:
        tmp = Path(tmp_name)
        print(f"forming ({form_repeats} repeats)", flush=True)
        form = bench_form(form_repeats, args.form_world, tmp)
        print(f"recovery ({repeats} repeats)", flush=True)
        rec = bench_recovery(repeats, args.workers, args.kill_at, args.kill_gap, tmp,
                             args.recovery_limit, torchrun_variants)
    elapsed = time.monotonic() - t0
    print_table(form, rec)
    print(f"\ntotal {elapsed:.0f} s; load average at start {load_start}, at end {load()}")


    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "distributed",
        **stamp(load_average_start=load_start, load_average_end=load()),
        "elapsed_s": round(elapsed, 1),
        "form": form,
        "recovery": rec,
    }, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
