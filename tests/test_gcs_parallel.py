"""Parallel streams to gs:// (storage_fsspec's TransferOptions) against fake-gcs-server.

A file larger than a part is uploaded as temporary part objects that are composed
server-side into the file, and read back as ranged reads in parallel. Small parts (64 KiB)
make a few MiB of state cross many part boundaries and more than the 32 sources one
compose takes. Nothing here sleeps or times anything: concurrency is observed through
counters and gates.
"""

from __future__ import annotations

import itertools
import json
import logging
import posixpath
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
import torch

from resilient_train.checkpoint import progress as progress_mod
from resilient_train.checkpoint.commit.directory import (
    SHARED_FILE,
    read_manifest,
    scan,
    verify_step,
)
from resilient_train.checkpoint.commit.manifest import CorruptCheckpointError
from resilient_train.checkpoint.manager import CheckpointManager, CheckpointOptions
from resilient_train.checkpoint.storage import base as storage_mod
from resilient_train.checkpoint.storage import objectstore as storage_fsspec
from resilient_train.checkpoint.storage.base import (
    TMP_FILE_PREFIX,
    Budget,
    RetryOptions,
    Storage,
    StorageError,
    StoragePermissionError,
    StorageUnavailableError,
)
from resilient_train.checkpoint.storage.fileio import PartBuffers
from resilient_train.checkpoint.storage.gcs import DEFAULT_GCS_TRANSFER, GcsStorage
from resilient_train.checkpoint.storage.objectstore import FsspecStorage, TransferOptions
from resilient_train.cli import main as cli
from resilient_train.errors import Classification, classify_exception

PART = 64 << 10
STREAMS = 3
FAST = RetryOptions(deadline_s=30.0, initial_s=0.01, max_wait_s=0.1)
# A persistent outage of one part: given up after a second.
SHORT = RetryOptions(deadline_s=1.0, initial_s=0.01, max_wait_s=0.05)
SAFETY_S = 60.0   # waits on gates and conditions: a hang fails the test, never a timing


def _options(bucket: Any, **transfer: int) -> dict[str, Any]:
    return {**bucket.storage_options, "transfer": {
        "streams": STREAMS, "read_streams": STREAMS, "part_bytes": PART,
        "read_part_bytes": PART, **transfer}}


