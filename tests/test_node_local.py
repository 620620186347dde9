"""The node-local tier (checkpoint/nodelocal.py): frequent saves to the machine's own disk,
every K-th to the persistent tier, and a restore that takes the newest step every rank can
get, from its own disk or a neighbour's, else from storage. Real files, real processes."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from jobs import assert_same_end, launch_job, the_recovery

import resilient_train as rt
from resilient_train.checkpoint.commit.directory import SHARED_FILE
from resilient_train.checkpoint.commit.manifest import MANIFEST, MARKER, marker_bytes

HERE = Path(__file__).resolve().parent


@dataclass
class Run:
    """One run of :func:`train_on`: its (closed) manager, the step it resumed from (0: a
    fresh start) and its final weights."""

    mgr: rt.CheckpointManager
    start: int
    weights: dict[str, torch.Tensor]


def train_on(ckpt: Path, local: Path, steps: int, *, every: int = 3,
             final: bool = False) -> Run:
    """A manager on checkpoint directory ``ckpt`` with a node-local tier in ``local`` (every
    save there, every 3rd to storage); restores, trains ``steps`` steps saving each one,
    closes."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr = rt.CheckpointManager(ckpt, options=rt.CheckpointOptions(
        save_every_steps=1, async_save=False,
        node_local=rt.NodeLocal(directory=str(local), persistent_every=every)))
    mgr.track(model=model, optimizer=opt)
    start = mgr.restore_latest() or 0
    for step in range(start, start + steps):
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        mgr.maybe_save(step + 1)
    if final:
        mgr.save(start + steps)   # a direct save goes to storage too
    mgr.close()
    return Run(mgr, start, {k: v.clone() for k, v in model.state_dict().items()})


def train(tmp: Path, steps: int, *, every: int = 3, final: bool = False
          ) -> rt.CheckpointManager:
    """:func:`train_on` with ``tmp/persistent`` and ``tmp/local``; the (closed) manager."""
    return train_on(tmp / "persistent", tmp / "local", steps, every=every, final=final).mgr


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def committed(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*")
                  if (p / MARKER).exists())


def test_every_save_goes_to_the_machine_and_every_third_to_storage(tmp_path: Path) -> None:
    train(tmp_path, 7)
    assert committed(tmp_path / "persistent") == [3, 6]
    assert committed(tmp_path / "local") == [7]          # keep_last=1 on the machine
    files = {p.name for p in (tmp_path / "local").glob("step-*/*.pt")}
    assert {SHARED_FILE, "rank-00000.pt"} <= files       # every rank's copy is complete


def test_processes_sharing_a_machine_each_save_in_a_directory_of_their_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # torchrun's processes on one VM share its disk; in one directory their saves of a
    # step (same names, same job token) broke each other ("... .tmp-step-50-...: no such
    # file or directory"). With LOCAL_WORLD_SIZE above 1, rank R writes in rankR/.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    train(tmp_path, 4)
    assert committed(tmp_path / "local") == []
    assert committed(tmp_path / "local" / "rank00000") == [4]
    mgr = train(tmp_path, 0)   # and the restart on that machine finds it there
    rec = mgr.last_restore
    assert rec is not None and (rec.step, rec.source) == (4, "node-local")


def test_a_restart_on_the_same_machine_restores_from_its_disk(tmp_path: Path) -> None:
    train(tmp_path, 7)
    mgr = train(tmp_path, 0)
    rec = mgr.last_restore
    assert rec is not None and (rec.step, rec.source) == (7, "node-local")
    assert rec.bytes_read["persistent"] == 0 and rec.bytes_read["node-local"] > 0


def test_a_new_machine_restores_from_storage_and_says_why(tmp_path: Path) -> None:
    train(tmp_path, 7)
    shutil.rmtree(tmp_path / "local")                    # a new VM: its disk is empty
    mgr = train(tmp_path, 0)
    rec = mgr.last_restore
    assert rec is not None and (rec.step, rec.source) == (6, "persistent")
    assert "on the machines' disks" in rec.reason and rec.bytes_read["node-local"] == 0


