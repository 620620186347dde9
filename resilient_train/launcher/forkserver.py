"""The preload fork server: a process that imports some modules once, then forks each
worker life from itself, so that a restart does not pay those imports again.

    PYTHON .../launcher/forkserver.py FD MODULE [MODULE ...]
    PYTHON .../launcher/forkserver.py --listen SOCKET_PATH MODULE [MODULE ...]

Run by path, not ``-m``: nothing of resilient_train is imported here, so each life imports
the library afresh, as a new process would. It imports the modules, says ``ready`` (or why
not) with what it is (its interpreter, modules and environment), then serves the
launcher's requests (``preload.py``), one JSON line each with the fd of the life's output
pipe, or its stdout's and stderr's (SCM_RIGHTS), and answers each with the new process's
pid or the error that stopped it. It reaps its children and sends each one's exit status
(as ``Popen.returncode``) to the launcher that asked for it. It dies with the process that
started it (PR_SET_PDEATHSIG), and its children die with it.

With FD, it serves one launcher on that socket and exits when the launcher closes it.
With ``--listen``, it serves every launcher that connects to the Unix socket at
SOCKET_PATH, so that successive launches share one server's imports; a launcher that goes
away takes its lives still running with it (SIGKILL to their sessions).

A forked life turns itself into ``python SCRIPT ARGS``: a session of its own, its own
environment, working directory, the launcher's priority (nice), ``sys.argv`` and
``sys.path[0]``, stdin from /dev/null, output to the pipe, the script run as ``__main__``,
and the interpreter's exit as the script's (``atexit``, an uncaught exception's traceback
and exit 1, ``sys.exit``'s status). Python's ``random`` reseeds itself after a fork;
NumPy's global generator, where a preloaded module imported it, is reseeded here, as a new
process would seed it.
Linux only (prctl); stdlib only.
"""

from __future__ import annotations

import ctypes
import gc
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


class _Client:
    """A launcher connected to the server."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lines = _Lines(sock)

    def tell(self, message: dict[str, Any]) -> None:
        try:
            _send(self.sock, message)
        except OSError:   # gone: its end of the socket is read as EOF next
            pass

    def leave(self, lives: list[int]) -> None:
        """Its launcher went away: its ``lives`` still running go too, as with a server
        of its own."""
        self.sock.close()
        for pid in lives:
            try:
                os.killpg(pid, signal.SIGKILL)   # each life leads its own session
            except OSError:
                pass


def _serve(clients: list[_Client], listener: socket.socket | None, hello: dict[str, Any],
           wake_r: int) -> dict[str, Any] | None:
    """Fork a life per request, report each exit to its launcher. In a forked life: its
    request (with its output fds as ``out_fds``: one, or stdout's and stderr's). In the
    server: None, once its launcher has gone (without ``--listen``)."""
    owners: dict[int, _Client] = {}   # each life still running: who asked for it
    while True:
        watched = [wake_r, *(c.sock for c in clients), *([listener] if listener else [])]
        ready, _, _ = select.select(watched, [], [])
        if wake_r in ready:
            os.read(wake_r, 512)
        while True:   # every child that ended, at once
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            owner = owners.pop(pid, None)
            if owner is not None and owner in clients:
                owner.tell({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        if listener is not None and listener in ready:
            conn, _ = listener.accept()
            clients.append(_Client(conn))
            clients[-1].tell(hello)
        for client in [c for c in clients if c.sock in ready]:
            try:
                requests = client.lines.read()
            except OSError:
                requests = None
            if requests is None:
                clients.remove(client)
                client.leave([pid for pid, owner in owners.items() if owner is client])
                if listener is None and not clients:
                    return None
                continue
            for request, fds in requests:
                pid = _fork(client, request, fds)
                if pid == 0:
                    return {**request, "out_fds": fds}
                if pid is not None:
                    owners[pid] = client


def _fork(client: _Client, request: dict[str, Any], fds: list[int]) -> int | None:
    """Fork the request's life; answer with its pid, or the error that stopped it. 0 in
    the forked life; None where none was forked."""
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
        client.tell({"id": request["id"], "errno": exc.errno,
                     "error": exc.strerror or str(exc),
                     "filename": getattr(exc, "filename", None)})
        return None
    if pid == 0:
        return 0
    for fd in fds:
        os.close(fd)
    client.tell({"id": request["id"], "pid": pid})
    return pid


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
    outs = life["out_fds"]   # one for stdout and stderr, or one each
    os.dup2(outs[0], 1)
    os.dup2(outs[-1], 2)
    for fd in set(outs):
        os.close(fd)
    os.environ.clear()
    os.environ.update(life["env"])
    if life.get("cwd") is not None:
        os.chdir(life["cwd"])
    if life.get("nice") is not None:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, int(life["nice"]))
        except OSError:   # below the server's, unprivileged: the server's it stays
            pass
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
    server_pid = os.getpid()
    prctl = _prctl()
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:
        return None
    del sys.path[0]      # this file's folder: its module names must not shadow others
    clients: list[_Client] = []
    listener: socket.socket | None = None
    if sys.argv[1] == "--listen":
        # Listening before the imports: a launcher that connects meanwhile waits for ready.
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(sys.argv[2])
        listener.listen(64)
        modules = sys.argv[3:]
    else:
        clients.append(_Client(socket.socket(fileno=int(sys.argv[1]))))
        modules = sys.argv[2:]
    try:
        for module in modules:
            importlib.import_module(module)
        if threading.active_count() != 1:
            raise RuntimeError("a preloaded module started a thread: a fork would copy "
                               "its locks without it")
        # What the imports made lives as long as each life: out of the collector's sight
        # (CPython's advice before fork without exec), no life's collections walk it, nor
        # copy its pages by touching them, nor its exit's (1.1 CPU-seconds of torch's).
        gc.freeze()
    except BaseException as exc:   # noqa: BLE001 - told to the launcher, which goes on without
        why = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        for client in clients:
            client.tell({"ready": False, "error": why})
        print(why, file=sys.stderr)
        return None
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)   # wakes the select through the pipe
    # What a launcher checks before it forks its lives here (preload.py).
    hello = {"ready": True, "program": sys.executable, "modules": modules,
             "env": dict(os.environ)}
    for client in clients:
        client.tell(hello)
    if listener is not None:   # for a person: it is ready
        print(f"preload server: {', '.join(modules)} imported; serving at {sys.argv[2]}",
              file=sys.stderr, flush=True)
    life = _serve(clients, listener, hello, wake_r)
    if life is not None:
        close = [c.sock.detach() for c in clients] + [wake_r, wake_w]
        if listener is not None:
            close.append(listener.detach())
        life["script"] = _become(life, server_pid, close)
    return life


if __name__ == "__main__":
    _life = main()
    if _life is not None:
        import runpy

        # Not in a try: an exception or sys.exit ends this process as it would the script's.
        runpy.run_path(_life["script"], run_name="__main__")
