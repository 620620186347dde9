"""Parallel streams to gs://: checkpoint save and restore throughput by streams per file.

    python benchmarks/bench_gcs_streams.py [--size-mib 512] [--streams 1,2,4,8]
                                           [--part-mib 32] [--repeats 3] [--out PATH]
                                           [--url gs://BUCKET/PREFIX]

Against fake-gcs-server started as the tests start it (tests/gcs.py: plain HTTP on
127.0.0.1, memory backend), a ``CheckpointManager`` saves (``save(step, blocking=True)``,
commit included) and restores (``restore_latest()`` into a second model, checksums
verified) a checkpoint-like state: a model of 64 float32 tensors, ``--size-mib`` in all,
so a step is one large ``shared.pt``, a small rank file, the manifest and the marker.
Each contender differs only in the storage option ``"transfer"``
(``TransferOptions(streams, part_bytes)``):

* ``1 stream`` is the path without parallel streams (``streams=1``): the file is spooled
  to ``TMPDIR`` and uploaded with one gcsfs ``put_file`` (a resumable upload in 50 MiB
  chunks); a restore reads 8 MiB ranges one at a time. The baseline of the ratios.
* ``1 stream, parts`` (``--no-shape`` drops it) is the parallel code path with one
  stream: parts of ``--part-mib`` uploaded one at a time, then composed. It separates
  what the upload's shape gains from what parallelism gains: fake-gcs-server spends CPU
  on a resumable upload of many chunks that grows faster than the object (1.2x the part
  upload's at 256 MiB, 1.8x at 512 MiB here), which tells nothing about real GCS, so
  compare the parallel rows with this one too.
* ``N streams`` cuts the stream into parts of ``--part-mib`` that upload N at a time and
  are composed server-side, and reads N ranges of ``read_part_bytes`` (the default, 8
  MiB) at a time. Every restore of the library reads a file into one buffer and loads
  the tensors as views of it.
* ``by hand`` (``--no-hand-written`` drops it) is what a user writes without this library:
  ``torch.save`` into a gcsfs file opened for writing, ``torch.load`` from one opened for
  reading, then ``load_state_dict``; no manifest, checksum or commit. Column ``xh``.

Every round runs every contender once, in a rotated order, after a warm-up round that is
dropped; between contenders the checkpoint is deleted, so the emulator (which keeps every
object in memory, and about 10 times its size in its heap while uploads and composes run)
holds one checkpoint at a time. The table shows medians, MiB/s of the state's size, and the
ratio to one stream: of the medians, and the median of the per-round ratios (less
sensitive to other processes' load drifting across rounds). The emulator's and this
process's CPU seconds per operation are recorded too. Prints one table and writes JSON
(default benchmarks/results/gcs_streams.json).

``--url gs://BUCKET/PREFIX`` runs the same against a real bucket (credentials as gcsfs
finds them; everything written under PREFIX is deleted): the way to pick
``TransferOptions`` for a VM, a region and a machine type.

What bounds it on this machine
    Two cores, shared with other processes (the load average is recorded: it swings the
    absolute numbers by 2x between runs), and on them the emulator's own CPU:
    fake-gcs-server spends about 8-10 ms of CPU per MiB it receives as parts (it hashes
    each upload with MD5 and CRC32C and copies it into its memory backend; a compose
    copies the parts once more; 15 ms with put_file's chunks), so a save cannot go faster
    than the emulator's share of the cores allows, however many streams run. Restores
    cost the emulator little; there the client's CPU is the limit: its single gcsfs event
    loop (one Python thread that reads every stream's bytes), the checksum and torch.load,
    so ranged reads have nothing to overlap. Loopback has no round-trip time and no
    per-connection cap, which is what parallel streams hide against real GCS (one stream
    there is bounded by RTT x window and by per-stream server throughput), so the gains
    here are a floor, not what a VM in the bucket's region sees.
"""

from __future__ import annotations

import os

