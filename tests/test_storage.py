"""Storage: one interface over local disk, memory:// and GCS (fake-gcs-server via gcsfs).

The fault tests put tests/gcs.py's proxy between gcsfs and the emulator. gcsfs retries
408/429/5xx/resets itself (6 tries, ~1+2+4 s of sleep for three failures), so those tests
take a few seconds each by design; our own retry loop is tested fast on a flaky in-memory
filesystem.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from gcs import RESET, FaultProxy, free_port

from resilient_train.checkpoint.storage import base as storage_mod
from resilient_train.checkpoint.storage.base import (
    PROBE_PREFIX,
    TMP_FILE_PREFIX,
    ErrorKind,
    RetryOptions,
    Storage,
    StorageError,
    StorageNotFoundError,
    StoragePermissionError,
    StorageUnavailableError,
    classify_error,
)
from resilient_train.checkpoint.storage.gcs import GCSFS_HNS_ENV, uses_gcs_emulator
from resilient_train.errors import Classification, classify_exception

FAST = RetryOptions(deadline_s=30.0, initial_s=0.01, max_wait_s=0.1)

# --- backends ---------------------------------------------------------------------------


@pytest.fixture(params=["local", "memory", "gcs"])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Storage]:
    if request.param == "local":
        yield Storage(str(tmp_path / "ckpt"), retry=FAST)
    elif request.param == "memory":
        root = f"memory://rt-test-{uuid.uuid4().hex[:12]}/run"
        st = Storage(root, retry=FAST)
        yield st
        if st.fs.exists(st.root):
            st.fs.rm(st.root, recursive=True)
    else:
        bucket = request.getfixturevalue("gcs_bucket")
        yield Storage(f"{bucket.url}/run1/checkpoints", retry=FAST,
                      storage_options=bucket.storage_options)


def test_write_read_roundtrip(store: Storage) -> None:
    store.write_bytes("step_1/model.pt", b"weights")
    store.write_bytes("step_1/view.bin", memoryview(b"0123456789")[2:6])
    assert store.read_bytes("step_1/model.pt") == b"weights"
    assert store.read_bytes("step_1/view.bin") == b"2345"
    store.write_bytes("step_1/model.pt", b"new")  # overwrite
    assert store.read_bytes("step_1/model.pt") == b"new"
    assert store.size("step_1/model.pt") == 3
    store.write_bytes("empty", b"")
    assert store.read_bytes("empty") == b"" and store.size("empty") == 0


def test_exists_listdir_delete(store: Storage) -> None:
    assert store.listdir() == [] and store.listdir("nope") == []
    for rel in ("b/x.pt", "b/sub/y.pt", "a.txt", "c/z"):
        store.write_bytes(rel, b"1")
    assert store.listdir() == ["a.txt", "b", "c"]
    assert store.listdir("b") == ["sub", "x.pt"]
    assert store.listdir("a.txt") == []  # a file has no children
    assert store.exists("b") and store.exists("b/x.pt") and store.exists("a.txt")
    assert not store.exists("b/none") and not store.exists("zzz")

    store.delete("a.txt")
    store.delete("a.txt")  # missing is fine
    store.delete("never/was", recursive=True)
    assert not store.exists("a.txt")
    with pytest.raises(StorageError, match="recursive|not empty|Directory not empty"):
        store.delete("b")  # non-empty directory without recursive=True
    assert store.exists("b/sub/y.pt")
    store.delete("b", recursive=True)
    assert not store.exists("b") and not store.exists("b/sub/y.pt")
    assert store.listdir() == ["c"]


def test_open_write_streams_and_open_read_seeks(store: Storage) -> None:
    payload = os.urandom(3 << 20) + b"tail"
    with store.open_write("d/big.bin") as f:
        for i in range(0, len(payload), 1 << 20):
            f.write(payload[i:i + (1 << 20)])
    assert store.size("d/big.bin") == len(payload)
    with store.open_read("d/big.bin") as f:
        assert f.read(4) == payload[:4]
        f.seek(len(payload) - 4)
        assert f.read() == b"tail"
        f.seek(1 << 20)
        assert f.tell() == 1 << 20
        assert f.read(10) == payload[(1 << 20):(1 << 20) + 10]
    with store.open_read("d/big.bin") as f:
        assert f.read() == payload


def test_open_write_leaves_nothing_on_exception(store: Storage) -> None:
    with pytest.raises(RuntimeError, match="boom"), store.open_write("d/partial.bin") as f:
        f.write(b"half of a checkpoint")
        raise RuntimeError("boom")
    assert not store.exists("d/partial.bin")
    assert store.listdir("d") == []


def test_missing_file_is_not_found_naming_the_url(store: Storage) -> None:
    for call in (lambda: store.read_bytes("no/such.pt"), lambda: store.size("no/such.pt")):
        with pytest.raises(StorageNotFoundError) as info:
            call()
        assert store.url_of("no/such.pt") in str(info.value)
        assert isinstance(info.value, FileNotFoundError)  # callers may catch the builtin
        assert classify_exception(info.value) is Classification.PERMANENT
    with pytest.raises(FileNotFoundError), store.open_read("no/such.pt"):
        pass


def test_check_writable_leaves_no_probe(store: Storage) -> None:
    store.check_writable()
    assert not any(n.startswith(PROBE_PREFIX) for n in store.listdir())


def test_makedirs_fsync_dir_and_rename_by_backend(store: Storage) -> None:
    store.makedirs("m/n")
    store.fsync_dir("")  # never fails: a no-op where directories are not real
    if store.atomic_rename:
        assert store.exists("m/n") and store.listdir("m") == ["n"]
        store.write_bytes("m/n/f", b"1")
        store.rename_dir("m/n", "m/o")
        assert store.listdir("m") == ["o"] and store.read_bytes("m/o/f") == b"1"
    else:
        assert not store.is_local
        store.write_bytes("m/n/f", b"1")
        with pytest.raises(NotImplementedError, match="atomic"):
            store.rename_dir("m/n", "m/o")
        assert store.read_bytes("m/n/f") == b"1"


def test_urls_and_properties(store: Storage) -> None:
    assert store.url_of("") == store.url
    assert store.url_of("a/b") == store.url.rstrip("/") + "/a/b"
    assert store.is_local is (store.fs is None)
    assert store.atomic_rename is store.is_local  # no FUSE mount among these backends
    with pytest.raises(ValueError, match="relative"):
        store.read_bytes("../outside")
    with pytest.raises(ValueError, match="relative"):
        store.write_bytes("/abs", b"")


# --- local disk: durability and the atomic commit ---------------------------------------


@pytest.fixture
def fsync_spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What os.fsync was called on, as paths (via /proc/self/fd)."""
    synced: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return synced


