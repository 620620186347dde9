"""The process layer: runs a job's workers and turns OS facts into state-machine events.

One monitor loop (like torch.distributed.elastic's agent) owns every worker process.
It sleeps until something can happen (a child exits, a timer, a fault is due) and never
polls faster than it must, so the launcher itself costs almost no CPU.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import random
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil

from ..errors import exit_code_for, read_error_report
from ..goodput import account
from ..ports import free_port
from ..telemetry import read_life, read_step, write_failures
from .chaos import ChaosSchedule, ChaosSpec, FaultKind, ScheduledFault, UnfiredFault
from .job import (
    Command,
    JobConfig,
    JobMachine,
    ReleaseCapacity,
    RequestCapacity,
    StartWorker,
    StopWorkers,
)
from .logtail import peer_connection_error, traceback_from_log
from .machines import NODE_LOCAL_DIR_ENV, Machines
from .messages import STATUS_FAULT_NOT_FIRED, STATUS_INTERNAL, JobState
from .policy import Cause, Policy, Strategy
from .programs import PoolProgram
from .quota import Capacity, Lease, LocalQuota, Request, default_quota_dir
from .record import (
    JOB_FILE,
    failures_path,
    log_path,
    mask_command,
    processes_path,
    report_path,
    telemetry_prefix,
    telemetry_prefixes,
    write_json_atomic,
)
from .resources import detect_gpus, kernel_oom_kills, process_tree, tree_pss, tree_rss
from .stall import Stall, StallStep, signal_tree
from .watchdog import descendants, start_ticks
from .workerenv import LAUNCH_ID_ENV, JobEnv, Replica, replicas_for, worker_env

log = logging.getLogger(__name__)

_FAULT_CAUSE = {
    FaultKind.KILL: Cause.NODE_LOSS,
    FaultKind.MAINTENANCE: Cause.MAINTENANCE,
    FaultKind.PREEMPT: Cause.PREEMPTION,
    FaultKind.OOM: Cause.OOM,
    FaultKind.STOCKOUT: Cause.STOCKOUT,
    FaultKind.INTERNAL: Cause.INTERNAL,
}


# How often the memory check re-discovers a worker's descendants (new children count
# from then on; the worker process itself is always measured at every poll).
_TREE_REFRESH_S = 1.0
# Deaths by these signals, unless the launcher sent them, are kills from outside (rule 7);
# SIGABRT / SIGSEGV are crashes (rule 4), other signals the program's own fault (rule 8).
_OUTSIDE_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGHUP, signal.SIGINT})
_PSS_REFRESH_S = 1.0
# How often each worker's process tree is recorded for the watchdog (and the loop wakes
# while workers run): a descendant that clears its environment and leaves the worker's
# session escapes a SIGKILLed launcher only if it was born less than this before.
_SNAPSHOT_S = 0.5
_PROC = sys.platform.startswith("linux") and os.path.isdir("/proc")
# How often the replicas' working directories are looked at for files they wrote (one
# scandir each), so the line naming such a file comes soon after it was written.
_WRITTEN_CHECK_S = 1.0
# A KIND@stepN fault waits for the primary's steps, which only scripts under @rt.main (or
# that report to the telemetry) send: a primary that has reported none this long into its
# life, the job RUNNING, likely never will, and the launcher says so (once).
NO_STEP_WARNING_S = 60.0


class LaunchError(Exception):
    """The job could not be set up (bad options, unwritable job directory)."""


@dataclass(frozen=True)
class LaunchOptions:
    command: tuple[str, ...]
    job_dir: Path
    job_name: str
    pools: tuple[tuple[str, int], ...] = (("workerpool0", 1),)
    output_dir: str | None = None          # AIP_* base; default JOB_DIR/output
    gpus_per_worker: int = 0
    cpu_slots: int = 0                     # of the machine-wide CPU-slot quota
    memory_limit: int | None = None        # bytes per worker (RSS of its process tree)
    start_jitter: float = 0.0              # max random delay before each worker starts
    grace: float = 10.0                    # SIGTERM -> SIGKILL on stop, cancel, faults
    chaos: ChaosSpec = field(default_factory=ChaosSpec)
    policy: Policy | None = None           # None: the platform's table for `strategy`
    strategy: Strategy = Strategy.STANDARD
    restart_job_on_worker_restart: bool = False
    timeout: float | None = 7 * 24 * 3600.0
    max_wait: float | None = 24 * 3600.0
    region: str = "local"
    seed: int = 0
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    quota_dir: Path | None = None
    memory_poll_s: float = 0.1
    # Warn when a KIND@stepN fault waits and the primary has reported no step this long
    # into its life (NO_STEP_WARNING_S; tests shorten it).
    no_step_warning_s: float = NO_STEP_WARNING_S
    # Per pool, instead of command / env / memory_limit / gpus_per_worker above.
    programs: tuple[PoolProgram, ...] = ()
    # Pools listed in every replica's CLUSTER_SPEC but not run (the platform's Reduction
    # Server image, which is no training rank and has no command to run here).
    listed_only: tuple[tuple[str, int], ...] = ()
    # Every replica in the launcher's working directory instead of a view of its own
    # (machines.py); TMPDIR and the node-local directory stay each replica's own.
    shared_workdir: bool = False

    def program(self, pool: str) -> PoolProgram:
        """What the replicas of ``pool`` run."""
        for p in self.programs:
            if p.pool == pool:
                return p
        return PoolProgram(pool, self.command, {}, self.memory_limit, self.gpus_per_worker)


class _Worker:
    """One running replica process and what the loop knows about it."""

    def __init__(self, replica: Replica, popen: subprocess.Popen[bytes], attempt: int,
                 restart: int, log_file: IO[bytes], report: Path,
                 echo: Callable[[str], None]) -> None:
        self.replica = replica
        self.popen = popen
        self.attempt = attempt
        self.restart = restart
        self.report = report
        self.cause: Cause | None = None      # set when the launcher itself ended it
        self.kill_at: float | None = None    # SIGKILL deadline after a SIGTERM
        self.tree: list[psutil.Process] = []
        self.seen: dict[int, int] = {}        # pid -> start ticks, of the worker and tree
        self.unreported: list[tuple[int, int]] = []   # seen, not yet told to the watchdog
        self.snapshot_at = float("-inf")      # time.monotonic() of the last snapshot
        self.start_ticks = start_ticks(popen.pid) if _PROC else None
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.mem_tree: list[psutil.Process] = []   # whose memory counts; refreshed now and then
        self.mem_tree_at = float("-inf")
        self.pss, self.pss_rss, self.pss_at = 0, 0, float("-inf")  # the last exact read
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
        for raw in iter(self.popen.stdout.readline, b""):
            self._log.write(raw)
            self._log.flush()
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.tail.append(line)
            echo(prefix + line)
        self.popen.stdout.close()

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
        if not _PROC:
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

    def finish(self, sweep: Callable[[_Worker], None] | None = None) -> str | None:
        """After exit: kill leftovers, drain the log, return a traceback excerpt if any."""
        self.snapshot_tree()
        self.signal(signal.SIGKILL)
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


class _Watchdog:
    """The launcher's side of ``watchdog.py``: the processes each worker life's snapshots
    found, appended to ``processes.log`` in the job directory (where the watchdog reads
    them, and a person can), and one line on the watchdog's stdin per finished life."""

    def __init__(self, launch_id: str, processes: Path) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_fd: int | None = None
        if not _PROC:
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

    def record(self, w: _Worker) -> None:
        """Append what the worker's snapshots found since the last call (``w.unreported``)."""
        procs, w.unreported = w.unreported, []
        if procs and self._log_fd is not None:
            text = "".join(f"{w.replica.name} {w.attempt} {w.restart} {pid} {ticks}\n"
                           for pid, ticks in procs)
            try:
                os.write(self._log_fd, text.encode())
            except OSError as exc:
                log.warning("cannot record worker processes for the watchdog: %s", exc)

    def life_over(self, w: _Worker) -> None:
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


