"""Run every benchmark, then write benchmarks/results/README.md with tables and SVG plots.

    python benchmarks/run_all.py                  # quick sizes (about 15-20 min on 2 cores)
    python benchmarks/run_all.py --full           # the benchmarks' own default sizes (hours)
    python benchmarks/run_all.py --only goodput,runtime
    python benchmarks/run_all.py --from-json      # only regenerate README.md and the plots

Each benchmark runs as its own subprocess, one after the other, writing its JSON into the
results directory (``--results``, default benchmarks/results). One that fails (non-zero
exit, timeout, no JSON written) does not stop the others; its status, exit code and last
output lines go to ``run_all.json`` next to the JSON files, and README.md says which
failed and why (showing the previous JSON, if any, marked as such). ``--from-json`` runs
nothing: it rebuilds README.md and the SVGs from the JSON there, and reports a missing
JSON as missing.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import importlib.metadata
import json
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
import plots
from bench_goodput import root_cause  # the last "...Error: ..." line of an output

STATUS_FILE = "run_all.json"


class Bench:
    def __init__(self, name: str, script: str, title: str, quick: list[str], full: list[str],
                 *, has_out: bool = True, quick_timeout: float = 1800,
                 full_timeout: float = 6 * 3600) -> None:
        self.name, self.script, self.title = name, script, title
        self.quick, self.full = quick, full
        self.has_out = has_out          # takes --out PATH (bench_runtime.py does not)
        self.quick_timeout, self.full_timeout = quick_timeout, full_timeout

    @property
    def json_name(self) -> str:
        return f"{self.name}.json"

    def command(self, full: bool, out: Path | None = None) -> list[str]:
        cmd = [sys.executable, str(HERE / self.script), *(self.full if full else self.quick)]
        if out is not None and self.has_out:
            cmd += ["--out", str(out)]
        return cmd

    def shown(self, full: bool) -> str:
        return shlex.join(["python", f"benchmarks/{self.script}",
                           *(self.full if full else self.quick)])


BENCHES: list[Bench] = [
    Bench("checkpoint", "bench_checkpoint.py",
          "Checkpoint save and restore vs torch.save, torch.distributed.checkpoint, gcsfs",
          ["--size-gb", "0.25", "--repeats", "2", "--gcs-size-gb", "0.1"], []),
    Bench("distributed", "bench_distributed.py",
          "Process group init, and recovery from a peer's death vs torchrun --max-restarts",
          ["--quick"], []),
    Bench("runtime", "bench_runtime.py", "Per-step overhead of ctx.steps()",
          ["--steps", "50000", "--repeats", "3"], [], has_out=False, quick_timeout=600),
    Bench("launcher", "bench_launcher.py", "Launcher restart latency and idle CPU",
          ["--restarts", "5", "--idle-seconds", "10"], [], quick_timeout=900),
    Bench("goodput", "bench_goodput.py", "Goodput under chaos, by checkpoint policy",
          ["--quick"], []),
    Bench("soak", "bench_soak.py", "Kill soak: one 4-worker job, kills at random steps over "
          "every rank", ["--kills", "8", "--against", "none"], [], quick_timeout=900),
    Bench("gcs_streams", "bench_gcs_streams.py",
          "Parallel streams to gs:// (fake-gcs-server): save and restore by streams per file",
          ["--size-mib", "128", "--repeats", "2"], [], quick_timeout=900),
    Bench("peers", "bench_peers.py", "Per-step cost of keeping peers' per-rank state",
          ["--steps", "1000", "--charlm-steps", "60"], [], quick_timeout=900),
    Bench("overlap", "bench_overlap.py", "Overlapped snapshot against the blocking copy",
          ["--saves", "4", "--state-mb", "256"], [], quick_timeout=900),
    Bench("spawn", "bench_spawn.py", "Several processes per machine: resilient-train spawn "
          "against torchrun when a machine is lost", [], [], quick_timeout=900),
    # --quick (5-7 min): 0.13 GiB of state per rank, not 0.5 (the full size: 15-18 min).
    Bench("recovery", "bench_recovery.py", "Recovery after a worker's death: from live "
          "peers, from gs://, and under torchrun", ["--quick"], [], quick_timeout=900),
]
BY_NAME = {b.name: b for b in BENCHES}


# --- running ------------------------------------------------------------------------------

def run_one(bench: Bench, results: Path, full: bool,
            timeout: float | None = None) -> dict[str, Any]:
    """Run one benchmark as a subprocess (its output echoed with a prefix); its status."""
    out = results / bench.json_name
    before = out.stat().st_mtime_ns if out.exists() else None
    cmd = bench.command(full, out)
    timeout = timeout or (bench.full_timeout if full else bench.quick_timeout)
    # A benchmark without --out writes benchmarks/results/NAME.json whatever --results
    # says: keep that file as it was when the results go elsewhere.
    default = DEFAULT_RESULTS / bench.json_name
    elsewhere = not bench.has_out and default.resolve() != out.resolve()
    saved = (default.read_bytes(), default.stat()) if elsewhere and default.exists() else None
    status: dict[str, Any] = {"command": bench.shown(full), "started":
                              dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    tail: collections.deque[str] = collections.deque(maxlen=40)
    print(f"\n=== {bench.name}: {shlex.join(cmd)}", flush=True)
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", start_new_session=True)
    except OSError as exc:
        status.update(status="failed", why=f"could not start: {exc}", seconds=0.0)
        return status

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            print(f"[{bench.name}] {line}", end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)   # the benchmark and its own children
        except ProcessLookupError:
            pass
        rc = proc.wait()
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    reader.join(timeout=5)
    status["seconds"] = round(time.monotonic() - t0, 1)
    status["exit_code"] = rc
    if elsewhere:
        if default.exists() and (saved is None
                                 or default.stat().st_mtime_ns != saved[1].st_mtime_ns):
            out.write_bytes(default.read_bytes())
        if saved is not None:
            default.write_bytes(saved[0])
            os.utime(default, ns=(saved[1].st_atime_ns, saved[1].st_mtime_ns))
        elif default.exists():
            default.unlink()
    wrote = out.exists() and (before is None or out.stat().st_mtime_ns != before)
    status["wrote_json"] = wrote
    if timed_out:
        status.update(status="failed", why=f"timed out after {timeout:.0f} s (killed)")
    elif rc != 0 and not wrote:
        status.update(status="failed", why=f"exit status {rc}, no JSON written")
    elif rc != 0:
        status.update(status="errors", why=f"exit status {rc} (JSON written)")
    elif not wrote:
        status.update(status="failed", why="exit status 0 but no JSON written")
    else:
        status["status"] = "ok"
    if status["status"] != "ok":
        status["output_tail"] = list(tail)[-25:]
    print(f"=== {bench.name}: {status['status']} in {status['seconds']:.0f} s"
          + (f" ({status['why']})" if status.get("why") else ""), flush=True)
    return status


# --- reading ------------------------------------------------------------------------------

def load_json(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    if not path.exists():
        return None, "missing"
    try:
        return json.loads(path.read_text()), None
    except (OSError, ValueError) as exc:
        return None, f"unreadable: {exc}"


def when(data: dict[str, Any]) -> str:
    t = data.get("time")
    if isinstance(t, (int, float)):
        return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="seconds")
    return str(t) if t else "?"


def machine_line(data: dict[str, Any]) -> str:
    m = data.get("machine") or {}
    bits = []
    if m.get("cpus"):
        bits.append(f"{m['cpus']} cores")
    if m.get("torch"):
        bits.append(f"torch {m['torch']}")
    py = m.get("python") or data.get("python")
    if py:
        bits.append(f"Python {py}")
    return ", ".join(bits) or "machine not recorded"


def fnum(v: Any, digits: int = 3, unit: str = "") -> str:
    if v is None:
        return "-"
    try:
        v = float(v)
    except (TypeError, ValueError):
        return str(v)
    if math.isnan(v):
        return "-"
    return f"{v:.{digits}f}{unit}"


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def fratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def _numeric(cell: Any) -> bool:
    return bool(re.match(r"^\**[-+]?\d", str(cell).strip())) or str(cell).strip() == "-"


def md_table(head: list[str], rows: list[list[str]], align: list[str] | None = None) -> str:
    def cell(s: Any) -> str:
        return str(s).replace("|", "\\|").replace("\n", " ")

    if align is None:   # numbers right, text left
        align = ["---"] + ["--:" if all(_numeric(r[i]) for r in rows if i < len(r)
                                        and str(r[i]).strip()) else "---"
                           for i in range(1, len(head))]
    lines = ["| " + " | ".join(cell(h) for h in head) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


# --- sections (each returns Markdown and writes its SVGs) ----------------------------------

Section = tuple[str, dict[str, str]]   # markdown, {svg file name: svg text}


def _find(rows: list[dict[str, Any]], prefix: str) -> dict[str, Any] | None:
    for r in rows:
        if str(r.get("operation", "")).strip().startswith(prefix):
            return r
    return None


def _secs(row: dict[str, Any] | None) -> float | None:
    return None if row is None or row.get("seconds") is None else float(row["seconds"])


def section_checkpoint(d: dict[str, Any]) -> Section:
    rows = d.get("rows") or []
    cfg = d.get("config") or {}
    comp = [
        ("async save: training blocked", "ours: async save, blocking",
         "bare copy into touched buffers", "copy into preallocated buffers",
         "dcp.async_save thread, blocking"),
        ("sync save to local disk (fsync)", "ours: sync save, local",
         "torch.save + flush + fsync", "torch.save + flush + fsync",
         "dcp.save (local"),
        ("restore, cold page cache", "ours: restore_latest",
         "torch.load(weights_only=True)", "torch.load(weights_only=True)",
         "dcp.load"),
        ("save to gs:// (fake-gcs-server)", "ours: sync save to gs://",
         "torch.save to buffer + gcsfs pipe", "torch.save + gcsfs pipe", None),
    ]
    table, values = [], {}
    cats = []
    for label, ours_p, base_p, base_name, dcp_p in comp:
        ours, base = _secs(_find(rows, ours_p)), _secs(_find(rows, base_p))
        dcp = _secs(_find(rows, dcp_p)) if dcp_p else None
        if ours is None and base is None and dcp is None:
            continue
        cats.append(label)
        table.append([label, fnum(ours), f"{fnum(base)} ({base_name})",
                      fratio(ratio(base, ours)), fnum(dcp), fratio(ratio(dcp, ours))])
        values[(label, "ours")] = ours
        values[(label, "baseline (torch.save / torch.load / copy / gcsfs)")] = base
        if dcp_p:
            values[(label, "torch.distributed.checkpoint")] = dcp
    size = cfg.get("size_gb")
    md = [f"State: {fnum(size, 2)} GiB of float32 in {cfg.get('tensors', '?')} tensors"
          + (f" (GCS: {fnum(cfg.get('gcs_size_gb'), 2)} GiB)" if cfg.get("gcs_size_gb") else "")
          + f", {cfg.get('repeats', '?')} interleaved repeats after a warm-up, medians. "
          "Ratios are baseline / ours: above 1.00x ours is faster."]
    md.append("")
    md.append(md_table(["operation", "ours (s)", "baseline (s)", "baseline / ours",
                        "DCP (s)", "DCP / ours"], table))
    md.append("")
    targets = [r for r in rows if r.get("pass") is not None]
    if targets:
        md.append(f"Targets met: {sum(bool(r['pass']) for r in targets)}/{len(targets)}.")
        md.append("")
    md.append("<details><summary>every row</summary>\n")
    md.append(md_table(["operation", "median s", "ratio", "ratio is", "target", "pass", "note"],
                       [[r.get("operation", ""), fnum(r.get("seconds")),
                         "" if r.get("ratio") is None else f"{r['ratio']:.2f}",
                         r.get("ratio_def", ""), r.get("target", ""),
                         "" if r.get("pass") is None else ("PASS" if r["pass"] else "FAIL"),
                         r.get("note", "")] for r in rows]))
    md.append("\n</details>")
    loads = d.get("load_average_1min")
    if loads:
        md.append("")
        md.append("1-minute load average during the run: "
                  + ", ".join(f"{k} {v}" for k, v in loads.items()) + ".")
    svgs = {}
    if cats:
        series = ["ours", "baseline (torch.save / torch.load / copy / gcsfs)",
                  "torch.distributed.checkpoint"]
        svgs["checkpoint.svg"] = plots.grouped_bars(
            "Checkpoint: seconds per operation (median, lower is better)", cats, series,
            values, unit="seconds", log=True)
    return "\n".join(md), svgs


def _stat(d: dict[str, Any] | None, key: str = "median_s") -> float | None:
    if not d or not d.get("n"):
        return None
    return d.get(key)


def section_distributed(d: dict[str, Any]) -> Section:
    md: list[str] = []
    svgs: dict[str, str] = {}
    form = d.get("form") or {}
    fr = form.get("results") or {}
    ours, plain = fr.get("rt.init_distributed"), fr.get("init_process_group")
    if fr:
        md.append(f"**Forming a {form.get('world_size', '?')}-process gloo group** "
                  f"({form.get('repeats', '?')} repeats, median seconds; ratio = plain / ours).")
        md.append("")
        rows = []
        for key, label in (("init_call_slowest_rank", "init call, slowest rank"),
                           ("last_into_init_to_all_formed", "last rank into init -> all formed"),
                           ("spawn_to_all_formed", "spawn -> all formed (wall)")):
            a = _stat((ours or {}).get(key))
            b = _stat((plain or {}).get(key))
            rows.append([label, fnum(a), fnum(b), fratio(ratio(b, a))])
        md.append(md_table(["", "rt.init_distributed", "init_process_group (env://)",
                            "plain / ours"], rows))
        md.append("")
    rec = d.get("recovery") or {}
    rr = rec.get("results") or {}
    if rr:
        md.append(f"**A peer's death -> every one of {rec.get('workers', '?')} workers training "
                  f"again** (seconds, median / p90; a death not recovered from within "
                  f"{fnum(rec.get('recovery_limit_s'), 0)} s is a failure).")
        md.append("")
        rows = []
        values: dict[tuple[str, str], float | None] = {}
        labels: dict[tuple[str, str], str] = {}
        cats = []
        ours_best = None
        for name, r in rr.items():
            ata = r.get("all_training_again") or {}
            why = ""
            if not r.get("recovered"):
                whys = sorted({x.get("why", "") for x in r.get("raw", []) if x.get("why")})
                mesh = any(x.get("connectFullMesh_in_output") for x in r.get("raw", []))
                why = "; ".join(whys) + ("; Gloo connectFullMesh failed" if mesh else "")
            med, p90 = _stat(ata), _stat(ata, "p90_s")
            rows.append([name, f"{r.get('recovered', 0)}/{r.get('kills', 0)}",
                         f"{fnum(med)} / {fnum(p90)}" if med is not None else "-",
                         fnum(_stat(r.get("restarted_first_line"))),
                         fnum(_stat(r.get("survivor_last_recovery_s"))), why])
            cats.append(name)
            values[(name, "death -> all training")] = med
            if med is None:
                labels[(name, "death -> all training")] = (
                    f"no recovery ({r.get('recovered', 0)}/{r.get('kills', 0)})")
            if name.startswith("rt") and med is not None:
                ours_best = med if ours_best is None else max(ours_best, med)
        md.append(md_table(["case", "recovered", "death -> all training", "restarted: first line",
                            "survivors: last_recovery_s", "failure"], rows))
        torch_rows = [(n, r) for n, r in rr.items() if n.startswith("torchrun")]
        for n, r in torch_rows:
            tmed = _stat(r.get("all_training_again") or {})
            md.append("")
            if tmed is not None and ours_best is not None:
                md.append(f"{n}: {tmed:.2f} s, {tmed / ours_best:.2f}x our slowest case.")
            else:
                md.append(f"{n}: recovered {r.get('recovered', 0)} of {r.get('kills', 0)} kills "
                          "(no time to compare).")
        svgs["distributed.svg"] = plots.grouped_bars(
            "Peer death -> all workers training again (median s, lower is better)", cats,
            ["death -> all training"], values, unit="seconds", labels=labels,
            missing_label="no recovery")
    m = d.get("machine") or {}
    if m.get("load_average_start"):
        md.append("")
        md.append(f"Load average at start {m['load_average_start']}, at end "
                  f"{m.get('load_average_end')}; total {fnum(d.get('elapsed_s'), 0)} s.")
    return "\n".join(md), svgs


def section_runtime(d: dict[str, Any]) -> Section:
    target = d.get("target_us")
    rows = [["bare `range` loop", fnum(d.get("bare_us_per_step")), ""],
            ["`ctx.steps()` (restore, policy check, watchdog, peer check)",
             fnum(d.get("ctx_steps_us_per_step")), ""],
            ["overhead per step", fnum(d.get("overhead_us_per_step")),
             f"< {target} us" if target is not None else ""],
            ["overhead with the launcher's goodput telemetry",
             fnum(d.get("telemetry_overhead_us_per_step")),
             f"< {target} us" if target is not None else ""]]
    if d.get("telemetry_overhead_us_per_step") is None:
        rows.pop()   # measured since the goodput telemetry was added
    md = [(f"{d.get('steps', '?')} steps x {d.get('repeats', '?')} repeats, median; single "
          "process, no save due."), "", md_table(["", "us / step", "target"], rows)]
    over, tele = d.get("overhead_us_per_step"), d.get("telemetry_overhead_us_per_step")
    if over is not None and target is not None:
        ok = over < target and (tele is None or tele < target)
        md += ["", f"Target < {target} us per step: {'met' if ok else 'NOT met'}."]
    cats = ["ctx.steps overhead", "+ goodput telemetry"]
    values = {("ctx.steps overhead", "us / step"): over}
    if tele is not None:
        values[("+ goodput telemetry", "us / step")] = tele
    svg = plots.grouped_bars("Per-step overhead of ctx.steps() (lower is better)", cats,
                             ["us / step"], values, unit="microseconds per step",
                             reference=(target, f"target {target} us") if target else None)
    return "\n".join(md), {"runtime.svg": svg}


def section_launcher(d: dict[str, Any]) -> Section:
    lat = d.get("restart_latency") or []
    keys = [("death_to_noticed", "death -> noticed"),
            ("death_to_replacement_started", "death -> replacement started"),
            ("death_to_user_code", "death -> replacement's first line")]
    rows, values, cats = [], {}, []
    for row in lat:
        mode = f"{row.get('mode', '?')} ({row.get('restarts', '?')} restarts)"
        cells = [mode]
        cats.append(mode)
        for k, label in keys:
            s = row.get(k) or {}
            cells.append(f"{fnum(s.get('median_ms'), 1)} / {fnum(s.get('p90_ms'), 1)}")
            values[(mode, label)] = s.get("median_ms")
        rows.append(cells)
    md = ["**Restart latency** (ms, median / p90):", "",
          md_table(["mode"] + [k[1] for k in keys], rows)]
    st = d.get("python_startup_to_first_line") or {}
    if st:
        md += ["", (f"For scale: a bare `subprocess.run` of the same `python -c` to its first "
                   f"line takes {fnum(st.get('median_ms'), 1)} / {fnum(st.get('p90_ms'), 1)} ms.")]
        cats.append("bare python -c (reference)")
        values[("bare python -c (reference)", keys[2][1])] = st.get("median_ms")
    cpu = d.get("idle_cpu") or []
    if cpu:
        md += ["", ("**Launcher CPU while the job idles** (the launcher process, not its "
                   "workers):"), "",
               md_table(["config", "wall s", "CPU s", "CPU / wall"],
                        [[c.get("config", "?"), fnum(c.get("wall_s"), 1), fnum(c.get("cpu_s")),
                          f"{100 * float(c.get('cpu_fraction') or 0):.3f} %"] for c in cpu])]
    svg = plots.grouped_bars("Launcher restart latency (median ms, lower is better)", cats,
                             [k[1] for k in keys], values, unit="milliseconds")
    return "\n".join(md), {"launcher.svg": svg}


GOODPUT_PARTS = [("startup_s", "startup"), ("productive_s", "productive"),
                 ("lost_s", "lost (recomputed)"), ("checkpoint_s", "checkpoint (blocked)"),
                 ("recovery_s", "recovery"), ("other_s", "other")]
GOODPUT_COLORS = ["#9498a0", "#3ca951", "#ff725c", "#efb118", "#4269d0", "#c9c9c9"]


def _policy_label(spec: str) -> str:
    try:
        import bench_goodput
        return bench_goodput.policy_label(spec)
    except Exception:  # noqa: BLE001  (a label only)
        return spec


def _rate_label(mean: Any) -> str:
    return "no faults" if mean is None else f"kill every ~{float(mean):g} s"


def section_goodput(d: dict[str, Any]) -> Section:
    cfg = d.get("config") or {}
    runs = d.get("runs") or []
    rates = [r.get("mean_s") for r in d.get("rates") or []] or list(
        dict.fromkeys(r.get("mean_s") for r in runs))
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    by = {(r["policy"], r.get("mean_s")): r for r in runs}
    md = [f"{cfg.get('workers', '?')} workers under `resilient-train launch`, "
          f"{cfg.get('steps', '?')} steps of ~{fnum(cfg.get('step_time_s'), 2)} s sleep + a small "
          f"forward/backward and one all-reduce, {fnum(cfg.get('state_mb'), 0)} MiB of "
          f"checkpointed state; seeded random kills (at most {cfg.get('kills', '?')} per job, "
          f"`--chaos-seed {cfg.get('seed', '?')}` for every policy, so every policy faces the "
          f"same fault times). Goodput = productive step time / wall time from RUNNING to the "
          f"end (job.json's `goodput`). Cells: goodput, lost s (steps computed again), "
          f"recovery s." + (" Quick mode." if cfg.get("quick") else ""), ""]
    head = ["policy"] + [_rate_label(m) for m in rates]
    rows = []
    for p in policies:
        cells = [_policy_label(p)]
        for m in rates:
            r = by.get((p, m))
            gp = (r or {}).get("goodput")
            if r is None:
                cells.append("-")
            elif not gp:
                cells.append(f"FAILED: {r.get('error', '?')}")
            elif r.get("error"):
                cells.append(f"**FAILED** (see below); {100 * gp['goodput']:.1f} % of "
                             f"{fnum(gp['wall_s'], 1)} s until then")
            else:
                cells.append(f"**{100 * gp['goodput']:.1f} %**, lost {fnum(gp['lost_s'], 1)} s, "
                             f"rec {fnum(gp['recovery_s'], 1)} s")
        rows.append(cells)
    md.append(md_table(head, rows))
    md.append("")
    for info in d.get("rates") or []:
        if info.get("schedule"):
            sched = ", ".join(f"{f.get('at_s')} s {f.get('target', '')}".strip()
                              for f in info["schedule"])
            md.append(f"- `{info.get('chaos')}` seed {info.get('seed')}: kills scheduled at "
                      f"{sched} after RUNNING (a kill after the job ended never happens).")
    md.append("")
    md.append("<details><summary>every job</summary>\n")
    detail = []
    for r in runs:
        gp = r.get("goodput") or {}
        detail.append([_policy_label(r["policy"]), _rate_label(r.get("mean_s")),
                       fnum(gp.get("wall_s"), 1), fnum(gp.get("startup_s"), 1),
                       fnum(gp.get("productive_s"), 1), fnum(gp.get("lost_s"), 1),
                       fnum(gp.get("checkpoint_s"), 2), fnum(gp.get("recovery_s"), 1),
                       fnum(gp.get("other_s"), 1), str(gp.get("steps_lost", "-")),
                       str(r.get("faults", "-")), str(r.get("saves", "-")),
                       r.get("state", "-") if not r.get("error") else f"{r.get('error')}"])
    md.append(md_table(["policy", "rate", "wall", "startup", "productive", "lost", "ckpt",
                        "recovery", "other", "steps lost", "kills", "saves", "state"], detail))
    md.append("\n</details>")
    for r in runs:
        if r.get("error"):
            cause = r.get("root_cause") or root_cause(r.get("output_tail") or "")
            md += ["", f"**`{r['policy']}` at {_rate_label(r.get('mean_s'))} failed**: "
                   f"{r['error']}" + (f". Root cause: `{cause}`" if cause else "")]
    for note in d.get("notes") or []:
        md += ["", f"Note: {note}"]
    for r in runs:
        if r.get("auto_log"):
            md += ["", (f"`{r['policy']}` at {_rate_label(r.get('mean_s'))}, the primary's "
                   f"auto_interval log (last line): `{r['auto_log'][-1][-220:]}`")]
    svgs = {}
    if runs:
        values = {}
        labels = {}
        for p in policies:
            for m in rates:
                r = by.get((p, m))
                if r is None:
                    continue
                gp = r.get("goodput")
                values[(_policy_label(p), _rate_label(m))] = (
                    100 * gp["goodput"] if gp else None)
                if r.get("error"):
                    labels[(_policy_label(p), _rate_label(m))] = (
                        f"{100 * gp['goodput']:.1f} (job failed)" if gp else "job failed")
        svgs["goodput.svg"] = plots.grouped_bars(
            "Goodput by checkpoint policy and fault rate (% of wall time, higher is better)",
            [_policy_label(p) for p in policies], [_rate_label(m) for m in rates], values,
            unit="goodput %", labels=labels, missing_label="job failed")
        stack_rows, stack_vals, right = [], {}, {}
        for r in runs:
            gp = r.get("goodput")
            if not gp:
                continue
            name = f"{_policy_label(r['policy'])}, {_rate_label(r.get('mean_s'))}"
            stack_rows.append(name)
            stack_vals[name] = [float(gp.get(k) or 0.0) for k, _ in GOODPUT_PARTS]
            right[name] = f"{100 * gp['goodput']:.0f} %" + (" (failed)" if r.get("error") else "")
        if stack_rows:
            svgs["goodput-breakdown.svg"] = plots.stacked_bars(
                "Where each job's wall time went (seconds)", stack_rows,
                [p for _, p in GOODPUT_PARTS], stack_vals, unit="seconds",
                right_labels=right, label_width=330, colors=GOODPUT_COLORS)
    return "\n".join(md), svgs


def _lost(kills: list[dict[str, Any]]) -> str:
    """The steps lost over a soak's kills, or "-" where a kill has no such count."""
    lost = [k.get("steps_lost") for k in kills]
    return str(sum(lost)) if lost and None not in lost else "-"


