"""The launcher's worker processes: how one starts, what is known of it, how it ends.

A :class:`Worker` is one life of one replica: its process, its log, the process tree its
snapshots found and the facts its end is judged by (what the launcher did to it on
purpose, whether the launcher signalled it, its own error report). Its end is one
:class:`~.exits.ProcessExit`; ``exits.classify_exit`` says what it means.

:func:`spawn` starts the process so that it dies with the launcher (PR_SET_PDEATHSIG) and
adopts its orphans as a container's PID 1 does. :class:`ProcessTrees` records every
worker's tree for the watchdog (``watchdog.py``), which kills what is left of a life when
it ends, or of every life when the launcher dies.
"""

from __future__ import annotations

import collections
import ctypes
import difflib
import io
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol, cast

import psutil

from ..errors import read_error_report
from ..platform.resources import kernel_oom_kills, process_tree
from ..platform.rules import Cause
from .console import ConsoleLines
from .exits import ProcessExit
from .logtail import BacktraceFolder, traceback_from_log
from .preload import PYTHON_PROGRAM, Preloader
from .watchdog import descendants, start_ticks
from .workerenv import LAUNCH_ID_ENV, Replica

__all__ = ["PROC", "SNAPSHOT_S", "TREE_REFRESH_S", "ProcessTrees", "Worker", "kill_all",
           "spawn"]

log = logging.getLogger(__name__)

PROC = sys.platform.startswith("linux") and os.path.isdir("/proc")
# How often each worker's process tree is recorded for the watchdog (and the loop wakes
# while workers run): a descendant that clears its environment and leaves the worker's
# session escapes a SIGKILLed launcher only if it was born less than this before.
SNAPSHOT_S = 0.5
# How often a tree that is being measured or stopped is looked for again (children born
# meanwhile count, or are stopped, from then on).
TREE_REFRESH_S = 1.0


def _shown_path(path: Any) -> str:
    """A log's path for a console line: relative to the working directory when under it."""
    text = str(path)
    rel = os.path.relpath(text) if os.path.isabs(text) else text
    return text if rel.startswith("..") else rel