def test_local_write_bytes_fsyncs_file_and_directory(tmp_path: Any, fsync_spy: list[str]
                                                     ) -> None:
    st = Storage(str(tmp_path / "ckpt"))
    st.write_bytes("step_1/MANIFEST.json", b"{}")
    directory = str(tmp_path / "ckpt" / "step_1")
    # the data reached the disk under a temporary name, then the rename did
    assert len(fsync_spy) == 2
    assert os.path.dirname(fsync_spy[0]) == directory
    assert os.path.basename(fsync_spy[0]).startswith(TMP_FILE_PREFIX)
    assert fsync_spy[1] == directory
    assert os.listdir(directory) == ["MANIFEST.json"]

    fsync_spy.clear()
    st.write_bytes("step_1/scratch", b"x", durable=False)
    assert fsync_spy == []


def test_local_open_write_is_fsynced_and_invisible_until_closed(tmp_path: Any,
                                                                 fsync_spy: list[str]) -> None:
    st = Storage(str(tmp_path))
    with st.open_write("w/rank0.pt") as f:
        f.write(b"abc")
        assert st.listdir("w") == []  # the temporary sibling is hidden
        assert not st.exists("w/rank0.pt")
    assert st.read_bytes("w/rank0.pt") == b"abc"
    assert len(fsync_spy) == 2 and fsync_spy[1] == str(tmp_path / "w")


