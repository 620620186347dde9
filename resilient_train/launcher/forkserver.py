"""The preload fork server: a process that imports some modules once, then forks each
worker life from itself, so that a restart does not pay those imports again.

    PYTHON .../launcher/forkserver.py FD MODULE [MODULE ...]

Run by path, not ``-m``: nothing of resilient_train is imported here, so each life imports
the library afresh, as a new process would. It imports the modules, says ``ready`` (or why
not), then serves the launcher's requests (``preload.py``) on the socket at FD, one JSON
line each with the fd of the life's output pipe (SCM_RIGHTS), and answers each with the
new process's pid or the error that stopped it.
It reaps its children and sends each one's exit status (as ``Popen.returncode``). It dies
with the launcher (PR_SET_PDEATHSIG), and its children die with it.

A forked life turns itself into ``python SCRIPT ARGS``: a session of its own, its own
environment, working directory, ``sys.argv`` and ``sys.path[0]``, stdin from /dev/null,
output to the pipe, the script run as ``__main__``, and the interpreter's exit as the
script's (``atexit``, an uncaught exception's traceback and exit 1, ``sys.exit``'s status).
Python's ``random`` reseeds itself after a fork; NumPy's global generator, where a
preloaded module imported it, is reseeded here, as a new process would seed it.
Linux only (prctl); stdlib only.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import select
import signal
import socket
import sys
import threading
import traceback
from typing import Any

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl() -> Any:
    return ctypes.CDLL(None, use_errno=True).prctl


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall((json.dumps(message) + "\n").encode())


class _Lines:
    """JSON lines from the launcher, each with the fds that came with it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.fds: list[int] = []

    def read(self) -> list[tuple[dict[str, Any], list[int]]] | None:
        """What arrived; None at EOF (the launcher closed its end, or died)."""
        data, fds, _, _ = socket.recv_fds(self.sock, 65536, 4)
        if not data:
            return None
        self.buffer += data
        self.fds += fds
        out = []
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            request = json.loads(line)
            n = int(request.get("fds", 0))
            out.append((request, self.fds[:n]))
            self.fds = self.fds[n:]
        return out


def _serve(sock: socket.socket, wake_r: int) -> dict[str, Any] | None:
    """Fork a life per request, report exits. In a forked life: its request (with the
    output fd as ``out_fd``). In the server: None, once the launcher has gone."""
    lines = _Lines(sock)
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 512)
        while True:   # every child that ended, at once
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        if sock not in ready:
            continue
        requests = lines.read()
        if requests is None:
            return None
        for request, fds in requests:
            life = _fork(sock, request, fds)
            if life is not None:
                return life


def _fork(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> dict[str, Any] | None:
    """Fork the request's life; answer with its pid, or the error that stopped it."""
    try:
        cwd = request.get("cwd")
        if cwd is not None and not os.path.isdir(cwd):
            # As Popen raises it: the launcher treats it as a start error.
            raise FileNotFoundError(2, os.strerror(2), cwd)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        _send(sock, {"id": request["id"], "errno": exc.errno, "error": exc.strerror or str(exc),
                     "filename": getattr(exc, "filename", None)})
        return None
    if pid == 0:
        return {**request, "out_fd": fds[0]}
    for fd in fds:
        os.close(fd)
    _send(sock, {"id": request["id"], "pid": pid})
    return None


def _become(life: dict[str, Any], server_pid: int, close: list[int]) -> str:
    """In the forked life: turn this process into ``python SCRIPT ARGS``'s; the script."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in close:
        os.close(fd)
    os.setsid()
    prctl = _prctl()
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    prctl(_PR_SET_CHILD_SUBREAPER, 1)   # as spawn() sets it for a process it starts
    if os.getppid() != server_pid:      # the server died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    out = life["out_fd"]
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.environ.clear()
    os.environ.update(life["env"])
    if life.get("cwd") is not None:
        os.chdir(life["cwd"])
    import tempfile
    tempfile.tempdir = None          # found again from this life's TMPDIR
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:     # a new process seeds it from the OS
        numpy_random.seed()
    script = os.path.abspath(life["argv"][1])
    sys.argv = list(life["argv"][1:])
    sys.path.insert(0, os.path.dirname(script))
    return script


def main() -> dict[str, Any] | None:
    """The server's life; in a forked life, its request."""
    sock = socket.socket(fileno=int(sys.argv[1]))
    server_pid = os.getpid()
    prctl = _prctl()
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:
        return None
    del sys.path[0]      # this file's folder: its module names must not shadow others
    try:
        for module in sys.argv[2:]:
            importlib.import_module(module)
        if threading.active_count() != 1:
            raise RuntimeError("a preloaded module started a thread: a fork would copy "
                               "its locks without it")
    except BaseException as exc:   # noqa: BLE001 - told to the launcher, which goes on without
        _send(sock, {"ready": False, "error": "".join(
            traceback.format_exception_only(type(exc), exc)).strip()})
        return None
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)   # wakes the select through the pipe
    _send(sock, {"ready": True})
    life = _serve(sock, wake_r)
    if life is not None:
        life["script"] = _become(life, server_pid, [sock.detach(), wake_r, wake_w])
    return life


if __name__ == "__main__":
    _life = main()
    if _life is not None:
        import runpy

        # Not in a try: an exception or sys.exit ends this process as it would the script's.
        runpy.run_path(_life["script"], run_name="__main__")
