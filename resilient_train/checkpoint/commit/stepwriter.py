"""How one rank writes its files of a step: checksummed torch files, on a writer thread.

:class:`StepWriter` writes a rank's files into the step's work directory (commit/protocol.py names
it and commits it) and returns each file's size and crc32c for the manifest; a rank whose
writes fail describes why in a :class:`RankFailure` for the primary. :class:`WriterThread`
runs the saves in the background, in order.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from ...errors import Classification, classify_exception, exception_chain
from ..state.capture import tree_map_tensors
from ..storage import fileio
from ..storage.base import Storage, StorageFullError, is_no_space
from .directory import SHARED_FILE, rank_file
from .manifest import Crc32c, FileEntry
from .sharded import ShardedCheckpointer


class CrcWriter:
    """A file object for torch.save that checksums what passes through.

    On a local file it writes with O_DIRECT where the file system allows it
    (``fileio.DirectWriter``: about twice the disk throughput of buffered writes + fsync).
    Elsewhere, or where O_DIRECT is refused, it writes buffered and, on a local file,
    starts the disk writeback early: every ``sync_every`` bytes a helper thread fdatasyncs
    what is written so far (the GIL is released meanwhile), so the disk works while torch
    keeps serializing, and the final fsync has little left.
    """

    def __init__(self, f: BinaryIO, *, local: bool, sync_every: int = 128 << 20) -> None:
        self._f = f
        self.crc = Crc32c()
        self._fd = f.fileno() if local else None
        self._direct = (fileio.DirectWriter.open(self._fd, crc=self.crc)
                        if self._fd is not None and fileio.ENABLED else None)
        self._sync_every = sync_every
        self._unsynced = 0
        self._syncing: threading.Thread | None = None

    def write(self, data: bytes | memoryview) -> int:
        if self._direct is not None:
            return self._direct.write(data)
        self.crc.update(data)
        n = self._f.write(data)
        self._unsynced += n
        if self._fd is not None and self._unsynced >= self._sync_every and not (
                self._syncing and self._syncing.is_alive()):
            self._f.flush()
            self._unsynced = 0
            self._syncing = threading.Thread(target=os.fdatasync, args=(self._fd,),
                                             name="rt-ckpt-writeback", daemon=True)
            self._syncing.start()
        return n

    def flush(self) -> None:
        if self._direct is None:  # the direct path holds only a partial block: see close
            self._f.flush()

    def close(self) -> None:
        """After a complete torch.save: write what the direct path still holds (its write
        errors raise here); the caller's close then fsyncs."""
        if self._direct is not None:
            self._direct.close()

    def finish(self) -> None:
        """Always, success or not: stop the direct writer, wait for the writeback in flight."""
        if self._direct is not None:
            self._direct.abort()
        if self._syncing is not None:
            self._syncing.join()


def write_torch_file(storage: Storage, rel: str, obj: Any, *, atomic: bool) -> FileEntry:
    """torch.save ``obj`` to ``rel``: its size and checksum. ``atomic``: the file needs a
    rename of its own (COMMIT_FILE); in a temporary directory the directory's rename
    commits them all."""
    with storage.open_write(rel, atomic=atomic) as f:
        w = CrcWriter(f, local=storage.local_path(rel) is not None)
        try:
            torch.save(obj, w)  # type: ignore[arg-type]
            w.close()
        finally:
            w.finish()
    return w.crc.entry()


def state_bytes(snap: Mapping[str, Any]) -> int:
    """About what a save of ``snap`` writes: its tensor bytes (a DTensor: its local shard)."""
    seen: dict[int, int] = {}

    def count(t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if hasattr(t, "to_local") else t
        seen[id(t)] = local.numel() * local.element_size()
        return t

    for key, tree in snap.items():
        tree_map_tensors(count, tree.dcp_state if key == "dcp" else tree)
    return sum(seen.values())


@dataclass(frozen=True)
class RankFailure:
    """What a rank whose writes failed tells the primary, with its (partial) file list."""

    rank: int
    error: str
    state_bytes: int                 # what its files would have held (tensor bytes)
    transient: bool = False
    no_space: bool = False
    directory: str | None = None     # where a no-space write failed: the root, or TMPDIR
    file: str | None = None          # and the file it was writing


class StepWriter:
    """One rank's part of a save: its files of a step, written into the work directory."""

    def __init__(self, storage: Storage, sharded: ShardedCheckpointer, *, rank: int,
                 files_atomic: bool) -> None:
        self.storage = storage
        self.sharded = sharded
        self.rank = rank
        self.files_atomic = files_atomic   # COMMIT_FILE: each file needs its own rename

    def write(self, work: str, snap: Mapping[str, Any]) -> dict[str, FileEntry]:
        """Write ``snap`` (the keys this rank saves: ``dcp``, ``shared``, ``rank``) into
        ``work``; every file's entry for the manifest."""
        entries: dict[str, FileEntry] = {}
        if "dcp" in snap:
            # First: dcp.save is collective and fails on every rank together, so no rank
            # waits in it for one whose own files already failed.
            entries.update(self.sharded.write(self.storage, work, snap["dcp"]))
        if "shared" in snap:   # the primary's
            entries[SHARED_FILE] = self._file(f"{work}/{SHARED_FILE}", snap["shared"])
        mine = rank_file(self.rank)
        entries[mine] = self._file(f"{work}/{mine}", snap["rank"])
        return entries

    def _file(self, rel: str, obj: Any) -> FileEntry:
        return write_torch_file(self.storage, rel, obj, atomic=self.files_atomic)

    def failure(self, snap: Mapping[str, Any], failure: Exception, *,
                nbytes: int | None = None) -> RankFailure:
        """Why this rank's part failed, for the primary: transient or not, and for a full
        disk where (the root, or another directory such as TMPDIR) and in which file."""
        full = next((e for e in exception_chain(failure) if isinstance(e, StorageFullError)),
                    None)
        root = self.storage.local_path("") or self.storage.url
        directory = full.directory if full is not None and full.directory else root
        if directory == root or directory.startswith(root.rstrip("/") + "/"):
            directory = root  # not the step's directory: it is removed by now
        return RankFailure(
            self.rank, f"{type(failure).__name__}: {failure}",
            state_bytes(snap) if nbytes is None else nbytes,
            transient=classify_exception(failure) is Classification.TRANSIENT,
            no_space=is_no_space(failure), directory=directory,
            file=full.url if full is not None else None)


class WriterThread:
    """One background thread that runs jobs in order.

    A daemon thread, unlike ThreadPoolExecutor's: a process that exits because a peer died
    must not hang at exit on a save stuck in a collective with that peer. A save cut off
    like that is simply never committed; ``shutdown()`` still waits for the save in flight.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]
                                      | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        self._jobs.put((fut, fn, args))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        return fut

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fut, fn, args = job
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:  # handed to whoever waits on the future
                    fut.set_exception(exc)

    def abandon(self) -> threading.Thread | None:
        """Stop taking jobs without waiting for the one running (left to the exit: an
        emergency save past its deadline, whose commit is refused); returns its thread."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
        return thread

    def shutdown(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
