"""A save that fills the disk: it fails clearly, removes what it wrote, keeps the last
committed step, and the next save succeeds once space frees; crashed saves' leftovers are
removed at start; the write probe leaves nothing behind.

Two disks, the same scenarios on each:
    * ``tmpfs``: a real 20 MiB tmpfs mounted for the test (needs root and a ``mount`` that
      works here; skipped otherwise), unmounted in teardown;
    * ``injected``: a 20 MiB quota on a directory of the test's tmp_path, enforced on every
      file that storage/base.py opens for writing: a write that does not fit writes what fits and
      raises ENOSPC, as a real disk does. It always runs. (fileio's O_DIRECT path writes with
      os.pwrite on the descriptor, past the quota: it is switched off there; the tmpfs
      variant runs it.)
"""

from __future__ import annotations

import builtins
import errno
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from resilient_train.checkpoint.commit.directory import TMP_PREFIX, scan, verify_step
from resilient_train.checkpoint.commit.manifest import CheckpointError, step_dirname
from resilient_train.checkpoint.commit.retention import RetentionPolicy
from resilient_train.checkpoint.errors import CheckpointStorageFullError
from resilient_train.checkpoint.manager import CheckpointManager, CheckpointOptions
from resilient_train.checkpoint.storage import base as storage_mod
from resilient_train.checkpoint.storage import fileio
from resilient_train.checkpoint.storage.base import StorageFullError
from resilient_train.checkpoint.tiers import persistent as persistent_mod
from resilient_train.errors import Classification, classify_exception

MiB = 1 << 20
CAPACITY = 20 * MiB
LOGGER = persistent_mod.log.name   # the checkpoint directory's saves and restores


# --- the two disks -----------------------------------------------------------------------


class Disk:
    """A small filesystem under ``root``: what is free, and ballast to fill it."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def free(self) -> int:
        raise NotImplementedError

    def ballast(self, name: str, nbytes: int | None = None) -> Path:
        """A file of nbytes (None: until the disk is full) that is not a checkpoint."""
        path = self.root / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        chunk = b"\xa5" * MiB
        left = nbytes if nbytes is not None else CAPACITY * 2
        try:
            while left > 0:
                room = self.room()
                if room is not None and room <= 0:
                    break
                want = min(left, len(chunk), room if room is not None else len(chunk))
                try:
                    n = os.write(fd, chunk[:want])
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    if want == 1:
                        break
                    chunk = chunk[: max(1, want // 2)]  # fill the last pages too
                    continue
                left -= n
        finally:
            os.close(fd)
        return path

    def room(self) -> int | None:
        return None


class Tmpfs(Disk):
    def free(self) -> int:
        return shutil.disk_usage(self.root).free


class QuotaDisk(Disk):
    """CAPACITY bytes under root: the sum of the sizes of the files there."""

    def used(self) -> int:
        total = 0
        for parent, _dirs, files in os.walk(self.root):
            for name in files:
                try:
                    total += os.lstat(os.path.join(parent, name)).st_size
                except FileNotFoundError:
                    pass
        return total

    def free(self) -> int:
        return max(0, CAPACITY - self.used())

    def room(self) -> int | None:
        return self.free()

    def open(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = builtins.open(file, mode, *args, **kwargs)
        inside = os.path.abspath(os.fspath(file)).startswith(str(self.root) + os.sep)
        if inside and any(c in mode for c in "wax+"):
            return _QuotaFile(f, self)
        return f


class _QuotaFile:
    """A binary file whose writes fail with ENOSPC past the quota (a short write first)."""

    def __init__(self, f: Any, disk: QuotaDisk) -> None:
        self._f = f
        self._disk = disk

    def write(self, data: Any) -> int:
        data = memoryview(data).cast("B")
        self._f.flush()
        room = self._disk.free()
        if data.nbytes > room:
            if room:
                self._f.write(data[:room])
                self._f.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = self._f.write(data)
        self._f.flush()  # the size on disk is what the quota counts
        return n

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return int(self._f.fileno())

    def close(self) -> None:
        self._f.close()

    @property
    def closed(self) -> bool:
        return bool(self._f.closed)

    def __enter__(self) -> _QuotaFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _mount_tmpfs(where: Path) -> str | None:
    """None when mounted, else why not."""
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return "no mount / umount command"
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={CAPACITY // MiB}m", "tmpfs",
                        str(where)], capture_output=True, text=True, timeout=30)
    return None if r.returncode == 0 else f"mount failed: {r.stderr.strip() or r.returncode}"


@pytest.fixture(params=["tmpfs", "injected"])
def disk(request: pytest.FixtureRequest, tmp_path: Path,
         monkeypatch: pytest.MonkeyPatch) -> Iterator[Disk]:
    if request.param == "tmpfs":
        mnt = tmp_path / "tmpfs"
        why_not = _mount_tmpfs(mnt)
        if why_not is not None:
            pytest.skip(f"no small tmpfs: {why_not} (the injected variant covers this)")
        try:
            yield Tmpfs(mnt)
        finally:
            if subprocess.run(["umount", str(mnt)], capture_output=True,
                              timeout=30).returncode != 0:
                subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)
        return
    quota = QuotaDisk(tmp_path / "quota")
    quota.root.mkdir()
    monkeypatch.setattr(storage_mod, "open", quota.open, raising=False)
    monkeypatch.setattr(fileio, "ENABLED", False)
    # What the error reports as free: the quota's, not the real disk's.
    fake_free = lambda _path: quota.free()  # noqa: E731
    monkeypatch.setattr(storage_mod, "free_bytes", fake_free)
    monkeypatch.setattr(persistent_mod, "free_bytes", fake_free)
    yield quota


# --- a model of about 6 MiB --------------------------------------------------------------


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(1024, 1536)  # 1.57 M float32 parameters: 6.0 MiB


def _manager(root: Path, **options: Any) -> CheckpointManager:
    options.setdefault("async_save", False)
    options.setdefault("retention", RetentionPolicy(keep_last=1))
    return CheckpointManager(str(root), options=CheckpointOptions(**options))


def _everything_under(root: Path) -> list[str]:
    """Every name under root, hidden scratch files included."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _committed(root: Path) -> list[int]:
    st = storage_mod.Storage(str(root))
    return [i.step for i in scan(st) if i.committed and verify_step(st, i).ok]