class Process(Protocol):
    """What the launcher uses of a worker's process: a ``Popen``, or a life the preload
    fork server started (``preload.Forked``)."""

    pid: int
    stdout: IO[bytes] | None
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class Worker:
    """One running replica process and what the loop knows about it."""

    def __init__(self, replica: Replica, popen: Process, attempt: int,
                 restart: int, log_file: IO[bytes], report: Path,
                 echo: Callable[[str], None]) -> None:
        self.replica = replica
        self.popen = popen
        self.attempt = attempt
        self.restart = restart
        self.report = report
        # The cause the launcher gave it when it ended it on purpose (a chaos fault, the
        # memory limit): its exit is that, whatever its status says.
        self.injected: Cause | None = None
        self.kill_at: float | None = None    # SIGKILL deadline after a SIGTERM
        self.tree: list[psutil.Process] = []
        self.seen: dict[int, int] = {}        # pid -> start ticks, of the worker and tree
        self.unreported: list[tuple[int, int]] = []   # seen, not yet told to the watchdog
        self.snapshot_at = float("-inf")      # time.monotonic() of the last snapshot
        self.start_ticks = start_ticks(popen.pid) if PROC else None
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.reported_oom = False   # set by finish() from the error report
        self.oom_kills_at_start = kernel_oom_kills()
        self.signalled = False      # the launcher signalled it: its death is not a mystery
        self._log = log_file
        self._reader = threading.Thread(target=self._pump, args=(echo,), daemon=True,
                                        name=f"log-{replica.name}")
        self._reader.start()

    def _pump(self, echo: Callable[[str], None]) -> None:
        assert self.popen.stdout is not None
        prefix = f"[{self.replica.name}] "
        folder = BacktraceFolder(_shown_path(getattr(self._log, "name", "the replica's log")))
        lines = ConsoleLines()
        out = cast(io.BufferedReader, self.popen.stdout)

        def show(pairs: list[tuple[str, bool]]) -> None:
            for text, whole in pairs:
                if not whole:   # a progress bar's update
                    echo(prefix + text)
                    continue
                self.tail.append(text)
                for shown in folder.feed(text):
                    echo(prefix + shown)

        # read1: what has arrived, without waiting for a newline that a bar may not write.
        for chunk in iter(lambda: out.read1(65536), b""):
            self._log.write(chunk)
            self._log.flush()
            show(lines.feed(chunk))
        show(lines.flush())
        for shown in folder.flush():
            echo(prefix + shown)
        out.close()

    def end(self, injected: Cause) -> None:
        """The launcher ends it on purpose, as ``injected``: a SIGKILL to its whole tree."""
        self.injected = injected
        self.snapshot_tree()
        self.signal(signal.SIGKILL)

    def terminate(self) -> None:
        """SIGTERM to the worker's main process only, as the platform sends it to the
        container's PID 1. Its children (DataLoader workers, torchrun's processes) are its
        business: a DataLoader whose workers were terminated behind its back raises in the
        middle of a step instead of letting the emergency checkpoint happen."""
        self.signalled = True
        try:
            os.kill(self.popen.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass

    def signal(self, sig: int) -> None:
        """Signal the worker's whole process group and anything that left the group."""
        self.signalled = True
        self._signal_tree(sig)

    def _signal_tree(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for proc in self.tree:
            try:
                proc.send_signal(sig)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass

    def snapshot_tree(self) -> None:
        """Remember the worker's descendants (kept: once the worker is gone they are not
        its children any more, and a daemon that left the group is found only this way).

        On Linux each new one (and the worker) is queued in ``unreported`` with its start
        time, for the watchdog. The walk reads /proc/PID/task/*/children of the tree's
        processes only: its cost does not grow with the machine's other processes."""
        self.snapshot_at = time.monotonic()
        if not PROC:
            for proc in process_tree(self.popen.pid)[1:]:
                if proc not in self.tree:   # psutil compares pid and create time
                    self.tree.append(proc)
            return
        root = self.popen.pid
        # Once the worker is reaped its pid may be another process's: walk it only while
        # it is still the worker (a zombie's children have already been moved away).
        found = [root, *descendants([root])] if start_ticks(root) == self.start_ticks else []
        current = set(found)
        for pid in found:
            if pid in self.seen:
                # The same process, unless the pid space wrapped around within this tree
                # since the last snapshot: at worst a missed record, never a wrong kill
                # (the recorded start time differs). Saves a read per process per snapshot.
                continue
            ticks = start_ticks(pid)
            if ticks is None:
                continue
            if pid != root:
                try:
                    proc = psutil.Process(pid)
                except psutil.Error:
                    continue
                self.tree = [p for p in self.tree if p.pid != pid]   # an older, dead owner
                self.tree.append(proc)
            self.seen[pid] = ticks
            self.unreported.append((pid, ticks))
        # Forget the dead (a long life forks many short-lived helpers); keep those that
        # only left the tree: a daemon whose parent exited is still this life's.
        gone = {pid for pid, ticks in self.seen.items()
                if pid not in current and start_ticks(pid) != ticks}
        if gone:
            self.tree = [p for p in self.tree if p.pid not in gone]
            for pid in gone:
                del self.seen[pid]

    def finish(self, sweep: Callable[[Worker], None] | None = None) -> str | None:
        """After exit: kill leftovers, drain the log, return a traceback excerpt if any.

        The leftovers' SIGKILL does not count as the launcher signalling the worker: the
        worker had already ended, of whatever it ended of."""
        self.snapshot_tree()
        self._signal_tree(signal.SIGKILL)
        if sweep is not None:
            sweep(self)   # leftovers that are neither in the group nor known descendants
        self._reader.join(timeout=5)
        self._log.close()
        report = read_error_report(self.report)
        # The worker's own verdict: an accelerator OOM (torch.OutOfMemoryError) exits 1,
        # but the job must fail as out of memory, as a host OOM does.
        self.reported_oom = report is not None and report.classification == "oom"
        if report is not None and (report.traceback or report.message):
            return report.excerpt() or report.message
        # torch's "[rank0]: " tags stripped, its C++ log lines left out (logtail.py).
        return traceback_from_log(self.tail)

    def exit(self, returncode: int, now: float, step: int | None = None) -> ProcessExit:
        """Its end, as the facts ``classify_exit`` judges (after :meth:`finish`)."""
        before, after = self.oom_kills_at_start, kernel_oom_kills()
        return ProcessExit(
            self.replica.name, now, returncode, injected=self.injected,
            signalled=self.signalled, reported_oom=self.reported_oom,
            kernel_oom_kills_rose=before is not None and after is not None and after > before,
            step=step)


# --- starting a process ---------------------------------------------------------------

def _load_prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()   # resolved here: between fork and exec the child only calls it
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _pdeathsig_preexec(launcher_pid: int) -> Callable[[], None]:
    def preexec() -> None:
        """In the child: die with the launcher, even if it is SIGKILLed (Linux).

        And adopt its orphaned descendants, as a container's PID 1 does on the platform:
        a daemon whose parent exits at once (a double fork) stays in the worker's process
        tree, where the launcher's snapshots find it, instead of moving under init.
        Both settings survive the exec."""
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)
        _PRCTL(_PR_SET_CHILD_SUBREAPER, 1)
        if os.getppid() != launcher_pid:   # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)
    return preexec


# Python's options after which no script runs (-c CMD, -m MOD, help, version), and those
# whose value may be the next argument.
_PYTHON_NO_SCRIPT = frozenset("cmhV?")
_PYTHON_WITH_VALUE = frozenset("WX")


def missing_program(command: Sequence[str], cwd: Path) -> str | None:
    """What of ``command`` is not there to run, found before any replica starts: a
    program given as a path that is no executable file, or the script of ``python[3]
    SCRIPT``; relative paths as a replica resolves them, against ``cwd`` (each replica's
    working directory is a view of it). None when all is there, or cannot be known here
    (a name PATH resolves, ``python -m``, a shell string)."""
    if not command:
        return None
    program = command[0]
    if "/" in program:
        path = cwd / program
        if not path.is_file() or not os.access(path, os.X_OK):
            what = "is not executable" if path.is_file() else "does not exist as a file"
            return (f"the program {program} {what} (resolved against {cwd}, each replica's "
                    f"working directory){_close_match(program, cwd)}")
    if not PYTHON_PROGRAM.fullmatch(os.path.basename(program)):
        return None
    script = _python_script(command[1:])
    if script is None or (cwd / script).exists():
        return None
    return (f"the script {script} does not exist (resolved against {cwd}, each replica's "
            f"working directory): {os.path.basename(program)} would exit 2 in every replica"
            f"{_close_match(script, cwd)}")


def _python_script(args: Sequence[str]) -> str | None:
    """The script of a python command line's arguments; None when it runs none (``-c``,
    ``-m``, ``-``, ``--version``) or has none."""
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return args[i + 1] if i + 1 < len(args) else None
        if arg == "-" or not arg.startswith("-"):
            return None if arg == "-" else arg
        if arg.startswith("--"):
            if arg in ("--help", "--version"):
                return None
            i += 2 if arg == "--check-hash-based-pycs" else 1
            continue
        for j, letter in enumerate(arg[1:], start=1):   # flags run together: -uB, -Wignore
            if letter in _PYTHON_NO_SCRIPT:
                return None
            if letter in _PYTHON_WITH_VALUE:
                if j == len(arg) - 1:   # its value is the next argument
                    i += 1
                break
        i += 1
    return None


def _close_match(path: str, cwd: Path) -> str:
    """``; did you mean DIR/NAME?`` for a name close to one in the same directory."""
    parent, name = os.path.split(path)
    try:
        names = os.listdir(cwd / parent) if parent else os.listdir(cwd)
    except OSError:
        return ""
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.75)
    return f"; did you mean {os.path.join(parent, close[0])}?" if close else ""


