"""A ring of TCP connections between neighbouring ranks, for the small messages that peer
recovery sends every step (tiers/peers.py).

Why not torch.distributed's point-to-point calls: on gloo each call goes through the
process group's worker threads, and on this project's 2-vCPU machines a send, a receive
or a wait costs 200-300 us each however small the message, about a millisecond a step,
where a plain socket's send and receive cost tens of microseconds. The large transfers of
a restore still go over the process group (transport/transfer.py).

Each rank listens on the address it reaches the primary from (so on the interface the job
already uses: loopback for a local job), connects to the next rank and accepts the previous
one. A connection starts with a per-life token the primary drew and broadcast over the
job's own process group: a stranger that finds the port is dropped. Messages are frames
(a header: kind, step, flags, length; then the payload), read in order.

The watcher's severing (distributed/sever.py) cuts these connections like gloo's, so a
rank blocked here on a peer that left returns at once, with an error whose text says
"connection closed by peer" (a peer failure, errors.PEER_LOST_MESSAGES).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import select
import socket
import struct
from collections import deque
from dataclasses import dataclass

from ...errors import TransientError
from ...sigterm import waits_on_peers

log = logging.getLogger(__name__)

_FRAME = struct.Struct("<iqqq")   # kind, step, flags, payload length
_TOKEN_BYTES = 16


class PeerRingError(TransientError):
    """A ring neighbour went away (its connection closed or failed)."""


@dataclass(frozen=True)
class Frame:
    kind: int
    step: int
    flags: int
    payload: bytes


def local_address(primary: str, port: int) -> str:
    """The address this host reaches ``primary`` from: where the neighbours reach us."""
    try:
        if ipaddress.ip_address(socket.gethostbyname(primary)).is_loopback:
            return "127.0.0.1"
    except (OSError, ValueError):
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((primary, port or 1))   # UDP: picks a route, sends nothing
            return str(probe.getsockname()[0])
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def machine_key() -> str:
    """This process's machine, for the ring's placement: the host, and the replica (node)
    rank where the job says it (``GROUP_RANK``, or the replica of ``CLUSTER_SPEC``):
    replicas of a local launcher share a host but stand for separate machines."""
    from ...cluster import ClusterInfo

    host = socket.gethostname()
    info = ClusterInfo.from_env_or_none()
    return host if info is None or info.source == "standalone" else f"{host}#{info.group_rank}"


def ring_order(machines: list[str]) -> list[int]:
    """The ranks in ring order, given each rank's machine (``machine_key``): the first rank
    of every machine, then the second of every machine, and so on. Neighbours in the ring
    then sit on different machines whenever there are two or more, so a lost machine (a
    node of 8 GPUs, say) never takes a rank's state together with the copy its neighbour
    holds. One rank per machine keeps the plain order 0, 1, 2, ..."""
    per_machine: dict[str, list[int]] = {}
    for rank, machine in enumerate(machines):
        per_machine.setdefault(machine, []).append(rank)
    columns = list(per_machine.values())
    return [col[i] for i in range(max(map(len, columns))) for col in columns if i < len(col)]


class RingLink:
    """This rank's two connections: to the next rank (sends) and from the previous one."""

    def __init__(self, listener: socket.socket, out: socket.socket, inc: socket.socket,
                 prev: int, nxt: int, timeout_s: float) -> None:
        self._listener, self._out, self._in = listener, out, inc
        self.prev, self.next = prev, nxt   # neighbours in ring_order
        self._timeout = timeout_s
        self._buf = bytearray()
        self._frames: deque[Frame] = deque()
        # Why a connection failed. Raised only where a message is needed (receive): a
        # neighbour that finished training and closed is no error for a rank finishing too.
        self._broken = ""

    @classmethod
    def connect(cls, rank: int, world_size: int, allgather: object, host: str,
                token: bytes, timeout_s: float) -> RingLink:
        """Collective: every rank listens, learns the others' addresses and machines
        through ``allgather`` (the coordination group's), connects to the next rank of
        :func:`ring_order`, accepts the previous."""
        listener = socket.create_server((host, 0))
        listener.settimeout(timeout_s)
        try:
            me = (host, listener.getsockname()[1], machine_key())
            peers = allgather(me)   # type: ignore[operator]
            order = ring_order([machine for _, _, machine in peers])
            at = order.index(rank)
            nxt, prev = order[(at + 1) % world_size], order[at - 1]
            out = socket.create_connection(tuple(peers[nxt][:2]), timeout=timeout_s)
            out.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            out.sendall(token + struct.pack("<i", rank))
            inc = cls._accept(listener, token, prev, timeout_s)
        except BaseException:
            listener.close()
            raise
        return cls(listener, out, inc, prev, nxt, timeout_s)

    @staticmethod
    def _accept(listener: socket.socket, token: bytes, prev: int,
                timeout_s: float) -> socket.socket:
        while True:
            conn, addr = listener.accept()   # times out after timeout_s
            conn.settimeout(timeout_s)
            try:
                hello = _read_exactly(conn, _TOKEN_BYTES + 4)
            except (OSError, PeerRingError):
                conn.close()
                continue
            sender = struct.unpack("<i", hello[_TOKEN_BYTES:])[0]
            if hmac.compare_digest(hello[:_TOKEN_BYTES], token) and sender == prev:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return conn
            log.warning("peer ring: dropped a connection from %s without this job's token", addr)
            conn.close()

    # --- messages -------------------------------------------------------------------------

    def send(self, kind: int, step: int, flags: int, payload: bytes) -> None:
        """A frame to the next rank (the kernel buffers it: no wait for the reader). A
        failure is noted, not raised: the next rank is gone, and :meth:`receive` or the
        process group's own failure says so where it matters."""
        try:
            self._out.sendall(_FRAME.pack(kind, step, flags, len(payload)) + payload)
        except OSError as exc:
            self._broken = self._broken or f"sending to the next rank: {exc}"

    def receive(self, kind: int) -> Frame:
        """The next frame of ``kind`` from the previous rank, waiting for it; frames of
        other kinds that come first are kept for :meth:`arrived`."""
        while True:
            for i, frame in enumerate(self._frames):
                if frame.kind == kind:
                    del self._frames[i]
                    return frame
            self._read(block=True)

    def arrived(self, kind: int) -> list[Frame]:
        """The frames of ``kind`` the previous rank sent so far, without waiting."""
        try:
            self._read(block=False)
        except PeerRingError as exc:
            self._broken = self._broken or str(exc)
        out = [f for f in self._frames if f.kind == kind]
        self._frames = deque(f for f in self._frames if f.kind != kind)
        return out

    @waits_on_peers   # a SIGTERM's stall guard ends a wait on a frozen rank (sigterm.py)
    def _read(self, *, block: bool) -> None:
        while True:
            self._parse()
            if self._broken:
                if block:
                    raise PeerRingError(f"peer ring: connection closed by peer ({self._broken})")
                return
            if not block:
                ready, _, _ = select.select([self._in], [], [], 0)
                if not ready:
                    return
            try:
                chunk = self._in.recv(1 << 16)
            except OSError as exc:
                raise PeerRingError(f"peer ring: connection closed by peer (rank {self.prev}: "
                                    f"{exc})") from exc
            if not chunk:
                raise PeerRingError(f"peer ring: connection closed by peer (rank {self.prev})")
            self._buf += chunk
            if block and self._parse():
                return

    def _parse(self) -> bool:
        """Move whole frames from the buffer to the queue; whether any was."""
        found = False
        while len(self._buf) >= _FRAME.size:
            kind, step, flags, length = _FRAME.unpack_from(self._buf)
            end = _FRAME.size + length
            if len(self._buf) < end:
                break
            self._frames.append(Frame(kind, step, flags, bytes(self._buf[_FRAME.size:end])))
            del self._buf[:end]
            found = True
        return found

    def close(self) -> None:
        for s in (self._out, self._in, self._listener):
            try:
                s.close()
            except OSError:
                pass


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise PeerRingError("peer ring: connection closed by peer during the handshake")
        data += chunk
    return bytes(data)


def new_token() -> bytes:
    return os.urandom(_TOKEN_BYTES)
