"""The supervision loop: runs a job's workers and turns OS facts into state-machine events.

One monitor loop (like torch.distributed.elastic's agent) owns every worker process.
It sleeps until something can happen (a child exits, a timer, a fault is due) and never
polls faster than it must, so the launcher itself costs almost no CPU.

The loop only supervises: start the workers the job machine asks for, stop them, reap
them and hand each end to ``exits.classify_exit``, then to the job machine. Everything else
is a part with a narrow interface that the loop calls at one point of each step, ``poll``,
and asks how long it may sleep, ``wake``: the capacity lease (``capacity.py``), scheduled
chaos (``faults.py``), the memory limit (``memory.py``), the watchdog's process trees
(``processes.py``) and the job record (``jobrecord.py``, flushed after each step, then
the TensorBoard scalars, ``scalars.py``, that read it).
"""

from __future__ import annotations

import collections
import logging
import os
import random
import selectors
import signal
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..cluster import NODE_LOCAL_DIR_ENV
from ..observe.events import EventKind
from ..observe.jobdir import (
    JOB_FILE,
    failures_path,
    log_path,
    processes_path,
    report_path,
    telemetry_prefix,
)
from ..observe.scalars import JobScalars, TensorBoardMode, TensorBoardUnavailable, open_scalars
from ..observe.telemetry import read_step
from ..platform.env import tensorboard_log_dir
from ..platform.programs import PoolProgram
from ..platform.resources import detect_gpus
from ..platform.rules import Policy, Strategy
from .capacity import CapacityLease
from .chaos import ChaosSchedule, ChaosSpec, UnfiredFault
from .exits import ProcessExit, classify_exit
from .faults import NO_STEP_WARNING_S, Faults
from .job import (
    Command,
    JobConfig,
    JobMachine,
    ReleaseCapacity,
    RequestCapacity,
    StartWorker,
    StopWorkers,
)
from .jobrecord import JobRecord, job_spec, launcher_alive
from .logtail import peer_connection_error
from .machines import Machines, Placement
from .memory import MemoryLimit
from .messages import STATUS_FAULT_NOT_FIRED, STATUS_INTERNAL
from .ports import free_port
from .preload import PRELOAD_SERVER_ENV, Preloader
from .processes import ProcessTrees, Worker, kill_all, missing_program, spawn
from .quota import Capacity, LocalQuota, Request, default_quota_dir
from .workerenv import (
    LAUNCH_ID_ENV,
    JobEnv,
    Replica,
    create_output_dirs,
    gcs_credentials_problem,
    replicas_for,
    worker_env,
)

if TYPE_CHECKING:
    from ..platform.export import PlatformJob

__all__ = ["NO_STEP_WARNING_S", "LaunchError", "LaunchOptions", "Launcher", "launcher_alive"]

log = logging.getLogger(__name__)