def section_soak(d: dict[str, Any]) -> Section:
    cfg = d.get("config") or {}
    s = d.get("summary") or {}
    rec = s.get("recovery_s") or {}
    kills = d.get("kills") or []
    md = [(f"{cfg.get('workers', '?')} workers, {cfg.get('steps', '?')} steps of "
           f"`examples/train_demo.py` (`--step-time {cfg.get('step_time_s', '?')}`, a save "
           f"every {cfg.get('save_every', '?')} steps), {cfg.get('kills', '?')} SIGKILLs "
           f"(`kill:R@stepN`, seed {cfg.get('seed', '?')}). Recovery = the launcher's kill "
           "event -> the last rank's first step done after its restore (telemetry)."), "",
          md_table(["kills", "recovered (in place)", "recovery s: min / median / max",
                    "job retries", "job", "failures"],
                   [[f"{s.get('kills_fired', '-')}/{s.get('planned_kills', '-')}",
                     f"{s.get('recovered', '-')} ({s.get('recovered_in_place', '-')})",
                     f"{fnum(rec.get('min'), 2)} / {fnum(rec.get('median'), 2)} / "
                     f"{fnum(rec.get('max'), 2)}",
                     str(s.get("job_retries", "-")),
                     str(s.get("job_state", "-")).replace("JOB_STATE_", ""),
                     str(len(s.get("failures") or []))]])]
    for f in s.get("failures") or []:
        md += ["", f"**Failure**: {f}"]
    tr = d.get("torchrun") or {}
    ts = tr.get("summary") or {}
    tcfg = cfg.get("torchrun") or {}
    if ts:
        trec = ts.get("recovery_s") or {}
        md += ["", (f"The same plan under `{tcfg.get('command', 'torchrun')}` (store "
                    f"{tcfg.get('store', '?')}), the same run: the harness SIGKILLs the rank "
                    "when the primary's telemetry reaches the step; torchrun restarts every "
                    "worker. Recovery measured the same way (the harness's kill time); a kill "
                    f"not recovered within {fnum(ts.get('recovery_limit_s'), 0)} s fails and "
                    "ends that job."), "",
               md_table(["", "recovered", "recovery s: min / median / max",
                         "processes restarted", "failures"],
                        [["resilient-train launch",
                          f"{s.get('recovered', '-')}/{s.get('planned_kills', '-')}",
                          f"{fnum(rec.get('min'), 2)} / {fnum(rec.get('median'), 2)} / "
                          f"{fnum(rec.get('max'), 2)}", str(s.get("kills_fired", "-")),
                          str(len(s.get("failures") or []))],
                         [f"torchrun --max-restarts {ts.get('max_restarts', '?')}",
                          f"{ts.get('recovered', '-')}/{ts.get('planned_kills', '-')}",
                          f"{fnum(trec.get('min'), 2)} / {fnum(trec.get('median'), 2)} / "
                          f"{fnum(trec.get('max'), 2)}",
                          f"{ts.get('restarts_used', '-')} x {cfg.get('workers', '?')}",
                          str(len(ts.get("failures") or []))]]),
               "", f"Median recovery, torchrun / ours: "
                   f"{fnum(d.get('median_ratio_torchrun_to_ours'), 2)}x. Steps lost over "
                   f"all kills (the primary's last step before the kill less the step "
                   f"resumed from): ours {_lost(kills)}, torchrun "
                   f"{_lost(tr.get('kills') or [])}."]
        for f in ts.get("failures") or []:
            md += ["", f"**torchrun failure**: {f}"]
    theirs = {k.get("kill"): k for k in tr.get("kills") or []}
    ours = "resilient-train launch"
    series = [ours, "torchrun"] if ts else [ours]
    rows, cats, values, labels = [], [], {}, {}
    for k in kills:
        name = f"kill {k.get('kill')}: rank {k.get('rank')} @ step {k.get('at_step')}"
        cats.append(name)
        values[(name, ours)] = k.get("recovery_s")
        if not k.get("recovered"):
            labels[(name, ours)] = "not recovered"
        if ts:
            t = theirs.get(k.get("kill")) or {}
            values[(name, "torchrun")] = t.get("recovery_s") if t.get("recovered") else None
            if not t.get("recovered"):
                labels[(name, "torchrun")] = "not recovered" if t else "never fired"
        rows.append([str(k.get("kill")), str(k.get("rank")), str(k.get("at_step")),
                     str(k.get("steps_done_at_kill")), str(k.get("resumed_from")),
                     fnum(k.get("survivors_reformed_s"), 1), fnum(k.get("recovery_s"), 2),
                     (k.get("slowest", "") + (" (job retry)" if k.get("job_retry") else ""))
                     if k.get("recovered") else f"FAILED: {k.get('why', '?')}"])
        if ts:
            t = theirs.get(k.get("kill")) or {}
            rows[-1] += [str(t.get("steps_done_at_kill", "-")), str(t.get("resumed_from", "-")),
                         fnum(t.get("recovery_s"), 2) if t.get("recovered") else
                         ("FAILED: " + t["why"] if t else "never fired")]
    head = ["kill", "rank", "at step", "stopped at", "resumed from", "survivors re-formed s",
            "recovery s", "slowest rank / note"]
    if ts:
        head += ["torchrun: stopped at", "resumed from", "recovery s"]
    md += ["", "<details><summary>every kill</summary>\n", md_table(head, rows),
           "\n</details>"]
    m = d.get("machine") or {}
    if m.get("load_average_start"):
        md += ["", f"Load average at start {m['load_average_start']}, at end "
               f"{m.get('load_average_end')}; job {fnum(d.get('job_wall_s'), 0)} s"
               + (f", torchrun job {fnum(tr.get('job_wall_s'), 0)} s." if ts else ".")]
    svgs = {}
    if cats:
        svgs["soak.svg"] = plots.grouped_bars(
            "Kill soak: kill -> every rank training again (s, lower is better)", cats,
            series, values, unit="seconds", labels=labels, missing_label="not recovered")
    return "\n".join(md), svgs


