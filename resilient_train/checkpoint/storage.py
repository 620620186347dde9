"""One storage interface for local disk, Cloud Storage FUSE mounts and fsspec object stores.

The checkpoint manager talks to a `Storage` rooted at its checkpoint directory and has no
separate local / GCS code paths except the commit step, which asks `atomic_rename`.

Backends
    * plain local path (or ``file://``): POSIX calls; writes go to a temporary sibling that is
      fsynced and ``os.replace``d, so a file exists whole or not at all, as on object stores;
      ``rename_dir`` is an atomic ``os.rename`` followed by an fsync of the parent.
    * ``/gcs/<bucket>/...`` (Cloud Storage FUSE, see `DEFAULT_OBJECT_STORE_MOUNTS`): POSIX
      calls, but an object store underneath: a directory rename is copy + delete, so
      ``atomic_rename`` is False and ``rename_dir`` refuses. Files are written in place (a
      rename would upload everything twice); the object appears when the file is closed.
    * any fsspec URL (``gs://bucket/prefix``, ``memory://x``, ...): one upload per file.

Errors
    Every failure is a `StorageError` (an ``OSError``) whose message names the operation, the
    full URL, what happened and what to do. `StorageNotFoundError` is also a
    ``FileNotFoundError`` and `StoragePermissionError` a ``PermissionError``, so callers can
    keep catching the builtin types. The classes also carry the package's taxonomy
    (`resilient_train.errors`): unavailable -> transient (rerun later), not found / permission
    -> permanent.

Retries
    Transient errors (`classify_error`) are retried with tenacity's full-jitter exponential
    backoff (`RetryOptions`) until ``deadline_s``; then `StorageUnavailableError`. Anything
    else fails at once.

What gcsfs (2026.10) does itself -- read from gcsfs/retry.py and gcsfs/core.py:
    * Every HTTP request goes through ``GCSFileSystem._request``, decorated with
      ``retry_request(retries=6)``: up to 6 tries, sleeping ``min(2**(n-1) + U(0, 1), 32)``
      seconds between them, i.e. about 31-36 s before it gives up on one request. The number
      is fixed when gcsfs is imported (not configurable per instance).
    * It retries: ``HttpError`` with code 408, 429, 500-504 (and 401 "Invalid Credentials"),
      ``requests`` connection / timeout errors (a 502 is raised as
      ``requests.exceptions.ProxyError``), every ``aiohttp.ClientError`` (refused, reset,
      server disconnected, payload errors), google-auth ``RefreshError``, ``ChecksumError``.
    * It does not retry, and raises at once: 404 -> ``FileNotFoundError(path)``; 403 -> a plain
      ``OSError("Forbidden: <path>\\n<message>")`` (no status attribute: we recognise the
      prefix); 412 -> ``FileExistsError``; 400 whose message says "invalid" -> ``ValueError``.
      Other statuses >= 400 -> ``gcsfs.retry.HttpError`` with ``.code`` (int) and ``.message``.
    * Large uploads (``pipe`` >= 50 MiB, ``put_file`` >= 5 MiB) are resumable uploads whose
      chunks are retried individually; the object appears only when the upload is finalized.
    So a short outage never reaches us, and one gcsfs call under a long outage can take
    half a minute or more. To keep ``deadline_s`` a real bound, each attempt against an
    async filesystem runs under ``asyncio.wait_for`` with the time left (fsspec's
    ``sync(..., timeout=)``), which cancels gcsfs mid-backoff. A transfer of N bytes is
    allowed at least ``N / RetryOptions.min_throughput`` seconds per attempt so that the
    deadline never cuts off a healthy large upload. 403 and 404 are not retried by gcsfs and
    not by us.

Emulators
    For ``gs://`` with ``STORAGE_EMULATOR_HOST`` set or an ``endpoint_url`` storage option
    starting with ``http://``, we default ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` and
    ``token="anon"``. gcsfs reads that variable once, in ``gcsfs/__init__.py`` at import
    time, to decide whether ``gcsfs.GCSFileSystem`` is the experimental
    ``ExtendedGcsFileSystem`` (whose extra gRPC calls an HTTP emulator cannot answer: about
    60 s per bucket operation). Setting the variable cannot help once gcsfs is imported, so
    with an emulator we also construct ``gcsfs.core.GCSFileSystem`` -- the plain class --
    explicitly instead of going through fsspec's registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import io
import logging
import os
import posixpath
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeVar, cast

import fsspec
import fsspec.asyn
import fsspec.core
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_delay,
    wait_random_exponential,
)

from resilient_train.errors import PermanentError, TransientError

logger = logging.getLogger(__name__)

T = TypeVar("T")

GCSFS_HNS_ENV = "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"
# Where Vertex AI (and our docs) mount Cloud Storage FUSE: local calls, object semantics.
DEFAULT_OBJECT_STORE_MOUNTS: tuple[str, ...] = ("/gcs/",)
TRANSIENT_HTTP_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# Our own scratch names; listdir hides them, so a crash mid-write leaves nothing visible.
TMP_FILE_PREFIX = ".rt-tmp-"
PROBE_PREFIX = ".rt-write-probe-"
_READ_BUFFER = 8 << 20  # open_read on object stores: one ranged GET per 8 MiB
_MIN_ATTEMPT_S = 0.05
_WRITE_OPS = frozenset({"write", "upload", "check_writable"})


# --- options and errors ----------------------------------------------------------------


@dataclass(frozen=True)
class RetryOptions:
    """How long and how to retry transient storage errors.

    Backoff is tenacity's full jitter: the n-th wait is uniform in
    [0, min(max_wait_s, initial_s * 2**(n-1))], and never runs past the deadline.
    """

    deadline_s: float = 120.0
    initial_s: float = 0.5
    max_wait_s: float = 10.0
    # bytes/s: an attempt moving N bytes may run N / min_throughput s even past the deadline
    # (the deadline bounds retrying through failures, not a healthy slow transfer).
    min_throughput: float = float(1 << 20)

    def __post_init__(self) -> None:
        for name in ("deadline_s", "initial_s", "max_wait_s", "min_throughput"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"RetryOptions.{name} must be > 0, got {value!r}")


class StorageError(OSError):
    """A storage operation failed; the message names the URL, what happened and the fix."""

    def __init__(self, message: str, *, url: str | None = None,
                 operation: str | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.operation = operation

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class StorageNotFoundError(StorageError, FileNotFoundError, PermanentError):
    """The bucket or the object / file does not exist."""


class StoragePermissionError(StorageError, PermissionError, PermanentError):
    """Access denied (HTTP 401/403, EACCES) or no usable credentials."""


class StorageUnavailableError(StorageError, TransientError):
    """Transient errors (throttling, 5xx, resets, timeouts) outlasted the retry deadline."""


class ErrorKind(enum.Enum):
    TRANSIENT = "transient"
    NOT_FOUND = "not_found"
    PERMISSION = "permission"
    OTHER = "other"


def _http_status(exc: BaseException) -> int | None:
    # Look the classes up only if their modules are loaded: no import cost for local runs.
    gcsfs_retry = sys.modules.get("gcsfs.retry")
    if gcsfs_retry is not None and isinstance(exc, gcsfs_retry.HttpError):
        try:
            return int(exc.code)
        except (TypeError, ValueError):
            return None
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None and isinstance(exc, aiohttp.ClientResponseError):
        return int(exc.status)
    return None


def classify_error(exc: BaseException) -> ErrorKind:
    """What a failed storage call means: retry it, or report it now (and as what)."""
    if isinstance(exc, StorageUnavailableError):
        return ErrorKind.TRANSIENT
    if isinstance(exc, StorageNotFoundError):
        return ErrorKind.NOT_FOUND
    if isinstance(exc, StoragePermissionError):
        return ErrorKind.PERMISSION
    status = _http_status(exc)
    if status is not None:
        if status == 404:
            return ErrorKind.NOT_FOUND
        if status in (401, 403):
            return ErrorKind.PERMISSION
        return ErrorKind.TRANSIENT if status in TRANSIENT_HTTP_STATUSES else ErrorKind.OTHER
    if isinstance(exc, FileNotFoundError):
        return ErrorKind.NOT_FOUND
    if isinstance(exc, PermissionError):
        return ErrorKind.PERMISSION
    if type(exc) is OSError and str(exc).startswith("Forbidden"):
        return ErrorKind.PERMISSION  # gcsfs's 403
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return ErrorKind.TRANSIENT  # incl. resets and fsspec's FSTimeoutError
    rex = sys.modules.get("requests.exceptions")
    if rex is not None and isinstance(
            exc, (rex.ConnectionError, rex.Timeout, rex.ChunkedEncodingError)):
        return ErrorKind.TRANSIENT  # gcsfs raises ProxyError (a ConnectionError) for 502
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None and isinstance(exc, aiohttp.ClientError):
        return ErrorKind.TRANSIENT  # connection refused / reset / disconnected / payload
    gcsfs_retry = sys.modules.get("gcsfs.retry")
    if gcsfs_retry is not None and isinstance(exc, gcsfs_retry.ChecksumError):
        return ErrorKind.TRANSIENT  # corrupted in transit: fetch again
    gauth = sys.modules.get("google.auth.exceptions")
    if gauth is not None:
        if isinstance(exc, gauth.RefreshError):
            return ErrorKind.TRANSIENT if getattr(exc, "retryable", False) \
                else ErrorKind.PERMISSION
        if isinstance(exc, gauth.TransportError):
            return ErrorKind.TRANSIENT
        if isinstance(exc, gauth.DefaultCredentialsError):
            return ErrorKind.PERMISSION
    return ErrorKind.OTHER


def is_transient(exc: BaseException) -> bool:
    return classify_error(exc) is ErrorKind.TRANSIENT


def _from_storage_library(exc: BaseException) -> bool:
    module = type(exc).__module__.split(".")[0]
    return module in {"gcsfs", "fsspec", "aiohttp", "requests", "google", "urllib3"}


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().replace("\n", " ")
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _ShortReadError(ConnectionError):
    """The connection delivered fewer bytes than the object holds (transient: read again)."""


# --- URL handling ----------------------------------------------------------------------


def uses_gcs_emulator(storage_options: Mapping[str, Any],
                      environ: Mapping[str, str] | None = None) -> bool:
    """Whether a gs:// Storage with these options talks to a local plain-HTTP emulator."""
    env = os.environ if environ is None else environ
    endpoint = storage_options.get("endpoint_url")
    if isinstance(endpoint, str) and endpoint:
        return endpoint.startswith("http://")  # an explicit endpoint wins over the env
    return env.get("STORAGE_EMULATOR_HOST", "") not in ("", "default")


