"""CheckpointManager across real processes: 2 ranks on gloo (127.0.0.1, GLOO_SOCKET_IFNAME=lo).

Each scenario runs tests/dist_workers/ckpt_worker.py's ``entry`` once per rank, in processes
forked from a ``forkserver`` that imported torch once (a fresh port per launch, explicit
timeouts); a restore after a restart is a second launch.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import sys
import time
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest
import torch

from resilient_train.checkpoint.commit.directory import read_manifest, scan, verify_step
from resilient_train.checkpoint.storage.base import Storage

WORKERS = Path(__file__).parent / "dist_workers"
LAUNCH_TIMEOUT_S = 90.0

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not available")

if str(WORKERS) not in sys.path:
    sys.path.insert(0, str(WORKERS))  # the forkserver gets sys.path and imports the worker
import ckpt_worker

_ctx = multiprocessing.get_context("forkserver")
# Imported once in the server, shared by every rank forked from it (torch._dynamo: what
# an optimizer's first use imports, 1.5-2 CPU-seconds a rank otherwise).
_ctx.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed.checkpoint",
                             "torch.distributed.fsdp", "ckpt_worker"])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(scenario: str, world: int, ckpt: Path | str, out: Path,
          extra_env: dict[str, str] | None = None) -> list[BaseProcess]:
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs: list[BaseProcess] = []
    for rank in range(world):
        env = dict(RANK=str(rank), WORLD_SIZE=str(world), MASTER_PORT=str(port),
                   GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
                   WORKER_TIMEOUT_S=str(int(LAUNCH_TIMEOUT_S)), **(extra_env or {}))
        p = _ctx.Process(target=ckpt_worker.entry, args=(scenario, str(ckpt), str(out), env),
                         name=f"{scenario}-rank{rank}")
        p.start()
        procs.append(p)
    return procs


def logs(out: Path, scenario: str, world: int) -> str:
    parts = []
    for rank in range(world):
        path = out / f"{scenario}.rank{rank}.log"
        text = path.read_text(errors="replace") if path.exists() else "(no log)"
        parts.append(f"--- rank {rank} ---\n{text[-6000:]}")
    return "\n".join(parts)


def wait(procs: list[BaseProcess], scenario: str, out: Path,
         timeout: float = LAUNCH_TIMEOUT_S) -> list[int | None]:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        if any(p.exitcode is None for p in procs):
            pytest.fail(f"{scenario}: ranks still running after {timeout:.0f}s\n"
                        + logs(out, scenario, len(procs)))
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
                p.join()
    return [p.exitcode for p in procs]


def run(scenario: str, world: int, ckpt: Path | str, out: Path,
        expect: list[int] | None = None,
        extra_env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    codes = wait(start(scenario, world, ckpt, out, extra_env), scenario, out)
    want = expect if expect is not None else [0] * world
    assert codes == want, f"{scenario}: exit codes {codes}, expected {want}\n" + logs(
        out, scenario, world)
    return results(out, scenario, world)


def results(out: Path, scenario: str, world: int) -> list[dict[str, Any]]:
    return [torch.load(out / f"{scenario}.rank{r}.pt", weights_only=True) for r in range(world)]


def bitwise_equal(a: Any, b: Any) -> bool:
    """Same structure and the same bits in every tensor (NaN- and -0.0-proof)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            bitwise_equal(a[k], b[k]) for k in a)
    return bool(a == b)


def step_dir(ckpt: Path, step: int) -> Path:
    return ckpt / f"step-{step:012d}"


def manifest_of(ckpt: Path, step: int) -> dict[str, Any]:
    return json.loads((step_dir(ckpt, step) / "manifest.json").read_text())


def assert_verifies(ckpt: Path, step: int) -> None:
    storage = Storage(str(ckpt))
    info = next(i for i in scan(storage) if i.step == step)
    checked = verify_step(storage, info)
    assert checked.ok, checked.problems


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    path.write_bytes(bytes(data))


def test_one_ranks_full_node_local_disk_sends_every_ranks_saves_to_storage(
        tmp_path: Path) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    run("local_tier_full", 2, ckpt, out)
    committed = sorted(int(d.name.split("-")[1]) for d in ckpt.glob("step-*")
                       if (d / "COMMITTED").exists())
    # Step 1 is decided before rank 1's failure; 2-4 go to storage (4's node-local write
    # works again), then the 5th save after 4.
    assert committed == [2, 3, 4, 9], committed
    text = logs(out, "local_tier_full", 2)
    assert "node-local checkpoint of step 1 in" in text and \
        "every save goes to storage too" in text, text
    assert "node-local checkpoint of step 4 in" in text and "after 3 failed save(s)" in text


