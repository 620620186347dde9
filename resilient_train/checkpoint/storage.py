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
    async filesystem runs on fsspec's loop for at most the time left, and is cancelled
    (gcsfs mid-backoff included) when that is up. A transfer of N bytes may run
    ``N / RetryOptions.min_throughput`` seconds, past the deadline, but only once this
    attempt has reached the endpoint (a TCP connection made or reused, seen through an
    aiohttp trace on gcsfs's session): a healthy large upload is not cut off, and an endpoint
    that refuses connections or never answers costs ``deadline_s`` and no more. The same
    trace keeps the last error gcsfs retried on (gcsfs's own retries hide it), so a timeout
    names the endpoint and, e.g., the refused connection. 403 and 404 are not retried by
    gcsfs and not by us.

Full disks
    ENOSPC / EDQUOT on a local write is a `StorageFullError` naming the file, the
    directory and the space left there (a write to an object store's local staging file
    names ``TMPDIR``). A failed write never leaves its temporary or partial file behind.

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
import concurrent.futures
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
from fsspec.exceptions import FSTimeoutError
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
# No space left / over quota: the write cannot succeed until someone frees space.
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
EMULATOR_ENV = "STORAGE_EMULATOR_HOST"


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
    # bytes/s: an attempt moving N bytes may run N / min_throughput s even past the deadline,
    # once it has reached the endpoint (the deadline bounds retrying through failures and
    # endpoints that never answer, not a healthy slow transfer).
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


class StorageFullError(StorageError, PermanentError):
    """No space left on the device (ENOSPC) or over the disk quota (EDQUOT).

    ``directory`` is where the write failed, ``free_bytes`` what was left there when it
    did (None where it cannot be told). Permanent: a rerun fills the same disk again
    unless someone frees space.
    """

    def __init__(self, message: str, *, url: str | None = None, operation: str | None = None,
                 directory: str | None = None, free_bytes: int | None = None) -> None:
        super().__init__(message, url=url, operation=operation)
        self.directory = directory
        self.free_bytes = free_bytes


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


def _no_space_in(exc: BaseException) -> OSError | None:
    """The ENOSPC / EDQUOT error (or StorageFullError) in exc's chain. torch.save reports a
    failed write of its file object as a RuntimeError ("unexpected pos ...") raised while
    handling the OSError, so the chain is searched, not just exc."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, StorageFullError) or (
                isinstance(e, OSError) and e.errno in NO_SPACE_ERRNOS):
            return e
        e = e.__cause__ or e.__context__
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
        f"{op} {url}: {what} ({_describe(exc)}); {format_bytes(free)} free in "
        f"{directory}. {fix[0].upper()}{fix[1:]}.",
        url=url, operation=op, directory=directory, free_bytes=free)


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


class _ConnectionTrace:
    """What gcsfs's aiohttp session did, seen through an aiohttp ``TraceConfig``: how many
    connections reached the endpoint (made or reused), and the last request error. gcsfs
    retries connection errors itself, so without this a cancelled attempt says only
    "timeout"; and a transfer gets its throughput allowance only once it got through."""

    def __init__(self) -> None:
        self.reached = 0
        self.last_error: tuple[float, BaseException] | None = None
        self._config: Any = None

    def config(self) -> Any:
        """One TraceConfig per trace: fsspec caches filesystems by their arguments, and the
        same object keeps Storages with equal options on one filesystem (one session)."""
        if self._config is None:
            self._config = self._make_config()
        return self._config

    def _make_config(self) -> Any:
        import aiohttp

        async def reached(_session: Any, _ctx: Any, _params: Any) -> None:
            self.reached += 1

        async def failed(_session: Any, _ctx: Any, params: Any) -> None:
            self.last_error = (time.monotonic(), params.exception)

        trace = aiohttp.TraceConfig()
        trace.on_connection_create_end.append(reached)
        trace.on_connection_reuseconn.append(reached)
        trace.on_request_exception.append(failed)
        return trace

    def error_since(self, t: float) -> BaseException | None:
        last = self.last_error
        return last[1] if last is not None and last[0] >= t else None


# Per distinct storage options: Storages with equal options share gcsfs's cached instance.
_TRACES: dict[str, _ConnectionTrace] = {}


def _trace_for(options: Mapping[str, Any]) -> _ConnectionTrace:
    key = repr(sorted(options.items(), key=lambda kv: kv[0]))
    return _TRACES.setdefault(key, _ConnectionTrace())


def _make_gcs_filesystem(options: dict[str, Any], trace: _ConnectionTrace | None = None
                         ) -> Any:
    # No stale listings: other ranks and processes write to the same prefix.
    options.setdefault("use_listings_cache", False)
    if trace is not None:
        session = dict(options.get("session_kwargs") or {})
        session["trace_configs"] = [*session.get("trace_configs", ()), trace.config()]
        options["session_kwargs"] = session
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


def _gcs_endpoint(fs: Any, options: Mapping[str, Any]) -> str:
    """The base URL gcsfs talks to, and where it came from (for error messages)."""
    location = str(getattr(fs, "_location", "") or "the Cloud Storage endpoint")
    if isinstance(options.get("endpoint_url"), str) and options["endpoint_url"]:
        return f"{location} (storage option endpoint_url)"
    if os.environ.get(EMULATOR_ENV, "") not in ("", "default"):
        return f"{location} (from {EMULATOR_ENV})"
    return location


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
        self._trace: _ConnectionTrace | None = None
        self._endpoint: str | None = None
        self._protocol = protocol or "file"
        if protocol in (None, "file", "local"):
            self._root = os.path.abspath(os.path.expanduser(rest))
            self._url = self._root
            self._fuse = is_under_mount(self._root, object_store_mounts)
        else:
            options = dict(storage_options or {})
            if protocol in ("gs", "gcs"):
                self._trace = _trace_for(options)
                self._fs = _make_gcs_filesystem(options, self._trace)
                root = self._fs._strip_protocol(url)
                self._endpoint = _gcs_endpoint(self._fs, options)
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

    def _fs_call(self, name: str, *args: Any, timeout: _Budget | None, **kwargs: Any) -> Any:
        fs = self._fs
        if timeout is not None and getattr(fs, "async_impl", False) \
                and not getattr(fs, "asynchronous", False):
            return self._run_bounded(name, getattr(fs, "_" + name)(*args, **kwargs), timeout)
        return getattr(fs, name)(*args, **kwargs)

    def _run_bounded(self, name: str, coro: Any, budget: _Budget) -> Any:
        """Run an fsspec coroutine on its loop for at most ``budget.remaining_s``, or
        ``budget.transfer_s`` once this attempt has reached the endpoint; then cancel it
        (gcsfs mid-backoff included) and raise FSTimeoutError."""
        fut = asyncio.run_coroutine_threadsafe(coro, self._fs.loop)
        start = time.monotonic()
        trace = self._trace
        reached_before = trace.reached if trace is not None else 0
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
                # Where no trace can tell (other async filesystems), grant the allowance.
                got_through = trace is None or trace.reached > reached_before
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

    def _retrying(self, op: str, rel: str, fn: Callable[[_Budget | None], T], *,
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
                           _describe(exc) if exc else "?",
                           state.next_action.sleep if state.next_action else 0.0)

        def attempt() -> T:
            nonlocal attempts
            attempts += 1
            budget = None
            if self._fs is not None:
                budget = _Budget(max(deadline - time.monotonic(), _MIN_ATTEMPT_S),
                                 nbytes / opts.min_throughput)
            return fn(budget)

        retrying = Retrying(stop=stop_after_delay(opts.deadline_s), wait=wait,
                            retry=retry_if_exception(is_transient), reraise=True,
                            before_sleep=before_sleep)
        try:
            return retrying(attempt)
        except Exception as exc:
            translated = self._translate(exc, op, rel, attempts, time.monotonic() - start,
                                         since=start)
            if translated is exc:
                raise
            raise translated from exc

    def _translate(self, exc: Exception, op: str, rel: str, attempts: int,
                   elapsed: float, *, since: float | None = None) -> Exception:
        if isinstance(exc, StorageError):
            return exc
        url = self.url_of(rel)
        if isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS and self._fs is None:
            return _no_space_error(exc, op, url, self._local(rel))
        kind = classify_error(exc)
        what = _describe(exc)
        if kind is ErrorKind.TRANSIENT:
            return StorageUnavailableError(
                f"{op} {url}: storage unavailable, still failing after {attempts} attempt(s) "
                f"over {elapsed:.1f}s (last error: {what}){self._endpoint_hint(exc, since)}. "
                f"The service is down, throttling or unreachable: check the network and "
                f"endpoint, rerun later, or raise RetryOptions.deadline_s (now "
                f"{self._retry.deadline_s:g}s).",
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

    def _endpoint_hint(self, exc: BaseException, since: float | None) -> str:
        """For object stores: which endpoint, and what the connection itself last said
        (gcsfs retries connection errors and a cancelled attempt hides them)."""
        if self._endpoint is None:
            return ""
        underlying = self._trace.error_since(since) if self._trace and since else None
        hint = f"; endpoint {self._endpoint}"
        if _refused(exc) or (underlying is not None and _refused(underlying)):
            hint += (" refused the connection (nothing listens there: is the emulator or "
                     "proxy running, is the host and port right?)")
        if underlying is not None and underlying is not exc:
            hint += f"; the connection's last error: {_describe(underlying)}"
        return hint

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

    def _raise_if_no_space(self, exc: BaseException, rel: str, path: str, *,
                           staging: bool = False) -> None:
        """A full disk met while writing ``path`` for rel: raise it as StorageFullError."""
        found = _no_space_in(exc)
        if isinstance(found, StorageFullError):
            return  # already says where
        if found is not None:
            raise _no_space_error(found, "write", self.url_of(rel), path,
                                  staging=staging) from exc

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
            return
        with tempfile.NamedTemporaryFile(prefix=TMP_FILE_PREFIX, suffix=".upload") as spool:
            try:
                yield cast(BinaryIO, spool)
                spool.flush()
            except Exception as exc:
                self._raise_if_no_space(exc, rel, spool.name, staging=True)
                raise
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

    # -- reading

    def read_bytes(self, rel: str) -> bytes:
        rel = _check_rel(rel, allow_root=False)
        if self._fs is None:
            path = self._local(rel)

            def read_local(_t: _Budget | None) -> bytes:
                with open(path, "rb") as f:
                    return f.read()

            return self._retrying("read", rel, read_local)
        path = self._remote(rel)
        # Size first: it sizes the attempt's time allowance and catches a short read.
        size = self.size(rel)

        def read_remote(t: _Budget | None) -> bytes:
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

        def check(t: _Budget | None) -> bool:
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

            def list_local(_t: _Budget | None) -> list[str]:
                try:
                    names = os.listdir(path)
                except (FileNotFoundError, NotADirectoryError):
                    return []
                return sorted(n for n in names if not n.startswith(TMP_FILE_PREFIX))

            return self._retrying("list", rel, list_local)
        path = self._remote(rel)

        def list_remote(t: _Budget | None) -> list[str]:
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

            def delete_local(_t: _Budget | None) -> None:
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

        def delete_remote(t: _Budget | None) -> None:
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

        def rename(_t: _Budget | None) -> None:
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
            def check(t: _Budget | None) -> None:
                self._fs_call("info", bucket, timeout=t)

            try:
                self._retrying("check", "", check)
            except StorageNotFoundError:
                raise StorageNotFoundError(
                    f"bucket gs://{bucket} does not exist (from {self._url}); check the "
                    "bucket name and project", url=self._url, operation="check") from None

    def check_writable(self) -> None:
        """Write and delete a probe under the root, so a missing bucket, a permission
        problem or a full disk fails now with a clear error, not at the first save hours
        later. The probe never stays behind, whether it was written or not."""
        probe = f"{PROBE_PREFIX}{uuid.uuid4().hex[:12]}"
        if self._fs is None:
            blocker = next((path for path in _ancestors(self._root)
                            if os.path.exists(path) and not os.path.isdir(path)), None)
            if blocker is not None:
                raise StorageNotFoundError(
                    f"cannot use {self._url} as a checkpoint directory: {blocker} is a file; "
                    "pass a directory path (it is created if missing)", url=self._url,
                    operation="check_writable")
        try:
            if self._fs is None:
                self._retrying("check_writable", probe,
                               lambda _t: self._write_local(probe, b"probe", durable=False))
            else:
                path = self._remote(probe)
                self._retrying("check_writable", probe,
                               lambda t: self._fs_call("pipe_file", path, b"probe", timeout=t))
        except BaseException:
            # A write that failed may still have created it (an upload whose answer was lost).
            if self._fs is None:
                with contextlib.suppress(OSError):
                    os.unlink(self._local(probe))
            raise
        self.delete(probe)
        logger.debug("storage %s is writable", self._url)


@dataclass(frozen=True)
class _Budget:
    """One attempt's time: ``remaining_s`` until the retry deadline, and ``transfer_s`` that
    moving its bytes may take at ``RetryOptions.min_throughput`` once the endpoint answers."""

    remaining_s: float
    transfer_s: float


def _refused(exc: BaseException) -> bool:
    """A refused TCP connection, as such or inside aiohttp's ClientConnectorError."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ConnectionRefusedError) or (
                isinstance(e, OSError) and e.errno == errno.ECONNREFUSED):
            return True
        os_error = getattr(e, "os_error", None)  # aiohttp.ClientConnectorError
        if isinstance(os_error, BaseException) and _refused(os_error):
            return True
        e = e.__cause__ or e.__context__
    return False


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

        def fetch(t: _Budget | None) -> bytes:
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
