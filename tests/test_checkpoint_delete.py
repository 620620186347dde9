"""Retention's delete interrupted at every point (docs/design.md, "Commit protocols").

Each run builds a checkpoint directory (steps 1-3 committed, a save in flight) and lets
retention (``prune``, keep_last=1: steps 1 and 2 go) stop just before its k-th change to
the storage, for k = 1, 2, ... until a run finishes untouched. On local disk, FUSE-style
paths and the GCS emulator the delete runs in a real child process that SIGKILLs itself
(tests/ckpt_workers/deleter.py); on ``memory://``, which lives inside one process, an
injected hook raises a BaseException at that point instead. After every stop:

  * readers never see half a step: every committed step verifies, and on local disk no
    step directory without its marker is left under a ``step-N`` name; elsewhere a
    half-deleted directory is marked debris, which readers skip;
  * ``checkpoints verify`` exits 0 and names the debris (not damage);
  * the next start (``remove_crashed_saves``) and retention finish the delete: only step 3
    and the save in flight are left, and the save in flight was never touched.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from warm import WarmProcess

from resilient_train.checkpoint.commit.directory import MARKER, prune, scan, verify_step
from resilient_train.checkpoint.commit.manifest import FileEntry, Manifest, crc32c, parse_step
from resilient_train.checkpoint.commit.protocol import committer_for, remove_crashed_saves
from resilient_train.checkpoint.commit.retention import RetentionPolicy
from resilient_train.checkpoint.storage.base import RetryOptions, Storage
from resilient_train.cli import main as cli

pytestmark = pytest.mark.slow

DELETER = Path(__file__).parent / "ckpt_workers" / "deleter.py"
FAST = RetryOptions(deadline_s=20.0, initial_s=0.01, max_wait_s=0.1)
IN_FLIGHT = "feedface"   # the token of a live save (another job on the same directory)
MAX_STOPS = 60


class Deleter(WarmProcess):
    """The warm parent process: one JSON request in, one JSON answer out."""

    def __init__(self, log_path: Path) -> None:
        super().__init__(DELETER, log_path, "the deleter")
        self.wait_ready()

    def run(self, **request: Any) -> dict[str, Any]:
        return self.request(request)


@pytest.fixture(scope="module")
def deleter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deleter]:
    d = Deleter(tmp_path_factory.mktemp("deleter") / "deleter.log")
    try:
        yield d
    finally:
        d.stop()


# --- one directory, and a stop at change k ---------------------------------------------


@dataclass
class Where:
    """One checkpoint directory on one backend, as the test and the deleter reach it."""

    kind: str
    url: str
    options: dict[str, Any] | None = None
    mounts: list[str] = field(default_factory=list)

    def storage(self) -> Storage:
        kwargs: dict[str, Any] = {"retry": FAST, "storage_options": self.options}
        if self.mounts:
            kwargs["object_store_mounts"] = tuple(self.mounts)
        return Storage(self.url, **kwargs)


def _commit(storage: Storage, step: int, token: str) -> str:
    committer = committer_for(storage, token)
    work = committer.work_dir(step)
    data = f"weights of step {step}".encode() * 100
    with committer.hold(work):
        storage.write_bytes(f"{work}/data.bin", data)
        storage.write_bytes(f"{work}/extra/more.bin", data[:10])
    return committer.commit(work, Manifest(
        step=step, world_size=1, layout="replicated",
        files={"data.bin": FileEntry(len(data), crc32c(data)),
               "extra/more.bin": FileEntry(10, crc32c(data[:10]))}))


def _build(where: Where) -> tuple[Storage, str]:
    """Steps 1-3 committed and a save in flight; returns the save's directory name."""
    storage = where.storage()
    for step in (1, 2, 3):
        _commit(storage, step, "0a0a0a0a")
    live = committer_for(storage, IN_FLIGHT)
    # Local disk: a live save of an old step, which only its lock protects. Object
    # stores: a save of a new step in place, without a marker yet.
    work = live.work_dir(1 if storage.atomic_rename else 9)
    storage.write_bytes(f"{work}/data.bin", b"half written")
    return storage, work


class _Stopped(BaseException):
    """The injected stop (memory://): not an Exception, so nothing catches it."""


