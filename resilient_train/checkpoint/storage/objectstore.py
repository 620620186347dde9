"""Object stores through fsspec (``memory://``, ``s3://``, ...; ``gs://`` in `storage_gcs`).

Objects, not files: no local paths, no directories (``makedirs`` is a no-op, a "directory"
is a prefix with objects), no atomic rename, so a step is committed by its marker
(`CommitProtocol.COMMIT_FILE`). A whole file is one ``pipe_file``; a stream is spooled to
local disk and uploaded with one ``put_file``; a read is checked against the object's size.

Parallel streams (`TransferOptions`, the ``"transfer"`` storage option)
    With ``streams > 1`` (uploads), a file larger than ``part_bytes`` moves as several
    requests in flight at once; a file larger than ``read_part_bytes`` is read as ranges,
    ``read_streams`` of them in flight:

    * writes, where the store composes objects server-side (GCS ``compose``: `GcsStorage`):
      the stream is cut into parts of ``part_bytes`` while it is written; each full part
      uploads as a temporary object (``.rt-tmp-<name>-<token>.pNNNNN`` next to the file,
      hidden from ``listdir``) while the writer fills the next; at the end the parts are
      composed into the file (in rounds of at most ``_compose_max`` sources), its size and
      crc32c are checked against the stream's, and the parts are deleted. At most
      ``streams + 1`` part buffers exist per file (``fileio.PartBuffers``): ``streams`` in
      flight, one being filled. The file appears only at the compose, complete; a failure
      deletes the parts (after an outage: one short attempt, as ``CommitFile.discard``
      reasons), and a crash leaves only hidden names in an uncommitted step directory,
      which retention deletes with it. Stores without compose keep the spooled upload.
    * reads (any fsspec store): ranged reads of ``read_part_bytes``, ``read_streams`` at
      a time, each copied into its place in one buffer as it lands (a restore reads a
      file into its own buffer, `loader.load_verified`); the caller verifies the whole
      file's crc32c as before.

    Every request is one `Storage._retrying` call of its own (the same deadline, backoff
    and errors as a whole-file request); the first that fails for good stops the others
    (at their next attempt) and is what the caller sees.

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
import contextlib
import io
import logging
import mmap
import posixpath
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any, BinaryIO, ClassVar, TypeVar, cast

import fsspec.asyn
import fsspec.core
from fsspec.exceptions import FSTimeoutError

from ..commit.manifest import Crc32c
from .base import OBJECT_STORE, TMP_FILE_PREFIX, Budget, Storage, split_protocol
from .errors import ShortReadError, StorageError, describe, is_transient
from .fileio import PartBuffers, SeekableReader

logger = logging.getLogger(__name__)

T = TypeVar("T")

_READ_BUFFER = 8 << 20  # open_read: one ranged GET per 8 MiB
# The storage option that carries TransferOptions (taken out before fsspec sees the rest).
TRANSFER_OPTION = "transfer"
# After an outage, removing a failed upload's parts gets one attempt of at most this long:
# retrying would wait out another deadline for objects nobody can see (hidden names).
_CLEANUP_AFTER_OUTAGE_S = 5.0


@dataclass(frozen=True)
class TransferOptions:
    """How one file moves between this process and an object store.

    streams: uploads in flight per file (a save). 1: the file is spooled to ``TMPDIR``
        and uploaded with one request, as before this option existed. More than 1 needs a
        store that composes objects (GCS); elsewhere a file is still one upload.
    read_streams: ranged reads in flight per file (a restore, ``checkpoints verify``).
        1: one at a time.
    part_bytes: the size of one part of an upload; a file of at most this size is always
        one upload. A parallel upload holds at most ``(streams + 1) * part_bytes`` of
        memory.
    read_part_bytes: the size of one ranged read; a file of at most this size is always
        one read. Smaller than an upload's part: a read has no per-part object to create
        and compose, so small ranges cost only their request (measured, docs/
        checkpointing.md).

    Given as ``storage_options={"transfer": TransferOptions(...)}`` (or a dict of the same
    fields, e.g. ``{"transfer": {"streams": 8}}``: unset fields keep the backend's
    default); the default is the backend's (`GcsStorage`: measured, docs/checkpointing.md,
    "Parallel streams to gs://"; other fsspec stores: one stream each way).
    """

    streams: int = 1
    read_streams: int = 1
    part_bytes: int = 32 << 20
    read_part_bytes: int = 8 << 20

    def __post_init__(self) -> None:
        for name in ("streams", "read_streams", "part_bytes", "read_part_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TransferOptions.{name} must be a whole number >= 1, "
                                 f"got {value!r}")


def transfer_options(value: Any, default: TransferOptions) -> TransferOptions:
    """The ``"transfer"`` storage option as TransferOptions: one already, a dict of its
    fields (unset ones from ``default``), or None (``default``)."""
    if value is None:
        return default
    if isinstance(value, TransferOptions):
        return value
    if isinstance(value, Mapping):
        known = {f.name for f in fields(TransferOptions)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"storage option {TRANSFER_OPTION!r}: unknown field(s) "
                             f"{', '.join(map(str, unknown))}; TransferOptions has "
                             f"{', '.join(sorted(known))}")
        return TransferOptions(**{f: value.get(f, getattr(default, f)) for f in known})
    raise ValueError(f"storage option {TRANSFER_OPTION!r} must be TransferOptions or a dict "
                     f"of its fields, got {type(value).__name__}")


@dataclass(frozen=True)
class TransferStats:
    """What the last parallel upload through a storage did (logs, tests, benchmarks)."""

    rel: str
    nbytes: int
    parts: int            # part objects uploaded (0: the file went as one request)
    streams: int
    peak_buffers: int     # part buffers out at once; at most streams + 1
    seconds: float


class FsspecStorage(Storage):
    """Any fsspec URL: objects under ``bucket/prefix``, one upload per file."""

    capabilities = OBJECT_STORE
    _sized_reads = True
    # Without server-side compose a file is one upload, whatever the streams.
    _compose_max: ClassVar[int] = 0
    _default_transfer: ClassVar[TransferOptions] = TransferOptions()
    _permission_fix = ("grant the job's identity read/write access to the bucket (e.g. "
                       "roles/storage.objectUser) or fix the credentials "
                       "(GOOGLE_APPLICATION_CREDENTIALS, gcloud auth application-default "
                       "login)")

    def _open(self, url: str, options: dict[str, Any]) -> tuple[str, str]:
        self._transfer = transfer_options(options.pop(TRANSFER_OPTION, None),
                                          self._default_transfer)
        self.last_transfer: TransferStats | None = None
        self._fs, root = self._filesystem(url, options)
        return url.rstrip("/") or url, root.rstrip("/") or root

    @property
    def transfer(self) -> TransferOptions:
        """How files move: streams per file and part size (the ``"transfer"`` option)."""
        return self._transfer

    def _filesystem(self, url: str, options: dict[str, Any]) -> tuple[Any, str]:
        """The fsspec filesystem for url, and the root as it spells paths."""
        try:
            fs, root = fsspec.core.url_to_fs(url, **options)
        except ValueError as exc:
            if not str(exc).startswith("Protocol not known"):
                raise
            raise ValueError(
                f"checkpoint directory {url}: no filesystem knows the protocol "
                f"{split_protocol(url)[0]!r}; use a local path, a Cloud Storage mount "
                f"(/gcs/BUCKET/PATH) or gs://BUCKET/PATH (another fsspec protocol works "
                f"once its package is installed: s3:// with s3fs)") from None
        except ImportError as exc:   # a known protocol whose package is missing
            raise ImportError(f"checkpoint directory {url}: {exc}") from exc
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

    # -- parallel streams

    def _parallel_writes(self) -> bool:
        return self._transfer.streams > 1 and self._compose_max >= 2

    @contextlib.contextmanager
    def _open_write(self, rel: str, *, atomic: bool) -> Iterator[BinaryIO]:
        if not self._parallel_writes():
            with super()._open_write(rel, atomic=atomic) as f:
                yield f
            return
        upload = _PartUpload(self, rel, self._transfer)
        try:
            yield cast(BinaryIO, upload)
        except BaseException as exc:
            upload.abort(exc)
            failure = upload.failure
            # torch.save turns our write's error into RuntimeError("unexpected pos ...");
            # once the upload has failed, whatever the writer raised follows from it: the
            # upload's error is what happened.
            if failure is not None and failure is not exc:
                raise failure  # its own cause (the library's error) is kept
            raise
        upload.finish()

    def _read_parts(self, rel: str, size: int) -> bytes | None:
        return self._read_range(rel, 0, size) if self._split(size) else None

    def _read_range(self, rel: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of rel: one ranged read, or ranges into one buffer."""
        if not self._split(end - start):
            return self._fetch_range(rel, start, end, None)
        out = bytearray(end - start)
        self._read_range_into(rel, start, memoryview(out))
        return bytes(out)

    def _read_range_into(self, rel: str, start: int, out: memoryview) -> None:
        """Bytes [start, start + len(out)) of rel into ``out``: ranged reads of
        ``read_part_bytes``, ``read_streams`` at a time, each copied into its place as it
        lands (at most ``read_streams`` ranges in memory)."""
        end = start + len(out)
        if not self._split(end - start):
            out[:] = self._fetch_range(rel, start, end, None)
            return
        step = self._transfer.read_part_bytes

        def fetch(at: int, stop: threading.Event) -> None:
            data = self._fetch_range(rel, at, min(at + step, end), stop)
            out[at - start:at - start + len(data)] = data

        stop = threading.Event()
        ranges = range(start, end, step)
        workers = _Workers(min(self._transfer.read_streams, len(ranges)), "rt-read")
        try:
            _wait_all([workers.submit(fetch, at, stop) for at in ranges], stop)
        finally:
            stop.set()   # a failure: the queued ranges end at their first attempt
            workers.close()

    def _split(self, n: int) -> bool:
        # Ranges even with one stream: one GET of a whole large object is the slowest way
        # to read it (the client grows one body in memory; measured, docs/checkpointing.md).
        return n > self._transfer.read_part_bytes

    def _fetch_range(self, rel: str, start: int, end: int,
                     stop: threading.Event | None) -> bytes:
        def fetch(t: Budget) -> bytes:
            _check_stop(stop)
            data = self._fs_call("cat_file", self._remote(rel), start=start, end=end,
                                 timeout=t)
            if len(data) != end - start:
                raise ShortReadError(f"range {start}-{end}: got {len(data)} bytes")
            return cast(bytes, data)

        return self._retrying("read", rel, fetch, nbytes=end - start)

    def _upload_part(self, rel: str, data: memoryview, budget: Budget) -> None:
        """Write one part (a temporary object) of a parallel upload."""
        self._fs_call("pipe_file", self._remote(rel), data, timeout=budget)

    def _compose(self, rel: str, sources: list[str], budget: Budget) -> None:
        """Make rel the concatenation of the objects ``sources`` (at most
        ``_compose_max``), server-side."""
        raise NotImplementedError

    def _check_composed(self, rel: str, size: int, crc32c: str, budget: Budget) -> None:
        """Raise StorageError when the composed rel is not ``size`` bytes of checksum
        ``crc32c`` (hex), as far as the store tells."""

    def _delete_objects(self, rels: list[str], budget: Budget) -> None:
        """Delete these objects; missing ones are fine."""
        with contextlib.suppress(FileNotFoundError):
            self._fs_call("rm", [self._remote(r) for r in rels], timeout=budget)

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
            base = posixpath.basename(name)
            if not base.startswith(TMP_FILE_PREFIX):  # parts of an upload in flight
                names.add(base)
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


