"""Loading one verified file of a committed step with torch, and nothing that runs code.

Apart from directory.py so that listing a directory never imports torch; restore and the
deep check (:func:`~.directory.verify_step`) both load through :func:`load_verified`.
"""

from __future__ import annotations

import io
import mmap
import os
from typing import Any

import torch

from .manifest import (
    CorruptCheckpointError,
    Crc32c,
    FileEntry,
    Manifest,
    check_entry,
    manifest_entry,
    read_verified,
)
from .state import weights_only_refusal
from .storage import Storage


def _verify_local_file(path: str, entry: FileEntry, where: str) -> None:
    """Checksum a local file through a memory map: no copy, and the pages it faults in
    are the ones torch.load(mmap=True) then uses."""
    crc = Crc32c()
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    crc.update(mm)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: missing") from None
    check_entry(FileEntry(crc.size, crc.hexdigest()), entry, where)


def load_verified(storage: Storage, name: str, fname: str, manifest: Manifest) -> dict[str, Any]:
    """``name/fname`` as a dict, once its size and checksum match the manifest; loaded
    weights-only (a file that would run code is refused) onto the CPU, memory-mapped where
    the file has a local path."""
    rel = f"{name}/{fname}"
    where = storage.url_of(rel)
    path = storage.local_path(rel)
    if path is not None:
        _verify_local_file(path, manifest_entry(manifest, fname, where), where)
        return load_checked(path, where, mapped=True)
    return load_checked(io.BytesIO(read_verified(storage, name, fname, manifest)), where)


def load_checked(source: Any, where: str, *, mapped: bool = False) -> dict[str, Any]:
    """A checkpoint file already checked against its manifest (a path, or a buffer), loaded
    weights-only onto the CPU (``mapped``: a local path, memory-mapped)."""
    try:
        obj = torch.load(source, map_location="cpu", weights_only=True, mmap=mapped)
    except Exception as exc:  # a checksum-valid file that torch cannot read
        # The reason without torch's advice to load with weights_only=False, which is
        # exactly wrong for a file that may have been tampered with.
        raise CorruptCheckpointError(
            f"{where}: unreadable as a weights-only torch file, refused without running "
            f"anything ({type(exc).__name__}: {weights_only_refusal(exc)})") from None
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"{where}: not a checkpoint file")
    return obj


class BufferReader(io.RawIOBase):
    """A seekable reader over a buffer, without the copy ``io.BytesIO(bytearray)`` makes:
    torch.load from bytes received in memory then peaks at the buffer and the tensors,
    not twice the buffer."""

    def __init__(self, buf: bytearray | bytes | memoryview) -> None:
        super().__init__()
        self._view = memoryview(buf)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), len(self._view) - self._pos))
        b[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


class VerifiedReader:
    """Reads ``name/fname`` in order into the buffers it is given (transfer.broadcast_file's
    ``read``), checking the size and crc32c against the manifest as it goes: the last
    buffer raises CorruptCheckpointError when they differ."""

    def __init__(self, storage: Storage, name: str, fname: str, manifest: Manifest) -> None:
        self.storage, self.rel = storage, f"{name}/{fname}"
        self.where = storage.url_of(self.rel)
        self.entry = manifest_entry(manifest, fname, self.where)
        self._crc = Crc32c()
        self._file: Any = None
        self._stack: Any = None

    def __call__(self, part: memoryview) -> None:
        import contextlib

        try:
            if self._file is None:
                self._stack = contextlib.ExitStack()
                self._file = self._stack.enter_context(self.storage.open_read(self.rel))
            got = self._file.read(len(part))
            if len(got) != len(part):
                raise CorruptCheckpointError(
                    f"{self.where}: {self._crc.size + len(got)} bytes, the manifest says "
                    f"{self.entry.size} (truncated)")
            part[:] = got
            self._crc.update(part)
            if self._crc.size == self.entry.size:   # the last one: nothing may follow
                extra = len(self._file.read(1))
                check_entry(FileEntry(self._crc.size + extra, self._crc.hexdigest()),
                            self.entry, self.where)
                self.close()
        except FileNotFoundError:
            self.close()
            raise CorruptCheckpointError(f"{self.where}: missing") from None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = self._file = None
