"""CheckpointManager integrity: damaged steps, fallback, retention, async errors, exact resume.

Every test saves real state (a small model with dropout, an Adam optimizer, RNG states and
user values), damages what a crash, a bad disk or a careless hand could damage, and checks
what docs/design.md ("Commit protocols") promises: a step without a valid marker does not
exist, a corrupt latest falls back to the previous commit with a warning that names the
problem, and checkpoints that exist but do not verify are an error, never a silent fresh
start.
Backends: local disk, fsspec ``memory://`` and the GCS emulator (fake-gcs-server).
"""

from __future__ import annotations

import io
import json
import logging
import os
import random
import shutil
import threading
import time
import types
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from gcs import FaultProxy

from resilient_train.checkpoint.commit import loader
from resilient_train.checkpoint.commit.directory import TMP_PREFIX, StepInfo, scan, verify_step
from resilient_train.checkpoint.commit.manifest import (
    MANIFEST,
    MARKER,
    CheckpointError,
    CorruptCheckpointError,
    crc32c,
    marker_bytes,
    step_dirname,
)
from resilient_train.checkpoint.commit.retention import RetentionPolicy
from resilient_train.checkpoint.manager import CheckpointManager, CheckpointOptions
from resilient_train.checkpoint.state.capture import StateMismatchError
from resilient_train.checkpoint.storage.base import (
    RetryOptions,
    Storage,
    StorageNotFoundError,
    StoragePermissionError,
    StorageUnavailableError,
)
from resilient_train.checkpoint.tiers import persistent as persistent_mod
from resilient_train.cli import main as cli
from resilient_train.errors import Classification, classify_exception
from resilient_train.frames import current_frames

FAST = RetryOptions(deadline_s=30.0, initial_s=0.01, max_wait_s=0.1)
LOGGER = persistent_mod.log.name   # the checkpoint directory's saves and restores
DEADLINE_S = 30.0


# --- backends ----------------------------------------------------------------------------


@dataclass
class Backend:
    kind: str                      # local | memory | gcs
    url: str
    storage_options: dict[str, Any] | None = None

    def manager(self, **options: Any) -> CheckpointManager:
        options.setdefault("async_save", False)
        options.setdefault("retry", FAST)
        return CheckpointManager(self.url, options=CheckpointOptions(
            storage_options=self.storage_options, **options))

    def storage(self) -> Storage:
        return Storage(self.url, retry=FAST, storage_options=self.storage_options)


def _memory_backend() -> Iterator[Backend]:
    url = f"memory://rt-integrity-{uuid.uuid4().hex[:12]}/run"
    yield Backend("memory", url)
    st = Storage(url)
    if st.fs.exists(st.root):
        st.fs.rm(st.root, recursive=True)


@pytest.fixture(params=["local", "memory", "gcs"])
def backend(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Backend]:
    if request.param == "local":
        yield Backend("local", str(tmp_path / "ckpt"))
    elif request.param == "memory":
        yield from _memory_backend()
    else:
        bucket = request.getfixturevalue("gcs_bucket")
        yield Backend("gcs", f"{bucket.url}/run", dict(bucket.storage_options))


@pytest.fixture(params=["local", "memory"])
def cheap_backend(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Backend]:
    """Local disk and memory:// only, for tests whose point is not the transport."""
    if request.param == "local":
        yield Backend("local", str(tmp_path / "ckpt"))
    else:
        yield from _memory_backend()


# --- a small training setup --------------------------------------------------------------


class Net(torch.nn.Module):
    def __init__(self, hidden: int = 16, extra: bool = False) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, hidden)
        self.drop = torch.nn.Dropout(0.5)
        self.fc2 = torch.nn.Linear(hidden, 4)
        if extra:
            self.fc3 = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


@dataclass
class Trainer:
    model: Net
    opt: torch.optim.Optimizer
    data_pos: int = 0

    @classmethod
    def fresh(cls, seed: int = 0, **net: Any) -> Trainer:
        torch.manual_seed(seed)
        model = Net(**net)
        return cls(model, torch.optim.Adam(model.parameters(), lr=1e-2))

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        # The data depends only on the position: a resume must restore data_pos.
        g = torch.Generator().manual_seed(1000 + self.data_pos)
        return torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)

    def step(self) -> None:
        x, y = self.batch()
        self.data_pos += 1
        # Global RNGs on purpose: dropout (torch), a python and a numpy draw.
        noise = 1.0 + 0.1 * random.random() + 0.1 * float(np.random.rand())
        loss = ((self.model(x) - y) ** 2).mean() * noise
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()

    def track(self, mgr: CheckpointManager) -> None:
        mgr.track(model=self.model, optimizer=self.opt)

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def assert_same_tree(a: Any, b: Any, where: str = "state") -> None:
    """Bitwise equality of nested state (tensors compared with torch.equal)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {set(a)} vs {set(b)}"
        for k in a:
            assert_same_tree(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def save_steps(backend: Backend, steps: list[int], **options: Any
               ) -> dict[int, dict[str, torch.Tensor]]:
    """Train and save each step; return each step's model weights."""
    tr = Trainer.fresh()
    expected = {}
    with backend.manager(**options) as mgr:
        tr.track(mgr)
        done = 0
        for s in steps:
            while done < s:
                tr.step()
                done += 1
            mgr.values["data_pos"] = tr.data_pos
            mgr.save(s)
            expected[s] = tr.weights()
    return expected