def test_replicated_layout_two_ranks(tmp_path: Path) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    saved = run("replicated_save", 2, ckpt, out)
    assert [s["step"] for s in saved] == [3, 3]

    m = manifest_of(ckpt, 3)
    assert m["layout"] == "replicated" and m["world_size"] == 2
    assert set(m["files"]) == {"shared.pt", "rank-00000.pt", "rank-00001.pt"}
    assert sorted(os.listdir(step_dir(ckpt, 3))) == sorted(
        ["COMMITTED", "manifest.json", "shared.pt", "rank-00000.pt", "rank-00001.pt"])
    assert_verifies(ckpt, 3)

    restored = run("replicated_restore", 2, ckpt, out)
    for rank, (s, r) in enumerate(zip(saved, restored)):
        assert r["step"] == 3
        assert bitwise_equal(r["weights"], s["weights"]), f"rank {rank}: weights differ"
        assert r["values"] == s["values"] == {"position": 1000 * rank + 3}
        assert bitwise_equal(r["rng_after"], s["rng_after"]), f"rank {rank}: RNG stream differs"
        assert r["opt_steps"] and set(r["opt_steps"]) == {3}
    assert bitwise_equal(restored[0]["weights"], restored[1]["weights"])
    # Each rank got its own stream back, not rank 0's.
    assert not bitwise_equal(restored[0]["rng_after"], restored[1]["rng_after"])


def test_a_replicated_step_resumes_with_fewer_or_more_ranks_and_says_so(
        tmp_path: Path) -> None:
    """A job resubmitted with another replica count resumes from the same step: the
    weights are every rank's; a rank the step had no file for takes rank 0's values, and a
    rank the job no longer has is named, since its RNG streams and values go nowhere."""
    for saved_by, restored_by in ((3, 2), (2, 3)):
        ckpt, out = tmp_path / f"ckpt{saved_by}", tmp_path / f"out{saved_by}"
        saved = run("replicated_save", saved_by, ckpt, out)
        restored = run("replicated_restore", restored_by, ckpt, out)
        for r in restored:
            assert r["step"] == 3
            assert bitwise_equal(r["weights"], saved[0]["weights"])
        assert [r["values"]["position"] for r in restored] == [3, 1003, 3][:restored_by]
        text = logs(out, "replicated_restore", restored_by)
        dropped = ("checkpoint step 3 was written by 3 ranks and this job has 2: the RNG "
                   "states and values of rank 2 are not used")
        missing = ("checkpoint step 3 was written by 2 ranks and has no file for rank 2: its "
                   "RNG state stays as it is and the values of rank 0 are used")
        assert (dropped in text) == (saved_by == 3), text
        assert (missing in text) == (saved_by == 2), text


def test_a_full_disk_on_one_rank_fails_the_save_on_both_and_cleans_up(tmp_path: Path) -> None:
    """Rank 1 runs out of space writing its file: it reports to the primary instead of
    leaving it waiting in the gather, both raise the no-space error, the primary removes
    the partial step, step 1 stays committed, and the next save commits."""
    ckpt = tmp_path / "ckpt"
    r0, r1 = run("full_disk", 2, ckpt, tmp_path / "out")
    assert r0["error"].startswith("CheckpointStorageFullError: checkpoint step 2 was not "
                                  "saved: no space left in"), r0["error"]
    assert "(rank 1 writing " in r0["error"] and "rank-00001.pt)" in r0["error"], r0["error"]
    assert r1["error"].startswith("CheckpointStorageFullError"), r1["error"]
    assert r0["listing"] == r1["listing"] == ["step-000000000001"]
    assert r0["committed"] == 3
    assert sorted(os.listdir(ckpt)) == ["step-000000000001", "step-000000000003"]
    assert_verifies(ckpt, 3)


def test_time_based_saves_happen_at_the_same_steps(tmp_path: Path) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    r0, r1 = run("timed_saves", 2, ckpt, out)
    assert r0["saved_steps"] == r1["saved_steps"], (r0, r1)
    assert len(r0["saved_steps"]) >= 2, r0  # ~2.5 s of steps, a save every 0.4 s
    committed = [i.step for i in scan(Storage(str(ckpt))) if i.committed]
    assert committed == r0["saved_steps"][-3:]  # keep_last=3
    for step in committed:
        assert manifest_of(ckpt, step)["world_size"] == 2
        assert_verifies(ckpt, step)


def test_a_stateful_policy_decides_the_same_on_every_rank(tmp_path: Path) -> None:
    # auto_interval with a different MTBF in each rank's environment: every rank must
    # use the primary's policy, or the ranks save at different steps.
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    r0, r1 = run("auto_saves", 2, ckpt, out)
    assert r0["saved_steps"] == r1["saved_steps"], (r0, r1)
    assert len(r0["saved_steps"]) >= 2, r0
    for info in scan(Storage(str(ckpt))):
        assert info.committed
        assert_verifies(ckpt, info.step)


