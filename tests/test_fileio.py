"""The O_DIRECT writer (fileio.DirectWriter): byte-exact files and crc32c around block and
buffer boundaries, the buffered fallbacks, errors, and its use by CheckpointManager."""

from __future__ import annotations

import errno
import fcntl
import io
import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from resilient_train.checkpoint.commit.manifest import Crc32c, crc32c
from resilient_train.checkpoint.manager import CheckpointManager, CheckpointOptions
from resilient_train.checkpoint.storage import fileio
from resilient_train.checkpoint.storage.fileio import ALIGN, DirectWriter

SMALL = 64 << 10  # a small buffer, so a few MiB cross many buffer boundaries


@pytest.fixture()
def wfile(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        yield path, fd
    finally:
        os.close(fd)


def _open(fd: int, **kw: Any) -> DirectWriter:
    w = DirectWriter.open(fd, crc=Crc32c(), **kw)
    if w is None:
        pytest.skip("this file system refuses O_DIRECT")
    return w


def _write_chunked(w: DirectWriter, data: bytes, seed: int) -> None:
    """Feed data in uneven pieces, as torch.save does (small records, then big storages)."""
    rng = random.Random(seed)
    pos = 0
    while pos < len(data):
        n = rng.choice([1, 7, 4096, 5000, SMALL - 3, SMALL, 3 * SMALL + 11, 1 << 20])
        assert w.write(memoryview(data)[pos:pos + n]) == len(data[pos:pos + n])
        pos += n


def _no_writer_threads() -> bool:
    return not any(t.name == "rt-ckpt-direct-write" for t in threading.enumerate())


@pytest.mark.parametrize("size", [
    0, 1, ALIGN - 1, ALIGN, ALIGN + 1,
    SMALL - 1, SMALL, SMALL + 1, 2 * SMALL, 2 * SMALL + ALIGN + 1,
    (5 << 20) + 12345,
])
def test_bytes_and_crc_exact(wfile: tuple[Path, int], size: int) -> None:
    path, fd = wfile
    data = os.urandom(size)
    w = _open(fd, buffer_size=SMALL, buffers=2)
    assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
    try:
        _write_chunked(w, data, seed=size)
        w.close()
    finally:
        w.abort()
    assert w.crc is not None
    assert (w.size, w.crc.size, w.crc.hexdigest()) == (size, size, crc32c(data))
    assert path.read_bytes() == data
    assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT  # the fd is given back buffered
    assert _no_writer_threads()
    with pytest.raises(ValueError):
        w.write(b"late")


def test_default_buffers_several_mib_odd(wfile: tuple[Path, int]) -> None:
    path, fd = wfile
    data = os.urandom(2 * fileio.BUFFER_SIZE + (3 << 20) + 4097)
    w = _open(fd)
    try:
        w.write(data)
        w.close()
    finally:
        w.abort()
    assert w.crc is not None and w.crc.hexdigest() == crc32c(data)
    assert path.read_bytes() == data


def test_torch_save_through_it_matches_torch_save(wfile: tuple[Path, int]) -> None:
    path, fd = wfile
    weights = torch.randn(300_001)
    state: dict[str, Any] = {"w": weights, "b": torch.arange(17), "meta": {"step": 3}}
    ref = io.BytesIO()
    torch.save(state, ref)
    w = _open(fd, buffer_size=SMALL, buffers=3)
    try:
        torch.save(state, w)  # type: ignore[arg-type]
        w.close()
    finally:
        w.abort()
    assert path.read_bytes() == ref.getvalue()
    back = torch.load(path, weights_only=True)
    assert torch.equal(back["w"], weights) and back["meta"] == {"step": 3}


def test_refused_o_direct_returns_none(wfile: tuple[Path, int],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system without O_DIRECT (tmpfs before Linux 6.6): F_SETFL fails with EINVAL."""
    _, fd = wfile
    real = fcntl.fcntl

    def refuse(fd_: int, cmd: int, arg: int = 0) -> int:
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd_, cmd, arg)

    monkeypatch.setattr(fileio.fcntl, "fcntl", refuse)
    assert DirectWriter.open(fd) is None
    assert not real(fd, fcntl.F_GETFL) & os.O_DIRECT


def test_refused_at_first_write_goes_on_buffered(wfile: tuple[Path, int],
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The flag accepted but direct I/O refused: the file is finished buffered, exactly."""
    path, fd = wfile
    real = os.pwrite
    refused = []

    def pwrite(fd_: int, data: Any, offset: int) -> int:
        if fcntl.fcntl(fd_, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd_, data, offset)

    monkeypatch.setattr(fileio.os, "pwrite", pwrite)
    data = os.urandom(5 * SMALL + 333)
    w = _open(fd, buffer_size=SMALL, buffers=2)
    try:
        _write_chunked(w, data, seed=1)
        w.close()
    finally:
        w.abort()
    assert refused == [0]
    assert "continues buffered" in caplog.text
    assert path.read_bytes() == data
    assert w.crc is not None and w.crc.hexdigest() == crc32c(data)


def test_short_direct_write_is_completed(wfile: tuple[Path, int],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A short O_DIRECT write leaves an unaligned offset: the rest is written, exactly."""
    path, fd = wfile
    real = os.pwrite
    calls = []

    def pwrite(fd_: int, data: Any, offset: int) -> int:
        calls.append(offset)
        if len(calls) == 2:  # once, in the middle of the second block
            return int(real(fd_, memoryview(data)[:ALIGN], offset))
        return int(real(fd_, data, offset))

    monkeypatch.setattr(fileio.os, "pwrite", pwrite)
    data = os.urandom(4 * SMALL + 5)
    w = _open(fd, buffer_size=SMALL, buffers=2)
    try:
        w.write(data)
        w.close()
    finally:
        w.abort()
    assert path.read_bytes() == data


def test_disk_error_raises_and_abort_cleans_up(wfile: tuple[Path, int],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    _, fd = wfile

    def full(fd_: int, data: Any, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fileio.os, "pwrite", full)
    w = _open(fd, buffer_size=SMALL, buffers=2)
    with pytest.raises(OSError) as info:
        for _ in range(64):  # the error shows at a later write, or at close
            w.write(b"x" * SMALL)
        w.close()
    assert info.value.errno == errno.ENOSPC
    w.abort()
    w.abort()  # idempotent
    assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
    assert _no_writer_threads()


def test_abort_without_close_writes_no_tail(wfile: tuple[Path, int]) -> None:
    path, fd = wfile
    w = _open(fd, buffer_size=SMALL, buffers=2)
    w.write(os.urandom(SMALL + 100))  # one full buffer, then a partial one
    w.abort()
    assert path.stat().st_size == SMALL
    assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
    assert _no_writer_threads()


def test_bad_buffer_size_rejected_and_flags_restored(wfile: tuple[Path, int]) -> None:
    _, fd = wfile
    with pytest.raises(ValueError):
        DirectWriter.open(fd, buffer_size=ALIGN + 1)
    assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT


def _roundtrip(directory: Path) -> None:
    model = torch.nn.Linear(300, 301)
    with CheckpointManager(directory, options=CheckpointOptions(async_save=False)) as mgr:
        mgr.track(model=model)
        mgr.save(1, blocking=True)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    torch.nn.init.zeros_(model.weight)
    with CheckpointManager(directory) as mgr:
        mgr.track(model=model)
        assert mgr.restore_latest() == 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k])


@pytest.mark.parametrize("mode", ["direct", "refused", "disabled"])
def test_manager_save_restore(tmp_path: Path, mode: str,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Every path a local save can take produces a checkpoint that verifies and restores."""
    used: list[DirectWriter | None] = []
    real_open = DirectWriter.open

    def spy(fd: int, **kw: Any) -> DirectWriter | None:
        if mode == "refused":
            used.append(None)
            return None
        w = real_open(fd, **kw)
        used.append(w)
        return w

    monkeypatch.setattr(DirectWriter, "open", staticmethod(spy))
    if mode == "disabled":
        monkeypatch.setattr(fileio, "ENABLED", False)
    _roundtrip(tmp_path / "ckpt")
    assert (used == []) == (mode == "disabled")
    if mode == "direct" and any(w is None for w in used):
        pytest.skip("this file system refuses O_DIRECT")


def test_manager_on_tmpfs(monkeypatch: pytest.MonkeyPatch) -> None:
    """tmpfs: refuses O_DIRECT on older kernels, accepts it (as a no-op) since Linux 6.6;
    either way the save must work."""
    import tempfile

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        _roundtrip(Path(d) / "ckpt")