def section_gcs_streams(d: dict[str, Any]) -> Section:
    cfg = d.get("config") or {}
    rows = d.get("rows") or []
    default = d.get("default") or {}
    parts = any("ratio_vs_1_parts" in (r.get("save") or {}) for r in rows)
    md = [(f"A {fnum((cfg.get('size_bytes') or 0) / 2**20, 0)} MiB checkpoint (64 float32 "
           f"tensors) saved and restored by `CheckpointManager` on "
           f"{cfg.get('store') or cfg.get('emulator') or 'the emulator'}, "
           f"{cfg.get('repeats', '?')} interleaved rounds after a warm-up, medians. "
           "x1: the one-stream path's time (one `put_file` per file; reads one range at a "
           "time) over the row's, above 1.00x faster; per round: the median of the "
           "per-round ratios"
           + ("; x1 parts: the same against the one-stream part upload (the upload's shape "
              "without parallelism)" if parts else "")
           + "; restore x by hand: `torch.load` from a gcsfs file's time over the row's."), ""]
    head = ["", "save s", "MiB/s", "x1", "per round"] + (["x1 parts"] if parts else []) + \
        ["restore s", "MiB/s", "x1", "per round", "restore x by hand", "parts", "buffers"]
    table, values = [], {}
    for r in rows:
        sv, rs = r.get("save") or {}, r.get("restore") or {}
        name = str(r.get("contender", "?"))
        table.append([name, fnum(sv.get("median_s"), 2), fnum(sv.get("mib_s"), 0),
                      fratio(sv.get("ratio_vs_1")), fratio(sv.get("ratio_vs_1_paired"))]
                     + ([fratio(sv.get("ratio_vs_1_parts"))] if parts else [])
                     + [fnum(rs.get("median_s"), 2), fnum(rs.get("mib_s"), 0),
                        fratio(rs.get("ratio_vs_1")), fratio(rs.get("ratio_vs_1_paired")),
                        fratio(rs.get("ratio_vs_hand")),
                        str(r.get("parts", "-")), str(r.get("peak_part_buffers", "-"))])
        values[(name, "save")] = sv.get("mib_s")
        values[(name, "restore")] = rs.get("mib_s")
    md.append(md_table(head, table))
    if default:
        md += ["", (f"Default for `gs://`: `TransferOptions(streams={default.get('streams')}, "
                    f"read_streams={default.get('read_streams', '?')}, part_bytes="
                    f"{fnum((default.get('part_bytes') or 0) / 2**20, 0)} MiB"
                    + (f", read_part_bytes={fnum(default['read_part_bytes'] / 2**20, 0)} MiB"
                       if default.get("read_part_bytes") else "") + ")`.")]
    if d.get("bound"):
        md += ["", f"What bounds it here: {d['bound']}."]
    loads = d.get("load_average_1min")
    if loads:
        md += ["", "1-minute load average during the run: "
               + ", ".join(f"{k} {v}" for k, v in loads.items()) + "."]
    svgs = {}
    if table:
        svgs["gcs_streams.svg"] = plots.grouped_bars(
            "gs:// checkpoint throughput by streams per file (MiB/s, higher is better)",
            [t[0] for t in table], ["save", "restore"], values, unit="MiB/s")
    return "\n".join(md), svgs


