"""The checkpoint manager's parts, one at a time: when to save (schedule/scheduler.py), how to write
a step (commit/stepwriter.py), how to commit it (commit/protocol.py) and what is in a directory (commit/directory.py,
torch-free). Pure and fast: no manager, no training loop, no sleeps."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from resilient_train.checkpoint.commit.directory import (
    MARKER,
    TMP_PREFIX,
    KnownSteps,
    StepInfo,
    in_place_dirname,
    parse_step,
    rank_file,
    scan,
    step_dirname,
    temporary_dirname,
    verify_step,
)
from resilient_train.checkpoint.commit.manifest import FileEntry, Manifest, crc32c
from resilient_train.checkpoint.commit.protocol import (
    AtomicRename,
    CommitFile,
    committer_for,
    remove_crashed_saves,
)
from resilient_train.checkpoint.commit.stepwriter import WriterThread, state_bytes, write_torch_file
from resilient_train.checkpoint.schedule.coordination import SingleProcess
from resilient_train.checkpoint.schedule.policies import (
    SaveContext,
    SavePolicy,
    every,
    every_n_steps,
)
from resilient_train.checkpoint.schedule.scheduler import Decision, SaveScheduler, SigtermWatch
from resilient_train.checkpoint.storage.base import CommitProtocol, Storage

# --- what is in a directory ----------------------------------------------------------------


def test_the_two_work_directory_names_parse_as_their_step() -> None:
    assert temporary_dirname(12, "beef") == f"{TMP_PREFIX}{step_dirname(12)}-beef"
    assert in_place_dirname(12, "beef") == f"{step_dirname(12)}-beef"
    assert parse_step(in_place_dirname(12, "beef")) == 12
    assert parse_step(temporary_dirname(12, "beef").removeprefix(TMP_PREFIX)) == 12
    assert rank_file(3) == "rank-00003.pt"


def test_known_steps_forget_a_bad_name_once_it_is_committed() -> None:
    known = KnownSteps()
    assert known.good() == set()
    known.bad.add("step-2")
    known.restored = "step-1"
    known.commit("step-2")
    assert known.good() == {"step-1", "step-2"} and known.bad == set()


def test_listing_a_directory_does_not_import_torch() -> None:
    # `resilient-train checkpoints list` starts without torch (2.5 s of a 2.7 s start).
    code = ("import sys, resilient_train.cli.checkpoints, resilient_train.checkpoint.commit.directory; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


# --- how to commit it -----------------------------------------------------------------------


def test_the_protocol_is_chosen_once_from_the_storage(tmp_path: Path) -> None:
    local = Storage(str(tmp_path / "local"))
    fuse = Storage(str(tmp_path / "gcs" / "b"), object_store_mounts=(str(tmp_path / "gcs"),))
    memory = Storage("memory://rt-parts/run")
    assert [type(committer_for(s, "t")) for s in (local, fuse, memory)] == \
        [AtomicRename, CommitFile, CommitFile]
    for storage in (local, fuse, memory):
        committer = committer_for(storage, "t")
        assert committer.protocol is storage.commit_protocol
        assert committer.files_atomic is (committer.protocol is CommitProtocol.COMMIT_FILE)


def _write_step(storage: Storage, work: str, step: int) -> Manifest:
    data = b"weights"
    storage.write_bytes(f"{work}/data.bin", data)
    return Manifest(step=step, world_size=1, layout="replicated",
                    files={"data.bin": FileEntry(len(data), crc32c(data))})


@pytest.mark.parametrize("url", ["local", "memory"])
def test_each_protocol_commits_what_a_reader_then_verifies(tmp_path: Path, url: str) -> None:
    storage = Storage(str(tmp_path / "c") if url == "local" else f"memory://rt-parts-{url}/c")
    committer = committer_for(storage, "cafe")
    work = committer.work_dir(5)
    assert not committer.already_committed(work)
    with committer.hold(work):
        manifest = _write_step(storage, work, 5)
    assert scan(storage, with_manifest=False) == [StepInfo(5, work, False)]   # not yet
    name = committer.commit(work, manifest)
    renamed = committer.protocol is CommitProtocol.ATOMIC_RENAME
    assert name == (step_dirname(5) if renamed else work)
    (info,) = scan(storage)
    assert info.name == name and verify_step(storage, info).ok
    # A second save of the step by this run: COMMIT_FILE must not rewrite it in place.
    assert committer.already_committed(committer.work_dir(5)) is not renamed


def test_atomic_rename_keeps_a_valid_commit_of_the_same_step(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "c"))
    first = committer_for(storage, "aaaa")
    first.commit(first.work_dir(3), _write_step(storage, first.work_dir(3), 3))
    again = committer_for(storage, "bbbb")
    assert again.commit(again.work_dir(3), _write_step(storage, again.work_dir(3), 3)) == \
        step_dirname(3)
    assert os.listdir(tmp_path / "c") == [step_dirname(3)]   # the duplicate is dropped


def test_commit_file_keeps_a_failed_save_behind_only_after_an_outage() -> None:
    storage = Storage("memory://rt-parts-discard/c")
    committer = committer_for(storage, "dead")
    work = committer.work_dir(7)
    _write_step(storage, work, 7)
    committer.discard(work, transient=True)     # each delete would wait out the outage
    assert storage.exists(f"{work}/data.bin")
    storage.write_bytes(f"{work}/{MARKER}", b"{}")
    committer.discard(work, transient=False)
    assert not storage.exists(work) and not storage.exists(f"{work}/{MARKER}")


def test_crashed_saves_are_removed_unless_a_live_save_holds_them(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "c"))
    crashed = temporary_dirname(2, "0dd0")
    storage.write_bytes(f"{crashed}/shared.pt", b"x")
    live = committer_for(storage, "11fe")
    with live.hold(live.work_dir(4)):
        remove_crashed_saves(storage)
        assert sorted(os.listdir(tmp_path / "c")) == [live.work_dir(4)]


# --- how to write a step --------------------------------------------------------------------


def test_a_torch_file_is_written_with_its_size_and_checksum(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "c"))
    tree = {"w": torch.arange(1000, dtype=torch.float32)}
    for atomic in (False, True):
        entry = write_torch_file(storage, f"d{atomic}/f.pt", tree, atomic=atomic)
        data = (tmp_path / "c" / f"d{atomic}" / "f.pt").read_bytes()
        assert entry == FileEntry(len(data), crc32c(data))
    assert state_bytes({"rank": tree, "shared": {"again": tree["w"]}}) == 4000


def test_the_writer_thread_runs_jobs_in_order_and_hands_back_errors() -> None:
    thread = WriterThread("rt-test-writer")
    seen: list[int] = []
    futures = [thread.submit(seen.append, i) for i in range(5)]
    failing = thread.submit(lambda: 1 / 0)
    thread.shutdown()
    assert seen == list(range(5)) and all(f.result() is None for f in futures)
    with pytest.raises(ZeroDivisionError):
        failing.result()


# --- when to save ---------------------------------------------------------------------------


class _Seen(SavePolicy):
    def __init__(self, inner: SavePolicy) -> None:
        self.inner, self.seen = inner, []   # type: ignore[var-annotated]

    def should_save(self, ctx: SaveContext) -> bool:
        self.seen.append(ctx)
        return self.inner.should_save(ctx)


def _scheduler(policy: SavePolicy, clock: list[float], *, sigterm_on: bool = False,
               coord: Any = None) -> SaveScheduler:
    s = SaveScheduler(policy, coord or SingleProcess(), SigtermWatch(sigterm_on),
                      clock=lambda: clock[0])
    s.start()
    return s


def test_the_scheduler_asks_the_policy_and_restarts_its_clock_at_each_save() -> None:
    t = [100.0]
    s = _scheduler(every(10.0) | every_n_steps(4), t)
    assert s.decide(1) is Decision.SKIP
    t[0] = 110.0
    assert s.decide(2) is Decision.SAVE                 # 10 s after the start
    s.saving(2)
    s.measured(1.0)
    s.measured(2.0)
    assert s.save_cost == pytest.approx(0.7 * 1.0 + 0.3 * 2.0)   # an EMA
    assert s.decide(3) is Decision.SKIP
    assert s.decide(4) is Decision.SAVE                 # every 4 steps
    s.restored(40, created=5.0)
    assert s.last_save_step == 40 and s.decide(41) is Decision.SAVE   # 105 s since 5.0


def test_each_life_decides_with_its_own_copy_of_the_policy() -> None:
    given = _Seen(every_n_steps(2))
    s = _scheduler(given, [0.0])
    s.decide(1)
    assert given.seen == [] and len(s.policy.seen) == 1   # type: ignore[attr-defined]
    assert s.policy.seen[0] == SaveContext(1, 0.0, None, 0.0, None, None)  # type: ignore


def test_a_sigterm_is_an_emergency_save_without_asking_the_policy() -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are installed from the main thread only")
    before = signal.getsignal(signal.SIGTERM)
    s = _scheduler(_Seen(every_n_steps(10**9)), [0.0], sigterm_on=True)
    try:
        assert signal.getsignal(signal.SIGTERM) != before     # the watch's handler
        assert s.decide(1) is Decision.SKIP
        s.watch.received = True     # what the handler notes (not raised: it is process-wide)
        assert s.sigterm_received and s.decide(2) is Decision.EMERGENCY
        assert [c.step for c in s.policy.seen] == [1]    # type: ignore[attr-defined]
    finally:
        s.close()
    assert signal.getsignal(signal.SIGTERM) == before


class _Peer:
    """Rank 0 of two; the other rank reports ``theirs`` to every all-reduce."""

    rank, world_size = 0, 2

    def __init__(self, theirs: list[int]) -> None:
        self.theirs = theirs
        self.broadcasts: list[Any] = []

    def broadcast(self, obj: Any) -> Any:
        self.broadcasts.append(obj)
        return obj

    def allreduce_max(self, values: list[int]) -> list[int]:
        return [max(a, b) for a, b in zip(values, self.theirs)]

    def gather(self, payload: Any) -> list[Any] | None:
        raise AssertionError("the scheduler never gathers")


def test_multi_rank_the_ranks_agree_on_the_clock_a_sigterm_and_the_cost() -> None:
    # The peer: a save costs it 3 s; it wrote the node-local tier in 0.5 s, storage in 20 s.
    peer = _Peer([0, 1, -1, 3_000_000, -1, 500, 20_000, 0])
    t = [50.0]
    s = _scheduler(_Seen(every_n_steps(10**9)), t, coord=peer)
    assert len(peer.broadcasts) == 2           # the policy, then the primary's clock
    s.decide(1)
    ctx = s.policy.seen[-1]                    # type: ignore[attr-defined]
    assert (ctx.now, ctx.save_cost_s) == (50.0, 3.0)
    assert s.shared_tier_s == (0.5, 20.0)      # the slowest rank's writes: the cadence's
    assert not s.shared_local_failing
    peer.theirs = [0, 1, -1, -1, -1, -1, -1, 1]  # the peer's node-local save failed
    s.next_sync_step = 0
    s.decide(2)
    assert s.shared_local_failing              # every save to storage too, on every rank
    peer.theirs = [0, 1, 4000, -1, -1, -1, -1, 0]  # the peer got a SIGTERM 4 s ago
    s.next_sync_step = 0
    assert s.decide(2) is Decision.EMERGENCY
    assert s.sigterm_elapsed_s == 4.0          # every rank plans for the earliest SIGTERM