def _assert_clean(ckpt: Path, steps: list[int]) -> None:
    """Only the committed steps' directories, nothing of the failed save."""
    assert sorted(os.listdir(ckpt)) == [step_dirname(s) for s in steps], _everything_under(ckpt)
    assert _committed(ckpt) == steps


def _check_no_space_error(exc: CheckpointStorageFullError, ckpt: Path, step: int,
                          last: int | None) -> None:
    msg = str(exc)
    # The checkpoint directory, and the file that did not fit.
    assert f"checkpoint step {step} was not saved: no space left in {ckpt} (rank 0 writing " \
           f"{ckpt}/{TMP_PREFIX}{step_dirname(step)}-" in msg, msg
    assert "This save needs about 6.0 MiB" in msg, msg
    assert " free there now" in msg and "next save tries again" in msg, msg
    if last is not None:
        assert f"the last committed step, {last}, is kept" in msg, msg
    assert exc.needed_bytes >= 6 * MiB
    assert exc.free_bytes is not None and exc.free_bytes < 6 * MiB
    assert any(isinstance(e, StorageFullError) or getattr(e, "errno", None) == errno.ENOSPC
               for e in _causes(exc))
    # A full disk needs someone to free space: rerunning the job would not help.
    assert classify_exception(exc) is Classification.PERMANENT


def _causes(exc: BaseException) -> list[BaseException]:
    out = []
    e: BaseException | None = exc
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


# --- the scenarios ---------------------------------------------------------------------


def test_a_save_that_fills_the_disk_fails_clearly_and_the_next_one_succeeds(
        disk: Disk) -> None:
    ckpt = disk.root / "ckpt"
    ballast = disk.ballast("other-data.bin", 10 * MiB)   # something else on the disk
    model = _model(0)
    with _manager(ckpt) as mgr:
        mgr.track(model=model)
        mgr.save(1)                                      # 6 MiB: 16 of 20 used
        free_before = disk.free()
        with torch.no_grad():
            model.weight.add_(1.0)
        with pytest.raises(CheckpointStorageFullError) as info:
            mgr.save(2)                                  # 6 more do not fit
        _check_no_space_error(info.value, ckpt, 2, last=1)
        # The partial step is gone and its space is back; step 1 is untouched.
        _assert_clean(ckpt, [1])
        assert disk.free() >= free_before - 64 * 1024
        assert mgr.last_commit_step == 1
        # The space frees: the next save commits (and retention drops step 1).
        ballast.unlink()
        mgr.save(2)
        mgr.wait()
        assert mgr.last_commit_step == 2
    _assert_clean(ckpt, [2])
    fresh = _model(7)
    with _manager(ckpt) as mgr:
        mgr.track(model=fresh)
        assert mgr.restore_latest() == 2
    assert torch.equal(fresh.weight, model.weight)