def section_peers(d: dict[str, Any]) -> Section:
    ring, charlm = d.get("ring") or {}, d.get("charlm") or {}
    frac, target = d.get("cost_fraction_of_charlm_step"), d.get("target_fraction")
    rows = [["ring on, per step", fnum((ring.get("on_mean_s") or 0) * 1e6, 0)],
            ["ring off, per step", fnum((ring.get("off_mean_s") or 0) * 1e6, 0)],
            ["cost per step", fnum((ring.get("cost_s") or 0) * 1e6, 0)],
            ["a step of train_charlm.py (2 workers)",
             fnum((charlm.get("mean_step_s") or 0) * 1e6, 0)]]
    md = [(f"2 processes over 127.0.0.1, {ring.get('steps', '?')} steps each way, interleaved: "
           "an optimizer step and the manager's step boundary with peer recovery on and off; "
           "then train_charlm.py under the launcher for its step time."), "",
          md_table(["", "us"], rows)]
    if frac is not None:
        ok = target is None or frac <= target
        md += ["", f"Cost per step: {frac:.2%} of a train_charlm.py step (target <= "
               f"{(target or 0):.0%}: {'met' if ok else 'NOT met'})."]
    undo, undo_frac = d.get("undo_copy") or {}, d.get("undo_copy_fraction_of_charlm_step")
    if undo and undo_frac is not None:
        md += ["", f"Opt-in `undo_torn_steps=True` (a step torn after its first optimizer "
               f"step, a GAN's, recovers from memory): its copy as each step's first "
               f"optimizer step begins, train_charlm.py's model ("
               f"{fnum((undo.get('param_bytes') or 0) / 2**20, 1)} MiB of parameters) with "
               f"AdamW's moments and its schedule, one thread: "
               f"{fnum((undo.get('mean_s') or 0) * 1e3, 2)} ms per step, {undo_frac:.1%} of "
               f"a step."]
    return "\n".join(md), {}