class _RangeReader(SeekableReader):
    """Seekable raw reader over an object: each read is one ranged GET, retried."""

    def __init__(self, storage: FsspecStorage, rel: str, size: int) -> None:
        super().__init__(size)
        self._storage = storage
        self._rel = rel


    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self.size - self.pos))
        if n:   # a large read (a whole file into its buffer) goes as parallel ranges
            self._storage._read_range_into(self._rel, self.pos, view[:n])
            self.pos += n
        return n

    def readall(self) -> bytes:
        if self.pos >= self.size:
            return b""
        data = self._storage._read_range(self._rel, self.pos, self.size)  # not 8 KiB reads
        self.pos = self.size
        return data


# --- a parallel upload ---------------------------------------------------------------------


class _Stopped(Exception):
    """A request of a transfer that already failed: not attempted (not retried either)."""


def _check_stop(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise _Stopped("stopped: another request of this transfer failed")


def _wait_all(futures: list[concurrent.futures.Future[Any]], stop: threading.Event) -> None:
    """Wait for every future; at the first failure stop the rest and raise it (the first
    failure, not a _Stopped of a request it stopped)."""
    done, pending = concurrent.futures.wait(
        futures, return_when=concurrent.futures.FIRST_EXCEPTION)
    failed = [f for f in futures if f in done and f.exception() is not None]
    if not failed:
        return
    stop.set()
    concurrent.futures.wait(pending)
    first = next((f for f in failed if not isinstance(f.exception(), _Stopped)), failed[0])
    raise cast(BaseException, first.exception())


class _Workers:
    """Up to ``n`` threads for one transfer's requests, started as tasks come and ended by
    ``close``. Daemon threads, unlike ThreadPoolExecutor's, for writer.WriterThread's
    reason: a process that exits mid-save must not wait at exit for uploads that nobody
    will commit."""

    def __init__(self, n: int, name: str) -> None:
        self._n = n
        self._name = name
        self._tasks: queue.SimpleQueue[tuple[concurrent.futures.Future[Any],
                                             Callable[..., Any], tuple[Any, ...]] | None] \
            = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._tasks.put((fut, fn, args))
        if len(self._threads) < self._n:
            t = threading.Thread(target=self._run, daemon=True,
                                 name=f"{self._name}-{len(self._threads)}")
            t.start()
            self._threads.append(t)
        return fut

    def _run(self) -> None:
        while (task := self._tasks.get()) is not None:
            fut, fn, args = task
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                    fut.set_exception(exc)

    def close(self) -> None:
        """Finish the tasks queued, then end the threads."""
        for _ in self._threads:
            self._tasks.put(None)
        for t in self._threads:
            t.join()
        self._threads = []


class _PartUpload(io.RawIOBase):
    """One file written as parts that upload while the caller writes the next, composed
    into the file by `finish` (the module docstring has the protocol)."""

    def __init__(self, storage: FsspecStorage, rel: str, opts: TransferOptions) -> None:
        super().__init__()
        self._st = storage
        self._rel = rel
        self._opts = opts
        directory, name = posixpath.split(rel)
        stem = f"{TMP_FILE_PREFIX}{name}-{uuid.uuid4().hex[:12]}"
        self._stem = posixpath.join(directory, stem) if directory else stem
        # streams in flight and one being filled: the writer never waits for a buffer
        # while fewer than `streams` requests are running.
        self._buffers = PartBuffers(opts.streams + 1, opts.part_bytes)
        self._workers = _Workers(opts.streams, "rt-upload")
        self._cur: mmap.mmap | None = None
        self._fill = 0
        self._crc = Crc32c()
        self._parts: list[str] = []        # every part submitted, in order
        self._temps: list[str] = []        # composites of composites (> _compose_max parts)
        self._futures: list[concurrent.futures.Future[None]] = []
        self._stop = threading.Event()
        self._composed = False
        self._done = False
        self._start = time.monotonic()
        self.failure: BaseException | None = None   # the first request that failed

    # -- the caller's side

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._crc.size

    def write(self, data: Any) -> int:
        if self._done:
            raise ValueError("write to a finished upload")
        if self.failure is not None:
            raise self.failure  # stops torch.save at its next write
        mv = memoryview(data)
        if mv.ndim != 1 or mv.format != "B":
            mv = mv.cast("B")
        self._crc.update(mv)
        n, pos, size = mv.nbytes, 0, self._opts.part_bytes
        while pos < n:
            # A full part goes once more bytes follow: a file of exactly one part is then
            # still one request, not a part and a compose.
            if self._cur is not None and self._fill == size:
                self._submit()
            if self._cur is None:
                self._cur = self._buffers.take()   # waits while `streams` are uploading
                if self.failure is not None:
                    raise self.failure
            k = min(n - pos, size - self._fill)
            self._cur[self._fill:self._fill + k] = mv[pos:pos + k]
            self._fill += k
            pos += k
        return n

    def flush(self) -> None:
        """Nothing: a part uploads when it is full, the rest at the end."""

    # -- parts

    def _submit(self) -> None:
        assert self._cur is not None
        rel = f"{self._stem}.p{len(self._parts):05d}"
        self._parts.append(rel)
        buf, n = self._cur, self._fill
        self._cur, self._fill = None, 0
        self._futures.append(self._workers.submit(self._send, rel, buf, n))

    def _send(self, rel: str, buf: mmap.mmap, n: int) -> None:
        try:
            data = memoryview(buf)[:n]

            def attempt(t: Budget) -> None:
                _check_stop(self._stop)
                self._st._upload_part(rel, data, t)

            self._st._retrying("upload", self._rel, attempt, nbytes=n)
        except BaseException as exc:
            if self.failure is None and not isinstance(exc, _Stopped):
                self.failure = exc
            self._stop.set()
            raise
        finally:
            self._buffers.give(buf)

    def _compose(self, rel: str, sources: list[str]) -> None:
        def attempt(t: Budget) -> None:
            _check_stop(self._stop)
            self._st._compose(rel, sources, t)

        self._st._retrying("compose", self._rel, attempt)

    # -- the end

    def finish(self) -> None:
        """Upload what is left, compose the parts into the file, check it, delete the
        parts. On failure nothing is left (see `abort`) and the error is raised."""
        try:
            self._finish()
        except BaseException as exc:
            self.abort(exc)
            raise
        self._close()

    def _finish(self) -> None:
        if self.failure is not None:
            raise self.failure
        size = self._crc.size
        if not self._parts:   # it fits one part: one request, as without streams
            data = memoryview(self._cur)[:self._fill] if self._cur is not None else b""
            self._st._retrying(
                "upload", self._rel,
                lambda t: self._st._write(self._rel, data, durable=True, budget=t),
                nbytes=self._fill)
            self._record(0)
            return
        if self._fill:
            self._submit()
        _wait_all(cast(list[concurrent.futures.Future[Any]], self._futures), self._stop)
        sources = list(self._parts)
        level = 0
        limit = self._st._compose_max
        while len(sources) > limit:   # compose in rounds: at most `limit` sources a call
            groups = [sources[i:i + limit] for i in range(0, len(sources), limit)]
            sources, jobs = [], []
            for i, group in enumerate(groups):
                if len(group) == 1:
                    sources.append(group[0])
                    continue
                temp = f"{self._stem}.c{level}-{i:05d}"
                self._temps.append(temp)
                sources.append(temp)
                jobs.append(self._workers.submit(self._compose, temp, group))
            _wait_all(jobs, self._stop)
            level += 1
        self._compose(self._rel, sources)
        self._composed = True
        crc = self._crc.hexdigest()
        self._st._retrying("compose", self._rel,
                           lambda t: self._st._check_composed(self._rel, size, crc, t))
        self._remove(self._parts + self._temps, transient=False)
        self._record(len(self._parts))

    def _record(self, parts: int) -> None:
        stats = TransferStats(self._rel, self._crc.size, parts, self._opts.streams,
                              self._buffers.peak, time.monotonic() - self._start)
        self._st.last_transfer = stats
        logger.debug("uploaded %s: %d bytes in %d part(s), %d stream(s), %d buffer(s) at "
                     "most, %.2fs", self._st.url_of(self._rel), stats.nbytes, parts,
                     stats.streams, stats.peak_buffers, stats.seconds)

    def abort(self, exc: BaseException) -> None:
        """The write failed (the caller's block, a request, the compose): stop the
        requests in flight, wait for them, delete every part; never raises."""
        if self._done:
            return
        self._stop.set()
        concurrent.futures.wait(self._futures)
        self._workers.close()
        objects = self._parts + self._temps
        if self._composed:
            objects.append(self._rel)   # composed but failed its check: not a file
        cause = self.failure if self.failure is not None else exc
        self._remove(objects, transient=is_transient(cause) or is_transient(exc))
        self._close()

    def _remove(self, rels: list[str], *, transient: bool) -> None:
        if not rels:
            return
        try:
            if transient:
                # One short attempt: the store is failing, and these names are hidden.
                budget = Budget(min(_CLEANUP_AFTER_OUTAGE_S, self._st._retry.deadline_s), 0.0)
                self._st._delete_objects(rels, budget)
            else:
                self._st._retrying("delete", self._rel,
                                   lambda t: self._st._delete_objects(rels, t))
        except Exception as exc:  # noqa: BLE001 - the write's own outcome matters more
            logger.warning("could not delete %d temporary part object(s) of %s (%s); their "
                           "names are hidden from listings, and they go with the step "
                           "directory", len(rels), self._st.url_of(self._rel), describe(exc))

    def _close(self) -> None:
        self._done = True
        self._workers.close()
        if self._cur is not None:
            self._buffers.give(self._cur)
            self._cur = None
        self._buffers.close()


__all__ = ["TRANSFER_OPTION", "FsspecStorage", "TransferOptions", "TransferStats"]
