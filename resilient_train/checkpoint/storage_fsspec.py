"""Object stores through fsspec (``memory://``, ``s3://``, ...; ``gs://`` in `storage_gcs`).

Objects, not files: no local paths, no directories (``makedirs`` is a no-op, a "directory"
is a prefix with objects), no atomic rename, so a step is committed by its marker
(`CommitProtocol.COMMIT_FILE`). A whole file is one ``pipe_file``; a stream is spooled to
local disk and uploaded with one ``put_file``; a read is checked against the object's size.

Bounded attempts
    A library may retry on its own (gcsfs: about half a minute per request), which would
    make ``RetryOptions.deadline_s`` no bound at all. So each attempt against an async
    filesystem runs on fsspec's loop for at most the time left, and is cancelled (the
    library mid-backoff included) when that is up. A transfer of N bytes may run
    ``N / RetryOptions.min_throughput`` seconds, past the deadline, but only once this
    attempt has reached the endpoint (`FsspecStorage._connections_made`, where a backend
    can tell): a healthy large upload is not cut off, and an endpoint that refuses
    connections or never answers costs ``deadline_s`` and no more.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import posixpath
import time
from collections.abc import Iterable
from typing import Any, BinaryIO, cast

import fsspec.asyn
import fsspec.core
from fsspec.exceptions import FSTimeoutError

from .storage import OBJECT_STORE, Budget, Storage
from .storage_errors import ShortReadError, StorageError

_READ_BUFFER = 8 << 20  # open_read: one ranged GET per 8 MiB


class FsspecStorage(Storage):
    """Any fsspec URL: objects under ``bucket/prefix``, one upload per file."""

    capabilities = OBJECT_STORE
    _sized_reads = True
    _permission_fix = ("grant the job's identity read/write access to the bucket (e.g. "
                       "roles/storage.objectUser) or fix the credentials "
                       "(GOOGLE_APPLICATION_CREDENTIALS, gcloud auth application-default "
                       "login)")

    def _open(self, url: str, options: dict[str, Any]) -> tuple[str, str]:
        self._fs, root = self._filesystem(url, options)
        return url.rstrip("/") or url, root.rstrip("/") or root

    def _filesystem(self, url: str, options: dict[str, Any]) -> tuple[Any, str]:
        """The fsspec filesystem for url, and the root as it spells paths."""
        fs, root = fsspec.core.url_to_fs(url, **options)
        return fs, str(root)

    @property
    def fs(self) -> Any:
        """The fsspec filesystem behind the URL."""
        return self._fs

    def _not_found_message(self, op: str, url: str, what: str) -> str:
        return (f"{op} {url}: no such object ({what}). It was never written, was deleted, "
                f"or the bucket or prefix is wrong; check the checkpoint directory")

    # -- calls, each bounded by its attempt's budget

    def _remote(self, rel: str) -> str:
        return f"{self._root}/{rel}" if rel else self._root

    def _fs_call(self, name: str, *args: Any, timeout: Budget | None, **kwargs: Any) -> Any:
        fs = self._fs
        if timeout is not None and getattr(fs, "async_impl", False) \
                and not getattr(fs, "asynchronous", False):
            return self._run_bounded(name, getattr(fs, "_" + name)(*args, **kwargs), timeout)
        return getattr(fs, name)(*args, **kwargs)

    def _connections_made(self) -> int | None:
        """How many connections reached the endpoint so far; None where that cannot be
        told (then a transfer always gets its throughput allowance)."""
        return None

    def _run_bounded(self, name: str, coro: Any, budget: Budget) -> Any:
        """Run an fsspec coroutine on its loop for at most ``budget.remaining_s``, or
        ``budget.transfer_s`` once this attempt has reached the endpoint; then cancel it
        (a library mid-backoff included) and raise FSTimeoutError."""
        # Counted before the coroutine starts: on its loop's thread it may reach the
        # endpoint (reuse a pooled connection) before this thread reads the count again.
        reached_before = self._connections_made()
        fut = asyncio.run_coroutine_threadsafe(coro, self._fs.loop)
        start = time.monotonic()
        limit = start + budget.remaining_s
        extended = False
        try:
            while True:
                try:
                    # Slices of a second, so that a signal (Ctrl-C) gets through.
                    return fut.result(timeout=max(0.0, min(limit - time.monotonic(), 1.0)))
                except concurrent.futures.TimeoutError:
                    if fut.done():
                        raise  # the coroutine's own timeout, not ours
                if time.monotonic() < limit:
                    continue
                reached = self._connections_made()
                got_through = reached is None or reached_before is None \
                    or reached > reached_before
                if not extended and got_through and budget.transfer_s > budget.remaining_s:
                    extended = True
                    limit = start + budget.transfer_s
                    continue
                raise FSTimeoutError(
                    f"{name}: no answer within {time.monotonic() - start:.1f}s"
                    + ("" if got_through else " (no connection to the endpoint was made)"))
        finally:
            if not fut.done():
                fut.cancel()

    # -- the primitives

    def _write(self, rel: str, data: bytes | bytearray | memoryview, *, durable: bool,
               budget: Budget) -> None:
        self._fs_call("pipe_file", self._remote(rel), data, timeout=budget)

    def _upload(self, src: str, rel: str, budget: Budget) -> None:
        self._fs_call("put_file", src, self._remote(rel), timeout=budget)

    def _read(self, rel: str, budget: Budget) -> bytes:
        return cast(bytes, self._fs_call("cat_file", self._remote(rel), timeout=budget))

    def _open_read(self, rel: str) -> BinaryIO:
        raw = _RangeReader(self, rel, self.size(rel))
        return cast(BinaryIO, io.BufferedReader(raw, buffer_size=_READ_BUFFER))

    def _size(self, rel: str, budget: Budget) -> int:
        info = self._fs_call("info", self._remote(rel), timeout=budget)
        return int(info.get("size") or 0)

    def _exists(self, rel: str, budget: Budget) -> bool:
        try:
            self._fs_call("info", self._remote(rel), timeout=budget)
        except FileNotFoundError:
            return False
        return True

    def _listdir(self, rel: str, budget: Budget) -> Iterable[str]:
        path = self._remote(rel)
        try:
            entries = self._fs_call("ls", path, detail=True, timeout=budget)
        except FileNotFoundError:
            return []
        names = set()
        for entry in entries:
            name = str(entry["name"]).rstrip("/")
            if name == path.rstrip("/"):
                continue  # ls of a file lists the file itself
            names.add(posixpath.basename(name))
        return names

    def _delete(self, rel: str, recursive: bool, budget: Budget) -> None:
        path = self._remote(rel)
        try:
            self._fs_call("rm", path, recursive=recursive, timeout=budget)
            return
        except FileNotFoundError:
            pass
        if not recursive:
            # gcsfs "deletes" a prefix by 404ing on the object: say why nothing happened.
            try:
                info = self._fs_call("info", path, timeout=budget)
            except FileNotFoundError:
                return
            if info.get("type") == "directory":
                raise StorageError(
                    f"delete {self.url_of(rel)}: it is a non-empty directory; pass "
                    f"recursive=True to delete it and everything under it",
                    url=self.url_of(rel), operation="delete")


class _RangeReader(io.RawIOBase):
    """Seekable raw reader over an object: each read is one ranged GET, retried."""

    def __init__(self, storage: FsspecStorage, rel: str, size: int) -> None:
        super().__init__()
        self._storage = storage
        self._rel = rel
        self._path = storage._remote(rel)
        self._size = size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def _fetch(self, n: int) -> bytes:
        start, end = self._pos, min(self._pos + n, self._size)
        if end <= start:
            return b""

        def fetch(t: Budget) -> bytes:
            data = self._storage._fs_call("cat_file", self._path, start=start, end=end,
                                          timeout=t)
            if len(data) != end - start:
                raise ShortReadError(f"range {start}-{end}: got {len(data)} bytes")
            return cast(bytes, data)

        data = self._storage._retrying("read", self._rel, fetch, nbytes=end - start)
        self._pos = end
        return data

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self._fetch(len(view))
        view[: len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        return self._fetch(self._size - self._pos)  # one request, not 8 KiB at a time


__all__ = ["FsspecStorage"]