def test_local_rename_dir_is_one_rename_then_parent_fsync(
        tmp_path: Any, fsync_spy: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    st = Storage(str(tmp_path / "ckpt"))
    for name in ("a.pt", "MANIFEST.json", "COMMITTED"):
        st.write_bytes(f".tmp-step_2/{name}", name.encode())
    renames: list[tuple[str, str]] = []
    real_rename = os.rename

    def rename_spy(src: str, dst: str) -> None:
        renames.append((src, dst))
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename_spy)
    fsync_spy.clear()

    st.rename_dir(".tmp-step_2", "step_2")

    assert renames == [(str(tmp_path / "ckpt" / ".tmp-step_2"), str(tmp_path / "ckpt" / "step_2"))]
    assert fsync_spy == [str(tmp_path / "ckpt")]
    assert st.listdir() == ["step_2"]
    assert st.listdir("step_2") == ["COMMITTED", "MANIFEST.json", "a.pt"]

    # a second commit of the same step must not clobber the first
    st.write_bytes(".tmp-step_2/a.pt", b"other")
    with pytest.raises(StorageError, match="not empty"):
        st.rename_dir(".tmp-step_2", "step_2")
    assert st.read_bytes("step_2/a.pt") == b"a.pt"


def test_local_permission_denied(tmp_path: Any) -> None:
    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(StoragePermissionError, match=str(ro)):
            Storage(str(ro / "ckpt")).check_writable()
    finally:
        ro.chmod(0o700)


@pytest.mark.parametrize("fuse", [False, True])
def test_local_delete_never_goes_through_a_link(tmp_path: Any, fuse: bool) -> None:
    """A link below the root leads out of it: delete removes the link itself, and refuses
    what lies behind it, naming the link."""
    other = tmp_path / "other"
    (other / "step").mkdir(parents=True)
    (other / "step" / "COMMITTED").write_text("theirs")
    root = tmp_path / "gcs" / "run"
    root.mkdir(parents=True)
    os.symlink(other / "step", root / "linked")
    st = Storage(str(root), object_store_mounts=(str(tmp_path / "gcs"),) if fuse else ())
    with pytest.raises(StorageError, match=f"{root / 'linked'} is a symbolic link"):
        st.delete("linked/COMMITTED")
    with pytest.raises(StorageError, match="symbolic link"):
        st.delete("linked/COMMITTED", recursive=True)
    assert (other / "step" / "COMMITTED").read_text() == "theirs"
    assert st.is_link("linked") and not st.is_link("linked/COMMITTED")
    st.delete("linked", recursive=True)
    assert not os.path.lexists(root / "linked") and (other / "step" / "COMMITTED").is_file()


# --- FUSE mounts of object stores --------------------------------------------------------


def test_gcs_fuse_paths_are_local_but_not_atomic(tmp_path: Any) -> None:
    assert not Storage("/gcs/bucket/run1").atomic_rename  # decision only: nothing touched
    assert Storage("/gcs/bucket/run1").is_local
    assert Storage("/gcsx/run1").atomic_rename
    assert Storage(str(tmp_path)).atomic_rename

    mount = tmp_path / "gcs"
    st = Storage(str(mount / "bucket" / "run1"), object_store_mounts=(str(mount),))
    assert st.is_local and not st.atomic_rename
    st.check_writable()
    st.write_bytes("step_1/a.pt", b"abc")
    with st.open_write("step_1/b.pt") as f:
        f.write(b"streamed")
    assert st.read_bytes("step_1/b.pt") == b"streamed"
    assert st.listdir("step_1") == ["a.pt", "b.pt"]
    with pytest.raises(NotImplementedError, match="atomic"):
        st.rename_dir("step_1", "step_2")
    st.fsync_dir("step_1")  # no-op


# --- error classification (gcsfs's real exceptions) -------------------------------------


def _gcsfs_error(status: int, message: str = "boom") -> BaseException:
    from gcsfs.retry import validate_response

    body = json.dumps({"error": {"code": status, "message": message}}).encode()
    try:
        validate_response(status, body, "b/bucket/o/key")
    except BaseException as exc:  # noqa: BLE001 - we want whatever gcsfs raises
        return exc
    raise AssertionError(f"gcsfs accepted status {status}")


@pytest.mark.parametrize(("status", "kind"), [
    (404, ErrorKind.NOT_FOUND), (403, ErrorKind.PERMISSION), (401, ErrorKind.PERMISSION),
    (408, ErrorKind.TRANSIENT), (429, ErrorKind.TRANSIENT), (500, ErrorKind.TRANSIENT),
    (502, ErrorKind.TRANSIENT), (503, ErrorKind.TRANSIENT), (504, ErrorKind.TRANSIENT),
    (400, ErrorKind.OTHER), (412, ErrorKind.OTHER),
])
def test_gcsfs_http_errors_are_classified(status: int, kind: ErrorKind) -> None:
    from gcsfs.retry import is_retriable

    exc = _gcsfs_error(status)
    assert classify_error(exc) is kind, repr(exc)
    # we retry exactly what gcsfs would retry (401 only with "Invalid Credentials")
    assert is_retriable(exc) == (kind is ErrorKind.TRANSIENT)


