"""Recovery after a worker's death, 0.5 GiB of state per rank: from live peers, from
storage, and under torchrun, side by side in one run.

    python benchmarks/bench_recovery.py [--quick] [--params-m 45] [--steps 65]
        [--save-every 15] [--kill-steps 29,59]
        [--arms peer,node-local,persistent,torchrun,torchrun-own]
        [--skip-read-once] [--skip-sigterm] [--out PATH]

The job: benchmarks/recovery_worker.py, 3 workers, DDP over gloo under ``rt.main``, a
synthetic model of ``--params-m`` million float32 parameters (45: 180 MB, plus AdamW's
moments: 0.5 GiB of state per rank), a save every ``--save-every`` steps. Each arm is ONE
job with two SIGKILLs: a non-primary (rank 1, ``kill:workerpool1-0@stepN``) at the first
``--kill-steps`` step, then the primary (rank 0, ``kill:workerpool0-0@stepN``) at the
second. The kills come 14 steps after a save: an upload of 0.5 GiB to the emulator takes
20-30 s on 2 busy cores, and a kill 9 steps after a save found it uncommitted (the
persistent arm then restarted from step 0, measuring no read at all). The arms:

- **(a) peer**: ``resilient-train launch``, default options (peer recovery on),
  checkpoints on local disk (the job directory's ``AIP_CHECKPOINT_DIR``);
- **(b) node-local**: the same with ``--no-peer --node-local 2`` (every save to each
  machine's disk, every 2nd to the emulator, ``gs://bench-recovery/run``): the killed
  worker's machine is new (its disk empty), so it gets its state from a neighbour's disk;
- **(c) persistent**: the same with ``--no-peer`` (``CheckpointOptions(peer_recovery=
  False)``) and the checkpoints on the GCS emulator (fake-gcs-server, ``gs://bench-
  recovery/run`` through ``STORAGE_EMULATOR_HOST``, tests/gcs.py starts it), keep_last=1;
- **(d) torchrun**: ``torchrun --standalone --max-restarts 2`` (one round per kill, its
  other settings at their defaults) on the same worker, unchanged, checkpoints on local
  disk; ``torchrun-own`` the same with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (the
  fair arm: each round's workers get a store of their own).

Measured as benchmarks/bench_soak.py does (its functions, imported: the launcher job, the
torchrun job and its SIGKILLs, the per-kill rows): **recovery** = the kill -> every rank
has finished a training step again (the workers' telemetry); **steps lost** = the
primary's last step before the kill - the step restored. Added here, from each rank's
``restore`` telemetry event of its recovery: the source (peer / persistent / none), the
bytes read per tier summed over the ranks, who sent the state, the reason a faster tier
was not used, and the timeline: the last rank to begin its restore (a restarted
process's start, ``import torch``, building the model, the group's formation), the
restore done, the first step done; and, from a line the worker prints per life, the
critical rank's start-up: spawned, torch imported, rt.main's group formed (the training
function called), the model and optimizer built. Under torchrun the recovery of kill k is
the restart round k (every process restarts), and the kill time is recovered from
bench_soak's row.

**Baseline**: what a restarted process cannot avoid: a cold ``python`` that imports torch
and joins a 3-rank gloo group whose other 2 ranks already wait (rank 1 restarted, the
store on rank 0), timed from its spawn to a barrier done (``--baseline-repeats``, the
median), plus **one training step** (the mean step of arm (a)'s primary, from its
telemetry). Target: (a)'s recovery <= 1.2 x (start-up + one step) ("x base"), <= 1 step
lost, 0 bytes read from storage. "x build" divides by that plus the time the critical rank
spent in that recovery building the worker's model and AdamW (the worker's code, not the
restore's: 45M parameters initialised, and the first AdamW imports torch._dynamo). The
baseline's process also times ``import torch`` alone and that build (information).

**Read once vs every rank reads** (``--skip-read-once`` skips it): 3 processes (gloo)
save one checkpoint of the same state to a fresh emulator, then restore it, interleaved,
after a warm-up round of every mode that is dropped (so every mode is measured warm):
``restore_latest`` with peer recovery off (read once: the primary reads the shared file
and streams each 64 MiB chunk to the others as it lands, each rank reads its own small
file), every rank calling ``loader.load_verified`` on the shared file itself (the old
path), and rank 0 alone (the others wait): through ``restore_latest`` in a world of one
(the same listing, manifest and size checks as read once: the target's denominator) and
through ``load_verified`` alone. Each includes loading the state into the model and
optimizer. Seconds (the slowest rank), bytes read from storage (all ranks). Target: read
once <= 1.2 x one rank alone. What bounds it, measured in the same
processes: rank 0's broadcast of the state's tensors as raw buffers to the other two,
into memory touched for the first time (as a restore's receivers must allocate it) and
into the same memory again.

**SIGTERM -> emergency checkpoint committed** (``--skip-sigterm`` skips it): a job of the
same worker, checkpoints on the emulator, the primary preempted at step 12 under
``--grace 30`` (a Spot VM's): the seconds from the SIGTERM to the worker's exit 134 with
its emergency checkpoint committed (the run's first save, so its host buffers are
allocated then too), against the 30 s.

``--quick`` (run_all.py's size): 12M parameters (0.13 GiB of state per rank) and the
read-once measurement once, the same steps and kills: about 7 min on 2 busy cores (load
5-9). The full size takes about 18 min there. Memory: about 5 GiB for the jobs, and the
emulator's heap held to about 3 GiB (GOMEMLIMIT).

Prints a table and writes JSON (with the load average at start and end, and the least
memory available seen) to benchmarks/results/recovery.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))
import bench_soak  # noqa: E402 - the job runners and the per-kill measurement
from meta import stamp  # noqa: E402 - benchmarks/, on the path as the script's folder

# Before anything imports gcsfs (docs/libraries.md, "gcsfs against a local GCS emulator").
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

WORKER = HERE / "recovery_worker.py"
RESULTS = HERE / "results" / "recovery.json"
WORKERS = 3
BUCKET = "bench-recovery"
ARGS_ENV = "BENCH_RECOVERY_ARGS"   # recovery_worker.py reads more arguments from it
MARK = "BENCH_RECOVERY_LIFE"       # ... and prints its start-up times after it
TIERS = ("peer", "node-local", "persistent")
ARMS = {   # name -> (label, runner, options)
    "peer": ("(a) peer recovery, local disk", "launch", []),
    "node-local": ("(b) node-local tier, --no-peer", "launch",
                   ["--no-peer", "--node-local", "2", "--checkpoint-dir", f"gs://{BUCKET}/run"]),
    "persistent": ("(c) --no-peer, gs:// emulator", "launch",
                   ["--no-peer", "--checkpoint-dir", f"gs://{BUCKET}/run"]),
    "torchrun": ("(d) torchrun, shared store", "torchrun", []),
    "torchrun-own": ("(d) torchrun, own store", "torchrun", []),
}
TARGET_RATIO = 1.2
EMULATOR_MEMLIMIT = "3GiB"


# --- helpers ------------------------------------------------------------------------------

@contextlib.contextmanager
def patched(obj: Any, **attrs: Any) -> Iterator[None]:
    """Set attributes for the duration: bench_soak's runners name their worker script in a
    module constant (DEMO, TORCHRUN_WORKER), which this benchmark points at its own."""
    old = {k: getattr(obj, k) for k in attrs}
    for k, v in attrs.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(obj, k, v)


@contextlib.contextmanager
def environ(**values: str | None) -> Iterator[None]:
    """os.environ changed for the duration (bench_soak.job_env copies it into the job's)."""
    old = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def git_commit() -> str | None:
    """The checkout measured (``--dirty``: tracked files changed)."""
    try:
        out = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


class MemoryWatch:
    """The least memory available seen (every 0.5 s), and the emulator's largest RSS."""

    def __init__(self) -> None:
        self.least = mem_available()
        self.emulator_rss = 0
        self.emulator_pid: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(0.5):
            self.least = min(self.least, mem_available())
            pid = self.emulator_pid
            if pid is not None:
                try:
                    self.emulator_rss = max(self.emulator_rss,
                                            psutil.Process(pid).memory_info().rss)
                except psutil.Error:
                    pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def gcs_emulator(log_dir: Path, watch: MemoryWatch) -> Iterator[str]:
    """A fresh fake-gcs-server (tests/gcs.py) with the bucket; yields its endpoint."""
    sys.path.insert(0, str(REPO / "tests"))
    try:
        import gcs as gcs_helpers  # tests/gcs.py
    finally:
        sys.path.pop(0)
    binary, why = gcs_helpers.emulator_binary()
    if binary is None:
        raise RuntimeError(f"no GCS emulator: {why}")
    # A soft memory limit for the Go runtime: without it the server's heap grows to about
    # 10x what it stores (5.6 GiB for 0.5 GiB checkpoints, keep_last=1) before it collects.
    with environ(GOMEMLIMIT=EMULATOR_MEMLIMIT):
        emu = gcs_helpers.start_emulator(binary, log_dir / "fake-gcs-server.log")
    watch.emulator_pid = emu.process.pid
    try:
        emu.create_bucket(BUCKET)
        yield emu.endpoint
    finally:
        watch.emulator_pid = None
        emu.stop()   # its memory (every object it holds) goes back now


def _read_events(prefix: Path, kind: str) -> list[dict[str, Any]]:
    try:
        lines = Path(f"{prefix}.jsonl").read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue   # a line cut by a SIGKILL
        if rec.get("kind") == kind:
            out.append(rec)
    return out


def _lives(job_dir: Path, replica: str) -> list[tuple[int, int, Path]]:
    """(attempt, restart, telemetry prefix) of ``replica``'s lives, in order."""
    out = []
    for prefix in bench_soak.telemetry_prefixes(job_dir, replica):
        out.append((int(prefix.parent.name.split("-")[1]),
                    int(prefix.name.rsplit(".restart-", 1)[1]), prefix))
    return sorted(out)


def step_time(job_dir: Path, replica: str) -> float | None:
    """The mean training step of ``replica``'s longest stretch of training (telemetry):
    the steps after its first, so neither a restore nor a first step's warm-up counts."""
    best = None
    for _, _, prefix in _lives(job_dir, replica):
        for seg in bench_soak.read_life(prefix).segments:
            n = seg.last_step - seg.first_step - 1
            if seg.t_first is not None and seg.t_last is not None and n >= 3 and (
                    best is None or n > best[0]):
                best = (n, (seg.t_last - seg.t_first) / n)
    return None if best is None else best[1]


def add_restores(row: dict[str, Any], restores: dict[str, dict[str, Any]], t_kill: float,
                 victim: str) -> None:
    """Per kill: each rank's restore (its recovery's ``restore`` event), summed bytes per
    tier, and the timeline from the kill."""
    row["t_kill"] = round(t_kill, 3)
    row["restores"] = {
        r: {"source": e.get("source"), "step": e.get("step"), "from_rank": e.get("from_rank"),
            "seconds": round(float(e.get("seconds") or 0), 3), "reason": e.get("reason", ""),
            "bytes_read": e.get("bytes_read") or {}, "generation": e.get("generation")}
        for r, e in restores.items()}
    row["bytes_read"] = {t: sum(int((e.get("bytes_read") or {}).get(t, 0))
                                for e in restores.values()) for t in TIERS}
    row["sources"] = sorted({str(e.get("source")) for e in restores.values()})
    row["reasons"] = sorted({e["reason"] for e in restores.values() if e.get("reason")})
    if restores:
        begins = {r: float(e["t"]) - float(e.get("seconds") or 0) - t_kill
                  for r, e in restores.items()}
        row["restore_begin_s"] = round(max(begins.values()), 3)   # the last rank ready
        row["restore_begin_last"] = max(begins, key=lambda r: begins[r])
        row["restored_s"] = round(max(float(e["t"]) for e in restores.values()) - t_kill, 3)
        v = restores.get(victim)
        row["victim_restore_s"] = None if v is None else round(float(v.get("seconds") or 0), 3)
    if row.get("recovered") and row.get("restored_s") is not None:
        row["first_step_after_restore_s"] = round(row["recovery_s"] - row["restored_s"], 3)


def life_lines(paths: list[Path]) -> list[dict[str, Any]]:
    """The per-life start-up lines recovery_worker.py printed (its MARK), from its logs."""
    out = []
    for path in paths:
        try:
            text = path.read_text(errors="replace")
        except FileNotFoundError:
            continue
        for line in text.splitlines():
            at = line.find(MARK)
            if at >= 0:
                try:
                    out.append(json.loads(line[at + len(MARK):].strip()))
                except ValueError:
                    continue   # cut by a SIGKILL
    return out


def add_startups(row: dict[str, Any], lines: list[dict[str, Any]],
                 rank_of: dict[str, int]) -> None:
    """Each new process's start-up after the kill (the victim's; under torchrun every
    rank's), as seconds after the kill: spawned, torch and resilient_train imported,
    rt.main's group formed (the training function called), the model built."""
    t_kill = row.get("t_kill")
    if t_kill is None:
        return
    startups = {}
    for replica, rank in rank_of.items():
        # The new process's first life: the earliest training function call (a process
        # prints one line per life, its t_spawn the same to a few ms).
        mine = [ln for ln in lines if ln.get("rank") == rank
                and (ln.get("t_spawn") or 0) > t_kill and ln.get("t_train") is not None]
        if mine:
            ln = min(mine, key=lambda ln: ln["t_train"])
            startups[replica] = {k[2:] + "_s": round(ln[k] - t_kill, 3)
                                 for k in ("t_spawn", "t_imported", "t_train", "t_built")
                                 if ln.get(k) is not None}
    row["startups"] = startups


def restores_after(job_dir: Path, replicas: list[str], t_kill: float,
                   t_next: float) -> dict[str, dict[str, Any]]:
    """Each replica's first restore event after ``t_kill`` (and before the next kill)."""
    out = {}
    for r in replicas:
        for _, _, prefix in _lives(job_dir, r):
            hit = next((e for e in _read_events(prefix, "restore")
                        if t_kill < float(e["t"]) < t_next), None)
            if hit is not None:
                out[r] = hit
                break
    return out


# --- the arms -----------------------------------------------------------------------------

def worker_args(cfg: argparse.Namespace, extra: list[str]) -> str:
    return shlex.join(["--params-m", f"{cfg.params_m:g}", "--keep-last", "1", *extra])


def run_launch_arm(work: Path, name: str, cfg: argparse.Namespace,
                   watch: MemoryWatch) -> dict[str, Any]:
    """One ``resilient-train launch`` job with both kills (bench_soak.run_job + measure)."""
    _, _, extra = ARMS[name]
    spec = ",".join(f"kill:{replica_of(rank)}@step{step}" for rank, step in cfg.plan)
    env: dict[str, str | None] = {ARGS_ENV: worker_args(cfg, extra)}
    with contextlib.ExitStack() as stack:
        if any(a.startswith("gs://") for a in extra):
            env["STORAGE_EMULATOR_HOST"] = stack.enter_context(gcs_emulator(work, watch))
        stack.enter_context(environ(**env))
        stack.enter_context(patched(bench_soak, DEMO=WORKER))
        rc, tail, wall = bench_soak.run_job(work, spec, cfg.steps, WORKERS, cfg.step_time,
                                            cfg.save_every, None, cfg.job_timeout)
    job_dir = work / "job"
    try:
        measured = bench_soak.measure(job_dir)
    except (FileNotFoundError, json.JSONDecodeError, KeyError) as exc:
        return {"error": f"no job record ({type(exc).__name__}: {exc})", "output_tail": tail,
                "rows": [], "summary": {"failures": [f"no job record: {exc}"]}}
    rows, job = measured["kills"], measured["job"]
    summary = bench_soak.summarize(rows, len(cfg.plan), job, rc, cfg.steps)
    kills = [e for e in job.get("events", []) if e.get("kind") == "fault"
             and bench_soak._KILL_RE.match(e.get("message", ""))]
    replicas: list[str] = job["replicas"]
    for i, (row, ev) in enumerate(zip(rows, kills)):
        t_kill = bench_soak._epoch(ev["time"])
        t_next = (bench_soak._epoch(kills[i + 1]["time"]) if i + 1 < len(kills)
                  else float("inf"))
        add_restores(row, restores_after(job_dir, replicas, t_kill, t_next), t_kill,
                     row["replica"])
        started = [bench_soak._epoch(e["time"]) for e in job.get("events", [])
                   if e.get("kind") == "started" and e.get("replica") == row["replica"]
                   and bench_soak._epoch(e["time"]) > t_kill]
        # The launcher's part: the kill -> the new process started.
        row["victim_started_s"] = round(min(started) - t_kill, 3) if started else None
        add_startups(row, life_lines(sorted(job_dir.glob("logs/attempt-*/*.log"))),
                     {r: i for i, r in enumerate(replicas)})
    out = {"rows": rows, "summary": summary, "job_wall_s": round(wall, 1),
           "step_s": step_time(job_dir, replicas[0]), "job_state": job.get("state")}
    if summary["failures"]:
        out["output_tail"] = tail
    return out


def sigterm_save(work: Path, cfg: argparse.Namespace, watch: MemoryWatch) -> dict[str, Any]:
    """A preemption of the primary (SIGTERM, then SIGKILL after a Spot VM's 30 s): the
    seconds from the SIGTERM to the worker's exit 134 with its emergency checkpoint
    committed to the emulator (every rank's 1/3 of the state, the first save of the run:
    its host buffers are allocated then too), against the 30 s."""
    grace, at = 30.0, 12
    with contextlib.ExitStack() as stack:
        endpoint = stack.enter_context(gcs_emulator(work, watch))
        env = bench_soak.job_env(work) | {
            "STORAGE_EMULATOR_HOST": endpoint,
            ARGS_ENV: worker_args(cfg, ["--checkpoint-dir", f"gs://{BUCKET}/run"])}
        job_dir = work / "job"
        cmd = [sys.executable, "-m", "resilient_train.cli.main", "launch", "--workers",
               str(WORKERS), "--job-dir", str(job_dir), "--quiet", "--grace", f"{grace:g}",
               "--timeout", f"{int(cfg.job_timeout)}s",
               "--chaos", f"preempt:{replica_of(0)}@step{at}", "--",
               # Steps after the preemption: the ranks agree on a SIGTERM at a step
               # boundary about once a second (sync_interval_s), so a run that ended
               # first would save nothing.
               sys.executable, str(WORKER), "--steps", str(at + 40), "--save-every",
               "100000", "--step-time", "0.05"]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=cfg.job_timeout + 60, check=False)
        wall = time.monotonic() - t0
    out = {"grace_s": grace, "preempted_at_step": at, "job_wall_s": round(wall, 1),
           "rc": proc.returncode}
    try:
        job = json.loads((job_dir / "job.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return out | {"error": f"no job record: {exc}", "output_tail": proc.stdout[-2000:]}
    events = job.get("events", [])
    sigterm = next((e for e in events if e.get("kind") == "fault"
                    and e.get("cause") == "preemption"), None)
    exited = next((e for e in events if sigterm and e.get("kind") == "exited"
                   and e.get("replica") == sigterm.get("replica")
                   and bench_soak._epoch(e["time"]) >= bench_soak._epoch(sigterm["time"])),
                  None)
    logs = "".join(p.read_text(errors="replace")
                   for p in sorted(job_dir.glob("logs/attempt-*/*.log")))
    line = next((x for x in logs.splitlines() if "SIGTERM: " in x and "exit 134" in x), "")
    if sigterm is None or exited is None:
        return out | {"error": "no preemption or no exit in the job record",
                      "output_tail": proc.stdout[-2000:]}
    took = bench_soak._epoch(exited["time"]) - bench_soak._epoch(sigterm["time"])
    committed = "committed" in line and "abandoned" not in line
    return out | {"sigterm_to_exit_s": round(took, 3), "exit_code": exited.get("exit_code"),
                  "line": line.strip(), "committed": committed,
                  "pass": bool(committed and exited.get("exit_code") == 134 and took < grace)}


def run_torchrun_arm(work: Path, name: str, cfg: argparse.Namespace) -> dict[str, Any]:
    """torchrun on the same worker and plan (bench_soak.run_torchrun)."""
    restarts = len(cfg.plan)
    store = {ARGS_ENV: worker_args(cfg, []),
             "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1" if name == "torchrun-own" else None}
    with environ(**store), patched(bench_soak, TORCHRUN_WORKER=WORKER):
        tr = bench_soak.run_torchrun(work, cfg.plan, cfg.steps, WORKERS, cfg.step_time,
                                     cfg.save_every, restarts, cfg.recovery_limit,
                                     name == "torchrun", cfg.job_timeout)
    summary = bench_soak.summarize_torchrun(tr, len(cfg.plan), cfg.recovery_limit, restarts)
    bench = work / "torchrun"
    replicas = [f"rank{r}" for r in range(WORKERS)]
    for k, row in enumerate(tr["rows"], start=1):
        # Every kill is one restart round: kill k's recovery is each rank's life k.
        restores: dict[str, dict[str, Any]] = {}
        for r in replicas:
            life = next((p for _, n, p in _lives(bench, r) if n == k), None)
            ev = _read_events(life, "restore") if life is not None else []
            if ev:
                restores[r] = ev[0]
        # The kill's time: bench_soak's row holds each rank's first step relative to it.
        t_kill = None
        for r, rel in (row.get("first_step_s") or {}).items():
            life = next((p for _, n, p in _lives(bench, r) if n == k), None)
            segs = bench_soak.read_life(life).segments if life is not None else ()
            if segs and segs[0].t_first is not None:
                t_kill = segs[0].t_first - rel
                break
        if t_kill is not None:
            add_restores(row, restores, t_kill, row["replica"])
            add_startups(row, life_lines([work / "torchrun.out"]),
                         {r: i for i, r in enumerate(replicas)})
    out = {"rows": tr["rows"], "summary": summary, "job_wall_s": round(tr["wall"], 1),
           "step_s": step_time(bench, "rank0"), "restarts_used": tr["restarts_used"]}
    if summary["failures"]:
        out["output_tail"] = tr["tail"]
    return out


def replica_of(rank: int) -> str:
    return "workerpool0-0" if rank == 0 else f"workerpool1-{rank - 1}"


# --- the baseline -------------------------------------------------------------------------

_SURVIVOR = """
import os, sys, time
import torch, torch.distributed as dist
open(sys.argv[1], "w").close()   # imported: ready
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""

_JOINER = """
import os, sys, time
t0 = float(sys.argv[2])
import torch, torch.distributed as dist
t_import = time.time()
dist.init_process_group("gloo")
dist.barrier()
t_join = time.time()
sys.path.insert(0, sys.argv[3])
import recovery_worker
t = time.perf_counter()
import torch._dynamo   # what torch.optim imports on an optimizer's first construction
lazy = time.perf_counter() - t
t = time.perf_counter()
torch.manual_seed(0)
model = recovery_worker.model_for(float(sys.argv[4]))
torch.optim.AdamW(model.parameters(), foreach=False)
build = time.perf_counter() - t + lazy
with open(sys.argv[1], "w") as f:
    f.write(f"{t_import - t0} {t_join - t0} {build} {lazy}")
dist.destroy_process_group()
"""


def startup_baseline(work: Path, params_m: float, repeats: int) -> dict[str, Any]:
    """A restarted rank 1's unavoidable start: spawn -> import torch -> joined a gloo
    group whose other ranks (0, holding the store, and 2) already wait."""
    env = bench_soak.job_env(work)
    samples = []
    for i in range(repeats):
        port = str(bench_soak_free_port())
        base = env | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                      "WORLD_SIZE": str(WORKERS)}
        ready = [work / f"ready-{i}-{r}" for r in (0, 2)]
        survivors = [subprocess.Popen([sys.executable, "-c", _SURVIVOR, str(f)],
                                      env=base | {"RANK": str(r)})
                     for r, f in zip((0, 2), ready)]
        deadline = time.monotonic() + 120
        while not all(f.exists() for f in ready) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)   # inside init_process_group by now: waiting for rank 1
        out = work / f"joined-{i}"
        t0 = time.time()
        joiner = subprocess.Popen([sys.executable, "-c", _JOINER, str(out), repr(t0),
                                   str(HERE), f"{params_m:g}"], env=base | {"RANK": "1"})
        codes = [p.wait(timeout=300) for p in (joiner, *survivors)]
        if any(codes):
            raise RuntimeError(f"baseline processes exited {codes}")
        imp, join, build, lazy = (float(x) for x in out.read_text().split())
        samples.append({"import_s": round(imp, 3), "join_s": round(join, 3),
                        "worker_build_s": round(build, 3),
                        "torch_lazy_import_s": round(lazy, 3)})
    med = {k: round(statistics.median(s[k] for s in samples), 3) for k in samples[0]}
    return {"samples": samples, **med}


def bench_soak_free_port() -> int:
    from resilient_train.launcher.ports import free_port

    return free_port()


# --- read once vs every rank reads ----------------------------------------------------------

def read_once_worker() -> None:
    """One of the 3 processes of ``read_once`` (this file, ``--read-once-worker``)."""
    import recovery_worker
    import torch
    import torch.distributed as dist

    from resilient_train.checkpoint.commit.directory import (
        SHARED_FILE,
        find_committed,
        rank_file,
        read_manifest,
    )
    from resilient_train.checkpoint.commit.loader import load_verified
    from resilient_train.checkpoint.commit.retention import RetentionPolicy
    from resilient_train.checkpoint.manager import CheckpointManager, CheckpointOptions
    from resilient_train.checkpoint.schedule.coordination import SingleProcess, TorchDistributed
    from resilient_train.checkpoint.state.capture import restore, restore_rng
    from resilient_train.checkpoint.storage.base import Storage

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    url, repeats = os.environ["BENCH_URL"], int(os.environ["BENCH_REPEATS"])
    torch.manual_seed(0)
    model = recovery_worker.model_for(float(os.environ["BENCH_PARAMS_M"]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    for p in model.parameters():   # one step: AdamW's moments exist, as in training
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    tracked = {"model": model, "optimizer": opt}
    coord = TorchDistributed()
    options = CheckpointOptions(peer_recovery=False, async_save=False,
                                retention=RetentionPolicy(keep_last=1))
    mgr = CheckpointManager(url, coordinator=coord, options=options)
    mgr.track(**tracked)
    mgr.values["data_position"] = 1
    mgr.save(1, blocking=True)
    mgr.close()
    storage = Storage(url)
    name = coord.broadcast(find_committed(storage, 1) if rank == 0 else None)

    def own_read() -> int:
        """The old path: this rank reads the step's manifest, the shared file itself and
        its own file, and loads them (no collective: rank 0 also runs it alone)."""
        manifest = read_manifest(storage, name, 1)
        restore(tracked, load_verified(storage, name, SHARED_FILE, manifest))
        mine = load_verified(storage, name, rank_file(rank), manifest)
        if "rng" in mine:
            restore_rng(mine["rng"])
        return manifest.files[SHARED_FILE].size + manifest.files[rank_file(rank)].size

    times: dict[str, list[float]] = {"read_once": [], "every_rank": [], "one_rank": [],
                                     "one_rank_restore": []}
    # CPU-seconds of each mode, the 3 ranks' (every thread) and the emulator's: what two
    # cores must find room for, whatever the order the work runs in.
    cpu: dict[str, list[float]] = {mode: [] for mode in times}
    emulator = None
    if rank == 0 and os.environ.get("BENCH_EMULATOR_PID"):
        import psutil

        emulator = psutil.Process(int(os.environ["BENCH_EMULATOR_PID"]))

    def emulator_cpu() -> float:
        if emulator is None:
            return 0.0
        t = emulator.cpu_times()
        return float(t.user + t.system)
    nbytes: dict[str, int] = {}
    order = list(times)
    # A warm-up round of every mode first, dropped: the emulator's first read of a freshly
    # written object costs twice a later one, and a process's first large broadcast and
    # first large buffers cost more than later ones (measured: 2.24 s, then 0.98 s); they
    # would always fall on the first mode of the first round.
    for rep in range(-1, repeats):
        for mode in (order if rep % 2 == 0 else order[::-1]):
            fresh = None
            if mode == "read_once":   # built outside the timing: its start probes storage
                fresh = CheckpointManager(url, coordinator=coord, options=options)
                fresh.track(**tracked)
            elif mode == "one_rank_restore" and rank == 0:   # the same path, world 1
                fresh = CheckpointManager(url, coordinator=SingleProcess(), options=options)
                fresh.track(**tracked)
            dist.barrier()
            t0, c0, e0 = time.perf_counter(), time.process_time(), emulator_cpu()
            if fresh is not None:
                fresh.restore_latest()
                rec = fresh.last_restore
                n = int(rec.bytes_read["persistent"]) if rec is not None else 0
            elif mode == "every_rank" or (rank == 0 and mode == "one_rank"):
                n = own_read()
            else:   # one rank alone: the others wait for rank 0
                n = 0
            took, used = time.perf_counter() - t0, time.process_time() - c0
            emulator_used = emulator_cpu() - e0
            all_took: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(all_took, (took, n, used))
            if rep >= 0:
                times[mode].append(max(float(t) for t, _, _ in all_took))
                nbytes[mode] = sum(int(b) for _, b, _ in all_took)
                cpu[mode].append(sum(float(c) for _, _, c in all_took) + emulator_used)
            if fresh is not None:
                fresh.close()
    bounds = raw_broadcasts(tracked, repeats, rank)
    if rank == 0:
        Path(os.environ["BENCH_OUT"]).write_text(json.dumps(
            {"times": times, "bytes": nbytes, "bounds": bounds, "cpu": cpu}))
    coord.close()
    dist.destroy_process_group()


def raw_broadcasts(tracked: dict[str, Any], repeats: int, rank: int) -> dict[str, float]:
    """What bounds a read once here: rank 0's broadcast of the state's bytes as raw buffers,
    one per tensor (about the read once's 64 MiB chunks), into memory the receivers touch
    for the first time (as a restore's must be: AdamW's moments do not exist before the
    first step) and into the same buffers again. Medians of ``repeats``, the slowest rank."""
    import torch
    import torch.distributed as dist

    from resilient_train.checkpoint.state.capture import collect, tree_map_tensors

    sizes: list[int] = []
    tree_map_tensors(lambda t: sizes.append(t.numel() * t.element_size()) or t,
                     collect(tracked))
    sizes = [n for n in sizes if n]
    out: dict[str, list[float]] = {"fresh_s": [], "warm_s": []}
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        bufs = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        for b in bufs:
            dist.broadcast(b, 0)
        fresh = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        for b in bufs:
            dist.broadcast(b, 0)
        warm = time.perf_counter() - t0
        del bufs
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, (fresh, warm))
        out["fresh_s"].append(max(f for f, _ in every))
        out["warm_s"].append(max(w for _, w in every))
    res = {k: round(statistics.median(v), 3) for k, v in out.items()}
    return res | {"mib": round(sum(sizes) / 2**20)} if rank == 0 else res


def read_once(work: Path, params_m: float, repeats: int, watch: MemoryWatch
              ) -> dict[str, Any]:
    """3 ranks restore one checkpoint from the emulator: read once vs every rank reads."""
    with gcs_emulator(work, watch) as endpoint:
        out = work / "read-once.json"
        env = bench_soak.job_env(work) | {
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(bench_soak_free_port()),
            "WORLD_SIZE": str(WORKERS), "STORAGE_EMULATOR_HOST": endpoint,
            "BENCH_URL": f"gs://{BUCKET}/read-once", "BENCH_REPEATS": str(repeats),
            "BENCH_PARAMS_M": f"{params_m:g}", "BENCH_OUT": str(out),
            "BENCH_EMULATOR_PID": str(watch.emulator_pid or "")}
        procs = [subprocess.Popen([sys.executable, __file__, "--read-once-worker"],
                                  env=env | {"RANK": str(r)}) for r in range(WORKERS)]
        try:
            codes = [p.wait(timeout=1800) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(codes) and not out.exists():
            raise RuntimeError(f"read-once workers exited {codes}")
        data = json.loads(out.read_text())
    res: dict[str, Any] = {"repeats": repeats, "exit_codes": codes}
    if any(codes):
        # Rank 0 wrote the results after the last measurement: a process that fails later,
        # in its teardown, does not void them, but it is a failure to report.
        res["note"] = (f"the measurement finished, then a worker exited {codes} (-6: SIGABRT, "
                       f"'terminate called without an active exception' at interpreter exit)")
        print(f"  WARNING: {res['note']}", flush=True)
    cores = os.cpu_count() or 1
    for mode, ts in data["times"].items():
        res[mode] = {"seconds_median": round(statistics.median(ts), 3),
                     "samples": [round(t, 3) for t in ts], "bytes": data["bytes"][mode]}
        used = (data.get("cpu") or {}).get(mode)
        if used:   # no schedule on this machine's cores can take less wall time than this
            res[mode]["cpu_s_median"] = round(statistics.median(used), 3)
            res[mode]["cpu_bound_s"] = round(statistics.median(used) / cores, 3)
    # The target's ratio is against one rank alone through the same restore_latest (world
    # 1): both then pay the same listing, manifest and size checks; the bare read is shown.
    alone = res.get("one_rank_restore") or res["one_rank"]
    res["ratio_read_once_to_one_rank"] = round(
        res["read_once"]["seconds_median"] / alone["seconds_median"], 3)
    res["ratio_read_once_to_bare_read"] = round(
        res["read_once"]["seconds_median"] / res["one_rank"]["seconds_median"], 3)
    res["ratio_every_rank_to_one_rank"] = round(
        res["every_rank"]["seconds_median"] / res["one_rank"]["seconds_median"], 3)
    res["raw_broadcast"] = data.get("bounds")
    res["target"] = f"read_once <= {TARGET_RATIO} x one_rank"
    res["pass"] = res["ratio_read_once_to_one_rank"] <= TARGET_RATIO
    return res


# --- the report ---------------------------------------------------------------------------

def _num(v: Any, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def _mb(n: Any) -> str:
    return "-" if n is None else f"{n / 2**20:.0f}"


def print_table(arms: dict[str, Any], baseline: dict[str, Any] | None) -> None:
    head = (f"{'arm':<31} {'kill':<10} {'landed':>6} {'resumed':>7} {'lost':>4} "
            f"{'recovery s':>10} {'x base':>6} {'x build':>7} {'ready s':>7} "
            f"{'restored s':>10} {'MiB peer/local/pers':>19}  source / note")
    print("\n" + head)
    for name, arm in arms.items():
        for row in arm.get("rows") or []:
            b = row.get("bytes_read") or {}
            kill = f"rank {row['rank']}@{row['at_step']}"
            note = ",".join(row.get("sources") or []) if row.get("recovered") else \
                f"FAILED: {row.get('why')}"
            if row.get("reasons") and "peer" not in (row.get("sources") or []):
                note += f" ({row['reasons'][0][:70]})"
            elif row.get("sources") == ["none"]:
                note += " (no committed checkpoint: a fresh start)"
            mib = "/".join(_mb(b.get(t)) for t in TIERS)
            print(f"{ARMS[name][0]:<31} {kill:<10} "
                  f"{_num(row.get('steps_done_at_kill'), 'd'):>6} "
                  f"{_num(row.get('resumed_from'), 'd'):>7} {_num(row.get('steps_lost'), 'd'):>4} "
                  f"{_num(row.get('recovery_s')):>10} {_num(row.get('x_base')):>6} "
                  f"{_num(row.get('x_build')):>7} {_num(row.get('restore_begin_s')):>7} "
                  f"{_num(row.get('restored_s')):>10} {mib:>19}  {note}")
        for f in (arm.get("summary") or {}).get("failures") or []:
            print(f"  FAILURE ({name}): {f}")
    if baseline:
        print(f"\nbaseline: import torch {baseline['import_s']:.2f} s, + joining the group "
              f"{baseline['join_s']:.2f} s (spawn -> barrier, median of "
              f"{len(baseline['samples'])}); one step {_num(baseline.get('step_s'))} s "
              f"-> start-up + one step {_num(baseline.get('startup_plus_step_s'))} s "
              f"('x base'). 'x build': over that + the worker's own model and AdamW "
              f"build in that recovery (its first AdamW imports torch._dynamo; "
              f"{baseline['worker_build_s']:.2f} s in the baseline's process, of which "
              f"{baseline['torch_lazy_import_s']:.2f} s is that import).")
    print("ready s: the kill -> the last rank began its restore; restored s: -> the last "
          "rank's restore done; recovery s: -> every rank finished a step.")
    print(f"\nThe critical path (the last rank to begin its restore), s after the kill:\n"
          f"{'arm':<31} {'kill':<10} {'rank':<14} {'spawned':>7} {'imported':>8} "
          f"{'formed':>6} {'built':>6} {'restore':>7} {'restored':>8} {'stepped':>7}")
    for name, arm in arms.items():
        for row in arm.get("rows") or []:
            who = row.get("restore_begin_last")
            st = (row.get("startups") or {}).get(who or "", {})
            kill = f"rank {row['rank']}@{row['at_step']}"
            print(f"{ARMS[name][0]:<31} {kill:<10} "
                  f"{who or '-':<14} {_num(st.get('spawn_s')):>7} {_num(st.get('imported_s')):>8} "
                  f"{_num(st.get('train_s')):>6} {_num(st.get('built_s')):>6} "
                  f"{_num(row.get('restore_begin_s')):>7} {_num(row.get('restored_s')):>8} "
                  f"{_num(row.get('recovery_s')):>7}")
    print("spawned: the new process exists; imported: torch and resilient_train imported; "
          "formed: rt.main formed the group (the training function runs); built: the "
          "worker's model and AdamW built; restore / restored: its restore began / the "
          "last rank's ended; stepped: every rank finished a step (the recovery).")


def markdown_section(d: dict[str, Any], md_table: Any, fnum: Any) -> tuple[str, dict[str, str]]:
    """run_all.py's README section from recovery.json: markdown, and the SVG plot."""
    import plots

    cfg = d.get("config") or {}
    base = d.get("baseline") or {}
    arms = d.get("arms") or {}
    md = [(f"{cfg.get('workers', '?')} workers, `benchmarks/recovery_worker.py` (DDP, gloo, "
           f"{fnum(cfg.get('params_m'), 0)}M float32 parameters + AdamW: "
           f"{fnum((cfg.get('state_bytes_per_rank') or 0) / 2**30, 2)} GiB of state per rank), "
           f"{cfg.get('steps', '?')} steps, a save every {cfg.get('save_every', '?')}; one job "
           f"per arm, killed twice: "
           + ", ".join(f"`kill:{k['replica']}@step{k['step']}`" for k in cfg.get("kills") or [])
           + ". Recovery = the kill -> every rank finished a step again (telemetry); "
           "bytes read summed over the ranks' restore events."
           + (" Quick size." if cfg.get("quick") else "")), ""]
    rows = []
    cats, values = [], {}
    series = [ARMS[a][0] for a in arms if a in ARMS]
    for name, arm in arms.items():
        label = ARMS.get(name, (name,))[0]
        if arm.get("error"):
            rows.append([label, "-", "-", f"FAILED: {arm['error']}"] + ["-"] * 6)
        for row in arm.get("rows") or []:
            b = row.get("bytes_read") or {}
            kill = f"rank {row.get('rank')} @ step {row.get('at_step')}"
            if kill not in cats:
                cats.append(kill)
            values[(kill, label)] = row.get("recovery_s") if row.get("recovered") else None
            rows.append([label, kill, str(row.get("steps_lost", "-")),
                         fnum(row.get("recovery_s"), 2) if row.get("recovered")
                         else f"FAILED: {row.get('why', '?')}",
                         fnum(row.get("x_base"), 2), fnum(row.get("x_build"), 2),
                         fnum(row.get("restored_s"), 2),
                         " / ".join(f"{(b.get(t) or 0) / 2**20:.0f}" for t in TIERS),
                         ", ".join(row.get("sources") or []),
                         "; ".join(r[:90] for r in row.get("reasons") or [])])
    md.append(md_table(["arm", "kill", "steps lost", "recovery s", "x (start-up + step)",
                        "x (+ worker build)", "restored s",
                        "MiB read peer / node-local / persistent", "source", "reason"], rows))
    if base:
        md += ["", (f"Start-up baseline: a cold `python` importing torch and joining a 3-rank "
                    f"gloo group whose other ranks wait: {fnum(base.get('join_s'), 2)} s "
                    f"(import alone {fnum(base.get('import_s'), 2)} s), + one step of arm (a) "
                    f"{fnum(base.get('step_s'), 2)} s = {fnum(base.get('startup_plus_step_s'), 2)}"
                    f" s. The worker's own model + AdamW (whose first construction imports "
                    f"torch._dynamo) add {fnum(base.get('worker_build_s'), 2)} s, of which "
                    f"{fnum(base.get('torch_lazy_import_s'), 2)} s is that import.")]
    ro = d.get("read_once") or {}
    if ro.get("error"):
        md += ["", f"**Read once vs every rank reads failed**: {ro['error']}"]
    elif ro:
        md += ["", (f"Restore of one checkpoint by 3 ranks from the emulator (median of "
                    f"{ro.get('repeats')}):"), "",
               md_table(["path", "seconds", "MiB read"],
                        [[label, fnum(ro[m]["seconds_median"], 2),
                          f"{ro[m]['bytes'] / 2**20:.0f}"]
                         for m, label in (("read_once", "read once (`restore_latest`)"),
                                          ("every_rank", "every rank reads (`load_verified`)"),
                                          ("one_rank_restore",
                                           "one rank alone (`restore_latest`, world 1)"),
                                          ("one_rank", "one rank alone (`load_verified`)"))
                         if m in ro]),
               *(["", f"**Note**: {ro['note']}."] if ro.get("note") else []),
               "", (f"Read once / one rank alone: "
                    f"{fnum(ro.get('ratio_read_once_to_one_rank'), 2)}x (target <= "
                    f"{TARGET_RATIO}).")]
        bound = ro.get("read_once", {}).get("cpu_bound_s")
        if bound is not None:
            md += ["", (f"CPU time (the 3 ranks' threads and the emulator's): read once "
                        f"{fnum(ro['read_once'].get('cpu_s_median'), 2)} CPU-s, one rank "
                        f"alone {fnum((ro.get('one_rank_restore') or {}).get('cpu_s_median'), 2)}"
                        f" CPU-s; on this machine's {(d.get('machine') or {}).get('cpus')} "
                        f"cores no schedule of the read once takes less than "
                        f"{fnum(bound, 2)} s.")]
        raw = ro.get("raw_broadcast") or {}
        if raw:
            md += ["", (f"What bounds it: a raw gloo broadcast of the state's "
                        f"{raw.get('mib')} MiB from rank 0 to the other two takes "
                        f"{fnum(raw.get('fresh_s'), 2)} s into memory touched for the first "
                        f"time (as a restore's is) and {fnum(raw.get('warm_s'), 2)} s into "
                        f"the same memory again.")]
    em = d.get("sigterm") or {}
    if em.get("error"):
        md += ["", f"**SIGTERM -> emergency checkpoint failed**: {em['error']}"]
    elif em:
        md += ["", (f"SIGTERM (a preemption of the primary at step {em.get('preempted_at_step')},"
                    f" `--grace {fnum(em.get('grace_s'), 0)}`) -> exit 134 with the emergency "
                    f"checkpoint committed to the emulator: "
                    f"{fnum(em.get('sigterm_to_exit_s'), 1)} s of the "
                    f"{fnum(em.get('grace_s'), 0)} s grace (`{em.get('line', '')}`).")]
    for k, v in (d.get("targets") or {}).items():
        md += ["", f"Target, {k}: " + ("met" if v.get("pass") else "**not met**") + f" ({v})"]
    m = d.get("machine") or {}
    md += ["", (f"Load average at start {m.get('load_average_start')}, at end "
                f"{m.get('load_average_end')}; least memory available "
                f"{fnum((m.get('mem_available_least_bytes') or 0) / 2**30, 1)} GiB.")]
    svgs = {}
    if cats:
        svgs["recovery.svg"] = plots.grouped_bars(
            f"Recovery after a kill, {(cfg.get('state_bytes_per_rank') or 0) / 2**30:.2f} "
            "GiB/rank: kill -> every rank training again (s, lower is better)",
            cats, series, values, unit="seconds", missing_label="not recovered")
    return "\n".join(md), svgs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="run_all.py's size: 12M parameters, read-once once")
    ap.add_argument("--params-m", type=float, default=None,
                    help="million parameters (default 45: 0.5 GiB of state per rank)")
    ap.add_argument("--steps", type=int, default=None, help="the job's steps (default 65)")
    ap.add_argument("--save-every", type=int, default=None, help="default 15")
    ap.add_argument("--kill-steps", default=None,
                    help="N1,N2: rank 1 killed at step N1, rank 0 at N2 (default 29,59: 14 steps "
                         "after a save, time for its upload to the emulator to commit)")
    ap.add_argument("--step-time", type=float, default=0.0,
                    help="recovery_worker.py --step-time: extra sleep per step (s)")
    ap.add_argument("--arms", default=",".join(ARMS),
                    help="comma-separated subset of: " + ", ".join(ARMS))
    ap.add_argument("--baseline-repeats", type=int, default=3)
    ap.add_argument("--read-once-repeats", type=int, default=None, help="default 2 (quick 1)")
    ap.add_argument("--skip-read-once", action="store_true")
    ap.add_argument("--skip-sigterm", action="store_true",
                    help="skip SIGTERM -> emergency checkpoint committed")
    ap.add_argument("--recovery-limit", type=float, default=120.0,
                    help="a torchrun kill not recovered from within this many s fails")
    ap.add_argument("--job-timeout", type=float, default=900.0,
                    help="each job's limit (s): the launcher's --timeout, torchrun's wait")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the jobs' directories")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--read-once-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.read_once_worker:
        read_once_worker()
        return 0
    q = args.quick
    args.params_m = args.params_m or (12.0 if q else 45.0)
    args.steps = args.steps or 65
    args.save_every = args.save_every or 15
    kill_steps = [int(s) for s in (args.kill_steps or "29,59").split(",")]
    if len(kill_steps) != 2 or not 0 < kill_steps[0] < kill_steps[1] < args.steps:
        ap.error(f"--kill-steps needs N1,N2 with 0 < N1 < N2 < --steps ({args.steps})")
    args.plan = [(1, kill_steps[0]), (0, kill_steps[1])]
    repeats = args.read_once_repeats or (1 if q else 2)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        ap.error(f"unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")

    load_start = [round(x, 2) for x in os.getloadavg()]
    avail_start = mem_available()
    watch = MemoryWatch()
    t0 = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="bench-recovery-", dir=args.workdir))
    results: dict[str, Any] = {}
    baseline = None
    ro = None
    emergency: dict[str, Any] | None = None
    failed = False
    print(f"{WORKERS} workers, {args.params_m:g}M parameters, {args.steps} steps, a save "
          f"every {args.save_every}, kills: rank 1 at step {kill_steps[0]}, rank 0 at "
          f"{kill_steps[1]}; load {load_start}", flush=True)
    try:
        (root / "baseline").mkdir()
        baseline = startup_baseline(root / "baseline", args.params_m, args.baseline_repeats)
        print(f"baseline: {baseline}", flush=True)
        for name in arms:
            work = root / name
            work.mkdir()
            print(f"arm {name}: {ARMS[name][0]}", flush=True)
            t = time.monotonic()
            try:
                if ARMS[name][1] == "launch":
                    results[name] = run_launch_arm(work, name, args, watch)
                else:
                    results[name] = run_torchrun_arm(work, name, args)
            except Exception as exc:  # noqa: BLE001 - one arm's failure must not sink the rest
                results[name] = {"error": f"{type(exc).__name__}: {exc}", "rows": [],
                                 "summary": {"failures": [f"{type(exc).__name__}: {exc}"]}}
            results[name]["arm_s"] = round(time.monotonic() - t, 1)
            if (results[name].get("summary") or {}).get("failures"):
                failed = True
            print(f"  done in {results[name]['arm_s']} s; failures: "
                  f"{(results[name].get('summary') or {}).get('failures')}", flush=True)
        if not args.skip_sigterm:
            (root / "sigterm").mkdir()
            print("SIGTERM -> emergency checkpoint committed", flush=True)
            try:
                emergency = sigterm_save(root / "sigterm", args, watch)
            except Exception as exc:  # noqa: BLE001
                emergency = {"error": f"{type(exc).__name__}: {exc}"}
            if emergency.get("error") or not emergency.get("pass"):
                failed = True
        if not args.skip_read_once:
            (root / "read-once").mkdir()
            print("read once vs every rank reads", flush=True)
            try:
                ro = read_once(root / "read-once", args.params_m, repeats, watch)
            except Exception as exc:  # noqa: BLE001
                ro = {"error": f"{type(exc).__name__}: {exc}"}
                failed = True
    finally:
        watch.stop()
        if args.keep or failed:
            print(f"work directory kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)

    step = (results.get("peer") or {}).get("step_s")
    if baseline is not None and step:
        baseline["step_s"] = round(step, 3)
        baseline["startup_plus_step_s"] = round(baseline["join_s"] + step, 3)
    for arm in results.values():
        for row in arm.get("rows") or []:
            den = (baseline or {}).get("startup_plus_step_s")
            ok = bool(den and row.get("recovered"))
            row["x_base"] = round(row["recovery_s"] / den, 3) if ok else None
            # With the build this very recovery's critical rank spent on the worker's model
            # and optimizer (the baseline's own measurement of it is noisier).
            st = (row.get("startups") or {}).get(row.get("restore_begin_last") or "", {})
            build = (st["built_s"] - st["train_s"]) if "built_s" in st and "train_s" in st \
                else None
            row["worker_build_s"] = None if build is None else round(build, 3)
            row["x_build"] = (round(row["recovery_s"] / (den + build), 3)
                              if ok and build is not None else None)
    print_table(results, baseline)
    targets: dict[str, Any] = {}
    for row in (results.get("peer") or {}).get("rows") or []:
        ratio, lost = row.get("x_base"), row.get("steps_lost")
        read = row.get("bytes_read") or {}
        storage = int(read.get("persistent", 0)) + int(read.get("node-local", 0))
        # The baseline leaves out the worker's own build, whose first optimizer
        # imports torch._dynamo (torch's start-up, deferred): the same ratio with it in.
        with_build = row.get("x_build")
        targets[f"(a) rank {row['rank']} killed"] = {
            "recovery_to_startup_plus_step": ratio, "steps_lost": lost,
            "storage_bytes_read": storage,
            "pass": bool(ratio is not None and ratio <= TARGET_RATIO and lost is not None
                         and lost <= 1 and storage == 0),
            "recovery_to_startup_build_plus_step": with_build,
            "pass_counting_the_build": bool(
                with_build is not None and with_build <= TARGET_RATIO and lost is not None
                and lost <= 1 and storage == 0)}
    if ro is not None and "error" not in ro:
        print(f"\nrestore by {WORKERS} ranks from the emulator, one checkpoint "
              f"({ro['one_rank']['bytes'] / 2**20:.0f} MiB read by one rank), median of "
              f"{repeats}:")
        for mode, label in (("read_once", "read once (restore_latest)"),
                            ("every_rank", "every rank reads (load_verified)"),
                            ("one_rank_restore", "one rank alone (restore_latest)"),
                            ("one_rank", "one rank alone (load_verified)")):
            print(f"  {label:<34} {ro[mode]['seconds_median']:>7.2f} s "
                  f"{ro[mode]['bytes'] / 2**20:>8.0f} MiB")
        if ro.get("note"):
            print(f"  NOTE: {ro['note']}")
        print(f"  read once / one rank alone (restore_latest): "
              f"{ro['ratio_read_once_to_one_rank']:.2f}x "
              f"(target <= {TARGET_RATIO}); every rank / one rank alone: "
              f"{ro['ratio_every_rank_to_one_rank']:.2f}x")
        for mode in ("read_once", "one_rank_restore"):
            if "cpu_s_median" in ro.get(mode, {}):
                print(f"  CPU-seconds, {mode} (3 ranks + the emulator): "
                      f"{ro[mode]['cpu_s_median']:.2f}, so at least "
                      f"{ro[mode]['cpu_bound_s']:.2f} s on {os.cpu_count()} cores")
        raw = ro.get("raw_broadcast") or {}
        if raw:
            print(f"  what bounds it: a raw broadcast of the state's {raw.get('mib')} MiB to "
                  f"the other ranks takes {raw['fresh_s']:.2f} s into memory touched for the "
                  f"first time, {raw['warm_s']:.2f} s into the same memory again")
        targets["read_once"] = {"ratio": ro["ratio_read_once_to_one_rank"], "pass": ro["pass"]}
    elif ro is not None:
        print(f"\nread once: FAILED: {ro['error']}")
    if emergency is not None:
        if emergency.get("error"):
            print(f"\nSIGTERM -> emergency checkpoint: FAILED: {emergency['error']}")
        else:
            print(f"\nSIGTERM -> exit 134 with the emergency checkpoint committed: "
                  f"{emergency['sigterm_to_exit_s']:.1f} s of the {emergency['grace_s']:g} s "
                  f"grace ({emergency['line']})")
        targets["sigterm"] = {"seconds": emergency.get("sigterm_to_exit_s"),
                              "grace_s": emergency.get("grace_s"),
                              "pass": bool(emergency.get("pass"))}
    for k, v in targets.items():
        print(f"target, {k}: {v}")
    load_end = [round(x, 2) for x in os.getloadavg()]
    print(f"\nload average at start {load_start}, at end {load_end}; memory available at "
          f"start {avail_start / 2**30:.1f} GiB, least seen {watch.least / 2**30:.1f} GiB; "
          f"emulator peak RSS {watch.emulator_rss / 2**30:.1f} GiB; "
          f"{time.monotonic() - t0:.0f} s in all")

    result = {
        "benchmark": "recovery",
        **stamp(load_average_start=load_start, load_average_end=load_end,
                mem_available_start_bytes=avail_start, mem_available_least_bytes=watch.least,
                emulator_peak_rss_bytes=watch.emulator_rss),
        "commit": git_commit(),
        "config": {"quick": q, "workers": WORKERS, "params_m": args.params_m,
                   "state_bytes_per_rank": int(args.params_m * 1e6) * 4 * 3,
                   "steps": args.steps, "save_every": args.save_every,
                   "step_time_s": args.step_time,
                   "kills": [{"rank": r, "replica": replica_of(r), "step": s}
                             for r, s in args.plan],
                   "arms": {a: ARMS[a][0] for a in arms},
                   "worker": "benchmarks/recovery_worker.py",
                   "torchrun": f"torchrun --standalone --nnodes 1 --nproc-per-node {WORKERS} "
                               f"--max-restarts {len(args.plan)}",
                   "read_once_repeats": None if args.skip_read_once else repeats},
        "baseline": baseline,
        "arms": results,
        "read_once": ro,
        "sigterm": emergency,
        "targets": targets,
        "elapsed_s": round(time.monotonic() - t0, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
