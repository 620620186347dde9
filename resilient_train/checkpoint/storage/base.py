"""One storage interface for checkpoints; the backend is a class chosen once from the URL.

The checkpoint manager talks to a `Storage` rooted at its checkpoint directory. It reads
what the backend can do (`Storage.capabilities`) and commits a step by the backend's
`CommitProtocol` (docs/design.md, "Commit protocols"); it has no local / GCS code paths
of its own.

Backends (``Storage(url)`` returns an instance of the class `backend_for(url)` names):

    =====================  ===============  =====  =====  ======  ===============
    URL                    class            posix  local  rename  commit protocol
    =====================  ===============  =====  =====  ======  ===============
    a path, ``file://``    `LocalStorage`   yes    yes    yes     ATOMIC_RENAME
    ``/gcs/<bucket>/...``  `FuseStorage`    yes    no     no      COMMIT_FILE
    ``gs://bucket/...``    `GcsStorage`     no     no     no      COMMIT_FILE
    other fsspec URLs      `FsspecStorage`  no     no     no      COMMIT_FILE
    =====================  ===============  =====  =====  ======  ===============

    (posix: ``Capabilities.posix_paths``, local: ``local_paths``, rename: ``atomic_rename``)

    * plain local disk: POSIX calls; a file is written to a temporary sibling that is
      fsynced and ``os.replace``d, so it exists whole or not at all, as on object stores;
      ``rename_dir`` is an atomic ``os.rename`` followed by an fsync of the parent.
    * Cloud Storage FUSE (paths under `DEFAULT_OBJECT_STORE_MOUNTS`): POSIX calls, but an
      object store underneath: a directory rename is copy + delete, so ``rename_dir``
      refuses. Files are written in place (a rename would upload everything twice); the
      object appears when the file is closed.
    * fsspec URLs (``gs://bucket/prefix``, ``memory://x``, ...): one upload per file;
      `storage_fsspec`, and `storage_gcs` for GCS's errors, emulator and connection trace.

A new backend (a node-local tier, a peer) is one subclass: its `Capabilities`, the
primitives below (each gets a path relative to the root and the attempt's `Budget`), and
`register_backend` for its URL scheme. Retrying, error translation into `StorageError`
subclasses, no-space detection, path checks and spooling of streamed writes are shared,
here in the base class; the public methods are defined only here.

    required  ``_open``, ``_write``, ``_read``, ``_size``, ``_exists``, ``_listdir``,
              ``_delete``
    optional  ``_upload`` (a spooled file; default: read it, ``_write``), ``_open_read``
              (default: the whole file in memory), ``_open_write`` (default: spool to
              ``TMPDIR``, then ``_upload``), ``_read_parts`` (a sized file in several
              requests, each retried; default: one ``_read``), ``_makedirs``, ``_fsync_dir``,
              ``_rename_dir`` (atomic_rename only), ``_check_readable``, error wording

Retries
    Transient errors (`classify_error`) are retried with tenacity's full-jitter exponential
    backoff (`RetryOptions`) until ``deadline_s``; then `StorageUnavailableError`. Anything
    else fails at once.

Full disks
    ENOSPC / EDQUOT on a local write is a `StorageFullError` naming the file, the
    directory and the space left there (a write to an object store's local staging file
    names ``TMPDIR``). A failed write never leaves its temporary or partial file behind.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import importlib
import io
import logging
import os
import posixpath
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, ClassVar, TypeVar, cast

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_delay,
    wait_random_exponential,
)

from resilient_train.errors import exception_chain
from resilient_train.validate import options

from .errors import (
    ErrorKind,
    ShortReadError,
    StorageError,
    StorageFullError,
    StorageNotFoundError,
    StoragePermissionError,
    StorageUnavailableError,
    classify_error,
    describe,
    from_storage_library,
    is_transient,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Where Vertex AI (and our docs) mount Cloud Storage FUSE: local calls, object semantics.
DEFAULT_OBJECT_STORE_MOUNTS: tuple[str, ...] = ("/gcs/",)
LOCAL_PROTOCOLS = frozenset({None, "file", "local"})
GCS_PROTOCOLS = frozenset({"gs", "gcs"})
# Our own scratch names; listdir hides them, so a crash mid-write leaves nothing visible.
TMP_FILE_PREFIX = ".rt-tmp-"
PROBE_PREFIX = ".rt-write-probe-"
_MIN_ATTEMPT_S = 0.05
# No space left / over quota: the write cannot succeed until someone frees space.
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


# --- what a backend can do ---------------------------------------------------------------


class CommitProtocol(enum.Enum):
    """How a checkpoint step becomes visible all at once (Orbax's names)."""

    ATOMIC_RENAME = "atomic_rename"  # write into a temporary directory, rename it into place
    COMMIT_FILE = "commit_file"      # write in place, a commit marker last


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, declared by its class.

    posix_paths: ``url_of(rel)`` is a path that ``open()`` and ``os`` calls reach (plain
        disk, a FUSE mount): DCP's file-system reader and writer work there.
    local_paths: a plain local disk: ``local_path(rel)`` gives a path for mmap, O_DIRECT
        and file locks.
    atomic_rename: ``rename_dir`` renames a directory atomically.
    commit_protocol: how the checkpoint manager commits a step here.
    """

    posix_paths: bool
    local_paths: bool
    atomic_rename: bool
    commit_protocol: CommitProtocol

    def __post_init__(self) -> None:
        if self.local_paths and not self.posix_paths:
            raise ValueError("Capabilities: local_paths needs posix_paths")
        if self.commit_protocol is CommitProtocol.ATOMIC_RENAME and not self.atomic_rename:
            raise ValueError("Capabilities: ATOMIC_RENAME needs atomic_rename")


# Objects: no local paths, no directory rename; a step is committed by its marker.
OBJECT_STORE = Capabilities(posix_paths=False, local_paths=False, atomic_rename=False,
                            commit_protocol=CommitProtocol.COMMIT_FILE)


# --- options -----------------------------------------------------------------------------


@options
@dataclass(frozen=True)
class RetryOptions:
    """How long and how to retry transient storage errors.

    Backoff is tenacity's full jitter: the n-th wait is uniform in
    [0, min(max_wait_s, initial_s * 2**(n-1))], and never runs past the deadline.
    """

    deadline_s: float = 120.0
    initial_s: float = 0.5
    max_wait_s: float = 10.0
    # bytes/s: an attempt moving N bytes may run N / min_throughput s even past the deadline,
    # once it has reached the endpoint (the deadline bounds retrying through failures and
    # endpoints that never answer, not a healthy slow transfer).
    min_throughput: float = float(1 << 20)

    def __post_init__(self) -> None:
        for name in ("deadline_s", "initial_s", "max_wait_s", "min_throughput"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"RetryOptions.{name} must be > 0, got {value!r}")


@dataclass(frozen=True)
class Budget:
    """One attempt's time: ``remaining_s`` until the retry deadline, and ``transfer_s`` that
    moving its bytes may take at ``RetryOptions.min_throughput`` once the endpoint answers.
    Backends that can bound a call (async fsspec filesystems) honour it; others ignore it."""

    remaining_s: float
    transfer_s: float


# --- full disks ----------------------------------------------------------------------------


def _no_space_in(exc: BaseException | None) -> OSError | None:
    """The ENOSPC / EDQUOT error (or StorageFullError) in exc's ``__cause__`` chain."""
    for e in exception_chain(exc):
        if isinstance(e, StorageFullError) or (
                isinstance(e, OSError) and e.errno in NO_SPACE_ERRNOS):
            return e
    return None


def is_no_space(exc: BaseException) -> bool:
    """Whether exc, or an exception it was raised from, is ENOSPC / EDQUOT."""
    return _no_space_in(exc) is not None


def free_bytes(path: str) -> int | None:
    """Bytes an unprivileged writer may still use on the filesystem of ``path`` (or of its
    nearest existing parent); None where that cannot be told."""
    for candidate in _ancestors(os.path.abspath(path)):
        if os.path.exists(candidate):
            try:
                return int(shutil.disk_usage(candidate).free)
            except OSError:
                return None
    return None


def format_bytes(n: int | float | None) -> str:
    if n is None:
        return "an unknown amount"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - the loop returns


def _no_space_error(exc: OSError, op: str, url: str, path: str, *,
                    staging: bool = False) -> StorageFullError:
    directory = os.path.dirname(path) or path
    free = free_bytes(directory)
    what = "over the disk quota" if exc.errno == errno.EDQUOT else "no space left on the device"
    if staging:
        fix = (f"{directory} is where uploads are staged (TMPDIR): free space there or set "
               f"TMPDIR to a disk with room for the largest checkpoint file")
    else:
        fix = ("free space there (delete old checkpoints, or lower "
               "RetentionPolicy.keep_last) or use a larger disk")
    return StorageFullError(
        f"{op} {url}: {what} ({describe(exc)}); {format_bytes(free)} free in "
        f"{directory}. {fix[0].upper()}{fix[1:]}.",
        url=url, operation=op, directory=directory, free_bytes=free)


# --- URLs and paths ------------------------------------------------------------------------


def split_protocol(url: str) -> tuple[str | None, str]:
    """``(protocol, rest)`` as ``fsspec.core.split_protocol`` splits it, without importing
    fsspec (a tenth of a second) for local paths."""
    if "://" in url:
        protocol, rest = url.split("://", 1)
        if len(protocol) > 1:  # not a Windows drive letter
            return protocol, rest
    if url.startswith("data:"):
        protocol, rest = url.split(":", 1)
        return protocol, rest
    return None, url


def is_under_mount(path: str, mounts: Sequence[str]) -> bool:
    path = os.path.abspath(path)
    for mount in mounts:
        prefix = os.path.abspath(mount).rstrip("/") + "/"
        if path == prefix.rstrip("/") or path.startswith(prefix):
            return True
    return False


def _check_url(url: Any) -> None:
    if not isinstance(url, str) or not url:
        raise ValueError(f"a storage URL must be a non-empty string, got {url!r}")


def _local_root(rest: str) -> str:
    return os.path.abspath(os.path.expanduser(rest))


def _check_rel(rel: str, *, allow_root: bool) -> str:
    if not isinstance(rel, str):
        raise TypeError(f"storage paths are str relative to the root, got {type(rel).__name__}")
    norm = posixpath.normpath(rel) if rel else ""
    if norm == ".":
        norm = ""
    if rel.startswith("/") or "\\" in rel or norm == ".." or norm.startswith("../"):
        raise ValueError(f"storage path {rel!r} must be relative to the root, without '..'")
    if not norm and not allow_root:
        raise ValueError("this operation needs a path below the storage root, got ''")
    return norm


# --- choosing the backend -----------------------------------------------------------------

_REGISTERED: dict[str, type[Storage]] = {}


def register_backend(protocol: str, cls: type[Storage]) -> None:
    """Make ``Storage("<protocol>://...")`` a ``cls``: how a backend joins without an edit
    here. A registered protocol wins over the built-in choice."""
    if not (isinstance(cls, type) and issubclass(cls, Storage)) or cls is Storage:
        raise TypeError(f"a storage backend is a subclass of Storage, got {cls!r}")
    _REGISTERED[protocol] = cls


def backend_for(url: str, object_store_mounts: Sequence[str] = DEFAULT_OBJECT_STORE_MOUNTS
                ) -> type[Storage]:
    """The backend class for ``url``, from the URL alone (nothing is touched)."""
    _check_url(url)
    protocol, rest = split_protocol(url)
    if protocol is not None and protocol in _REGISTERED:
        return _REGISTERED[protocol]
    if protocol in LOCAL_PROTOCOLS:
        return FuseStorage if is_under_mount(_local_root(rest), object_store_mounts) \
            else LocalStorage
    return _builtin(_GCS_BACKEND if protocol in GCS_PROTOCOLS else _FSSPEC_BACKEND)


# The object-store backends, by name: loaded on first use, so local runs never load fsspec,
# gcsfs or aiohttp, and this module (which they build on) never imports them.
_GCS_BACKEND = ("resilient_train.checkpoint.storage.gcs", "GcsStorage")
_FSSPEC_BACKEND = ("resilient_train.checkpoint.storage.objectstore", "FsspecStorage")


def _builtin(where: tuple[str, str]) -> type[Storage]:
    cls: type[Storage] = getattr(importlib.import_module(where[0]), where[1])
    return cls


# --- the interface -------------------------------------------------------------------------


class Storage:
    """Files under one root URL; every method takes paths relative to that root.

    ``Storage(url, ...)`` returns an instance of the backend class `backend_for` chooses.

    Args:
        url: a local path, ``file://`` URL, ``/gcs/<bucket>/...`` FUSE path or any fsspec
            URL (``gs://bucket/prefix``, ``memory://x``).
        retry: how long to retry transient errors.
        storage_options: passed to the fsspec filesystem (e.g. ``endpoint_url``, ``token``).
        object_store_mounts: local path prefixes that are object stores mounted with FUSE
            (no atomic directory rename). Tests pass a temporary directory here.
    """

    capabilities: ClassVar[Capabilities] = OBJECT_STORE
    # The operation named in errors of an upload of a spooled file (the default open_write).
    _upload_op: ClassVar[str] = "upload"
    # Check a read against the size first: it sizes the attempt's time allowance and
    # catches a connection that delivers fewer bytes (object stores).
    _sized_reads: ClassVar[bool] = False

    def __new__(cls, url: str = "", *args: Any, **kwargs: Any) -> Storage:
        backend = cls
        if cls is Storage:  # chosen once, here; a subclass named directly is itself
            backend = backend_for(url, kwargs.get("object_store_mounts",
                                                  DEFAULT_OBJECT_STORE_MOUNTS))
        return super().__new__(backend)

    def __init__(self, url: str, *, retry: RetryOptions = RetryOptions(),
                 storage_options: Mapping[str, Any] | None = None,
                 object_store_mounts: Sequence[str] = DEFAULT_OBJECT_STORE_MOUNTS) -> None:
        _check_url(url)
        self._retry = retry
        self._moved = 0   # bytes read and written so far (progress lines): _retrying's
        self._moved_lock = threading.Lock()
        self._proven_writable = False   # a probe passed (check_writable(again=False))
        self._url, self._root = self._open(url, dict(storage_options or {}))
        logger.debug("storage %s: %s, local=%s atomic_rename=%s", self._url,
                     type(self).__name__, self.is_local, self.atomic_rename)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._url!r})"

    # -- properties

    @property
    def url(self) -> str:
        return self._url

    @property
    def is_local(self) -> bool:
        """Paths are on the local filesystem (plain disk or a FUSE mount)."""
        return self.capabilities.posix_paths

    @property
    def atomic_rename(self) -> bool:
        """True only where a directory rename is atomic (plain local disk): the commit may
        rename a directory."""
        return self.capabilities.atomic_rename

    @property
    def commit_protocol(self) -> CommitProtocol:
        return self.capabilities.commit_protocol

    @property
    def fs(self) -> Any:
        """The fsspec filesystem behind an object-store URL; None for local paths."""
        return None

    @property
    def root(self) -> str:
        """The root as the backend spells it: a local path, or the fsspec path (bucket/prefix)."""
        return self._root

    def url_of(self, rel: str = "") -> str:
        rel = _check_rel(rel, allow_root=True)
        return self._url_of(rel) if rel else self._url

    def local_path(self, rel: str = "") -> str | None:
        """The file's real path on plain local disk (for mmap); None elsewhere."""
        if self.capabilities.local_paths:
            return self.url_of(rel)
        return None

    # -- writing

    def write_bytes(self, rel: str, data: bytes | bytearray | memoryview, *,
                    durable: bool = True) -> None:
        """Write a whole file: it exists complete or not at all (any backend).

        Local: temporary sibling, write, flush, fsync (durable), ``os.replace``, fsync of the
        directory (durable); parent directories are created. FUSE: written in place (the
        object appears on close). Object stores: a single upload.
        """
        rel = _check_rel(rel, allow_root=False)
        self._retrying("write", rel,
                       lambda t: self._write(rel, data, durable=durable, budget=t),
                       nbytes=memoryview(data).nbytes)

    @contextlib.contextmanager
    def open_write(self, rel: str, *, atomic: bool = True) -> Iterator[BinaryIO]:
        """Stream a large file; it appears only when the block exits without an exception.

        Local: a temporary sibling, fsynced and renamed into place on close (with
        ``atomic=False``: written in place and fsynced, for files inside a directory that is
        committed by its own rename). FUSE and object stores: spooled to a temporary file
        on local disk (``TMPDIR``), then uploaded with one ``put_file`` -- one object
        creation, retried as a whole. Disk, not memory, because checkpoint shards are as
        large as the model: an in-memory buffer would double the host memory a save needs.
        (``gs://`` with several streams: parts of a fixed number of bounded buffers upload
        while the stream is written, then are composed; storage_fsspec.TransferOptions.)
        On an exception no partial object or file is ever visible.
        """
        rel = _check_rel(rel, allow_root=False)
        with self._open_write(rel, atomic=atomic) as f:
            yield f

    # -- reading

    def read_bytes(self, rel: str) -> bytes:
        rel = _check_rel(rel, allow_root=False)
        size = self.size(rel) if self._sized_reads else None
        if size is not None:
            parts = self._read_parts(rel, size)
            if parts is not None:
                return parts

        def read(t: Budget) -> bytes:
            data = self._read(rel, t)
            if size is not None and len(data) != size:
                raise ShortReadError(f"got {len(data)} of {size} bytes")
            return data

        return self._retrying("read", rel, read, nbytes=size or 0)

    @contextlib.contextmanager
    def open_read(self, rel: str) -> Iterator[BinaryIO]:
        """A seekable binary reader. Object stores: ranged reads of 8 MiB, each retried."""
        rel = _check_rel(rel, allow_root=False)
        with self._open_read(rel) as f:
            yield f

    def size(self, rel: str) -> int:
        rel = _check_rel(rel, allow_root=False)
        return self._retrying("size", rel, lambda t: self._size(rel, t))

    def exists(self, rel: str = "") -> bool:
        """True for a file or a directory (a prefix with objects, on object stores).

        Errors other than "not found" (403, an outage) raise: reporting "absent" for them
        would make a restore silently start from scratch.
        """
        rel = _check_rel(rel, allow_root=True)
        return self._retrying("exists", rel, lambda t: self._exists(rel, t))

    def listdir(self, rel: str = "") -> list[str]:
        """Sorted names of the immediate children (files and directories).

        A missing directory, or a path that is a file, gives an empty list.
        """
        rel = _check_rel(rel, allow_root=True)
        return self._retrying("list", rel, lambda t: sorted(set(self._listdir(rel, t))))

    # -- changing the namespace

    def delete(self, rel: str, *, recursive: bool = False) -> None:
        """Delete a file, or a directory (recursive=True for a non-empty one); missing is fine.
        A symbolic link is deleted itself, never what it points to; a path below a link
        (posix paths) is refused, naming the link."""
        rel = _check_rel(rel, allow_root=False)
        self._retrying("delete", rel, lambda t: self._delete(rel, recursive, t))

    def is_link(self, rel: str) -> bool:
        """Whether ``rel`` itself is a symbolic link (posix paths; object stores have none).
        A delete never goes through one (``delete`` refuses a path below a link)."""
        rel = _check_rel(rel, allow_root=False)
        return self._is_link(rel)

    def makedirs(self, rel: str = "") -> None:
        """Create a directory and its parents; a no-op on object stores (no directories)."""
        rel = _check_rel(rel, allow_root=True)
        self._retrying("makedirs", rel, lambda t: self._makedirs(rel, t))

    def rename_dir(self, src_rel: str, dst_rel: str) -> None:
        """Atomically rename a directory (plain local disk only), then fsync the parent(s).

        Raises NotImplementedError where ``atomic_rename`` is False: object stores (and FUSE
        mounts of them) rename by copy + delete, which is not a commit.
        """
        src_rel = _check_rel(src_rel, allow_root=False)
        dst_rel = _check_rel(dst_rel, allow_root=False)
        if not self.capabilities.atomic_rename:
            raise NotImplementedError(
                f"rename_dir {self.url_of(src_rel)} -> {self.url_of(dst_rel)}: {self._url} is "
                f"an object store without atomic directory rename; check "
                f"Storage.atomic_rename and write in place with the commit marker last")
        self._retrying("rename", src_rel, lambda t: self._rename_dir(src_rel, dst_rel, t))

    def fsync_dir(self, rel: str = "") -> None:
        """fsync a directory so the names in it survive a power loss (plain local only)."""
        rel = _check_rel(rel, allow_root=True)
        self._retrying("fsync", rel, lambda t: self._fsync_dir(rel, t))

    def check_readable(self) -> None:
        """Fail with a clear error when the root cannot hold checkpoints to read: a local
        path that does not exist or is a file, or a bucket that does not exist. (An empty
        prefix in an existing bucket is fine: nothing has been saved there yet.)"""
        self._check_readable()

    def check_writable(self, *, again: bool = True) -> None:
        """Write and delete a probe under the root, so a missing bucket, a permission
        problem or a full disk fails now with a clear error, not at the first save hours
        later. The probe never stays behind, whether it was written or not.

        ``again=False``: not again on a handle whose probe passed (a handle kept for a
        later life: its saves have written since, and a failure now is met by a save)."""
        if self._proven_writable and not again:
            return
        probe = f"{PROBE_PREFIX}{uuid.uuid4().hex[:12]}"
        self._check_root_writable()
        try:
            self._retrying("check_writable", probe,
                           lambda t: self._write(probe, b"probe", durable=False, budget=t))
        except BaseException:
            # A write that failed may still have created it (an upload whose answer was lost).
            self._forget(probe)
            raise
        self.delete(probe)
        self._proven_writable = True
        logger.debug("storage %s is writable", self._url)

    # -- what every backend shares: retries, error translation, full disks

    def _retrying(self, op: str, rel: str, fn: Callable[[Budget], T], *,
                  nbytes: int = 0) -> T:
        """Run fn(attempt_budget) with retries on transient errors; translate failures."""
        opts = self._retry
        start = time.monotonic()
        deadline = start + opts.deadline_s
        attempts = 0
        backoff = wait_random_exponential(multiplier=opts.initial_s, max=opts.max_wait_s)

        def wait(state: RetryCallState) -> float:
            return max(0.0, min(backoff(state), deadline - time.monotonic()))

        def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            logger.warning("%s %s: transient error on attempt %d (%s); retrying in %.2fs",
                           op, self.url_of(rel), state.attempt_number,
                           describe(exc) if exc else "?",
                           state.next_action.sleep if state.next_action else 0.0)

        def attempt() -> T:
            nonlocal attempts
            attempts += 1
            return fn(Budget(max(deadline - time.monotonic(), _MIN_ATTEMPT_S),
                             nbytes / opts.min_throughput))

        retrying = Retrying(stop=stop_after_delay(opts.deadline_s), wait=wait,
                            retry=retry_if_exception(is_transient), reraise=True,
                            before_sleep=before_sleep)
        try:
            out = retrying(attempt)
        except Exception as exc:
            translated = self._translate(exc, op, rel, attempts, time.monotonic() - start,
                                         since=start)
            if translated is exc:
                raise
            raise translated from exc
        self.count_moved(nbytes)
        return out

    @property
    def bytes_moved(self) -> int:
        """Bytes of the reads and writes done so far (each part of a parallel transfer as
        it lands): what a progress line counts."""
        return self._moved

    def count_moved(self, nbytes: int) -> None:
        """``nbytes`` more were read or written (a read through a local path's memory map
        counts here too)."""
        if nbytes:
            with self._moved_lock:
                self._moved += nbytes

    def _translate(self, exc: Exception, op: str, rel: str, attempts: int,
                   elapsed: float, *, since: float | None = None) -> Exception:
        if isinstance(exc, StorageError):
            return exc
        url = self.url_of(rel)
        if isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS \
                and self.capabilities.posix_paths:
            return _no_space_error(exc, op, url, url)  # url is the path here
        kind = classify_error(exc)
        what = describe(exc)
        if kind is ErrorKind.TRANSIENT:
            return StorageUnavailableError(
                f"{op} {url}: storage unavailable, still failing after {attempts} attempt(s) "
                f"over {elapsed:.1f}s (last error: {what}){self._endpoint_hint(exc, since)}. "
                f"The service is down, throttling or unreachable: check the network and "
                f"endpoint, rerun later, or raise RetryOptions.deadline_s (now "
                f"{self._retry.deadline_s:g}s).",
                url=url, operation=op)
        if kind is ErrorKind.NOT_FOUND:
            return StorageNotFoundError(self._not_found_message(op, url, what),
                                        url=url, operation=op)
        if kind is ErrorKind.PERMISSION:
            return StoragePermissionError(
                f"{op} {url}: permission denied ({what}): {self._permission_fix}",
                url=url, operation=op)
        if isinstance(exc, (OSError, ValueError)) or from_storage_library(exc):
            return StorageError(f"{op} {url} failed: {what}", url=url, operation=op)
        return exc  # a programming error: keep its type and traceback

    def _raise_if_no_space(self, exc: BaseException, rel: str, path: str, *,
                           staging: bool = False) -> None:
        """A full disk met while the caller's block wrote ``path`` for rel: raise it as
        StorageFullError (``from`` the block's exception).

        This is where a writer's error comes back to us, so this is where its cause is made
        explicit: a serializer whose write to our file failed raises an error of its own
        *while handling* the write's, without ``from`` (torch.save: RuntimeError
        "unexpected pos ..."). Here, and only here, such an error gets the write's error as
        its ``__cause__``; everything downstream reads causes only.
        """
        if exc.__cause__ is None and not exc.__suppress_context__ \
                and _no_space_in(exc.__context__) is not None:
            exc.__cause__ = exc.__context__
        found = _no_space_in(exc)
        if isinstance(found, StorageFullError):
            return  # already says where
        if found is not None:
            raise _no_space_error(found, "write", self.url_of(rel), path,
                                  staging=staging) from exc

    # -- the backend's primitives (rel is checked and normalised; "" is the root)

    def _open(self, url: str, options: dict[str, Any]) -> tuple[str, str]:
        """Connect to ``url``; return the URL as errors show it and the root as the
        backend spells it."""
        raise NotImplementedError

    def _url_of(self, rel: str) -> str:
        return f"{self._url}/{rel}"

    def _write(self, rel: str, data: bytes | bytearray | memoryview, *, durable: bool,
               budget: Budget) -> None:
        """Write a whole file, visible complete or not at all."""
        raise NotImplementedError

    def _upload(self, src: str, rel: str, budget: Budget) -> None:
        """Write the local file ``src`` (a spooled stream) to rel."""
        with open(src, "rb") as f:
            data = f.read()
        self._write(rel, data, durable=True, budget=budget)

    @contextlib.contextmanager
    def _open_write(self, rel: str, *, atomic: bool) -> Iterator[BinaryIO]:
        """Spool the stream to local disk, then upload it as one file (retried whole)."""
        with tempfile.NamedTemporaryFile(prefix=TMP_FILE_PREFIX, suffix=".upload") as spool:
            try:
                yield cast(BinaryIO, spool)
                spool.flush()
            except Exception as exc:
                self._raise_if_no_space(exc, rel, spool.name, staging=True)
                raise
            size = os.fstat(spool.fileno()).st_size
            self._retrying(self._upload_op, rel, lambda t: self._upload(spool.name, rel, t),
                           nbytes=size)

    def _read(self, rel: str, budget: Budget) -> bytes:
        """The whole file; FileNotFoundError when it is missing."""
        raise NotImplementedError

    def _open_read(self, rel: str) -> BinaryIO:
        """An open, seekable reader (the caller closes it); it may retry on its own."""
        return io.BytesIO(self.read_bytes(rel))

    def _read_parts(self, rel: str, size: int) -> bytes | None:
        """The whole file of ``size`` bytes read as several requests (ranged reads in
        parallel), each retried with ``_retrying``; None: read it as one (``_read``)."""
        return None

    def _size(self, rel: str, budget: Budget) -> int:
        raise NotImplementedError

    def _exists(self, rel: str, budget: Budget) -> bool:
        """A file or a directory (a prefix) is at rel."""
        raise NotImplementedError

    def _listdir(self, rel: str, budget: Budget) -> Iterable[str]:
        """Names of the children; none for a missing directory or a file."""
        raise NotImplementedError

    def _delete(self, rel: str, recursive: bool, budget: Budget) -> None:
        """Delete a file or a directory (only an empty one unless recursive); missing is
        fine."""
        raise NotImplementedError

    def _is_link(self, rel: str) -> bool:
        """Objects have no links."""
        return False

    def _makedirs(self, rel: str, budget: Budget) -> None:
        """Objects need no directories."""

    def _fsync_dir(self, rel: str, budget: Budget) -> None:
        """Only a local disk has directory entries to make durable."""

    def _rename_dir(self, src_rel: str, dst_rel: str, budget: Budget) -> None:
        raise NotImplementedError  # only where capabilities.atomic_rename

    def _check_readable(self) -> None:
        """An empty or missing prefix is fine: nothing has been saved there yet."""

    def _check_root_writable(self) -> None:
        """Before the probe: fail with a clearer error than the probe's own."""

    def _forget(self, rel: str) -> None:
        """Remove what a failed write of rel may have left; never raises. Remote: nothing
        (during an outage another request would only wait out another deadline)."""

    # -- how this backend's errors are worded

    _permission_fix: ClassVar[str] = (
        "check this job's access rights and credentials for the checkpoint directory")

    def _not_found_message(self, op: str, url: str, what: str) -> str:
        return (f"{op} {url}: not found ({what}). It was never written or was deleted; "
                f"check the checkpoint directory")

    def _endpoint_hint(self, exc: BaseException, since: float | None) -> str:
        """Where a remote backend connects, for errors that say it is unavailable."""
        return ""


