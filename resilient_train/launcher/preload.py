"""``launch --preload torch,...``: worker lives forked from a process that has imported
those modules once (``forkserver.py``), instead of each a new interpreter importing them.

Why: a restart under the local launcher costs the new process its imports, 2-5 CPU-seconds
for torch and the ``torch._dynamo`` that an optimizer's first use imports, most of a short
life's cost on a laptop's cores. With the modules preloaded a restart costs a fork. What a
life sees is what ``python SCRIPT`` would give it (forkserver.py says how); it differs
where start-up itself is what is tested: the interpreter's options, environment variables
read while the preloaded modules were imported, ``/proc/PID/cmdline`` and ``environ``.
So a life is forked only when its command is ``PYTHON SCRIPT ARGS`` with the server's
interpreter and no options, and its environment agrees with the server's on every variable
that is read at start-up (:func:`read_at_start`); any other is started as a new process.
The platform always starts a new process: this is for fast local iterations.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import select
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

__all__ = ["PRELOAD_ENV", "PRELOAD_SERVER_ENV", "PYTHON_PROGRAM", "Forked", "Preloader",
           "read_at_start"]

log = logging.getLogger(__name__)

# The modules to preload when `launch` is not given --preload (comma-separated).
PRELOAD_ENV = "RESILIENT_TRAIN_PRELOAD"
# A running server's socket (forkserver.py --listen PATH) for launches to share: its lives
# are forked there when it fits (same interpreter, its modules, the same start-up
# environment); otherwise a launch starts a server of its own.
PRELOAD_SERVER_ENV = "RESILIENT_TRAIN_PRELOAD_SERVER"
_SERVER = Path(__file__).with_name("forkserver.py")
READY_TIMEOUT_S = 120.0      # the imports, on loaded cores
# ``python``, ``python3``, ``python3.11``: a program that runs a Python script (the
# launcher's check for a missing script reads commands by it too).
PYTHON_PROGRAM = re.compile(r"python(?:[0-9]+(?:\.[0-9]+)?)?")
# Environment variables read as an interpreter starts, or as torch and its libraries load
# (OpenMP's and MKL's thread counts, the allocator, locale, library paths).
_AT_START = re.compile(r"(PYTHON|LD_|OMP_|GOMP_|KMP_|MKL_|MALLOC_|TORCH_|PYTORCH_|LC_)"
                       r"|LANG$|LANGUAGE$|GLIBC_TUNABLES$|PATH$|HOME$")


def read_at_start(env: Mapping[str, str]) -> dict[str, str]:
    """The part of ``env`` that is read as a process starts: a life is forked only when
    its own agrees with the server's."""
    return {k: v for k, v in env.items() if _AT_START.match(k)}


class Forked:
    """A life the server forked, with what the launcher uses of a ``Popen``."""

    def __init__(self, server: Preloader, pid: int, stdout: IO[bytes] | None) -> None:
        self._server = server
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, timeout=0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, timeout=timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
        return self.returncode


