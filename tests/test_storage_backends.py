"""Storage backends are classes chosen once from the URL, each declaring what it can do.

Pure and fast: no emulator, nothing remote is touched. tests/test_storage.py runs the same
operations against local disk, memory:// and the GCS emulator.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import fsspec.core
import pytest

from resilient_train.checkpoint.storage.base import (
    DEFAULT_OBJECT_STORE_MOUNTS,
    Budget,
    Capabilities,
    CommitProtocol,
    FuseStorage,
    LocalStorage,
    RetryOptions,
    Storage,
    StorageError,
    StorageFullError,
    StorageNotFoundError,
    StorageUnavailableError,
    backend_for,
    is_no_space,
    register_backend,
    split_protocol,
)
from resilient_train.checkpoint.storage.gcs import GcsStorage, _refused
from resilient_train.checkpoint.storage.objectstore import FsspecStorage

FAST = RetryOptions(deadline_s=5.0, initial_s=0.001, max_wait_s=0.01)


# --- what each backend declares -------------------------------------------------------------


@pytest.mark.parametrize(("cls", "posix", "local", "rename", "protocol"), [
    (LocalStorage, True, True, True, CommitProtocol.ATOMIC_RENAME),
    (FuseStorage, True, False, False, CommitProtocol.COMMIT_FILE),
    (FsspecStorage, False, False, False, CommitProtocol.COMMIT_FILE),
    (GcsStorage, False, False, False, CommitProtocol.COMMIT_FILE),
])
def test_each_backend_declares_its_capabilities(cls: type[Storage], posix: bool, local: bool,
                                                rename: bool, protocol: CommitProtocol) -> None:
    assert cls.capabilities == Capabilities(posix_paths=posix, local_paths=local,
                                            atomic_rename=rename, commit_protocol=protocol)


def test_capabilities_that_contradict_each_other_are_refused() -> None:
    with pytest.raises(ValueError, match="ATOMIC_RENAME needs atomic_rename"):
        Capabilities(posix_paths=True, local_paths=True, atomic_rename=False,
                     commit_protocol=CommitProtocol.ATOMIC_RENAME)
    with pytest.raises(ValueError, match="local_paths needs posix_paths"):
        Capabilities(posix_paths=False, local_paths=True, atomic_rename=False,
                     commit_protocol=CommitProtocol.COMMIT_FILE)


def test_the_properties_read_the_capabilities(tmp_path: Path) -> None:
    local = Storage(str(tmp_path / "ckpt"))
    assert local.commit_protocol is CommitProtocol.ATOMIC_RENAME
    assert local.atomic_rename and local.is_local and local.fs is None
    assert local.local_path("a/b") == str(tmp_path / "ckpt" / "a" / "b")
    assert local.local_path() == str(tmp_path / "ckpt")

    fuse = Storage(str(tmp_path / "gcs" / "b"), object_store_mounts=(str(tmp_path / "gcs"),))
    assert fuse.commit_protocol is CommitProtocol.COMMIT_FILE
    assert fuse.is_local and not fuse.atomic_rename
    assert fuse.local_path("a") is None and fuse.fs is None

    memory = Storage("memory://rt-backends/run")
    assert memory.commit_protocol is CommitProtocol.COMMIT_FILE
    assert not memory.is_local and not memory.atomic_rename and memory.fs is not None
    assert memory.local_path("a") is None


# --- the URL chooses -------------------------------------------------------------------------


@pytest.mark.parametrize(("url", "cls"), [
    ("/tmp/run/checkpoints", LocalStorage),
    ("relative/checkpoints", LocalStorage),
    ("~/checkpoints", LocalStorage),
    ("file:///tmp/run", LocalStorage),
    ("local:///tmp/run", LocalStorage),
    ("/gcs/bucket/run", FuseStorage),
    ("/gcs", FuseStorage),
    ("file:///gcs/bucket/run", FuseStorage),
    ("/gcsx/run", LocalStorage),
    ("gs://bucket/run", GcsStorage),
    ("gcs://bucket/run", GcsStorage),
    ("memory://x/run", FsspecStorage),
    ("s3://bucket/run", FsspecStorage),
])
def test_the_url_chooses_the_backend(url: str, cls: type[Storage]) -> None:
    assert backend_for(url) is cls
    assert DEFAULT_OBJECT_STORE_MOUNTS == ("/gcs/",)


def test_storage_returns_the_chosen_class(tmp_path: Path) -> None:
    assert type(Storage(str(tmp_path))) is LocalStorage
    assert type(Storage(f"file://{tmp_path}")) is LocalStorage
    assert type(Storage("/gcs/bucket/run")) is FuseStorage  # nothing is touched
    mount = tmp_path / "mnt"
    assert type(Storage(str(mount / "b"), object_store_mounts=(str(mount),))) is FuseStorage
    assert backend_for(str(mount / "b"), (str(mount),)) is FuseStorage
    assert type(Storage("memory://rt-backends/choose")) is FsspecStorage
    st = Storage(str(tmp_path))
    assert isinstance(st, Storage) and repr(st) == f"LocalStorage({str(tmp_path)!r})"


@pytest.mark.parametrize("url", ["", None, 3])
def test_a_url_that_is_not_a_string_is_refused(url: Any) -> None:
    with pytest.raises(ValueError, match="non-empty string"):
        Storage(url)
    with pytest.raises(ValueError, match="non-empty string"):
        backend_for(url)


@pytest.mark.parametrize("url", [
    "/a/b", "a/b", "file:///a", "gs://b/p", "memory://x", "c://x", "data:text/plain,hi",
    "odd://", "://x", "a://b://c",
])
def test_split_protocol_agrees_with_fsspec(url: str) -> None:
    assert tuple(split_protocol(url)) == tuple(fsspec.core.split_protocol(url))


# --- a new backend is one new class -----------------------------------------------------------


class DictStorage(Storage):
    """Objects in a dict: only the required primitives, nothing else."""

    objects: ClassVar[dict[str, bytes]] = {}
    lock = threading.Lock()
    fail_next: ClassVar[list[BaseException]] = []

    def _open(self, url: str, options: dict[str, Any]) -> tuple[str, str]:
        return url.rstrip("/"), split_protocol(url)[1].rstrip("/")

    def _key(self, rel: str) -> str:
        return f"{self._root}/{rel}" if rel else self._root

    def _maybe_fail(self) -> None:
        if self.fail_next:
            raise self.fail_next.pop(0)

    def _write(self, rel: str, data: bytes | bytearray | memoryview, *, durable: bool,
               budget: Budget) -> None:
        self._maybe_fail()
        with self.lock:
            self.objects[self._key(rel)] = bytes(data)

    def _read(self, rel: str, budget: Budget) -> bytes:
        self._maybe_fail()
        try:
            return self.objects[self._key(rel)]
        except KeyError:
            raise FileNotFoundError(self._key(rel)) from None

    def _size(self, rel: str, budget: Budget) -> int:
        return len(self._read(rel, budget))

    def _children(self, rel: str) -> set[str]:
        prefix = self._key(rel) + "/"
        return {k[len(prefix):].split("/", 1)[0] for k in self.objects if k.startswith(prefix)}

    def _exists(self, rel: str, budget: Budget) -> bool:
        return self._key(rel) in self.objects or bool(self._children(rel))

    def _listdir(self, rel: str, budget: Budget) -> Iterable[str]:
        return self._children(rel)

    def _delete(self, rel: str, recursive: bool, budget: Budget) -> None:
        key = self._key(rel)
        if self._children(rel) and not recursive:
            raise StorageError(f"{self.url_of(rel)} is not empty", url=self.url_of(rel))
        for k in [k for k in self.objects if k == key or k.startswith(key + "/")]:
            del self.objects[k]


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> Storage:
    monkeypatch.setattr(DictStorage, "objects", {})
    monkeypatch.setattr(DictStorage, "fail_next", [])
    register_backend("rt-toy", DictStorage)
    st = Storage("rt-toy://bucket/run", retry=FAST)
    assert type(st) is DictStorage
    return st


def test_a_toy_backend_with_only_the_primitives_writes_reads_lists_and_deletes(
        toy: Storage) -> None:
    assert toy.capabilities.commit_protocol is CommitProtocol.COMMIT_FILE  # the default
    toy.check_writable()
    toy.makedirs("step-1")   # no directories: a no-op
    toy.fsync_dir("step-1")
    toy.write_bytes("step-1/a.pt", b"weights")
    toy.write_bytes("step-1/sub/b.pt", memoryview(b"0123")[1:3])
    with toy.open_write("step-1/c.pt") as f:
        f.write(b"streamed ")
        f.write(b"bytes")
    assert toy.read_bytes("step-1/a.pt") == b"weights"
    assert toy.read_bytes("step-1/sub/b.pt") == b"12"
    with toy.open_read("step-1/c.pt") as f:
        f.seek(9)
        assert f.read() == b"bytes"
    assert toy.size("step-1/c.pt") == 14
    assert toy.listdir() == ["step-1"]
    assert toy.listdir("step-1") == ["a.pt", "c.pt", "sub"]
    assert toy.exists("step-1") and toy.exists("step-1/a.pt") and not toy.exists("nope")
    assert toy.url_of("step-1/a.pt") == "rt-toy://bucket/run/step-1/a.pt"
    assert toy.local_path("step-1/a.pt") is None and not toy.is_local

    toy.delete("step-1/a.pt")
    assert toy.listdir("step-1") == ["c.pt", "sub"]
    toy.delete("step-1", recursive=True)
    assert toy.listdir() == [] and not toy.exists("step-1")


def test_a_toy_backend_gets_the_shared_errors_retries_and_checks(toy: Storage) -> None:
    with pytest.raises(StorageNotFoundError) as info:
        toy.read_bytes("no/such.pt")
    assert "rt-toy://bucket/run/no/such.pt" in str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    with pytest.raises(NotImplementedError, match="atomic"):
        toy.rename_dir("a", "b")
    with pytest.raises(ValueError, match="relative"):
        toy.write_bytes("../escape", b"")

    DictStorage.fail_next[:] = [ConnectionResetError(), TimeoutError()]
    toy.write_bytes("retried", b"1")   # two transient failures, then it works
    assert toy.read_bytes("retried") == b"1" and not DictStorage.fail_next

    DictStorage.fail_next[:] = [ConnectionResetError()] * 1000
    with pytest.raises(StorageUnavailableError, match="deadline_s"):
        Storage("rt-toy://bucket/run", retry=RetryOptions(
            deadline_s=0.05, initial_s=0.001, max_wait_s=0.005)).write_bytes("x", b"1")

    with pytest.raises(RuntimeError, match="boom"), toy.open_write("partial") as f:
        f.write(b"half")
        raise RuntimeError("boom")
    assert not toy.exists("partial")


def test_register_backend_takes_only_storage_subclasses() -> None:
    with pytest.raises(TypeError, match="subclass of Storage"):
        register_backend("rt-bad", object)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="subclass of Storage"):
        register_backend("rt-bad", Storage)


# --- exception chains: __cause__ only, linked once where a writer's error comes back ----------


def _raised_while_handling(inner: BaseException, outer: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException:  # noqa: BLE001
            raise outer  # implicitly chained, as torch.save does
    except BaseException as exc:  # noqa: BLE001
        return exc


def test_no_space_follows_causes_only() -> None:
    enospc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert is_no_space(enospc)
    caused = RuntimeError("wrapped")
    caused.__cause__ = enospc
    assert is_no_space(caused)
    assert not is_no_space(_raised_while_handling(
        OSError(errno.ENOSPC, "full"), ValueError("a bug in the handler")))


def test_a_serializer_failing_on_a_full_disk_is_a_full_disk(tmp_path: Path) -> None:
    """torch.save raises RuntimeError("unexpected pos") while handling the ENOSPC of its
    write: open_write links the two, so the error is a StorageFullError for everyone."""
    st = Storage(str(tmp_path / "ckpt"))
    for atomic in (True, False):
        with pytest.raises(StorageFullError) as info, st.open_write("f.pt", atomic=atomic):
            raise _raised_while_handling(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
                                         RuntimeError("unexpected pos 64 vs 0"))
        assert "no space left on the device" in str(info.value)
        assert isinstance(info.value.__cause__, RuntimeError)
        assert is_no_space(info.value.__cause__)   # the link is a cause now
        assert st.listdir() == []


def test_a_refused_connection_is_found_through_causes_and_aiohttp_os_error() -> None:
    refused = ConnectionRefusedError(errno.ECONNREFUSED, "Connect call failed")
    assert _refused(refused)
    outer = OSError("cannot connect")
    outer.__cause__ = refused
    assert _refused(outer)

    class ClientConnectorError(Exception):
        os_error = refused

    assert _refused(ClientConnectorError())
    assert not _refused(_raised_while_handling(refused, ValueError("unrelated")))


def test_a_url_no_filesystem_can_open_names_the_directory_and_what_works() -> None:
    with pytest.raises(ValueError) as info:
        Storage("s3x://bucket/run", retry=FAST)
    assert str(info.value).startswith(
        "checkpoint directory s3x://bucket/run: no filesystem knows the protocol 's3x'; use "
        "a local path, a Cloud Storage mount (/gcs/BUCKET/PATH) or gs://BUCKET/PATH")
    # A protocol fsspec knows whose package is not installed (s3:// without s3fs).
    fsspec.register_implementation("rtmissing", "no_such_package.NoFileSystem",
                                   errtxt="Install no_such_package to access rtmissing")
    with pytest.raises(ImportError) as missing:
        Storage("rtmissing://bucket/run", retry=FAST)
    assert str(missing.value) == ("checkpoint directory rtmissing://bucket/run: Install "
                                  "no_such_package to access rtmissing")
