"""The generation protocol: how the ranks of a job agree, over one TCPStore, on who forms
the process group, so a worker restarted with the same rank is never taken for its old self.

The store lives in the primary (rank 0) or, under torchrun, in torchrun's agent. The
primary's store listens on 127.0.0.1 only; the job's port (MASTER_PORT, on the address the
peers were told) is a gate that lets in only clients that prove they know the job's secret
(storeauth.py). Keys, all under ``<namespace>/``:

- ``epoch``: the hosting process's incarnation id. A new one means the primary restarted.
- ``gen``: the current generation, a decimal integer. It only grows.
- ``g/<G>/member/<rank>``: the incarnation id (random, one per process start and never
  reused) of the process that joined generation G for that rank.
- ``g/<G>/cause``: why generation G began (a person-readable line for the logs).
- ``g/<G>/pg/...``: the process group's own keys, so a generation never reads the
  addresses of an earlier one (the class of bug of pytorch issue 135712).
- ``g/<G>/barrier/<name>/<rank>``: barrier arrivals.

Joining generation G: write ``member/<rank>`` and wait until every rank's key is there.
A process that finds its rank already present in G under another incarnation knows its
old self was a member: G is over, and it moves ``gen`` to G+1 (compare-and-set, so
concurrent movers agree). Every waiter that sees ``gen`` move re-joins the newer one.
Survivors watch ``gen`` (see group.py) and re-join too.
"""

from __future__ import annotations

import datetime
import errno
import logging
import math
import socket
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_delay,
    wait_random_exponential,
)

from .. import sigterm
from ..text import first_line
from . import storeauth
from .errors import (
    BarrierTimeoutError,
    DistributedConfigError,
    PeerRestartedError,
    PrimaryUnreachableError,
    RendezvousTimeoutError,
    StopRequestedError,
)
from .resolve import Resolver, resolve

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 10.0
# The ranks retry the primary's store with full jitter (a random wait up to a cap). The cap
# grows with the job, so that up to 500 ranks the primary sees at most about 2 x this many
# attempts a second, and a small job connects within 50 ms of the store coming back (0.5 s
# for every size, as before, cost a 3-worker job about 0.3 s per loss of its primary).
CONNECT_ATTEMPTS_PER_S = 1000


def connect_retry_cap_s(world_size: int) -> float:
    """The longest wait between two attempts to reach the primary's store."""
    return min(0.5, max(0.05, world_size / CONNECT_ATTEMPTS_PER_S))


def _ms(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(0.001, seconds))


def _leave_if_stopped(waiting_for: str) -> None:
    """A SIGTERM while waiting for a peer: its peers are being stopped too, so leave now
    (exit 134) instead of waiting for them until the grace period's SIGKILL."""
    if sigterm.received():
        raise StopRequestedError(f"SIGTERM while waiting for {waiting_for}; leaving")


def describe_ranks(ranks: Sequence[int], name_of: Callable[[int], str]) -> str:
    shown = [f"rank {r} ({name_of(r)})" for r in ranks[:8]]
    more = f" and {len(ranks) - 8} more" if len(ranks) > 8 else ""
    return ", ".join(shown) + more