# Must be set before anything imports gcsfs (docs/libraries.md, "gcsfs against a local GCS
# emulator").
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import argparse
import contextlib
import gc
import json
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from meta import stamp  # benchmarks/, on the path as the script's folder

from resilient_train.checkpoint.commit.retention import RetentionPolicy
from resilient_train.checkpoint.manager import CheckpointManager, CheckpointOptions
from resilient_train.checkpoint.storage import base as storage_mod
from resilient_train.checkpoint.storage.gcs import DEFAULT_GCS_TRANSFER, GcsStorage

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "gcs_streams.json"
N_TENSORS = 64
ROW = 1024


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


class UploadLog(logging.Handler):
    """The storage's "uploaded ..." debug lines: parts and peak buffers per file."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.uploads: list[tuple[Any, ...]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("uploaded ") and isinstance(record.args, tuple):
            self.uploads.append(record.args)


class OneStreamParts(GcsStorage):
    """The part upload with one stream (``streams=1`` otherwise means one put_file)."""

    def _parallel_writes(self) -> bool:
        return True


@contextlib.contextmanager
def gs_backend(cls: type[GcsStorage] | None) -> Iterator[None]:
    """Storage("gs://...") is a ``cls`` inside the block (None: the usual GcsStorage)."""
    if cls is None:
        yield
        return
    storage_mod.register_backend("gs", cls)
    try:
        yield
    finally:
        storage_mod._REGISTERED.pop("gs", None)


def blank(target: Model) -> None:
    """Zeros in the restore's target, so that a restore that loads nothing fails the check."""
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()


def by_hand(url: str, options: dict[str, Any], model: Model, target: Model, step: int,
            emu_proc: Any, me: Any) -> tuple[float, float, float, float, float, float, int]:
    """What a user writes without this library: torch.save into a gcsfs file opened for
    writing (one resumable upload), torch.load from one opened for reading (gcsfs's
    read-ahead in blocks). No manifest, checksum or commit. The same timings as the
    manager's rows: save s, emulator and client CPU s, then the same for the restore."""
    fs = storage_mod.Storage(url, storage_options=options).fs
    path = f"{url.removeprefix('gs://')}/model-{step}.pt"
    e0, c0, t0 = cpu_s(emu_proc), cpu_s(me), time.perf_counter()
    with fs.open(path, "wb") as f:
        torch.save(model.state_dict(), f)
    saved = (time.perf_counter() - t0, cpu_s(emu_proc) - e0, cpu_s(me) - c0)
    blank(target)
    gc.collect()
    e0, c0, t0 = cpu_s(emu_proc), cpu_s(me), time.perf_counter()
    with fs.open(path, "rb") as f:
        target.load_state_dict(torch.load(f, map_location="cpu", weights_only=True))
    restored = (time.perf_counter() - t0, cpu_s(emu_proc) - e0, cpu_s(me) - c0)
    return (*saved, *restored, step)


def cpu_s(proc: Any) -> float:
    """CPU seconds of a process so far (0 where there is none: a real bucket)."""
    if proc is None:
        return 0.0
    t = proc.cpu_times()
    return float(t.user + t.system)


def rss(proc: Any) -> int:
    return 0 if proc is None else int(proc.memory_info().rss)


HAND_WRITTEN = "by hand: torch.save/load on gcsfs open()"