def test_corrupt_file_of_one_rank_falls_back_on_every_rank(tmp_path: Path) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    results_ = run("corrupt", 2, ckpt, out)  # saves 2 and 4, flips a byte, restores
    assert sorted(results_[0]["weights"]) == [2, 4]
    assert [r["restored"]["step"] for r in results_] == [2, 2]
    for r in results_:
        assert bitwise_equal(r["restored"]["weights"], r["weights"][2])
        assert r["restored"]["values"] == {"position": 2}
    assert "does not verify on another rank" in (out / "corrupt.rank0.log").read_text()
    assert "rank-00001.pt: checksum mismatch" in (out / "corrupt.rank1.log").read_text()
    problems = verify_step(Storage(str(ckpt)), next(
        i for i in scan(Storage(str(ckpt))) if i.step == 4)).problems
    assert len(problems) == 1 and "rank-00001.pt" in problems[0]


def test_sharded_fsdp2_save_restore_and_reshard(tmp_path: Path) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    both = run("sharded", 2, ckpt, out)  # save at step 3, then restore into fresh objects
    saved, restored = [r["saved"] for r in both], [r["restored"] for r in both]
    s0 = saved[0]
    assert s0["step"] == 3
    assert bitwise_equal(s0["weights"], saved[1]["weights"])  # full tensors, same on both
    assert not bitwise_equal(s0["weights"], s0["final"])  # training moved on during the write

    m = manifest_of(ckpt, 3)
    assert m["layout"] == "sharded" and m["world_size"] == 2
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "shared.pt",
            "rank-00000.pt", "rank-00001.pt"} == set(m["files"])
    assert_verifies(ckpt, 3)
    shared = torch.load(step_dir(ckpt, 3) / "shared.pt", weights_only=True)
    assert set(shared) == {"sched"}  # what is not sharded stays out of DCP
    assert bitwise_equal(s0["table"], torch.arange(8.0) + 3)

    for rank, r in enumerate(restored):
        assert r["step"] == 3 and r["sharded"]
        assert bitwise_equal(r["weights"], s0["weights"]), f"rank {rank}: weights differ"
        assert bitwise_equal(r["moments"], s0["moments"]), f"rank {rank}: AdamW state differs"
        assert r["values"] == saved[rank]["values"]
        assert bitwise_equal(r["rng_after"], saved[rank]["rng_after"])
        assert r["sched"] == s0["sched"] and r["lrs"] == [s0["sched"]["_last_lr"][0]]
        assert bitwise_equal(r["table"], s0["table"])

    # A different world size: one process, a plain (unsharded) model gets the full weights.
    (single,) = run("sharded_restore", 1, ckpt, tmp_path / "out1")
    assert single["step"] == 3 and not single["sharded"]
    assert bitwise_equal(single["weights"], s0["weights"])
    assert bitwise_equal(single["moments"], s0["moments"])
    assert single["values"] == saved[0]["values"]
    assert single["sched"] == s0["sched"]
    assert bitwise_equal(single["table"], s0["table"])  # a DTensor saved, a tensor loaded

    # A flipped byte in one rank's shard file is caught by the deep check.
    flip_byte(step_dir(ckpt, 3) / "dcp" / "__1_0.distcp")
    storage = Storage(str(ckpt))
    checked = verify_step(storage, next(i for i in scan(storage) if i.step == 3))
    assert not checked.ok and any("__1_0.distcp" in p for p in checked.problems)


def test_sigterm_on_one_rank_saves_on_all_and_exits_134(tmp_path: Path) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    procs = start("sigterm", 2, ckpt, out)
    ready = [out / f"sigterm.rank{r}.ready" for r in range(2)]
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while not all(p.exists() for p in ready):
        if time.monotonic() > deadline or any(p.exitcode is not None for p in procs):
            wait(procs, "sigterm", out, timeout=1)
            pytest.fail("sigterm: the ranks never got going\n" + logs(out, "sigterm", 2))
        time.sleep(0.05)
    assert procs[1].pid is not None
    os.kill(procs[1].pid, signal.SIGTERM)
    codes = wait(procs, "sigterm", out)
    assert codes == [0, 134], f"exit codes {codes}\n" + logs(out, "sigterm", 2)

    r0, r1 = results(out, "sigterm", 2)
    step = r1["saved_step"]
    assert step is not None and r0["saved_step"] == step
    assert r1["exit_code"] == 134
    assert step in r1["committed_at_exit"], "rank 1 left before the step was committed"
    assert [i.step for i in scan(Storage(str(ckpt))) if i.committed] == [step]
    assert manifest_of(ckpt, step)["world_size"] == 2
    assert_verifies(ckpt, step)