class Net(torch.nn.Module):
    """About 2.6 MiB of float32: some 40 parts of 64 KiB."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.a = torch.nn.Parameter(torch.randn(512, 1024, generator=g))
        self.b = torch.nn.Parameter(torch.randn(123, 1001, generator=g))
        self.register_buffer("c", torch.arange(7, dtype=torch.int64))


def _manager(bucket: Any, prefix: str = "run", retry: RetryOptions = FAST,
             **transfer: int) -> CheckpointManager:
    return CheckpointManager(f"{bucket.url}/{prefix}", options=CheckpointOptions(
        async_save=False, retry=retry, storage_options=_options(bucket, **transfer)))


def _objects(bucket: Any) -> list[str]:
    """Every object in the bucket, as the store has them (no listing filter)."""
    st = Storage(bucket.url, storage_options=bucket.storage_options)
    return sorted(st.fs.find(bucket.name))


def _parts_left(bucket: Any) -> list[str]:
    return [o for o in _objects(bucket) if posixpath.basename(o).startswith(TMP_FILE_PREFIX)]


def _uploaded(caplog: pytest.LogCaptureFixture) -> dict[str, tuple[Any, ...]]:
    """The storage's "uploaded ..." records by file name: (url, bytes, parts, streams,
    peak buffers, seconds)."""
    found: dict[str, tuple[Any, ...]] = {}
    for r in caplog.records:
        if r.name == storage_fsspec.__name__ and r.msg.startswith("uploaded ") \
                and isinstance(r.args, tuple):
            found[posixpath.basename(str(r.args[0]))] = r.args
    return found


def _remote(url: str, **kwargs: Any) -> FsspecStorage:
    st = Storage(url, **kwargs)
    assert isinstance(st, FsspecStorage)
    return st


# --- options ---------------------------------------------------------------------------------


def test_transfer_options_come_from_storage_options_and_check_themselves(gcs_bucket: Any
                                                                         ) -> None:
    st = _remote(gcs_bucket.url, storage_options=gcs_bucket.storage_options)
    assert isinstance(st, GcsStorage) and st.transfer == DEFAULT_GCS_TRANSFER
    st = _remote(gcs_bucket.url, storage_options={**gcs_bucket.storage_options,
                                                  "transfer": {"streams": 8}})
    assert st.transfer == TransferOptions(8, DEFAULT_GCS_TRANSFER.read_streams,
                                          DEFAULT_GCS_TRANSFER.part_bytes,
                                          DEFAULT_GCS_TRANSFER.read_part_bytes)
    given = TransferOptions(streams=2, part_bytes=1 << 20)
    st = _remote(gcs_bucket.url, storage_options={**gcs_bucket.storage_options,
                                                  "transfer": given})
    assert st.transfer is given
    assert _remote("memory://rt-parallel/x").transfer == TransferOptions(1, 1)
    for bad in ({"streams": 0}, {"read_streams": 0}, {"part_bytes": -1}, {"streams": True},
                {"read_part_bytes": 0},
                {"stream": 2}, 4):
        with pytest.raises(ValueError, match="TransferOptions|transfer"):
            Storage(gcs_bucket.url, storage_options={**gcs_bucket.storage_options,
                                                     "transfer": bad})


# --- a save through the manager -----------------------------------------------------------


def test_a_multi_part_save_round_trips_byte_exact(gcs_bucket: Any,
                                                  caplog: pytest.LogCaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level("DEBUG", logger=storage_fsspec.__name__)
    ranges: list[tuple[int, int]] = []
    lock = threading.Lock()
    reading = {"now": 0, "peak": 0}
    real_fetch = FsspecStorage._fetch_range

    def counting_fetch(self: FsspecStorage, rel: str, start: int, end: int,
                       stop: threading.Event | None) -> bytes:
        with lock:
            reading["now"] += 1
            reading["peak"] = max(reading["peak"], reading["now"])
            if rel.endswith(SHARED_FILE):
                ranges.append((start, end))
        try:
            return real_fetch(self, rel, start, end, stop)
        finally:
            with lock:
                reading["now"] -= 1

    monkeypatch.setattr(FsspecStorage, "_fetch_range", counting_fetch)
    net = Net(seed=1)
    with _manager(gcs_bucket) as mgr:
        mgr.track(model=net)
        mgr.save(1)
        st = mgr.storage
    shared = _uploaded(caplog)[SHARED_FILE]
    nbytes, parts, streams, peak_buffers = shared[1], shared[2], shared[3], shared[4]
    assert parts == -(-nbytes // PART) > 32   # more parts than one compose takes
    assert streams == STREAMS and peak_buffers <= STREAMS + 1
    assert not _parts_left(gcs_bucket)         # composed, checked, deleted
    (info,) = scan(st)
    assert info.committed and verify_step(st, info).ok
    assert st.size(f"{info.name}/{SHARED_FILE}") == nbytes

    fresh = Net(seed=2)
    with _manager(gcs_bucket) as mgr:
        mgr.track(model=fresh)
        assert mgr.restore_latest() == 1
    for name, tensor in net.state_dict().items():
        assert torch.equal(tensor, fresh.state_dict()[name]), name
    # The restore read the file as ranges of a part each, reassembled in order.
    last = sorted(set(ranges))
    assert last[0][0] == 0 and last[-1][1] == nbytes and len(last) == parts
    assert all(a[1] == b[0] for a, b in itertools.pairwise(last))
    assert 1 <= reading["peak"] <= STREAMS


def test_one_stream_uploads_in_one_request_and_reads_one_range_at_a_time(
        gcs_bucket: Any, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level("DEBUG", logger=storage_fsspec.__name__)
    ranged: list[int] = []
    lock = threading.Lock()
    reading = {"now": 0, "peak": 0}
    real_fetch = FsspecStorage._fetch_range

    def spy(self: FsspecStorage, rel: str, start: int, end: int,
            stop: threading.Event | None) -> bytes:
        with lock:
            ranged.append(start)
            reading["now"] += 1
            reading["peak"] = max(reading["peak"], reading["now"])
        try:
            return real_fetch(self, rel, start, end, stop)
        finally:
            with lock:
                reading["now"] -= 1

    monkeypatch.setattr(FsspecStorage, "_fetch_range", spy)
    st = _remote(f"{gcs_bucket.url}/one",
                 storage_options=_options(gcs_bucket, streams=1, read_streams=1))
    payload = bytes(range(256)) * (3 * PART // 256) + b"tail"
    with st.open_write("f.bin") as f:
        f.write(payload)
    assert st.last_transfer is None and not _uploaded(caplog)  # spooled, one put_file
    assert st.read_bytes("f.bin") == payload
    assert sorted(ranged) == [0, PART, 2 * PART, 3 * PART] and reading["peak"] == 1
    ranged.clear()
    small = b"x" * PART
    st.write_bytes("small.bin", small)
    assert st.read_bytes("small.bin") == small and ranged == []   # one part: one request


def test_ranged_parallel_reads_work_on_any_fsspec_store() -> None:
    """memory:// has no compose: writes stay one upload, reads go in ranges."""
    st = _remote("memory://rt-parallel-reads/run", retry=FAST, storage_options={
        "transfer": {"streams": STREAMS, "read_streams": STREAMS, "part_bytes": 1000,
                     "read_part_bytes": 1000}})
    payload = bytes(i % 241 for i in range(10_500))
    try:
        with st.open_write("f.bin") as f:
            f.write(payload)
        assert st.last_transfer is None
        assert st.read_bytes("f.bin") == payload
        with st.open_read("f.bin") as r:
            r.seek(999)
            assert r.read(1002) == payload[999:2001]
            assert r.read() == payload[2001:]
    finally:
        st.fs.rm(st.root, recursive=True)


