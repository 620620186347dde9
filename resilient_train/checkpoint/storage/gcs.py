"""Google Cloud Storage (``gs://``) through gcsfs: its errors, its emulator, its connections.

`GcsStorage` is `FsspecStorage` plus what only GCS needs: a missing bucket named as such,
the endpoint (and what the connection last said) in "unavailable" errors, a plain
``GCSFileSystem`` against an emulator, an aiohttp trace that tells whether an attempt
reached the endpoint (for `FsspecStorage`'s bounded attempts), and server-side compose
for parallel uploads (`FsspecStorage`'s "Parallel streams").

Parallel uploads
    A part is one resumable upload of a single chunk (``pipe_file`` with ``chunksize`` =
    the part): gcsfs hands aiohttp a view of our buffer, where a simple (multipart) upload
    would first copy it into a request body. The parts become the file with
    ``GCSFileSystem.merge`` (the JSON API's ``compose``: at most 32 sources a call, checked
    by fake-gcs-server too); GCS computes the composite's crc32c (no MD5), which is then
    compared with the stream's. fake-gcs-server implements compose (and answers 33 sources
    with 400, as GCS does), so the emulator runs the real protocol.

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
    half a minute or more: hence the bounded attempts. An attempt has reached the endpoint
    when a TCP connection was made or reused, seen through an aiohttp trace on gcsfs's
    session. The same trace keeps the last error gcsfs retried on (gcsfs's own retries hide
    it), so a timeout names the endpoint and, e.g., the refused connection. 403 and 404 are
    not retried by gcsfs and not by us.

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

import base64
import errno
import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

import fsspec

from resilient_train.errors import exception_chain

from .base import Budget
from .errors import StorageError, StorageNotFoundError, describe
from .objectstore import FsspecStorage, TransferOptions

logger = logging.getLogger(__name__)

GCSFS_HNS_ENV = "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"
EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
# Operations that create objects: a 404 there means the bucket itself is missing.
_WRITE_OPS = frozenset({"write", "upload", "check_writable"})
# Sources per compose request: the JSON API's limit.
COMPOSE_MAX_SOURCES = 32
# The default for gs://, measured with benchmarks/bench_gcs_streams.py: uploads, the fewest
# streams within 10% of the best save measured (4 of 1, 2, 4, 8; 160 MiB of buffers per
# file being written), and the smaller part size within 10% of the best (32 of 16, 32,
# 64 MiB). Reads: 8 MiB ranges, which restore 512 MiB about twice as fast here as one
# request for the whole object; 1, 2 and 4 of them in flight restore within 5% of each
# other on loopback, so 4, for what loopback cannot show: a real bucket's per-stream limit.
# docs/checkpointing.md, "Parallel streams to gs://", has the numbers.
DEFAULT_GCS_TRANSFER = TransferOptions(streams=4, read_streams=4, part_bytes=32 << 20,
                                       read_part_bytes=8 << 20)


def uses_gcs_emulator(storage_options: Mapping[str, Any],
                      environ: Mapping[str, str] | None = None) -> bool:
    """Whether a gs:// Storage with these options talks to a local plain-HTTP emulator."""
    env = os.environ if environ is None else environ
    endpoint = storage_options.get("endpoint_url")
    if isinstance(endpoint, str) and endpoint:
        return endpoint.startswith("http://")  # an explicit endpoint wins over the env
    return env.get(EMULATOR_ENV, "") not in ("", "default")