def committed_names(st: Storage) -> dict[int, str]:
    return {i.step: i.name for i in scan(st, with_manifest=False) if i.committed}


def restore_into_fresh(backend: Backend) -> tuple[int | None, Trainer, CheckpointManager]:
    tr = Trainer.fresh(seed=123)
    mgr = backend.manager()
    tr.track(mgr)
    try:
        step = mgr.restore_latest()
    finally:
        mgr.close()
    return step, tr, mgr


# --- damage ------------------------------------------------------------------------------


def _rewrite_manifest(st: Storage, name: str, edit: Callable[[dict[str, Any]], None], *,
                      fix_marker: bool) -> None:
    doc = json.loads(st.read_bytes(f"{name}/{MANIFEST}"))
    edit(doc)
    data = json.dumps(doc, indent=1, sort_keys=True).encode()
    st.write_bytes(f"{name}/{MANIFEST}", data)
    if fix_marker:
        st.write_bytes(f"{name}/{MARKER}", marker_bytes(data, int(doc["step"])))


def _truncate(st: Storage, name: str) -> None:
    data = st.read_bytes(f"{name}/shared.pt")
    st.write_bytes(f"{name}/shared.pt", data[: len(data) // 2])


def _flip_byte(st: Storage, name: str) -> None:
    data = bytearray(st.read_bytes(f"{name}/shared.pt"))
    data[len(data) // 2] ^= 0x5A
    st.write_bytes(f"{name}/shared.pt", bytes(data))


def _drop_marker(st: Storage, name: str) -> None:
    st.delete(f"{name}/{MARKER}")


def _edit_manifest_after_commit(st: Storage, name: str) -> None:
    _rewrite_manifest(st, name, lambda d: d["metadata"].update(edited=True), fix_marker=False)


def _drop_manifest(st: Storage, name: str) -> None:
    st.delete(f"{name}/{MANIFEST}")


def _drop_listed_file(st: Storage, name: str) -> None:
    st.delete(f"{name}/rank-00000.pt")


def _add_junk(st: Storage, name: str) -> None:
    st.write_bytes(f"{name}/junk.bin", b"not part of the checkpoint")


def _forge_unreadable(st: Storage, name: str) -> None:
    """Replace shared.pt with bytes that are not a torch file, and forge the manifest and
    the marker so that every size and checksum matches."""
    junk = b"definitely not a torch zip file " * 64
    st.write_bytes(f"{name}/shared.pt", junk)

    def edit(doc: dict[str, Any]) -> None:
        doc["files"]["shared.pt"] = {"size": len(junk), "crc32c": crc32c(junk)}

    _rewrite_manifest(st, name, edit, fix_marker=True)


# (damage, the problem restore_latest's warning and verify_step must name)
DAMAGES: dict[str, tuple[Callable[[Storage, str], None], str]] = {
    "truncated": (_truncate, "shared.pt is"),
    "flipped-byte": (_flip_byte, "checksum mismatch"),
    "no-marker": (_drop_marker, f"no {MARKER} marker"),
    "marker-mismatch": (_edit_manifest_after_commit, "commit marker does not match"),
    "no-manifest": (_drop_manifest, f"{MANIFEST} is missing"),
    "listed-file-missing": (_drop_listed_file, "rank-00000.pt is missing"),
    "extra-file": (_add_junk, "files not in the manifest: junk.bin"),
    "unreadable": (_forge_unreadable, "unreadable"),
}
EXTRA_PROBLEM_WORDS = {"truncated": "truncated"}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_latest_falls_back_to_previous_commit(
        backend: Backend, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    expected = save_steps(backend, [1, 2, 3])
    st = backend.storage()
    name = committed_names(st)[3]
    assert verify_step(st, StepInfo(3, name, True)).ok
    do, problem = DAMAGES[damage]
    do(st, name)

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        step, tr, mgr = restore_into_fresh(backend)
    assert step == 2
    assert_same_tree(expected[2], tr.weights())
    assert mgr.values["data_pos"] == 2 and tr.data_pos == 0  # values live on the manager
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and r.name == LOGGER]

    infos = {i.step: i for i in scan(st)}
    if damage == "no-marker":
        # Not a checkpoint for readers, but never skipped without a word.
        assert not infos[3].committed
        assert any(name in w and problem in w for w in warnings), warnings
        (what,) = verify_step(st, infos[3]).problems
        assert what.startswith("not committed") and f"{MARKER} is missing" in what
    else:
        assert any(name in w and problem in w for w in warnings), warnings
        checked = verify_step(st, infos[3])
        assert not checked.ok and checked.committed
        assert any(problem in p for p in checked.problems), checked.problems
        for word in [EXTRA_PROBLEM_WORDS.get(damage)]:
            assert word is None or any(word in p for p in checked.problems)
    # The untouched steps still verify.
    assert verify_step(st, infos[1]).ok and verify_step(st, infos[2]).ok


def test_all_committed_steps_corrupt_is_an_error_not_a_fresh_start(
        backend: Backend, caplog: pytest.LogCaptureFixture) -> None:
    save_steps(backend, [1, 2, 3])
    st = backend.storage()
    names = committed_names(st)
    _flip_byte(st, names[3])
    _truncate(st, names[2])
    _drop_listed_file(st, names[1])
    tr = Trainer.fresh(seed=5)
    before = tr.weights()
    with backend.manager() as mgr, caplog.at_level(logging.WARNING, logger=LOGGER):
        tr.track(mgr)
        with pytest.raises(CorruptCheckpointError) as info:
            mgr.restore_latest()
    msg = str(info.value)
    assert "3 committed checkpoint(s)" in msg and "none verifies" in msg
    assert "checksum mismatch" in msg and "truncated" in msg and "rank-00000.pt is missing" in msg
    assert st.url in msg
    assert_same_tree(before, tr.weights())  # nothing was loaded
    assert sum(r.levelno == logging.WARNING and r.name == LOGGER for r in caplog.records) == 3


def test_empty_or_missing_directory_restores_nothing(backend: Backend) -> None:
    with backend.manager() as mgr:  # the manager's write probe leaves nothing behind
        assert mgr.restore_latest() is None
        assert scan(mgr.storage) == []


def test_missing_local_directory_restores_nothing(tmp_path: Any) -> None:
    with CheckpointManager(str(tmp_path / "a" / "b"), options=CheckpointOptions()) as mgr:
        assert mgr.restore_latest() is None


def test_state_mismatch_lists_differences_and_loads_nothing(cheap_backend: Backend) -> None:
    save_steps(cheap_backend, [1])
    torch.manual_seed(77)
    other = Net(hidden=9, extra=True)
    opt = torch.optim.Adam(other.parameters())
    before = {k: v.clone() for k, v in other.state_dict().items()}
    rng_before = torch.get_rng_state()
    with cheap_backend.manager() as mgr:
        mgr.track(model=other, optimizer=opt)
        mgr.values["sentinel"] = 1
        with pytest.raises(StateMismatchError) as info:
            mgr.restore_latest()
        assert mgr.values == {"sentinel": 1}
        assert mgr.last_commit_step is None
    msg = str(info.value)
    assert "'model'" in msg
    assert "fc1.weight: checkpoint (16, 8) vs model (9, 8)" in msg
    assert "fc2.weight: checkpoint (4, 16) vs model (4, 9)" in msg
    assert "missing keys" in msg and "fc3.weight" in msg and "fc3.bias" in msg
    assert_same_tree(before, {k: v for k, v in other.state_dict().items()})
    assert opt.state_dict()["state"] == {}
    assert torch.equal(rng_before, torch.get_rng_state())


def test_state_mismatch_on_tracked_names(tmp_path: Any) -> None:
    backend = Backend("local", str(tmp_path / "ckpt"))
    save_steps(backend, [1])
    tr = Trainer.fresh()
    before = tr.weights()
    with backend.manager() as mgr:
        mgr.track(model=tr.model, scheduler_like=torch.optim.Adam(tr.model.parameters()))
        with pytest.raises(StateMismatchError) as info:
            mgr.restore_latest()
    assert "tracked but not in the checkpoint" in str(info.value)
    assert "scheduler_like" in str(info.value) and "optimizer" in str(info.value)
    assert_same_tree(before, tr.weights())


def test_verify_lists_a_step_without_its_marker_and_fails(
        cheap_backend: Backend, capsys: pytest.CaptureFixture[str]) -> None:
    backend = cheap_backend  # the CLI takes a URL only: no emulator endpoint
    save_steps(backend, [1, 2])
    st = backend.storage()
    name = committed_names(st)[2]
    _drop_marker(st, name)
    assert cli.main(["checkpoints", "verify", backend.url]) == 1
    out = capsys.readouterr().out
    assert name in out and "uncommitted" in out and f"{MARKER} is missing" in out, out
    assert cli.main(["checkpoints", "verify", backend.url, "--step", "2", "--json"]) == 1
    (row,) = json.loads(capsys.readouterr().out)
    assert row["name"] == name and not row["committed"] and not row["ok"]
    assert cli.main(["checkpoints", "verify", backend.url, "--step", "1"]) == 0


def test_verify_lists_a_temporary_directory_without_failing(
        tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """A save in progress (or one that crashed) is not a damaged checkpoint."""
    backend = Backend("local", str(tmp_path / "ckpt"))
    save_steps(backend, [1])
    tmp = _leftover(backend.storage(), 2, "deadbeef")
    assert cli.main(["checkpoints", "verify", backend.url]) == 0
    out = capsys.readouterr().out
    assert tmp in out and "save in progress or one that never finished" in out, out


class _RunsCode:
    """What a tampered checkpoint could hold: unpickling it would call os.mkdir(path)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.path,))


def test_a_pickle_that_would_run_code_is_refused_with_the_reason_not_the_advice(
        tmp_path: Any, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    backend = Backend("local", str(tmp_path / "ckpt"))
    expected = save_steps(backend, [1, 2])
    st = backend.storage()
    name = committed_names(st)[2]
    ran = tmp_path / "the-payload-ran"
    buf = io.BytesIO()
    torch.save({"model": _RunsCode(str(ran))}, buf)
    evil = buf.getvalue()
    st.write_bytes(f"{name}/shared.pt", evil)
    _rewrite_manifest(st, name, lambda d: d["files"].update(
        {"shared.pt": {"size": len(evil), "crc32c": crc32c(evil)}}), fix_marker=True)

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        step, tr, _ = restore_into_fresh(backend)
    assert step == 1 and not ran.exists()
    assert_same_tree(expected[1], tr.weights())
    assert cli.main(["checkpoints", "verify", backend.url]) == 1
    out = capsys.readouterr().out
    assert not ran.exists()
    for text in ([r.getMessage() for r in caplog.records if name in r.getMessage()]
                 + [line for line in out.splitlines() if "shared.pt" in line]):
        # The reason, whole: which global, and that its module is blocked.
        assert "unreadable as a weights-only torch file" in text, text
        assert "GLOBAL posix.mkdir whose module posix is blocked" in text, text
        # And none of torch's advice to load it with weights_only=False.
        for advice in ("weights_only` set to `False`", "weights_only=False", "likely succeed",
                       "arbitrary code", "trusted source", "safe_globals"):
            assert advice not in text, text


@pytest.mark.parametrize("zero_copy", [True, False])
def test_a_streamed_files_bytes_load_as_views_and_code_is_refused_the_same_way(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, zero_copy: bool) -> None:
    """load_buffer (what a read-once restore loads on every rank): the tensors come out
    equal and, on this torch, as views of the received bytes (no copy); a file that would
    run code is refused as load_verified refuses it. Without torch's zero-copy loader it
    copies, with the same result."""
    assert loader._ZERO_COPY   # this torch has it: a torch that drops it is noticed here
    monkeypatch.setattr(loader, "_ZERO_COPY", zero_copy)
    want = {"model": {"w": torch.randn(64, 32), "b": torch.arange(5, dtype=torch.int16)},
            "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}}, "n": 7}
    raw = io.BytesIO()
    torch.save(want, raw)
    buf = torch.frombuffer(bytearray(raw.getvalue()), dtype=torch.uint8)
    got = loader.load_buffer(buf, "gs://b/step/shared.pt")
    assert got["n"] == 7
    assert torch.equal(got["model"]["w"], want["model"]["w"])
    assert torch.equal(got["model"]["b"], want["model"]["b"])
    assert torch.equal(got["optimizer"]["state"][0]["step"], want["optimizer"]["state"][0]["step"])
    inside = buf.data_ptr() <= got["model"]["w"].data_ptr() < buf.data_ptr() + buf.numel()
    assert inside == zero_copy
    ran = tmp_path / "the-payload-ran"
    evil = io.BytesIO()
    torch.save({"model": _RunsCode(str(ran))}, evil)
    with pytest.raises(CorruptCheckpointError) as err:
        loader.load_buffer(torch.frombuffer(bytearray(evil.getvalue()), dtype=torch.uint8),
                           "gs://b/step/shared.pt")
    assert not ran.exists()
    text = str(err.value)
    assert text.startswith("gs://b/step/shared.pt: unreadable as a weights-only torch file")
    assert "GLOBAL posix.mkdir whose module posix is blocked" in text, text
    assert "weights_only=False" not in text and "weights_only` set to `False`" not in text


# --- retention and leftovers -------------------------------------------------------------


def test_retention_keeps_last_two_and_milestones(cheap_backend: Backend) -> None:
    policy = RetentionPolicy(keep_last=2, milestone_every_steps=4)
    tr = Trainer.fresh()
    with cheap_backend.manager(retention=policy) as mgr:
        tr.track(mgr)
        for s in range(1, 12):
            tr.step()
            mgr.save(s)
            mgr.wait()    # retention runs in the background after the commit
            expect = {k for k in range(1, s + 1) if k % 4 == 0} | {s - 1, s} - {0}
            assert set(committed_names(mgr.storage)) == expect, s
    st = cheap_backend.storage()
    assert set(committed_names(st)) == {4, 8, 10, 11}
    assert all(verify_step(st, i).ok for i in scan(st))


@pytest.mark.parametrize("damage", [_truncate, _flip_byte], ids=["truncated", "flipped"])
def test_a_corrupt_latest_never_makes_retention_delete_the_good_steps(
        cheap_backend: Backend, damage: Callable[[Storage, str], None]) -> None:
    # keep_last=1 and a corrupt newest step: restore falls back to step 4, and the commit
    # that follows must not count step 6 as "the one to keep" and delete 4 and 5.
    save_steps(cheap_backend, [2, 4, 6], retention=RetentionPolicy(keep_last=3))
    st = cheap_backend.storage()
    damage(st, committed_names(st)[6])
    tr = Trainer.fresh(seed=7)
    with cheap_backend.manager(retention=RetentionPolicy(keep_last=1)) as mgr:
        tr.track(mgr)
        assert mgr.restore_latest() == 4
        tr.step()
        mgr.save(5)
        mgr.wait()   # retention runs in the background after the commit
        # 5 is the newest usable step; the broken 6 stays (newer: its save moves it aside).
        assert set(committed_names(st)) == {5, 6}
        tr.step()
        mgr.save(6)
        mgr.wait()
    assert set(committed_names(st)) == {6}
    assert all(verify_step(st, i).ok for i in scan(st) if i.committed)
    step, _, _ = restore_into_fresh(cheap_backend)
    assert step == 6


def test_a_fresh_start_says_so_and_points_at_steps_one_level_down(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    save_steps(Backend("local", str(tmp_path / "run" / "checkpoints")), [2])
    with caplog.at_level(logging.INFO, logger=LOGGER):
        step, _, _ = restore_into_fresh(Backend("local", str(tmp_path / "run")))
    assert step is None
    assert "checkpoints holds step directories: is the checkpoint directory one level too " \
           "high?" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        restore_into_fresh(Backend("local", str(tmp_path / "new")))
    assert "no checkpoint in" in caplog.text and "starting from step 0" in caplog.text


def test_cli_prune_verifies_before_it_counts(tmp_path: Any,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    backend = Backend("local", str(tmp_path / "ckpt"))
    save_steps(backend, [2, 4, 6])
    st = backend.storage()
    _flip_byte(st, committed_names(st)[6])    # same size: only a checksum finds it
    assert cli.main(["checkpoints", "prune", backend.url, "--keep-last", "1"]) == 0
    assert "deleted 1: step-000000000002" in capsys.readouterr().out
    assert set(committed_names(st)) == {4, 6}


def test_retention_never_deletes_the_only_commit(cheap_backend: Backend,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    tr = Trainer.fresh()
    with cheap_backend.manager(retention=RetentionPolicy(keep_last=1)) as mgr:
        tr.track(mgr)
        for s in (1, 2):
            tr.step()
            mgr.save(s)
            mgr.wait()    # retention runs in the background after the commit
            assert set(committed_names(mgr.storage)) == {s}
        # A save that fails before its marker must not cost the only commit.
        real = Storage.write_bytes

        def no_marker(self: Storage, rel: str, data: Any, **kw: Any) -> None:
            if rel.endswith(MARKER):
                raise OSError("injected: disk full")
            real(self, rel, data, **kw)

        monkeypatch.setattr(Storage, "write_bytes", no_marker)
        with pytest.raises(OSError, match="disk full"):
            mgr.save(3)
        monkeypatch.setattr(Storage, "write_bytes", real)
        assert set(committed_names(mgr.storage)) == {2}
    step, _, _ = restore_into_fresh(cheap_backend)
    assert step == 2


def _leftover(st: Storage, step: int, token: str) -> str:
    if st.atomic_rename:
        name = f"{TMP_PREFIX}{step_dirname(step)}-{token}"
    else:
        name = f"{step_dirname(step)}-{token}"
    st.write_bytes(f"{name}/shared.pt", b"half a checkpoint")
    return name


def test_uncommitted_leftovers_older_than_latest_are_cleaned(backend: Backend) -> None:
    tr = Trainer.fresh()
    with backend.manager() as mgr:
        tr.track(mgr)
        tr.step()
        mgr.save(1)
        st = mgr.storage
        old_other = _leftover(st, 2, "deadbeef")        # a crashed run's save of step 2
        old_mine = _leftover(st, 2, mgr._persistent.token)  # this run's token: never touched
        newer_other = _leftover(st, 9, "cafebabe")      # not older than the latest commit
        names = set(st.listdir(""))
        assert {old_other, old_mine, newer_other} <= names
        assert [i.step for i in scan(st) if i.committed] == [1]
        tr.step()
        mgr.save(3)
        mgr.wait()        # retention runs in the background after the commit
        names = set(st.listdir(""))
    assert old_other not in names
    assert old_mine in names and newer_other in names
    assert set(committed_names(st)) == {1, 3}


def test_crash_while_deleting_an_old_step_leaves_no_committed_half(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Retention deletes a directory file by file; a crash part-way must not leave a step
    that still has its marker but lost a data file."""
    backend = Backend("local", str(tmp_path / "ckpt"))
    tr = Trainer.fresh()
    real_rmtree = shutil.rmtree

    class Killed(BaseException):
        pass

    def dies_after_one_file(path: Any, *a: Any, **kw: Any) -> None:
        # Data files go first (the worst order for a plain rmtree), then "SIGKILL".
        victims = sorted(os.listdir(path), key=lambda n: n in (MARKER, MANIFEST))
        os.remove(os.path.join(path, victims[0]))
        raise Killed()

    with backend.manager(retention=RetentionPolicy(keep_last=1)) as mgr:
        tr.track(mgr)
        tr.step()
        mgr.save(1)
        monkeypatch.setattr(shutil, "rmtree", dies_after_one_file)
        tr.step()
        mgr.save(2)       # committed; retention then "dies" in the background
        with pytest.raises(Killed):
            mgr.wait()
        monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    st = backend.storage()
    for info in scan(st):
        if info.committed:
            assert verify_step(st, info).ok, info


@pytest.mark.parametrize("damage", ["flipped-byte", "no-marker"])
def test_resaving_a_step_over_a_broken_directory_commits_it(tmp_path: Any, damage: str) -> None:
    """Restore falls back past a broken step N, training reaches N again and saves it: the
    new save must really commit (not be dropped as a 'duplicate' of the broken one)."""
    backend = Backend("local", str(tmp_path / "ckpt"))
    save_steps(backend, [1, 2, 3])
    st = backend.storage()
    DAMAGES[damage][0](st, step_dirname(3))
    tr = Trainer.fresh(seed=9)
    with backend.manager() as mgr:
        tr.track(mgr)
        assert mgr.restore_latest() == 2
        tr.step()
        mgr.save(3)
        assert mgr.last_commit_step == 3
        expected = tr.weights()
    info = {i.step: i for i in scan(st)}[3]
    assert verify_step(st, info).ok, verify_step(st, info).problems
    step, fresh, _ = restore_into_fresh(backend)
    assert step == 3
    assert_same_tree(expected, fresh.weights())


# --- async saves -------------------------------------------------------------------------


def test_async_error_from_write_bytes_surfaces_on_next_maybe_save(
        cheap_backend: Backend, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    real = Storage.write_bytes

    def write_bytes(self: Storage, rel: str, data: Any, **kw: Any) -> None:
        if step_dirname(2) in rel and rel.endswith(MANIFEST):
            raise OSError("injected: write failed")
        real(self, rel, data, **kw)

    monkeypatch.setattr(Storage, "write_bytes", write_bytes)
    tr = Trainer.fresh()
    with cheap_backend.manager(async_save=True, save_every_steps=1) as mgr:
        tr.track(mgr)
        tr.step()
        assert mgr.maybe_save(1)
        mgr.wait()
        tr.step()
        assert mgr.maybe_save(2)          # starts the save that fails in the background
        tr.step()
        with caplog.at_level(logging.ERROR, logger=LOGGER), \
                pytest.raises(CheckpointError, match="background checkpoint save failed") as info:
            mgr.maybe_save(3)
        assert "injected: write failed" in str(info.value)
        assert isinstance(info.value.__cause__, OSError)
        # A plain OSError is not known to be transient: exit 1 if it escapes.
        assert classify_exception(info.value) is Classification.PERMANENT
        assert any("step 2 failed" in r.getMessage() for r in caplog.records)
        assert set(committed_names(mgr.storage)) == {1}
        # Raised once, then the manager works again.
        assert mgr.maybe_save(3)
        mgr.wait()
        assert set(committed_names(mgr.storage)) == {1, 3}


def test_a_background_save_lost_to_a_storage_outage_is_transient(
        cheap_backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    def unavailable(self: Storage, rel: str, data: Any, **kw: Any) -> None:
        raise StorageUnavailableError("injected: gs://b/x: 503 for 300 s")

    tr = Trainer.fresh()
    with cheap_backend.manager(async_save=True, save_every_steps=1) as mgr:
        tr.track(mgr)
        tr.step()
        monkeypatch.setattr(Storage, "write_bytes", unavailable)
        assert mgr.maybe_save(1)
        with pytest.raises(CheckpointError, match="503 for 300 s") as info:
            mgr.wait()
        monkeypatch.undo()
    # Escaping @rt.main / @rt.record it exits 134: the platform retries the job.
    assert classify_exception(info.value) is Classification.TRANSIENT


@pytest.mark.parametrize("surface", ["wait", "close", "save"])
def test_async_error_surfaces_on_wait_close_and_save(
        cheap_backend: Backend, monkeypatch: pytest.MonkeyPatch, surface: str) -> None:
    def boom(self: Storage, rel: str, data: Any, **kw: Any) -> None:
        raise OSError(f"injected failure writing {rel}")

    tr = Trainer.fresh()
    mgr = cheap_backend.manager(async_save=True)
    tr.track(mgr)
    monkeypatch.setattr(Storage, "write_bytes", boom)
    mgr.save(1)
    with pytest.raises(CheckpointError, match="injected failure writing") as info:
        getattr(mgr, surface)(*((2,) if surface == "save" else ()))
    assert isinstance(info.value.__cause__, OSError)
    monkeypatch.undo()
    if surface != "close":
        mgr.close()
    assert committed_names(cheap_backend.storage()) == {}


@pytest.mark.parametrize("how", ["replaced-by-a-file", "read-only"])
def test_async_error_when_the_directory_goes_bad_mid_run(tmp_path: Any, how: str) -> None:
    if how == "read-only" and os.geteuid() == 0:
        pytest.skip("root ignores directory permissions")
    root = tmp_path / "ckpt"
    tr = Trainer.fresh()
    mgr = Backend("local", str(root)).manager(async_save=True, save_every_steps=1)
    tr.track(mgr)
    tr.step()
    mgr.maybe_save(1)
    mgr.wait()
    if how == "read-only":
        root.chmod(0o555)
    else:
        shutil.rmtree(root)                 # someone deletes the directory mid-run ...
        root.write_text("not a directory")  # ... and something else takes the name
    try:
        tr.step()
        assert mgr.maybe_save(2)
        tr.step()
        with pytest.raises(CheckpointError) as info:
            mgr.maybe_save(3)
        assert str(root) in str(info.value)
    finally:
        if how == "read-only":
            root.chmod(0o755)
        else:
            root.unlink()
    mgr.close()  # the error was reported once: close is clean


def _blocked_in_wait(thread: threading.Thread) -> bool:
    frame = current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == "wait" and frame.f_code.co_filename.endswith("threading.py"):
            return True
        frame = frame.f_back
    return False


def test_one_save_in_flight_at_a_time(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second save waits for the first: gate the first write and watch the second save's
    thread block, instead of timing anything."""
    entered, release = threading.Event(), threading.Event()
    events: list[str] = []
    real_open_write = Storage.open_write

    def gated_open_write(self: Storage, rel: str, **kw: Any) -> Any:
        events.append(f"write {rel.split('/')[0]} {rel.rsplit('/', 1)[-1]}")
        if rel.endswith("shared.pt") and not entered.is_set():
            entered.set()
            assert release.wait(DEADLINE_S), "never released"
        return real_open_write(self, rel, **kw)

    monkeypatch.setattr(Storage, "open_write", gated_open_write)
    backend = Backend("local", str(tmp_path / "ckpt"))
    model = torch.nn.Linear(4, 4)
    with backend.manager(async_save=True) as mgr:
        mgr.track(model=model)
        real_snapshot = mgr._snapshot.snapshot

        def snapshot(tree: Any, **kw: Any) -> Any:
            events.append("snapshot")
            return real_snapshot(tree, **kw)

        mgr._snapshot.snapshot = snapshot  # type: ignore[method-assign]
        with torch.no_grad():
            model.weight.fill_(1.0)
        mgr.save(1)
        assert entered.wait(DEADLINE_S)
        with torch.no_grad():
            model.weight.fill_(2.0)
        second = threading.Thread(target=mgr.save, args=(2,))
        second.start()
        deadline = time.monotonic() + DEADLINE_S
        while second.is_alive() and not _blocked_in_wait(second):
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert second.is_alive(), "the second save did not wait for the first"
        assert events.count("snapshot") == 1
        release.set()
        second.join(DEADLINE_S)
        mgr.wait()
    snap2 = events.index("snapshot", 1)
    assert all("step-000000000001" in e for e in events[1:snap2]), events
    st = backend.storage()
    for step, value in ((1, 1.0), (2, 2.0)):
        blob = st.read_bytes(f"{step_dirname(step)}/shared.pt")
        state = torch.load(io.BytesIO(blob), weights_only=True)
        assert torch.all(state["model"]["weight"] == value), step


# --- resume exactness --------------------------------------------------------------------


def _reseed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _next_draws() -> tuple[torch.Tensor, float, float]:
    return torch.rand(3), random.random(), float(np.random.rand())


def _run_uninterrupted(total: int) -> tuple[Trainer, tuple[torch.Tensor, float, float]]:
    _reseed(42)
    tr = Trainer.fresh(seed=0)
    _reseed(42)
    for _ in range(total):
        tr.step()
    return tr, _next_draws()


@pytest.mark.parametrize("async_save", [False, True])
def test_resume_is_bitwise_exact(cheap_backend: Backend, async_save: bool) -> None:
    """Train to 8 with saves every 3, crash, restore (step 6) into fresh objects with other
    weights and RNG states, train to 11: bitwise the same as an uninterrupted run to 11."""
    total, crash_at, every = 11, 8, 3
    reference, reference_draws = _run_uninterrupted(total)

    _reseed(42)
    tr = Trainer.fresh(seed=0)
    _reseed(42)
    mgr = cheap_backend.manager(async_save=async_save, save_every_steps=every)
    tr.track(mgr)
    for s in range(1, crash_at + 1):
        tr.step()
        mgr.values["data_pos"] = tr.data_pos
        mgr.maybe_save(s)
    mgr.close()
    del tr, mgr  # "crash": nothing survives but the checkpoint directory

    _reseed(999)  # a new process starts with other RNG states and other weights
    tr = Trainer.fresh(seed=7)
    with cheap_backend.manager(async_save=async_save, save_every_steps=every) as mgr:
        tr.track(mgr)
        step = mgr.restore_latest()
        assert step == 6
        tr.data_pos = mgr.values["data_pos"]
        assert tr.data_pos == 6
        for s in range(step + 1, total + 1):
            tr.step()
            mgr.values["data_pos"] = tr.data_pos
            mgr.maybe_save(s)
        draws = _next_draws()

    assert_same_tree(reference.model.state_dict(), tr.model.state_dict(), "model")
    assert_same_tree(reference.opt.state_dict(), tr.opt.state_dict(), "optimizer")
    assert_same_tree(reference_draws, draws, "next random draws")  # torch, python, numpy
    assert tr.data_pos == reference.data_pos == total


# --- GCS emulator ------------------------------------------------------------------------


def _proxy_backend(proxy: FaultProxy, bucket: Any) -> Backend:
    return Backend("gcs", f"{bucket.url}/run", {"endpoint_url": proxy.endpoint, "token": "anon"})


def test_gcs_round_trip_through_gcsfs(gcs_bucket: Any) -> None:
    backend = Backend("gcs", f"{gcs_bucket.url}/run", dict(gcs_bucket.storage_options))
    expected = save_steps(backend, [1, 2], async_save=True)
    st = backend.storage()
    names = committed_names(st)
    assert set(names) == {1, 2}
    # Object stores commit in place: a fresh token-suffixed name per run, marker last.
    assert all(n.startswith(step_dirname(s) + "-") for s, n in names.items())
    assert sorted(st.listdir(names[2])) == [MARKER, MANIFEST, "rank-00000.pt", "shared.pt"]
    step, tr, mgr = restore_into_fresh(backend)
    assert step == 2 and mgr.values == {"data_pos": 2}
    assert_same_tree(expected[2], tr.weights())


@pytest.fixture
def fast_gcsfs_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """gcsfs sleeps 1, 2, 4 s between its own retries; the same retries, 100x faster."""
    import asyncio

    import gcsfs.retry

    real_sleep = asyncio.sleep
    monkeypatch.setattr(gcsfs.retry, "asyncio",
                        types.SimpleNamespace(sleep=lambda s: real_sleep(s / 100)))


def test_gcs_503s_on_upload_are_retried_and_the_save_commits(
        gcs_proxy: FaultProxy, gcs_bucket: Any, fast_gcsfs_backoff: None) -> None:
    backend = _proxy_backend(gcs_proxy, gcs_bucket)
    tr = Trainer.fresh()
    with backend.manager() as mgr:
        tr.track(mgr)
        tr.step()
        gcs_proxy.inject(503, count=3, method="POST", path="/upload/")
        mgr.save(1)
        assert mgr.last_commit_step == 1
    assert gcs_proxy.injected == 3
    st = backend.storage()
    info = {i.step: i for i in scan(st)}[1]
    assert verify_step(st, info).ok
    step, fresh, _ = restore_into_fresh(backend)
    assert step == 1
    assert_same_tree(tr.weights(), fresh.weights())


def test_gcs_403_fails_construction_at_once(gcs_proxy: FaultProxy, gcs_bucket: Any) -> None:
    gcs_proxy.inject(403, count=None)
    url = f"{gcs_bucket.url}/run"
    t0 = time.monotonic()
    with pytest.raises(StoragePermissionError) as info:
        CheckpointManager(url, options=CheckpointOptions(  # the production retry deadline
            storage_options={"endpoint_url": gcs_proxy.endpoint, "token": "anon"}))
    assert time.monotonic() - t0 < 5.0
    assert url in str(info.value) and "permission denied" in str(info.value)
    assert gcs_proxy.forwarded == 0 and gcs_proxy.injected >= 1


def test_gcs_missing_bucket_fails_construction(gcs_server: Any) -> None:
    url = f"gs://no-such-bucket-{uuid.uuid4().hex[:8]}/run"
    t0 = time.monotonic()
    with pytest.raises(StorageNotFoundError, match="does not exist") as info:
        CheckpointManager(url, options=CheckpointOptions(
            storage_options={"endpoint_url": gcs_server.endpoint}))
    assert time.monotonic() - t0 < 5.0
    assert url in str(info.value)
