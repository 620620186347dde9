"""Benchmark checkpoint save / restore against the obvious baselines, side by side in one run.

    python benchmarks/bench_checkpoint.py [--size-gb 1.0] [--repeats 3] [--skip-gcs]
                                          [--gcs-size-gb 0.5] [--out PATH] [--workdir DIR]

The state is a model-like ``torch.nn.Module`` with 64 float32 parameters (``--size-gb`` in
all), tracked by a ``CheckpointManager``. Every measurement is warmed up once (the first
I/O of a run is often several times slower, FIELD-NOTES.md) and then repeated
``--repeats`` times, the contenders interleaved in each round; the table shows medians.
Ratios are "baseline / ours" where the target is "not slower" (>= 1.0 is good) and
"ours / baseline" for the async blocking time (<= 1.5 is good).

1. async save: ``last_blocking_s`` of ``save()`` with ``async_save=True`` (after a warm-up
   save, so host buffers are reused) vs ``dst.copy_(src)`` per tensor into preallocated,
   already-touched buffers.                                       target: ours/copy <= 1.5
2. sync save: ``save(step, blocking=True)`` on local disk, commit included (fsyncs, rename,
   retention) vs ``torch.save`` + flush + fsync.                  target: torch/ours >= 1.0
   Also vs the raw disk: the same tensor bytes with ``os.write`` + fsync (info).
3. restore: ``restore_latest()`` (checksums verified, loaded into the module) vs
   ``torch.load(weights_only=True)``, both from files evicted from the page cache
   (fsync + ``POSIX_FADV_DONTNEED``; residency checked with mincore).  target: >= 1.0
4. GCS (fake-gcs-server, memory backend): a blocking save to ``gs://`` vs ``torch.save``
   into a buffer + ``fs.pipe`` of it (``--gcs-size-gb``, smaller than the local
   state by default: the emulator holds every object in RAM and loopback uploads run at
   about 80 MiB/s).                                                  target: raw/ours >= 0.8
5. torch.distributed.checkpoint without a process group: ``dcp.save`` (vs torch.save),
   thread-mode ``dcp.async_save`` blocking time (vs the copy), ``dcp.load`` (vs torch.load,
   evicted). Info rows, for comparison with ours.

Prints one table and writes JSON (default benchmarks/results/checkpoint.json).
"""

from __future__ import annotations

import os

# Must be set before anything imports gcsfs (FIELD-NOTES.md: otherwise ~60 s per bucket op).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import argparse  # noqa: E402
import ctypes  # noqa: E402
import ctypes.util  # noqa: E402
import datetime as dt  # noqa: E402
import gc  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import mmap  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from resilient_train.checkpoint.manager import CheckpointManager, CheckpointOptions  # noqa: E402
from resilient_train.checkpoint.retention import RetentionPolicy  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "checkpoint.json"
N_TENSORS = 64
ROW = 1024  # elements per row: each tensor is (rows, 1024) float32

warnings.filterwarnings("ignore", message=".*process group.*")
warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed.*")


# --- the state ---------------------------------------------------------------------------


