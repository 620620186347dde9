from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from resilient_train.cluster import cluster_spec_json
from resilient_train.errors import (
    ERROR_FILE_ENV,
    EXIT_PERMANENT,
    EXIT_TRANSIENT,
    PLATFORM_TRANSIENT_EXIT_CODES,
    Classification,
    ErrorReport,
    PermanentError,
    TransientError,
    classify_exception,
    exit_code_for,
    exit_code_for_classification,
    exit_permanent,
    exit_transient,
    is_platform_transient,
    read_error_report,
    record,
    traceback_excerpt,
    write_error_report,
)
from resilient_train.text import error_line, first_line


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (ERROR_FILE_ENV, "CLUSTER_SPEC", "TF_CONFIG", "RANK", "WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(var, raising=False)


def test_exit_codes_follow_platform_and_kubeflow() -> None:
    assert EXIT_TRANSIENT in PLATFORM_TRANSIENT_EXIT_CODES and EXIT_TRANSIENT >= 128
    assert 1 <= EXIT_PERMANENT <= 127 and EXIT_PERMANENT not in PLATFORM_TRANSIENT_EXIT_CODES
    assert (TransientError.exit_code, TransientError.classification) == (
        134,
        Classification.TRANSIENT,
    )
    assert (PermanentError.exit_code, PermanentError.classification) == (
        1,
        Classification.PERMANENT,
    )


@given(st.integers(1, 64))
def test_signal_deaths_become_128_plus_n(signum: int) -> None:
    assert exit_code_for(-signum) == 128 + signum


@given(st.integers(0, 255))
def test_plain_exit_codes_are_unchanged(code: int) -> None:
    assert exit_code_for(code) == code


@pytest.mark.parametrize(
    ("returncode", "transient"),
    [
        (6, True),
        (11, True),
        (134, True),
        (139, True),
        (-6, True),
        (-11, True),
        (0, False),
        (1, False),
        (137, False),
        (-9, False),
        (-15, False),
        (128, False),
    ],
)
def test_is_platform_transient(returncode: int, transient: bool) -> None:
    assert is_platform_transient(returncode) is transient


class OutOfMemoryError(RuntimeError):  # same name as torch.cuda.OutOfMemoryError
    pass


class SubclassedOOM(OutOfMemoryError):
    pass


class FlakyButPermanent(PermanentError, ConnectionError):
    pass


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (TransientError("x"), Classification.TRANSIENT),
        (PermanentError("x"), Classification.PERMANENT),
        (FlakyButPermanent("x"), Classification.PERMANENT),  # the explicit taxonomy wins
        (MemoryError(), Classification.OOM),
        (OutOfMemoryError("CUDA"), Classification.OOM),
        (SubclassedOOM(), Classification.OOM),
        (ConnectionResetError(), Classification.TRANSIENT),
        (TimeoutError(), Classification.TRANSIENT),
        (ValueError("bad config"), Classification.PERMANENT),
        (RuntimeError("boom"), Classification.PERMANENT),
    ],
)
def test_classify_exception(exc: BaseException, expected: Classification) -> None:
    assert classify_exception(exc) is expected


def test_real_torch_oom_is_recognised_by_name() -> None:
    torch = pytest.importorskip("torch")
    assert (
        classify_exception(torch.cuda.OutOfMemoryError("CUDA out of memory")) is Classification.OOM
    )


def test_torch_network_and_store_errors_are_transient() -> None:
    torch = pytest.importorskip("torch")
    dist = torch.distributed
    assert classify_exception(dist.DistNetworkError("Connection reset")) is Classification.TRANSIENT
    assert classify_exception(dist.DistStoreError("wait timeout")) is Classification.TRANSIENT
    # A plain RuntimeError from a collective is not assumed transient: it may be a bug.
    assert classify_exception(RuntimeError("shapes differ")) is Classification.PERMANENT