def is_under_mount(path: str, mounts: Sequence[str]) -> bool:
    path = os.path.abspath(path)
    for mount in mounts:
        prefix = os.path.abspath(mount).rstrip("/") + "/"
        if path == prefix.rstrip("/") or path.startswith(prefix):
            return True
    return False


def _make_gcs_filesystem(options: dict[str, Any]) -> Any:
    # No stale listings: other ranks and processes write to the same prefix.
    options.setdefault("use_listings_cache", False)
    if not uses_gcs_emulator(options):
        return fsspec.filesystem("gs", **options)
    os.environ.setdefault(GCSFS_HNS_ENV, "false")  # effective only if gcsfs is not imported yet
    options.setdefault("token", "anon")
    from gcsfs.core import GCSFileSystem as PlainGCSFileSystem

    gcsfs_pkg = sys.modules.get("gcsfs")
    if gcsfs_pkg is not None and getattr(gcsfs_pkg, "GCSFileSystem", None) \
            is not PlainGCSFileSystem:
        logger.debug("gcsfs was imported with %s enabled; using the plain GCSFileSystem "
                     "for the emulator", GCSFS_HNS_ENV)
    return PlainGCSFileSystem(**options)


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


# --- the interface ---------------------------------------------------------------------


class Storage:
    """Files under one root URL; every method takes paths relative to that root.

    Args:
        url: a local path, ``file://`` URL, ``/gcs/<bucket>/...`` FUSE path or any fsspec
            URL (``gs://bucket/prefix``, ``memory://x``).
        retry: how long to retry transient errors.
        storage_options: passed to the fsspec filesystem (e.g. ``endpoint_url``, ``token``).
        object_store_mounts: local path prefixes that are object stores mounted with FUSE
            (no atomic directory rename). Tests pass a temporary directory here.
    """

    def __init__(self, url: str, *, retry: RetryOptions = RetryOptions(),
                 storage_options: Mapping[str, Any] | None = None,
                 object_store_mounts: Sequence[str] = DEFAULT_OBJECT_STORE_MOUNTS) -> None:
        if not isinstance(url, str) or not url:
            raise ValueError(f"a storage URL must be a non-empty string, got {url!r}")
        self._retry = retry
        protocol, rest = fsspec.core.split_protocol(url)
        self._fs: Any = None
        self._protocol = protocol or "file"
        if protocol in (None, "file", "local"):
            self._root = os.path.abspath(os.path.expanduser(rest))
            self._url = self._root
            self._fuse = is_under_mount(self._root, object_store_mounts)
        else:
            options = dict(storage_options or {})
            if protocol in ("gs", "gcs"):
                self._fs = _make_gcs_filesystem(options)
                root = self._fs._strip_protocol(url)
            else:
                self._fs, root = fsspec.core.url_to_fs(url, **options)
            self._root = root.rstrip("/") or root
            self._url = url.rstrip("/") or url
            self._fuse = False
        logger.debug("storage %s: local=%s atomic_rename=%s", self._url, self.is_local,
                     self.atomic_rename)

    def __repr__(self) -> str:
        return f"Storage({self._url!r})"

    # -- properties

    @property
    def url(self) -> str:
        return self._url

    @property
    def is_local(self) -> bool:
        """Paths are on the local filesystem (plain disk or a FUSE mount)."""
        return self._fs is None

    @property
    def atomic_rename(self) -> bool:
        """True only for plain local POSIX paths: the commit may rename a directory."""
        return self._fs is None and not self._fuse

    @property
    def fs(self) -> Any:
        """The fsspec filesystem behind an object-store URL; None for local paths."""
        return self._fs

    @property
    def root(self) -> str:
        """The root as the backend spells it: a local path, or the fsspec path (bucket/prefix)."""
        return self._root

    def url_of(self, rel: str = "") -> str:
        rel = _check_rel(rel, allow_root=True)
        if not rel:
            return self._url
        if self._fs is None:
            return os.path.join(self._root, rel)
        return f"{self._url}/{rel}"

    # -- internals

    def _local(self, rel: str) -> str:
        return os.path.join(self._root, rel) if rel else self._root

    def _remote(self, rel: str) -> str:
        return f"{self._root}/{rel}" if rel else self._root

    def _fs_call(self, name: str, *args: Any, timeout: float | None, **kwargs: Any) -> Any:
        fs = self._fs
        if timeout is not None and getattr(fs, "async_impl", False) \
                and not getattr(fs, "asynchronous", False):
            # wait_for cancels the coroutine (and gcsfs's own backoff) when time is up.
            return fsspec.asyn.sync(fs.loop, getattr(fs, "_" + name), *args,
                                    timeout=timeout, **kwargs)
        return getattr(fs, name)(*args, **kwargs)

    def _retrying(self, op: str, rel: str, fn: Callable[[float | None], T], *,
                  nbytes: int = 0) -> T:
        """Run fn(attempt_timeout) with retries on transient errors; translate failures."""
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
                           _describe(exc) if exc else "?",
                           state.next_action.sleep if state.next_action else 0.0)

        def attempt() -> T:
            nonlocal attempts
            attempts += 1
            timeout = None
            if self._fs is not None:
                timeout = max(deadline - time.monotonic(), nbytes / opts.min_throughput,
                              _MIN_ATTEMPT_S)
            return fn(timeout)

        retrying = Retrying(stop=stop_after_delay(opts.deadline_s), wait=wait,
                            retry=retry_if_exception(is_transient), reraise=True,
                            before_sleep=before_sleep)
        try:
            return retrying(attempt)
        except Exception as exc:
            translated = self._translate(exc, op, rel, attempts, time.monotonic() - start)
            if translated is exc:
                raise
            raise translated from exc

    def _translate(self, exc: Exception, op: str, rel: str, attempts: int,
                   elapsed: float) -> Exception:
        if isinstance(exc, StorageError):
            return exc
        url = self.url_of(rel)
        kind = classify_error(exc)
        what = _describe(exc)
        if kind is ErrorKind.TRANSIENT:
            return StorageUnavailableError(
                f"{op} {url}: storage unavailable, still failing after {attempts} attempt(s) "
                f"over {elapsed:.1f}s (last error: {what}). The service is down, throttling "
                f"or unreachable: check the network and endpoint, rerun later, or raise "
                f"RetryOptions.deadline_s (now {self._retry.deadline_s:g}s).",
                url=url, operation=op)
        if kind is ErrorKind.NOT_FOUND:
            if self._protocol in ("gs", "gcs") and op in _WRITE_OPS:
                # A write only 404s when the bucket itself is missing.
                bucket = self._root.split("/", 1)[0]
                msg = (f"{op} {url}: bucket {bucket!r} does not exist ({self._url}): create it "
                       f"(gcloud storage buckets create gs://{bucket}) or fix the checkpoint "
                       f"directory")
            elif self._fs is None:
                msg = (f"{op} {url}: no such file or directory ({what}). It was never written "
                       f"or was deleted; check the checkpoint directory")
            else:
                msg = (f"{op} {url}: no such object ({what}). It was never written, was "
                       f"deleted, or the bucket or prefix is wrong; check the checkpoint "
                       f"directory")
            return StorageNotFoundError(msg, url=url, operation=op)
        if kind is ErrorKind.PERMISSION:
            if self._fs is None:
                fix = ("fix the directory's owner or mode, or choose a checkpoint directory "
                       "this user can write")
            else:
                fix = ("grant the job's identity read/write access to the bucket (e.g. "
                       "roles/storage.objectUser) or fix the credentials "
                       "(GOOGLE_APPLICATION_CREDENTIALS, gcloud auth application-default login)")
            return StoragePermissionError(f"{op} {url}: permission denied ({what}): {fix}",
                                          url=url, operation=op)
        if isinstance(exc, (OSError, ValueError)) or _from_storage_library(exc):
            return StorageError(f"{op} {url} failed: {what}", url=url, operation=op)
        return exc  # a programming error: keep its type and traceback

    # -- writing

    def write_bytes(self, rel: str, data: bytes | bytearray | memoryview, *,
                    durable: bool = True) -> None:
        """Write a whole file: it exists complete or not at all (any backend).

        Local: temporary sibling, write, flush, fsync (durable), ``os.replace``, fsync of the
        directory (durable); parent directories are created. FUSE: written in place (the
        object appears on close). Object stores: a single upload.
        """
        rel = _check_rel(rel, allow_root=False)
        size = memoryview(data).nbytes
        if self._fs is None:
            self._retrying("write", rel,
                           lambda _t: self._write_local(rel, data, durable=durable),
                           nbytes=size)
        else:
            path = self._remote(rel)
            self._retrying("write", rel,
                           lambda t: self._fs_call("pipe_file", path, data, timeout=t),
                           nbytes=size)

    def _write_local(self, rel: str, data: bytes | bytearray | memoryview, *,
                     durable: bool) -> None:
        if self._fuse:
            path = self._local(rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                if durable:
                    os.fsync(f.fileno())
            return
        with self._local_atomic_file(rel, durable=durable) as f:
            f.write(data)

    @contextlib.contextmanager
    def _local_atomic_file(self, rel: str, *, durable: bool) -> Iterator[BinaryIO]:
        """Yield a temporary sibling of rel; on a clean exit fsync it and rename it into place.

        Failures of the commit itself come out as StorageError; exceptions from the caller's
        block propagate unchanged (after removing the temporary file).
        """
        path = self._local(rel)
        directory, name = os.path.split(path)
        tmp = os.path.join(directory, f"{TMP_FILE_PREFIX}{name}-{uuid.uuid4().hex[:12]}")
        try:
            os.makedirs(directory, exist_ok=True)
            f = open(tmp, "wb")  # noqa: SIM115 - closed below on every path
        except OSError as exc:
            raise self._translate(exc, "write", rel, 1, 0.0) from exc
        try:
            yield cast(BinaryIO, f)
        except BaseException:
            f.close()
            with contextlib.suppress(OSError):
                os.unlink(tmp)
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
            f.close()
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise self._translate(exc, "write", rel, 1, 0.0) from exc

    def local_path(self, rel: str = "") -> str | None:
        """The file's real path on plain local disk (for mmap); None elsewhere."""
        if self._fs is None and not self._fuse:
            return self._local(_check_rel(rel, allow_root=True))
        return None

    @contextlib.contextmanager
    def open_write(self, rel: str, *, atomic: bool = True) -> Iterator[BinaryIO]:
        """Stream a large file; it appears only when the block exits without an exception.

        Local: a temporary sibling, fsynced and renamed into place on close (with
        ``atomic=False``: written in place and fsynced, for files inside a directory that is
        committed by its own rename). FUSE and object
        stores: spooled to a temporary file on local disk (``TMPDIR``), then uploaded with
        one ``put_file`` -- one object creation, retried as a whole. Disk,
        not memory, because checkpoint shards are as large as the model: an in-memory
        buffer would double the host memory a save needs. On an exception nothing is
        uploaded and no partial object or file is ever visible.
        """
        rel = _check_rel(rel, allow_root=False)
        if self._fs is None and not self._fuse:
            if atomic:
                with self._local_atomic_file(rel, durable=True) as f:
                    yield f
                return
            # Inside a directory that is itself renamed into place (a checkpoint's temporary
            # step directory) the per-file rename buys nothing: write in place and fsync.
            path = self._local(rel)
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                f = open(path, "wb")  # noqa: SIM115 - closed below on every path
            except OSError as exc:
                raise self._translate(exc, "write", rel, 1, 0.0) from exc
            with f:
                yield cast(BinaryIO, f)
                try:
                    f.flush()
                    os.fsync(f.fileno())
                except OSError as exc:
                    raise self._translate(exc, "write", rel, 1, 0.0) from exc
            return
        with tempfile.NamedTemporaryFile(prefix=TMP_FILE_PREFIX, suffix=".upload") as spool:
            yield cast(BinaryIO, spool)
            spool.flush()
            size = os.fstat(spool.fileno()).st_size
            if self._fs is None:  # FUSE: one sequential copy, then close uploads it
                self._retrying("write", rel,
                               lambda _t: self._copy_to_fuse(spool.name, rel), nbytes=size)
            else:
                path = self._remote(rel)
                self._retrying(
                    "upload", rel,
                    lambda t: self._fs_call("put_file", spool.name, path, timeout=t),
                    nbytes=size)

    def _copy_to_fuse(self, src: str, rel: str) -> None:
        path = self._local(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(src, "rb") as fin, open(path, "wb") as fout:
            shutil.copyfileobj(fin, fout, 8 << 20)
            fout.flush()
            os.fsync(fout.fileno())

    # -- reading

    def read_bytes(self, rel: str) -> bytes:
        rel = _check_rel(rel, allow_root=False)
        if self._fs is None:
            path = self._local(rel)

            def read_local(_t: float | None) -> bytes:
                with open(path, "rb") as f:
                    return f.read()

            return self._retrying("read", rel, read_local)
        path = self._remote(rel)
        # Size first: it sizes the attempt's time allowance and catches a short read.
        size = self.size(rel)

        def read_remote(t: float | None) -> bytes:
            data = self._fs_call("cat_file", path, timeout=t)
            if len(data) != size:
                raise _ShortReadError(f"got {len(data)} of {size} bytes")
            return cast(bytes, data)

        return self._retrying("read", rel, read_remote, nbytes=size)

    @contextlib.contextmanager
    def open_read(self, rel: str) -> Iterator[BinaryIO]:
        """A seekable binary reader. Object stores: ranged reads of 8 MiB, each retried."""
        rel = _check_rel(rel, allow_root=False)
        if self._fs is None:
            path = self._local(rel)
            f = self._retrying("read", rel, lambda _t: open(path, "rb"))  # noqa: SIM115
            with f:
                yield cast(BinaryIO, f)
            return
        raw = _RangeReader(self, rel, self.size(rel))
        with io.BufferedReader(raw, buffer_size=_READ_BUFFER) as reader:
            yield cast(BinaryIO, reader)

    def size(self, rel: str) -> int:
        rel = _check_rel(rel, allow_root=False)
        if self._fs is None:
            path = self._local(rel)
            return self._retrying("size", rel, lambda _t: os.stat(path).st_size)
        path = self._remote(rel)
        info = self._retrying("size", rel, lambda t: self._fs_call("info", path, timeout=t))
        return int(info.get("size") or 0)

    def exists(self, rel: str = "") -> bool:
        """True for a file or a directory (a prefix with objects, on object stores).

        Errors other than "not found" (403, an outage) raise: reporting "absent" for them
        would make a restore silently start from scratch.
        """
        rel = _check_rel(rel, allow_root=True)

        def check(t: float | None) -> bool:
            try:
                if self._fs is None:
                    os.stat(self._local(rel))
                else:
                    self._fs_call("info", self._remote(rel), timeout=t)
            except FileNotFoundError:
                return False
            return True

        return self._retrying("exists", rel, check)

    def listdir(self, rel: str = "") -> list[str]:
        """Sorted names of the immediate children (files and directories).

        A missing directory, or a path that is a file, gives an empty list.
        """
        rel = _check_rel(rel, allow_root=True)
        if self._fs is None:
            path = self._local(rel)

            def list_local(_t: float | None) -> list[str]:
                try:
                    names = os.listdir(path)
                except (FileNotFoundError, NotADirectoryError):
                    return []
                return sorted(n for n in names if not n.startswith(TMP_FILE_PREFIX))

            return self._retrying("list", rel, list_local)
        path = self._remote(rel)

        def list_remote(t: float | None) -> list[str]:
            try:
                entries = self._fs_call("ls", path, detail=True, timeout=t)
            except FileNotFoundError:
                return []
            names = set()
            for entry in entries:
                name = str(entry["name"]).rstrip("/")
                if name == path.rstrip("/"):
                    continue  # ls of a file lists the file itself
                names.add(posixpath.basename(name))
            return sorted(names)

        return self._retrying("list", rel, list_remote)

    # -- changing the namespace

    def delete(self, rel: str, *, recursive: bool = False) -> None:
        """Delete a file, or a directory (recursive=True for a non-empty one); missing is fine."""
        rel = _check_rel(rel, allow_root=False)
        if self._fs is None:
            path = self._local(rel)

            def delete_local(_t: float | None) -> None:
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

            self._retrying("delete", rel, delete_local)
            return
        path = self._remote(rel)

        def delete_remote(t: float | None) -> None:
            try:
                self._fs_call("rm", path, recursive=recursive, timeout=t)
                return
            except FileNotFoundError:
                pass
            if not recursive:
                # gcsfs "deletes" a prefix by 404ing on the object: say why nothing happened.
                try:
                    info = self._fs_call("info", path, timeout=t)
                except FileNotFoundError:
                    return
                if info.get("type") == "directory":
                    raise StorageError(
                        f"delete {self.url_of(rel)}: it is a non-empty directory; pass "
                        f"recursive=True to delete it and everything under it",
                        url=self.url_of(rel), operation="delete")

        self._retrying("delete", rel, delete_remote)

    def makedirs(self, rel: str = "") -> None:
        """Create a directory and its parents; a no-op on object stores (no directories)."""
        rel = _check_rel(rel, allow_root=True)
        if self._fs is None:
            path = self._local(rel)
            self._retrying("makedirs", rel, lambda _t: os.makedirs(path, exist_ok=True))

    def rename_dir(self, src_rel: str, dst_rel: str) -> None:
        """Atomically rename a directory (plain local disk only), then fsync the parent(s).

        Raises NotImplementedError where ``atomic_rename`` is False: object stores (and FUSE
        mounts of them) rename by copy + delete, which is not a commit.
        """
        src_rel = _check_rel(src_rel, allow_root=False)
        dst_rel = _check_rel(dst_rel, allow_root=False)
        if not self.atomic_rename:
            raise NotImplementedError(
                f"rename_dir {self.url_of(src_rel)} -> {self.url_of(dst_rel)}: {self._url} is "
                f"an object store without atomic directory rename; check "
                f"Storage.atomic_rename and write in place with the commit marker last")
        src, dst = self._local(src_rel), self._local(dst_rel)

        def rename(_t: float | None) -> None:
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

        self._retrying("rename", src_rel, rename)

    def fsync_dir(self, rel: str = "") -> None:
        """fsync a directory so the names in it survive a power loss (plain local only)."""
        rel = _check_rel(rel, allow_root=True)
        if self.atomic_rename:
            path = self._local(rel)
            self._retrying("fsync", rel, lambda _t: _fsync_directory(path))

    def check_readable(self) -> None:
        """Fail with a clear error when the root cannot hold checkpoints to read: a local
        path that does not exist or is a file, or a bucket that does not exist. (An empty
        prefix in an existing bucket is fine: nothing has been saved there yet.)"""
        if self._fs is None:
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
        bucket = self._root.split("/", 1)[0]
        if self._protocol in ("gs", "gcs") and bucket:
            def check(t: float | None) -> None:
                self._fs_call("info", bucket, timeout=t)

            try:
                self._retrying("check", "", check)
            except StorageNotFoundError:
                raise StorageNotFoundError(
                    f"bucket gs://{bucket} does not exist (from {self._url}); check the "
                    "bucket name and project", url=self._url, operation="check") from None

    def check_writable(self) -> None:
        """Write and delete a probe under the root, so a missing bucket or a permission
        problem fails now with a clear error, not at the first save hours later."""
        probe = f"{PROBE_PREFIX}{uuid.uuid4().hex[:12]}"
        if self._fs is None:
            blocker = next((path for path in _ancestors(self._root)
                            if os.path.exists(path) and not os.path.isdir(path)), None)
            if blocker is not None:
                raise StorageNotFoundError(
                    f"cannot use {self._url} as a checkpoint directory: {blocker} is a file; "
                    "pass a directory path (it is created if missing)", url=self._url,
                    operation="check_writable")
            self._retrying("check_writable", probe,
                           lambda _t: self._write_local(probe, b"probe", durable=False))
        else:
            path = self._remote(probe)
            self._retrying("check_writable", probe,
                           lambda t: self._fs_call("pipe_file", path, b"probe", timeout=t))
        self.delete(probe)
        logger.debug("storage %s is writable", self._url)


def _ancestors(path: str) -> list[str]:
    """``path`` and each directory above it, nearest first."""
    out = [path]
    while os.path.dirname(out[-1]) != out[-1]:
        out.append(os.path.dirname(out[-1]))
    return out


class _RangeReader(io.RawIOBase):
    """Seekable raw reader over an object: each read is one ranged GET, retried."""

    def __init__(self, storage: Storage, rel: str, size: int) -> None:
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

        def fetch(t: float | None) -> bytes:
            data = self._storage._fs_call("cat_file", self._path, start=start, end=end,
                                          timeout=t)
            if len(data) != end - start:
                raise _ShortReadError(f"range {start}-{end}: got {len(data)} bytes")
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


def _fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = [
    "DEFAULT_OBJECT_STORE_MOUNTS",
    "ErrorKind",
    "RetryOptions",
    "Storage",
    "StorageError",
    "StorageNotFoundError",
    "StoragePermissionError",
    "StorageUnavailableError",
    "classify_error",
    "is_transient",
    "uses_gcs_emulator",
]