def test_other_exceptions_are_classified() -> None:
    import aiohttp
    import requests
    from fsspec.exceptions import FSTimeoutError

    transient = [ConnectionResetError(), ConnectionRefusedError(), TimeoutError(),
                 asyncio.TimeoutError(), FSTimeoutError(), requests.exceptions.ProxyError(),
                 aiohttp.ServerDisconnectedError(), aiohttp.ClientPayloadError("cut")]
    for exc in transient:
        assert classify_error(exc) is ErrorKind.TRANSIENT, repr(exc)
    assert classify_error(FileNotFoundError("x")) is ErrorKind.NOT_FOUND
    assert classify_error(PermissionError("x")) is ErrorKind.PERMISSION
    for exc in (ValueError("x"), FileExistsError("x"), OSError("disk full"), KeyError("k")):
        assert classify_error(exc) is ErrorKind.OTHER, repr(exc)


# --- our retry loop, on a flaky in-memory filesystem (fast) -----------------------------


class FlakyMemoryFS(MemoryFileSystem):
    """memory:// whose writes and reads first raise the queued faults (then `always`)."""

    protocol = "flakymem"
    faults: ClassVar[list[Callable[[], BaseException]]] = []
    always: ClassVar[Callable[[], BaseException] | None] = None
    calls: ClassVar[int] = 0

    def _maybe_fail(self) -> None:
        cls = type(self)
        cls.calls += 1
        if cls.faults:
            raise cls.faults.pop(0)()
        if cls.always is not None:
            raise cls.always()

    def pipe_file(self, path: str, value: Any, *args: Any, **kwargs: Any) -> None:
        self._maybe_fail()
        super().pipe_file(path, value, *args, **kwargs)

    def cat_file(self, path: str, *args: Any, **kwargs: Any) -> Any:
        self._maybe_fail()
        return super().cat_file(path, *args, **kwargs)


@pytest.fixture
def flaky(monkeypatch: pytest.MonkeyPatch) -> type[FlakyMemoryFS]:
    fsspec.register_implementation("flakymem", FlakyMemoryFS, clobber=True)
    monkeypatch.setattr(FlakyMemoryFS, "faults", [])
    monkeypatch.setattr(FlakyMemoryFS, "always", None)
    monkeypatch.setattr(FlakyMemoryFS, "calls", 0)
    return FlakyMemoryFS


def test_transient_errors_are_retried_with_backoff(flaky: type[FlakyMemoryFS]) -> None:
    st = Storage(f"flakymem://r-{uuid.uuid4().hex[:8]}", retry=FAST)
    flaky.faults[:] = [ConnectionResetError, TimeoutError, lambda: _gcsfs_error(503)]
    st.write_bytes("f", b"data")
    assert flaky.calls == 4
    flaky.faults[:] = [lambda: _gcsfs_error(429)]
    assert st.read_bytes("f") == b"data"


@pytest.mark.parametrize(("fault", "error"), [
    (lambda: _gcsfs_error(403), StoragePermissionError),
    (lambda: _gcsfs_error(404), StorageNotFoundError),
    (lambda: PermissionError(13, "denied"), StoragePermissionError),
    (lambda: _gcsfs_error(400), StorageError),
])
def test_permanent_errors_are_not_retried(flaky: type[FlakyMemoryFS],
                                          fault: Callable[[], BaseException],
                                          error: type[Exception]) -> None:
    st = Storage(f"flakymem://r-{uuid.uuid4().hex[:8]}", retry=FAST)
    flaky.faults[:] = [fault, fault, fault]
    with pytest.raises(error) as info:
        st.write_bytes("f", b"data")
    assert flaky.calls == 1
    assert st.url_of("f") in str(info.value)


