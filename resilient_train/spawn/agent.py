"""``resilient-train spawn``: a replica's training processes, one per GPU, without torchrun's
agent.

On a multi-GPU machine each replica runs several processes. torchrun starts them, but its
agents also meet each other (its static rendezvous: the first machine's agent hosts a store
and waits until every machine's agent has joined it). When the first machine alone is
restarted (a maintenance move, a node loss), its new agent waits for agents that never
come again: the others joined once and now only watch their processes. The job hangs
until torchrun's rendezvous timeout, then fails; and torchrun exits 1 where its process
exited 134, which hides from the platform what it needs to decide a restart.

``spawn`` gives each process torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``), computed from the replica's own (the platform's ``CLUSTER_SPEC``, or
``RANK`` and ``WORLD_SIZE``), and leaves the meeting to the processes: under ``@rt.main``
the group re-forms whichever machine restarts. It supervises as torchrun does with no
restarts of its own: SIGTERM and SIGINT are passed on (the platform signals the
container's first process only); when a process fails, the others get SIGTERM, and SIGKILL
after ``stop_grace_s``; and ``spawn`` exits with the first failed process's status (128 +
N for a signal N), so a 134 reaches the platform as a 134.

Output: each process's stdout and stderr go to spawn's own through a relay that writes
whole lines (linerelay.py): the processes share the replica's output.

Error reports: where the replica has one (``TORCHELASTIC_ERROR_FILE``, which the platform's
containers and the launcher read for a failure's reason), each process writes its own, and
the first failed process's becomes the replica's, as torchrun's agent does.

No torch import: it runs first on every (re)started machine.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..cluster import NON_TRAINING_RANK, ClusterInfo, ClusterSpecError
from ..errors import ERROR_FILE_ENV, exit_code_for
from .linerelay import LineRelay

log = logging.getLogger(__name__)

# How long spawn waits, once every process has exited, for the rest of their output: a
# grandchild that kept a pipe open may hold it for good.
RELAY_DRAIN_S = 5.0
# torchrun's agent's store: not there for a process started here.
_AGENT_ONLY = ("TORCHELASTIC_USE_AGENT_STORE",)


class SpawnError(ValueError):
    """``spawn`` cannot start this replica's processes: the message says why and the fix."""


@dataclass(frozen=True)
class SpawnOptions:
    nproc: int                   # processes on this machine
    stop_grace_s: float = 30.0   # after one failed: SIGTERM to the rest, SIGKILL this late