def test_collective_failures_from_a_lost_peer_are_transient() -> None:
    torch = pytest.importorskip("torch")
    dist = torch.distributed
    # What gloo raises (a plain RuntimeError) when the peer at the other end died.
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
                        "Connection closed by peer [127.0.0.1]:41123")
    assert classify_exception(gloo) is Classification.TRANSIENT
    nccl = dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited")
    assert classify_exception(nccl) is Classification.TRANSIENT
    # A ValueError mentioning a connection is still a bug: only RuntimeErrors are read.
    assert classify_exception(ValueError("connection reset by peer")) is Classification.PERMANENT


def test_a_lost_peers_error_reads_in_one_line_without_gloos_source_and_advice() -> None:
    """The launcher's line for a re-forming (``generation 0 ended (...)``) says what
    happened, not gloo's C++ file or torch's advice on reading the other worker's log."""
    gloo = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[127.0.0.1]:5547: Connection reset by peer. This is typically caused by a remote "
        "worker hanging or bugs in the application. Check the logs of the remote worker "
        "before reporting an error. GLHF! \U0001f3d6\ufe0f")
    assert error_line(gloo) == ("RuntimeError: Read error [127.0.0.1]:5547: Connection reset "
                                "by peer")
    assert error_line(str(gloo)) == "Read error [127.0.0.1]:5547: Connection reset by peer"
    closed = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
                          "Connection closed by peer [127.0.0.1]:41123")
    assert error_line(closed) == "RuntimeError: Connection closed by peer [127.0.0.1]:41123"
    # Anything else reads as first_line has it: advice in a message of its own stays.
    other = ValueError("shapes [3] and [4] differ. This is typically caused by a bad batch")
    assert error_line(other) == first_line(other)
    assert error_line(RuntimeError("[pair.cc:1] ")) == "RuntimeError: [pair.cc:1]"
    # The store's client (the primary, its host, gone) adds advice of its own.
    from torch.distributed import DistNetworkError

    store = DistNetworkError(
        "Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server "
        "shutdown or crash?")
    assert error_line(store) == "DistNetworkError: Failed to recv, got 0 bytes"


def test_an_explicit_cause_decides_but_an_error_while_handling_does_not() -> None:
    try:
        try:
            raise ConnectionResetError("peer gone")
        except ConnectionResetError as exc:
            raise RuntimeError("the training step failed") from exc
    except RuntimeError as wrapped:
        assert classify_exception(wrapped) is Classification.TRANSIENT
    try:
        try:
            raise ConnectionResetError("peer gone")
        except ConnectionResetError:
            raise KeyError("a bug in the handler")  # noqa: B904 - the point of the test
    except KeyError as bug:
        assert bug.__context__ is not None
        assert classify_exception(bug) is Classification.PERMANENT


def test_exit_code_for_classification() -> None:
    assert exit_code_for_classification(Classification.TRANSIENT) == EXIT_TRANSIENT
    assert exit_code_for_classification("permanent") == EXIT_PERMANENT
    assert exit_code_for_classification(Classification.OOM) == EXIT_PERMANENT


def test_excerpt_keeps_last_non_blank_lines() -> None:
    report = ErrorReport("r", 1, "permanent", "m", "a\n\nb\nc\nd\n", 0.0)
    assert report.excerpt(2) == "c\nd"
    assert report.excerpt() == "a\nb\nc\nd"
    assert report.excerpt(0) == ""