class Rendezvous:
    """One process's side of the protocol. Not thread-safe: one thread uses it."""

    def __init__(self, *, host: str, port: int, rank: int, world_size: int, hosts_store: bool,
                 namespace: str, name_of: Callable[[int], str],
                 join_timeout_s: float, resolver: Resolver | None = None,
                 poll_s: float = 0.1, silent_s: float = math.inf) -> None:
        self.host, self.port = host, port
        self.rank, self.world_size = rank, world_size
        self.hosts_store = hosts_store
        self.ns = namespace.rstrip("/")
        self.name_of = name_of
        self.join_timeout_s = join_timeout_s
        self.resolver = resolver
        self.poll_s = poll_s
        self.incarnation = uuid.uuid4().hex
        # When this process's rendezvous last went round a loop of its waits (or began a
        # step of one): a wait whose store call never returns (its host stopped; torch's
        # client does not give up then) leaves it behind, for the hang watchdog.
        self.alive = time.monotonic()
        # Connecting: since when the primary's port has accepted connections that its store
        # never answered (a stopped or frozen process), and how long that may last.
        self.silent_since: float | None = None
        self.silent_s = silent_s
        self._cut_silent_since: float | None = None   # cut(): the store's silence so far
        self.epoch = ""
        self.store: Any = None

    # --- the store --------------------------------------------------------------------

    def _key(self, *parts: object) -> str:
        return "/".join([self.ns, *(str(p) for p in parts)])

    def key(self, *parts: object) -> str:
        """A key of this job's namespace in the store, for the group's own records."""
        return self._key(*parts)

    @property
    def store(self) -> Any:
        return self._store

    @store.setter
    def store(self, value: Any) -> None:
        old = getattr(self, "_store", None)
        if old is not None and value is not old:
            # The store is dropped (shutdown, or it went away): end its relayed connections
            # and their threads, and (the primary) stop taking connections on its port.
            gate = getattr(self, "_gate", None)
            if gate is not None:
                gate.close()
                self._gate = None
            self._relays.close()
            self._relays = storeauth.Relays()   # for the next store's connections
        elif not hasattr(self, "_relays"):
            self._relays = storeauth.Relays()
        self._store = value

    def local_ports(self) -> frozenset[int]:
        """Ports this process listens on for the store: connections accepted there are the
        store's (the gate's, the inner server's, a forwarder's), never a process group's."""
        return storeauth.listening_ports() | {self.port}

    def _secret(self) -> bytes:
        return storeauth.job_secret(self.ns)

    def connect(self, deadline: float) -> None:
        """Host the store (rank 0 without an agent store) or connect to it, until ``deadline``
        (a time.monotonic() value). Sets ``self.store`` and ``self.epoch``."""
        if self.hosts_store:
            store, gate = self._host_store(deadline)
            self.store = store
            self._gate: storeauth.StoreGate | None = gate
            weakref.finalize(self, gate.close)  # a Rendezvous dropped without a shutdown
            self.epoch = self.incarnation
            # "gen" before "epoch": a client that sees the epoch also sees a generation.
            self.store.set(self._key("gen"), "0")
            self.store.set(self._key("epoch"), self.epoch)
            return
        what = f"the primary {self.name_of(0)}"
        start = last_log = time.monotonic()
        self.silent_since, self._cut_silent_since = self._cut_silent_since, None

        def log_progress(state: RetryCallState) -> None:
            nonlocal last_log
            _leave_if_stopped(f"{what} at {self.host}:{self.port} to accept connections")
            now = time.monotonic()
            if state.attempt_number == 1:
                exc = state.outcome.exception() if state.outcome else None
                logger.info("waiting for %s at %s:%d (%s), up to %.0f s", what, self.host,
                            self.port, first_line(exc), self.join_timeout_s)
            if now - last_log >= PROGRESS_EVERY_S:
                last_log = now
                logger.warning("waiting for %s at %s:%d, %.0f s of %.0f s", what, self.host,
                               self.port, now - start, self.join_timeout_s)

        retrying = Retrying(
            retry=retry_if_exception_type((RuntimeError, OSError)),  # DistNetwork/StoreError
            wait=wait_random_exponential(multiplier=0.05,  # full jitter
                                         max=connect_retry_cap_s(self.world_size)),
            stop=stop_after_delay(max(0.0, deadline - start)),
            # A SIGTERM ends the pause at once (its handler runs during the wait).
            sleep=sigterm.pause, before_sleep=log_progress, reraise=True)
        try:
            retrying(self._connect_once, deadline, what)
        except (RuntimeError, OSError) as exc:
            raise PrimaryUnreachableError(
                f"{what} at {self.host}:{self.port} did not accept connections "
                f"within {self.join_timeout_s:.0f} s (last error: "
                f"{first_line(str(exc)) or type(exc).__name__}). "
                f"Check that the primary started and that MASTER_ADDR/MASTER_PORT "
                f"(or CLUSTER_SPEC) point at it.", missing=(0,)) from exc
        if time.monotonic() - start > 1.0:
            logger.info("connected to %s's store at %s:%d after %.1f s", what, self.host,
                        self.port, time.monotonic() - start)

    def _open(self, address: str, timeout_s: float) -> tuple[str, int]:
        """Where this process's next TCPStore client connects to reach the store at
        ``address``: a forwarder that has passed the primary's gate, or (torchrun's agent
        store, which has no gate) the store itself. Raises OSError while nothing listens
        (a plain connect: a refused TCPStore connect prints a C++ stack trace per attempt,
        thousands of lines over a long wait for the primary)."""
        if storeauth.agent_hosts_store():
            socket.create_connection((address, self.port), timeout=timeout_s).close()
            return address, self.port
        try:
            return storeauth.LOOPBACK, storeauth.forward(
                address, self.port, self._secret(), self._relays, connect_timeout_s=timeout_s)
        except storeauth.StoreAuthError as exc:
            if not getattr(self, "_auth_warned", False):   # retried until the deadline
                self._auth_warned = True
                logger.warning("%s; retrying until the join deadline", exc)
            raise

    def cut(self, silent_since: float) -> None:
        """End this process's connections to the store now (from any thread): a call
        waiting on a store that does not answer fails at once, and the next connection
        is a fresh one. ``silent_since``: when the store last answered; the next connect
        counts a silent port from then, not afresh."""
        self._cut_silent_since = silent_since
        cut, self._relays = self._relays, storeauth.Relays()
        cut.close(timeout_s=1.0)

    def tick(self) -> None:
        """This process's rendezvous is not stuck in a store call (``alive``)."""
        self.alive = time.monotonic()

    def _connect_once(self, deadline: float, what: str) -> None:
        import torch.distributed as dist

        if self.silent_since is None:   # else the store's silence goes on: no round ticks
            self.tick()
        _leave_if_stopped(f"{what} at {self.host}:{self.port} to accept connections")
        kwargs: dict[str, Any] = {"resolver": self.resolver} if self.resolver else {}
        address = resolve(self.host, self.port, what=what, on_wait=self.tick,
                          deadline_s=max(0.0, deadline - time.monotonic()), **kwargs)
        remaining = deadline - time.monotonic()
        try:
            host, port = self._open(address, min(1.0, max(remaining, 0.1)))
        except storeauth.StoreSilentError as exc:
            self._still_silent(what, exc)
            raise
        except TimeoutError as exc:   # after silence: the stopped process's backlog is full
            if self.silent_since is not None:
                self._still_silent(what, exc)
            raise
        except (ConnectionRefusedError, socket.gaierror):
            self.silent_since = None   # nothing listens: not up yet, or restarting
            raise
        self.silent_since = None
        # Short attempts: torch's own retry inside one attempt backs off to seconds, which is
        # how long a worker would then lag behind a primary that is already up.
        store = dist.TCPStore(host, port, is_master=False,
                              timeout=_ms(min(1.0, max(remaining, 0.1))), wait_for_workers=False)
        store.set_timeout(_ms(min(10.0, max(remaining, 0.5))))
        if self.rank == 0:
            # Under torchrun the agent hosts the store and rank 0 only initialises our keys
            # (once per namespace, that is per restart round).
            store.compare_set(self._key("gen"), "", "0")
            store.compare_set(self._key("epoch"), "", self.incarnation)
        store.wait([self._key("epoch")])
        self.epoch = store.get(self._key("epoch")).decode()
        store.set_timeout(_ms(max(remaining, 1.0)))
        self.store = store

    def _still_silent(self, what: str, exc: BaseException) -> None:
        """An attempt met a port that accepts connections and a store that never greets.
        (A connect that timed out says nothing either way: a machine not up yet, or a
        stopped process's full backlog.) Past ``silent_s`` of that, give up."""
        now = time.monotonic()
        if self.silent_since is None:
            self.silent_since = now
            logger.warning("%s at %s:%d accepts connections but its store does not answer "
                           "(%s): stopped or frozen?", what, self.host, self.port, exc)
        elif now - self.silent_since >= self.silent_s:
            raise PrimaryUnreachableError(
                f"{what} at {self.host}:{self.port} has not answered for "
                f"{now - self.silent_since:.0f} s and its port still accepts connections: "
                f"its process is stopped or frozen, or another program holds the port; "
                f"leaving so that the job is retried", missing=(0,)) from exc

    def _bind_addresses(self, deadline: float) -> list[str]:
        """The addresses of this machine that MASTER_ADDR names (never all interfaces)."""
        resolver = self.resolver or socket.getaddrinfo
        # Its own name can resolve late too (the platform's DNS): wait for it like a client.
        resolve(self.host, self.port, what=f"this machine's name ({self.name_of(0)})",
                deadline_s=max(0.0, min(deadline, time.monotonic() + 60.0) - time.monotonic()),
                resolver=resolver)
        infos = resolver(self.host, self.port, type=socket.SOCK_STREAM)
        return storeauth.bind_addresses(self.host, [str(i[4][0]) for i in infos])

    def _host_store(self, deadline: float) -> tuple[Any, storeauth.StoreGate]:
        import torch.distributed as dist

        secret = self._secret()
        addresses = self._bind_addresses(deadline)
        give_up = min(deadline, time.monotonic() + 30.0)
        tampered = 0
        while True:
            try:
                gate = storeauth.StoreGate(addresses, self.port, secret)
            except OSError as exc:
                # The previous incarnation's socket can hold the port for a moment.
                if exc.errno != errno.EADDRINUSE or time.monotonic() >= give_up:
                    raise DistributedConfigError(
                        f"cannot listen on {'/'.join(addresses)} port {self.port} for the "
                        f"job's rendezvous store ({exc.strerror or exc}). "
                        + ("Another process holds it: choose a free MASTER_PORT."
                           if exc.errno == errno.EADDRINUSE else
                           f"Set MASTER_ADDR (or {storeauth.BIND_ENV}) to an address of "
                           f"this machine.")) from exc
                time.sleep(0.5)
                continue
            try:
                # The server itself on loopback only: TCPStore's libuv server would bind
                # every interface given a port, but keeps to the socket it is handed.
                store = dist.TCPStore(storeauth.LOOPBACK, gate.inner_port, is_master=True,
                                      master_listen_fd=gate.inner_fd(),
                                      timeout=_ms(self.join_timeout_s), wait_for_workers=False)
                gate.seal(store)
            except storeauth.StoreTamperedError as exc:
                gate.close()
                tampered += 1
                if tampered >= 3:
                    raise DistributedConfigError(
                        f"{exc}, {tampered} times in a row: another process on this machine "
                        f"is probing the job's store; stop it") from exc
                logger.warning("%s; starting the store again", exc)
                continue
            except BaseException:
                gate.close()
                raise
            gate.start()
            logger.info("rendezvous store listening on %s port %d (clients must know the "
                        "job's secret)", "/".join(gate.addresses), self.port)
            return store, gate

    def client(self) -> Any:
        """A second connection to the same store, for a watcher thread."""
        import torch.distributed as dist

        gate = getattr(self, "_gate", None)
        if gate is not None:
            address = gate.addresses[0]
        else:
            kwargs: dict[str, Any] = {"resolver": self.resolver} if self.resolver else {}
            address = resolve(self.host, self.port, deadline_s=30.0, **kwargs)
        host, port = self._open(address, 10.0)
        return dist.TCPStore(host, port, is_master=False, timeout=_ms(10.0),
                             wait_for_workers=False)

    # --- generations ------------------------------------------------------------------

    def generation(self, store: Any = None) -> int:
        return int((store or self.store).get(self._key("gen")))

    def epoch_of(self, store: Any) -> str:
        return bytes(store.get(self._key("epoch"))).decode()

    def cause(self, gen: int, store: Any = None) -> str:
        store = store or self.store
        key = self._key("g", gen, "cause")
        if store.check([key]):
            return bytes(store.get(key)).decode()
        return ""

    def _advance(self, seen: int, to: int, cause: str) -> None:
        self.store.set(self._key("g", to, "cause"), cause)
        # Compare-and-set: when several ranks move it at once, one wins and all agree.
        self.store.compare_set(self._key("gen"), str(seen), str(to))

    def join(self, at_least: int, deadline: float, cause: str = "") -> int:
        """Join the newest generation >= ``at_least``; returns it once every rank is in."""
        me = self.name_of(self.rank)
        while True:
            self.tick()
            gen = self.generation()
            if gen < at_least:
                self._advance(gen, at_least, cause or f"{me} (rank {self.rank}) re-joined")
                continue
            member = self._key("g", gen, "member", self.rank)
            if self.store.check([member]) and bytes(self.store.get(member)).decode() != (
                    self.incarnation):
                # Our previous incarnation was in this generation: it is over.
                self._advance(gen, gen + 1, f"{me} (rank {self.rank}) restarted")
                continue
            self.store.set(member, self.incarnation)
            if self._wait_members(gen, deadline):
                return gen

    def _barrier_timeout(self, name: str, timeout_s: float,
                         missing: list[int]) -> BarrierTimeoutError:
        return BarrierTimeoutError(
            f"barrier {name!r} timed out after {timeout_s:.0f} s: "
            f"{len(missing)} of {self.world_size} ranks never reached it: "
            f"{describe_ranks(missing, self.name_of)}. They are slow, hung or "
            f"took another code path; their logs (or a hang-watchdog report) tell "
            f"which.", missing=tuple(missing))

    def _missing(self, keys: list[str]) -> list[int]:
        """The ranks whose key (``keys[rank]``) is not in the store yet."""
        return [r for r, key in enumerate(keys) if not self.store.check([key])]

    def _wait_members(self, gen: int, deadline: float) -> bool:
        """True when every rank joined ``gen``; False when a newer generation began."""
        keys = [self._key("g", gen, "member", r) for r in range(self.world_size)]
        start = last_log = time.monotonic()
        sleep = 0.01
        while True:
            self.tick()
            if self.store.check(keys):
                return True
            if self.generation() != gen:
                return False
            if sigterm.received():
                raise StopRequestedError(
                    f"SIGTERM while waiting for {len(self._missing(keys))} of "
                    f"{self.world_size} ranks to form generation {gen}; leaving")
            gave_up = self._key("g", gen, "gave_up")
            if self.store.check([gave_up]):
                # The primary's deadline passed first: fail with its words, before its store
                # (and with it the list of who is missing) goes away.
                message = bytes(self.store.get(gave_up)).decode()
                self.store.set(self._key("g", gen, "gave_up_seen", self.rank), "1")
                raise RendezvousTimeoutError(message, missing=tuple(self._missing(keys)))
            now = time.monotonic()
            if now >= deadline:
                missing = self._missing(keys)
                message = (
                    f"the process group did not form within {self.join_timeout_s:.0f} s: "
                    f"{len(missing)} of {self.world_size} ranks never arrived: "
                    f"{describe_ranks(missing, self.name_of)}. Check those workers' logs "
                    f"(did they start? do they reach init_distributed?), or raise the join "
                    f"timeout.")
                if self.hosts_store:
                    self._tell_waiters(gen, message, missing)
                raise RendezvousTimeoutError(message, missing=tuple(missing))
            if now - last_log >= PROGRESS_EVERY_S:
                last_log = now
                missing = self._missing(keys)
                if missing:   # none: the last one came meanwhile (or the store's host froze)
                    logger.warning("waiting for %d of %d workers: %s, %.0f s of %.0f s",
                                   len(missing), self.world_size,
                                   describe_ranks(missing, self.name_of), now - start,
                                   self.join_timeout_s)
            time.sleep(sleep)
            sleep = min(sleep * 2, self.poll_s)

    def _tell_waiters(self, gen: int, message: str, missing: list[int]) -> None:
        """Leave the verdict in the store and give the waiting ranks a moment to read it."""
        self.store.set(self._key("g", gen, "gave_up"), message)
        present = [r for r in range(self.world_size) if r not in missing and r != self.rank]
        seen = [self._key("g", gen, "gave_up_seen", r) for r in present]
        until = time.monotonic() + 3.0
        while seen and not self.store.check(seen) and time.monotonic() < until:
            time.sleep(0.05)

    def pg_store(self, gen: int) -> Any:
        import torch.distributed as dist

        return dist.PrefixStore(self._key("g", gen, "pg") + "/", self.store)

    # --- barriers ---------------------------------------------------------------------

    def barrier(self, gen: int, name: str, timeout_s: float) -> None:
        """Wait until every rank reached barrier ``name`` of generation ``gen``.

        Raises BarrierTimeoutError naming the ranks that did not arrive, and
        PeerRestartedError when a newer generation begins meanwhile.
        """
        import torch.distributed as dist

        keys = [self._key("g", gen, "barrier", name, r) for r in range(self.world_size)]
        self.store.set(keys[self.rank], self.incarnation)
        start = last_log = time.monotonic()
        sleep = 0.005
        # Who is missing, taken shortly before the timeout: the ranks time out together,
        # and the primary, leaving on its own timeout, takes the store with it while the
        # others may still be asking it who never came.
        early: list[int] | None = None
        while True:
            self.tick()
            try:
                if self.store.check(keys):
                    break
                current = self.generation()
            except dist.DistNetworkError:
                if early is None:
                    raise
                # The store went this close to the timeout: the primary timed out first
                # (its clock ran a little ahead) and took the store with it.
                raise self._barrier_timeout(name, timeout_s, early) from None
            now = time.monotonic()
            if sigterm.received():
                raise StopRequestedError(f"SIGTERM while waiting at barrier {name!r}; leaving")
            if early is None and now - start >= 0.8 * timeout_s:
                early = self._missing(keys)
            if now - start >= timeout_s:
                try:
                    missing = self._missing(keys)
                except dist.DistNetworkError:
                    missing = early if early is not None else []
                raise self._barrier_timeout(name, timeout_s, missing)
            if current != gen:
                raise PeerRestartedError(
                    f"generation {gen} ended during barrier {name!r}: "
                    f"{self.cause(current) or 'a peer restarted'}", gen)
            if now - last_log >= PROGRESS_EVERY_S:
                last_log = now
                missing = self._missing(keys)
                if missing:   # none: the last one came meanwhile (or the store's host froze)
                    logger.warning("barrier %r: waiting for %s, %.0f s of %.0f s", name,
                                   describe_ranks(missing, self.name_of), now - start,
                                   timeout_s)
            time.sleep(sleep)
            sleep = min(sleep * 2, self.poll_s)