def test_a_background_save_on_a_full_disk_is_reported_and_the_loop_can_go_on(
        disk: Disk, caplog: pytest.LogCaptureFixture) -> None:
    ckpt = disk.root / "ckpt"
    ballast = disk.ballast("other-data.bin", 10 * MiB)
    model = _model(0)
    with _manager(ckpt, async_save=True, save_every_steps=1) as mgr:
        mgr.track(model=model)
        assert mgr.maybe_save(1)
        mgr.wait()
        assert mgr.maybe_save(2)          # fails in the writer thread
        with caplog.at_level(logging.ERROR, logger=LOGGER), \
                pytest.raises(CheckpointError, match="background checkpoint save failed") as info:
            mgr.maybe_save(3)             # ... and is raised by the next call
        full = info.value.__cause__
        assert isinstance(full, CheckpointStorageFullError), repr(full)
        _check_no_space_error(full, ckpt, 2, last=1)
        assert classify_exception(info.value) is Classification.PERMANENT
        assert any("step 2 failed" in r.getMessage() and "no space left" in r.getMessage()
                   for r in caplog.records)
        _assert_clean(ckpt, [1])
        # A loop that catches the error goes on; the next save, once space frees, commits.
        ballast.unlink()
        assert mgr.maybe_save(3)
        mgr.wait()
        assert mgr.last_commit_step == 3
    _assert_clean(ckpt, [3])


def test_leftovers_of_crashed_saves_are_removed_at_start(
        disk: Disk, caplog: pytest.LogCaptureFixture) -> None:
    ckpt = disk.root / "ckpt"
    model = _model(0)
    with _manager(ckpt) as mgr:
        mgr.track(model=model)
        mgr.save(1)
    # A run that crashed while saving step 2 filled the disk with its temporary directory
    # (and a scratch file of an interrupted atomic write).
    crashed = ckpt / f"{TMP_PREFIX}{step_dirname(2)}-deadbeef"
    crashed.mkdir()
    scratch = ckpt / f"{storage_mod.TMP_FILE_PREFIX}manifest.json-0123456789ab"
    scratch.write_bytes(b"{")
    os.utime(scratch, (time.time() - 3600,) * 2)   # an hour old: no live write's
    disk.ballast(str(crashed.relative_to(disk.root) / "shared.pt"))   # until the disk is full
    assert disk.free() < 64 * 1024
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        mgr = _manager(ckpt)              # the write probe passes: the leftovers went first
    try:
        assert "removed 2 leftover(s) of saves that never finished" in caplog.text
        _assert_clean(ckpt, [1])
        assert disk.free() > 12 * MiB
        fresh = _model(5)
        mgr.track(model=fresh)
        assert mgr.restore_latest() == 1
        assert torch.equal(fresh.weight, model.weight)
        mgr.save(2)                       # the space they held is usable again
        assert mgr.last_commit_step == 2
    finally:
        mgr.close()
    _assert_clean(ckpt, [2])


def test_the_write_probe_on_a_full_disk_names_the_directory_and_leaves_nothing(
        disk: Disk) -> None:
    ckpt = disk.root / "ckpt"
    ckpt.mkdir()
    disk.ballast("other-data.bin")        # full, and not by a checkpoint
    with pytest.raises(StorageFullError) as info:
        _manager(ckpt)
    msg = str(info.value)
    assert f"write {ckpt}/{storage_mod.PROBE_PREFIX}" in msg, msg
    assert f"free in {ckpt}" in msg and "no space left on the device" in msg, msg
    assert "Free space there" in msg, msg
    assert os.listdir(ckpt) == []         # no probe, no temporary sibling of it
    # With room again the probe passes, and leaves nothing either.
    (disk.root / "other-data.bin").unlink()
    _manager(ckpt).close()
    assert os.listdir(ckpt) == []


