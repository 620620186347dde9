"""The per-step cost of keeping peers' per-rank state, as a fraction of a training step.

    python benchmarks/bench_peers.py [--steps 2000] [--charlm-steps 80] [--out PATH]

Peer recovery (resilient_train/checkpoint/tiers/peers.py) costs every step: this rank's RNG
states and ``ctx.values`` captured and pickled twice (just before the optimizer step, and at
the step's end to see whether they changed), one ring exchange with the neighbours (about
15 KB each way, waited for), a step-end message without waiting, and a sum of the tracked
modules' tensor version counters.

Three measurements, in one run:

1. **The ring alone**, on 2 real processes over gloo on 127.0.0.1: the same training-loop
   calls a step makes (a tracked optimizer's ``step()``, then the manager's step boundary)
   with peer recovery on and off, ``--steps`` times each, interleaved in blocks of 100 so
   that load on this shared machine hits both arms alike. The difference of the means is
   the cost per step; the model is tiny, so nothing else differs.
2. **A step of examples/train_charlm.py**: the example trained by 2 workers under the
   launcher for ``--charlm-steps`` steps with its default sizes; the mean step time from
   the workers' own telemetry (the launcher's goodput record), steps after the first 10.

3. **undo_torn_steps' copy** (opt-in: ``CheckpointOptions(undo_torn_steps=True)``): what
   each step's first optimizer step costs with it, on train_charlm.py's model and AdamW.

Prints them and the ratios, and writes JSON (with the load average) to
benchmarks/results/peers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from meta import stamp  # benchmarks/, on the path as the script's folder

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))


def ring_worker() -> None:
    """One of the two processes (run by ``ring`` below)."""
    import torch
    import torch.distributed as dist

    from resilient_train.checkpoint.manager import CheckpointManager, CheckpointOptions
    from resilient_train.checkpoint.schedule.coordination import TorchDistributed

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    steps, out = int(os.environ["BENCH_STEPS"]), Path(os.environ["BENCH_OUT"])
    coord = TorchDistributed()
    managers, optimizers = {}, {}
    for on in (True, False):
        mgr = CheckpointManager(out / f"ckpt-{on}-{rank}", coordinator=coord,
                                options=CheckpointOptions(peer_recovery=on))
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        mgr.track(model=model, optimizer=opt)
        mgr.values["seen"] = 0
        managers[on], optimizers[on] = mgr, opt
    times: dict[bool, list[float]] = {True: [], False: []}
    done = {True: 0, False: 0}
    for block in range(steps // 100):
        for on in ((True, False) if block % 2 == 0 else (False, True)):
            mgr, opt = managers[on], optimizers[on]
            dist.barrier()
            for _ in range(100):
                t0 = time.perf_counter()
                mgr.values["seen"] += 8          # as a loop would, before the optimizer step
                opt.step()
                done[on] += 1
                mgr.maybe_save(done[on])         # the step boundary (no save: no policy)
                times[on].append(time.perf_counter() - t0)
    for mgr in managers.values():
        mgr.close()
    if rank == 0:
        (out / "ring.json").write_text(json.dumps({str(k): v for k, v in times.items()}))
    dist.destroy_process_group()


def ring(steps: int) -> dict[str, float]:
    from resilient_train.launcher.ports import free_port

    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   WORLD_SIZE="2", BENCH_STEPS=str(steps), BENCH_OUT=tmp,
                   GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([sys.executable, __file__, "--ring-worker"],
                                  env=env | {"RANK": str(r)}) for r in range(2)]
        if any(p.wait(timeout=900) for p in procs):
            raise SystemExit("a ring worker failed")
        times = json.loads((Path(tmp) / "ring.json").read_text())
    on, off = times["True"], times["False"]
    return {"steps": steps, "on_mean_s": statistics.fmean(on),
            "off_mean_s": statistics.fmean(off),
            "on_median_s": statistics.median(on), "off_median_s": statistics.median(off),
            "cost_s": statistics.fmean(on) - statistics.fmean(off)}


def charlm_step(steps: int) -> dict[str, float]:
    sys.path.insert(0, str(REPO))
    from resilient_train.observe.telemetry import read_life

    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job"
        subprocess.run(
            [sys.executable, "-m", "resilient_train.cli.main", "launch", "--workers", "2",
             "--job-dir", str(job), "--", sys.executable,
             str(REPO / "examples" / "train_charlm.py"), "--steps", str(steps)],
            env=dict(os.environ, RESILIENT_TRAIN_QUOTA_DIR=str(Path(tmp) / "quota")),
            cwd=tmp, check=True, stdout=subprocess.DEVNULL, timeout=1800)
        prefix = next((job / "telemetry").rglob("workerpool0-0.restart-0.jsonl"))
        seg = read_life(str(prefix)[: -len(".jsonl")]).segments[0]
    assert seg.t_first is not None and seg.t_last is not None
    # Steps after the first (which includes the DataLoader's start): the steady state.
    per_step = (seg.t_last - seg.t_first) / max(1, seg.last_step - seg.first_step - 1)
    return {"steps": steps, "mean_step_s": per_step}


def undo_copy(repeats: int) -> dict[str, float]:
    """``undo_torn_steps``' copy, taken as each step's first optimizer step begins, on
    examples/train_charlm.py's model at its default sizes, with its AdamW (after one step:
    its moments exist) and its schedule; one thread, as each of the 2 workers has here."""
    import importlib.util

    import torch

    from resilient_train.checkpoint.state.stepwrites import BeforeStep

    spec = importlib.util.spec_from_file_location("train_charlm",
                                                  REPO / "examples" / "train_charlm.py")
    assert spec is not None and spec.loader is not None
    charlm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(charlm)
    torch.set_num_threads(1)
    model = charlm.CharLM(64)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: charlm.lr_at(s, 600))
    model(torch.randint(0, 256, (16, 64))).sum().backward()
    opt.step()
    tracked = {"model": model, "optimizer": opt, "scheduler": sched}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        BeforeStep.take(tracked)
        times.append(time.perf_counter() - t0)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"repeats": repeats, "mean_s": statistics.fmean(times),
            "median_s": statistics.median(times), "param_bytes": nbytes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--charlm-steps", type=int, default=80)
    p.add_argument("--out", type=Path, default=HERE / "results" / "peers.json")
    p.add_argument("--ring-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.ring_worker:
        ring_worker()
        return
    load0 = os.getloadavg()
    r = ring(args.steps)
    c = charlm_step(args.charlm_steps)
    u = undo_copy(max(50, args.steps // 10))
    fraction = r["cost_s"] / c["mean_step_s"]
    undo_fraction = u["mean_s"] / c["mean_step_s"]
    result = {**stamp(), "ring": r, "charlm": c, "cost_fraction_of_charlm_step": fraction,
              "target_fraction": 0.01, "undo_copy": u,
              "undo_copy_fraction_of_charlm_step": undo_fraction,
              "loadavg_start": load0, "loadavg_end": os.getloadavg(), "cpus": os.cpu_count()}
    print(f"ring, per step: on {r['on_mean_s'] * 1e6:.0f} us, off {r['off_mean_s'] * 1e6:.0f} "
          f"us: cost {r['cost_s'] * 1e6:.0f} us")
    print(f"train_charlm.py step (2 workers): {c['mean_step_s'] * 1e3:.1f} ms")
    print(f"cost / step: {fraction:.2%} (target <= 1%); load {load0[0]:.1f} -> "
          f"{result['loadavg_end'][0]:.1f}")
    print(f"undo_torn_steps' copy (opt-in): {u['mean_s'] * 1e3:.2f} ms per step for "
          f"{u['param_bytes'] / 2**20:.1f} MiB of parameters and AdamW's moments: "
          f"{undo_fraction:.1%} of the step")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