def test_deadline_bounds_retrying(flaky: type[FlakyMemoryFS]) -> None:
    st = Storage(f"flakymem://r-{uuid.uuid4().hex[:8]}",
                 retry=RetryOptions(deadline_s=0.5, initial_s=0.01, max_wait_s=0.05))
    flaky.always = ConnectionResetError
    t0 = time.monotonic()
    with pytest.raises(StorageUnavailableError, match="deadline_s") as info:
        st.write_bytes("f", b"data")
    elapsed = time.monotonic() - t0
    assert 0.5 <= elapsed < 1.0
    assert flaky.calls > 3
    assert st.url_of("f") in str(info.value)
    assert classify_exception(info.value) is Classification.TRANSIENT


# --- GCS through gcsfs: emulator set-up ---------------------------------------------------


def test_emulator_detection() -> None:
    assert uses_gcs_emulator({"endpoint_url": "http://127.0.0.1:1"}, {})
    assert not uses_gcs_emulator({"endpoint_url": "https://storage.example"}, {})
    assert not uses_gcs_emulator({}, {})
    assert uses_gcs_emulator({}, {"STORAGE_EMULATOR_HOST": "localhost:9023"})
    assert not uses_gcs_emulator({}, {"STORAGE_EMULATOR_HOST": "default"})
    assert not uses_gcs_emulator({"endpoint_url": "https://storage.example"},
                                 {"STORAGE_EMULATOR_HOST": "localhost:9023"})


def test_emulator_uses_plain_gcsfs_and_anonymous_token(gcs_bucket: Any) -> None:
    import gcsfs.core

    st = Storage(gcs_bucket.url, storage_options={"endpoint_url": gcs_bucket.server.endpoint})
    assert type(st.fs) is gcsfs.core.GCSFileSystem  # not the experimental ZB/HNS subclass
    assert os.environ.get(GCSFS_HNS_ENV, "").lower() in ("false", "0")
    st.write_bytes("a", b"1")
    assert st.read_bytes("a") == b"1"
    assert st.url_of("a") == f"{gcs_bucket.url}/a"


_IMPORT_ORDER_SCRIPT = """
import os, sys, time
if sys.argv[1] == "gcsfs-first":
    import gcsfs, gcsfs.core  # imported before us, with gcsfs's default (experimental on)
    assert gcsfs.GCSFileSystem is not gcsfs.core.GCSFileSystem
from resilient_train.checkpoint.storage.base import Storage
st = Storage("gs://" + sys.argv[3], storage_options={"endpoint_url": sys.argv[2]})
t0 = time.monotonic()
st.write_bytes("a", b"1")
assert st.read_bytes("a") == b"1" and st.listdir() == ["a"]
import gcsfs, gcsfs.core
assert type(st.fs) is gcsfs.core.GCSFileSystem
print(round(time.monotonic() - t0, 2), gcsfs.GCSFileSystem is gcsfs.core.GCSFileSystem)
"""