def test_a_corrupt_local_copy_falls_back_to_storage(tmp_path: Path, caplog) -> None:
    train(tmp_path, 7)
    shared = next((tmp_path / "local").glob(f"step-*/{SHARED_FILE}"))
    data = bytearray(shared.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shared.write_bytes(bytes(data))
    mgr = train(tmp_path, 0)
    assert mgr.last_restore is not None
    assert (mgr.last_restore.step, mgr.last_restore.source) == (6, "persistent")
    assert "node-local checkpoint of step 7 does not verify" in caplog.text


def test_storage_newer_than_the_machine_wins(tmp_path: Path) -> None:
    train(tmp_path, 7)
    shutil.copytree(tmp_path / "local", tmp_path / "old-local")   # the machine at step 7
    train(tmp_path, 2, final=True)                                 # storage: step 9
    shutil.rmtree(tmp_path / "local")
    shutil.copytree(tmp_path / "old-local", tmp_path / "local")   # a disk left behind
    mgr = train(tmp_path, 0)
    assert mgr.last_restore is not None
    assert (mgr.last_restore.step, mgr.last_restore.source) == (9, "persistent")


def test_a_run_resumes_its_own_state_never_another_runs_copy_in_a_shared_directory(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Two runs given one NodeLocal(directory=...): run B, its checkpoint directory at step
    # 30, resumed from run A's step 60 there, with no warning, and trained on from A's
    # weights; a run with a fresh checkpoint directory resumed at A's step too. A copy
    # belongs to its run's checkpoint directory: another run's is named and ignored.
    caplog.set_level(logging.WARNING, logger="resilient_train.checkpoint.tiers.nodelocal")
    shared, a, b = tmp_path / "nl", tmp_path / "a", tmp_path / "b"

    def ignored(step: int, whose: Path) -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.getMessage().startswith(f"ignoring the node-local checkpoint of step "
                                             f"{step} in {shared}")
                and f"checkpoint directory {os.path.realpath(whose)}" in r.getMessage()]

    assert train_on(b, shared, 30).start == 0            # B: step 30 in b and in nl
    # B resuming its own state, for the weights; then both its tiers as they were.
    for where in (b, shared):
        shutil.copytree(where, tmp_path / "before" / where.name)
    own = train_on(b, shared, 5)
    assert own.mgr.last_restore is not None
    assert (own.start, own.mgr.last_restore.source) == (30, "node-local")
    for where in (b, shared):
        shutil.rmtree(where)
        shutil.copytree(tmp_path / "before" / where.name, where)

    # A, a run of its own, starts fresh beside B's copy, and says why it ignores it.
    assert train_on(a, shared, 60).start == 0
    assert ignored(30, b), caplog.text
    assert committed(shared) == [60]
    doc = json.loads((shared / "step-000000000060" / MANIFEST).read_text())
    assert doc["metadata"]["owner"] == {"checkpoint_directory": os.path.realpath(a),
                                        "job_id": None}

    # B again: its own step 30 (from its checkpoint directory), never A's 60.
    caplog.clear()
    again = train_on(b, shared, 5)
    assert again.mgr.last_restore is not None
    assert (again.start, again.mgr.last_restore.source) == (30, "persistent")
    assert same(again.weights, own.weights)
    said = ignored(60, a)
    assert len(said) == 1 and "belongs to another run" in said[0], caplog.text
    assert "Give each run a node-local directory of its own" in said[0], said

    # A run with a fresh checkpoint directory starts fresh, as on a disk of its own.
    caplog.clear()
    fresh = train_on(tmp_path / "c", shared, 5)
    alone = train_on(tmp_path / "d", tmp_path / "d-nl", 5)
    assert (fresh.start, alone.start) == (0, 0) and same(fresh.weights, alone.weights)
    assert ignored(60, a), caplog.text


def test_a_copy_names_its_job_where_there_is_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # Under the launcher or on the platform the job id is part of whose a copy is: a
    # restart of the job resumes from it, another job on the same checkpoint directory
    # (one that found the machine's disk kept) does not.
    caplog.set_level(logging.WARNING, logger="resilient_train.checkpoint.tiers.nodelocal")
    monkeypatch.setenv("CLOUD_ML_JOB_ID", "1111")
    train(tmp_path, 7)
    mgr = train(tmp_path, 0)
    assert mgr.last_restore is not None
    assert (mgr.last_restore.step, mgr.last_restore.source) == (7, "node-local")
    assert "ignoring" not in caplog.text
    monkeypatch.setenv("CLOUD_ML_JOB_ID", "2222")
    mgr = train(tmp_path, 0)
    assert mgr.last_restore is not None
    assert (mgr.last_restore.step, mgr.last_restore.source) == (6, "persistent")
    ckpt = os.path.realpath(tmp_path / "persistent")
    assert (f"it belongs to another run (checkpoint directory {ckpt}, job 1111), not to "
            f"this one (checkpoint directory {ckpt}, job 2222)") in caplog.text, caplog.text


def test_a_copy_that_names_no_run_is_ignored(tmp_path: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    # A copy saved before node-local copies recorded their run: whose it is cannot be
    # told, so it counts as another run's (named, ignored) and storage serves the restore.
    caplog.set_level(logging.WARNING, logger="resilient_train.checkpoint.tiers.nodelocal")
    train(tmp_path, 7)
    step = tmp_path / "local" / "step-000000000007"
    doc = json.loads((step / MANIFEST).read_text())
    doc["metadata"].pop("owner", None)
    data = json.dumps(doc).encode()
    (step / MANIFEST).write_bytes(data)
    (step / MARKER).write_bytes(marker_bytes(data, 7))
    mgr = train(tmp_path, 0)
    assert mgr.last_restore is not None
    assert (mgr.last_restore.step, mgr.last_restore.source) == (6, "persistent")
    assert f"ignoring the node-local checkpoint of step 7 in {tmp_path / 'local'}" \
        in caplog.text and "names no run" in caplog.text, caplog.text


def test_a_node_local_directory_that_cannot_be_written_fails_at_start(
        tmp_path: Path) -> None:
    # Before: the manager started, and each save warned that the tier failed, for the
    # whole run (a typo, or a local SSD that is not mounted), while the cadence kept most
    # saves off storage.
    (tmp_path / "a-file").write_text("not a directory")
    for where, why in ((tmp_path / "a-file" / "ckpt", f"{tmp_path / 'a-file'} is a file"),
                       (Path("/proc/no-such-dir/ckpt"), "a directory on its path cannot "
                                                        "be created there")):
        with pytest.raises(ValueError) as info:
            rt.CheckpointManager(tmp_path / "persistent", options=rt.CheckpointOptions(
                node_local=rt.NodeLocal(directory=str(where))))
        msg = str(info.value)
        assert msg.startswith(f"cannot use {where} for the node-local tier: "), msg
        assert why in msg, msg
        assert "Give NodeLocal(directory=...) a path on this machine's own disk" in msg


def test_a_long_restore_from_the_machines_disk_says_how_far_it_has_got(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # The node-local read was one checksum call over the whole memory map: tens of GB
    # with no line at all. It goes by chunks now, counted as any storage read is; the
    # checksum is held after its first chunk until a progress line has been logged.
    from resilient_train.checkpoint import progress as progress_mod
    from resilient_train.checkpoint.commit import loader as loader_mod
    from resilient_train.checkpoint.storage.base import format_bytes

    train(tmp_path, 7)
    monkeypatch.setattr(progress_mod, "AFTER_S", 0.05)
    monkeypatch.setattr(progress_mod, "EVERY_S", 0.05)
    monkeypatch.setattr(loader_mod, "VERIFY_CHUNK", 64)
    seen = threading.Event()

    class Shown(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if " of " in record.getMessage() and "reading step 7" in record.getMessage():
                seen.set()

    class HeldCrc(loader_mod.Crc32c):   # type: ignore[misc, name-defined]
        def update(self, data: object) -> None:
            if self.size:   # after the first chunk
                assert seen.wait(30), "no progress line while the read was held"
            super().update(data)   # type: ignore[arg-type]

    monkeypatch.setattr(loader_mod, "Crc32c", HeldCrc)
    shown = Shown()
    logging.getLogger("resilient_train").addHandler(shown)
    caplog.set_level(logging.INFO, logger="resilient_train.checkpoint.tiers.nodelocal")
    try:
        mgr = train(tmp_path, 0)
    finally:
        logging.getLogger("resilient_train").removeHandler(shown)
    assert mgr.last_restore is not None and mgr.last_restore.source == "node-local"
    lines = [r.getMessage() for r in caplog.records
             if r.getMessage().startswith("rank 0: reading step 7 from ")]
    total = sum(p.stat().st_size for p in (tmp_path / "local").glob("step-*/*.pt"))
    head = rf"rank 0: reading step 7 from {tmp_path / 'local'}/step-0+7\S*: "
    size = re.escape(format_bytes(total))
    part = re.fullmatch(head + rf"([0-9]+) B of {size} \(([0-9]+)%, .*/s\)", lines[0])
    assert part and 0 < int(part.group(1)) < total, (lines, total)
    assert re.fullmatch(head + rf"done, {size} in [0-9]+ s \(.*/s\)", lines[-1]), lines


def test_node_local_options_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="is a URL"):
        rt.NodeLocal(directory="gs://bucket/local")
    with pytest.raises(ValueError, match="persistent_every=0"):
        rt.NodeLocal(persistent_every=0)
    with pytest.raises(ValueError, match="RESILIENT_TRAIN_NODE_LOCAL_DIR"):
        rt.NodeLocal().resolve(env={})
    assert rt.NodeLocal().resolve(env={"RESILIENT_TRAIN_NODE_LOCAL_DIR": "/x"}) == \
        "/x/checkpoints"
    with pytest.raises(TypeError, match="NodeLocal"):
        rt.CheckpointOptions(node_local="/dev/shm")   # type: ignore[arg-type]


def test_auto_cadence_sends_to_storage_as_often_as_its_cost_allows() -> None:
    from resilient_train.checkpoint.tiers.nodelocal import MAX_PERSISTENT_EVERY
    from resilient_train.checkpoint.tiers.nodelocal import persistent_every_auto as k

    day, four_hours = 86400.0, 14400.0
    # A storage write that fits between two saves costs the loop nothing: every save.
    assert k(0.1, 5.0, 10.0, day, four_hours) == 1
    # One that does not makes the next save wait 10 s: Young/Daly for C = 10 s, M = 1 day
    # (about 1,320 s) in saves 10 s apart.
    assert k(0.1, 19.9, 10.0, day, four_hours) == 131
    assert k(0.1, 19.9, 10.0, 3600.0, four_hours) == 26   # failures more often: more often
    # Bounded by the platform's 4 hours (in saves) and by MAX_PERSISTENT_EVERY.
    assert k(0.1, 3000.0, 20.0, 100 * day, four_hours) == 720
    assert k(0.1, 3000.0, 1.0, 100 * day, None) == MAX_PERSISTENT_EVERY
    with pytest.raises(ValueError, match='persistent_every=.often.*"auto"'):
        rt.NodeLocal(persistent_every="often")


def test_auto_cadence_measures_both_tiers_first_then_spaces_storage(tmp_path: Path,
                                                                     caplog) -> None:
    """With steps that cost nothing, a storage write (fsync'd files, manifest and marker)
    is always longer than the training between two saves: after the first save, which
    goes to both tiers and measures them, storage gets fewer saves than the machine."""
    caplog.set_level("INFO", logger="resilient_train.checkpoint.tiers.nodelocal")
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    mgr = rt.CheckpointManager(tmp_path / "persistent", options=rt.CheckpointOptions(
        save_every_steps=1, node_local=rt.NodeLocal(directory=str(tmp_path / "local"),
                                                    persistent_every="auto", keep_last=100)))
    mgr.track(model=model)
    for step in range(1, 13):
        mgr.maybe_save(step)
    mgr.close()
    assert committed(tmp_path / "local") == list(range(1, 13))
    stored = committed(tmp_path / "persistent")
    assert stored[0] == 1 and len(stored) < 12, stored
    assert "node-local tier: every " in caplog.text and "goes to storage too" in caplog.text


def launch(tmp: Path, name: str, *args: str) -> tuple[dict, str, Path]:
    return launch_job(tmp, name, 2, args,
                      [str(HERE / "workers" / "local_tier.py"), "80", "0.03"])


@pytest.mark.slow
def test_every_worker_restarted_one_on_a_new_machine_resumes_from_the_others_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # restartJobOnWorkerRestart: a node loss restarts every worker, so no process keeps
    # anything in memory; the killed one's machine is new (its disk empty), the other's
    # kept. Rank 1 gets the model from rank 0's disk, and its own RNG streams and values
    # from the copy rank 0's disk holds for it: nothing is read from storage.
    _, _, clean = launch(tmp_path, "clean")
    job, out, faulted = launch(tmp_path, "faulted", "--restart-job-on-worker-restart",
                               "--chaos", "kill:workerpool1-0@step37")
    assert "workerpool1-0: restarted on a new VM" in out and "node-local disk" in out
    recovery = the_recovery(job, out)
    assert recovery["step"] == 35, recovery      # the last save before the kill
    assert {r["source"] for r in recovery["ranks"]} == {"node-local"}, recovery
    assert recovery["bytes_read"]["persistent"] == 0
    assert "rank 1: resumed from step 35 (from rank 0's node-local disk)" in out
    assert_same_end(clean, faulted, ranks=2)
    # Peer recovery off, the survivor re-forms in-process: the tier alone serves the
    # restore (the ring still carries each rank's RNG and values to its neighbour's disk).
    monkeypatch.setenv("LOCAL_TIER_NO_PEER", "1")
    job, out, alone = launch(tmp_path, "no-peer", "--chaos", "kill:workerpool1-0@step37")
    recovery = the_recovery(job, out)
    assert recovery["step"] == 35, recovery
    assert {r["source"] for r in recovery["ranks"]} == {"node-local"}, recovery
    assert recovery["bytes_read"]["persistent"] == 0
    assert_same_end(clean, alone, ranks=2)


@pytest.mark.slow
def test_a_machine_of_two_processes_lost_resumes_from_the_other_machines_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The same restart with two processes per replica (torchrun on each machine): ranks
    # [0, 1] on the kept machine, [2, 3] on the new one. Each process keeps its own
    # directory on the shared disk, and the peer ring ran 0-2-1-3, so the kept disk
    # holds ranks 2 and 3's RNG and values too: no storage is read.
    monkeypatch.setenv("PEER_DDP_NODE_LOCAL", "2")
    job, out, faulted = launch_job(
        tmp_path, "machines", 2, ["--restart-job-on-worker-restart",
                                  "--chaos", "kill:workerpool1-0@step35"],
        [str(HERE / "workers" / "torchrun_peer_ddp.sh"), "100", "10", "0.05"], program="bash")
    assert "node-local checkpoint of step" not in out, out[-3000:]   # none failed
    recovery = the_recovery(job, out)
    # The last save before the kill landed: the launcher reads step 35 from the telemetry,
    # and on loaded cores the ranks may be past the save of step 40 by then.
    assert 30 <= recovery["step"] < 100, recovery
    assert {r["source"] for r in recovery["ranks"]} == {"node-local"}, recovery
    assert recovery["bytes_read"]["persistent"] == 0, recovery
    disk = faulted / "machines" / "workerpool0-0" / "vm" / "local" / "checkpoints"
    assert sorted(p.name for p in disk.iterdir()) == ["rank00000", "rank00001"]


@pytest.mark.slow
def test_two_ranks_given_one_node_local_directory_each_keep_and_restore_their_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Both ranks of a job wrote a step into one temporary directory (one name: the job's
    # token) and committed it over each other; a save failed with "a directory on its path
    # cannot be created there". Each rank writes in a directory of its own there now, and
    # a restart of every worker resumes from it, each rank with its own state.
    _, _, clean = launch(tmp_path, "clean")
    shared = tmp_path / "one-disk"
    monkeypatch.setenv("LOCAL_TIER_DIR", str(shared))
    job, out, faulted = launch(tmp_path, "shared", "--restart-job-on-worker-restart",
                               "--chaos", "kill:workerpool1-0@step37")
    assert "node-local checkpoint of step" not in out, out[-3000:]   # none failed
    assert "cannot be created there" not in out, out[-3000:]
    recovery = the_recovery(job, out)
    assert recovery["step"] == 35, recovery
    assert {r["source"] for r in recovery["ranks"]} == {"node-local"}, recovery
    assert recovery["bytes_read"]["persistent"] == 0, recovery
    assert_same_end(clean, faulted, ranks=2)
    assert sorted(p.name for p in shared.iterdir()) == ["rank00000", "rank00001"]


def test_chaos_wipe_and_corrupt_hit_the_disk_a_restore_reads(tmp_path: Path, caplog) -> None:
    from resilient_train.launcher.chaos import FaultKind, parse_chaos
    from resilient_train.launcher.tamper import corrupt_newest_checkpoint, wipe_disk

    spec = parse_chaos("corrupt:0@step36,wipe:workerpool1-0@20s")
    assert [f.kind for f in spec.faults] == [FaultKind.CORRUPT, FaultKind.WIPE]
    with pytest.raises(ValueError, match="duration applies only to hang and slow"):
        parse_chaos("wipe:1@20s+5s")
    train(tmp_path, 7)
    hit = corrupt_newest_checkpoint(tmp_path)   # the newest committed step anywhere below
    assert hit is not None and hit.parent.name == "step-000000000007", hit
    mgr = train(tmp_path, 0)
    assert mgr.last_restore is not None
    assert (mgr.last_restore.step, mgr.last_restore.source) == (6, "persistent")
    assert "node-local copy of step(s) 7 does not verify" in mgr.last_restore.reason
    assert wipe_disk(tmp_path / "local") != [] and list((tmp_path / "local").iterdir()) == []
    assert wipe_disk(tmp_path / "nowhere") == []


def test_a_save_the_loop_waits_for_names_the_tiers_it_writes(tmp_path: Path) -> None:
    """The progress lines of a save that the loop waits for: where it goes and of how much
    (each tier gets the state). A save to the machine's disk alone named the checkpoint
    directory, and counted its bytes, which that save never moves."""
    net = torch.nn.Linear(256, 256)
    state = sum(t.numel() * t.element_size() for t in net.state_dict().values())
    local, ckpt = tmp_path / "local", tmp_path / "ckpt"
    with rt.CheckpointManager(ckpt, options=rt.CheckpointOptions(
            node_local=rt.NodeLocal(directory=str(local), persistent_every=2))) as mgr:
        mgr.track(model=net)
        seen = []
        for step, persistent, node_local in ((1, True, True), (2, False, True),
                                             (3, True, False)):
            mgr.save(step, persistent=persistent, node_local=node_local)
            progress = mgr._inflight.progress()
            seen.append((progress.what, progress.total))
            mgr.wait()
            assert progress.done() > 0   # its tiers' own counters moved
    # The state: the model and this rank's own (its RNG streams), in each tier.
    assert seen[1][0] == f"saving step 2 to {local}" and state < seen[1][1] < 2 * state
    assert seen[0] == (f"saving step 1 to {local} and {ckpt}", 2 * seen[1][1])
    assert seen[2] == (f"saving step 3 to {ckpt}", seen[1][1])
