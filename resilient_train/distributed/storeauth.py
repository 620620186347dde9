"""Keep the rendezvous store to the job: which address it listens on, and a secret that
every client must prove it knows. torch's TCPStore has neither: its libuv server binds
every interface whatever host it is given, and it serves anyone who connects.

How a store hosted by the primary is reached (rendezvous.py puts the parts together):

- the TCPStore server listens on 127.0.0.1, on a port the kernel picks (the "inner" port).
  On Linux a socket filter on that listener drops every connection attempt but the gate's
  own (by source address and port), so another user of the machine cannot use it either;
- the *gate* listens on the job's port (MASTER_PORT), bound to the address the peers were
  told (127.0.0.1 under the launcher), never to all interfaces. A client proves it knows
  the job's secret (HMAC-SHA256 over a fresh nonce each way, so the secret never crosses
  the wire and the client knows the gate is the job's too); then the gate relays bytes
  to the inner port. A client that does not answer correctly within a few seconds is
  disconnected before a single byte reaches the store;
- every process's TCPStore client connects to a *forwarder* in its own process: it did the
  handshake with the gate first, listens on 127.0.0.1 for one connection, and serves only a
  connection that comes from a socket of its own process.

The socket filter is Linux's (classic BPF); elsewhere the inner port is open to other
local users, and a warning says so. Under torchrun's agent store none of this applies:
the agent hosts its own store (see docs/design.md, "Storage security").
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .errors import DistributedConfigError
from .sever import own_tcp_connections

logger = logging.getLogger(__name__)

SECRET_ENV = "RESILIENT_TRAIN_JOB_SECRET"
BIND_ENV = "RESILIENT_TRAIN_STORE_BIND_ADDR"
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
MIN_SECRET_CHARS = 16
HANDSHAKE_TIMEOUT_S = 5.0
MAX_PENDING_HANDSHAKES = 64     # more at once: the newest are closed (a flood, not peers)
GREETING = b"resilient-train store 1\n"
NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size
LOOPBACK = "127.0.0.1"

_FILTERED = sys.platform.startswith("linux")
_warned: set[str] = set()
_listening: dict[int, int] = {}    # port -> how many of this module's listeners hold it
_listening_lock = threading.Lock()


def listening_ports() -> frozenset[int]:
    """The ports this process listens on for the store (the gate's, the inner server's, a
    forwarder's): connections accepted there are the store's, never gloo's (sever.py)."""
    with _listening_lock:
        return frozenset(_listening)


def _track(port: int, delta: int) -> None:
    with _listening_lock:
        count = _listening.get(port, 0) + delta
        if count > 0:
            _listening[port] = count
        else:
            _listening.pop(port, None)


def _warn_once(key: str, message: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


class StoreAuthError(ConnectionError):
    """The handshake with the job's store failed (wrong secret, another job's store, or
    not a store at all). A ConnectionError: the connect loop retries it until its deadline,
    since the port may be another job's until our primary takes it."""


class StoreSilentError(TimeoutError):
    """The store's port accepted a connection (its machine's kernel did) and the store
    never greeted: its process is stopped or frozen, or another program holds the port.
    Unlike a refused or timed-out connect, this is not a primary that is not up yet."""


def agent_hosts_store(env: Mapping[str, str] | None = None) -> bool:
    """Whether torchrun's agent hosts the store (then there is no gate and no secret)."""
    env = os.environ if env is None else env
    return env.get(AGENT_STORE_ENV, "").strip().lower() == "true"


def job_secret(namespace: str, env: Mapping[str, str] | None = None) -> bytes:
    """The secret every replica of the job shares: RESILIENT_TRAIN_JOB_SECRET (the launcher
    sets a random one per job), else one derived from the job's id, which keeps out whoever
    does not know the job id, and no one else (a warning says so)."""
    env = os.environ if env is None else env
    raw = env.get(SECRET_ENV, "").strip()
    if raw:
        if len(raw) < MIN_SECRET_CHARS:
            raise DistributedConfigError(
                f"{SECRET_ENV} has {len(raw)} characters; use at least {MIN_SECRET_CHARS} "
                f"random ones, the same on every replica (e.g. `openssl rand -hex 32`)")
        return raw.encode()
    _warn_once("secret", "%s is not set: the rendezvous store's secret is derived from the job "
               "id (%s), so anyone who knows the job id can use the store. Set %s to the "
               "same random value on every replica (the local launcher does it for you).",
               SECRET_ENV, namespace, SECRET_ENV)
    return hashlib.sha256(b"resilient-train derived store secret\0" + namespace.encode()
                          ).digest()


# --- which address the gate listens on ------------------------------------------------------

def _local_addresses() -> set[str]:
    import psutil

    out = set()
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                out.add(a.address.split("%")[0])
    return out


def _is_local(address: str, local: set[str]) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return False
    return ip.is_loopback or str(ip) in local


def _loopback(address: str) -> bool:
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


def _names_loopback(host: str) -> bool:
    """Whether ``host`` says loopback itself (a literal or localhost), not by a lookup."""
    if host.lower().rstrip(".") in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def _interface_addresses() -> list[str]:
    """The non-loopback addresses of this machine's interfaces that are up (no IPv6
    link-local ones, which need a scope)."""
    import psutil

    stats = psutil.net_if_stats()
    out = []
    for name, addrs in psutil.net_if_addrs().items():
        if name in stats and not stats[name].isup:
            continue
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            ip = ipaddress.ip_address(a.address.split("%")[0])
            if not (ip.is_loopback or ip.is_link_local or ip.is_unspecified):
                out.append(str(ip))
    return list(dict.fromkeys(out))


def bind_addresses(host: str, resolved: Sequence[str],
                   env: Mapping[str, str] | None = None) -> list[str]:
    """The addresses of this machine that the peers reach it by: those of ``resolved``
    (what MASTER_ADDR ``host`` resolves to) that belong to a local interface.

    RESILIENT_TRAIN_STORE_BIND_ADDR overrides. When none is local (a load balancer or NAT in
    front of the primary), the address this machine sends from toward the first one, with
    a warning. Never the wildcard: a store on every interface is what this module prevents.
    """
    env = os.environ if env is None else env
    local = _local_addresses()
    override = [a.strip() for a in env.get(BIND_ENV, "").split(",") if a.strip()]
    if override:
        for a in override:
            if not _is_local(a, local):
                raise DistributedConfigError(
                    f"{BIND_ENV}={a!r} is not an address of this machine (its addresses: "
                    f"{', '.join(sorted(local))}); name one of them")
        return override
    chosen = list(dict.fromkeys(a for a in resolved if _is_local(a, local)))
    if chosen and all(_loopback(a) for a in chosen) and not _names_loopback(host):
        # This machine's own name, mapped to 127.0.1.1 by /etc/hosts (Debian's habit), while
        # its peers resolve it to a real address: listen on those too, and say so.
        extra = _interface_addresses()
        if extra:
            logger.warning("MASTER_ADDR %r resolves to %s on this machine (an /etc/hosts "
                           "entry?), which other machines cannot reach: the rendezvous "
                           "store listens on %s too. Set %s to choose.", host,
                           ", ".join(chosen), ", ".join(extra), BIND_ENV)
        return chosen + extra
    if chosen:
        return chosen
    if not resolved:
        raise DistributedConfigError(f"MASTER_ADDR {host!r} resolved to no address")
    family = socket.AF_INET6 if ":" in resolved[0] else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((resolved[0], 9))   # UDP: sends nothing, only picks a route
            source = str(probe.getsockname()[0])
    except OSError as exc:
        raise DistributedConfigError(
            f"MASTER_ADDR {host!r} resolves to {', '.join(resolved)}, none of which is an "
            f"address of this machine, and no route leads there ({exc}). Set MASTER_ADDR to "
            f"this machine's name or address, or {BIND_ENV} to the address the peers "
            f"reach it by.") from exc
    if ipaddress.ip_address(source.split("%")[0]).is_unspecified:
        raise DistributedConfigError(
            f"MASTER_ADDR {host!r} resolves to {', '.join(resolved)}, none of which is an "
            f"address of this machine; set {BIND_ENV} to the address the peers reach it by")
    logger.warning("MASTER_ADDR %r resolves to %s, which is no address of this machine (a load "
                   "balancer or NAT in front of it?): the rendezvous store listens on %s, the "
                   "address this machine uses toward it. Set %s to choose another.", host,
                   ", ".join(resolved), source, BIND_ENV)
    return [source]


# --- the handshake --------------------------------------------------------------------------

def _mac(secret: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    # Distinct labels: an answer from one direction is never valid in the other.
    return hmac.new(secret, label + first + second, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Up to ``n`` bytes (fewer when the peer closes); raises TimeoutError at ``deadline``,
    a bound on the whole read, so a peer trickling one byte at a time is cut off too."""
    data = bytearray()
    while len(data) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the store handshake timed out")
        sock.settimeout(remaining)
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return bytes(data)


def _server_handshake(sock: socket.socket, secret: bytes) -> bool:
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    server_nonce = secrets.token_bytes(NONCE_BYTES)
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    sock.sendall(GREETING + server_nonce)
    answer = _recv_exact(sock, NONCE_BYTES + MAC_BYTES, deadline)
    if len(answer) != NONCE_BYTES + MAC_BYTES:
        return False
    client_nonce, mac = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    if not hmac.compare_digest(mac, _mac(secret, b"client", server_nonce, client_nonce)):
        return False
    sock.sendall(_mac(secret, b"server", client_nonce, server_nonce))
    return True


def _client_handshake(sock: socket.socket, secret: bytes, where: str) -> None:
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    try:
        greeting = _recv_exact(sock, len(GREETING) + NONCE_BYTES, deadline)
    except TimeoutError as exc:
        raise StoreSilentError(
            f"{where} accepted the connection but sent no greeting within "
            f"{HANDSHAKE_TIMEOUT_S:g} s") from exc
    if not greeting.startswith(GREETING):
        raise StoreAuthError(
            f"{where} is not the job's rendezvous store: it "
            f"{'closed the connection' if not greeting else 'speaks another protocol'} "
            f"(every replica must run the same resilient-train version; or another program "
            f"holds the port)")
    server_nonce = greeting[len(GREETING):]
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(client_nonce + _mac(secret, b"client", server_nonce, client_nonce))
    proof = _recv_exact(sock, MAC_BYTES, deadline)
    if len(proof) != MAC_BYTES:
        raise StoreAuthError(
            f"the rendezvous store at {where} refused this process's secret: {SECRET_ENV} "
            f"differs between the replicas, or the port belongs to another job")
    if not hmac.compare_digest(proof, _mac(secret, b"server", client_nonce, server_nonce)):
        raise StoreAuthError(
            f"the rendezvous store at {where} does not know this job's secret (another job's "
            f"store, or an impostor): not using it")


# --- relaying -------------------------------------------------------------------------------

def _tune(sock: socket.socket) -> None:
    # Store requests are small: Nagle's algorithm would hold them for up to 40 ms.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Relays:
    """The relayed connections (and their threads) of one store, so that dropping the store
    ends them all at once and leaves no thread behind, as dropping a TCPStore closes its
    sockets."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self.closed = False

    def adopt(self, *socks: socket.socket) -> None:
        with self._lock:
            self._sockets.update(socks)
            closed = self.closed
        if closed:   # closed meanwhile: end these too
            for sock in socks:
                _shutdown(sock)

    def release(self, *socks: socket.socket) -> None:
        with self._lock:
            self._sockets.difference_update(socks)

    def thread(self, target: Callable[..., None], *args: Any, name: str) -> bool:
        """Run ``target`` in a thread of this set; False (and nothing runs) once closed."""
        def run() -> None:
            try:
                target(*args)
            finally:
                with self._lock:
                    self._threads.discard(threading.current_thread())

        t = threading.Thread(target=run, name=name, daemon=True)
        with self._lock:
            if self.closed:
                return False
            self._threads.add(t)
        t.start()
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            self.closed = True
            socks, threads = list(self._sockets), list(self._threads)
        for sock in socks:
            _shutdown(sock)
        deadline = time.monotonic() + timeout_s
        for t in threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)   # wakes a blocked recv, send or accept (Linux)
    except OSError:
        pass


def splice(a: socket.socket, b: socket.socket, relays: Relays,
           on_close: Callable[[], None] | None = None) -> None:
    """Relay bytes both ways until either side closes, then close both (calling
    ``on_close`` just before). Pumps one direction in the caller's thread, which must be
    one of ``relays``' threads."""
    lock = threading.Lock()
    left = [2]
    relays.adopt(a, b)

    def finish() -> None:
        with lock:
            left[0] -= 1
            remaining = left[0]
        if remaining == 1:
            # Wake the other direction: TCPStore never half-closes, so one side ending
            # means the connection is over.
            _shutdown(a)
            _shutdown(b)
        elif remaining == 0:
            relays.release(a, b)
            try:
                if on_close is not None:
                    on_close()
            finally:
                a.close()
                b.close()

    def pump(src: socket.socket, dst: socket.socket) -> None:
        buf = bytearray(1 << 16)
        view = memoryview(buf)
        try:
            while True:
                n = src.recv_into(buf)
                if not n:
                    break
                dst.sendall(view[:n])
        except OSError:
            pass
        finally:
            finish()

    if not relays.thread(pump, b, a, name="rt-store-relay"):
        finish()   # closed: neither direction runs
        finish()
        return
    pump(a, b)


# --- the inner port's socket filter (Linux) ------------------------------------------------

SO_ATTACH_FILTER = 26
_SKF_NET_OFF = -0x100000
_LD_W_ABS, _LD_H_ABS, _JEQ_K, _RET_K = 0x20, 0x28, 0x15, 0x06
_MAX_PORTS = 2000               # a classic BPF program holds 4096 instructions


def _filter_program(ports: Sequence[int]) -> tuple[bytes, Any]:
    """A classic BPF socket filter: accept TCP segments from 127.0.0.1 whose source port
    is one of ``ports``, drop the rest. Returns the sock_fprog and the buffer it points to
    (kept alive until setsockopt has copied it)."""
    ins = [(_LD_W_ABS, 0, 0, (_SKF_NET_OFF + 12) & 0xFFFFFFFF),  # IPv4 source address
           (_JEQ_K, 1, 0, 0x7F000001),
           (_RET_K, 0, 0, 0),
           (_LD_H_ABS, 0, 0, 0)]                                  # TCP source port
    for port in ports:
        ins += [(_JEQ_K, 0, 1, port), (_RET_K, 0, 0, 0xFFFFFFFF)]
    ins.append((_RET_K, 0, 0, 0))
    program = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in ins))
    return struct.pack("HP", len(ins), ctypes.addressof(program)), program


def _proc_net_tcp() -> list[tuple[int, int, str]]:
    """(local port, remote port, state) of every IPv4 TCP socket on this machine."""
    out = []
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            out.append((int(fields[1].rsplit(":", 1)[1], 16),
                        int(fields[2].rsplit(":", 1)[1], 16), fields[3]))
    return out


class StoreTamperedError(ConnectionError):
    """Someone reached the new store in the moment before its filter went up: start over."""


# --- the gate -------------------------------------------------------------------------------

def _listen(address: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    lst = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As torch does: a restarted primary rebinds while its old connections linger.
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            lst.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        lst.bind((address, port))
        lst.listen(1024)
    except BaseException:
        lst.close()
        raise
    return lst


class StoreGate:
    """The job's port on the primary: authenticates each connection, then relays it to the
    TCPStore server on the inner port. One per hosted store.

    Use: ``gate = StoreGate(...)``, start the TCPStore server on ``gate.inner_port`` with
    ``master_listen_fd=gate.inner_fd()``, then ``gate.seal(store)`` and ``gate.start()``.
    """

    def __init__(self, addresses: Sequence[str], port: int, secret: bytes) -> None:
        self.addresses: list[str] = []    # those it listens on
        self.port = port
        self._secret = secret
        self._listeners: list[socket.socket] = []
        self._closed = threading.Event()
        self._pending = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        self._lock = threading.Lock()
        self._allowed: list[int] = []
        self._refused_logged: dict[str, float] = {}
        self._relays = Relays()
        try:
            for address in addresses:
                try:
                    self._listeners.append(_listen(address, port))
                    self.addresses.append(address)
                except OSError as exc:
                    # "localhost" can name ::1 on a host without IPv6: one address is enough.
                    if exc.errno == errno.EADDRINUSE or address == addresses[-1] and (
                            not self._listeners):
                        raise
                    logger.debug("store gate: not listening on %s: %s", address, exc)
            self._inner = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._inner.bind((LOOPBACK, 0))
            self._inner.listen(1024)
        except BaseException:
            self.close()
            raise
        self.inner_port: int = self._inner.getsockname()[1]
        self._tracked = [self.port, self.inner_port]
        for tracked in self._tracked:
            _track(tracked, +1)

    def inner_fd(self) -> int:
        """A descriptor of the inner listener for TCPStore's ``master_listen_fd`` (which
        closes it when the store goes; the gate keeps its own to change the filter)."""
        return os.dup(self._inner.fileno())

    def seal(self, store: Any) -> None:
        """Drop every new connection to the inner port but the gate's, then check that no
        one slipped in while the store started (connected, or left keys behind)."""
        if not _FILTERED:
            _warn_once("filter", "no socket filter on %s: the rendezvous store's inner port "
                       "on 127.0.0.1 is open to other users of this machine", sys.platform)
            return
        with self._lock:
            self._attach_locked()
        ours = {c.laddr.port for c in own_tcp_connections()
                if c.raddr and c.raddr.port == self.inner_port}
        # LISTEN is the server itself; TIME_WAIT a connection that is over (whatever it
        # did shows in the keys).
        strangers = sorted({remote for local, remote, state in _proc_net_tcp()
                            if local == self.inner_port and state not in ("0A", "06")
                            and remote not in ours})
        if strangers or store.num_keys() != 0:
            raise StoreTamperedError(
                f"another process reached the new rendezvous store on 127.0.0.1:"
                f"{self.inner_port} before it was sealed (from port(s) "
                f"{strangers or 'gone, keys left behind'})")

    def start(self) -> None:
        for lst in self._listeners:
            self._relays.thread(self._accept, lst, name="rt-store-gate")

    def close(self) -> None:
        """Stop listening on the job's port and end the connections relayed to the store
        (as dropping the TCPStore server would), with their threads."""
        with self._lock:
            if not self._closed.is_set():
                for tracked in getattr(self, "_tracked", ()):
                    _track(tracked, -1)
            self._closed.set()
            for sock in [*self._listeners, *([self._inner] if hasattr(self, "_inner") else [])]:
                _shutdown(sock)
                sock.close()
        self._relays.close()

    # --- internals

    def _attach_locked(self) -> None:
        if self._closed.is_set():
            return   # the listener is closed; the store's own copy keeps the last filter
        fprog, program = _filter_program(self._allowed)
        self._inner.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
        del program   # setsockopt copied it

    def _accept(self, lst: socket.socket) -> None:
        while not self._closed.is_set():
            try:
                conn, peer = lst.accept()
            except OSError as exc:
                if self._closed.is_set() or exc.errno in (errno.EBADF, errno.EINVAL):
                    return
                time.sleep(0.05)   # EMFILE and the like: do not spin
                continue
            if not self._pending.acquire(blocking=False):
                conn.close()
                continue
            self._relays.adopt(conn)   # a close() during the handshake ends it too
            if not self._relays.thread(self._serve, conn, peer, name="rt-store-gate"):
                self._pending.release()
                conn.close()

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        try:
            ok = _server_handshake(conn, self._secret)
        except OSError:
            ok = False
        finally:
            self._pending.release()
        if not ok:
            if not self._closed.is_set():
                self._log_refused(str(peer[0]))
            self._relays.release(conn)
            conn.close()
            return
        try:
            upstream, port = self._connect_inner()
        except OSError as exc:   # the store is gone (the primary is shutting down)
            logger.debug("store gate: cannot reach the inner store: %s", exc)
            self._relays.release(conn)
            conn.close()
            return
        conn.settimeout(None)
        _tune(conn)
        splice(conn, upstream, self._relays, lambda: self._forget(port))

    def _connect_inner(self) -> tuple[socket.socket, int]:
        upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            # Bound first, so the filter can let exactly this source port in.
            upstream.bind((LOOPBACK, 0))
        except OSError:
            upstream.close()
            raise
        port = int(upstream.getsockname()[1])
        try:
            self._allow(port)
            _tune(upstream)
            upstream.connect((LOOPBACK, self.inner_port))
        except OSError:
            self._forget(port)
            upstream.close()
            raise
        return upstream, port

    def _allow(self, port: int) -> None:
        if not _FILTERED:
            return
        with self._lock:
            if len(self._allowed) >= _MAX_PORTS:
                raise OSError(errno.EMFILE, f"more than {_MAX_PORTS} store connections")
            self._allowed.append(port)
            self._attach_locked()

    def _forget(self, port: int) -> None:
        """Called before the upstream socket closes: its port is free for anyone after."""
        if not _FILTERED:
            return
        with self._lock:
            if port in self._allowed:
                self._allowed.remove(port)
                self._attach_locked()

    def _log_refused(self, peer: str) -> None:
        now = time.monotonic()
        if now - self._refused_logged.get(peer, -1e9) >= 60.0:
            self._refused_logged[peer] = now
            logger.warning("refused a rendezvous store client from %s: it did not prove it "
                           "knows the job's secret (%s)", peer, SECRET_ENV)


# --- the forwarder --------------------------------------------------------------------------

def forward(address: str, port: int, secret: bytes, relays: Relays, *,
            connect_timeout_s: float, wait_s: float = 30.0) -> int:
    """Connect to the gate at ``address:port`` and prove the secret; returns the loopback
    port on which this process's next TCPStore client (created within ``wait_s``) reaches
    the store. Raises OSError when nothing listens, StoreAuthError when the handshake fails.
    """
    where = f"{address}:{port}"
    upstream = socket.create_connection((address, port), timeout=connect_timeout_s)
    try:
        _client_handshake(upstream, secret, where)
        upstream.settimeout(None)
        _tune(upstream)
        lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            lst.bind((LOOPBACK, 0))
            lst.listen(8)
        except OSError:
            lst.close()
            raise
    except BaseException:
        upstream.close()
        raise
    local_port = int(lst.getsockname()[1])
    _track(local_port, +1)
    relays.adopt(lst, upstream)
    if not relays.thread(_serve_one, lst, upstream, time.monotonic() + wait_s, relays,
                         name="rt-store-forwarder"):
        relays.release(lst, upstream)
        lst.close()
        upstream.close()
        _track(local_port, -1)
        raise ConnectionAbortedError("the rendezvous store was closed meanwhile")
    return local_port


def _is_own(conn: socket.socket, listen_port: int) -> bool:
    """Whether ``conn``'s other end is a socket of this process."""
    import psutil

    try:
        peer_port = conn.getpeername()[1]
        return any(c.laddr.port == peer_port and c.raddr and c.raddr.port == listen_port
                   for c in own_tcp_connections())
    except (OSError, psutil.Error) as exc:   # gone already, or the table is unreadable
        logger.warning("store forwarder: cannot tell whose connection this is (%s): "
                       "refusing it", exc)
        return False


def _serve_one(lst: socket.socket, upstream: socket.socket, deadline: float,
               relays: Relays) -> None:
    """Accept this process's TCPStore client (and no one else's), then relay it."""
    port = lst.getsockname()[1]
    conn = None
    try:
        while not relays.closed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break   # the TCPStore client never came (its start failed)
            lst.settimeout(remaining)
            try:
                candidate, peer = lst.accept()
            except OSError:
                continue
            if _is_own(candidate, port):
                conn = candidate
                break
            logger.warning("refused a connection to this process's store forwarder from "
                           "%s:%s: not from this process", *peer[:2])
            candidate.close()
    finally:
        relays.release(lst)
        lst.close()
        _track(port, -1)
    if conn is None:
        relays.release(upstream)
        upstream.close()
        return
    conn.settimeout(None)
    _tune(conn)
    splice(conn, upstream, relays)