def count_gpus(dev: Path = Path("/dev")) -> int:
    """GPUs this machine shows: ``CUDA_VISIBLE_DEVICES``'s entries where it is set, else
    NVIDIA's device files (no CUDA initialised, no torch imported)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return sum(1 for p in dev.glob("nvidia*") if p.name[6:].isdigit())


def parse_nproc(text: str, gpus: int | None = None) -> int:
    """``--nproc-per-node``: a number, ``gpu`` (one per GPU, at least one GPU) or ``auto``
    (one per GPU, else 1)."""
    if text in ("gpu", "auto"):
        n = count_gpus() if gpus is None else gpus
        if n == 0 and text == "gpu":
            raise SpawnError("--nproc-per-node gpu: this machine shows no GPU "
                             "(CUDA_VISIBLE_DEVICES, /dev/nvidia*); give a number instead")
        return max(1, n)
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise SpawnError(f"--nproc-per-node {text!r}: expected a positive number, 'gpu' "
                         "or 'auto'")
    return n


def process_envs(env: Mapping[str, str], nproc: int,
                 reports: Sequence[Path] = ()) -> list[dict[str, str]]:
    """The environment of each of this replica's ``nproc`` processes, from the replica's
    own: ranks ``group_rank * nproc + i`` of ``replicas * nproc``; process i's error report
    goes to ``reports[i]`` where given."""
    try:
        info = ClusterInfo.from_env(env)
    except ClusterSpecError as exc:
        raise SpawnError(f"spawn cannot tell this replica's place in the job: {exc}") from None
    if info.local_world_size > 1:
        raise SpawnError(
            f"spawn runs once per machine, and this process is already one of "
            f"LOCAL_WORLD_SIZE={info.local_world_size} (under torchrun, or a second spawn): "
            "run spawn as the replica's command instead of torchrun")
    if info.rank == NON_TRAINING_RANK:
        raise SpawnError(
            f"{info.replica_name} is not a training replica (a reduction server or an "
            "evaluator): run its program directly, not under spawn")
    # One process per replica here: the replica's rank and the replicas' count.
    node, nodes = info.group_rank, info.world_size
    base = {k: v for k, v in env.items() if k not in _AGENT_ONLY}
    if nproc > 1:
        # As torchrun: N processes each starting a thread per core would thrash.
        base.setdefault("OMP_NUM_THREADS", "1")
    return [{**base,
             "RANK": str(node * nproc + i), "LOCAL_RANK": str(i),
             "WORLD_SIZE": str(nodes * nproc), "LOCAL_WORLD_SIZE": str(nproc),
             "GROUP_RANK": str(node), "GROUP_WORLD_SIZE": str(nodes),
             "ROLE_RANK": str(node * nproc + i), "ROLE_WORLD_SIZE": str(nodes * nproc),
             "MASTER_ADDR": info.master_addr, "MASTER_PORT": str(info.master_port),
             **({ERROR_FILE_ENV: str(reports[i])} if reports else {})}
            for i in range(nproc)]


class Supervisor:
    """Starts the processes and waits for them; see the module's docstring."""

    def __init__(self, command: Sequence[str], envs: Sequence[Mapping[str, str]],
                 options: SpawnOptions, report: str | None = None) -> None:
        self.command = list(command)
        self.envs = envs
        self.options = options
        self.report = report   # the replica's error report: the first failed process's
        self.running: dict[int, int] = {}   # pid -> local rank
        # Kept: a Popen dropped while its process runs is polled, and maybe reaped, by
        # the next Popen's clean-up, and its exit would never reach the wait here.
        self._procs: list[subprocess.Popen[bytes]] = []
        # Re-entrant: the signal handler takes it in the thread that may hold it.
        self._lock = threading.RLock()
        self._killer: threading.Timer | None = None
        # The SIGTERM or SIGINT passed on, if one was: the rest stop anyway.
        self._signalled: int | None = None
        self._relays: list[LineRelay] = []
        # Our output as bytes (not so where a caller replaced sys.stdout: then inherited).
        self._relaying = all(hasattr(f, "buffer") for f in (sys.stdout, sys.stderr))
        self._out_lock = threading.Lock()   # stdout and stderr may be one pipe

    def run(self) -> int:
        """Every process's end; the first failure's status, or 0 when all succeeded."""
        old = {sig: signal.signal(sig, self._forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            for i, env in enumerate(self.envs):
                pipe = subprocess.PIPE if self._relaying else None
                try:
                    proc = subprocess.Popen(self.command, env=self._env(env),
                                            stdout=pipe, stderr=pipe)
                except OSError as exc:
                    self._signal(signal.SIGKILL)   # those started: nothing to save yet
                    self._wait()
                    raise SpawnError(f"cannot run {self.command[0]!r}: {exc.strerror or exc}; "
                                     "check the command after --") from None
                self._procs.append(proc)
                self.running[proc.pid] = i
                if self._relaying:
                    self._relay(proc, i)
            if self._signalled is not None:   # a signal came while they were starting
                self._signal(self._signalled)
            ranks = f"{self.envs[0]['RANK']}-{self.envs[-1]['RANK']}"
            log.info("started %d processes: ranks %s of %s", len(self.envs), ranks,
                     self.envs[0]["WORLD_SIZE"])
            return self._wait()
        finally:
            # What the processes wrote last, before we exit: one deadline for all of them.
            drained_by = time.monotonic() + RELAY_DRAIN_S
            for relay in self._relays:
                relay.join(max(0.0, drained_by - time.monotonic()))
            for sig, handler in old.items():
                signal.signal(sig, handler)
            if self._killer is not None:
                self._killer.cancel()

    def _env(self, env: Mapping[str, str]) -> dict[str, str]:
        out = dict(env)
        if self._relaying:   # each line as it is printed: the relay keeps lines whole
            out.setdefault("PYTHONUNBUFFERED", "1")
        return out

    def _relay(self, proc: subprocess.Popen[bytes], local: int) -> None:
        """The process's stdout and stderr to ours, line by line (linerelay.py): the
        processes of a replica share its output, and would otherwise mix mid-line."""
        for pipe, out, name in ((proc.stdout, sys.stdout, "stdout"),
                                (proc.stderr, sys.stderr, "stderr")):
            assert pipe is not None
            fd = os.dup(pipe.fileno())   # the relay's own: Popen closes its file objects
            pipe.close()
            self._relays.append(LineRelay(fd, out.buffer, self._out_lock,
                                          f"rt-spawn-{name}-{local}"))

    def _wait(self) -> int:
        failed: int | None = None
        while self.running:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:   # reaped elsewhere: nothing left to wait for
                break
            with self._lock:
                local = self.running.pop(pid, None)
            if local is None:
                continue
            code = exit_code_for(os.waitstatus_to_exitcode(status))
            if code == 0:
                log.info("local process %d exited 0", local)
                continue
            if failed is None:
                failed = code
                self._hand_up_report(local)
                if self.running and self._signalled is None:
                    log.warning("local process %d exited %d: stopping the other %d (SIGTERM, "
                                "SIGKILL after %g s)", local, code, len(self.running),
                                self.options.stop_grace_s)
                    self._stop_rest()
                else:
                    log.warning("local process %d exited %d", local, code)
            else:
                log.info("local process %d exited %d", local, code)
        return failed or 0

    def _hand_up_report(self, local: int) -> None:
        """The failed process's error report becomes the replica's (first error wins)."""
        theirs = self.envs[local].get(ERROR_FILE_ENV)
        if not self.report or not theirs or not os.path.exists(theirs):
            return   # none written: killed, say; the exit status says what is known
        tmp = f"{self.report}.spawn.tmp"
        try:
            shutil.copyfile(theirs, tmp)
            os.replace(tmp, self.report)   # a reader sees no report or the whole one
        except OSError as exc:
            log.warning("could not pass on local process %d's error report: %s", local, exc)

    def _stop_rest(self) -> None:
        self._signal(signal.SIGTERM)
        self._killer = threading.Timer(self.options.stop_grace_s, self._signal,
                                       args=(signal.SIGKILL,))
        self._killer.daemon = True
        self._killer.start()

    def _forward(self, signum: int, frame: object) -> None:
        log.info("%s: passing it on to %d processes", signal.Signals(signum).name,
                 len(self.running))
        self._signalled = signum
        self._signal(signum)

    def _signal(self, sig: int) -> None:
        with self._lock:
            pids = list(self.running)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:   # exited, not yet reaped
                pass


def spawn(command: Sequence[str], options: SpawnOptions,
          env: Mapping[str, str] | None = None) -> int:
    """Run ``command`` as this replica's ``options.nproc`` processes; their exit status."""
    if not command:
        raise SpawnError("spawn needs a command, e.g. resilient-train spawn "
                         "--nproc-per-node 8 -- python train.py")
    env = os.environ if env is None else env
    report = env.get(ERROR_FILE_ENV) or None
    with tempfile.TemporaryDirectory(prefix="rt-spawn-") as tmp:
        reports = [Path(tmp) / f"local{i}.json" for i in range(options.nproc)] if report else []
        envs = process_envs(env, options.nproc, reports)
        return Supervisor(command, envs, options, report).run()