@pytest.mark.parametrize("order", ["storage-first", "gcsfs-first"])
def test_emulator_works_whenever_gcsfs_was_imported(gcs_bucket: Any, order: str) -> None:
    """GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT is read at gcsfs import; both orders must be fast."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k not in (GCSFS_HNS_ENV, "STORAGE_EMULATOR_HOST")}
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_ORDER_SCRIPT, order, gcs_bucket.server.endpoint,
         gcs_bucket.name], env=env, capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    seconds, plain_registered = out.stdout.split()
    assert float(seconds) < 5.0  # the experimental path costs ~60 s per bucket operation
    # set before the import, the variable also makes gcsfs's own default the plain class
    assert plain_registered == ("True" if order == "storage-first" else "False")


def test_missing_bucket_fails_check_writable(gcs_server: Any) -> None:
    url = f"gs://no-such-bucket-{uuid.uuid4().hex[:8]}/run1/checkpoints"
    st = Storage(url, retry=FAST, storage_options={"endpoint_url": gcs_server.endpoint})
    t0 = time.monotonic()
    with pytest.raises(StorageNotFoundError, match="does not exist") as info:
        st.check_writable()
    assert time.monotonic() - t0 < 2.0
    assert url in str(info.value) and "create it" in str(info.value)


def test_check_readable_names_a_missing_bucket_but_accepts_an_empty_prefix(
        gcs_server: Any, gcs_bucket: Any) -> None:
    opts = {"endpoint_url": gcs_server.endpoint}
    missing = Storage(f"gs://no-such-bucket-{uuid.uuid4().hex[:8]}/run1", retry=FAST,
                      storage_options=opts)
    with pytest.raises(StorageNotFoundError, match=r"bucket gs://no-such-bucket-\w+ does not"):
        missing.check_readable()
    Storage(f"{gcs_bucket.url}/nothing-saved-yet", retry=FAST,
            storage_options=dict(gcs_bucket.storage_options)).check_readable()


def test_check_writable_of_a_path_under_a_file_names_the_file(tmp_path: Any) -> None:
    (tmp_path / "file").write_text("x")
    for url in (tmp_path / "file", tmp_path / "file" / "ckpt"):
        with pytest.raises(StorageNotFoundError, match=f"{tmp_path / 'file'} is a file"):
            Storage(str(url)).check_writable()


def test_check_readable_of_local_paths(tmp_path: Any) -> None:
    Storage(str(tmp_path)).check_readable()
    with pytest.raises(StorageNotFoundError, match="does not exist; check the path"):
        Storage(str(tmp_path / "typo")).check_readable()
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageNotFoundError, match="is a file, not a checkpoint directory"):
        Storage(str(tmp_path / "file")).check_readable()


# --- GCS through the fault proxy ----------------------------------------------------------


def _through(proxy: FaultProxy, bucket: Any, retry: RetryOptions = FAST) -> Storage:
    return Storage(f"{bucket.url}/run1", retry=retry,
                   storage_options={"endpoint_url": proxy.endpoint, "token": "anon"})


@pytest.mark.parametrize("status", [503, 429])
def test_transient_statuses_then_success(gcs_proxy: FaultProxy, gcs_bucket: Any,
                                         status: int) -> None:
    st = _through(gcs_proxy, gcs_bucket)
    gcs_proxy.inject(status, count=2)   # gcsfs backs off about 1, 2, 4 s: keep it short
    st.write_bytes("step_1/a.pt", b"payload")
    assert st.read_bytes("step_1/a.pt") == b"payload"
    assert gcs_proxy.injected == 2
    assert len(gcs_proxy.requests_matching("POST", "/upload/")) == 3  # 2 refused, 1 stored


def test_reset_connection_is_retried(gcs_proxy: FaultProxy, gcs_bucket: Any) -> None:
    st = _through(gcs_proxy, gcs_bucket)
    gcs_proxy.inject(RESET, count=1, method="POST")
    st.write_bytes("a.pt", b"x" * 1000)
    gcs_proxy.inject(RESET, count=1, method="GET", path="alt=media")
    assert st.read_bytes("a.pt") == b"x" * 1000
    assert gcs_proxy.injected == 2


def test_forbidden_fails_at_once(gcs_proxy: FaultProxy, gcs_bucket: Any) -> None:
    st = _through(gcs_proxy, gcs_bucket, retry=RetryOptions())  # the production deadline
    gcs_proxy.inject(403, count=None)
    t0 = time.monotonic()
    with pytest.raises(StoragePermissionError) as info:
        st.write_bytes("a.pt", b"x")
    assert time.monotonic() - t0 < 2.0  # neither gcsfs nor we retried a 403
    assert len(gcs_proxy.requests_matching("POST")) == 1
    assert st.url_of("a.pt") in str(info.value) and "grant" in str(info.value)
    with pytest.raises(StoragePermissionError):
        st.exists("a.pt")  # never "absent": that would start a run from scratch
    assert time.monotonic() - t0 < 2.0


def test_missing_object_is_not_retried(gcs_proxy: FaultProxy, gcs_bucket: Any) -> None:
    st = _through(gcs_proxy, gcs_bucket, retry=RetryOptions())
    t0 = time.monotonic()
    with pytest.raises(StorageNotFoundError):
        st.read_bytes("none.pt")
    assert time.monotonic() - t0 < 2.0
    assert gcs_proxy.forwarded <= 3 and gcs_proxy.injected == 0


def test_deadline_expires_under_endless_503(gcs_proxy: FaultProxy, gcs_bucket: Any) -> None:
    st = _through(gcs_proxy, gcs_bucket,
                  retry=RetryOptions(deadline_s=2.0, initial_s=0.05, max_wait_s=0.2))
    gcs_proxy.inject(503, count=None)
    t0 = time.monotonic()
    with pytest.raises(StorageUnavailableError) as info:
        st.write_bytes("a.pt", b"x")
    elapsed = time.monotonic() - t0
    # gcsfs alone would keep at it ~31 s; our deadline cancels it mid-backoff.
    assert 1.9 <= elapsed < 3.5
    assert gcs_proxy.injected >= 1
    assert st.url_of("a.pt") in str(info.value)


# --- GCS: an endpoint where nothing listens ------------------------------------------------


@pytest.mark.parametrize("how", ["endpoint_url", "STORAGE_EMULATOR_HOST"])
def test_a_closed_endpoint_fails_within_the_deadline_naming_it_and_the_refusal(
        how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing listens on the port: gcsfs retries the refused connection ~31 s on its own,
    and then only a timeout would be left to report. The deadline holds, and the error says
    which endpoint refused."""
    endpoint = f"http://127.0.0.1:{free_port()}"
    options: dict[str, Any] = {}
    if how == "endpoint_url":
        options["endpoint_url"] = endpoint
    else:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", endpoint)
    deadline = 3.0
    st = Storage(f"gs://bucket-{uuid.uuid4().hex[:8]}/run", storage_options=options,
                 retry=RetryOptions(deadline_s=deadline, initial_s=0.05, max_wait_s=0.5))
    t0 = time.monotonic()
    with pytest.raises(StorageUnavailableError) as info:
        st.check_writable()   # what CheckpointManager does first
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert f"endpoint {endpoint}" in msg and how in msg, msg
    assert "refused the connection" in msg, msg
    assert "Connect call failed" in msg, msg   # what the connection itself said
    assert st.url in msg
    assert classify_exception(info.value) is Classification.TRANSIENT
    # A bound on a deadline the code enforces (generous: a loaded machine), not a speed.
    assert deadline - 0.1 <= elapsed < deadline + 2.0, elapsed