# How often the replicas' working directories are looked at for files they wrote (one
# scandir each), so the line naming such a file comes soon after it was written.
_WRITTEN_CHECK_S = 1.0
# How often a life waiting for the fork server (--preload) to import asks again.
_PRELOAD_POLL_S = 0.1


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
    # Step time, goodput and recoveries as TensorBoard scalars in AIP_TENSORBOARD_LOG_DIR
    # (scalars.py): auto writes them when it is local and the tensorboard package is there.
    tensorboard: TensorBoardMode = TensorBoardMode.AUTO
    # What the platform would run (export.PlatformJob), recorded in job.json so that
    # `resilient-train export --from-job` writes the job as tested; None: not recorded.
    platform_job: PlatformJob | None = None
    # Modules imported once by a fork server that every `python SCRIPT` life is forked
    # from (preload.py): local iterations without each restart's imports. () : none.
    preload: tuple[str, ...] = ()

    def program(self, pool: str) -> PoolProgram:
        """What the replicas of ``pool`` run."""
        for p in self.programs:
            if p.pool == pool:
                return p
        return PoolProgram(pool, self.command, {}, self.memory_limit, self.gpus_per_worker)


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
        # A typo in the script's path is an error here, not a failure under a replica's
        # path once the job started.
        for pool, program in self._programs.items():
            missing = missing_program(program.command, Path.cwd())
            if missing is not None:
                where = "" if program.command == options.command else f"{pool}'s command: "
                raise LaunchError(where + missing)
        self._by_name = {r.name: r for r in self.replicas}
        # Absolute: the paths handed to workers (error reports, telemetry, AIP_*) must hold
        # for a worker that changes directory.
        self.job_dir = options.job_dir.resolve()
        # Validate the chaos targets before anything is created or started.
        schedule = ChaosSchedule(options.chaos, [r.name for r in self.replicas])
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
            launch_id=uuid.uuid4().hex, running=len(self.replicas), grace_s=options.grace)
        self.workers: dict[str, Worker] = {}
        self._trees: ProcessTrees | None = None   # while run() runs
        self._preloader: Preloader | None = None  # while run() runs, with --preload
        self._delayed: list[tuple[float, StartWorker]] = []
        self._rng = random.Random(options.seed)
        # The parts the loop calls at each step.
        self.record = JobRecord(
            self.job_dir, self.machine,
            job_spec(options.pools, options.listed_only, self._programs, self.env.output_base,
                     self.env.master_port, options.platform_job),
            self.replicas[0].name, self.echo, chaos=bool(options.chaos),
            unfired=self.unfired_faults, exit_status=lambda: self.exit_status)
        try:
            self.scalars: JobScalars | None = open_scalars(
                options.tensorboard, tensorboard_log_dir(self.env.output_base), self.job_dir,
                len(self.replicas))
        except TensorBoardUnavailable as exc:
            raise LaunchError(str(exc)) from None
        self.faults = Faults(schedule, self.machine, self.workers,
                             primary=self.replicas[0].name, job_dir=self.job_dir,
                             grace=options.grace, no_step_warning_s=options.no_step_warning_s,
                             note=self.note, execute=self._execute,
                             node_local=lambda name: self.machines.node_local(name))
        self.memory = MemoryLimit({pool: p.memory_limit for pool, p in self._programs.items()},
                                  self.workers, self.note, options.memory_poll_s)
        quota_dir = options.quota_dir or default_quota_dir(options.env)
        capacity = Capacity(detect_gpus(options.env), _cpu_slots(options.env))
        try:
            quota = LocalQuota(quota_dir, capacity)
        except OSError as exc:
            raise LaunchError(
                f"cannot use the quota directory {quota_dir}: {exc.strerror or exc}; set "
                "RESILIENT_TRAIN_QUOTA_DIR to a writable directory") from None
        request = Request(gpus=sum(self._gpus(r) for r in self.replicas),
                          cpu_slots=options.cpu_slots)
        self.capacity = CapacityLease(quota, request, options.job_name, self.machine,
                                      self.echo, self._execute)
        problem = gcs_credentials_problem(self.env.output_base, options.env)
        if problem is not None:
            raise LaunchError(problem)
        # Last of the checks, so that a bad option leaves no empty job directory behind.
        self._prepare_job_dir()
        try:
            self.machines = Machines(self.job_dir, self.env.launch_id,
                                     source=None if options.shared_workdir else Path.cwd(),
                                     tmp_base=options.env.get("TMPDIR"))
        except OSError as exc:
            raise LaunchError(f"{exc}; pass --shared-workdir to run every replica in it "
                              f"as it is") from None
        self._cancel_requests = 0
        self._cancel_signal = "SIGTERM"    # the signal that asked, for the line saying so
        self._cancel_announced = False
        self._written_checked = float("-inf")   # when the working directories were looked at
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)

    # --- set-up -----------------------------------------------------------------------

    @staticmethod
    def _refuse_non_directory(option: str, target: Path) -> None:
        # mkdir would say only "File exists" (or "Not a directory" for a parent).
        for path in (target, *target.parents):
            if path.is_dir():
                break
            if path.exists() or path.is_symlink():
                what = "a file, not a directory" if path.is_file() else "not a directory"
                subject = "" if path == target else f": its parent {path}"
                raise LaunchError(
                    f"{option} {target}{subject} is {what}; pass the path of a "
                    "directory (it is created if missing)")

    def _prepare_job_dir(self) -> None:
        self._refuse_non_directory("--job-dir", self.job_dir)
        if "://" not in self.env.output_base:   # created below, after the job directory
            self._refuse_non_directory("--output-dir", Path(self.env.output_base))
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
        try:
            create_output_dirs(self.env.output_base)
        except OSError as exc:
            raise LaunchError(
                f"cannot create the output directories under {self.env.output_base}: "
                f"{exc.strerror or exc}; pass --output-dir with a writable path") from None

    # --- output -----------------------------------------------------------------------

    def echo(self, line: str) -> None:
        with self._echo_lock:
            self._echo_sink(line)

    def _echo_worker(self, line: str) -> None:
        if self._echo_workers:
            self.echo(line)

    def note(self, kind: EventKind, message: str, **fields: Any) -> None:
        """Record an event of the launcher's own (a fault, a signal, a machine change, a
        warning) with its typed fields, at the current time."""
        self.machine.note(self.clock(), kind, message, **fields)

    # --- the loop ---------------------------------------------------------------------

    def run(self) -> int:
        """Run the job to a terminal state; return the launcher's exit status."""
        restore = self._install_signals()
        trees = self._trees = ProcessTrees(self.env.launch_id, processes_path(self.job_dir),
                                           self.workers)
        preloader = self._preloader = (
            Preloader(self.options.preload,
                      {**self.options.env, LAUNCH_ID_ENV: self.env.launch_id},
                      shared=self.options.env.get(PRELOAD_SERVER_ENV))
            if self.options.preload else None)
        try:
            self.record.flush(force=True)   # job.json exists from the start (QUEUED)
            self._execute(self.machine.start(self.clock()))
            while not (self.machine.state.terminal and not self.workers):
                self._step()
                self.record.flush()
                if self.scalars is not None:
                    self.scalars.poll(self.clock(), self.record)
                if self.machine.state.terminal and not self.workers:
                    break
                self._sleep()
            # A job can end before the loop runs once (a command that cannot start).
            self.record.flush()
            if self.scalars is not None:
                self.scalars.close(self.record, self.machine.end_time)
        except BaseException as exc:
            # The launcher itself failed: no worker may outlive it, and the record says why.
            log.exception("launcher failed")
            kill_all(self.workers, self._life_over)
            self.machine.launcher_failed(self.clock())
            self.record.flush()
            if self.scalars is not None:   # what was written, up to the failure
                self.scalars.close(self.record, self.machine.end_time)
            if isinstance(exc, KeyboardInterrupt):
                return STATUS_INTERNAL
            raise
        finally:
            self.capacity.release()
            trees.close()
            if preloader is not None:
                preloader.close()
            self.machines.close()
            restore()
            os.close(self._wake_r)
            os.close(self._wake_w)
        status = self.exit_status
        return 0 if status is None else status

    def unfired_faults(self) -> list[UnfiredFault]:
        """The ``--chaos`` items that never fired, with why; empty until the job is over."""
        return self.faults.unfired()

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
        """One pass of the loop: each part at its point, in this order."""
        now = self.clock()
        self._reap(now)
        if self._trees is not None:
            self._trees.poll()
        self._check_written(now)
        self._handle_cancel(now)
        self._kill_overdue(now)
        self.memory.poll(now)
        self._inject_faults(now)
        self._start_delayed(now)
        self.capacity.poll(now)
        self._execute(self.machine.tick(now))

    def _inject_faults(self, now: float) -> None:
        self.faults.poll(now)

    def _sleep(self) -> None:
        now = self.clock()
        deadlines = [t for t, _ in self._delayed]
        deadlines += [w.kill_at for w in self.workers.values() if w.kill_at is not None]
        machine_deadline = self.machine.next_deadline()
        if machine_deadline is not None:
            deadlines.append(machine_deadline)
        waits = [self._trees.wake() if self._trees is not None else 1.0]
        waits += [max(0.0, t - now) for t in deadlines]
        waits += [t for part in (self.memory, self.capacity, self.faults)
                  if (t := part.wake(now)) is not None]
        # SIGCHLD writes to the wake pipe, so a dying worker is seen at once.
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ)
        # Lives forked by the preload server are its children, not ours: their ends (and
        # its readiness) come on its socket instead of as a SIGCHLD.
        if self._preloader is not None:
            self._preloader.drain()
            if (fd := self._preloader.fileno()) is not None:
                sel.register(fd, selectors.EVENT_READ)
        try:
            if sel.select(min(waits)):
                try:
                    while os.read(self._wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
        finally:
            sel.close()

    def _check_written(self, now: float) -> None:
        if now - self._written_checked >= _WRITTEN_CHECK_S:
            self._written_checked = now
            for name in self.workers:
                self._note_written(name)

    def cancel_note(self) -> str | None:
        """What cancelled the job, for the launcher's last lines; None: no signal did. A
        worker reports the SIGTERM it got ("SIGTERM: emergency checkpoint ..."), which
        after a Ctrl-C reads as if something else had stopped it."""
        if not self._cancel_requests:
            return None
        passed = "SIGTERM, then SIGKILL at the second" if self._cancel_requests > 1 \
            else "SIGTERM"
        return (f"the job was cancelled by {_cancel_cause(self._cancel_signal)}, which the "
                f"launcher passed to its workers as {passed}: a worker's line that says "
                f"SIGTERM is this")

    def _handle_cancel(self, now: float) -> None:
        if self._cancel_requests:
            if not self._cancel_announced:
                self._cancel_announced = True
                self.echo(f"[launcher] {_cancel_cause(self._cancel_signal)}: cancelling the "
                          f"job: each worker gets SIGTERM, as on the platform (again to kill "
                          f"at once)")
            self._execute(self.machine.cancel(now))
            if self._cancel_requests > 1:
                for w in self.workers.values():
                    w.signal(signal.SIGKILL)

    def _kill_overdue(self, now: float) -> None:
        """SIGKILL the workers whose grace period after a SIGTERM is over."""
        for w in list(self.workers.values()):
            if w.kill_at is not None and now >= w.kill_at:
                self.note(EventKind.SIGNAL, f"{w.replica.name}: grace period over, SIGKILL",
                          replica=w.replica.name)
                w.kill_at = None
                w.signal(signal.SIGKILL)

    def _start_delayed(self, now: float) -> None:
        due = [cmd for t, cmd in self._delayed if t <= now]
        self._delayed = [(t, cmd) for t, cmd in self._delayed if t > now]
        for cmd in due:
            self._start_worker(cmd)

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
                queue.extend(self.capacity.ask(self.clock()))
            elif isinstance(cmd, ReleaseCapacity):
                self.capacity.release()

    def _gpus(self, replica: Replica) -> int:
        return self._programs[replica.pool].gpus_per_replica

    def _start_worker(self, cmd: StartWorker, *, execute: bool = True) -> list[Command]:
        if not self.machine.is_current(cmd):
            return []
        replica = self._by_name[cmd.replica]
        o = self.options
        program = self._programs[replica.pool]
        # Each replica's GPUs follow those of the replicas before it, in rank order.
        first = sum(self._gpus(r) for r in self.replicas[:self.replicas.index(replica)])
        gpu_ids = self.capacity.gpu_ids(first, program.gpus_per_replica)
        report = report_path(self.job_dir, cmd.attempt, replica.name, cmd.restart)

        def env_for(placement: Placement | None) -> dict[str, str]:
            return worker_env(
                self.env, replica, attempt=cmd.attempt, restart=cmd.restart,
                error_file=str(report), gpu_ids=gpu_ids, base={**o.env, **program.env},
                placement=placement, failures_file=str(failures_path(self.job_dir)),
                telemetry=str(telemetry_prefix(self.job_dir, cmd.attempt, replica.name,
                                               cmd.restart)))

        # --preload: the life waits, before anything of it is done, while the fork server
        # imports; the loop goes on meanwhile (a timeout, a cancel, other ends).
        if self._preloader is not None and self._preloader.warming(program.command,
                                                                   env_for(None)):
            self._delayed.append((self.clock() + _PRELOAD_POLL_S, cmd))
            return []
        report.parent.mkdir(parents=True, exist_ok=True)
        report.unlink(missing_ok=True)
        placement = self.machines.prepare(replica.name, new_vm=cmd.new_vm)
        if placement.wiped or placement.kept:
            where = "a new VM" if cmd.new_vm else "the same VM, a new container"
            self.note(EventKind.MACHINE, f"{replica.name}: restarted on {where}: "
                      + "; ".join([*(f"{w} wiped" for w in placement.wiped),
                                   *(f"{k} kept" for k in placement.kept)]),
                      replica=replica.name)
        env = env_for(placement)
        logfile = log_path(self.job_dir, cmd.attempt, replica.name)
        logfile.parent.mkdir(parents=True, exist_ok=True)
        out = open(logfile, "ab")
        out.write(f"===== {replica.name} attempt {cmd.attempt} restart {cmd.restart} "
                  f"at {time.strftime('%Y-%m-%dT%H:%M:%S')} =====\n".encode())
        now = self.clock()
        try:
            popen = spawn(program.command, env, placement.workdir, self._preloader)
        except (FileNotFoundError, PermissionError, NotADirectoryError) as exc:
            # As on the platform: a command that cannot start is exit 128, StartError.
            msg = f"cannot start {program.command[0]!r}: {exc.strerror or exc}"
            out.write((msg + "\n").encode())
            out.close()
            self.echo(f"[{replica.name}] {msg}")
            failed = ProcessExit(replica.name, now, None, start_error=msg)
        except OSError as exc:
            out.close()
            self.echo(f"[launcher] cannot create a process for {replica.name}: {exc}")
            failed = ProcessExit(replica.name, now, None, spawn_error=str(exc))
        else:
            self.workers[replica.name] = Worker(replica, popen, cmd.attempt, cmd.restart, out,
                                                report, self._echo_worker)
            failed = None
        cmds = self.machine.worker_started(replica.name, now)
        if failed is not None:
            cmds += self._exited(failed, excerpt=failed.start_error)
        if execute:
            self._execute(cmds)
            return []
        return cmds

    def _stop(self, names: Sequence[str], grace: float) -> None:
        now = self.clock()
        for name in names:
            w = self.workers.get(name)
            if w is None:
                continue
            w.snapshot_tree()
            self.faults.end_stall(name, now, " to deliver the SIGTERM of a stop")
            w.terminate()
            deadline = now + grace
            w.kill_at = deadline if w.kill_at is None else min(w.kill_at, deadline)

    # --- ends -------------------------------------------------------------------------

    def _reap(self, now: float) -> None:
        ended = [(name, w, rc) for name, w in list(self.workers.items())
                 if (rc := w.popen.poll()) is not None]
        # Deaths by a signal first (faults, kills from outside, crashes): when a killed peer
        # and the survivor whose collective failed on it are reaped together, the loss is
        # the cause and is on record before the survivor's exit is judged.
        ended.sort(key=lambda item: not (item[1].injected is not None or item[2] < 0))
        for name, w, rc in ended:
            del self.workers[name]
            excerpt = w.finish(self._life_over)   # (signals what is left of the tree)
            self._note_written(name)
            step = read_step(telemetry_prefix(self.job_dir, w.attempt, name, w.restart))
            # w.tail is complete: finish() waited for the log reader.
            self._execute(self._exited(w.exit(rc, now, step), excerpt, w.tail))

    def _exited(self, ended: ProcessExit, excerpt: str | None,
                tail: Sequence[str] = ()) -> list[Command]:
        """The one path from a worker's end to the job machine: classify it, say what the
        launcher observed (a kill from outside, the kernel's OOM killer), pass it on."""
        verdict = classify_exit(ended)
        if verdict.observed is not None:
            self.note(EventKind.FAULT, f"{ended.replica}: {verdict.observed}",
                      replica=ended.replica, cause=verdict.cause.value,
                      fault=verdict.fault, injected=False,
                      step=ended.step, counts_as_failure=True)
        connection_error = peer_connection_error(tail) if verdict.exit_code else None
        return self.machine.worker_exited(ended.replica, verdict.exit_code, verdict.cause,
                                          ended.time, excerpt=excerpt,
                                          connection_error=connection_error, step=ended.step)

    def _note_written(self, name: str) -> None:
        """Say, once per file, what a replica wrote to its working directory: on the
        platform that is its container's own disk."""
        for entry in self.machines.written(name):
            self.note(EventKind.MACHINE,
                      f"{name} wrote {entry} in its working directory: on the platform that "
                      f"is its container's own disk, which the other replicas do not see and "
                      f"a restart wipes; write what must last under AIP_CHECKPOINT_DIR "
                      f"(shared), or {NODE_LOCAL_DIR_ENV} (its VM's disk, kept by a restart "
                      f"in place)", replica=name)

    def _life_over(self, w: Worker) -> None:
        if self._trees is not None:
            self._trees.life_over(w)

    # --- signals ----------------------------------------------------------------------


    def _install_signals(self) -> Callable[[], None]:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def on_cancel(signum: int, frame: Any) -> None:
            # Counts only: the handler runs in the main thread between two bytecodes, maybe
            # inside echo() holding its lock (a deadlock) or inside a write to stdout (a
            # reentrant-call error). The loop, woken by the wakeup descriptor, says it.
            self._cancel_signal = signal.Signals(signum).name
            self._cancel_requests += 1

        # SIGHUP: the terminal closed (an ssh session dropped). Without it the launcher
        # died at once, its workers with it and no emergency save, the record RUNNING.
        cancels = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        old = {s: signal.getsignal(s) for s in (*cancels, signal.SIGCHLD)}
        for s in cancels:
            signal.signal(s, on_cancel)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        old_fd = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)

        def restore() -> None:
            signal.set_wakeup_fd(old_fd)
            for s, h in old.items():
                signal.signal(s, h)
        return restore



# The signals that cancel a job, said as what the user did.
_CANCEL_CAUSES = {"SIGINT": "your interrupt (SIGINT)", "SIGTERM": "a SIGTERM to the launcher",
                  "SIGHUP": "the terminal closing (SIGHUP)"}


def _cancel_cause(signal_name: str) -> str:
    return _CANCEL_CAUSES.get(signal_name, signal_name)


def _cpu_slots(env: Mapping[str, str]) -> int:
    value = env.get("RESILIENT_TRAIN_CPU_SLOTS")
    if value:
        try:
            return int(value)
        except ValueError:
            raise LaunchError(f"RESILIENT_TRAIN_CPU_SLOTS must be an integer, found "
                              f"{value!r}") from None
    return os.cpu_count() or 1

