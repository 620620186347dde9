"""Loading one verified file of a committed step with torch, and nothing that runs code.

Apart from commit/directory.py so that listing a directory never imports torch; restore and the
deep check (:func:`~.directory.verify_step`) both load through :func:`load_verified`, and
a file streamed to every rank (transport/readonce.py) through :func:`load_buffer`, which also loads
what load_verified read from an object store into one buffer.
"""

from __future__ import annotations

import inspect
import io
import mmap
import os
from collections.abc import Callable
from typing import IO, Any, cast

import torch
import torch.serialization

from ..state.capture import weights_only_refusal
from ..storage.base import Storage
from ..storage.fileio import SeekableReader
from .manifest import (
    CorruptCheckpointError,
    Crc32c,
    FileEntry,
    Manifest,
    check_entry,
    manifest_entry,
)

# A local file is checksummed this much at a time: the pages it faults in are the read, and
# each chunk counts towards the storage's bytes moved (a progress line of a large restore).
VERIFY_CHUNK = 64 << 20


def _verify_local_file(path: str, entry: FileEntry, where: str, storage: Storage) -> None:
    """Checksum a local file through a memory map: no copy, and the pages it faults in
    are the ones torch.load(mmap=True) then uses."""
    crc = Crc32c()
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm, \
                        memoryview(mm) as view:
                    for start in range(0, len(view), VERIFY_CHUNK):
                        with view[start:start + VERIFY_CHUNK] as chunk:
                            crc.update(chunk)
                            storage.count_moved(len(chunk))
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: missing") from None
    check_entry(crc.entry(), entry, where)


def load_verified(storage: Storage, name: str, fname: str, manifest: Manifest) -> dict[str, Any]:
    """``name/fname`` as a dict, once its size and checksum match the manifest; loaded
    weights-only (a file that would run code is refused) onto the CPU: memory-mapped where
    the file has a local path, else read into one buffer whose views the tensors are (no
    copy while deserializing, and never a second copy of the file in memory)."""
    rel = f"{name}/{fname}"
    where = storage.url_of(rel)
    entry = manifest_entry(manifest, fname, where)
    path = storage.local_path(rel)
    if path is not None:
        _verify_local_file(path, entry, where, storage)
        return _weights_only(
            lambda: torch.load(path, map_location="cpu", weights_only=True, mmap=True), where)
    buf = file_buffer(entry.size)
    view = buf.numpy().data
    try:
        with storage.open_read(rel) as opened:
            f = cast(io.BufferedIOBase, opened)
            read_into(f, view, 0, entry.size, where, entry.size)
            if f.read(1):
                raise CorruptCheckpointError(
                    f"{where}: longer than the {entry.size} bytes the manifest says")
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: missing") from None
    crc = Crc32c()
    crc.update(view)
    check_entry(crc.entry(), entry, where)
    return load_buffer(buf, where)


# Fault the pages in with the mapping, in one call without the GIL: a file read into
# untouched memory otherwise faults page by page inside copies that hold the GIL (0.1-0.15
# s of a 512 MiB restore here). Linux only; elsewhere the pages fault in as they are used.
_POPULATE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0) \
    if hasattr(mmap, "MAP_ANONYMOUS") else None


def file_buffer(size: int) -> torch.Tensor:
    """``size`` bytes of fresh anonymous memory as a uint8 tensor (kept alive by it)."""
    n = max(size, 1)
    mem = mmap.mmap(-1, n) if _POPULATE is None else mmap.mmap(-1, n, flags=_POPULATE)
    return torch.frombuffer(mem, dtype=torch.uint8)[:size]


def read_into(f: io.BufferedIOBase, view: memoryview, start: int, end: int, where: str, size: int,
              counted: Callable[[int], None] = lambda n: None) -> None:
    """Fill ``view[start:end]`` from ``f`` (a reader at ``start``) of a file the manifest
    says is ``size`` bytes, as large reads: an object store's reader splits each into
    parallel ranged reads (``TransferOptions.read_streams``). ``counted(n)`` per read."""
    at = start
    while at < end:
        n = f.readinto(view[at:end])
        if not n:
            raise CorruptCheckpointError(f"{where}: ended at byte {at}, the manifest says "
                                         f"{size}")
        at += n
        counted(n)


# torch.load(mmap=True) maps every tensor onto one storage of the whole file, but only for a
# path; its _load takes that storage from any source. Checked once, so a torch without it
# loads by copying (the tensors' own storages) instead of failing.
_ZERO_COPY = "overall_storage" in inspect.signature(
    getattr(torch.serialization, "_load", lambda: None)).parameters


def load_buffer(buf: torch.Tensor, where: str) -> dict[str, Any]:
    """A verified file's bytes (a flat uint8 CPU tensor) as a dict, weights-only, whose
    tensors are views of ``buf``: no copy of the data (a 0.5 GiB state loads in ms)."""
    def load() -> Any:
        if not _ZERO_COPY:
            return torch.load(io.BytesIO(buf.numpy().data), map_location="cpu",
                              weights_only=True)
        reader = torch._C.PyTorchFileReader(cast(IO[bytes], _ViewReader(buf.numpy().data)))
        unpickler = torch.serialization._weights_only_unpickler  # type: ignore[attr-defined]
        return torch.serialization._load(  # type: ignore[attr-defined]
            reader, "cpu", unpickler, overall_storage=buf.untyped_storage(), encoding="utf-8")

    return _weights_only(load, where)


class _ViewReader(SeekableReader):
    """A seekable reader over a memoryview: the zip reader's small reads (directory, record
    headers, the pickle) copy what they read, the tensors' data is never read."""

    def __init__(self, view: memoryview) -> None:
        super().__init__(len(view))
        self._view = view

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = max(0, min(len(out), self.size - self.pos))
        out[:n] = self._view[self.pos:self.pos + n]
        self.pos += n
        return n


def _weights_only(load: Callable[[], Any], where: str) -> dict[str, Any]:
    """``load()``'s dict; anything torch cannot read weights-only is a corrupt file."""
    try:
        obj = load()
    except CorruptCheckpointError:
        raise
    except Exception as exc:  # a checksum-valid file that torch cannot read
        # The reason without torch's advice to load with weights_only=False, which is
        # exactly wrong for a file that may have been tampered with.
        raise CorruptCheckpointError(
            f"{where}: unreadable as a weights-only torch file, refused without running "
            f"anything ({type(exc).__name__}: {weights_only_refusal(exc)})") from None
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"{where}: not a checkpoint file")
    return obj