# --- plain local disk ----------------------------------------------------------------------


class LocalStorage(Storage):
    """A local POSIX directory: files renamed into place, directories renamed atomically."""

    capabilities = Capabilities(posix_paths=True, local_paths=True, atomic_rename=True,
                                commit_protocol=CommitProtocol.ATOMIC_RENAME)
    _permission_fix = ("fix the directory's owner or mode, or choose a checkpoint directory "
                       "this user can write")

    def _open(self, url: str, options: dict[str, Any]) -> tuple[str, str]:
        root = _local_root(split_protocol(url)[1])
        return root, root

    def _path(self, rel: str) -> str:
        return os.path.join(self._root, rel) if rel else self._root

    def _url_of(self, rel: str) -> str:
        return os.path.join(self._root, rel)

    def _not_found_message(self, op: str, url: str, what: str) -> str:
        if op in ("write", "check_writable"):   # its directories could not be created
            return (f"{op} {url}: no such file or directory ({what}): a directory on its "
                    f"path cannot be created there; check the path")
        return (f"{op} {url}: no such file or directory ({what}). It was never written "
                f"or was deleted; check the checkpoint directory")

    # -- writing

    def _write(self, rel: str, data: bytes | bytearray | memoryview, *, durable: bool,
               budget: Budget) -> None:
        with self._atomic_file(rel, durable=durable) as f:
            f.write(data)

    @contextlib.contextmanager
    def _atomic_file(self, rel: str, *, durable: bool) -> Iterator[BinaryIO]:
        """Yield a temporary sibling of rel; on a clean exit fsync it and rename it into place.

        Failures of the commit itself come out as StorageError; exceptions from the caller's
        block propagate unchanged (after removing the temporary file).
        """
        path = self._path(rel)
        directory, name = os.path.split(path)
        tmp = os.path.join(directory, f"{TMP_FILE_PREFIX}{name}-{uuid.uuid4().hex[:12]}")
        try:
            os.makedirs(directory, exist_ok=True)
            f = open(tmp, "wb")  # noqa: SIM115 - closed below on every path
        except OSError as exc:
            raise self._translate(exc, "write", rel, 1, 0.0) from exc
        try:
            yield cast(BinaryIO, f)
        except BaseException as exc:
            _discard(f, tmp)
            self._raise_if_no_space(exc, rel, path)  # a write to f: name the path
            raise
        try:
            f.flush()
            if durable:
                os.fsync(f.fileno())
            f.close()
            os.replace(tmp, path)
            if durable:
                _fsync_directory(directory)  # the new name survives a power loss
        except OSError as exc:
            _discard(f, tmp)
            raise self._translate(exc, "write", rel, 1, 0.0) from exc

    @contextlib.contextmanager
    def _open_write(self, rel: str, *, atomic: bool) -> Iterator[BinaryIO]:
        if atomic:
            with self._atomic_file(rel, durable=True) as f:
                yield f
            return
        # Inside a directory that is itself renamed into place (a checkpoint's temporary
        # step directory) the per-file rename buys nothing: write in place and fsync.
        path = self._path(rel)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            f = open(path, "wb")  # noqa: SIM115 - closed below on every path
        except OSError as exc:
            raise self._translate(exc, "write", rel, 1, 0.0) from exc
        # A failed write removes what it wrote: on a full disk a partial file would keep
        # the space, and every later save would fail too.
        try:
            yield cast(BinaryIO, f)
        except BaseException as exc:
            _discard(f, path)
            self._raise_if_no_space(exc, rel, path)
            raise
        try:
            f.flush()
            os.fsync(f.fileno())
            f.close()
        except OSError as exc:
            _discard(f, path)
            raise self._translate(exc, "write", rel, 1, 0.0) from exc

    # -- reading

    def _read(self, rel: str, budget: Budget) -> bytes:
        with open(self._path(rel), "rb") as f:
            return f.read()

    def _open_read(self, rel: str) -> BinaryIO:
        path = self._path(rel)
        return self._retrying("read", rel, lambda _t: open(path, "rb"))

    def _size(self, rel: str, budget: Budget) -> int:
        return os.stat(self._path(rel)).st_size

    def _exists(self, rel: str, budget: Budget) -> bool:
        try:
            os.stat(self._path(rel))
        except FileNotFoundError:
            return False
        return True

    def _listdir(self, rel: str, budget: Budget) -> Iterable[str]:
        try:
            names = os.listdir(self._path(rel))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [n for n in names if not n.startswith(TMP_FILE_PREFIX)]

    # -- the namespace

    def _delete(self, rel: str, recursive: bool, budget: Budget) -> None:
        path = self._path(rel)
        link = self._link_above(rel)
        if link is not None:
            raise StorageError(
                f"delete {path}: {link} is a symbolic link, and deleting through it would "
                f"delete what another directory holds; delete the link itself, or the "
                f"target where it lives", url=path, operation="delete")
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                if recursive:
                    shutil.rmtree(path)
                else:
                    os.rmdir(path)
            else:
                os.remove(path)
        except FileNotFoundError:
            pass

    def _is_link(self, rel: str) -> bool:
        return os.path.islink(self._path(rel))

    def _link_above(self, rel: str) -> str | None:
        """The first directory between the root and ``rel`` that is a symbolic link."""
        parts = rel.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            path = os.path.join(self._root, *parts[:i])
            if os.path.islink(path):
                return path
        return None

    def _makedirs(self, rel: str, budget: Budget) -> None:
        os.makedirs(self._path(rel), exist_ok=True)

    def _fsync_dir(self, rel: str, budget: Budget) -> None:
        _fsync_directory(self._path(rel))

    def _rename_dir(self, src_rel: str, dst_rel: str, budget: Budget) -> None:
        src, dst = self._path(src_rel), self._path(dst_rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        try:
            os.rename(src, dst)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise StorageError(
                    f"rename {self.url_of(src_rel)} -> {self.url_of(dst_rel)}: the "
                    f"destination exists and is not empty; delete it first or pick "
                    f"another name", url=self.url_of(dst_rel), operation="rename") from exc
            raise
        for parent in {os.path.dirname(dst), os.path.dirname(src)}:
            _fsync_directory(parent)

    # -- checks

    def _check_readable(self) -> None:
        if os.path.isdir(self._root):
            return
        if os.path.exists(self._root):
            raise StorageNotFoundError(
                f"{self._url} is a file, not a checkpoint directory; pass the directory "
                "that holds the step-* directories", url=self._url, operation="check")
        raise StorageNotFoundError(
            f"{self._url} does not exist; check the path (the checkpoint directory is "
            "AIP_CHECKPOINT_DIR, or ./checkpoints by default)", url=self._url,
            operation="check")

    def _check_root_writable(self) -> None:
        blocker = next((path for path in _ancestors(self._root)
                        if os.path.exists(path) and not os.path.isdir(path)), None)
        if blocker is not None:
            raise StorageNotFoundError(
                f"cannot use {self._url} as a checkpoint directory: {blocker} is a file; "
                "pass a directory path (it is created if missing)", url=self._url,
                operation="check_writable")

    def _forget(self, rel: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self._path(rel))


# --- a FUSE mount of an object store ---------------------------------------------------------


class FuseStorage(LocalStorage):
    """Cloud Storage FUSE (``/gcs/...``): POSIX calls over objects. A rename is copy +
    delete, so files are written in place (the object appears on close) and a step is
    committed by its marker."""

    capabilities = Capabilities(posix_paths=True, local_paths=False, atomic_rename=False,
                                commit_protocol=CommitProtocol.COMMIT_FILE)
    _upload_op = "write"
    # Streams spool to local disk, then one sequential copy: close uploads the object.
    _open_write = Storage._open_write

    def _write(self, rel: str, data: bytes | bytearray | memoryview, *, durable: bool,
               budget: Budget) -> None:
        path = self._path(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        f = open(path, "wb")  # noqa: SIM115 - closed below on every path
        try:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
            f.close()
        except BaseException:
            _discard(f, path)  # close would upload a partial object
            raise

    def _upload(self, src: str, rel: str, budget: Budget) -> None:
        path = self._path(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(src, "rb") as fin:
            fout = open(path, "wb")  # noqa: SIM115 - closed below on every path
            try:
                shutil.copyfileobj(fin, fout, 8 << 20)
                fout.flush()
                os.fsync(fout.fileno())
                fout.close()
            except BaseException:
                _discard(fout, path)  # close would upload a partial object
                raise

    def _fsync_dir(self, rel: str, budget: Budget) -> None:
        """Objects have no directory entries to make durable."""


# --- helpers -------------------------------------------------------------------------------


def _ancestors(path: str) -> list[str]:
    """``path`` and each directory above it, nearest first."""
    out = [path]
    while os.path.dirname(out[-1]) != out[-1]:
        out.append(os.path.dirname(out[-1]))
    return out


def _discard(f: BinaryIO | io.IOBase, path: str) -> None:
    """Close a file that failed and remove it; never raises. (Closing a buffered file whose
    flush failed raises the same error again: that must not skip the removal.)"""
    with contextlib.suppress(OSError, ValueError):
        f.close()
    with contextlib.suppress(OSError):
        os.unlink(path)


def _fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = [
    "DEFAULT_OBJECT_STORE_MOUNTS",
    "Budget",
    "Capabilities",
    "CommitProtocol",
    "ErrorKind",
    "FuseStorage",
    "LocalStorage",
    "RetryOptions",
    "Storage",
    "StorageError",
    "StorageFullError",
    "StorageNotFoundError",
    "StoragePermissionError",
    "StorageUnavailableError",
    "backend_for",
    "classify_error",
    "is_no_space",
    "is_transient",
    "register_backend",
]