def spawn(command: Sequence[str], env: Mapping[str, str], cwd: Path | None,
          preloader: Preloader | None = None) -> Process:
    """Start one worker process in a session of its own, its output piped to the launcher:
    forked by ``preloader`` where it can (``launch --preload``), a new process otherwise.
    Raises what ``subprocess.Popen`` raises (OSError and its kinds)."""
    if preloader is not None and preloader.can_fork(command, env):
        forked = preloader.spawn(command, env, cwd)
        if forked is not None:
            return forked
    return subprocess.Popen(
        list(command), env=env, cwd=cwd,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True,
        # Only prctl and getppid run between fork and exec (no locks, no imports).
        preexec_fn=_pdeathsig_preexec(os.getpid()) if _PRCTL is not None else None,  # noqa: PLW1509
    )


# --- the watchdog's records -------------------------------------------------------------

class ProcessTrees:
    """The launcher's side of ``watchdog.py``: the processes each worker life's snapshots
    found, appended to ``processes.log`` in the job directory (where the watchdog reads
    them, and a person can), and one line on the watchdog's stdin per finished life.

    The supervision loop calls :meth:`poll` at each step and :meth:`life_over` for each
    worker that ended; :meth:`close` sweeps every leftover of the job."""

    def __init__(self, launch_id: str, processes: Path,
                 workers: Mapping[str, Worker]) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self._workers = workers
        self._log_fd: int | None = None
        if not PROC:
            return
        try:
            # One write per snapshot that found something: the line is in the file (the
            # page cache) before the launcher can be killed; no fsync, a machine crash
            # takes the processes with it.
            self._log_fd = os.open(processes, os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                                   | os.O_APPEND | os.O_CLOEXEC, 0o644)
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "resilient_train.launcher.watchdog",
                 f"{LAUNCH_ID_ENV}={launch_id}", str(processes)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                # Its own environment must not carry the launch id it sweeps for.
                env={"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
                start_new_session=True)
        except OSError as exc:
            log.warning("no watchdog (%s): if the launcher is killed, workers' children may "
                        "survive it", exc)
            self._close_log()

    def poll(self) -> None:
        """Record each worker's process tree for the watchdog, every SNAPSHOT_S: if the
        launcher is SIGKILLed, the watchdog kills what it was told of, whatever became of
        that process's session or environment. A new worker is recorded at the first step
        after its start."""
        if not PROC:
            return
        now = time.monotonic()
        for w in self._workers.values():
            if now - w.snapshot_at >= SNAPSHOT_S:
                w.snapshot_tree()
            self.record(w)   # (also what other snapshots found meanwhile)

    def wake(self) -> float:
        """How long the loop may sleep: snapshots are due every SNAPSHOT_S while workers
        run (1 s otherwise, or where there is nothing to snapshot)."""
        return SNAPSHOT_S if self._workers and PROC else 1.0

    def record(self, w: Worker) -> None:
        """Append what the worker's snapshots found since the last call (``w.unreported``)."""
        procs, w.unreported = w.unreported, []
        if procs and self._log_fd is not None:
            text = "".join(f"{w.replica.name} {w.attempt} {w.restart} {pid} {ticks}\n"
                           for pid, ticks in procs)
            try:
                os.write(self._log_fd, text.encode())
            except OSError as exc:
                log.warning("cannot record worker processes for the watchdog: %s", exc)

    def life_over(self, w: Worker) -> None:
        self.record(w)
        if self.proc is None or self.proc.stdin is None:
            return
        try:
            self.proc.stdin.write(f"LIFE {w.replica.name} {w.attempt} {w.restart}\n".encode())
            self.proc.stdin.flush()
        except OSError:
            pass

    def _close_log(self) -> None:
        if self._log_fd is not None:
            os.close(self._log_fd)
            self._log_fd = None

    def close(self) -> None:
        """Sweep every leftover of the job, and wait for that to finish."""
        self._close_log()
        if self.proc is None:
            return
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def kill_all(workers: MutableMapping[str, Worker],
             sweep: Callable[[Worker], None] | None) -> None:
    """SIGKILL every worker's tree, wait for each and forget it (the launcher failed)."""
    for w in list(workers.values()):
        w.snapshot_tree()
        w.signal(signal.SIGKILL)
    for name, w in list(workers.items()):
        try:
            w.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        w.finish(sweep)
        del workers[name]
