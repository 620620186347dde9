"""Exit codes, error taxonomy and the error report a failing replica leaves behind.

Exit codes follow the platform's exit-code rules (docs/platform.md): 134 asks for a rerun from the last checkpoint
(the platform lists it as transient, and Kubeflow's ExitCode policy retries every code
>= 128); 1 says rerunning cannot help.

The report goes to $TORCHELASTIC_ERROR_FILE in the format torch.distributed.elastic's
ErrorHandler writes, so one script reports the same way under torchrun and our launcher,
plus a "resilient_train" key with what the launcher needs for the platform's messages.
No torch import: the launcher imports this module and must start fast.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import os
import pathlib
import sys
import tempfile
import time
import traceback as _tb
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any, ClassVar, NoReturn, TypeVar

logger = logging.getLogger(__name__)

EXIT_TRANSIENT = 134
EXIT_PERMANENT = 1
PLATFORM_TRANSIENT_EXIT_CODES = frozenset({6, 11, 134, 139})
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
REPORT_KEY = "resilient_train"

_F = TypeVar("_F", bound=Callable[..., Any])


class Classification(str, Enum):
    TRANSIENT = "transient"
    PERMANENT = "permanent"
    OOM = "oom"


class TransientError(Exception):
    """Raise to ask for a rerun from the last checkpoint (a lost peer, a flaky filesystem)."""

    exit_code: ClassVar[int] = EXIT_TRANSIENT
    classification: ClassVar[Classification] = Classification.TRANSIENT
    # A planned way out (asked to stop, not a failure): @record logs it as one line; the
    # error report keeps the traceback.
    one_line_exit: ClassVar[bool] = False


class PermanentError(Exception):
    """Raise when rerunning cannot help (bad config, bad data, a bug)."""

    exit_code: ClassVar[int] = EXIT_PERMANENT
    classification: ClassVar[Classification] = Classification.PERMANENT


def exit_code_for(returncode: int) -> int:
    """A subprocess returncode in the shell's convention: killed by signal N -> 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def is_platform_transient(returncode: int) -> bool:
    """Whether the platform retries the job for this exit (SIGABRT / SIGSEGV, raw or 128+N)."""
    return exit_code_for(returncode) in PLATFORM_TRANSIENT_EXIT_CODES


# torch.distributed's network, store and backend (NCCL) errors: a peer or the store went
# away. By name, so this module never imports torch.
_TORCH_TRANSIENT = frozenset({"DistNetworkError", "DistStoreError", "DistBackendError"})

# What gloo, NCCL and the TCPStore say (often as a plain RuntimeError) when a peer of the
# process group died or restarted. Lower case.
PEER_LOST_MESSAGES = (
    "connection closed by peer", "connection reset by peer", "broken pipe",
    "connection refused", "failed to recv", "failed to send", "timed out waiting",
    "communicator was aborted", "process group was aborted", "nccl error", "socket timeout",
)


def _is_oom(exc: BaseException) -> bool:
    # By name, so torch.OutOfMemoryError (CUDA, MPS, XPU) is recognised without torch.
    return isinstance(exc, MemoryError) or any(
        cls.__name__ == "OutOfMemoryError" for cls in type(exc).__mro__)


def _classify_one(exc: BaseException) -> Classification | None:
    if isinstance(exc, TransientError):
        return Classification.TRANSIENT
    if isinstance(exc, PermanentError):
        return Classification.PERMANENT
    if _is_oom(exc):
        return Classification.OOM
    if isinstance(exc, (ConnectionError, TimeoutError)) or any(
            cls.__name__ in _TORCH_TRANSIENT for cls in type(exc).__mro__):
        return Classification.TRANSIENT
    if isinstance(exc, RuntimeError) and any(p in str(exc).lower() for p in PEER_LOST_MESSAGES):
        return Classification.TRANSIENT
    return None


