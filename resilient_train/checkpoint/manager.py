"""CheckpointManager: save, keep and restore training state, through its collaborators.

The manager holds the parts and runs a save and a restore through them:

- when to save: :class:`~.scheduler.SaveScheduler` (the policy, the clock, SIGTERM, the
  agreement across ranks);
- how to write a step: :class:`~.writer.StepWriter` on a :class:`~.writer.WriterThread`;
- how to commit it: the storage's commit protocol, :mod:`.commit` (ATOMIC_RENAME or
  COMMIT_FILE, chosen once);
- what is in a directory (layout, scan, checks, retention): :mod:`.directory`.

A save that fails (a full disk, a storage error, a bug) commits nothing and removes what it
wrote: every rank reports to the primary through the commit's gather, also when its own
writes failed, and the primary deletes the step's directory once all of them are done
writing. The last committed step stays as it was. At start, before any rank of the new run
can save, the primary removes the temporary step directories that crashed runs left on
local disk; every rank holds a shared ``flock`` on the temporary directory it writes into,
so a directory that a live save (of another process, e.g. a second job started on the same
directory) still writes is skipped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import Classification, classify_exception
from ..lifecycle import say_once
from ..validate import NONE, expect_type, options
from .commit.directory import (
    default_directory,
)
from .commit.manifest import (
    CheckpointError,
    CorruptCheckpointError,
)
from .commit.retention import RetentionPolicy
from .commit.sharded import ShardedCheckpointer, uses_sharded_layout
from .commit.stepwriter import StepWriter, WriterThread
from .errors import TransientCheckpointError
from .progress import Progress
from .schedule.coordination import Coordinator, default_coordinator
from .schedule.emergency import CommitGate, Grace, Outcome, SaveAbandoned, remaining
from .schedule.policies import (
    FOUR_HOURS,
    PRIOR_MTBF_S,
    SavePolicy,
    check_ceiling,
    every_n_steps,
    resolve_mtbf,
    with_ceiling,
)
from .schedule.scheduler import Decision, SaveScheduler, SigtermWatch
from .state.advice import ScriptAdvice
from .state.capture import (
    HostSnapshot,
    capture_rng,
    check_weights_only,
    collect,
    has_dtensor,
    refuse_rank_local_state,
    refuse_stateless,
    restore,
    restore_rng,
    tree_nbytes,
    tree_on_host,
    unwrap_model,
)
from .state.kept import KeptObjects
from .state.overrides import describe, overridden
from .state.stepwrites import StepWrites, before_each_call, current_buffers, put_buffers
from .storage.base import RetryOptions, Storage, format_bytes
from .tiers import shards as shard_copies
from .tiers.early import Early
from .tiers.nodelocal import LocalTier, NodeLocal, PersistentCadence
from .tiers.peers import PeerMemory, PeerRing, process_memory
from .tiers.persistent import PersistentTier
from .tiers.plan import Plan, Recovered, carry_out, loads_rank_state, plan
from .tiers.restored import Restored, RestoreRecord, bytes_read
from .transport.ringlink import RingLink, local_address, new_token

log = logging.getLogger(__name__)

# How often a wait for the save in flight looks for a SIGTERM that came meanwhile.
SIGTERM_POLL_S = 0.1

# How long a peer-ring neighbour may take to connect, or to send its state at a step:
# as long as a collective may take (DistributedOptions.collective_timeout_s's default).
RING_TIMEOUT_S = 600.0


def _positive_seconds(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and 0 < value < math.inf)


@options
@dataclass(frozen=True)
class CheckpointOptions:
    """When to save, what to keep, how to write. One way to say when: ``save_every_steps=N``
    is short for ``policy=every_n_steps(N)``; either way the 4-hour ceiling
    (``max_interval_s``) joins it unless removed by name. Contradictions raise at once."""

    save_every_steps: int | None = None     # short for policy=every_n_steps(N)
    # The platform: a checkpoint at most 4 hours old, whatever the policy; None: no ceiling.
    max_interval_s: float | None = FOUR_HOURS
    policy: SavePolicy | None = None        # the general way; auto_interval() picks the
                                            # interval that maximizes goodput
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    async_save: bool = True
    retry: RetryOptions = field(default_factory=RetryOptions)
    storage_options: Mapping[str, Any] | None = None
    # Multi-rank: how often the ranks agree on the clock (time-based saves, SIGTERM).
    sync_interval_s: float = 1.0
    # None: not said here (the manager alone: off; under @rt.main: MainOptions decides, on).
    save_on_sigterm: bool | None = None
    # SIGTERM to SIGKILL: the emergency save commits within it or is abandoned
    # (schedule/emergency.py). None: $RESILIENT_TRAIN_SIGTERM_GRACE_S (the launcher's --grace), else
    # 30 s (a Spot VM's, the shortest the platform gives).
    sigterm_grace_s: float | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)   # JSON, in every manifest
    # Multi-rank: after a peer's restart, restore from the survivors' memory instead of
    # storage (tiers/peers.py). Costs each step a ring message of about 15 KB.
    peer_recovery: bool = True
    # Multi-rank, with peer_recovery: copy the parameters and optimizer state as each
    # step's first optimizer step begins, so that a survivor of a peer lost after it (a
    # GAN's second optimizer, a metric all-reduced after opt.step()) is taken back to the
    # step's start and recovers from memory, not from the last save. Costs that copy every
    # step, in memory on the parameters' device (state/stepwrites.py).
    undo_torn_steps: bool = False
    # An async save copies parameters and optimizer state to the host while the next step
    # computes; only the next optimizer step waits for that copy (state.HostSnapshot).
    overlap_snapshot: bool = True
    # A node-local tier (the machine's own disk) that every save goes to, the persistent
    # one (the checkpoint directory) every NodeLocal.persistent_every-th save: tiers/nodelocal.py.
    node_local: NodeLocal | None = None

    def __post_init__(self) -> None:
        n = self.save_every_steps
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"CheckpointOptions.save_every_steps={n!r}: expected a whole "
                             f"number >= 1, or None (no step-based saves)")
        expect_type("CheckpointOptions.policy", self.policy, (SavePolicy, NONE),
                    "a save policy such as rt.every_n_steps(1000) or rt.auto_interval()")
        if n is not None and self.policy is not None:
            raise ValueError(
                f"CheckpointOptions: save_every_steps={n} and policy={self.policy!r} both say "
                f"when to save; give one: policy=rt.every_n_steps({n}) | <your policy> "
                f"saves at whichever comes first")
        m = self.max_interval_s
        if m is not None and not _positive_seconds(m):
            raise ValueError(f"CheckpointOptions.max_interval_s={m!r}: expected a positive, "
                             f"finite number of seconds, or None (no ceiling)")
        if self.policy is not None:
            check_ceiling(self.policy, m)
        expect_type("CheckpointOptions.retention", self.retention, RetentionPolicy,
                    "rt.RetentionPolicy(keep_last=...)")
        expect_type("CheckpointOptions.retry", self.retry, RetryOptions, "rt.RetryOptions(...)")
        expect_type("CheckpointOptions.async_save", self.async_save, bool, "True or False")
        expect_type("CheckpointOptions.peer_recovery", self.peer_recovery, bool,
                    "True or False")
        expect_type("CheckpointOptions.undo_torn_steps", self.undo_torn_steps, bool,
                    "True or False")
        if self.undo_torn_steps and not self.peer_recovery:
            raise ValueError("CheckpointOptions: undo_torn_steps=True takes a torn step back "
                             "for peer recovery, which peer_recovery=False turns off: drop "
                             "one of them")
        expect_type("CheckpointOptions.overlap_snapshot", self.overlap_snapshot, bool,
                    "True or False")
        expect_type("CheckpointOptions.node_local", self.node_local, (NodeLocal, NONE),
                    "rt.NodeLocal(...), or None (no node-local tier)")
        expect_type("CheckpointOptions.save_on_sigterm", self.save_on_sigterm, (bool, NONE),
                    "True or False or None")
        g = self.sigterm_grace_s
        if g is not None and not _positive_seconds(g):
            raise ValueError(f"CheckpointOptions.sigterm_grace_s={g!r}: expected the "
                             f"SIGTERM-to-SIGKILL grace period in seconds (30 on a Spot VM, "
                             f"120 on a standard one), or None")
        if not _positive_seconds(self.sync_interval_s):
            raise ValueError(f"CheckpointOptions.sync_interval_s={self.sync_interval_s!r}: "
                             f"expected a positive, finite number of seconds")
        expect_type("CheckpointOptions.storage_options", self.storage_options, (Mapping, NONE),
                    "a dict of fsspec options, or None")
        try:  # here, not at the first save hours from now (commit/manifest.py writes it so)
            json.dumps(dict(self.metadata), sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"CheckpointOptions.metadata cannot be written into the "
                             f"manifest as JSON ({exc}): keep to str keys and str, number, "
                             f"bool, None, list or dict values") from None

    def save_policy(self) -> SavePolicy:
        """The policy the manager follows: ``policy`` (or every ``save_every_steps``) or
        ``max_interval_s`` after the last commit, whichever comes first."""
        given = self.policy
        if given is None and self.save_every_steps is not None:
            given = every_n_steps(self.save_every_steps)
        return with_ceiling(given, self.max_interval_s)


# What a restore's first half (CheckpointManager._fetch) got, per tier, for its second
# half (_load); ``record`` lacks only the restore's seconds.

@dataclass(frozen=True)
class _FromPeers:
    record: RestoreRecord
    plan: Plan
    got: Recovered
    sharded: bool


@dataclass(frozen=True)
class _FromLocal:
    record: RestoreRecord
    got: Recovered
    newest: int | None       # the persistent tier's newest committed step
    created: float           # when the restored step was saved
    since: int               # saves since the last persistent one (PersistentCadence)


_Fetched = _FromPeers | _FromLocal | Restored


class _Sharded(Exception):
    """Raised inside a hand-over: the state holds DTensors (tiers/shards.py restores it)."""


class CheckpointManager:
    """Save, keep and restore training state; see the module docstring for its parts."""

    def __init__(self, directory: str | os.PathLike[str] | None = None, *,
                 options: CheckpointOptions | None = None,
                 coordinator: Coordinator | None = None,
                 clock: Callable[[], float] = time.time,
                 peer_memory: PeerMemory | None = None) -> None:
        self.options = options or CheckpointOptions()
        self.directory = os.fspath(directory) if directory is not None else default_directory()
        watch = SigtermWatch(bool(self.options.save_on_sigterm))   # first: see its docstring
        self.storage = Storage(self.directory, retry=self.options.retry,
                               storage_options=self.options.storage_options)
        self.coord = coordinator or default_coordinator()
        self.rank, self.world_size = self.coord.rank, self.coord.world_size
        self.is_primary = self.rank == 0
        self.scheduler = SaveScheduler(self.options.save_policy(), self.coord, watch,
                                       clock=clock,
                                       sync_interval_s=self.options.sync_interval_s)
        self._sharded = ShardedCheckpointer(self.coord)  # FSDP2 / DTensor state: commit/sharded.py
        # SIGTERM: the gate that refuses a commit after the emergency save's deadline.
        self._gate = CommitGate()
        # The checkpoint directory (after the policy agreement: see its constructor).
        self._persistent = PersistentTier(
            self.storage, self.coord, self._sharded, self._gate,
            retention=self.options.retention, metadata=self.options.metadata,
            storage_options=self.options.storage_options)
        self.scheduler.start()
        self._tracked: dict[str, Any] = {}
        self.values: dict[str, Any] = {}
        self._snapshot = HostSnapshot()
        self._thread = WriterThread("rt-ckpt-writer")
        self._inflight: Future[None] | None = None
        self._writing = (0, time.monotonic())   # the last save's start: bytes moved, time
        self._writing_to: list[Storage] = []    # ... and the tiers it writes
        self._writing_tree: Any = None   # what it writes to each tier (progress)
        self._error: BaseException | None = None
        self.last_blocking_s = 0.0
        group = getattr(self.coord, "main_group", None)
        self._ring: PeerRing | None = None
        # What this process keeps across lives (tiers/peers.py): the state for peer recovery, and
        # which objects the last life trained, with peer recovery or without.
        self._memory = peer_memory or process_memory()
        # Objects built outside the training function, which the next life trains on.
        self._kept = KeptObjects(self._tracked, self._memory, self.rank)
        # The ring also carries each rank's RNG and values to the next rank's node-local
        # copy (tiers/nodelocal.py): a rank on a new machine finds them on its neighbour's disk.
        if (self.options.peer_recovery or self.options.node_local is not None) \
                and self.world_size > 1 and group is not None:
            # Collective: every rank connects to its ring neighbours (transport/ringlink.py).
            link = RingLink.connect(
                self.rank, self.world_size, self.coord.allgather,
                local_address(os.environ.get("MASTER_ADDR", "127.0.0.1"),
                              int(os.environ.get("MASTER_PORT", "0") or 0)),
                self.coord.broadcast(new_token()), timeout_s=RING_TIMEOUT_S)
            self._ring = PeerRing(self.rank, self.world_size, group, link, self._memory,
                                  StepWrites(self._tracked,
                                             before_step=self.options.undo_torn_steps))
        self._early: Early[_FromPeers] | None = None   # start_restore's transfers
        self.last_restore: RestoreRecord | None = None
        # The step pre-hooks on tracked optimizers, removed at close: a hook would keep
        # this manager (and its process groups) alive as long as the optimizer.
        self._hooks: list[Any] = []
        self._hooked: set[int] = set()
        # Optimizer (and GradScaler) steps called, and the count at the last boundary: a
        # save after a step without one may cut gradients being accumulated in two.
        self._steps_called = self._steps_at_boundary = 0
        self._advice = ScriptAdvice(self._tracked, self.is_primary)   # what to change
        self._local: LocalTier | None = None
        if self.options.node_local is not None:
            self._local = LocalTier(self.options.node_local, self.rank, self.world_size,
                                    self._persistent.token, self._sharded,
                                    self.storage.url)
        # Which saves go to the persistent tier too (every save without a node-local one).
        self._cadence = PersistentCadence(self.options.node_local, self.options.max_interval_s) \
            if self.options.node_local is not None else None
        # Read once, and only for an automatic K: it may read the launcher's failure log.
        self._mtbf = resolve_mtbf() if self._cadence is not None and \
            self._cadence.fixed is None else (PRIOR_MTBF_S, "prior")
        self._local_step: int | None = None   # the last step committed to the node-local tier
        # SIGTERM: the emergency save's deadline, and the gate that refuses a late commit.
        self._grace = Grace.resolve(self.options.sigterm_grace_s)
        self.abandoned = ""   # why the emergency save was abandoned, for the exit's line
        self.left_behind: threading.Thread | None = None   # its writer, left to the exit

    @property
    def last_commit_step(self) -> int | None:
        """The newest step committed to the checkpoint directory, as this life knows it."""
        return self._persistent.last_commit_step

    @last_commit_step.setter
    def last_commit_step(self, step: int | None) -> None:
        self._persistent.last_commit_step = step

    @property
    def writer(self) -> StepWriter:
        """How this rank writes its files of a step to the checkpoint directory."""
        return self._persistent.writer

    def latest_step(self) -> int | None:
        """The newest committed step in the checkpoint directory (its marker written), or
        None: a listing, no checkpoint read. For a process that follows a job's checkpoints
        (an evaluator): call ``restore_latest()`` when it moves."""
        return self._persistent.latest_step()

    @property
    def _peers(self) -> bool:
        """Peer recovery is on (the ring may also run for the node-local tier alone)."""
        return self._ring is not None and self.options.peer_recovery

    # --- what the scheduler owns, where callers read it ----------------------------------

    @property
    def policy(self) -> SavePolicy:
        """This life's copy of the save policy (the primary's on every rank)."""
        return self.scheduler.policy

    @property
    def clock(self) -> Callable[[], float]:
        return self.scheduler.clock

    @property
    def last_saved_step(self) -> int | None:
        """The step of the last save started (or of the restored checkpoint)."""
        return self.scheduler.last_save_step

    @last_saved_step.setter
    def last_saved_step(self, step: int | None) -> None:
        self.scheduler.last_save_step = step

    @property
    def sigterm_received(self) -> bool:
        return self.scheduler.sigterm_received

    # --- what to save -----------------------------------------------------------------

    def track(self, **objects: Any) -> None:
        """Objects with ``state_dict``/``load_state_dict`` (model, optimizer, scheduler,
        scaler), replicated on every rank; the primary writes them. A model compiled or
        wrapped (DDP) is tracked as the module underneath, so that its checkpoint's keys do
        not depend on the wrapping (state.unwrap_model)."""
        objects = {name: unwrap_model(obj) for name, obj in objects.items()}
        for name, obj in objects.items():
            refuse_rank_local_state(name, obj)
            refuse_stateless(name, obj)
        self._tracked.update(objects)
        self._advice.tracked()
        self._kept.tracked()
        import torch

        for obj in objects.values():
            if isinstance(obj, torch.optim.Optimizer) and id(obj) not in self._hooked:
                self._hooked.add(id(obj))
                self._hooks.append(obj.register_step_pre_hook(self._before_optimizer_step))
            elif isinstance(obj, torch.amp.GradScaler) and id(obj) not in self._hooked:
                self._hooked.add(id(obj))
                self._hooks.append(before_each_call(obj, "step", self._step_begins))

    # --- when to save -----------------------------------------------------------------

    @property
    def optimizer_steps(self) -> int:
        """Steps begun by the tracked optimizers and GradScalers (a skipped scaler step
        counts), in this manager's life."""
        return self._steps_called

    @property
    def stepped_since_boundary(self) -> bool:
        """Whether a tracked optimizer or GradScaler step began since the last
        :meth:`maybe_save` (a step boundary)."""
        return self._steps_called != self._steps_at_boundary

    def maybe_save(self, step: int) -> bool:
        """Call after each finished step (``step`` = steps done). Saves when the policy says so;
        cheap otherwise. Returns True when a save was started."""
        # The step is done even when the save before it failed (a peer lost in its
        # collective): its boundary first, so that this life's hand-over keeps its state.
        if self._ring is not None:
            self._ring.boundary(step, self._rank_state, self.values)
        self._kept.boundary()
        stepped, self._steps_at_boundary = self.stepped_since_boundary, self._steps_called
        self._advice.boundary(step, self._steps_called)
        if self._error is not None:
            self._raise_error()
        decision = self.scheduler.decide(step)
        if decision is Decision.SKIP:
            return False
        if not stepped:
            self._advice.saving_without_a_step(step)
        if decision is Decision.EMERGENCY:
            self._exit_after_emergency(step, self.emergency_save(step))
        else:
            self.save(step, persistent=self._persistent_due())
        return True

    # --- saving -----------------------------------------------------------------------

    def _persistent_due(self) -> bool:
        """Whether a save by policy goes to the persistent tier as well as the node-local
        one (always, without a node-local tier)."""
        if self._cadence is None or self.scheduler.shared_local_failing:
            return True   # a machine's disk failed its last save: every save to storage too
        sched = self.scheduler
        mtbf = self._mtbf if sched.shared_mtbf is None else (sched.shared_mtbf, "observed")
        return self._cadence.due(*sched.shared_tier_s, sched.policy_interval, mtbf)

    def save(self, step: int, *, blocking: bool | None = None, persistent: bool = True,
             node_local: bool = True) -> None:
        """Save now. Blocks only for the in-memory snapshot unless ``blocking`` (or the
        options) say otherwise; one save is in flight at a time. With a node-local tier
        the save goes there (unless ``node_local`` is False), and to the persistent tier
        too when ``persistent``."""
        if self._error is not None:
            self._raise_error()
        t_wait = time.perf_counter()
        self._wait_or_leave()
        self._advice.saving(step, self._steps_called)
        sync = bool(blocking or (blocking is None and not self.options.async_save))
        self._save(step, sync=sync, persistent=persistent, node_local=node_local,
                   overlap=self.options.overlap_snapshot)
        # All this call held the loop for (the goodput's checkpoint time): waiting for the
        # previous write and the checks too, not only the snapshot (and a blocking write).
        self.last_blocking_s = time.perf_counter() - t_wait
        self.scheduler.measured(self.last_blocking_s)

    def _save(self, step: int, *, sync: bool, persistent: bool, overlap: bool,
              node_local: bool = True) -> None:
        """Snapshot and write (``sync``) or hand to the writer thread; the last save done."""
        tree: dict[str, Any] = {"rank": self._rank_state()}
        staged = self._sharded.stage(self._tracked)  # None unless some state is a DTensor
        # Sharded: persistent only.
        local = node_local and self._local is not None and staged is None
        persistent = persistent or not local
        if self._cadence is not None:
            self._cadence.saved(persistent)
        # A machine's copy holds the replicated state too, and so does a sharded save's
        # copy in a neighbour's memory (tiers/shards.py).
        if self.is_primary or local or (staged is not None and self._peers):
            tree["shared"] = staged.replicated if staged else collect(self._tracked)
        check_weights_only(tree, where="checkpoint state")
        # A blocking save writes the live state (nothing can change it meanwhile); an async
        # one copies it into reused host buffers first, and that copy is all it blocks for.
        # Accelerator state always goes through the host copy, so every file holds CPU
        # tensors: torch.load(weights_only=True) reads it on a machine without a GPU.
        defer = self._deferrable() if not sync and overlap else frozenset()
        snap = tree if sync and tree_on_host(tree) else self._snapshot.snapshot(tree,
                                                                                defer=defer)
        if staged is not None:
            snap["dcp"] = staged  # already a host copy: DCP's stager made it
        self.scheduler.saving(step)
        self._writing_to = ([self._local.storage] if local and self._local else []) + \
            ([self.storage] if persistent else [])
        self._writing = (self._moved(), time.monotonic())
        # Its size, for the progress lines, is summed only if the loop waits for it. A
        # sharded save's total is DCP's to know.
        self._writing_tree = snap if "dcp" not in snap else None
        if sync:
            with self._progress_of_save():
                self._write_tiers(step, snap, local, persistent)
            # Deleting old steps (about 1 s per GB on some disks) and the writer record (two
            # requests to a bucket) need not block anyone.
            self._inflight = self._thread.submit(self._after_commit)
        else:
            self._inflight = self._thread.submit(self._write_guarded, step, snap, local,
                                                 persistent)

    def save_final(self, step: int) -> None:
        """The run's last step, committed to the persistent tier before this returns: the
        machines' own disks do not outlive the job, its output must hold the step. Nothing
        to do where the last save was of this step and went there too (with a node-local
        tier, most saves go to the machine's disk alone). A SIGTERM meanwhile: a save that
        cannot commit before its grace period ends is abandoned, and this rank leaves with
        exit 134, as at any other step (the previous step stays the latest)."""
        self._wait_or_leave()
        saved = self.last_saved_step == step
        if saved and (self._cadence is None or self._cadence.since == 0):
            return
        self.save(step, persistent=True, node_local=not saved)
        self._wait_or_leave()

    def emergency_save(self, step: int) -> bool:
        """SIGTERM: save ``step`` to every tier, the fastest first, and have it committed
        before the grace period ends (schedule/emergency.py); True once it is. False: abandoned at
        the deadline (logged), and the last committed step stays the latest."""
        if self._error is not None:
            self._raise_error()
        # The ranks' agreed clock; the handler's own when no step boundary agreed on it.
        elapsed = max(self.scheduler.sigterm_elapsed_s, self.scheduler.watch.elapsed() or 0.0)
        budget = self._grace.budget(elapsed)
        deadline = time.monotonic() + budget
        # The save before it (its host buffers are reused), then this one.
        if budget > 0 and self._finished_by(self._inflight, deadline):
            self.wait()
            self._save(step, sync=False, persistent=True, overlap=False)
            done = self._inflight
            if self.world_size > 1:   # and the primary's commit, which ends the save
                done = self._thread.submit(self._await_commit)
            if self._finished_by(done, deadline):
                self.wait()
                return True
        return self._abandon(step, budget)

    def _wait_or_leave(self) -> None:
        """wait(); but once a SIGTERM has come (before or during the wait), only until its
        deadline: then the save in flight is abandoned and this rank leaves (exit 134)."""
        fut, watch = self._inflight, self.scheduler.watch
        while fut is not None and self.options.save_on_sigterm and not watch.received:
            try:   # slices: the handler runs during the wait but cannot end it
                fut.result(timeout=SIGTERM_POLL_S)
                break
            except FutureTimeout:
                continue
        if fut is not None and watch.received:
            budget = self._grace.budget(watch.elapsed() or 0.0)
            if not self._finished_by(fut, time.monotonic() + budget):
                step = self.scheduler.last_save_step or 0   # the step that save writes
                self._exit_after_emergency(step, self._abandon(step, budget))
        self.wait()

    @staticmethod
    def _finished_by(fut: Future[None] | None, deadline: float) -> bool:
        if fut is None:
            return True
        try:
            fut.result(timeout=remaining(deadline))
        except FutureTimeout:
            return False
        return True

    def _await_commit(self) -> None:
        """Writer thread: the ranks wait for the primary, which commits before it joins."""
        try:
            self.coord.writer_barrier()
        except Exception as exc:  # noqa: BLE001 - a peer lost meanwhile: raised by wait()
            self._error = self._error or exc

    def _abandon(self, step: int, budget: float) -> bool:
        """The deadline passed: refuse the commit, leave the writer thread to the exit.
        True when the step's commit got in first after all."""
        outcome = self._gate.close(step, timeout_s=self._grace.reserve_s / 2)
        # A daemon thread; what it was writing is never committed.
        self.left_behind = self._thread.abandon()
        self._thread = WriterThread("rt-ckpt-writer")
        self._inflight = None
        if self.is_primary and outcome is Outcome.COMMITTED:
            return True
        before = "none" if self.last_commit_step is None else f"step {self.last_commit_step}"
        if self.is_primary and outcome is Outcome.ABANDONED:
            last = f"{before} stays the latest"
        else:   # the primary commits: only it knows whether the marker lands
            last = f"the latest is step {step} if its commit landed, else {before}"
        local = f"; step {step} is on this machine's node-local disk" \
            if self._local_step == step else ""
        spent = f"the grace period, {self._grace.describe()}, had " + (
            f"{budget:.1f} s left for it" if budget > 0 else "no time left for it")
        what = "was abandoned" if outcome is Outcome.ABANDONED else \
            "was still committing at the deadline"
        self.abandoned = (f"the checkpoint of step {step} {what}: not committed "
                          f"in time ({spent}); {last}{local}")
        if not self.scheduler.sigterm_received:   # the signalled rank says it as it exits
            log.warning("SIGTERM on a peer: %s", self.abandoned)
        return False

    def _before_optimizer_step(self, *_: Any) -> None:
        self._step_begins()
        if self._ring is not None:   # after the exchange: one that failed began no step
            self._ring.writes.began()
        # The snapshot of a save may still be copying what this step overwrites. A failed
        # copy is the save's failure: the writer raises it, not the training step.
        self._snapshot.wait(errors=False)

    def _step_begins(self) -> None:
        """A step of the tracked optimizers or GradScalers begins (a step the scaler
        skips, for an inf gradient, calls no optimizer's step but is one all the same):
        the ring's exchange, once per step, then the count."""
        if self._ring is not None:
            self._ring.send_early(self._rank_state)
        self._steps_called += 1

    def _deferrable(self) -> frozenset[int]:
        """Storage addresses of what only the tracked optimizers' steps write: their
        parameters and their state. A snapshot may copy these while the next step's
        forward and backward run (HostSnapshot.snapshot)."""
        import torch

        ptrs: set[int] = set()
        for obj in self._tracked.values():
            if isinstance(obj, torch.optim.Optimizer):
                ptrs.update(p.data_ptr() for g in obj.param_groups for p in g["params"])
                ptrs.update(v.data_ptr() for st in obj.state.values() for v in st.values()
                            if isinstance(v, torch.Tensor))
        return frozenset(ptrs)

    def _rank_state(self) -> dict[str, Any]:
        """What differs per rank and is saved per rank: the RNG streams, ``values``, and
        the buffers that steps write (batch norm's statistics: each rank's own)."""
        state: dict[str, Any] = {"rng": capture_rng(), "values": dict(self.values)}
        buffers = current_buffers(self._tracked) if self.world_size > 1 else None
        if buffers:
            state["buffers"] = buffers
        return state

    def hand_over(self, step: int) -> None:
        """This life ends on an error after ``step`` finished steps: leave its state in the
        process's memory, where the next life's restore finds it (tiers/peers.py). A reference,
        not a copy; nothing when the state is not that of step ``step``'s boundary."""
        self._kept.hand_over(trained=step > 0 or self._steps_called > 0)   # peers or not
        if not self._peers:
            return
        assert self._ring is not None
        self._ring.memory.shards_handed_over = True   # sharded saves' copies: usable now

        def state() -> dict[str, Any]:
            tree = collect(self._tracked)
            if has_dtensor(tree):
                raise _Sharded
            return tree

        try:
            self._ring.hand_over(step, state, self.scheduler.save_point,
                                 self.last_commit_step)
        except _Sharded:
            # Not the live state: a shard has no second holder but the last save's copy.
            self._ring.memory.why_not = ("sharded (DTensor) state: restored from the last "
                                         "save's copies in memory (tiers/shards.py)")

    def wait(self) -> None:
        """Block until the save in flight is committed; raise its error if it failed."""
        fut, self._inflight = self._inflight, None
        if fut is not None:
            # _write_guarded never raises; errors land in self._error
            with contextlib.nullcontext() if fut.done() else self._progress_of_save():
                fut.result()
        if self._error is not None:
            self._raise_error()

    def _moved(self) -> int:
        """Bytes the last save's tiers have written, in all (what its progress counts)."""
        return sum(st.bytes_moved for st in self._writing_to)

    def _progress_of_save(self) -> Progress:
        """Lines on the primary while the loop waits for a long write (the final save of
        tens of GB, a save that the next one waits for), counted from the save's start."""
        tree = self._writing_tree if self.is_primary else None
        tiers = self._writing_to or [self.storage]
        # What goes into the primary's files (the replicated state and its rank's) in each
        # tier, less their headers.
        total = tree_nbytes(tree) * len(tiers) if tree is not None else None
        return Progress(f"saving step {self.scheduler.last_save_step} to "
                        f"{' and '.join(st.url for st in tiers)}", self._moved, total=total,
                        since=self._writing, after_s=None if self.is_primary else math.inf,
                        log=log)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            for hook in reversed(self._hooks):   # a wrapper puts back what it found
                hook.remove()
            self._hooks.clear()
            if self._ring is not None:
                self._ring.link.close()
            self._thread.shutdown()
            self._sharded.close()
            self.scheduler.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
            return
        # An exception is on its way out (often a peer that died): still wait for the save in
        # flight, so nothing commits behind a restore that follows, but do not let its
        # failure (usually the same dead peer) hide the exception that matters.
        try:
            self.close()
        except Exception as exc:
            log.warning("the save in flight failed while leaving on an error: %s", exc)

    def _raise_error(self) -> None:
        err, self._error = self._error, None
        assert err is not None
        # Keep the cause's class: a save lost to a storage outage or a dead peer is worth a
        # retry (exit 134), a save that failed on a bug is not (exit 1).
        transient = classify_exception(err) is Classification.TRANSIENT
        cls = TransientCheckpointError if transient else CheckpointError
        raise cls(f"a background checkpoint save failed: {err}") from err

    def _write_guarded(self, step: int, snap: dict[str, Any], local: bool,
                       persistent: bool) -> None:
        try:
            self._write_tiers(step, snap, local, persistent)
        except SaveAbandoned:   # expected: the emergency save's deadline passed (logged)
            return
        except BaseException as exc:  # never lost: raised on the next call
            log.error("checkpoint save of step %d failed: %s", step, exc)
            self._error = exc
            return
        self._after_commit()

    def _write_tiers(self, step: int, snap: dict[str, Any], local: bool,
                     persistent: bool) -> None:
        """The node-local copy first (fast, and what a restart in place reads), then the
        persistent one. A node-local failure only warns (LocalTier.save): the persistent
        tier still holds every step it committed, takes every save until the machine's
        disk works again, and the next save tries that disk again."""
        if "dcp" in snap and self._peers:
            self._copy_shards(step, snap)   # memory first: the fastest tier
        if local:
            assert self._local is not None
            self._snapshot.wait()   # its deferred copies (an overlapped snapshot)
            t0 = time.perf_counter()
            if self._local.save(step, snap, self._partner_copy(step)):
                self.scheduler.wrote(0, time.perf_counter() - t0)
                self._local_step = step
            self.scheduler.local_failing(bool(self._local.failing))
        if persistent:
            if not self.is_primary:
                snap = {k: v for k, v in snap.items() if k != "shared"}   # the primary's
            t0 = time.perf_counter()
            self._persistent.write(step, snap, self._snapshot.wait)
            self.scheduler.wrote(1, time.perf_counter() - t0)

    def _copy_shards(self, step: int, snap: dict[str, Any]) -> None:
        """Writer thread, a sharded save: this rank's shard to the next rank's memory, the
        previous rank's into ours (tiers/shards.py); the older save's copies are dropped
        once every rank holds these."""
        assert self._ring is not None
        t0 = time.perf_counter()
        own = shard_copies.pack(snap["dcp"].dcp_state, snap["shared"], snap["rank"])
        group = getattr(self.coord, "writer_group", None)
        link = self._ring.link
        got = shard_copies.exchange(own, link.next, link.prev, group)
        shard_copies.keep(self._ring.memory, self.storage.url, step, own, got, link.prev,
                          self.scheduler.save_point[1])
        self.coord.writer_barrier()
        shard_copies.confirm(self._ring.memory, step)
        log.debug("step %d: shard copies exchanged (%s out, %s in) in %.2f s", step,
                  format_bytes(len(own)), format_bytes(len(got)), time.perf_counter() - t0)

    def _partner_copy(self, step: int) -> tuple[int, dict[str, Any]] | None:
        """The previous rank's per-rank state of ``step`` that the peer ring gave this
        rank, for its machine's copy (tiers/nodelocal.py); None without one."""
        if self._ring is None:
            return None
        memory = self._ring.memory
        payload = memory.partner.get(step)
        if payload is None or memory.partner_rank is None:
            return None
        return memory.partner_rank, loads_rank_state(payload)

    def _after_commit(self) -> None:
        """Writer thread, after a save: the persistent tier's writer record and retention."""
        self._persistent.after_commit(stopping=self.scheduler.sigterm_received)

    # --- restoring --------------------------------------------------------------------

    def start_restore(self) -> None:
        """Begin this life's restore from live peers before the training code builds what it
        restores into (tiers/early.py): the ranks agree on the plan now and the state moves in a
        thread while the training function builds; ``restore_latest`` joins it and loads.
        A collective: every rank calls this at the same point, as rt.main does before the
        training function. Nothing starts without a plan from memory: a restore from disk
        or storage, run early too, gained nothing here (its reads and broadcast competed
        with the build for the same cores and the process's GIL), so it waits for
        ``restore_latest``."""
        self._kept.take_over()
        if not self._peers or self._early is not None:
            return
        assert self._ring is not None
        the_plan = plan(self.coord.allgather(self._ring.report()))
        if isinstance(the_plan, Plan):
            self._early = Early(lambda: self._fetch_from_peers(the_plan, sharded=False),
                                f"the state of step {the_plan.step} from peers")

    def restore_latest(self, *, strict: bool = True) -> int | None:
        """Load the newest state into the tracked objects, the RNGs and ``values``; return
        its step, or None when there is none at all. After an in-process recovery that is
        the survivors' memory (tiers/peers.py: at most the step in flight lost, no storage read);
        otherwise the node-local tier's newest step that every rank can get, else the
        newest committed step that verifies, read once and streamed to every rank. ``last_restore``
        says which, with the bytes read per tier.
        A corrupt latest falls back to the previous one with a warning; if checkpoints
        exist but none verifies, raise instead of silently starting from scratch."""
        self.wait()
        t0 = time.perf_counter()
        early, self._early = self._early, None
        fetched = early.result() if early is not None \
            else self._fetch(uses_sharded_layout(self._tracked))
        step = self._load(fetched, strict, "" if early is None else
                          f" in {early.seconds:.2f} s while the model was built")
        held = "no survivor holds the last step, and " if self._peers else ""
        self._kept.after_restore(step, f"{held}{self.storage.url} has no checkpoint")
        self.last_restore = replace(fetched.record, seconds=time.perf_counter() - t0)
        if self._ring is not None and step:
            self._ring.restored(step, self._rank_state())
        return step

    # A restore in two halves: _fetch (which tier and step, every rank's bytes: nothing of
    # the tracked objects, so it may run early, in a thread) and _load (into the objects).

    def _fetch(self, sharded: bool) -> _Fetched:
        """The state to load, from the fastest tier that every rank can get it from."""
        reason = ""
        self._kept.take_over()   # when start_restore did not
        if self._peers:
            assert self._ring is not None
            mine = shard_copies.report(self._ring.memory, self.rank, self.storage.url) \
                if sharded else self._ring.report()
            the_plan = plan(self.coord.allgather(mine))
            if isinstance(the_plan, Plan):
                return self._fetch_from_peers(the_plan, sharded)
            reason = the_plan.reason
            if self.is_primary:   # one line for the job: every rank computed the same plan
                (log.warning if the_plan.survivors else log.info)(
                    "restoring from %s, not from peers: %s", self.storage.url, reason)
        if self._local is not None:
            local = self._fetch_from_local()
            if not isinstance(local, str):
                return replace(local, record=replace(local.record, reason=reason))
            reason = f"{reason}; {local}" if reason else local
        return self._persistent.restore(reason)

    def _load(self, fetched: _Fetched, strict: bool, early: str = "") -> int | None:
        """Load what _fetch got into the tracked objects, the RNGs and ``values``.
        ``early``: " in N s while the model was built" (start_restore's transfers), for
        the log line, or ""."""
        if isinstance(fetched, _FromPeers):
            return self._load_from_peers(fetched, strict, early)
        if isinstance(fetched, _FromLocal):
            got = fetched.got
            self._load_trees(got.shared, got.mine, strict)
            self.last_commit_step = fetched.newest
            self.scheduler.restored(got.step, fetched.created)
            assert self._cadence is not None
            self._cadence.since = fetched.since
            log.info("restored checkpoint step %d from the node-local tier%s", got.step,
                     "" if got.from_rank is None else f" (rank {got.from_rank}'s machine)")
            return got.step
        if fetched.step is None:
            return None
        if fetched.load is not None:   # what the replicated tree cannot carry (sharded)
            fetched.load(self._tracked, strict)
        self._load_trees(fetched.shared, fetched.mine, strict)
        self.scheduler.restored(*fetched.save_point)
        self._persistent.restored(fetched)
        log.info("%s", fetched.message)
        return fetched.step

    def _fetch_from_peers(self, the_plan: Plan, sharded: bool) -> _FromPeers:
        assert self._ring is not None
        if sharded:   # a save's shards, from each rank's memory or its neighbour's
            got = carry_out(the_plan, shard_copies.ShardHoldings(self._ring.memory),
                            self.rank, self._ring.group)
            giver = the_plan.rank_source[self.rank]   # where its shard, the bulk, came from
            from_rank = None if giver == self.rank else giver
        else:
            got = self._ring.transfer(the_plan)
            from_rank = got.from_rank
        record = RestoreRecord(step=got.step, source="peer", seconds=0.0,
                               bytes_read=bytes_read(peer=got.nbytes), from_rank=from_rank)
        return _FromPeers(record, the_plan, got, sharded)

    def _load_from_peers(self, fetched: _FromPeers, strict: bool, early: str) -> int:
        assert self._ring is not None
        got = fetched.got
        if fetched.sharded:
            shard_copies.load(self._tracked, got.mine["dcp"], got.shared, strict=strict)
            self._load_trees(None, got.mine["rank"], strict)
        else:
            got = self._ring.adopt(fetched.plan, got)
            self._load_trees(got.shared, got.mine, strict)
        self.last_commit_step = got.last_commit
        self.scheduler.restored(*got.save_point)
        log.info("restored step %d from %s (%s of state received%s), no storage read",
                 got.step, "memory" if fetched.record.from_rank is None else
                 f"rank {fetched.record.from_rank}", format_bytes(got.nbytes), early)
        return got.step

    def _fetch_from_local(self) -> _FromLocal | str:
        """From the machines' disks by plan (tiers/plan.py): the newest step, no older
        than the persistent tier's newest, that every rank can get from its own disk or
        another rank's; else why not."""
        assert self._local is not None
        newest = self.coord.broadcast(self.latest_step() if self.is_primary else None)
        reports = self.coord.allgather(self._local.report(newest))
        bad: set[int] = set()
        while True:
            usable = [replace(r, replicated=tuple(s for s in r.replicated if s not in bad),
                              own=tuple(s for s in r.own if s not in bad),
                              held=tuple(s for s in r.held if s not in bad)) for r in reports]
            the_plan = plan(usable, where="on the machines' disks",
                            nothing="a fresh start, or every machine is new")
            if not isinstance(the_plan, Plan):
                if bad:   # what was there did not verify: say that, not "nothing there"
                    return (f"the node-local copy of step(s) "
                            f"{', '.join(map(str, sorted(bad)))} does not verify on some rank")
                return the_plan.reason
            holdings = None
            try:
                holdings = self._local.holdings(the_plan)
            except CorruptCheckpointError as exc:
                log.warning("node-local checkpoint of step %d does not verify: %s",
                            the_plan.step, exc)
            # Every rank's part verified, or this step is skipped by all (no transfer waits
            # on a rank that could not read its part).
            if self.coord.allreduce_max([0 if holdings else 1])[0] or holdings is None:
                bad.add(the_plan.step)
                continue
            got = carry_out(the_plan, holdings, self.rank,
                            getattr(self.coord, "main_group", None))
            break
        # Saves since the last persistent one, alike on every rank (they must all decide
        # alike which save goes to storage): the holder's, up to the restored step.
        since = sum(1 for s in reports[the_plan.holder].own
                    if s <= got.step and (newest is None or s > newest))
        record = RestoreRecord(
            step=got.step, source="node-local", seconds=0.0,
            bytes_read=bytes_read(node_local=self._local.read_bytes, peer=got.nbytes),
            from_rank=got.from_rank, where=self._local.url)
        return _FromLocal(record, got, newest, holdings.created or time.time(), since)

    def _load_trees(self, shared: dict[str, Any] | None, mine: dict[str, Any],
                    strict: bool) -> None:
        """Load a replicated tree into the tracked objects (None: already loaded, sharded)
        and a per-rank tree into the RNGs (when it has them) and ``values``."""
        if shared is not None:
            replaced = overridden(self._tracked, shared) if self.is_primary else []
            restore(self._tracked, shared, strict=strict)
            if replaced:   # once per setting: every life would say it again, and a
                # script that sets one by hand each step (a weight decay schedule) too
                say_once(log, "overridden " + "; ".join(r.what for r in replaced),
                         logging.WARNING, "%s", describe(replaced))
        if "rng" in mine:
            restore_rng(mine["rng"])
        if mine.get("buffers"):
            put_buffers(self._tracked, mine["buffers"])
        self.values.clear()
        self.values.update(mine["values"])

    # --- SIGTERM ----------------------------------------------------------------------

    def _exit_after_emergency(self, step: int, committed: bool) -> None:
        """The signalled rank leaves (exit 134), saying whether its save committed; the
        others saved with it and go on (they learn of its exit at the next collective)."""
        from ..errors import exit_transient

        if self.scheduler.sigterm_received:
            self.close()
            exit_transient(f"SIGTERM: emergency checkpoint of step {step} committed"
                           if committed else f"SIGTERM: {self.abandoned}", one_line=True)
