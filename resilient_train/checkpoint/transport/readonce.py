"""Read a file of replicated state once, streaming it to every rank while it is read.

Every rank of a data-parallel job restores the same replicated bytes. Each rank reading
them costs N x the bytes from storage; one rank reading, loading and then broadcasting the
tree makes the others wait for the whole read and then for the whole broadcast. Here the
source rank reads the file in chunks on a thread and broadcasts each chunk as soon as it
has landed, so the broadcast of one chunk overlaps the read of the next, and checksums it
as it goes. Every rank then loads the tree straight from the bytes it holds
(:func:`~.loader.load_buffer`: the tensors are views of the buffer, nothing is copied
again), so no rank deserializes by copying, the source included.

The source's verdict (the checksum matched, or why not) travels after the last chunk, so
every rank raises the same error for the same file: a step that one rank cannot use is
skipped by all. On CPU the buffer outlives the restore where an optimizer adopted its state
as views of it (``load_state_dict`` keeps same-device tensors): the model's part of it
stays allocated with it. On an accelerator everything is copied off and it is freed.
"""

from __future__ import annotations

import io
import queue
import threading
from collections.abc import Callable
from typing import Any, cast

import torch

from ..commit.loader import file_buffer, load_buffer, read_into
from ..commit.manifest import CorruptCheckpointError, Crc32c, FileEntry, check_entry
from ..storage.base import Storage
from ..storage.errors import StorageError

# Large enough that a chunk's request and broadcast cost little per byte, small enough that
# a 0.5 GiB file is some 8 chunks to overlap (measured: 64 MiB beat 16 and 32 here).
CHUNK_BYTES = 64 << 20

_OK, _CORRUPT, _FAILED = 0, 1, 2


def read_once(storage: Storage, rel: str, entry: FileEntry, *, src: int, rank: int,
              group: Any, counted: Callable[[int], None] = lambda n: None) -> dict[str, Any]:
    """``rel``'s tree on every rank of ``group``, read from ``storage`` by rank ``src``
    alone and checked against the manifest's ``entry``; ``counted(n)`` after each n bytes
    read (on ``src``: also those of a read that then fails). Every rank raises the same
    CorruptCheckpointError (or StorageError) when it fails."""
    # Every rank streams the source's size, so that the ranks' collectives line up even
    # where their manifests would not (a step rewritten while it is read): that is then an
    # error on every rank, not a rank waiting for chunks that never come.
    size = _source_size(entry.size, src, rank, group)
    buf = file_buffer(size)
    chunks = [(s, min(s + CHUNK_BYTES, size)) for s in range(0, size, CHUNK_BYTES)]
    where = storage.url_of(rel)
    failure: BaseException | None = None
    if rank == src:
        failure = _read_and_send(storage, rel, entry, buf, chunks, src, group, counted)
    else:
        for start, end in chunks:
            _broadcast(buf[start:end], src, group)
    kind, message = _verdict(failure, src, rank, group)
    if kind == _OK and _any_rank(entry.size != size, group):
        kind, message = _CORRUPT, (f"{where}: the ranks' manifests disagree on its size "
                                   f"(rank {src}'s says {size} bytes): the step changed "
                                   "while it was being read")
    if kind == _CORRUPT:
        if rank == src and isinstance(failure, CorruptCheckpointError):
            raise failure
        raise CorruptCheckpointError(message)
    if kind == _FAILED:
        if rank == src and failure is not None:
            raise failure
        raise StorageError(f"{message} (read by rank {src}, which streams {where} to the "
                           "others)", url=where, operation="read")
    return load_buffer(buf, where)


def _source_size(size: int, src: int, rank: int, group: Any) -> int:
    head = torch.tensor([size if rank == src else 0], dtype=torch.int64)
    _broadcast(head, src, group)
    return int(head.item())


def _any_rank(flag: bool, group: Any) -> bool:
    import torch.distributed as dist

    t = torch.tensor([int(flag)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def _broadcast(chunk: torch.Tensor, src: int, group: Any) -> None:
    import torch.distributed as dist

    dist.broadcast(chunk, src, group=group)


def _read_and_send(storage: Storage, rel: str, entry: FileEntry, buf: torch.Tensor,
                   chunks: list[tuple[int, int]], src: int, group: Any,
                   counted: Callable[[int], None]) -> BaseException | None:
    """The source's side: a thread reads and checksums chunk after chunk into ``buf``, this
    thread broadcasts each once it is there. After a failure the remaining chunks still go
    (unread), so that no receiver waits for a chunk that never comes; the verdict says."""
    landed: queue.Queue[int | BaseException] = queue.Queue()
    stop = threading.Event()   # a broadcast failed (a receiver is gone): read no further
    crc = Crc32c()
    view = buf.numpy().data
    where = storage.url_of(rel)

    # No size request first: restore has just compared every file's size with the
    # manifest (directory.manifest_problems), and a short file ends the loop below.
    def read() -> None:
        try:
            with storage.open_read(rel) as opened:
                f = cast(io.BufferedIOBase, opened)
                for i, (start, end) in enumerate(chunks):
                    if stop.is_set():
                        return
                    read_into(f, view, start, end, where, entry.size, counted)
                    crc.update(view[start:end])
                    landed.put(i)
            check_entry(crc.entry(), entry, where)
        except FileNotFoundError:
            landed.put(CorruptCheckpointError(f"{where}: missing"))
        except BaseException as exc:  # handed to the caller, after the chunks are sent
            landed.put(exc)
        else:
            landed.put(-1)

    reader = threading.Thread(target=read, name="rt-read-once", daemon=True)
    reader.start()
    failure: BaseException | None = None
    try:
        for start, end in chunks:
            if failure is None:
                got = landed.get()
                if isinstance(got, BaseException):
                    failure = got
            _broadcast(buf[start:end], src, group)
    except BaseException:
        stop.set()
        raise
    if failure is None:   # the checksum's outcome, after the last chunk
        got = landed.get()
        failure = got if isinstance(got, BaseException) else None
    reader.join()
    return failure


def _verdict(failure: BaseException | None, src: int, rank: int, group: Any
             ) -> tuple[int, str]:
    """The source's outcome on every rank: (_OK / _CORRUPT / _FAILED, its message)."""
    import torch.distributed as dist

    text = b""
    if rank == src:
        kind = _OK if failure is None else \
            _CORRUPT if isinstance(failure, CorruptCheckpointError) else _FAILED
        text = b"" if failure is None else str(failure).encode()[:16384]
        head = torch.tensor([kind, len(text)], dtype=torch.int64)
    else:
        head = torch.zeros(2, dtype=torch.int64)
    dist.broadcast(head, src, group=group)
    kind, length = (int(v) for v in head.tolist())
    if kind == _OK:
        return _OK, ""
    body = torch.frombuffer(bytearray(text), dtype=torch.uint8) if rank == src and length \
        else torch.zeros(length, dtype=torch.uint8)
    if length:
        dist.broadcast(body, src, group=group)
    return kind, body.numpy().tobytes().decode(errors="replace")