class Preloader:
    """The launcher's side of one fork server, started at the first life it can fork.

    If the server cannot import the modules, or dies, the launcher says so once and
    starts every later life as a new process."""

    def __init__(self, modules: Sequence[str], common_env: Mapping[str, str],
                 shared: str | None = None) -> None:
        """``shared``: the socket of a running server to use when it fits
        (:data:`PRELOAD_SERVER_ENV`)."""
        self.modules = tuple(modules)
        self._shared = shared or None   # a shared server's socket, until it does not fit
        self._started = False
        self._first_env: Mapping[str, str] = {}
        # What every life's environment has (the launcher's, and the launch id): a forked
        # life's /proc/PID/environ is the server's, where the watchdog's sweep at the
        # launcher's end, or a person, looks for it.
        self._common_env = dict(common_env)
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._program: str | None = None
        self._at_start: dict[str, str] = {}
        self._errors: IO[bytes] | None = None
        self._started_at = 0.0
        self._ready = False
        self._failed = False
        self._buffer = b""
        self._exits: dict[int, int] = {}
        self._ids = 0
        self._lock = threading.Lock()

    # --- which lives -------------------------------------------------------------------

    def can_fork(self, command: Sequence[str], env: Mapping[str, str]) -> bool:
        """``PYTHON SCRIPT ARGS`` (no interpreter options), with the server's interpreter
        and start-up environment once it runs."""
        if self._failed or len(command) < 2 or command[1].startswith("-"):
            return False
        if not PYTHON_PROGRAM.fullmatch(os.path.basename(command[0])):
            return False
        if not self._started:
            return True
        return command[0] == self._program and read_at_start(env) == self._at_start

    def warming(self, command: Sequence[str], env: Mapping[str, str]) -> bool:
        """Whether ``command``'s life should wait for the server, which is importing the
        modules: True while it does (started here at the first life it can fork). The
        launcher's loop goes on meanwhile (a timeout, a cancel, other workers' ends) and
        asks again; False once the server is ready, or failed, or for a life it will not
        fork."""
        with self._lock:
            if not self.can_fork(command, env):
                return False
            if not self._started and not self._start(command[0], env):
                return False
            if not self._ready:
                self._next(lambda m: "ready" in m, 0.0)
            if self._ready or self._sock is None:
                return False
            if time.monotonic() - self._started_at < READY_TIMEOUT_S:
                return True
            self._fail(f"the fork server did not import {', '.join(self.modules)} within "
                       f"{READY_TIMEOUT_S:.0f} s")
            return False

    def fileno(self) -> int | None:
        """What to wait on for the server's news (ready, a life's exit); None without one."""
        return None if self._sock is None else self._sock.fileno()

    def drain(self) -> None:
        """Take in what the server said, without waiting (before waiting on :meth:`fileno`)."""
        with self._lock:
            self._next(lambda m: False, 0.0)

    # --- starting ----------------------------------------------------------------------

    def spawn(self, command: Sequence[str], env: Mapping[str, str], cwd: Path | None,
              output: tuple[int, int] | None = None) -> Forked | None:
        """Fork ``command``'s life (after :meth:`can_fork`; waiting for the server unless
        :meth:`warming` did); None when the server cannot (it failed: said once), for the
        caller to start a new process instead. Raises the OSError a ``Popen`` would for a
        working directory that is not there. Its stdout and stderr: one pipe
        (``Forked.stdout``), or the two fds of ``output``."""
        with self._lock:
            if not self._started and not self._start(command[0], env):
                return None
            if not self._ready:
                self._next(lambda m: "ready" in m, READY_TIMEOUT_S)
            if not self._ready:
                self._fail("the fork server did not start")
                return None
            read_fd, write_fd = os.pipe() if output is None else (-1, -1)
            self._ids += 1
            # The launcher's priority, as a new process would inherit it (a shared
            # server's is its own starter's).
            request = {"id": self._ids, "argv": list(command), "env": dict(env),
                       "cwd": None if cwd is None else str(cwd),
                       "fds": 1 if output is None else 2,
                       "nice": os.getpriority(os.PRIO_PROCESS, 0)}
            try:
                socket.send_fds(self._sock, [(json.dumps(request) + "\n").encode()],
                                [write_fd] if output is None else list(output))
                reply = self._next(lambda m: m.get("id") == request["id"], READY_TIMEOUT_S)
            except OSError as exc:
                reply = None
                self._fail(f"the fork server's socket failed: {exc}")
            finally:
                if output is None:
                    os.close(write_fd)
            if reply is None or "pid" not in reply:
                if output is None:
                    os.close(read_fd)
                if reply is not None and "errno" in reply:
                    raise OSError(reply["errno"], reply["error"], reply.get("filename"))
                if reply is None:
                    self._fail("the fork server did not answer")
                return None
            return Forked(self, int(reply["pid"]),
                          io.open(read_fd, "rb") if output is None else None)

    def _start(self, program: str, env: Mapping[str, str]) -> bool:
        self._started = True
        self._program, self._first_env = program, dict(env)
        if self._shared is not None:
            try:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(5.0)
                sock.connect(self._shared)
                sock.settimeout(None)
            except OSError as exc:
                sock.close()
                log.info("no preload server at %s (%s): starting one for this launch",
                         self._shared, exc)
                self._shared = None
            else:
                self._sock = sock
                self._at_start = read_at_start(env)
                self._started_at = time.monotonic()
                return True
        return self._start_own(program, env)

    def _start_own(self, program: str, env: Mapping[str, str]) -> bool:
        ours, theirs = socket.socketpair()
        server_env = {**self._common_env, **read_at_start(env)}
        # A file, not a pipe that nobody reads while the server runs: what it says if it
        # fails to start (a crash in an import), read then.
        self._errors = tempfile.TemporaryFile()
        try:
            self._proc = subprocess.Popen(
                [program, str(_SERVER), str(theirs.fileno()), *self.modules],
                env=server_env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=self._errors, pass_fds=(theirs.fileno(),), start_new_session=True)
        except OSError as exc:
            ours.close()
            self._fail(f"cannot start the fork server: {exc}")
            return False
        finally:
            theirs.close()
        self._sock, self._program = ours, program
        self._at_start = read_at_start(server_env)
        self._started_at = time.monotonic()
        return True

    def _hello(self, hello: dict) -> None:
        """The server's first word: ready, or why not."""
        if self._shared is not None:
            self._join(hello)
            return
        if hello["ready"]:
            self._ready = True
            log.info("preloaded %s in %.1f s: worker lives are forked from it",
                     ", ".join(self.modules), time.monotonic() - self._started_at)
            return
        why = hello.get("error") or self._stderr() or "no reason given"
        self._fail(f"cannot preload {', '.join(self.modules)}: {why}")

    def _join(self, hello: dict) -> None:
        """A shared server's first word: its lives are forked there if it fits this
        launch, else this launch starts a server of its own."""
        why = self.misfit(hello)
        if why is None:
            self._ready = True
            log.info("worker lives are forked from the preload server at %s", self._shared)
            return
        log.info("the preload server at %s does not fit this launch (%s): starting one for "
                 "it", self._shared, why)
        assert self._sock is not None
        self._sock.close()
        self._sock, self._shared, self._buffer = None, None, b""
        self._start_own(self._program or "", self._first_env)

    def misfit(self, hello: dict) -> str | None:
        """Why a shared server's lives would not be what this launch's would; None if
        they would."""
        if not hello.get("ready"):
            return f"it could not import its modules: {hello.get('error')}"
        missing = [m for m in self.modules if m not in hello.get("modules", ())]
        if missing:
            return f"it has not imported {', '.join(missing)}"
        if hello.get("program") != self._program:
            return f"it runs {hello.get('program')}, not {self._program}"
        theirs = read_at_start(hello.get("env", {}))
        if theirs != self._at_start:
            differ = sorted(k for k in {*theirs, *self._at_start}
                            if theirs.get(k) != self._at_start.get(k))
            return f"its start-up environment differs in {', '.join(differ)}"
        return None

    # --- exits -------------------------------------------------------------------------

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        """``pid``'s exit status once the server reaped it; None if not within ``timeout``
        seconds (None: no limit). If the server is gone, its lives went with it (their
        PR_SET_PDEATHSIG): SIGKILL."""
        with self._lock:
            if pid not in self._exits:
                self._next(lambda m: m.get("exit") == pid, timeout)
            if pid not in self._exits and self._sock is None:
                return -9
            return self._exits.pop(pid, None)

    def _next(self, wanted: object, timeout: float | None) -> dict | None:
        """Read messages until one that ``wanted(message)``, recording exits on the way;
        None at the timeout, or when the server is gone."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            while b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                message = json.loads(line)
                if "exit" in message:
                    self._exits[int(message["exit"])] = int(message["code"])
                if "ready" in message:
                    sock = self._sock
                    self._hello(message)
                    if self._sock is not sock:   # a server of its own instead: its word next
                        continue
                if wanted(message):   # type: ignore[operator]
                    return message
            if self._sock is None:   # gone, or a greeting that said it failed
                return None
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._sock], [], [], left)
            if not ready:
                return None
            data = self._sock.recv(65536)
            if not data and self._shared is not None and not self._ready:
                self._join({"ready": False, "error": "it closed the connection"})
                continue
            if not data:
                stderr = self._stderr()
                self._fail("the fork server exited" + (f": {stderr}" if stderr else ""))
                return None
            self._buffer += data

    def _stderr(self) -> str:
        if self._errors is None:
            return ""
        self._errors.seek(0)
        return self._errors.read().decode(errors="replace").strip()[-500:]

    def _fail(self, why: str) -> None:
        if not self._failed:
            log.warning("%s; worker lives start as new processes from now on", why)
        self._failed = True
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        """End the server (its lives, all ended by now, would die with it)."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            if self._proc is not None:
                try:
                    self._proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
                self._proc = None
            if self._errors is not None:
                self._errors.close()
                self._errors = None

