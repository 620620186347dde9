"""``init_distributed()``: a process group that forms whatever order the workers start in,
notices within a second when a peer restarts, and re-forms in-process.

One `DistributedGroup` per process. Its parts:
- the rendezvous (rendezvous.py): which processes form which generation;
- a watcher thread on a second store connection: when the generation moves on (a peer
  restarted) or the store vanishes (the primary restarted), it flags the group and ends
  every collective in flight: NCCL's communicator is aborted, and gloo's connections are
  shut down (sever.py), so no survivor waits on another survivor that has left;
- `run(fn)`: calls ``fn``; when it fails because a peer went away, tears the process
  group down, re-forms it at the next generation and calls ``fn`` again. ``fn`` is the
  same code a restarted process would run (restore the latest checkpoint, train on), so
  in-process recovery and a process restart take the same path, and the platform's job
  retry budget is not spent;
- an optional hang watchdog (hang.py) fed by `step_done()`.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar

from .. import sigterm
from ..cluster import ClusterInfo, replica_name, training_replica
from ..errors import PEER_LOST_MESSAGES, exception_chain, exit_transient
from ..text import error_line
from ..validate import options
from .errors import DistributedConfigError, PeerRestartedError, RendezvousTimeoutError
from .hang import HangWatchdog, report_and_exit
from .heartbeat import OwnPause, PeerBeats
from .rendezvous import Rendezvous
from .resolve import Resolver
from .sever import Baseline, sever_gloo
from .storeauth import agent_hosts_store

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How long the training thread may stay at one call inside torch once a lost peer's
# connections were cut, before the rank gives up re-forming in-process (_leave_if_stuck):
# far past any collective that sees its sockets fail, and short of the job's patience.
LOST_PEER_STALL_S = 30.0
# The store has not answered (the watcher, or while the group forms the rendezvous) for
# this long: its host stopped, froze or is cut off, and torch's store client would wait on
# it for good. Far above a busy store's answer.
STORE_SILENT_S = 60.0

OnPeerRestart = Literal["recover", "exit"]


@options
@dataclass(frozen=True)
class DistributedOptions:
    """How the group forms and what happens when a peer goes away.

    Environment overrides (read by `from_env`; `init_distributed` applies them on top of
    the options it is given): RESILIENT_TRAIN_JOIN_TIMEOUT_S, RESILIENT_TRAIN_FORM_TIMEOUT_S,
    RESILIENT_TRAIN_HANG_TIMEOUT_S, RESILIENT_TRAIN_ON_PEER_RESTART.
    """

    backend: str | None = None          # None: nccl when CUDA is usable, else gloo
    join_timeout_s: float = 900.0       # forming the group, at start and after a restart
    collective_timeout_s: float = 600.0  # one collective (torch's `timeout`)
    # Connecting the mesh once every rank has joined. Short, because a member that dies in
    # this window leaves the others waiting in torch (not interruptible) for this long.
    form_timeout_s: float = 60.0
    barrier_timeout_s: float = 600.0
    on_peer_restart: OnPeerRestart = "recover"  # or "exit": every worker exits transient
    watch_interval_s: float = 0.5       # how often the watcher polls the generation
    hang_timeout_s: float | None = None  # no finished step for this long: exit transient
    max_recoveries: int = 100           # in-process re-formings before giving up

    def __post_init__(self) -> None:
        for name in ("join_timeout_s", "collective_timeout_s", "form_timeout_s",
                     "barrier_timeout_s", "watch_interval_s"):
            if getattr(self, name) <= 0:
                raise DistributedConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.hang_timeout_s is not None and self.hang_timeout_s <= 0:
            raise DistributedConfigError(
                f"hang_timeout_s must be > 0 or None (off), got {self.hang_timeout_s}")
        if self.on_peer_restart not in ("recover", "exit"):
            raise DistributedConfigError(
                f"on_peer_restart must be 'recover' or 'exit', got {self.on_peer_restart!r}")
        if self.backend not in (None, "gloo", "nccl"):
            raise DistributedConfigError(
                f"backend must be 'gloo', 'nccl' or None (automatic), got {self.backend!r}")

    @classmethod
    def from_env(cls, base: DistributedOptions | None = None,
                 env: dict[str, str] | None = None) -> DistributedOptions:
        env = dict(os.environ) if env is None else env
        changes: dict[str, Any] = {}
        for var, field in (("RESILIENT_TRAIN_JOIN_TIMEOUT_S", "join_timeout_s"),
                           ("RESILIENT_TRAIN_FORM_TIMEOUT_S", "form_timeout_s"),
                           ("RESILIENT_TRAIN_HANG_TIMEOUT_S", "hang_timeout_s")):
            raw = env.get(var, "").strip()
            if raw:
                try:
                    changes[field] = float(raw)
                except ValueError as exc:
                    raise DistributedConfigError(
                        f"{var}: expected a number of seconds, found {raw!r}") from exc
        mode = env.get("RESILIENT_TRAIN_ON_PEER_RESTART", "").strip()
        if mode:
            changes["on_peer_restart"] = mode
        out = replace(base or cls(), **changes)  # validated again by __post_init__
        return out


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says a peer of the process group went away."""
    import torch.distributed as dist

    for e in exception_chain(exc):
        if isinstance(e, PeerRestartedError):
            return True
        if isinstance(e, RendezvousTimeoutError):
            return False  # nobody to recover with: the caller exits transient
        if isinstance(e, dist.DistNetworkError):
            return True
        text = str(e).lower()
        if any(p in text for p in PEER_LOST_MESSAGES):
            return True
    return False