def _raise(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def test_write_then_read_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "dir" / "error.json"
    exc = _raise(ValueError("bad lr"))
    written = write_error_report(
        exc,
        exit_code=1,
        classification=Classification.PERMANENT,
        path=path,
        replica="workerpool1-0",
    )
    assert written == path
    data = json.loads(path.read_text())
    assert data["message"]["message"] == "ValueError: bad lr"
    assert "_raise" in data["message"]["extraInfo"]["py_callstack"]
    assert data["message"]["extraInfo"]["timestamp"].isdigit()
    report = read_error_report(path)
    assert report is not None
    assert (report.replica, report.exit_code, report.classification) == (
        "workerpool1-0",
        1,
        "permanent",
    )
    assert report.message == "ValueError: bad lr" and "ValueError: bad lr" in report.excerpt()
    assert [p.name for p in path.parent.iterdir()] == ["error.json"]  # no temp files left


def test_torchelastic_reads_our_file(tmp_path: Path) -> None:
    errors = pytest.importorskip("torch.distributed.elastic.multiprocessing.errors")
    path = tmp_path / "error.json"
    write_error_report(
        "lost peer", exit_code=134, classification="transient", path=path, replica="r"
    )
    failure = errors.ProcessFailure(local_rank=0, pid=1, exitcode=134, error_file=str(path))
    assert failure.message["message"] == "lost peer" and failure.timestamp > 0


def test_we_read_torchelastic_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    handler_mod = pytest.importorskip(
        "torch.distributed.elastic.multiprocessing.errors.error_handler"
    )
    path = tmp_path / "error.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(path))
    try:
        raise KeyError("shard-7")
    except KeyError as exc:
        handler_mod.ErrorHandler().record_exception(exc)
    report = read_error_report(path)
    assert report is not None
    assert (report.classification, report.exit_code, report.replica) == ("unknown", -1, "")
    assert report.message == "KeyError: 'shard-7'" and "KeyError" in report.traceback


def test_read_plain_string_message(tmp_path: Path) -> None:
    path = tmp_path / "e.json"
    path.write_text(json.dumps({"message": "it broke", "timestamp": 5}))
    report = read_error_report(path)
    assert report is not None and (report.message, report.time) == ("it broke", 5.0)


def test_path_defaults_to_env_and_none_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert write_error_report("x", exit_code=1, classification="permanent") is None
    path = tmp_path / "env.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(path))
    assert write_error_report("x", exit_code=1, classification="permanent") == path
    assert path.exists()


def test_replica_defaults_from_cluster_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "CLUSTER_SPEC",
        cluster_spec_json(
            {"workerpool0": ["a:1"], "workerpool1": ["b:1", "c:1"]}, "workerpool1", 1
        ),
    )
    path = write_error_report(
        "x", exit_code=1, classification="permanent", path=tmp_path / "e.json"
    )
    assert path is not None and (report := read_error_report(path)) is not None
    assert report.replica == "workerpool1-1"
    monkeypatch.setenv("CLUSTER_SPEC", "{broken")  # an odd environment must not break the report
    path = write_error_report(
        "x", exit_code=1, classification="permanent", path=tmp_path / "e.json"
    )
    assert path is not None and (report := read_error_report(path)) is not None
    assert report.replica == ""


def test_existing_report_is_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "e.json"
    write_error_report("first", exit_code=1, classification="permanent", path=path, replica="r")
    write_error_report("second", exit_code=134, classification="transient", path=path, replica="r")
    report = read_error_report(path)
    assert report is not None and (report.message, report.exit_code) == ("second", 134)


@pytest.mark.parametrize("content", [None, "", "  \n"])
def test_missing_or_empty_report_is_none(tmp_path: Path, content: str | None) -> None:
    path = tmp_path / "e.json"
    if content is not None:
        path.write_text(content)
    assert read_error_report(path) is None


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"other": 1}', '{"message": 3}'])
def test_corrupt_report_is_none_and_logged(
    tmp_path: Path, content: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "e.json"
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="resilient_train.errors"):
        assert read_error_report(path) is None
    assert str(path) in caplog.text