def test_a_restore_reads_an_object_into_one_buffer_that_the_tensors_view(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranged reads land in place in one buffer, the tensors are views of it (no second
    copy of the file in memory), and a file of another size than the manifest's is
    corrupt whether it is shorter or longer."""
    from resilient_train.checkpoint.commit import loader

    st = _remote("memory://rt-read-into/run", retry=FAST, storage_options={
        "transfer": {"read_streams": STREAMS, "read_part_bytes": 4096}})
    net = Net(seed=6)
    try:
        with CheckpointManager(st.url, options=CheckpointOptions(async_save=False)) as mgr:
            mgr.track(model=net)
            mgr.save(1)
        (info,) = scan(st)
        manifest = read_manifest(st, info.name, 1)
        path = f"{st.root}/{info.name}/{SHARED_FILE}"
        assert manifest.files[SHARED_FILE].size > 40 * 4096   # many ranges, 3 in flight

        buffers: list[torch.Tensor] = []

        def kept(size: int) -> torch.Tensor:
            buffers.append(real_buffer(size))
            return buffers[-1]

        real_buffer = loader.file_buffer
        monkeypatch.setattr(loader, "file_buffer", kept)
        weights = loader.load_verified(st, info.name, SHARED_FILE, manifest)["model"]
        assert all(torch.equal(weights[k], v) for k, v in net.state_dict().items())
        (buf,) = buffers
        assert loader._ZERO_COPY   # this torch has it (test_checkpoint_integrity: without)
        assert all(buf.data_ptr() <= t.data_ptr() < buf.data_ptr() + buf.numel()
                   for t in weights.values())

        good = st.fs.cat_file(path)
        for bad, what in ((good[:-7], "ended at byte"), (good + b"extra", "longer than")):
            st.fs.pipe_file(path, bad)
            with pytest.raises(CorruptCheckpointError, match=what):
                loader.load_verified(st, info.name, SHARED_FILE, manifest)
    finally:
        st.fs.rm(st.root, recursive=True)


@pytest.fixture
def _released_by_a_line() -> Iterator[Callable[[str], threading.Event]]:
    """An Event for the proxy to hold a request on, set once the checkpoint manager logs a
    line that matches a pattern (and at the test's end, whatever happened)."""
    handlers: list[tuple[logging.Handler, threading.Event]] = []

    def gate(pattern: str) -> threading.Event:
        event = threading.Event()

        class Release(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if re.match(pattern, record.getMessage()):
                    event.set()

        handlers.append((Release(), event))
        logging.getLogger("resilient_train.checkpoint").addHandler(handlers[-1][0])
        return event

    yield gate
    for handler, event in handlers:
        logging.getLogger("resilient_train.checkpoint").removeHandler(handler)
        event.set()


def test_a_long_restore_says_how_far_it_has_got(
        gcs_bucket: Any, gcs_proxy: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
        _released_by_a_line: Callable[[str], threading.Event]) -> None:
    """A restore that takes a while (tens of GB from a bucket: minutes) logs how much of
    the state has come in, of how much and how fast, and a closing line. One ranged read
    of the state (64 KiB of 2.5 MiB) is held at the proxy until such a line has been
    logged, so that line shows a restore part-way."""
    options = {**_options(gcs_bucket), "endpoint_url": gcs_proxy.endpoint}   # via the proxy
    url = f"{gcs_bucket.url}/progress"
    net = Net(seed=8)
    caplog.set_level(logging.INFO, logger="resilient_train.checkpoint")
    with CheckpointManager(url, options=CheckpointOptions(
            async_save=False, retry=FAST, storage_options=options)) as mgr:
        mgr.track(model=net)
        mgr.save(1)
    with CheckpointManager(url, options=CheckpointOptions(
            async_save=False, retry=FAST, storage_options=options)) as mgr:
        mgr.track(model=Net(seed=9))
        assert mgr.restore_latest() == 1       # a restore of a second says nothing more
    assert [r.getMessage() for r in caplog.records
            if r.getMessage().startswith("restored checkpoint step 1 from gs://")]
    assert not [r for r in caplog.records if r.getMessage().startswith("restoring step")]
    size = mgr.storage.size(f"{scan(mgr.storage)[0].name}/{SHARED_FILE}")

    monkeypatch.setattr(progress_mod, "AFTER_S", 0.05)
    monkeypatch.setattr(progress_mod, "EVERY_S", 0.05)

    # The total known: the state is being read.
    gate = _released_by_a_line(r"restoring step 1 from .* of ")
    gcs_proxy.inject(gate, count=1, method="GET", path=r"shared\.pt.*alt=media")
    again = Net(seed=9)
    with CheckpointManager(url, options=CheckpointOptions(
            async_save=False, retry=FAST, storage_options=options)) as mgr:
        mgr.track(model=again)
        assert mgr.restore_latest() == 1
    assert [e.outcome for e in gcs_proxy.events].count("held") == 1
    assert all(torch.equal(again.state_dict()[k], v) for k, v in net.state_dict().items())
    lines = [r.getMessage() for r in caplog.records
             if r.getMessage().startswith("restoring step 1 from")]
    # Before the manifest is read the total is not known: "... so far (...)".
    head = r"restoring step 1 from gs://\S+/step-0+1\S*: "
    early = [ln for ln in lines if re.fullmatch(head + r"[0-9.]+ \S+ so far \(.*/s\)", ln)]
    shown = [m for m in (re.fullmatch(head + r"([0-9.]+) (B|KiB|MiB) of ([0-9.]+) MiB "
                                       r"\(([0-9]+)%, [0-9.]+ \S+/s\)", ln) for ln in lines) if m]
    assert len(early) + len(shown) == len(lines) - 1, lines
    assert shown and int(shown[0].group(4)) < 100, lines     # part-way, held at the proxy
    assert {m.group(3) for m in shown} == {f"{size / 2**20:.1f}"}, (lines, size)
    assert re.fullmatch(head + rf"done, {size / 2**20:.1f} MiB in [0-9]+ s \(.*/s\)",
                        lines[-1]), lines


def test_a_long_save_that_the_loop_waits_for_says_how_far_it_has_got(
        gcs_bucket: Any, gcs_proxy: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
        _released_by_a_line: Callable[[str], threading.Event]) -> None:
    """The final save of tens of GB, or a save the next one waits for: while the loop
    waits, the primary says how much has gone out since the save began. An upload of the
    async save is held at the proxy until such a line has been logged."""
    monkeypatch.setattr(progress_mod, "AFTER_S", 0.05)
    monkeypatch.setattr(progress_mod, "EVERY_S", 0.05)
    options = {**_options(gcs_bucket), "endpoint_url": gcs_proxy.endpoint}   # via the proxy
    caplog.set_level(logging.INFO, logger="resilient_train.checkpoint")
    gate = _released_by_a_line(r"saving step 1 to ")
    gcs_proxy.inject(gate, count=1, method="POST", path=r"/upload/.*step-0+1")
    with CheckpointManager(f"{gcs_bucket.url}/saving", options=CheckpointOptions(
            async_save=True, retry=FAST, storage_options=options)) as mgr:
        mgr.track(model=Net(seed=10))
        mgr.save(1)     # the snapshot; the writes go on in the background
        mgr.wait()      # as the final save, or the next save, waits
        assert mgr.last_commit_step == 1
    assert [e.outcome for e in gcs_proxy.events].count("held") == 1
    lines = [r.getMessage() for r in caplog.records
             if r.getMessage().startswith("saving step 1 to gs://")]
    assert len(lines) >= 2, lines
    # Of the state's bytes: the model's, and kilobytes of RNG states (the files add their
    # headers: the share stops at 100%).
    model = sum(t.numel() * t.element_size() for t in Net(seed=10).state_dict().values())
    shown = [re.fullmatch(r"saving step 1 to gs://\S+: [0-9.]+ \S+ of ([0-9.]+) MiB "
                          r"\(([0-9]+)%, .*/s\)", ln) for ln in lines[:-1]]
    assert all(shown), lines
    assert all(abs(float(m.group(1)) - model / 2**20) < 0.1 for m in shown if m), lines
    assert shown[0] and int(shown[0].group(2)) < 100, lines   # part-way: the upload is held
    assert re.fullmatch(r"saving step 1 to gs://\S+: done, [0-9.]+ MiB in [0-9]+ s \(.*/s\)",
                        lines[-1]), lines


def test_open_write_and_reads_at_part_boundaries(gcs_bucket: Any) -> None:
    st = _remote(f"{gcs_bucket.url}/edges", retry=FAST,
                 storage_options=_options(gcs_bucket))
    for size in (0, 1, PART - 1, PART, PART + 1, 2 * PART, 33 * PART + 5):
        payload = bytes((i * 7 + size) % 251 for i in range(size))
        with st.open_write(f"f{size}.bin") as f:
            for i in range(0, size, 10_000):   # writes that straddle part boundaries
                f.write(memoryview(payload)[i:i + 10_000])
        assert st.size(f"f{size}.bin") == size
        assert st.read_bytes(f"f{size}.bin") == payload
        with st.open_read(f"f{size}.bin") as r:
            assert r.read() == payload
        stats = st.last_transfer
        assert stats is not None and stats.nbytes == size
        assert stats.parts == (0 if size <= PART else -(-size // PART))
    assert st.listdir() == sorted(f"f{n}.bin" for n in
                                  (0, 1, PART - 1, PART, PART + 1, 2 * PART, 33 * PART + 5))
    assert not _parts_left(gcs_bucket)


# --- corruption --------------------------------------------------------------------------------


def test_a_corrupted_byte_is_detected_on_read(gcs_bucket: Any) -> None:
    net = Net(seed=3)
    with _manager(gcs_bucket) as mgr:
        mgr.track(model=net)
        mgr.save(1)
        mgr.save(2)
        st = mgr.storage
    second = next(i for i in scan(st) if i.step == 2)
    path = f"{st.root}/{second.name}/{SHARED_FILE}"
    data = bytearray(st.fs.cat_file(path))
    data[len(data) - PART // 2] ^= 0x01   # one bit, in the last part, same size
    st.fs.pipe_file(path, bytes(data))

    checked = verify_step(st, second)
    assert not checked.ok and any("crc32c" in p or "checksum" in p for p in checked.problems)
    fresh = Net(seed=4)
    with _manager(gcs_bucket) as mgr:
        mgr.track(model=fresh)
        assert mgr.restore_latest() == 1   # step 2 fails its checksum: the one before
    assert torch.equal(fresh.a, net.a)

    with _manager(gcs_bucket) as mgr:
        st.delete(next(i for i in scan(st) if i.step == 1).name, recursive=True)
        mgr.track(model=Net(seed=5))
        with pytest.raises(CorruptCheckpointError):
            mgr.restore_latest()


class _CorruptingGcs(GcsStorage):
    """Sends part 1 of every upload with one byte flipped (a part corrupted in transit)."""

    def _upload_part(self, rel: str, data: memoryview, budget: Budget) -> None:
        if rel.endswith(".p00001"):
            bad = bytearray(data)
            bad[5] ^= 0xFF
            data = memoryview(bad)
        super()._upload_part(rel, data, budget)


def test_a_corrupted_part_fails_the_compose_check_and_nothing_commits(
        gcs_bucket: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(storage_mod._REGISTERED, "gs", _CorruptingGcs)
    with _manager(gcs_bucket) as mgr:
        mgr.track(model=Net(seed=6))
        with pytest.raises(StorageError, match="crc32c") as info:
            mgr.save(1)
        st = mgr.storage
    assert st.url_of("") in str(info.value) and SHARED_FILE in str(info.value)
    assert not any(i.committed for i in scan(st))
    assert _objects(gcs_bucket) == []   # not the parts, not the composed file


# --- failures in the middle -------------------------------------------------------------------


class _FailingGcs(GcsStorage):
    """Part ``fail_at`` of each upload raises ``error`` (every attempt)."""

    fail_at = 7
    error: type[BaseException] = RuntimeError

    def _upload_part(self, rel: str, data: memoryview, budget: Budget) -> None:
        if rel.endswith(f".p{self.fail_at:05d}"):
            raise self.error("injected part failure")
        super()._upload_part(rel, data, budget)


def _listed(gcs_bucket: Any, url: str, monkeypatch: pytest.MonkeyPatch,
            capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    """What ``resilient-train checkpoints list URL --json`` prints."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_bucket.server.endpoint)
    capsys.readouterr()
    assert cli.main(["checkpoints", "list", url, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    return listed if isinstance(listed, list) else listed.get("steps", [])


def test_a_failed_part_leaves_no_committed_step_and_no_part_objects(
        gcs_bucket: Any, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(storage_mod._REGISTERED, "gs", _FailingGcs)
    with _manager(gcs_bucket) as mgr:
        mgr.track(model=Net(seed=7))
        # The part's own error, not torch.save's "unexpected pos" raised while handling it.
        with pytest.raises(RuntimeError, match="^injected part failure$") as info:
            mgr.save(1)
        st = mgr.storage
    assert classify_exception(info.value) is Classification.PERMANENT
    assert scan(st) == []
    assert _objects(gcs_bucket) == []
    assert _listed(gcs_bucket, f"{gcs_bucket.url}/run", monkeypatch, capsys) == []


def test_an_outage_of_one_part_is_transient_and_leaves_no_parts(
        gcs_bucket: Any, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A part that keeps failing with a reset: retried until RetryOptions.deadline_s, then
    StorageUnavailableError (exit 134), through torch.save, naming the file."""
    monkeypatch.setattr(_FailingGcs, "error", ConnectionResetError)
    monkeypatch.setitem(storage_mod._REGISTERED, "gs", _FailingGcs)
    with _manager(gcs_bucket, retry=SHORT) as mgr:
        mgr.track(model=Net(seed=8))
        with pytest.raises(StorageUnavailableError) as info:
            mgr.save(1)
        st = mgr.storage
    assert classify_exception(info.value) is Classification.TRANSIENT
    assert st.url_of("") in str(info.value) and SHARED_FILE in str(info.value)
    assert "ConnectionResetError: injected part failure" in str(info.value)
    assert not any(i.committed for i in scan(st))
    assert _parts_left(gcs_bucket) == []
    assert not any(s.get("state") == "ok" for s in
                   _listed(gcs_bucket, f"{gcs_bucket.url}/run", monkeypatch, capsys))


def test_a_failed_stream_raises_the_storage_error_at_the_next_write(
        gcs_bucket: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Storage.open_write directly: a part refused with 403 is not retried; the writer
    sees the storage's error (naming the file) at its next write, and nothing is left."""
    monkeypatch.setattr(_FailingGcs, "error", PermissionError)
    st = _FailingGcs(f"{gcs_bucket.url}/direct", retry=FAST,
                     storage_options=_options(gcs_bucket))
    chunk = bytes(PART // 2)
    writes = 0
    with pytest.raises(StoragePermissionError) as info, st.open_write("f.bin") as f:
        for _ in range(1000):
            f.write(chunk)
            writes += 1
    assert st.url_of("f.bin") in str(info.value) and "injected part failure" in str(info.value)
    # Stopped within the buffers' reach of part 7, not at the end of the stream.
    assert writes * len(chunk) <= (_FailingGcs.fail_at + STREAMS + 2) * PART
    assert _objects(gcs_bucket) == [] and st.listdir() == []


# --- the memory bound --------------------------------------------------------------------------


class _CountingBuffers(PartBuffers):
    """PartBuffers that say when the writer waits for one."""

    made: ClassVar[list[_CountingBuffers]] = []
    changed: ClassVar[threading.Condition] = threading.Condition()

    def __init__(self, count: int, size: int) -> None:
        super().__init__(count, size)
        self.waiting = False
        self.allocated = 0
        with self.changed:
            self.made.append(self)

    def take(self) -> Any:
        with self.changed:
            self.waiting = True
            self.changed.notify_all()
        try:
            buf = super().take()
        finally:
            with self.changed:
                self.waiting = False
        self.allocated = max(self.allocated, self._made)
        return buf


class _GatedGcs(GcsStorage):
    """Part uploads wait at a gate; counts the uploads in flight."""

    gate = threading.Event()
    in_flight = 0
    peak = 0

    def _upload_part(self, rel: str, data: memoryview, budget: Budget) -> None:
        cls = type(self)
        with _CountingBuffers.changed:
            cls.in_flight += 1
            cls.peak = max(cls.peak, cls.in_flight)
            _CountingBuffers.changed.notify_all()
        try:
            assert cls.gate.wait(SAFETY_S), "the test never opened the gate"
            super()._upload_part(rel, data, budget)
        finally:
            with _CountingBuffers.changed:
                cls.in_flight -= 1


def test_the_memory_bound_holds_streams_in_flight_plus_one_filling(
        gcs_bucket: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(storage_fsspec, "PartBuffers", _CountingBuffers)
    monkeypatch.setattr(_CountingBuffers, "made", [])
    monkeypatch.setattr(_GatedGcs, "gate", threading.Event())
    monkeypatch.setattr(_GatedGcs, "peak", 0)
    st = _GatedGcs(f"{gcs_bucket.url}/bound", retry=FAST,
                   storage_options=_options(gcs_bucket))
    total_parts = 4 * (STREAMS + 1)
    payload = bytes(i % 253 for i in range(total_parts * PART))
    written = {"bytes": 0}
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            with st.open_write("big.bin") as f:
                for i in range(0, len(payload), PART // 4):
                    f.write(payload[i:i + PART // 4])
                    written["bytes"] = i + PART // 4
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    with _CountingBuffers.changed:
        # Every stream busy and the writer waiting for a buffer: the bound is reached.
        assert _CountingBuffers.changed.wait_for(
            lambda: _GatedGcs.in_flight == STREAMS and _CountingBuffers.made
            and _CountingBuffers.made[0].waiting and _CountingBuffers.made[0].in_use
            == STREAMS + 1, SAFETY_S)
        bufs = _CountingBuffers.made[0]
        assert bufs._made == STREAMS + 1 and bufs.count == STREAMS + 1
        # The writer is held back: what it wrote fits in the buffers.
        assert written["bytes"] <= (STREAMS + 1) * PART
    assert t.is_alive()
    _GatedGcs.gate.set()
    t.join(SAFETY_S)
    assert not t.is_alive() and not errors, errors
    assert _GatedGcs.peak == STREAMS
    assert bufs.peak == STREAMS + 1 and bufs.allocated == STREAMS + 1
    assert st.last_transfer is not None and st.last_transfer.parts == total_parts
    assert st.last_transfer.peak_buffers == STREAMS + 1
    assert st.read_bytes("big.bin") == payload
    assert not _parts_left(gcs_bucket)