def section_overlap(d: dict[str, Any]) -> Section:
    rows = []
    for name in ("synthetic", "charlm"):
        r = d.get(name) or {}
        b, o = r.get("blocking") or {}, r.get("overlapped") or {}
        rows.append([name, fnum((b.get("state_bytes") or 0) / 2**20, 0),
                     fnum((b.get("step_s") or 0) * 1e3, 0),
                     fnum((b.get("blocked_s") or 0) * 1e3, 1),
                     fnum((o.get("blocked_s") or 0) * 1e3, 1), fratio(r.get("ratio"))])
    md = ["The loop's time blocked per async save (in `save()` plus the next optimizer "
          "step's wait for the copy), with the copy overlapping the next step and without. "
          "Target: at most 0.2x where the step is longer than the copy.", "",
          md_table(["model", "state MiB", "step ms", "blocking copy ms", "overlapped ms",
                    "ratio"], rows)]
    return "\n".join(md), {}


def section_spawn(d: dict[str, Any]) -> Section:
    cfg = d.get("config") or {}
    rows = []
    for arm, r in (d.get("arms") or {}).items():
        for k in r.get("rows") or []:
            lost = k.get("steps_lost")
            rows.append([arm, f"{k.get('replica')} at step {k.get('at_step')}",
                         fnum(k.get("recovery_s"), 2) if k.get("recovered")
                         else f"did not train again ({k.get('why')})",
                         "" if lost is None or not k.get("recovered") else str(max(0, lost))])
        rows.append([arm, "the job", f"{r.get('state')} in {fnum(r.get('wall_s'), 1)} s", ""])
    md = [(f"One launcher job per arm: 2 machines x 2 processes of examples/train_demo.py, "
           f"{cfg.get('steps', '?')} steps, `{cfg.get('kills', '?')}`, job timeout "
           f"{fnum(cfg.get('timeout_s'), 0)} s. Seconds: the kill -> every machine finished "
           "a step again (telemetry). torchrun: examples/torchrun_replica.sh with its "
           "defaults; its first machine, restarted alone, waits in torchrun's rendezvous "
           "for the other machine's agent (600 s by default). Steps lost are 0 where the "
           "state restored is newer than the victim's last reported step: a kill between "
           "the all-reduce and the step's end, whose step the survivors' copies hold."), "",
          md_table(["arm", "kill", "seconds", "steps lost"], rows)]
    return "\n".join(md), {}