class Launcher:
    def __init__(self, options: LaunchOptions, *, echo: Callable[[str], None] | None = None,
                 echo_workers: bool = True, clock: Callable[[], float] = time.time) -> None:
        self.options = options
        self._echo_lock = threading.Lock()
        self._echo_sink = echo or (lambda line: None)
        self._echo_workers = echo_workers
        self.clock = clock
        listed_only = {pool for pool, _ in options.listed_only}
        if listed_only & {pool for pool, _ in options.pools}:
            raise LaunchError(f"pools {sorted(listed_only)} are listed only, and also run")
        # CLUSTER_SPEC lists every pool; the launcher runs those with a program.
        listed = replicas_for(options.pools + options.listed_only)
        self.replicas = tuple(r for r in listed if r.pool not in listed_only)
        self._programs = {pool: options.program(pool) for pool, _ in options.pools}
        self._memory_limited = any(p.memory_limit is not None for p in self._programs.values())
        self._by_name = {r.name: r for r in self.replicas}
        # Absolute: the paths handed to workers (error reports, telemetry, AIP_*) must hold
        # for a worker that changes directory.
        self.job_dir = options.job_dir.resolve()
        # Validate the chaos targets before anything is created or started.
        self.chaos = ChaosSchedule(options.chaos, [r.name for r in self.replicas])
        self.machine = JobMachine(JobConfig(
            name=options.job_name,
            replicas=tuple(r.name for r in self.replicas),
            policy=options.policy,
            strategy=options.strategy,
            restart_job_on_worker_restart=options.restart_job_on_worker_restart,
            timeout=options.timeout,
            max_wait=options.max_wait,
            region=options.region,
        ), clock())
        output = options.output_dir or str(self.job_dir / "output")
        if "://" not in output:
            output = os.path.abspath(output)
        self.env = JobEnv(
            job_id=options.job_name, replicas=listed, master_addr="127.0.0.1",
            master_port=free_port(),  # outside the ephemeral range: see ports.py
            output_base=output.rstrip("/"), job_dir=str(self.job_dir),
            launch_id=uuid.uuid4().hex, running=len(self.replicas))
        self._watchdog: _Watchdog | None = None
        self.workers: dict[str, _Worker] = {}
        self._launcher_started = _process_start_time(os.getpid())
        self._delayed: list[tuple[float, StartWorker]] = []
        self._failure_log: tuple[float, int] | None = None   # what failures.json says
        self._pending_faults: list[ScheduledFault] = []
        self._stalls: dict[str, tuple[_Worker, Stall]] = {}   # hung or slowed lives, by name
        self._last_step: int | None = None   # the highest step the primary reported
        self._step_life: tuple[_Worker, float] | None = None   # primary life watched, since
        self._warned_no_steps = False
        self._rng = random.Random(options.seed)
        quota_dir = options.quota_dir or default_quota_dir(options.env)
        capacity = Capacity(detect_gpus(options.env), _cpu_slots(options.env))
        try:
            self._quota = LocalQuota(quota_dir, capacity)
        except OSError as exc:
            raise LaunchError(
                f"cannot use the quota directory {quota_dir}: {exc.strerror or exc}; set "
                "RESILIENT_TRAIN_QUOTA_DIR to a writable directory") from None
        self._request = Request(gpus=sum(self._gpus(r) for r in self.replicas),
                                cpu_slots=options.cpu_slots)
        self._lease: Lease | None = None
        # Last of the checks, so that a bad option leaves no empty job directory behind.
        self._prepare_job_dir()
        try:
            self.machines = Machines(self.job_dir, self.env.launch_id,
                                     source=None if options.shared_workdir else Path.cwd(),
                                     tmp_base=options.env.get("TMPDIR"))
        except OSError as exc:
            raise LaunchError(f"{exc}; pass --shared-workdir to run every replica in it "
                              f"as it is") from None
        self._wants_capacity = False
        self._quota_note_shown = False
        self._cancel_requests = 0
        self._written_checked = float("-inf")   # when the working directories were looked at
        self._printed_events = 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)

    # --- set-up -----------------------------------------------------------------------

    def _prepare_job_dir(self) -> None:
        # mkdir would say only "File exists" (or "Not a directory" for a parent).
        for path in (self.job_dir, *self.job_dir.parents):
            if path.is_dir():
                break
            if path.exists() or path.is_symlink():
                what = "a file, not a directory" if path.is_file() else "not a directory"
                subject = "" if path == self.job_dir else f": its parent {path}"
                raise LaunchError(
                    f"--job-dir {self.job_dir}{subject} is {what}; pass the path of a "
                    "directory (it is created if missing)")
        try:
            self.job_dir.mkdir(parents=True, exist_ok=True)
            probe = self.job_dir / ".write-test"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise LaunchError(
                f"cannot write the job directory {self.job_dir}: {exc.strerror or exc}; "
                "pass --job-dir with a writable path") from None
        if (self.job_dir / JOB_FILE).exists():
            raise LaunchError(
                f"{self.job_dir} already holds a job ({JOB_FILE}); pass a new --job-dir "
                "or --name so that the earlier record is not overwritten")

    # --- output -----------------------------------------------------------------------

    def echo(self, line: str) -> None:
        with self._echo_lock:
            self._echo_sink(line)

    def _echo_worker(self, line: str) -> None:
        if self._echo_workers:
            self.echo(line)

    def _flush_events(self, force: bool = False) -> None:
        events = self.machine.events
        if self._printed_events == len(events) and not force:
            return
        for event in events[self._printed_events:]:
            when = self.machine.create_time + event["elapsed_s"]
            stamp = time.strftime("%H:%M:%S", time.localtime(when))
            self.echo(f"{stamp} [launcher] {event['message']}")
        self._printed_events = len(events)
        write_json_atomic(self.job_dir / JOB_FILE, self._record())
        self._update_failure_log()

    def _record(self) -> dict[str, Any]:
        rec = self.machine.to_record()
        rec["job_spec"] = {
            "command": mask_command(self.options.program("workerpool0").command),  # no --token=...
            "worker_pool_specs": [
                {"pool": p, "replica_count": n,
                 "command": mask_command(self._programs[p].command),
                 "gpus_per_replica": self._programs[p].gpus_per_replica,
                 "memory_limit_bytes": self._programs[p].memory_limit}
                for p, n in self.options.pools]
            + [{"pool": p, "replica_count": n, "listed_only": True}
               for p, n in self.options.listed_only],
            "base_output_directory": self.env.output_base,
            "master_port": self.env.master_port,
        }
        rec["job_dir"] = str(self.job_dir)
        if self.machine.state.terminal:
            rec["goodput"] = self._goodput()
            if self.options.chaos:
                rec["unfired_faults"] = [u.to_json() for u in self.unfired_faults()]
            rec["exit_status"] = self.exit_status   # the launcher's, as run() returns it
        # Lets `status` tell a live job from the record of a launcher that was killed.
        rec["launcher"] = {"pid": os.getpid(), "host": socket.gethostname(),
                           "started": self._launcher_started}
        return rec

    def _failures(self) -> int:
        """Failures so far in this job: injected faults and non-zero exits of user code."""
        return sum(1 for e in self.machine.events if e["kind"] == "fault" or (
            e["kind"] == "exited" and e.get("cause") == "exit" and e.get("exit_code")))

    def _observed_mtbf(self, now: float) -> float | None:
        """Seconds of running per failure so far in this job; None before the first."""
        start, failures = self.machine.start_time, self._failures()
        if start is None or not failures:
            return None
        return max(1.0, now - start) / failures

    def _update_failure_log(self) -> None:
        """Keep telemetry/failures.json current, so that a worker that survives failures
        (in-process recovery) sees the job's observed MTBF too, not only restarted ones."""
        start, failures = self.machine.start_time, self._failures()
        if start is None or (start, failures) == self._failure_log:
            return
        try:
            write_failures(failures_path(self.job_dir), start, failures)
            self._failure_log = (start, failures)
        except OSError as exc:  # the interval then keeps what it knew
            log.warning("cannot write the failure log: %s", exc)

    def _goodput(self) -> dict[str, Any] | None:
        """The primary's training segments over every life, split into goodput buckets;
        None when the job never ran or its script does not report (no @rt.main)."""
        start, end = self.machine.start_time, self.machine.end_time
        if start is None or end is None:
            return None
        segments = [seg for prefix in telemetry_prefixes(self.job_dir, self.replicas[0].name)
                    for seg in read_life(prefix).segments]
        return account(segments, start, end).to_json() if segments else None

    def note(self, message: str, kind: str = "fault", **extra: Any) -> None:
        self.machine.note(self.clock(), message, kind, **extra)

    # --- the loop ---------------------------------------------------------------------

    def run(self) -> int:
        """Run the job to a terminal state; return the launcher's exit status."""
        restore = self._install_signals()
        watchdog = self._watchdog = _Watchdog(self.env.launch_id, processes_path(self.job_dir))
        try:
            self._flush_events(force=True)   # job.json exists from the start (QUEUED)
            self._execute(self.machine.start(self.clock()))
            while not (self.machine.state.terminal and not self.workers):
                self._step()
                self._flush_events()
                if self.machine.state.terminal and not self.workers:
                    break
                self._sleep()
            # A job can end before the loop runs once (a command that cannot start).
            self._flush_events()
        except BaseException as exc:
            # The launcher itself failed: no worker may outlive it, and the record says why.
            log.exception("launcher failed")
            self._kill_everything()
            self.machine.launcher_failed(self.clock())
            self._flush_events()
            if isinstance(exc, KeyboardInterrupt):
                return STATUS_INTERNAL
            raise
        finally:
            self._release()
            watchdog.close()
            self.machines.close()
            restore()
            os.close(self._wake_r)
            os.close(self._wake_w)
        status = self.exit_status
        return 0 if status is None else status

    def unfired_faults(self) -> list[UnfiredFault]:
        """The ``--chaos`` items that never fired, with why; empty until the job is over."""
        m = self.machine
        if not self.options.chaos or not m.state.terminal:
            return []
        ran_for = (m.end_time - m.start_time
                   if m.start_time is not None and m.end_time is not None else None)
        return self.chaos.never_fired(ran_for=ran_for, last_step=self._last_step,
                                      pending=self._pending_faults)

    @property
    def exit_status(self) -> int | None:
        """The launcher's exit status once the job is over: the machine's, except that a
        job that SUCCEEDED while a fault set at a fixed time or step never fired exits
        STATUS_FAULT_NOT_FIRED (the resilience test did not happen)."""
        status = self.machine.exit_status
        if status == 0 and any(not u.random for u in self.unfired_faults()):
            return STATUS_FAULT_NOT_FIRED
        return status

    def _step(self) -> None:
        now = self.clock()
        self._reap(now)
        self._snapshot_trees()
        if now - self._written_checked >= _WRITTEN_CHECK_S:
            self._written_checked = now
            for name in self.workers:
                self._note_written(name)
        if self._cancel_requests:
            self._execute(self.machine.cancel(now))
            if self._cancel_requests > 1:
                for w in self.workers.values():
                    w.signal(signal.SIGKILL)
        for w in list(self.workers.values()):
            if w.kill_at is not None and now >= w.kill_at:
                self.note(f"{w.replica.name}: grace period over, SIGKILL", kind="signal")
                w.kill_at = None
                w.signal(signal.SIGKILL)
        if self._memory_limited:
            self._check_memory()
        self._inject_faults(now)
        due = [cmd for t, cmd in self._delayed if t <= now]
        self._delayed = [(t, cmd) for t, cmd in self._delayed if t > now]
        for cmd in due:
            self._start_worker(cmd)
        if self._wants_capacity:
            self._try_capacity(now)
        self._execute(self.machine.tick(now))

    def _sleep(self) -> None:
        now = self.clock()
        deadlines = [t for t, _ in self._delayed]
        deadlines += [w.kill_at for w in self.workers.values() if w.kill_at is not None]
        machine_deadline = self.machine.next_deadline()
        if machine_deadline is not None:
            deadlines.append(machine_deadline)
        if self.machine.start_time is not None:
            fault_at = self.chaos.next_time()
            if fault_at is not None:
                deadlines.append(self.machine.start_time + fault_at)
        deadlines += [t for _, st in self._stalls.values() if (t := st.deadline()) is not None]
        timeout = _SNAPSHOT_S if self.workers and _PROC else 1.0
        if self._memory_limited and self.workers:
            timeout = min(timeout, self.options.memory_poll_s)
        if self._wants_capacity or self._pending_faults:
            timeout = min(timeout, 0.25)
        if self.chaos.waits_for_steps and self.machine.start_time is not None:
            timeout = min(timeout, 0.05)   # watch the primary's step count closely
        if deadlines:
            timeout = min(timeout, max(0.0, min(deadlines) - now))
        # SIGCHLD writes to the wake pipe, so a dying worker is seen at once.
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            if sel.select(timeout):
                try:
                    while os.read(self._wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
        finally:
            sel.close()

    # --- commands ---------------------------------------------------------------------

    def _execute(self, commands: Sequence[Command]) -> None:
        queue = collections.deque(commands)
        while queue:
            cmd = queue.popleft()
            if isinstance(cmd, StartWorker):
                jitter = self.options.start_jitter
                delay = self._rng.uniform(0, jitter) if jitter > 0 else 0.0
                if delay > 0:
                    self._delayed.append((self.clock() + delay, cmd))
                else:
                    queue.extend(self._start_worker(cmd, execute=False))
            elif isinstance(cmd, StopWorkers):
                self._stop(cmd.replicas, self.options.grace)
            elif isinstance(cmd, RequestCapacity):
                self._wants_capacity = True
                queue.extend(self._try_capacity(self.clock(), execute=False))
            elif isinstance(cmd, ReleaseCapacity):
                self._release()

    def _start_worker(self, cmd: StartWorker, *, execute: bool = True) -> list[Command]:
        if not self.machine.is_current(cmd):
            return []
        replica = self._by_name[cmd.replica]
        o = self.options
        program = self._programs[replica.pool]
        gpu_ids = None
        if self._lease is not None and program.gpus_per_replica:
            # Each replica's GPUs follow those of the replicas before it, in rank order.
            first = sum(self._gpus(r) for r in self.replicas[:self.replicas.index(replica)])
            gpu_ids = self._lease.gpu_ids[first:first + program.gpus_per_replica]
        elif self._quota_capacity_has_gpus():
            gpu_ids = ()  # a replica without accelerators sees none, as on the platform
        report = report_path(self.job_dir, cmd.attempt, replica.name, cmd.restart)
        report.parent.mkdir(parents=True, exist_ok=True)
        report.unlink(missing_ok=True)
        placement = self.machines.prepare(replica.name, new_vm=cmd.new_vm)
        if placement.wiped or placement.kept:
            where = "a new VM" if cmd.new_vm else "the same VM, a new container"
            self.note(f"{replica.name}: restarted on {where}: "
                      + "; ".join([*(f"{w} wiped" for w in placement.wiped),
                                   *(f"{k} kept" for k in placement.kept)]), kind="machine")
        env = worker_env(self.env, replica, attempt=cmd.attempt, restart=cmd.restart,
                         error_file=str(report), gpu_ids=gpu_ids,
                         base={**o.env, **program.env}, placement=placement,
                         telemetry=str(telemetry_prefix(self.job_dir, cmd.attempt,
                                                        replica.name, cmd.restart)),
                         observed_mtbf_s=self._observed_mtbf(now=self.clock()),
                         failures_file=str(failures_path(self.job_dir)))
        logfile = log_path(self.job_dir, cmd.attempt, replica.name)
        logfile.parent.mkdir(parents=True, exist_ok=True)
        out = open(logfile, "ab")
        out.write(f"===== {replica.name} attempt {cmd.attempt} restart {cmd.restart} "
                  f"at {time.strftime('%Y-%m-%dT%H:%M:%S')} =====\n".encode())
        now = self.clock()
        try:
            popen = subprocess.Popen(
                list(program.command), env=env, cwd=placement.workdir,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True,
                # Only prctl and getppid run between fork and exec (no locks, no imports).
                preexec_fn=_pdeathsig_preexec(os.getpid()) if _PRCTL is not None else None,  # noqa: PLW1509
            )
        except (FileNotFoundError, PermissionError, NotADirectoryError) as exc:
            # As on the platform: a command that cannot start is exit 128, StartError.
            msg = f"cannot start {program.command[0]!r}: {exc.strerror or exc}"
            out.write((msg + "\n").encode())
            out.close()
            self.echo(f"[{replica.name}] {msg}")
            cmds = self.machine.worker_started(replica.name, now) + self.machine.worker_exited(
                replica.name, 128, Cause.START_ERROR, now, excerpt=msg)
        except OSError as exc:
            out.close()
            self.echo(f"[launcher] cannot create a process for {replica.name}: {exc}")
            cmds = self.machine.worker_started(replica.name, now) + self.machine.worker_exited(
                replica.name, STATUS_INTERNAL, Cause.INTERNAL, now)
        else:
            self.workers[replica.name] = _Worker(replica, popen, cmd.attempt, cmd.restart, out,
                                                 report, self._echo_worker)
            cmds = self.machine.worker_started(replica.name, now)
        if execute:
            self._execute(cmds)
            return []
        return cmds

    def _stop(self, names: Sequence[str], grace: float, cause: Cause | None = None) -> None:
        now = self.clock()
        for name in names:
            w = self.workers.get(name)
            if w is None:
                continue
            if cause is not None:
                w.cause = cause
            w.snapshot_tree()
            self._end_stall(name, now, " to deliver the SIGTERM of a stop")
            w.terminate()
            deadline = now + grace
            w.kill_at = deadline if w.kill_at is None else min(w.kill_at, deadline)

    def _reap(self, now: float) -> None:
        ended = [(name, w, rc) for name, w in list(self.workers.items())
                 if (rc := w.popen.poll()) is not None]
        # Deaths by a signal first (faults, kills from outside, crashes): when a killed peer
        # and the survivor whose collective failed on it are reaped together, the loss is
        # the cause and is on record before the survivor's exit is judged.
        ended.sort(key=lambda item: not (item[1].cause is not None or item[2] < 0))
        for name, w, rc in ended:
            del self.workers[name]
            outside = w.cause is None and not w.signalled and -rc in _OUTSIDE_SIGNALS
            excerpt = w.finish(self._sweep)   # (signals what is left of the tree)
            self._note_written(name)
            code = exit_code_for(rc)
            cause = w.cause or (Cause.OOM if w.reported_oom and code != 0 else Cause.EXIT)
            if outside:
                cause = self._killed_from_outside(w, -rc)
            # w.tail is complete: finish() waited for the log reader.
            connection_error = peer_connection_error(w.tail) if code else None
            self._execute(self.machine.worker_exited(name, code, cause, now, excerpt=excerpt,
                                                     connection_error=connection_error))

    def _note_written(self, name: str) -> None:
        """Say, once per file, what a replica wrote to its working directory: on the
        platform that is its container's own disk."""
        for entry in self.machines.written(name):
            self.note(f"{name} wrote {entry} in its working directory: on the platform that "
                      f"is its container's own disk, which the other replicas do not see and "
                      f"a restart wipes; write what must last under AIP_CHECKPOINT_DIR "
                      f"(shared), or {NODE_LOCAL_DIR_ENV} (its VM's disk, kept by a restart "
                      f"in place)", kind="machine")

    def _killed_from_outside(self, w: _Worker, signum: int) -> Cause:
        """A worker dead of a signal that the launcher did not send and that a program does
        not raise at itself (SIGKILL, SIGTERM, SIGHUP, SIGINT): the kernel's OOM killer if
        its count rose meanwhile, else someone killed it from outside, which the platform
        sees as a lost node (rule 7: restart in place), not as a bug in the code."""
        name = signal.Signals(signum).name
        before, after = w.oom_kills_at_start, kernel_oom_kills()
        if signum == signal.SIGKILL and before is not None and after is not None \
                and after > before:
            self.note(f"{w.replica.name}: killed by the kernel's out-of-memory killer "
                      f"(SIGKILL; the machine ran out of memory)")
            return Cause.OOM
        self.note(f"{w.replica.name}: killed by {name} from outside the launcher: a node loss")
        return Cause.NODE_LOSS

    # --- capacity ---------------------------------------------------------------------

    def _quota_capacity_has_gpus(self) -> bool:
        return bool(self._quota.capacity.gpu_ids)

    def _try_capacity(self, now: float, *, execute: bool = True) -> list[Command]:
        cmds: list[Command] = []
        if self._lease is None and self._request != Request():
            if not self._quota.fits_ever(self._request):
                cmds = self.machine.no_capacity(now)
                # Only a job that waits (flex-start) says so; the others fail as a stockout.
                if self.machine.state is JobState.QUEUED and not self._quota_note_shown \
                        and self.machine.config.strategy is Strategy.FLEX_START:
                    self._quota_note_shown = True
                    self.echo(f"[launcher] waiting for capacity: the job asks for "
                              f"{self._request.gpus} GPUs / {self._request.cpu_slots} CPU slots, "
                              f"this machine has {len(self._quota.capacity.gpu_ids)} / "
                              f"{self._quota.capacity.cpu_slots}")
            else:
                self._lease = self._quota.try_acquire(self.options.job_name, self._request)
                if self._lease is None and not self._quota_note_shown:
                    self._quota_note_shown = True
                    held = ", ".join(f"{l.job_id} ({len(l.gpu_ids)} GPUs, {l.cpu_slots} slots)"
                                     for l in self._quota.usage())
                    self.echo(f"[launcher] queued: the quota is in use by {held or 'other jobs'}")
        if self._lease is not None or self._request == Request():
            self._wants_capacity = False
            self._quota_note_shown = False
            cmds = self.machine.quota_granted(now)
        if execute:
            self._execute(cmds)
            return []
        return cmds

    def _release(self) -> None:
        self._wants_capacity = False
        if self._lease is not None:
            self._quota.release(self._lease)
            self._lease = None

    # --- faults and limits ------------------------------------------------------------

    def _inject_faults(self, now: float) -> None:
        self._drive_stalls(now)
        start = self.machine.start_time
        if start is None or self.machine.state.terminal:
            return
        self._pending_faults.extend(self.chaos.due(now - start))
        if self.chaos.waits_for_steps:
            step = self._primary_step()
            if step is not None:
                self._last_step = max(step, self._last_step or 0)
                self._pending_faults.extend(self.chaos.due_at_step(step))
            else:
                self._warn_no_steps(now)
        waiting = []
        for fault in self._pending_faults:
            if self._inject(fault, now):
                self.chaos.fired(fault)
            else:
                waiting.append(fault)   # its target is between lives: hit the next one
        self._pending_faults = waiting

    def _warn_no_steps(self, now: float) -> None:
        """Once per job: step faults wait, and the primary's life has reported no step
        ``no_step_warning_s`` into RUNNING (its script likely reports none)."""
        w = self.workers.get(self.replicas[0].name)
        if self._warned_no_steps or w is None or self.machine.state is not JobState.RUNNING:
            return
        if self._step_life is None or self._step_life[0] is not w:
            self._step_life = (w, now)   # a new life (or RUNNING just began): count afresh
            return
        waited = now - self._step_life[1]
        if waited < self.options.no_step_warning_s:
            return
        self._warned_no_steps = True
        faults = ", ".join(self.chaos.waiting_for_steps())
        self.note(f"chaos: {faults} cannot fire yet: the primary {w.replica.name} has "
                  f"reported no step {waited:.0f} s into its life, and only a script under "
                  f"@rt.main (ctx.steps) reports steps; against one that does not, a "
                  f"KIND@stepN fault never fires: give it a time instead (e.g. kill:1@30s)",
                  kind="warning")

    def _primary_step(self) -> int | None:
        """Steps the primary's current life has finished (its telemetry), for faults
        written KIND@stepN; None while it has not reported any."""
        primary = self.replicas[0].name
        w = self.workers.get(primary)
        if w is None:
            return None
        return read_step(telemetry_prefix(self.job_dir, w.attempt, primary, w.restart))

    def _inject(self, fault: ScheduledFault, now: float) -> bool:
        if fault.kind.stalls:
            return self._begin_stall(fault, now)
        cause = _FAULT_CAUSE[fault.kind]
        if fault.kind.job_wide:
            # Not while the attempt is being stopped for a retry: the fault would be lost.
            if self.machine.state is not JobState.RUNNING or self.machine.stopping:
                return False
            self.note(f"chaos: {fault.kind.value} (whole job) at "
                      + (f"step {fault.at_step}" if fault.at_step is not None
                         else f"{now - self.machine.create_time:.1f} s"), cause=cause.value)
            self._execute(self.machine.job_fault(cause, now))
            return True
        w = self.workers.get(fault.target or "")
        if w is None or w.cause is not None or w.kill_at is not None:
            return False
        # replica and cause: a peer's exit soon after is put down to this loss (job.py).
        self.note(f"chaos: {fault.kind.value} on {w.replica.name}"
                  + (f" at step {fault.at_step}" if fault.at_step is not None else ""),
                  replica=w.replica.name, cause=cause.value)
        w.cause = cause
        w.snapshot_tree()
        if fault.kind.has_grace:
            grace = fault.grace if fault.grace is not None else self.options.grace
            self._end_stall(w.replica.name, now, " to deliver the SIGTERM")
            w.terminate()
            w.kill_at = now + grace
        else:
            w.signal(signal.SIGKILL)
        return True

    def _begin_stall(self, fault: ScheduledFault, now: float) -> bool:
        """A hang or slow-down: the replica's tree is stopped now (and continued by
        `_drive_stalls`). A later hang or slow-down of the same life replaces this one."""
        w = self.workers.get(fault.target or "")
        if w is None or w.cause is not None or w.kill_at is not None:
            return False
        name = w.replica.name
        self._end_stall(name, now, f" ({fault.kind.value} replaces it)")
        when = f" at step {fault.at_step}" if fault.at_step is not None else ""
        lasts = "" if fault.duration is None else f" for {fault.duration:g} s"
        stall = Stall.begin(fault, now)
        if fault.kind is FaultKind.SLOW:
            self.note(f"chaos: slow on {name}{when}: {stall.speed:.0%} speed"
                      + (lasts or " for the rest of its life"))
        else:
            self.note(f"chaos: hang on {name}{when}{lasts}")
        w.snapshot_tree()
        stall.tree_at = now
        self._stalls[name] = (w, stall)
        self._drive_stalls(now)
        return True

    def _drive_stalls(self, now: float) -> None:
        """Stop, continue or release the hung and slowed replicas whose time has come."""
        for name, (w, stall) in list(self._stalls.items()):
            if self.workers.get(name) is not w:
                del self._stalls[name]   # that life is over; a restart runs at full speed
                continue
            step = stall.advance(now)
            if step is StallStep.OVER:
                self._end_stall(name, now)
            elif step is StallStep.STOP:
                if now - stall.tree_at >= _TREE_REFRESH_S:
                    w.snapshot_tree()   # children started while it ran get stopped too
                    stall.tree_at = now
                signal_tree(w.popen.pid, w.tree, signal.SIGSTOP)
            elif step is StallStep.CONT:
                signal_tree(w.popen.pid, w.tree, signal.SIGCONT)

    def _end_stall(self, name: str, now: float, why: str = "") -> None:
        """Continue the replica if a hang or slow-down holds it (a stopped process acts on
        SIGTERM only once continued), and record how long it lasted."""
        entry = self._stalls.pop(name, None)
        if entry is None:
            return
        w, stall = entry
        if self.workers.get(name) is not w:
            return
        if stall.stopped:
            signal_tree(w.popen.pid, w.tree, signal.SIGCONT)
        what = "resumed" if stall.kind is FaultKind.HANG else "resumed full speed"
        self.note(f"chaos: {name} {what} after {now - stall.since:.1f} s{why}", kind="signal")

    def _tree_memory(self, w: _Worker, limit: int) -> int:
        """Memory of the worker's process tree, each shared page once (resources.tree_pss).

        Finding the tree scans every process on the machine (psutil's ppid map), so it is
        redone at most every _TREE_REFRESH_S. The RSS sum is read at every poll; PSS <= RSS,
        so under the limit that answers. Over it, PSS decides, read afresh when the last
        exact value plus all RSS growth since (a safe estimate) is over the limit too, or
        every _PSS_REFRESH_S: a read costs a page-table walk per process.
        """
        now = time.monotonic()
        if now - w.mem_tree_at >= _TREE_REFRESH_S or not w.mem_tree:
            w.mem_tree = process_tree(w.popen.pid)
            w.mem_tree_at = now
        rss = tree_rss(w.mem_tree)
        if rss <= limit:
            return rss
        if now - w.pss_at < _PSS_REFRESH_S:
            estimate = w.pss + max(0, rss - w.pss_rss)
            if estimate <= limit:
                return estimate
        w.pss, w.pss_rss, w.pss_at = tree_pss(w.mem_tree), rss, now
        return w.pss

    def _gpus(self, replica: Replica) -> int:
        return self._programs[replica.pool].gpus_per_replica

    def _check_memory(self) -> None:
        for w in self.workers.values():
            limit = self._programs[w.replica.pool].memory_limit
            if w.cause is not None or limit is None:
                continue
            used = self._tree_memory(w, limit)
            if used > limit:
                self.note(f"{w.replica.name}: out of memory: {used / 2**20:.0f} MiB > limit "
                          f"{limit / 2**20:.0f} MiB")
                w.cause = Cause.OOM
                w.snapshot_tree()
                w.signal(signal.SIGKILL)

    # --- signals and teardown ---------------------------------------------------------

    def _install_signals(self) -> Callable[[], None]:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def on_cancel(signum: int, frame: Any) -> None:
            self._cancel_requests += 1
            if self._cancel_requests == 1:
                self.echo(f"[launcher] {signal.Signals(signum).name}: cancelling the job "
                          f"(again to kill at once)")

        old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)}
        signal.signal(signal.SIGINT, on_cancel)
        signal.signal(signal.SIGTERM, on_cancel)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        old_fd = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)

        def restore() -> None:
            signal.set_wakeup_fd(old_fd)
            for s, h in old.items():
                signal.signal(s, h)
        return restore

    def _snapshot_trees(self) -> None:
        """Record each worker's process tree for the watchdog, every _SNAPSHOT_S: if the
        launcher is SIGKILLed, the watchdog kills what it was told of, whatever became of
        that process's session or environment. A new worker is recorded at the first step
        after its start."""
        if not _PROC:
            return
        now = time.monotonic()
        for w in self.workers.values():
            if now - w.snapshot_at >= _SNAPSHOT_S:
                w.snapshot_tree()
            if self._watchdog is not None:
                self._watchdog.record(w)   # (also what other snapshots found meanwhile)

    def _sweep(self, w: _Worker) -> None:
        if self._watchdog is not None:
            self._watchdog.life_over(w)

    def _kill_everything(self) -> None:
        for w in list(self.workers.values()):
            w.snapshot_tree()
            w.signal(signal.SIGKILL)
        for name, w in list(self.workers.items()):
            try:
                w.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            w.finish(self._sweep)
            del self.workers[name]


def _process_start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def launcher_alive(record: Mapping[str, Any]) -> bool | None:
    """Whether the launcher that writes this record still runs (None: cannot tell here)."""
    info = record.get("launcher") or {}
    if info.get("host") != socket.gethostname() or not info.get("pid"):
        return None
    started = _process_start_time(int(info["pid"]))
    return started is not None and (info.get("started") is None
                                    or abs(started - float(info["started"])) < 1.0)


def _cpu_slots(env: Mapping[str, str]) -> int:
    value = env.get("RESILIENT_TRAIN_CPU_SLOTS")
    if value:
        try:
            return int(value)
        except ValueError:
            raise LaunchError(f"RESILIENT_TRAIN_CPU_SLOTS must be an integer, found {value!r}") from None
    return os.cpu_count() or 1
