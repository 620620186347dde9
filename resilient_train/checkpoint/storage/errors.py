"""What a failed storage call means: the `StorageError` family, and which errors to retry.

Every failure of a `Storage` operation comes out as a `StorageError` (an ``OSError``) whose
message names the operation, the full URL, what happened and what to do.
`StorageNotFoundError` is also a ``FileNotFoundError`` and `StoragePermissionError` a
``PermissionError``, so callers can keep catching the builtin types. The classes also carry
the package's taxonomy (`resilient_train.errors`): unavailable -> transient (rerun later),
not found / permission / full -> permanent.

`classify_error` reads the exceptions that the storage libraries really raise (gcsfs,
aiohttp, requests, google-auth; see `storage_gcs` for what gcsfs retries itself). Their
classes are looked up only if their modules are already loaded: a local run imports none.
"""

from __future__ import annotations

import asyncio
import enum
import sys

from resilient_train.errors import PermanentError, TransientError

TRANSIENT_HTTP_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# Exceptions from these packages are storage failures (StorageError), not programming errors.
_STORAGE_LIBRARIES = frozenset({"gcsfs", "fsspec", "aiohttp", "requests", "google", "urllib3"})


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


class ShortReadError(ConnectionError):
    """The connection delivered fewer bytes than the object holds (transient: read again)."""


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


def from_storage_library(exc: BaseException) -> bool:
    return type(exc).__module__.split(".")[0] in _STORAGE_LIBRARIES


def describe(exc: BaseException) -> str:
    """``Type: message`` on one line (the whole message: storage errors put the detail last)."""
    text = str(exc).strip().replace("\n", " ")
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


__all__ = [
    "ErrorKind",
    "ShortReadError",
    "StorageError",
    "StorageFullError",
    "StorageNotFoundError",
    "StoragePermissionError",
    "StorageUnavailableError",
    "classify_error",
    "describe",
    "from_storage_library",
    "is_transient",
]
