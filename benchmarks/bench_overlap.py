"""The overlapped snapshot against the blocking copy: how long an async save blocks the loop.

    python benchmarks/bench_overlap.py [--saves 6] [--state-mb 512] [--out PATH]

An async save copies the training state into host buffers and writes them in the
background. With ``CheckpointOptions(overlap_snapshot=False)`` the loop is blocked for the
whole copy; with overlap (the default) the parameters and optimizer state are copied by a
thread while the next step's forward and backward run, and only the next optimizer step
waits for what is left (CheckFreq's pipelined snapshot). What the loop loses to a save is
then: the time in ``save()`` plus the extra time of the step that follows it, against a
step without a save before it. Measured in one run, both ways, on:

- **synthetic**: Linear layers holding ``--state-mb`` of parameters and Adam moments (a
  third each), a batch large enough that forward and backward take longer than the copy;
- **charlm**: examples/train_charlm.py's model and optimizer at its default sizes (a few
  MB of state: the copy is short next to its step).

The loop is *blocked* by a save for the time in ``save()`` plus what the next optimizer
step waits for the copy (timed by hooks around the manager's own), the mean over
``--saves`` saves. On this 2-core machine the background copy and the step's compute share
the cores (memory bandwidth, mostly), so the step that overlaps the copy runs slower
without being blocked: its median time is reported beside a step with nothing in flight.
Writes JSON (with the load average) to benchmarks/results/overlap.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from meta import stamp  # noqa: E402 - benchmarks/, on the path as the script's folder

import resilient_train as rt  # noqa: E402 - from this checkout, after the path is set


def synthetic(state_mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer,
                                      Callable[[], None]]:
    # Parameters are a third of the state (Adam keeps two moments of the same size).
    params = state_mb * (1 << 20) // 3 // 4
    width = 2048
    depth = max(1, params // (width * width))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(1024, width)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step


def charlm() -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    sys.path.insert(0, str(REPO / "examples"))
    import train_charlm as ex

    torch.manual_seed(0)
    model = ex.CharLM(64)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = ex.load_corpus()
    data = ex.Windows(tokens, 64)
    x, y = (torch.stack(t) for t in zip(*(data[i] for i in range(16))))

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step


def measure(build: Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer,
                                      Callable[[], None]]],
            overlap: bool, saves: int) -> dict[str, float]:
    """The loop's time blocked per save: in ``save()``, plus what the next optimizer step
    waited for the copy (timed between two hooks around the manager's own), and the next
    step's time against a step with nothing in flight (the copy's contention included)."""
    model, opt, step = build()
    marks: dict[str, float] = {}
    opt.register_step_pre_hook(lambda *_: marks.__setitem__("before", time.perf_counter()))
    with tempfile.TemporaryDirectory() as tmp:
        mgr = rt.CheckpointManager(tmp, options=rt.CheckpointOptions(
            async_save=True, overlap_snapshot=overlap,
            retention=rt.RetentionPolicy(keep_last=1)))
        mgr.track(model=model, optimizer=opt)   # the manager's hook: waits for the copy
        opt.register_step_pre_hook(lambda *_: marks.__setitem__("after", time.perf_counter()))
        for _ in range(3):
            step()                                   # warm up; optimizer state exists
        plain: list[float] = []
        in_save: list[float] = []
        waited: list[float] = []
        next_step: list[float] = []
        for n in range(saves):
            for _ in range(2):                       # steps with nothing in flight
                t0 = time.perf_counter()
                step()
                plain.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            mgr.save(n + 1)
            in_save.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            step()                                   # overlaps the copy (or not)
            next_step.append(time.perf_counter() - t0)
            waited.append(marks["after"] - marks["before"])
            mgr.wait()                               # the write: not the loop's cost here
        mgr.close()
    return {"step_s": statistics.median(plain),
            "next_step_s": statistics.median(next_step),
            "in_save_s": statistics.fmean(in_save),
            "optimizer_waited_s": statistics.fmean(waited),
            "blocked_s": statistics.fmean(in_save) + statistics.fmean(waited),
            "state_bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values())
            + sum(v.numel() * v.element_size() for st in opt.state.values()
                  for v in st.values() if isinstance(v, torch.Tensor))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--saves", type=int, default=6)
    p.add_argument("--state-mb", type=int, default=512)
    p.add_argument("--out", type=Path, default=HERE / "results" / "overlap.json")
    args = p.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    load0 = os.getloadavg()
    result: dict[str, object] = {**stamp(), "cpus": os.cpu_count(), "loadavg_start": load0}
    for name, build in (("synthetic", lambda: synthetic(args.state_mb)), ("charlm", charlm)):
        blocking = measure(build, False, args.saves)
        overlapped = measure(build, True, args.saves)
        ratio = overlapped["blocked_s"] / blocking["blocked_s"]
        result[name] = {"blocking": blocking, "overlapped": overlapped, "ratio": ratio}
        print(f"{name}: state {blocking['state_bytes'] / 2**20:.0f} MiB, step "
              f"{blocking['step_s'] * 1e3:.0f} ms; loop blocked per save: blocking copy "
              f"{blocking['blocked_s'] * 1e3:.1f} ms, overlapped "
              f"{overlapped['blocked_s'] * 1e3:.1f} ms ({ratio:.2f}x; target <= 0.2x where "
              f"the step is longer than the copy); the step after the save "
              f"{overlapped['next_step_s'] * 1e3:.0f} ms overlapped, "
              f"{blocking['next_step_s'] * 1e3:.0f} ms not", flush=True)
    result["loadavg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
