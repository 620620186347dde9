"""GPU checks: CUDA staging of async saves, CUDA RNG, NCCL, ``--gpus-per-worker``, a real
CUDA out-of-memory.

CI has no GPU: every test here skips cleanly without CUDA. On a GPU node run
``python -m pytest -q tests/test_gpu.py`` (``benchmarks/gpu_check.sh`` does that and the
checkpoint benchmark on CUDA state, in one script).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import resilient_train as rt
from resilient_train.checkpoint.state.capture import HostSnapshot
from resilient_train.launcher.ports import free_port

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PY = sys.executable
REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300


def _run(args: list[str], tmp: Path, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=tmp, env={**os.environ, **(env or {})}, text=True,
                          capture_output=True, timeout=TIMEOUT_S, check=False)


def _launch(tmp: Path, *args: str, code: str) -> tuple[int, dict, str]:
    script = tmp / "worker.py"
    script.write_text(textwrap.dedent(code))
    job_dir = tmp / "job"
    proc = _run([PY, "-m", "resilient_train.cli.main", "launch", "--job-dir", str(job_dir),
                 "--timeout", "240s", *args, "--", PY, str(script)], tmp)
    record = json.loads((job_dir / "job.json").read_text())
    return proc.returncode, record, proc.stdout + proc.stderr


def test_snapshot_of_cuda_tensors_lands_in_reused_pinned_buffers() -> None:
    snap = HostSnapshot()
    live = torch.randn(1024, 1024, device="cuda")
    first = snap.snapshot({"w": live})["w"]
    assert first.device.type == "cpu" and first.is_pinned()
    assert torch.equal(first, live.cpu())
    ptr = first.data_ptr()
    live.add_(1.0)  # training goes on: the next snapshot overwrites the same buffer
    second = snap.snapshot({"w": live})["w"]
    assert second.data_ptr() == ptr
    assert torch.equal(second, live.cpu())
    assert snap.nbytes == live.numel() * live.element_size()


def _tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    return []


def _cuda_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(16, 512, device="cuda")).square().mean().backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "blocking"])
def test_a_cuda_model_saves_host_tensors_and_restores_bitwise(tmp_path: Path,
                                                              async_save: bool) -> None:
    torch.manual_seed(0)
    model, opt = _cuda_model()
    saved = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    mgr = rt.CheckpointManager(tmp_path / "ckpt",
                               options=rt.CheckpointOptions(async_save=async_save))
    mgr.track(model=model, optimizer=opt)
    torch.cuda.manual_seed(1234)
    mgr.save(3)
    expected_draw = torch.rand(4, device="cuda")  # the CUDA RNG right after the save
    with torch.no_grad():  # the loop goes on while the writer writes
        for p in model.parameters():
            p.add_(1.0)
    mgr.close()

    # Every file is host tensors: readable with weights_only on a machine without a GPU.
    step_dir = next((tmp_path / "ckpt").glob("step-*"))
    for f in step_dir.glob("*.pt"):
        devices = {t.device.type for t in _tensors(torch.load(f, weights_only=True))}
        assert devices <= {"cpu"}, f"{f.name} holds tensors on {devices}"

    fresh, fresh_opt = _cuda_model()
    mgr2 = rt.CheckpointManager(tmp_path / "ckpt", options=rt.CheckpointOptions())
    mgr2.track(model=fresh, optimizer=fresh_opt)
    assert mgr2.restore_latest() == 3
    mgr2.close()
    for k, v in fresh.state_dict().items():
        assert v.is_cuda
        assert torch.equal(v.cpu(), saved[k]), k
    assert torch.equal(torch.rand(4, device="cuda"), expected_draw)  # CUDA RNG restored


def test_nccl_group_forms_all_reduces_and_shuts_down(tmp_path: Path) -> None:
    code = """
        import json, torch, torch.distributed as dist
        import resilient_train as rt
        group = rt.init_distributed(rt.DistributedOptions(join_timeout_s=60))
        t = torch.ones(4, device=group.device) * (group.rank + 1)
        dist.all_reduce(t)
        torch.cuda.synchronize()
        print(json.dumps({"backend": group.backend, "device": str(group.device),
                          "sum": t.tolist()}), flush=True)
        group.shutdown()
        print(json.dumps({"initialized": dist.is_initialized()}), flush=True)
    """
    script = tmp_path / "nccl_form.py"
    script.write_text(textwrap.dedent(code))
    port = free_port()
    proc = _run([PY, str(script)], tmp_path, {
        "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines[0] == {"backend": "nccl", "device": "cuda:0", "sum": [1.0] * 4}
    assert lines[1] == {"initialized": False}


def test_gpus_per_worker_gives_each_replica_its_own_device(tmp_path: Path) -> None:
    code = """
        import os, torch
        print("VISIBLE", os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count())
    """
    status, rec, out = _launch(tmp_path, "--workers", "1", "--gpus-per-worker", "1", code=code)
    assert (status, rec["state"]) == (0, "JOB_STATE_SUCCEEDED"), out
    line = next(x for x in out.splitlines() if "VISIBLE" in x)
    visible, count = line.split("VISIBLE", 1)[1].split()
    assert count == "1" and visible.isdigit()


def test_more_gpus_than_the_machine_has_is_a_stockout(tmp_path: Path) -> None:
    too_many = str(torch.cuda.device_count() + 1)
    _, rec, out = _launch(tmp_path, "--workers", "1", "--gpus-per-worker", too_many,
                          code="print('never runs')\n")
    assert rec["state"] == "JOB_STATE_FAILED", out
    assert rec["error"]["message"].startswith("Resources are insufficient in region")
    assert "never runs" not in out


def test_a_real_cuda_oom_fails_the_job_as_out_of_memory(tmp_path: Path) -> None:
    code = """
        import torch
        import resilient_train as rt

        @rt.main()
        def train(ctx: rt.Context) -> None:
            free, total = torch.cuda.mem_get_info()
            torch.empty(int(total * 2), dtype=torch.uint8, device=ctx.device)

        train()
    """
    status, rec, out = _launch(tmp_path, "--workers", "1", "--gpus-per-worker", "1", code=code)
    assert (status, rec["state"]) == (137, "JOB_STATE_FAILED"), out
    first, *excerpt = rec["error"]["message"].splitlines()
    assert first.startswith("The replica workerpool0-0 ran out of memory")
    assert "CUDA out of memory" in excerpt[-1]
    assert len(rec["attempts"]) == 1