def replica_namer(info: ClusterInfo) -> Callable[[int], str]:
    """Rank -> the replica name a person sees in the launcher and the platform's console."""
    per_node = max(1, info.local_world_size)

    def name_of(rank: int) -> str:
        node = rank // per_node
        replica = replica_name(*training_replica(node))
        return replica if per_node == 1 else f"{replica}/local{rank % per_node}"

    return name_of


class DistributedGroup:
    """This process's membership of the job's process group (the default torch group)."""

    def __init__(self, info: ClusterInfo, options: DistributedOptions,
                 resolver: Resolver | None = None) -> None:
        import torch

        if info.rank < 0:
            raise DistributedConfigError(
                f"replica {info.replica_name} is in {info.pool}, which does not train "
                f"(parameter or reduction servers, evaluators): do not call "
                f"init_distributed there")
        self.info = info
        self.options = options
        self.rank, self.world_size = info.rank, info.world_size
        self.local_rank = info.local_rank
        cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
        self.backend = options.backend or ("nccl" if cuda else "gloo")
        if self.backend == "nccl":
            if not cuda:
                raise DistributedConfigError(
                    "backend 'nccl' needs a CUDA GPU and none is visible; use backend='gloo' "
                    "(or None: automatic) on CPU")
            self.device = torch.device("cuda", info.local_rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.name_of = replica_namer(info)
        agent_store = agent_hosts_store()
        # Under torchrun the agent hosts the store and restarts every worker on a failure:
        # one namespace per restart round. Elsewhere rank 0 hosts it.
        # The job's id in the namespace: a worker that reaches another job's store (a port
        # reused on a shared host) waits for its own job instead of joining that one.
        job = info.job_id or os.environ.get("TORCHELASTIC_RUN_ID") or "job"
        namespace = f"rt/{job}"
        if agent_store:
            namespace = f"rt/{job}/{info.restart_count}"
        self._rdzv = Rendezvous(
            host=info.master_addr, port=info.master_port, rank=info.rank,
            world_size=info.world_size, hosts_store=info.rank == 0 and not agent_store,
            namespace=namespace, name_of=self.name_of, join_timeout_s=options.join_timeout_s,
            resolver=resolver, silent_s=STORE_SILENT_S)
        self.generation = -1
        self.recoveries = 0
        self.last_recovery_s: float | None = None
        self._peer_lost = threading.Event()
        self._peer_reason = ""
        self._store_lost = False   # the watcher's reason already says the store is gone
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._beats: PeerBeats | None = None   # this generation's heartbeats (hang watchdog)
        self._forming = False   # the group forms: the rendezvous's rounds say it is not stuck
        self._store_heard = time.monotonic()   # the store last answered the watcher
        self._liveness: threading.Thread | None = None   # _watch_store, for the group's life
        self._liveness_stop = threading.Event()
        self._barriers: dict[str, int] = {}
        self._closed = False
        self._hang = HangWatchdog(options.hang_timeout_s) if options.hang_timeout_s else None
        self._on_stuck: Callable[[str], None] = report_and_exit
        # What listened before any process group existed: what appears later is gloo's.
        # (A lone worker never severs: no inventory of its sockets at start-up.)
        self._sockets_before = Baseline.now() if info.world_size > 1 else Baseline(frozenset())
        self._sigterm_guard = sigterm.StallGuard(lambda: self._end_collectives(leaving=True),
                                                 report_and_exit)
        atexit.register(self._at_exit)

    # --- what the training code sees ----------------------------------------------------

    @property
    def is_primary(self) -> bool:
        return self.rank == 0

    @property
    def replica_name(self) -> str:
        return self.name_of(self.rank)

    def check(self) -> None:
        """Raise PeerRestartedError if the watcher saw this generation end."""
        if self._peer_lost.is_set():
            raise PeerRestartedError(self._peer_reason, self.generation)

    def step_done(self, step: int | None = None) -> None:
        """Call after every training step: feeds the hang watchdog, raises on a peer restart."""
        if self._hang is not None:
            self._hang.beat(step)
        if self._peer_lost.is_set():
            raise PeerRestartedError(self._peer_reason, self.generation)

    def phase(self, name: str) -> None:
        """What this rank does now ("step", "save", "restore"): the hang watchdog counts the
        time of a step, and outside one the silence of a peer that stopped beating."""
        if self._hang is not None:
            self._hang.phase(name)

    @contextlib.contextmanager
    def in_phase(self, name: str) -> Iterator[None]:
        """:meth:`phase` ``name`` for the block, then "step" again, also when it raises."""
        self.phase(name)
        try:
            yield
        finally:
            self.phase("step")

    def barrier(self, name: str = "barrier", timeout_s: float | None = None) -> None:
        """Every rank waits here; a timeout names the ranks that never came."""
        if self.world_size == 1:
            return
        n = self._barriers.get(name, 0)
        self._barriers[name] = n + 1
        self._rdzv.barrier(self.generation, f"{name}.{n}",
                           timeout_s if timeout_s is not None else self.options.barrier_timeout_s)

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, called again after each in-process recovery.

        ``fn`` must start the way a restarted process does: build the model, restore the
        latest checkpoint, train. A failure that is not a peer's is raised unchanged.
        """
        while True:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                # A lone worker has no peer: its connection errors (storage, a DataLoader
                # worker's pipe) are judged as they are, not as a peer that went away.
                if self.world_size == 1 or not (self._peer_lost.is_set()
                                                or is_peer_failure(exc)):
                    raise
                reason = error_line(exc)
            # Out of the except block, the exception's traceback and with it fn's frames
            # (DDP, the checkpoint manager: whatever holds the process group) are freed, so
            # destroying the group really closes its sockets. A survivor blocked in a
            # collective on *us* (not on the dead peer) then fails at once instead of
            # waiting for the collective timeout.
            gc.collect()
            self.recover(reason)

    def recover(self, cause: BaseException | str) -> None:
        """Tear the process group down and re-form it at the next generation (or, with
        ``on_peer_restart="exit"``, exit with the transient code)."""
        reason = self._peer_reason or error_line(cause)
        if sigterm.received():
            # Being stopped (a preemption, a job retry): the peers are too, so re-forming
            # would wait for nobody until the grace period's SIGKILL.
            self._stop_watcher()
            self._destroy_pg()
            # Planned, as a SIGTERM's emergency save is: one line, the stack in the report.
            exit_transient(f"SIGTERM while the process group was failing ({reason}); "
                           f"exiting instead of re-forming it",
                           exc=cause if isinstance(cause, BaseException) else None,
                           one_line=True)
        if self.options.on_peer_restart == "exit" or self.world_size == 1:
            self._stop_watcher()
            self._destroy_pg()
            exit_transient(f"a peer of the process group went away: {reason}",
                           exc=cause if isinstance(cause, BaseException) else None,
                           one_line=self.options.on_peer_restart == "exit")   # as asked
        self.recoveries += 1
        if self.recoveries > self.options.max_recoveries:
            raise PeerRestartedError(
                f"the process group was re-formed {self.options.max_recoveries} times and a "
                f"peer went away again ({reason}); giving up", self.generation)
        t0 = time.monotonic()
        if self._hang is not None:
            self._hang.disarm()
        logger.warning("%s: generation %d ended (%s); re-forming the process group",
                       self.replica_name, self.generation, reason)
        self._teardown(self.replica_name)
        self._watch_forming()   # before the probe below: it is a store call too
        # The watcher's lost store is not probed again (a 5 s wait on a dead socket).
        if self._store_lost or not self._store_alive():
            # torchrun's agents on several machines: the store may never come back.
            machines = self.info.world_size // self.info.local_world_size
            machines = machines if agent_hosts_store() else 0
            if machines > 1 or not self._store_lost:   # else the line above said it
                logger.warning("%s", store_gone_message(
                    self.replica_name, f"{self.info.master_addr}:{self.info.master_port}",
                    self.name_of(0), machines))
            self._rdzv.store = None
        self._peer_lost.clear()
        self._peer_reason = ""
        self._store_lost = False
        self._form(self.generation + 1, f"{self.replica_name} saw: {reason}")
        self.last_recovery_s = time.monotonic() - t0
        logger.warning("%s: process group re-formed at generation %d in %.1f s",
                       self.replica_name, self.generation, self.last_recovery_s)

    def shutdown(self, *, wait_for_peers: bool = True) -> None:
        """Destroy the process group and stop the threads. With ``wait_for_peers`` the ranks
        first meet at a barrier, so the primary keeps the store up until all are done."""
        if self._closed:
            return
        self._closed = True
        waits = wait_for_peers and self.world_size > 1 and not self._peer_lost.is_set()
        if waits and self._beats is not None and self._rdzv.store is not None:
            try:   # a peer still saving must not take this rank's silence for a hang
                self._beats.leave(self._rdzv.store)
            except Exception as exc:  # the store's host is gone: nobody is left to wait
                logger.debug("could not say this rank left: %s", exc)
        self._stop_watcher()
        self._liveness_stop.set()
        self._sigterm_guard.close()
        if self._hang is not None:
            self._hang.close()
        if waits:
            try:
                self.barrier("shutdown", timeout_s=min(60.0, self.options.barrier_timeout_s))
            except Exception as exc:  # finishing matters more than a tidy goodbye
                logger.warning("%s: peers did not all reach shutdown: %s", self.replica_name,
                               exc)
        self._destroy_pg()
        self._rdzv.store = None
        atexit.unregister(self._at_exit)

    def __enter__(self) -> DistributedGroup:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self.shutdown(wait_for_peers=exc_type is None)

    # --- forming ----------------------------------------------------------------------

    def _form(self, at_least: int, cause: str = "") -> None:
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.options.collective_timeout_s)
        if self.world_size == 1:
            dist.init_process_group(self.backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout)
            self.generation = 0
            if self._hang is not None:  # a lone worker can hang too (I/O, a deadlock)
                self._hang.arm()
            return
        self._watch_forming()
        try:
            gen = self._join_and_connect(at_least, cause)
        except BaseException:
            self._forming = False
            if self._hang is not None:   # on its way out with the error: no hang to report
                self._hang.disarm()
            raise
        logger.info("%s: rank %d of %d joined generation %d (%s)", self.replica_name,
                    self.rank, self.world_size, gen, self.backend)
        if at_least == 0:
            self._sigterm_guard.install()  # once, from init_distributed (the main thread)
        self._forming = False
        self._start_watcher(gen)
        if self._hang is not None:
            self._hang.arm()
            self._hang.phase("step")

    def _watch_forming(self) -> None:
        """From now until the group has formed, each round of the rendezvous's waits says
        that this process is not stuck in a store call: waiting for peers to come is no
        hang, a store call that never returns (its host stopped) is. The hang watchdog
        counts that silence ("rendezvous" phase), and without one _watch_store cuts it."""
        self._forming = True
        self._rdzv.tick()
        self._start_store_liveness()
        if self._hang is not None:
            self._hang.listen(self._silent_peer)
            self._hang.arm()
            self._hang.phase("rendezvous")

    def _join_and_connect(self, at_least: int, cause: str) -> int:
        """Join the newest generation >= ``at_least`` and connect its process group."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.options.collective_timeout_s)
        deadline = time.monotonic() + self.options.join_timeout_s
        form_timeout = datetime.timedelta(seconds=min(self.options.form_timeout_s,
                                                      self.options.collective_timeout_s))
        while True:
            if self._rdzv.store is None:
                self._rdzv.connect(deadline)
            try:
                gen = self._rdzv.join(at_least, deadline, cause)
            except dist.DistNetworkError as exc:
                # The primary (and its store) went away while we waited: it restarts and
                # hosts a new store; wait for that one, within the same deadline.
                logger.warning("%s: lost the rendezvous store while forming (%s); "
                               "reconnecting", self.replica_name, error_line(exc))
                self._rdzv.store = None
                continue
            kwargs: dict[str, Any] = {}
            if self.backend == "nccl":
                kwargs["device_id"] = self.device  # eager init: a bad GPU fails here
            _reset_group_names()
            try:
                dist.init_process_group(self.backend, store=self._rdzv.pg_store(gen),
                                        rank=self.rank, world_size=self.world_size,
                                        timeout=form_timeout, **kwargs)
            except Exception as exc:
                if time.monotonic() >= deadline or not self._formation_broke(gen, exc):
                    raise
                # A member died while the mesh connected: try the next generation.
                logger.warning("%s: forming generation %d failed (%s); trying again",
                               self.replica_name, gen, error_line(exc))
                self._destroy_pg()
                if not self._store_alive():
                    self._rdzv.store = None
                at_least = gen + 1
                continue
            _set_pg_timeout(timeout)
            self.generation = gen
            # Barrier names count calls per generation: a restarted member counts from 0, so
            # the survivors must too (they met at 'eval.3' while it waited at 'eval.0').
            self._barriers = {}
            return gen

    def _formation_broke(self, gen: int, exc: BaseException) -> bool:
        """Whether init failed because the generation's membership broke (retry) rather
        than for a reason that another try cannot fix."""
        if is_peer_failure(exc) or "timeout" in str(exc).lower():
            return True
        try:
            return self._rdzv.generation() != gen
        except Exception:
            return True  # the store is gone: the primary restarted

    def _teardown(self, who: str) -> None:
        """Stop the watcher and drop the old group, within a bound: a teardown stuck inside
        torch (a gloo group whose peer died mid-collective, seen on 3-rank jobs) would
        otherwise hold this process, deaf to SIGTERM, until the job's timeout. Past the
        bound it exits transient with every thread's stack in the error report."""
        bound = min(30.0, self.options.form_timeout_s)
        guard = threading.Timer(bound, self._on_stuck, args=(
            f"{who}: tearing down generation {self.generation} did not finish in {bound:g} s "
            "(stuck inside torch.distributed); exiting so that the worker is restarted",))
        guard.daemon = True
        guard.start()
        try:
            self._stop_watcher()
            # Before the destroy, which waits for the group's collectives in flight: they
            # may wait on a survivor that is itself waiting on us.
            self._sever()
            self._destroy_pg()
        finally:
            guard.cancel()

    def _destroy_pg(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            from torch.distributed.distributed_c10d import _abort_process_group

            # Abort (which NCCL needs to let go of a stuck collective); destroy is the
            # fallback when the abort itself fails.
            try:
                _abort_process_group()
            except Exception as exc:
                logger.debug("abort failed (%s); destroying instead", exc)
                try:
                    dist.destroy_process_group()
                except Exception as exc2:  # the peer is gone: nothing left to free
                    logger.debug("destroy_process_group: %s", exc2)
        gc.collect()  # gloo closes a group's sockets when the last reference goes

    def _sever(self, outgoing: bool = False) -> None:
        exclude = self._rdzv.local_ports()  # the rendezvous store's own listeners
        severed = sever_gloo(self._sockets_before, exclude, outgoing=outgoing)
        if severed:
            logger.info("%s: shut down %d gloo connections of generation %d", self.replica_name,
                        severed, self.generation)

    def _store_alive(self) -> bool:
        store = self._rdzv.store
        if store is None:
            return False
        try:
            store.set_timeout(datetime.timedelta(seconds=5))
            alive = self._rdzv.epoch_of(store) == self._rdzv.epoch
            store.set_timeout(datetime.timedelta(seconds=self.options.join_timeout_s))
            return alive
        except Exception:
            return False

    # --- watching ---------------------------------------------------------------------

    def _start_watcher(self, gen: int) -> None:
        if self.world_size == 1:
            return
        self._watch_stop = threading.Event()
        client = self._rdzv.client()
        self._beats = None
        if self._hang is not None:
            # A beat every eighth of the hang timeout: a live peer is never near silent.
            self._beats = PeerBeats(
                lambda r: self._rdzv.key("g", gen, "beat", r), self.rank, self.world_size,
                period_s=max(self.options.watch_interval_s, self._hang.timeout_s / 8))
            self._hang.listen(self._silent_peer)
        self._store_heard = time.monotonic()
        self._watcher = threading.Thread(target=self._watch, args=(gen, client, self._watch_stop),
                                         name="rt-peer-watcher", daemon=True)
        self._watcher.start()

    def _start_store_liveness(self) -> None:
        """Once per process that reaches the store through relays of its own (not the
        primary, not under torchrun's agent store): _watch_store can cut them."""
        if (self._liveness is None and self.world_size > 1 and not self._rdzv.hosts_store
                and not agent_hosts_store()):
            self._liveness = threading.Thread(target=self._watch_store,
                                              name="rt-store-liveness", daemon=True)
            self._liveness.start()

    def _store_heard_at(self) -> float | None:
        """When the store last answered this process, as far as anything waits on it:
        while the group forms, the rendezvous's last round; once formed, the watcher's last
        answer; None when nothing waits on it (the watcher saw the generation end)."""
        if self._forming:
            # Still connecting, nothing of ours to cut: the connect loop bounds a silent
            # store itself (Rendezvous.silent_s).
            return self._rdzv.alive if self._rdzv.store is not None else None
        watcher = self._watcher
        if watcher is None or not watcher.is_alive() or self._peer_lost.is_set():
            return None
        return self._store_heard

    def _silent_peer(self) -> tuple[str, float] | None:
        """What has been silent longest while this rank waits, in words, and since when:
        a peer, or the store (its host stopped: the watcher, or between generations the
        rendezvous, waits in a call that does not return)."""
        if self._forming:
            rank, since = None, self._rdzv.alive
        else:
            beats = self._beats
            quiet = beats.quietest(self._store_heard) if beats is not None else None
            if quiet is None:
                return None
            rank, since = quiet
        if rank is not None:
            return f"{self.name_of(rank)} (rank {rank}) sent no heartbeat", since
        host = "" if agent_hosts_store() else f", on {self.name_of(0)}"
        return (f"the rendezvous store at {self.info.master_addr}:{self.info.master_port}"
                f"{host}, did not answer"), since

    def _stop_watcher(self) -> None:
        self._watch_stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=15.0)
        self._watcher = None

    def _watch(self, gen: int, store: Any, stop: threading.Event) -> None:
        beats = self._beats
        while not stop.wait(self.options.watch_interval_s):
            try:
                current = self._rdzv.generation(store)
                if current == gen:
                    if beats is not None:
                        self._heartbeat(beats, store)
                    self._store_heard = time.monotonic()
                    continue
                cause = self._rdzv.cause(current, store) if current > gen else ""
                reason = f"generation {current} began: {cause or 'a peer restarted'}"
            except Exception as exc:
                if stop.is_set():
                    return
                reason = (f"lost the rendezvous store at {self.info.master_addr}:"
                          f"{self.info.master_port}: the primary {self.name_of(0)} stopped or "
                          f"restarted ({error_line(exc)})")
                self._store_lost = True
            self._flag(reason)
            self._leave_if_stuck(reason, stop)
            return

    def _watch_store(self) -> None:
        """A store call does not return when the store's host stopped (torch's client waits
        for good, and the rank's training, recovery or formation with it): past
        STORE_SILENT_S without an answer, cut this process's connections to the store.
        Every call on them fails then, and the loss is handled as the store's (the
        primary's) is: re-forming, or forming, waits for it up to the join timeout."""
        pause = OwnPause(5.0)
        counts_from = time.monotonic()   # after this process's own stop, or a cut
        while not self._liveness_stop.wait(1.0):
            now = time.monotonic()
            heard = self._store_heard_at()
            if pause.paused() or heard is None:
                counts_from = now
                continue
            silent = now - max(heard, counts_from)
            if silent >= STORE_SILENT_S:
                logger.warning(
                    "%s: the rendezvous store at %s:%s (on %s) has not answered for %.0f s: "
                    "its host stopped, froze or is cut off; closing this process's "
                    "connections to it", self.replica_name, self.info.master_addr,
                    self.info.master_port, self.name_of(0), math.floor(silent))
                self._rdzv.cut(max(heard, counts_from))
                counts_from = now

    def _heartbeat(self, beats: PeerBeats, store: Any) -> None:
        """Beat; and while this rank waits outside a step, look at the peers' beats."""
        beats.beat(store)
        if self._hang is not None and self._hang.waiting:
            beats.observe(store)
        elif beats.silent is not None:
            beats.stop_observing()

    def _flag(self, reason: str) -> None:
        self._peer_reason = reason
        self._peer_lost.set()
        # Not a line of its own on the console: recover()'s "generation N ended (reason)"
        # follows at once, and a training thread that stays stuck says it in its exit.
        logger.info("%s: %s", self.replica_name, reason)
        self._end_collectives()

    def _leave_if_stuck(self, reason: str, stop: threading.Event) -> None:
        """Once its connections are cut, the training thread leaves the collective it was in
        and recovers. Not always: a rank frozen while its peer left came back inside DDP's
        backward, waiting for an allreduce that never completes although its sockets are
        gone, and it sat there until the job's timeout. A training thread that stays at one
        call inside torch for LOST_PEER_STALL_S after the cut exits transient instead, with
        every thread's stack in its error report, so that the worker is restarted."""
        if sigterm.main_stuck_in_torch(LOST_PEER_STALL_S, lambda: not stop.is_set()):
            self._on_stuck(f"{self.replica_name}: {reason}, and its training thread stayed at "
                           f"one call inside torch for {LOST_PEER_STALL_S:g} s after the "
                           "process group's connections were cut; exiting so that the "
                           "worker is restarted")

    def _end_collectives(self, leaving: bool = False) -> None:
        """Make every collective in flight return with an error, from any thread. A process
        that is ``leaving`` also cuts the connections it opened: a frozen peer cannot cut
        the ones it accepted."""
        # gloo groups (the default one on CPU, the checkpoint coordination's on any backend)
        # return from a collective only when one of its sockets fails: make them fail.
        self._sever(outgoing=leaving)
        if self.backend == "nccl":
            # NCCL would sit in a collective until its timeout; aborting makes it return.
            try:
                from torch.distributed.distributed_c10d import _abort_process_group

                _abort_process_group()
            except Exception as exc:
                logger.warning("could not abort the NCCL process group: %s", exc)

    def _at_exit(self) -> None:
        try:
            self.shutdown(wait_for_peers=False)
        except Exception:  # at interpreter exit: nothing useful to do with an error
            pass


def store_gone_message(who: str, address: str, primary: str, torchrun_machines: int) -> str:
    """What a survivor says when the rendezvous store is gone. Under torchrun on several
    machines the store is the first machine's agent's, and when that machine alone
    restarts, its new agent waits for the other machines' agents, which never meet again:
    the job hangs until torchrun's rendezvous timeout. Say so, and what to use instead."""
    line = (f"{who}: the rendezvous store at {address} is gone (the primary {primary} stopped "
            "or restarted); waiting for it to come back")
    if torchrun_machines > 1:
        line += ("; under torchrun it may not: the first machine's new torchrun agent waits "
                 "for the other machines' agents, which do not meet again (the job then hangs "
                 "until torchrun's rendezvous timeout, 600 s by default). Start the "
                 "processes with `resilient-train spawn --nproc-per-node N -- python "
                 "train.py` instead of torchrun (docs/launcher.md, \"Several processes per "
                 "machine\")")
    return line


def _reset_group_names() -> None:
    """Name the next default group "0", as in a fresh process.

    torch names a group (and prefixes its store keys) by a process-wide counter that a
    failed ``init_process_group`` advances and only destroying a formed group resets: after
    a member died mid-formation, the survivors' next group was "1" and the restarted
    member's "0", and each waited for keys the other never wrote. With the counter reset,
    a generation's keys depend on the generation alone.
    """
    from torch.distributed import distributed_c10d

    try:
        distributed_c10d._world.group_count = 0
    except AttributeError:  # a private torch API: older or newer torch without it
        logger.debug("torch has no group counter to reset")


def _set_pg_timeout(timeout: datetime.timedelta) -> None:
    from torch.distributed import distributed_c10d

    try:
        distributed_c10d._set_pg_timeout(timeout)
    except Exception as exc:  # a private torch API: never fail training over it
        logger.warning("could not set the collective timeout to %s: %s", timeout, exc)


def init_distributed(options: DistributedOptions | None = None, *,
                     info: ClusterInfo | None = None,
                     resolver: Resolver | None = None) -> DistributedGroup:
    """Form the job's process group (the default torch group) and return its handle.

    Reads the cluster from the environment (our launcher, the platform's CLUSTER_SPEC /
    TF_CONFIG, torchrun, Kubeflow's PyTorchJob). Safe under parallel start: waits for the
    primary's name to resolve and its store to listen, and for every rank to arrive, up to
    ``join_timeout_s``; the error then names who never came.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        raise DistributedConfigError(
            "torch.distributed is already initialized: rt.main and init_distributed() form "
            "the process group themselves (and form it again after a peer's restart); remove "
            "the script's own init_process_group() call (and call init_distributed() once "
            "per process, or shutdown() the previous group)")
    # The environment wins over the code's options: an operator changes behaviour per job
    # (a longer join timeout, exit instead of recover) without editing the script.
    options = DistributedOptions.from_env(options)
    group = DistributedGroup(info or ClusterInfo.from_env(), options, resolver)
    group._form(0)
    return group