def exception_chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc``, then what it was raised ``from``, and so on: the one rule by which every
    decision about an exception (transient or a bug, a lost peer, a full disk) reads it.

    Only ``__cause__`` (``raise X from Y``) links: an exception raised while handling
    another one (``__context__`` only) is judged on its own, so a ``KeyError`` in an
    ``except ConnectionResetError`` block is a bug, not a lost peer. Code that means "this
    failed because of that" says so with ``from``, which our own raise sites do.
    """
    seen: set[int] = set()
    e = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__


def classify_exception(exc: BaseException) -> Classification:
    """Transient (rerun from the checkpoint), permanent (a bug, bad config) or OOM.

    Our own TransientError / PermanentError decide; then out of memory; then the failures
    a rerun fixes: network and timeout errors, torch.distributed's errors, and a collective
    that failed because a peer went away. An exception raised ``from`` another one is
    judged by the first in its ``__cause__`` chain that says something. Anything else is a
    bug: permanent, so the job fails at once instead of crash-looping.
    """
    for e in exception_chain(exc):
        verdict = _classify_one(e)
        if verdict is not None:
            return verdict
    return Classification.PERMANENT


def exit_code_for_classification(classification: Classification | str) -> int:
    """TRANSIENT -> 134; PERMANENT and OOM -> 1.

    OOM exits 1, not a code of its own: the platform decides "ran out of memory" from its own
    memory accounting, never from the exit code, and rerunning the same job would OOM again.
    """
    if Classification(classification) is Classification.TRANSIENT:
        return EXIT_TRANSIENT
    return EXIT_PERMANENT


@dataclass(frozen=True)
class ErrorReport:
    replica: str
    exit_code: int
    classification: str
    message: str
    traceback: str
    time: float  # epoch seconds

    def excerpt(self, max_lines: int = 12) -> str:
        """The last lines of the traceback, which the platform appends to its error message."""
        return traceback_excerpt(self.traceback, max_lines)


TRACEBACK_HEADER = "Traceback (most recent call last):"


def traceback_excerpt(text: str, max_lines: int = 12, max_chars: int = 2000) -> str:
    """The end of a traceback, cut to fit an error message: the header, then the last
    whole frames (a cut never starts in the middle of one), then the exception line.
    Lines over 400 characters and a total over ``max_chars`` are shortened with "..."."""
    if max_lines <= 0:
        return ""
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) > max_lines:
        header = lines[0].startswith(TRACEBACK_HEADER) and max_lines > 1
        tail = lines[-(max_lines - header):]
        # Start at a frame ("  File ...") so that no code line or caret line is orphaned.
        first_frame = next((i for i, line in enumerate(tail[:-1])
                            if line.startswith("  File ")), None)
        if first_frame is not None:
            tail = tail[first_frame:]
        lines = [TRACEBACK_HEADER, *tail] if header else tail
    lines = [line if len(line) <= 400 else line[:397] + "..." for line in lines]
    while len(lines) > 2 and sum(len(line) + 1 for line in lines) > max_chars:
        del lines[1]   # drop the oldest frames first; keep the header and the exception
    out = "\n".join(lines)
    return out if len(out) <= max_chars else out[:max_chars - 3] + "..."


def _default_replica() -> str:
    from .cluster import ClusterInfo

    try:
        return ClusterInfo.from_env().replica_name
    except Exception:  # a report must never fail because the environment is odd
        return ""


def write_error_report(
    error: BaseException | str,
    *,
    exit_code: int,
    classification: Classification | str,
    path: str | os.PathLike[str] | None = None,
    replica: str | None = None,
    traceback: str | None = None,
) -> pathlib.Path | None:
    """Write the report atomically; returns its path, or None when no path is configured.

    `path` defaults to $TORCHELASTIC_ERROR_FILE. `traceback` defaults to the exception's.
    An existing file is overwritten: torchrun's "first error wins" protects a child's report
    from its parent, and our launcher gives every attempt its own path, so the file present
    is from an earlier run of this same process. OSError propagates.
    """
    configured = path if path is not None else os.environ.get(ERROR_FILE_ENV) or None
    if configured is None:
        return None
    target = pathlib.Path(configured)
    if isinstance(error, BaseException):
        message = f"{type(error).__name__}: {error}"
        if traceback is None:
            traceback = "".join(_tb.format_exception(type(error), error, error.__traceback__))
    else:
        message = error
    now = time.time()
    if isinstance(classification, Classification):
        classification = classification.value  # str() of a str Enum is "Classification.X"
    report = ErrorReport(
        replica=_default_replica() if replica is None else replica,
        exit_code=exit_code,
        classification=classification,
        message=message,
        traceback=traceback or "",
        time=now,
    )
    payload = {
        "message": {
            "message": message,
            "extraInfo": {"py_callstack": report.traceback, "timestamp": str(int(now))},
        },
        REPORT_KEY: asdict(report),
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)  # readers see the old file or the new one, never half of one
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _report_from_ours(data: Any) -> ErrorReport | None:
    if not isinstance(data, dict):
        return None
    types: dict[str, type | tuple[type, ...]] = {
        "replica": str,
        "exit_code": int,
        "classification": str,
        "message": str,
        "traceback": str,
        "time": (int, float),
    }
    if any(
        not isinstance(data.get(k), t) or isinstance(data.get(k), bool) for k, t in types.items()
    ):
        return None
    return ErrorReport(**{k: data[k] for k in types})  # bool is an int, but never a valid one


def _report_from_torchelastic(data: dict[str, Any]) -> ErrorReport | None:
    # ErrorHandler writes {"message": {"message", "extraInfo": {...}}}; older and parent-dumped
    # files may carry a plain string message with a top-level timestamp.
    message = data.get("message")
    try:
        if isinstance(message, str):
            text, callstack, stamp = message, "", data.get("timestamp", 0)
        elif isinstance(message, dict) and isinstance(message.get("message"), str):
            extra = message.get("extraInfo") or {}
            text = message["message"]
            callstack = str(extra.get("py_callstack", "")) if isinstance(extra, dict) else ""
            stamp = extra.get("timestamp", 0) if isinstance(extra, dict) else 0
        else:
            return None
        when = float(stamp)
    except (TypeError, ValueError):
        return None
    return ErrorReport(
        replica="",
        exit_code=-1,
        classification="unknown",
        message=text,
        traceback=callstack,
        time=when,
    )


def read_error_report(path: str | os.PathLike[str]) -> ErrorReport | None:
    """The report at `path`; None when it is missing, empty or corrupt (corrupt is logged)."""
    try:
        text = pathlib.Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        logger.warning("cannot read error report %s: %s", path, exc)
        return None
    if not text.strip():
        return None
    try:
        data = json.loads(text)
    except ValueError as exc:
        logger.warning("error report %s is not JSON (%s); ignoring it", path, exc)
        return None
    report = None
    if isinstance(data, dict):
        report = _report_from_ours(data.get(REPORT_KEY)) or _report_from_torchelastic(data)
    if report is None:
        logger.warning(
            "error report %s has neither a %r key nor TorchElastic's "
            "{'message': ...} shape; ignoring it",
            path,
            REPORT_KEY,
        )
    return report


def _flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or replaced stream must not block the exit
            pass


def _report_and_exit(
    error: BaseException | str, code: int, classification: Classification, traceback: str,
    *, one_line: bool = False,
) -> NoReturn:
    try:
        write_error_report(
            error, exit_code=code, classification=classification, traceback=traceback
        )
    except Exception:  # the exit code still tells the launcher what happened
        logger.exception("could not write the error report to $%s", ERROR_FILE_ENV)
    if one_line:
        # A planned exit (a SIGTERM's emergency save): a stack here reads like a crash.
        logger.warning("%s, exit %d", error, code)
    else:
        logger.error(
            "exiting with code %d (%s): %s\n%s",
            code,
            classification.value,
            error if isinstance(error, str) else f"{type(error).__name__}: {error}",
            traceback.rstrip(),
        )
    _flush_streams()
    # Leaving: the interpreter's last garbage collection would walk every object torch
    # and the storage clients made, 1.2 s of exit on a 2-core VM against 0.2 s without it
    # (the grace period's time, after an emergency save).
    gc.freeze()
    raise SystemExit(code)


def _exit(reason: str, exc: BaseException | None, code: int, c: Classification,
          one_line: bool = False) -> NoReturn:
    # Without exc: the exception being handled, if any, explains more than our own stack.
    exc = exc if exc is not None else sys.exc_info()[1]
    if exc is not None:
        text = "".join(_tb.format_exception(type(exc), exc, exc.__traceback__))
    else:
        text = "".join(_tb.format_stack()[:-2])  # drop exit_*/_exit frames
    _report_and_exit(reason, code, c, text, one_line=one_line)


def exit_transient(reason: str, *, exc: BaseException | None = None,
                   one_line: bool = False) -> NoReturn:
    """Report and exit 134: run me again from my last checkpoint. ``one_line``: a planned
    exit, logged as ``"<reason>, exit 134"`` alone (the report still has the stack)."""
    _exit(reason, exc, EXIT_TRANSIENT, Classification.TRANSIENT, one_line)


def exit_permanent(reason: str, *, exc: BaseException | None = None) -> NoReturn:
    """Report and exit 1: rerunning cannot help."""
    _exit(reason, exc, EXIT_PERMANENT, Classification.PERMANENT)


def record(fn: _F) -> _F:
    """Like torchelastic's @record: an escaping exception becomes a report and an exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # SystemExit and KeyboardInterrupt pass through
            c = classify_exception(exc)
            text = "".join(_tb.format_exception(type(exc), exc, exc.__traceback__))
            one_line = bool(getattr(exc, "one_line_exit", False))
            _report_and_exit(exc, exit_code_for_classification(c), c, text, one_line=one_line)

    return wrapper  # type: ignore[return-value]