def test_sharded_on_an_object_store(tmp_path: Path, gcs_bucket: Any) -> None:
    out = tmp_path / "out"
    r0, r1 = run("sharded_gcs", 2, gcs_bucket.url, out,
                 extra_env={"RT_GCS_ENDPOINT": gcs_bucket.storage_options["endpoint_url"]})
    for r in (r0, r1):
        assert r["restored"]["step"] == 3
        assert bitwise_equal(r["restored"]["weights"], r0["saved"]["weights"])
        assert bitwise_equal(r["restored"]["moments"], r0["saved"]["moments"])

    storage = Storage(gcs_bucket.url, storage_options=gcs_bucket.storage_options)
    (info,) = [i for i in scan(storage) if i.committed]
    assert info.step == 3 and info.name.startswith("step-000000000003-")  # in place, no rename
    m = json.loads(storage.read_bytes(f"{info.name}/manifest.json"))
    assert m["layout"] == "sharded"
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= set(m["files"])
    checked = verify_step(storage, info)
    assert checked.ok, checked.problems


def test_a_replicated_restore_from_an_object_store_reads_once(
        tmp_path: Path, gcs_bucket: Any) -> None:
    """3 ranks, the emulator: the primary reads shared.pt and streams it to the others; a
    flipped byte in step 4's copy is found by the primary's checksum, and all three take
    step 2 instead. No rank but the primary reads a shared file."""
    out = tmp_path / "out"
    got = run("corrupt_gcs", 3, f"{gcs_bucket.url}/run", out,
              extra_env={"RT_GCS_ENDPOINT": gcs_bucket.storage_options["endpoint_url"]})
    assert [r["restored"]["step"] for r in got] == [2, 2, 2]
    for r in got:
        assert bitwise_equal(r["restored"]["weights"], got[0]["weights"][2])
        assert r["restored"]["values"] == {"position": 2}
    storage = Storage(f"{gcs_bucket.url}/run", storage_options=gcs_bucket.storage_options)
    files = {i.step: read_manifest(storage, i.name, i.step).files
             for i in scan(storage) if i.committed}
    # Each rank read its own file of steps 4 and 2 (every rank's own file verifies before
    # the shared one is streamed); the primary also both shared.pt files, in full (step 4's
    # failed its checksum at the end).
    for rank, r in enumerate(got):
        own = sum(files[s][f"rank-{rank:05d}.pt"].size for s in (2, 4))
        assert r["restored"]["bytes_read"]["persistent"] == own + (
            files[2]["shared.pt"].size + files[4]["shared.pt"].size if rank == 0 else 0), \
            (rank, r)
    assert "shared.pt: checksum mismatch" in (out / "corrupt_gcs.rank0.log").read_text()


def test_sharded_save_to_gcs_rides_out_503s(tmp_path: Path, gcs_bucket: Any,
                                            gcs_proxy: Any) -> None:
    """DCP writes each rank's shard through gcsfs: injected 503s on those uploads are
    retried (gcsfs's own retry on 5xx) and the step still commits and restores exactly."""
    gcs_proxy.inject(503, count=4, method="POST", path=r"/upload/.*distcp")
    out = tmp_path / "out"
    r0, r1 = run("sharded_gcs", 2, gcs_bucket.url, out,
                 extra_env={"RT_GCS_ENDPOINT": gcs_proxy.endpoint})
    assert gcs_proxy.injected == 4
    for r in (r0, r1):
        assert r["restored"]["step"] == 3
        assert bitwise_equal(r["restored"]["weights"], r0["saved"]["weights"])
    storage = Storage(gcs_bucket.url, storage_options=gcs_bucket.storage_options)
    (info,) = [i for i in scan(storage) if i.committed]
    assert verify_step(storage, info).ok


def test_dcp_metadata_is_parsed_without_running_code(tmp_path: Path) -> None:
    """DCP's .metadata is a pickle (DCP itself reads it with pickle.load): ours refuses
    anything but checkpoint metadata classes."""
    import pickle

    from resilient_train.checkpoint.commit.manifest import CorruptCheckpointError
    from resilient_train.checkpoint.commit.sharded import parse_metadata

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    with pytest.raises(CorruptCheckpointError, match="refusing"):
        parse_metadata(pickle.dumps(Evil()), "x/.metadata")
    assert not (tmp_path / "pwned").exists()
    with pytest.raises(CorruptCheckpointError, match="not DCP metadata"):
        parse_metadata(pickle.dumps({"a": 1}), "x/.metadata")