class Model(torch.nn.Module):
    """64 float32 parameters of equal size: ``size_bytes`` in all."""

    def __init__(self, size_bytes: int, n: int = N_TENSORS) -> None:
        super().__init__()
        rows = max(1, size_bytes // (n * ROW * 4))
        self.layers = torch.nn.ParameterDict({
            f"w{i:02d}": torch.nn.Parameter(torch.rand(rows, ROW), requires_grad=False)
            for i in range(n)})

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


# --- helpers -----------------------------------------------------------------------------


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def files_under(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]


def evict(path: str) -> None:
    """fsync, then drop every file under ``path`` from the page cache."""
    for p in files_under(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_PAGE = mmap.PAGESIZE
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_fraction(path: str) -> float | None:
    """Fraction of the bytes under ``path`` in the page cache (mincore(2)); None if unknown.
    Mapping a file without touching it faults nothing in."""
    total = resident = 0
    for p in files_under(path):
        size = os.path.getsize(p)
        if size == 0:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, _MAP_FAILED):
                return None
            try:
                pages = (size + _PAGE - 1) // _PAGE
                vec = (ctypes.c_ubyte * pages)()
                if _libc.mincore(addr, size, vec) != 0:
                    return None
                resident += sum(b & 1 for b in bytes(vec)) * _PAGE
                total += pages * _PAGE
            finally:
                _libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / total if total else None


def write_raw(path: str, tensors: list[torch.Tensor]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in tensors:
            mv = memoryview(t.detach().numpy()).cast("B")
            while mv:
                n = os.write(fd, mv)
                mv = mv[n:]
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_save_file(path: str, sd: dict[str, torch.Tensor]) -> None:
    with open(path, "wb") as f:
        torch.save(sd, f)
        f.flush()
        os.fsync(f.fileno())


def rm(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


def quiet_manager_logs() -> None:
    logging.getLogger("resilient_train").setLevel(logging.WARNING)


class Results:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.samples: dict[str, list[float]] = {}

    def add(self, op: str, samples: list[float], *, ratio: float | None = None,
            ratio_def: str = "", target: str = "", ok: bool | None = None,
            note: str = "") -> None:
        self.samples[op] = [round(s, 6) for s in samples]
        self.rows.append({"operation": op, "seconds": median(samples), "samples": samples,
                          "ratio": ratio, "ratio_def": ratio_def, "target": target,
                          "pass": ok, "note": note})


# --- 1. async save blocking time vs a bare copy ------------------------------------------


def bench_async(model: Model, root: str, repeats: int, res: Results) -> dict[str, Any]:
    src = [p.detach() for p in model.parameters()]
    dst = [torch.empty_like(t) for t in src]
    for d, s in zip(dst, src):  # touch every page once
        d.copy_(s)

    def copy() -> None:
        for d, s in zip(dst, src):
            d.copy_(s)

    mgr = CheckpointManager(os.path.join(root, "async"),
                            options=CheckpointOptions(async_save=True,
                                                      retention=RetentionPolicy(keep_last=1)))
    mgr.track(model=model)
    copies, blocking, calls, background = [], [], [], []
    step = 0
    for i in range(repeats + 1):  # round 0 is the warm-up
        c = timed(copy)
        step += 1
        t0 = time.perf_counter()
        mgr.save(step)
        call = time.perf_counter() - t0
        b = mgr.last_blocking_s
        bg = timed(mgr.wait)
        if i:
            copies.append(c)
            blocking.append(b)
            calls.append(call)
            background.append(bg)
    mgr.close()
    del dst
    ratio = median(blocking) / median(copies)
    res.add("bare copy into touched buffers", copies, note="baseline for 1")
    res.add("ours: async save, blocking (last_blocking_s)", blocking, ratio=ratio,
            ratio_def="ours/copy", target="<= 1.5", ok=ratio <= 1.5)
    res.add("ours: async save, background write after", background,
            note="info: save() return -> wait() done")
    return {"save_call_s": calls}


# --- 2. sync save vs torch.save and the raw disk -----------------------------------------


def bench_sync(model: Model, root: str, repeats: int, res: Results) -> str:
    """Returns the path of the last torch.save file (kept for the restore benchmark)."""
    sd = model.state_dict()
    tensors = [t.detach() for t in sd.values()]
    mgr = CheckpointManager(os.path.join(root, "sync"),
                            options=CheckpointOptions(async_save=False,
                                                      retention=RetentionPolicy(keep_last=1)))
    mgr.track(model=model)
    ours, tsave, raw = [], [], []
    tpath = os.path.join(root, "torch_save.pt")
    rpath = os.path.join(root, "raw.bin")
    for i in range(repeats + 1):
        rm(tpath)
        rm(rpath)
        o = timed(lambda: mgr.save(i + 1, blocking=True))
        t = timed(lambda: torch_save_file(tpath, sd))
        r = timed(lambda: write_raw(rpath, tensors))
        if i:
            ours.append(o)
            tsave.append(t)
            raw.append(r)
    mgr.close()
    rm(rpath)
    nbytes = model.nbytes
    ratio = median(tsave) / median(ours)
    res.add("ours: sync save, local (commit incl.)", ours, ratio=ratio,
            ratio_def="torch.save/ours", target=">= 1.0", ok=ratio >= 1.0)
    res.add("torch.save + flush + fsync", tsave, note="baseline for 2, 3")
    rr = median(raw) / median(ours)
    res.add("raw os.write + fsync (same bytes)", raw, ratio=rr, ratio_def="raw/ours",
            note=f"info: disk {nbytes / median(raw) / 2**30:.2f} GiB/s; "
                 f"ours {nbytes / median(ours) / 2**30:.2f} GiB/s")
    return tpath


# --- 3. restore vs torch.load ------------------------------------------------------------


def bench_restore(model: Model, root: str, tpath: str, repeats: int,
                  res: Results) -> dict[str, Any]:
    ours_dir = os.path.join(root, "sync")
    mgr = CheckpointManager(ours_dir, options=CheckpointOptions(async_save=False))
    mgr.track(model=model)
    ours, tload, tload_apply = [], [], []
    resid: dict[str, list[float | None]] = {"ours": [], "torch": []}

    def torch_load_apply() -> None:
        model.load_state_dict(torch.load(tpath, map_location="cpu", weights_only=True))

    for i in range(repeats + 1):
        evict(ours_dir)
        resid["ours"].append(resident_fraction(ours_dir))
        o = timed(mgr.restore_latest)
        evict(tpath)
        resid["torch"].append(resident_fraction(tpath))
        t = timed(lambda: torch.load(tpath, map_location="cpu", weights_only=True))
        gc.collect()
        evict(tpath)
        ta = timed(torch_load_apply)
        gc.collect()
        if i:
            ours.append(o)
            tload.append(t)
            tload_apply.append(ta)
    mgr.close()
    known = [r for rs in resid.values() for r in rs if r is not None]
    cached = ("unknown (mincore failed)" if not known else
              f"evicted: max {max(known) * 100:.1f}% resident before reads")
    ratio = median(tload) / median(ours)
    res.add("ours: restore_latest (crc + load_state_dict)", ours, ratio=ratio,
            ratio_def="torch.load/ours", target=">= 1.0", ok=ratio >= 1.0, note=cached)
    res.add("torch.load(weights_only=True)", tload, note="baseline for 3")
    res.add("torch.load + load_state_dict", tload_apply,
            ratio=median(tload_apply) / median(ours), ratio_def="(load+apply)/ours",
            note="info: same work as ours minus crc")
    return {"resident_fraction_before_read": resid}


# --- 4. GCS emulator -----------------------------------------------------------------------


def bench_gcs(size_bytes: int, repeats: int, res: Results, log_dir: str) -> dict[str, Any]:
    sys.path.insert(0, str(REPO / "tests"))
    try:
        import gcs as gcs_helpers  # tests/gcs.py
    finally:
        sys.path.pop(0)
    binary, why = gcs_helpers.emulator_binary()
    if binary is None:
        res.rows.append({"operation": "GCS", "seconds": None, "samples": [], "ratio": None,
                         "ratio_def": "", "target": ">= 0.8", "pass": None,
                         "note": f"skipped: {why}"})
        return {"skipped": why}
    import psutil

    emu = gcs_helpers.start_emulator(binary, Path(log_dir) / "fake-gcs-server.log")
    try:
        bucket = emu.create_bucket("bench-ckpt")
        opts = {"endpoint_url": emu.endpoint, "token": "anon"}
        from gcsfs.core import GCSFileSystem

        fs = GCSFileSystem(**opts, use_listings_cache=False)
        model = Model(size_bytes)
        sd = model.state_dict()
        mgr = CheckpointManager(f"gs://{bucket}/ours",
                                options=CheckpointOptions(async_save=False, storage_options=opts,
                                                          retention=RetentionPolicy(keep_last=1)))
        mgr.track(model=model)
        ours, raw, pipe_only = [], [], []
        peak_rss = 0
        proc = psutil.Process(emu.process.pid)
        for i in range(repeats + 1):
            o = timed(lambda: mgr.save(i + 1, blocking=True))
            peak_rss = max(peak_rss, proc.memory_info().rss)
            path = f"{bucket}/raw/state-{i}.pt"
            t0 = time.perf_counter()
            buf = io.BytesIO()
            torch.save(sd, buf)
            data = buf.getbuffer()
            t1 = time.perf_counter()
            fs.pipe(path, data)
            t2 = time.perf_counter()
            peak_rss = max(peak_rss, proc.memory_info().rss)
            del data
            buf.close()
            fs.rm(path)
            if i:
                ours.append(o)
                raw.append(t2 - t0)
                pipe_only.append(t2 - t1)
        mgr.close()
        nbytes = model.nbytes
        ratio = median(raw) / median(ours)
        res.add(f"ours: sync save to gs:// ({nbytes / 2**30:.2f} GiB)", ours, ratio=ratio,
                ratio_def="raw/ours", target=">= 0.8", ok=ratio >= 0.8,
                note=f"ours {nbytes / median(ours) / 2**20:.0f} MiB/s")
        res.add("torch.save to buffer + gcsfs pipe", raw, note="baseline for 4")
        res.add("  gcsfs pipe only", pipe_only, ratio=median(pipe_only) / median(ours),
                ratio_def="pipe/ours",
                note=f"info: {nbytes / median(pipe_only) / 2**20:.0f} MiB/s")
        return {"size_bytes": nbytes, "emulator_peak_rss_bytes": peak_rss}
    finally:
        emu.stop()


# --- 5. torch.distributed.checkpoint -------------------------------------------------------


def bench_dcp(model: Model, root: str, tpath: str, repeats: int, res: Results,
              ref: dict[str, float]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    sd = model.state_dict()
    d_sync = os.path.join(root, "dcp-sync")
    saves, blocking, background = [], [], []
    for i in range(repeats + 1):
        rm(d_sync)
        s = timed(lambda: dcp.save(sd, checkpoint_id=d_sync))
        d_async = os.path.join(root, f"dcp-async-{i}")
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, checkpoint_id=d_async,
                             async_checkpointer_type=AsyncCheckpointerType.THREAD)
        b = time.perf_counter() - t0
        bg = timed(fut.result)
        rm(d_async)
        if i:
            saves.append(s)
            blocking.append(b)
            background.append(bg)
    res.add("dcp.save (local, no process group)", saves,
            ratio=ref["torch_save"] / median(saves), ratio_def="torch.save/dcp",
            note=f"info; ours/dcp = {ref['ours_sync'] / median(saves):.2f}")
    res.add("dcp.async_save thread, blocking", blocking,
            ratio=median(blocking) / ref["copy"], ratio_def="dcp/copy",
            note=f"info; fresh staging buffers; ours/dcp = "
                 f"{ref['ours_blocking'] / median(blocking):.2f}")
    res.add("dcp.async_save thread, background", background, note="info")

    target = {k: torch.empty_like(v) for k, v in sd.items()}
    loads = []
    for i in range(repeats + 1):
        evict(d_sync)
        t = timed(lambda: dcp.load(target, checkpoint_id=d_sync))
        if i:
            loads.append(t)
    del target
    res.add("dcp.load (evicted, into preallocated)", loads,
            ratio=ref["torch_load"] / median(loads), ratio_def="torch.load/dcp",
            note=f"info; ours/dcp = {ref['ours_restore'] / median(loads):.2f}")
    rm(d_sync)


# --- output --------------------------------------------------------------------------------


def print_table(rows: list[dict[str, Any]]) -> None:
    head = f"{'operation':<47} {'seconds':>8} {'ratio':>7}  {'ratio =':<18} {'target':<7} {'':<4}  note"
    print(head)
    print("-" * len(head))
    for r in rows:
        secs = "-" if r["seconds"] is None else f"{r['seconds']:.3f}"
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
        ok = "" if r["pass"] is None else ("PASS" if r["pass"] else "FAIL")
        print(f"{r['operation']:<47} {secs:>8} {ratio:>7}  {r['ratio_def']:<18} "
              f"{r['target']:<7} {ok:<4}  {r['note']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=1.0, help="local state size (GiB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-gcs", action="store_true")
    ap.add_argument("--gcs-size-gb", type=float, default=0.5,
                    help="state size for the GCS emulator benchmark (GiB)")
    ap.add_argument("--skip-dcp", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--workdir", default=None, help="where checkpoints are written "
                    "(default: a temporary directory, removed afterwards)")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    quiet_manager_logs()
    torch.manual_seed(0)
    t_start = time.perf_counter()
    root = tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.workdir)
    res = Results()
    extra: dict[str, Any] = {}
    phases: dict[str, float] = {}
    try:
        t = time.perf_counter()
        model = Model(int(args.size_gb * 2**30))
        phases["build_state"] = time.perf_counter() - t
        print(f"state: {N_TENSORS} float32 tensors, {model.nbytes / 2**30:.3f} GiB; "
              f"{args.repeats} repeats after a warm-up; workdir {root}", flush=True)

        t = time.perf_counter()
        extra["async"] = bench_async(model, root, args.repeats, res)
        phases["async"] = time.perf_counter() - t
        print(f"  async done ({phases['async']:.0f} s)", flush=True)

        t = time.perf_counter()
        tpath = bench_sync(model, root, args.repeats, res)
        phases["sync"] = time.perf_counter() - t
        print(f"  sync save done ({phases['sync']:.0f} s)", flush=True)

        t = time.perf_counter()
        extra["restore"] = bench_restore(model, root, tpath, args.repeats, res)
        phases["restore"] = time.perf_counter() - t
        print(f"  restore done ({phases['restore']:.0f} s)", flush=True)

        med = {r["operation"]: r["seconds"] for r in res.rows}
        if not args.skip_dcp:
            t = time.perf_counter()
            bench_dcp(model, root, tpath, args.repeats, res, {
                "copy": med["bare copy into touched buffers"],
                "ours_blocking": med["ours: async save, blocking (last_blocking_s)"],
                "torch_save": med["torch.save + flush + fsync"],
                "ours_sync": med["ours: sync save, local (commit incl.)"],
                "torch_load": med["torch.load(weights_only=True)"],
                "ours_restore": med["ours: restore_latest (crc + load_state_dict)"],
            })
            phases["dcp"] = time.perf_counter() - t
            print(f"  dcp done ({phases['dcp']:.0f} s)", flush=True)
        del model
        gc.collect()
        rm(root)
        os.makedirs(root, exist_ok=True)

        if not args.skip_gcs:
            t = time.perf_counter()
            extra["gcs"] = bench_gcs(int(args.gcs_size_gb * 2**30), args.repeats, res, root)
            phases["gcs"] = time.perf_counter() - t
            print(f"  gcs done ({phases['gcs']:.0f} s)", flush=True)
    finally:
        rm(root)
    phases["total"] = time.perf_counter() - t_start

    print()
    print_table(res.rows)
    targets = [r for r in res.rows if r["pass"] is not None]
    print(f"\n{sum(r['pass'] for r in targets)}/{len(targets)} targets met; "
          f"total {phases['total']:.0f} s")

    out = {
        "benchmark": "checkpoint",
        "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "cpus": os.cpu_count(), "platform": platform.platform()},
        "config": {"size_gb": args.size_gb, "gcs_size_gb": None if args.skip_gcs
                   else args.gcs_size_gb, "repeats": args.repeats, "tensors": N_TENSORS,
                   "statistic": "median"},
        "rows": res.rows,
        "extra": extra,
        "phase_seconds": {k: round(v, 2) for k, v in phases.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