@pytest.mark.parametrize(
    ("fn", "code", "classification"),
    [
        (exit_transient, EXIT_TRANSIENT, "transient"),
        (exit_permanent, EXIT_PERMANENT, "permanent"),
    ],
)
def test_exit_helpers_report_log_and_exit(
    fn,
    code: int,
    classification: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path = tmp_path / "e.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(path))
    with (
        caplog.at_level(logging.ERROR, logger="resilient_train.errors"),
        pytest.raises(SystemExit) as exit_info,
    ):
        fn("peer gone")
    assert exit_info.value.code == code
    report = read_error_report(path)
    assert report is not None and (report.message, report.exit_code, report.classification) == (
        "peer gone",
        code,
        classification,
    )
    assert "test_exit_helpers_report_log_and_exit" in report.traceback  # the caller's stack
    assert "peer gone" in caplog.text


def test_exit_helper_uses_given_or_handled_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "e.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(path))
    with pytest.raises(SystemExit):
        exit_transient("flaky", exc=_raise(ConnectionResetError("rst")))
    assert "ConnectionResetError: rst" in read_error_report(path).traceback  # type: ignore[union-attr]
    with pytest.raises(SystemExit):
        try:
            raise OSError("disk")
        except OSError:
            exit_permanent("cannot read data")
    assert "OSError: disk" in read_error_report(path).traceback  # type: ignore[union-attr]


def test_exit_still_happens_when_report_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ERROR_FILE_ENV, str(tmp_path))  # a directory: os.replace fails
    with pytest.raises(SystemExit) as exit_info:
        exit_transient("x")
    assert exit_info.value.code == EXIT_TRANSIENT


@pytest.mark.parametrize(
    ("exc", "code", "classification"),
    [
        (ValueError("bad"), 1, "permanent"),
        (TransientError("lost"), 134, "transient"),
        (OutOfMemoryError("cuda"), 1, "oom"),
        (TimeoutError(), 134, "transient"),
    ],
)
def test_record_turns_exceptions_into_reports_and_codes(
    exc: Exception, code: int, classification: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "e.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(path))

    @record
    def main() -> None:
        raise exc

    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == code
    report = read_error_report(path)
    assert report is not None and (report.exit_code, report.classification) == (
        code,
        classification,
    )
    assert type(exc).__name__ in report.excerpt()


@pytest.mark.parametrize("exc", [SystemExit(3), KeyboardInterrupt()])
def test_record_passes_exits_through(
    exc: BaseException, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ERROR_FILE_ENV, str(tmp_path / "e.json"))

    @record
    def main() -> None:
        raise exc

    with pytest.raises(type(exc)) as info:
        main()
    assert info.value is exc
    assert not (tmp_path / "e.json").exists()


def test_record_returns_value_and_keeps_metadata() -> None:
    @record
    def main(x: int) -> int:
        """Doc."""
        return x + 1

    assert main(1) == 2
    assert (main.__name__, main.__doc__) == ("main", "Doc.")


def test_record_sets_process_exit_code(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        from resilient_train.errors import TransientError, record

        @record
        def main():
            raise TransientError("NCCL timeout")

        main()
    """)
    path = tmp_path / "e.json"
    env = {**os.environ, ERROR_FILE_ENV: str(path)}
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert result.returncode == EXIT_TRANSIENT and is_platform_transient(result.returncode)
    report = read_error_report(path)
    assert report is not None and report.message == "TransientError: NCCL timeout"


def _traceback(frames: int, message: str) -> str:
    body = "".join(f'  File "train.py", line {i}, in step_{i}\n    call_{i}()\n    ^^^^^^^^\n'
                   for i in range(frames))
    return f"Traceback (most recent call last):\n{body}ValueError: {message}"


def test_traceback_excerpt_keeps_the_header_and_whole_frames() -> None:
    lines = traceback_excerpt(_traceback(10, "bad shard 7"), max_lines=8).splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[1].startswith('  File "train.py"')   # never a caret or code line first
    assert lines[-1] == "ValueError: bad shard 7"
    assert lines[-4] == '  File "train.py", line 9, in step_9'
    assert len(lines) <= 8
    short = _traceback(1, "x")
    assert traceback_excerpt(short) == short          # short tracebacks stay whole


def test_traceback_excerpt_is_bounded_whatever_the_message() -> None:
    out = traceback_excerpt(_traceback(10, "y" * 20_000), max_chars=2000)
    assert len(out) <= 2000
    lines = out.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[-1].startswith("ValueError: yyy") and lines[-1].endswith("...")