def test_a_closed_endpoint_does_not_get_the_large_transfer_allowance() -> None:
    """32 MiB at RetryOptions.min_throughput (1 MiB/s) may take 32 s once the endpoint
    answers; an endpoint that never accepted a connection gets the deadline, no more."""
    endpoint = f"http://127.0.0.1:{free_port()}"
    st = Storage(f"gs://bucket-{uuid.uuid4().hex[:8]}/run",
                 storage_options={"endpoint_url": endpoint},
                 retry=RetryOptions(deadline_s=2.0, initial_s=0.05, max_wait_s=0.5))
    t0 = time.monotonic()
    with pytest.raises(StorageUnavailableError, match="refused the connection"):
        st.write_bytes("big.pt", bytes(32 << 20))
    assert time.monotonic() - t0 < 4.0


def test_a_large_transfer_that_reaches_the_endpoint_may_outlast_the_deadline(
        gcs_bucket: Any) -> None:
    """The other side of the allowance: a healthy upload is not cut off by a deadline far
    shorter than the transfer."""
    st = Storage(f"{gcs_bucket.url}/run", storage_options=gcs_bucket.storage_options,
                 retry=RetryOptions(deadline_s=30.0, initial_s=0.01, max_wait_s=0.05))
    # A pooled connection (the next request reuses it at once), and this machine's speed
    # now: a fixed deadline was either shorter than the first connection beside other jobs
    # (none within 0.4 s at a load average of 10) or longer than the whole upload alone.
    chunk = os.urandom(1 << 20) * 24
    t0 = time.monotonic()
    st.write_bytes("warm", chunk)
    deadline = max(0.3, 2 * (time.monotonic() - t0))   # half the upload below
    # The same options: the same (cached) filesystem, its session and connection pool.
    st = Storage(f"{gcs_bucket.url}/run", storage_options=gcs_bucket.storage_options,
                 retry=RetryOptions(deadline_s=deadline, initial_s=0.01, max_wait_s=0.05))
    data = chunk * 4   # ~1 s through the emulator here; 96 s allowed (1 MiB/s)
    t0 = time.monotonic()
    st.write_bytes("big.pt", data)
    assert time.monotonic() - t0 > deadline   # else this test shows nothing
    assert st.size("big.pt") == len(data)


def test_storage_module_does_not_import_gcsfs_for_local_paths() -> None:
    import subprocess
    import sys

    code = ("import sys; from resilient_train.checkpoint.storage.base import Storage; "
            "Storage('/tmp/x'); print('gcsfs' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
    assert storage_mod.DEFAULT_OBJECT_STORE_MOUNTS == ("/gcs/",)