def _stop_in_process(where: Where, stop_at: int) -> bool:
    """Run retention in this process, stopping it before its change ``stop_at``."""
    backend = type(where.storage())
    changes = 0

    def counted(name: str) -> Any:
        real = getattr(backend, name)

        def change(self: Storage, *args: Any, **kwargs: Any) -> Any:
            nonlocal changes
            changes += 1
            if changes == stop_at:
                raise _Stopped()
            return real(self, *args, **kwargs)
        return change

    stopping = type("Stopping", (backend,), {
        n: counted(n) for n in ("_write", "_delete", "_rename_dir")})
    try:
        prune(stopping(where.url, retry=FAST), RetentionPolicy(keep_last=1))
    except _Stopped:
        return True
    return False


def _check_readers(where: Where, storage: Storage, work: str,
                   capsys: pytest.CaptureFixture[str]) -> None:
    if storage.atomic_rename:
        half = [n for n in storage.listdir("") if parse_step(n) is not None
                and not storage.exists(f"{n}/{MARKER}")]
        assert half == [], f"half a step is visible to readers under its name: {half}"
    infos = scan(storage)
    committed = [i for i in infos if i.committed]
    assert 3 in [i.step for i in committed]             # the kept step is never touched
    for info in committed:
        assert verify_step(storage, info).ok, verify_step(storage, info).problems
    for info in infos:
        if not info.committed and info.name != work:
            assert getattr(info, "debris", ""), f"{info.name}: a leftover not marked debris"
    if where.kind != "gcs":   # the CLI takes a URL only: no emulator endpoint
        # Object stores: the save in flight, newer than the newest commit and without its
        # marker yet, fails verify as it always has (a deleted marker looks the same).
        rc = 0 if storage.atomic_rename else 1
        assert cli.main(["checkpoints", "verify", where.url, "--json"]) == rc
        rows = json.loads(capsys.readouterr().out)
        for row in rows:
            if row["name"] == work or row["ok"]:
                continue
            assert row["debris"] and not row["committed"], row
            assert "checkpoints prune" in row["problems"][0], row
        assert {r["name"] for r in rows if r["debris"]} == \
            {i.name for i in infos if getattr(i, "debris", "") and i.name != work}


def _check_finished(storage: Storage, work: str) -> None:
    remove_crashed_saves(storage)   # the next start
    prune(storage, RetentionPolicy(keep_last=1), protect=IN_FLIGHT)   # its retention
    infos = scan(storage)
    assert [i.step for i in infos if i.committed] == [3]
    left = storage.listdir("")
    assert left == sorted({i.name for i in infos if i.committed} | {work}), left
    assert storage.read_bytes(f"{work}/data.bin") == b"half written"


def _wheres(kind: str, tmp_path: Path, request: pytest.FixtureRequest, k: int) -> Where:
    if kind == "local":
        return Where(kind, str(tmp_path / f"local-{k}"))
    if kind == "fuse":
        return Where(kind, str(tmp_path / "gcs" / f"b-{k}"), mounts=[str(tmp_path / "gcs")])
    if kind == "memory":
        return Where(kind, f"memory://rt-delete-{uuid.uuid4().hex[:8]}/run-{k}")
    bucket = request.getfixturevalue("gcs_bucket")
    return Where(kind, f"{bucket.url}/run-{k}", dict(bucket.storage_options))


@pytest.mark.parametrize("kind", ["local", "fuse", "memory", "gcs"])
def test_retention_stopped_at_every_change_leaves_no_half_step(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest,
        capsys: pytest.CaptureFixture[str]) -> None:
    deleter: Deleter | None = None if kind == "memory" else request.getfixturevalue("deleter")
    stops = 0
    for k in range(1, MAX_STOPS + 1):
        where = _wheres(kind, tmp_path, request, k)
        storage, work = _build(where)
        live = committer_for(storage, IN_FLIGHT)
        with live.hold(work):   # the save in flight holds its directory (local disk)
            if deleter is None:
                stopped = _stop_in_process(where, k)
            else:
                answer = deleter.run(url=where.url, storage_options=where.options,
                                     object_store_mounts=where.mounts, keep_last=1,
                                     kill_at=k)
                assert answer["error"] is None, answer["error"]
                stopped = answer["killed"]
            if stopped:
                stops += 1
                _check_readers(where, storage, work, capsys)
            _check_finished(storage, work)   # a run that finished: the same
        if not stopped:
            break
    else:
        pytest.fail(f"retention was still being stopped after {MAX_STOPS} changes")
    # Two steps deleted: at least the intent (or rename) and the removal of each.
    assert stops >= 4, stops