def contender_name(streams: int, part_mib: int, shape: bool) -> str:
    if streams == 0:
        return HAND_WRITTEN
    if shape:
        return f"1 stream, {part_mib} MiB parts + compose"
    return "1 stream (put_file; 1 read at a time)" if streams == 1 else \
        f"{streams} streams, {part_mib} MiB parts"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=512, help="state size (MiB)")
    ap.add_argument("--streams", default="1,2,4,8", help="comma-separated stream counts")
    ap.add_argument("--part-mib", default="32",
                    help="comma-separated part sizes (MiB) for the parallel contenders")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-shape", action="store_true",
                    help="leave out the one-stream part upload (see the docstring)")
    ap.add_argument("--no-hand-written", action="store_true",
                    help="leave out torch.save/torch.load on a gcsfs file (the docstring)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--url", default=None,
                    help="a real gs://BUCKET/PREFIX instead of the emulator (deleted after)")
    args = ap.parse_args()
    streams_list = sorted({int(s) for s in args.streams.split(",") if s.strip()})
    parts_list = [int(p) for p in args.part_mib.split(",") if p.strip()]
    if args.repeats < 1 or 1 not in streams_list or not parts_list:
        ap.error("--repeats >= 1, --streams must include 1 (the baseline), --part-mib a list")

    sys.path.insert(0, str(REPO / "tests"))
    try:
        import gcs as gcs_helpers  # tests/gcs.py: the emulator as the tests start it
    finally:
        sys.path.pop(0)
    import psutil

    binary, why = gcs_helpers.emulator_binary()
    if binary is None and args.url is None:
        print(f"skipped: {why}")
        return 1
    logging.getLogger("resilient_train").setLevel(logging.WARNING)
    uploads = UploadLog()
    fs_log = logging.getLogger("resilient_train.checkpoint.storage.objectstore")
    fs_log.setLevel(logging.DEBUG)
    fs_log.addHandler(uploads)
    fs_log.propagate = False

    contenders: list[tuple[str, int, int, bool]] = []   # name, streams, part MiB, shape
    for s in streams_list:
        for p in ([parts_list[0]] if s == 1 else parts_list):
            contenders.append((contender_name(s, p, False), s, p, False))
        if s == 1 and not args.no_shape:
            for p in parts_list:
                contenders.append((contender_name(1, p, True), 1, p, True))
    if not args.no_hand_written:   # what a user writes without us: streams 0 marks it
        contenders.append((HAND_WRITTEN, 0, 0, False))

    torch.manual_seed(0)
    model = Model(args.size_mib << 20)
    target = Model(args.size_mib << 20)
    nbytes = model.nbytes
    emu = None
    if args.url is None:
        assert binary is not None
        workdir = tempfile.mkdtemp(prefix="bench-gcs-streams-")
        emu = gcs_helpers.start_emulator(binary, Path(workdir) / "fake-gcs-server.log")
    emu_proc = psutil.Process(emu.process.pid) if emu is not None else None
    me = psutil.Process()
    loads: dict[str, float] = {"start": os.getloadavg()[0]}
    samples: dict[str, dict[str, list[float]]] = {
        name: {k: [] for k in ("save", "restore", "save_emu_cpu", "save_client_cpu",
                               "restore_emu_cpu", "restore_client_cpu")}
        for name, *_ in contenders}
    shape: dict[str, dict[str, Any]] = {}
    peak_rss = 0
    t_start = time.perf_counter()
    print(f"state: {N_TENSORS} float32 tensors, {nbytes / 2**20:.0f} MiB; contenders: "
          f"{', '.join(c[0] for c in contenders)}; {args.repeats} rounds after a warm-up",
          flush=True)
    try:
        if emu is not None:
            root = f"gs://{emu.create_bucket('bench-streams')}"
            base_opts: dict[str, Any] = {"endpoint_url": emu.endpoint, "token": "anon"}
        else:
            root, base_opts = args.url.rstrip("/"), {}
        step = 0
        for rnd in range(args.repeats + 1):
            k = rnd % len(contenders)
            for name, streams, part_mib, only_shape in contenders[k:] + contenders[:k]:
                step += 1
                url = f"{root}/r{rnd}-s{streams}-p{part_mib}{'-shape' * only_shape}"
                if streams == 0:
                    t_save, e_save, c_save, t_restore, e_rest, c_rest, got = by_hand(
                        url, base_opts, model, target, step, emu_proc, me)
                    big = None
                else:
                    opts = CheckpointOptions(
                        async_save=False, retention=RetentionPolicy(keep_last=1),
                        storage_options={**base_opts, "transfer": {
                            "streams": streams, "read_streams": streams,
                            "part_bytes": part_mib << 20}})
                    with gs_backend(OneStreamParts if only_shape else None):
                        saver = CheckpointManager(url, options=opts)
                    saver.track(model=model)
                    uploads.uploads.clear()
                    e0, c0, t0 = cpu_s(emu_proc), cpu_s(me), time.perf_counter()
                    saver.save(step, blocking=True)
                    t_save = time.perf_counter() - t0
                    e_save, c_save = cpu_s(emu_proc) - e0, cpu_s(me) - c0
                    peak_rss = max(peak_rss, rss(emu_proc))
                    big = max(uploads.uploads, key=lambda a: a[1], default=None)
                    saver.close()

                    restorer = CheckpointManager(url, options=opts)
                    restorer.track(model=target)
                    blank(target)
                    gc.collect()
                    e0, c0, t0 = cpu_s(emu_proc), cpu_s(me), time.perf_counter()
                    got = restorer.restore_latest()
                    t_restore = time.perf_counter() - t0
                    e_rest, c_rest = cpu_s(emu_proc) - e0, cpu_s(me) - c0
                    peak_rss = max(peak_rss, rss(emu_proc))
                    restorer.close()
                if got != step or not all(torch.equal(a, b) for a, b in
                                          zip(model.parameters(), target.parameters())):
                    raise SystemExit(f"{name}: restored step {got}, not the bytes saved")
                gone = storage_mod.Storage(url, storage_options=base_opts)
                gone.fs.rm(gone.root, recursive=True)
                gc.collect()
                if rnd:
                    mine = samples[name]
                    mine["save"].append(t_save)
                    mine["restore"].append(t_restore)
                    mine["save_emu_cpu"].append(e_save)
                    mine["save_client_cpu"].append(c_save)
                    mine["restore_emu_cpu"].append(e_rest)
                    mine["restore_client_cpu"].append(c_rest)
                if big is not None:   # (url, bytes, parts, streams, peak buffers, seconds)
                    shape[name] = {"largest_file_bytes": big[1], "parts": big[2],
                                   "peak_part_buffers": big[4]}
                print(f"  round {rnd}{' (warm-up)' if not rnd else ''} {name}: save "
                      f"{t_save:.2f} s, restore {t_restore:.2f} s", flush=True)
            loads[f"round_{rnd}"] = os.getloadavg()[0]
    finally:
        if emu is not None:
            emu.stop()
        fs_log.removeHandler(uploads)

    base = samples[contenders[0][0]]
    shaped = next((samples[c[0]] for c in contenders if c[3]), None)
    hand = samples.get(HAND_WRITTEN)
    rows = []
    for name, streams, part_mib, only_shape in contenders:
        mine = samples[name]
        row: dict[str, Any] = {"contender": name, "streams": streams,
                               "part_bytes": part_mib << 20 if streams > 1 or only_shape
                               else None, "parts_path": streams > 1 or only_shape,
                               **shape.get(name, {})}
        if streams:
            row["read_part_bytes"] = DEFAULT_GCS_TRANSFER.read_part_bytes if streams > 1 \
                else None
        for op in ("save", "restore"):
            med = statistics.median(mine[op])
            row[op] = {
                "samples_s": [round(x, 4) for x in mine[op]], "median_s": med,
                "mib_s": nbytes / med / 2**20,
                "ratio_vs_1": statistics.median(base[op]) / med,
                "ratio_vs_1_paired": statistics.median(
                    [b / x for b, x in zip(base[op], mine[op])]),
                "emulator_cpu_s": statistics.median(mine[f"{op}_emu_cpu"]),
                "client_cpu_s": statistics.median(mine[f"{op}_client_cpu"]),
            }
            if hand is not None:   # against what a user writes without the library
                row[op]["ratio_vs_hand"] = statistics.median(hand[op]) / med
            if shaped is not None:   # against the one-stream part upload: parallelism alone
                row[op]["ratio_vs_1_parts"] = statistics.median(shaped[op]) / med
                row[op]["ratio_vs_1_parts_paired"] = statistics.median(
                    [b / x for b, x in zip(shaped[op], mine[op])])
        rows.append(row)
    loads["end"] = os.getloadavg()[0]
    total = time.perf_counter() - t_start
    print_table(rows, nbytes)
    print(f"\ntotal {total:.0f} s; emulator peak RSS {peak_rss / 2**30:.1f} GiB; 1-min load "
          "average " + ", ".join(f"{k} {v:.1f}" for k, v in loads.items()))
    if max(loads.values()) > 1.5:
        print("warning: other processes were busy during the run (2 cores here): absolute "
              "MiB/s are deflated; the per-round ratios are the more robust numbers")
    out = {
        "benchmark": "gcs_streams",
        **stamp(),
        "config": {"size_bytes": nbytes, "streams": streams_list,
                   "part_bytes": [p << 20 for p in parts_list], "repeats": args.repeats,
                   "tensors": N_TENSORS, "statistic": "median",
                   "store": args.url or "fake-gcs-server, memory backend, 127.0.0.1"},
        "default": {"streams": DEFAULT_GCS_TRANSFER.streams,
                    "read_streams": DEFAULT_GCS_TRANSFER.read_streams,
                    "part_bytes": DEFAULT_GCS_TRANSFER.part_bytes,
                    "read_part_bytes": DEFAULT_GCS_TRANSFER.read_part_bytes},
        "rows": rows,
        "emulator_peak_rss_bytes": peak_rss,
        "seconds": round(total, 1),
        "load_average_1min": {k: round(v, 2) for k, v in loads.items()},
        "bound": ("2 cores shared with other processes; the emulator's CPU per MiB written "
                  "(MD5 + CRC32C + copies) bounds saves, the client's CPU (one gcsfs event "
                  "loop, first-touch of the restore's buffer, checksum) bounds restores; "
                  "loopback has no RTT or per-stream cap, which parallel streams hide on "
                  "GCS"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def print_table(rows: list[dict[str, Any]], nbytes: int) -> None:
    parts = "ratio_vs_1_parts" in rows[0]["save"]
    print(f"\n{nbytes / 2**20:.0f} MiB checkpoint, medians. x1 = the one-stream put_file "
          "path's time / this one's (above 1: faster); /rnd = median of the per-round "
          "ratios; xh = the hand-written restore's time / this one's"
          + ("; x1p = the same against the one-stream part upload" if parts else ""))
    head = (f"{'contender':<38} {'save s':>7} {'MiB/s':>6} {'x1':>5} {'/rnd':>5} "
            + (f"{'x1p':>5} " if parts else "")
            + f" {'restore s':>9} {'MiB/s':>6} {'x1':>5} {'/rnd':>5} {'xh':>5}  {'emu cpu':>7} "
            f"{'parts':>5} {'bufs':>4}")
    print(head)
    print("-" * len(head))
    for r in rows:
        sv, rs = r["save"], r["restore"]
        print(f"{r['contender']:<38} {sv['median_s']:>7.2f} {sv['mib_s']:>6.0f} "
              f"{sv['ratio_vs_1']:>5.2f} {sv['ratio_vs_1_paired']:>5.2f} "
              + (f"{sv['ratio_vs_1_parts']:>5.2f} " if parts else "")
              + f" {rs['median_s']:>9.2f} {rs['mib_s']:>6.0f} {rs['ratio_vs_1']:>5.2f} "
              f"{rs['ratio_vs_1_paired']:>5.2f} {rs.get('ratio_vs_hand', float('nan')):>5.2f}  "
              f"{sv['emulator_cpu_s']:>7.2f} "
              f"{r.get('parts', '-'):>5} {r.get('peak_part_buffers', '-'):>4}")


if __name__ == "__main__":
    sys.exit(main())