class GcsStorage(FsspecStorage):
    """``gs://bucket/prefix`` (or ``gcs://``) through gcsfs."""

    _compose_max = COMPOSE_MAX_SOURCES
    _default_transfer = DEFAULT_GCS_TRANSFER

    def _filesystem(self, url: str, options: dict[str, Any]) -> tuple[Any, str]:
        self._trace = _trace_for(options)  # before the options gain our session settings
        fs = _make_gcs_filesystem(options, self._trace)
        self._endpoint = _gcs_endpoint(fs, options)
        return fs, str(fs._strip_protocol(url))

    @property
    def _bucket(self) -> str:
        return self._root.split("/", 1)[0]

    def _connections_made(self) -> int | None:
        return self._trace.reached

    def _not_found_message(self, op: str, url: str, what: str) -> str:
        if op in _WRITE_OPS:
            # A write only 404s when the bucket itself is missing.
            bucket = self._bucket
            return (f"{op} {url}: bucket {bucket!r} does not exist ({self._url}): create it "
                    f"(gcloud storage buckets create gs://{bucket}) or fix the checkpoint "
                    f"directory")
        return super()._not_found_message(op, url, what)

    def _endpoint_hint(self, exc: BaseException, since: float | None) -> str:
        """Which endpoint, and what the connection itself last said (gcsfs retries
        connection errors and a cancelled attempt hides them)."""
        underlying = self._trace.error_since(since) if since else None
        hint = f"; endpoint {self._endpoint}"
        if _refused(exc) or (underlying is not None and _refused(underlying)):
            hint += (" refused the connection (nothing listens there: is the emulator or "
                     "proxy running, is the host and port right?)")
        if underlying is not None and underlying is not exc:
            hint += f"; the connection's last error: {describe(underlying)}"
        return hint

    # -- parallel uploads

    def _upload_part(self, rel: str, data: memoryview, budget: Budget) -> None:
        # One chunk of a resumable upload: aiohttp sends our buffer without a copy.
        self._fs_call("pipe_file", self._remote(rel), data, chunksize=max(len(data), 1),
                      timeout=budget)

    def _compose(self, rel: str, sources: list[str], budget: Budget) -> None:
        self._fs_call("merge", self._remote(rel), [self._remote(r) for r in sources],
                      timeout=budget)

    def _check_composed(self, rel: str, size: int, crc32c: str, budget: Budget) -> None:
        info = self._fs_call("info", self._remote(rel), timeout=budget)
        got_size = int(info.get("size") or 0)
        got_crc = _crc32c_hex(info.get("crc32c"))
        if got_size != size or (got_crc is not None and got_crc != crc32c):
            raise StorageError(
                f"compose {self.url_of(rel)}: the composed object is {got_size} bytes with "
                f"crc32c {got_crc}, the stream written was {size} bytes with crc32c "
                f"{crc32c}; a part was corrupted or replaced", url=self.url_of(rel),
                operation="compose")

    def _check_readable(self) -> None:
        bucket = self._bucket
        if not bucket:
            return

        def check(t: Budget) -> None:
            self._fs_call("info", bucket, timeout=t)

        try:
            self._retrying("check", "", check)
        except StorageNotFoundError:
            raise StorageNotFoundError(
                f"bucket gs://{bucket} does not exist (from {self._url}); check the "
                "bucket name and project", url=self._url, operation="check") from None


# --- the filesystem --------------------------------------------------------------------------


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


def _crc32c_hex(value: Any) -> str | None:
    """GCS's crc32c (base64 of the big-endian 4 bytes) as our manifests spell it (hex)."""
    if not isinstance(value, str) or not value:
        return None
    try:
        raw = base64.b64decode(value, validate=True)
    except ValueError:
        return None
    return raw.hex() if len(raw) == 4 else None


def _refused(exc: BaseException) -> bool:
    """A refused TCP connection, as such or inside aiohttp's ClientConnectorError."""
    for e in exception_chain(exc):
        if isinstance(e, ConnectionRefusedError) or (
                isinstance(e, OSError) and e.errno == errno.ECONNREFUSED):
            return True
        os_error = getattr(e, "os_error", None)  # aiohttp.ClientConnectorError
        if isinstance(os_error, BaseException) and os_error is not e and _refused(os_error):
            return True
    return False


__all__ = ["COMPOSE_MAX_SOURCES", "DEFAULT_GCS_TRANSFER", "EMULATOR_ENV", "GCSFS_HNS_ENV",
           "GcsStorage", "uses_gcs_emulator"]