def test_a_failed_write_in_a_step_directory_removes_its_partial_file(disk: Disk) -> None:
    """Storage.open_write(atomic=False), the path of every file of a local save."""
    st = storage_mod.Storage(str(disk.root / "ckpt"))
    st.makedirs("d")
    with pytest.raises(StorageFullError) as info, st.open_write("d/big.bin", atomic=False) as f:
        for _ in range(CAPACITY // MiB + 1):
            f.write(os.urandom(16) * (MiB // 16))
    assert f"write {st.url_of('d/big.bin')}: no space left on the device" in str(info.value)
    assert info.value.directory == st.url_of("d")
    assert os.listdir(st.url_of("d")) == []
    assert disk.free() > CAPACITY - MiB



def test_a_save_in_flight_is_not_removed_as_a_leftover(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Another manager starting on the same directory (a second job, an evaluation script)
    must not delete the temporary directory of a save that is still being written: the
    writer holds a lock on it."""
    ckpt = tmp_path / "ckpt"
    entered, release = threading.Event(), threading.Event()
    real = storage_mod.Storage.open_write

    def gated(self: storage_mod.Storage, rel: str, **kw: Any) -> Any:
        if rel.endswith("shared.pt") and not entered.is_set():
            entered.set()
            assert release.wait(30), "never released"
        return real(self, rel, **kw)

    monkeypatch.setattr(storage_mod.Storage, "open_write", gated)
    writer = _manager(ckpt, async_save=True)
    try:
        writer.track(model=_model(0))
        writer.save(1)
        assert entered.wait(30)
        (in_flight,) = [n for n in os.listdir(ckpt) if n.startswith(TMP_PREFIX)]
        _manager(ckpt).close()            # its start-up clean-up runs now
        assert in_flight in os.listdir(ckpt)
    finally:
        release.set()
        writer.close()
    _assert_clean(ckpt, [1])


def test_a_commit_that_does_not_fit_removes_the_step_too(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file written, then the marker does not fit (injected ENOSPC): nothing of the
    step stays, and the needed bytes are those of the files written."""
    ckpt = tmp_path / "ckpt"
    real = storage_mod.Storage.write_bytes

    def marker_full(self: storage_mod.Storage, rel: str, data: Any, **kw: Any) -> None:
        if rel.endswith("COMMITTED") and step_dirname(2) in rel:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(self, rel, data, **kw)

    with _manager(ckpt) as mgr:
        mgr.track(model=_model(0))
        mgr.save(1)
        monkeypatch.setattr(storage_mod.Storage, "write_bytes", marker_full)
        with pytest.raises(CheckpointStorageFullError) as info:
            mgr.save(2)
        assert "This save needs about 6.0 MiB" in str(info.value)
        _assert_clean(ckpt, [1])
        monkeypatch.undo()
        mgr.save(2)
    _assert_clean(ckpt, [2])


def test_a_full_node_local_disk_sends_every_save_to_storage_until_it_has_room(
        disk: Disk, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Before, each node-local save on a full disk printed the same long warning and the
    # saves that the cadence kept off storage (4 in 5 here) went nowhere: the job ran
    # unprotected for as long as the disk stayed full, with a fix that named the wrong
    # option (RetentionPolicy.keep_last).
    from resilient_train.checkpoint.tiers.nodelocal import NodeLocal
    from resilient_train.checkpoint.tiers.nodelocal import log as local_log

    ballast = disk.ballast("other-data.bin", 16 * MiB)   # 4 MiB free: 6 MiB do not fit
    persistent = tmp_path / "persistent"
    model = _model(0)
    options = CheckpointOptions(async_save=False, save_every_steps=1,
                                retention=RetentionPolicy(keep_last=20),
                                node_local=NodeLocal(directory=str(disk.root / "local"),
                                                     persistent_every=5))
    with caplog.at_level(logging.INFO, logger=local_log.name), \
            CheckpointManager(str(persistent), options=options) as mgr:
        mgr.track(model=model)
        for step in range(1, 5):
            assert mgr.maybe_save(step)
        # Step 1 was the machine's only, and failed; from then on storage takes each save.
        assert _committed(persistent) == [2, 3, 4]
        said = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(said) == 1, [r.getMessage() for r in said]
        msg = said[0].getMessage()
        assert msg.startswith(f"node-local checkpoint of step 1 in {disk.root / 'local'} "
                              "failed: no space left: this save needs about 6.0 MiB"), msg
        assert "NodeLocal.keep_last=1" in msg and "NodeLocal(directory=...)" in msg, msg
        assert "every save goes to storage too" in msg
        assert "RetentionPolicy" not in msg
        assert sum("failed again (" in r.getMessage() for r in caplog.records) == 3
        caplog.clear()
        ballast.unlink()
        for step in range(5, 12):
            assert mgr.maybe_save(step)
        # Step 5 is decided before its node-local write works: storage too; then the
        # cadence again, every 5th save.
        assert _committed(persistent) == [2, 3, 4, 5, 10]
        assert _committed(disk.root / "local") == [11]
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert said == [f"node-local checkpoint of step 5 in {disk.root / 'local'} committed, "
                        "after 4 failed save(s): storage again takes only the saves that "
                        "NodeLocal.persistent_every asks for"], said