def section_recovery(d: dict[str, Any]) -> Section:
    import bench_recovery  # renders its own JSON

    return bench_recovery.markdown_section(d, md_table, fnum)


SECTIONS: dict[str, Callable[[dict[str, Any]], Section]] = {
    "checkpoint": section_checkpoint, "distributed": section_distributed,
    "runtime": section_runtime, "launcher": section_launcher, "goodput": section_goodput,
    "soak": section_soak, "gcs_streams": section_gcs_streams,
    "recovery": section_recovery, "peers": section_peers, "overlap": section_overlap,
    "spawn": section_spawn,
}


# --- README -------------------------------------------------------------------------------

def torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def write_report(results: Path, statuses: dict[str, Any], invocation: str) -> list[str]:
    """README.md and the SVGs from the JSON files in ``results``; returns problems found."""
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    problems: list[str] = []
    summary, body = [], []
    for b in BENCHES:
        data, err = load_json(results / b.json_name)
        st = statuses.get(b.name) or {}
        last = st.get("status")
        if last == "ok":
            last_txt = f"ok ({fnum(st.get('seconds'), 0)} s)"
        elif last:
            last_txt = f"**{last.upper()}**: {st.get('why', '?')}"
        else:
            last_txt = "not run by run_all.py"
        summary.append([f"[{b.name}](#{b.name})", f"`{b.script}`",
                        when(data) if data else f"**{err}**", last_txt])
        body.append(f'<a id="{b.name}"></a>\n\n## {b.title}\n')
        body.append(f"`benchmarks/{b.script}` -> `{b.json_name}`. Quick: `{b.shown(False)}`; "
                    f"full: `{b.shown(True)}`.\n")
        if last == "errors":
            body.append(f"> **The last run reported errors** ({st.get('started', '?')}): "
                        f"{st.get('why', '?')}; the numbers below are from it, see the "
                        "failures they list.\n")
        elif last and last != "ok":
            body.append(f"> **The last run failed** ({st.get('started', '?')}): "
                        f"{st.get('why', '?')}"
                        + (". The numbers below are from an earlier run." if data
                           and not st.get("wrote_json") else ".") + "\n")
            tail = st.get("output_tail") or []
            if tail:
                body.append("<details><summary>its last output lines</summary>\n\n```\n"
                            + "\n".join(tail[-15:]) + "\n```\n</details>\n")
            problems.append(f"{b.name}: {st.get('why')}")
        if data is None:
            body.append(f"**No results**: `{b.json_name}` is {err}. Run "
                        f"`python benchmarks/run_all.py --only {b.name}`.\n")
            problems.append(f"{b.name}: {b.json_name} {err}")
            continue
        body.append(f"Measured {when(data)} on {machine_line(data)}.\n")
        try:
            md, svgs = SECTIONS[b.name](data)
        except Exception as exc:  # noqa: BLE001  (a JSON of another shape must not sink the others)
            body.append(f"**Could not render** `{b.json_name}`: {type(exc).__name__}: {exc}\n")
            problems.append(f"{b.name}: render error {exc!r}")
            traceback.print_exc()
            continue
        body.append(md + "\n")
        for fname, svg in svgs.items():
            (results / fname).write_text(svg)
            body.append(f"![{fname}]({fname})\n")
    cores = os.cpu_count()
    head = [
        "# Benchmark results",
        "",
        (f"Generated {now} by `{invocation}` on {cores} cores, torch {torch_version()}, "
        f"Python {platform.python_version()}, {platform.platform()}. "
        "Each section states when and where its JSON was measured. Other processes on a "
        "2-core machine swing absolute times; the interleaved ratios are more robust."),
        "",
        ("Reproduce everything (quick sizes; `--full` for the benchmarks' real sizes; "
        "`--only NAME[,NAME]`; `--from-json` rebuilds this page and the plots without "
        "running anything):"),
        "",
        "```",
        "python benchmarks/run_all.py",
        "python benchmarks/run_all.py --full",
        "python benchmarks/run_all.py --from-json",
        "```",
        "",
        md_table(["benchmark", "script", "measured", "last run_all.py run"], summary),
        "",
    ]
    if problems:
        head += ["**Problems**: " + "; ".join(problems) + ".", ""]
    (results / "README.md").write_text("\n".join(head + body))
    return problems


def load_statuses(results: Path) -> dict[str, Any]:
    data, _ = load_json(results / STATUS_FILE)
    return (data or {}).get("benchmarks", {}) if isinstance(data, dict) else {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="the benchmarks' own default sizes")
    ap.add_argument("--only", default=None,
                    help="comma-separated subset of: " + ", ".join(b.name for b in BENCHES))
    ap.add_argument("--from-json", action="store_true",
                    help="run nothing; rebuild README.md and the SVGs from the JSON files")
    ap.add_argument("--results", type=Path, default=DEFAULT_RESULTS,
                    help="results directory (default benchmarks/results)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per benchmark before it is killed (default: 30 min each "
                         "for the quick sizes, 6 h with --full; 10-15 min for the small ones)")
    args = ap.parse_args()
    results: Path = args.results
    results.mkdir(parents=True, exist_ok=True)
    selected = BENCHES
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in BY_NAME]
        if unknown:
            ap.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from "
                     f"{', '.join(BY_NAME)}")
        selected = [BY_NAME[n] for n in names]
    statuses = load_statuses(results)
    invocation = shlex.join(["python", "benchmarks/run_all.py", *sys.argv[1:]])
    if not args.from_json:
        t0 = time.monotonic()
        for b in selected:
            statuses[b.name] = run_one(b, results, args.full, args.timeout)
            (results / STATUS_FILE).write_text(json.dumps(
                {"updated": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                 "benchmarks": statuses}, indent=2) + "\n")
        print(f"\nall done in {time.monotonic() - t0:.0f} s")
    problems = write_report(results, statuses, invocation)
    print(f"wrote {results / 'README.md'}" + (f"; problems: {'; '.join(problems)}"
                                               if problems else ""))
    if args.from_json:
        return 0
    failed = [b.name for b in selected if statuses.get(b.name, {}).get("status") == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
