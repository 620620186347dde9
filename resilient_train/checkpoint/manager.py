"""CheckpointManager: save, keep and restore training state, through its tiers.

The manager holds an ordered list of recovery tiers, fastest first (tiers/tier.py: one
interface): the live peers' memory (tiers/peertier.py), the machines' own disks
(tiers/nodelocal.py), the checkpoint directory (tiers/persistent.py). It decides nothing
about any one of them:

- when to save: :class:`~.schedule.scheduler.SaveScheduler` (the policy, the clock,
  SIGTERM, the agreement across ranks); which saves reach the persistent tier: the
  node-local tier's cadence, or every save;
- a save: one host snapshot (state/capture.py), written on the writer thread to every tier
  that takes it, fastest first; a failure is raised at the next call;
- a restore: the first tier that can give every rank the same step, each faster one saying
  why not; what it gives (:class:`~.tiers.restored.Restored`) is loaded the same way
  whatever the tier.

A save that fails commits nothing (the persistent tier removes what it wrote) and the last
committed step stays as it was.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .commit.directory import default_directory
from .commit.sharded import ShardedCheckpointer, uses_sharded_layout
from .commit.stepwriter import StepWriter
from .inflight import SaveInFlight
from .lastsave import LastSave
from .options import CheckpointOptions
from .schedule.coordination import Coordinator, default_coordinator
from .schedule.emergency import CommitGate, Grace, SaveAbandoned
from .schedule.policies import SavePolicy
from .schedule.scheduler import Decision, SaveScheduler, SigtermWatch
from .state.advice import ScriptAdvice
from .state.capture import HostSnapshot, check_weights_only, collect, tree_on_host
from .state.kept import KeptObjects
from .state.tracked import Tracked
from .storage.base import Storage
from .tiers.assemble import fast_tiers
from .tiers.chain import TierChain
from .tiers.early import Early
from .tiers.peers import PeerMemory, process_memory
from .tiers.persistent import PersistentTier
from .tiers.restored import Restored, RestoreRecord
from .tiers.tier import SaveRequest, Tier

__all__ = ["CheckpointManager", "CheckpointOptions"]

log = logging.getLogger(__name__)


class CheckpointManager:
    """Save, keep and restore training state; see the module docstring for its parts."""

    def __init__(self, directory: str | os.PathLike[str] | None = None, *,
                 options: CheckpointOptions | None = None,
                 coordinator: Coordinator | None = None,
                 clock: Callable[[], float] = time.time,
                 peer_memory: PeerMemory | None = None,
                 tiers: tuple[Tier, ...] = (),
                 storage: Storage | None = None) -> None:
        """``tiers``: more places to save to and restore from, tried after the built-in
        fast tiers and before the persistent one (tiers/tier.py: the interface).
        ``storage``: the handle of ``directory`` an earlier life of this process opened
        (``rt.main`` keeps it: runtime.py), else a new one."""
        self.options = opts = options or CheckpointOptions()
        self.directory = os.fspath(directory) if directory is not None else default_directory()
        watch = SigtermWatch(bool(opts.save_on_sigterm))   # first: see its docstring
        self.storage = storage or Storage(self.directory, retry=opts.retry,
                                          storage_options=opts.storage_options)
        self.coord = coordinator or default_coordinator()
        self.rank, self.world_size = self.coord.rank, self.coord.world_size
        self.is_primary = self.rank == 0
        self.scheduler = SaveScheduler(opts.save_policy(), self.coord, watch, clock=clock,
                                       sync_interval_s=opts.sync_interval_s)
        self._sharded = ShardedCheckpointer(self.coord)  # FSDP2 / DTensor state: commit/sharded.py
        self._gate = CommitGate()   # refuses a commit after SIGTERM's save's deadline
        # The checkpoint directory (after the policy agreement: see its constructor).
        self._persistent = PersistentTier(
            self.storage, self.coord, self._sharded, self._gate, retention=opts.retention,
            metadata=opts.metadata, storage_options=opts.storage_options)
        self.scheduler.start()
        self._state = Tracked(self.is_primary, self.world_size, self._step_begins)
        self._tracked = self._state.objects
        self._snapshot = HostSnapshot()
        self._inflight = SaveInFlight(self.is_primary)
        self.last_blocking_s = 0.0
        # What this process keeps across lives (tiers/peers.py).
        self._memory = peer_memory or process_memory()
        self._kept = KeptObjects(self._tracked, self._memory, self.rank)   # a later life's
        # The peers' memory and the machine's disk, as asked (a collective: the ring
        # that carries each rank's own state to the next one every step connects).
        fast = fast_tiers(opts, self.coord, self._memory, self._tracked,
                          url=self.storage.url, token=self._persistent.token,
                          sharded=self._sharded, newest=self.latest_step,
                          save_point=lambda: (self.scheduler.save_point, self.last_commit_step))
        self._ring, self._cadence = fast.ring, fast.cadence
        # Fastest first: a save writes them in this order, a restore tries them in it.
        self._tiers = TierChain((*fast.tiers, *tiers, self._persistent))
        self._early: Early[Restored] | None = None   # start_restore's transfers
        self.last_restore: RestoreRecord | None = None   # where the last restore came from
        self._advice = ScriptAdvice(self._tracked, self.is_primary)   # what to change
        # SIGTERM: the save committed before the grace period ends, or abandoned.
        self._last = LastSave(
            self._inflight, self.scheduler, self.coord, self._gate,
            Grace.resolve(opts.sigterm_grace_s), watching=bool(opts.save_on_sigterm),
            save=lambda step: self._save(step, sync=False, persistent=True, overlap=False),
            close=self.close, last_commit=lambda: self.last_commit_step,
            on_disk=lambda step: self._tiers.kept.get("node-local") == step)

    # --- what the tiers and the scheduler own, where callers read it ---------------------

    @property
    def last_commit_step(self) -> int | None:
        """The newest step committed to the checkpoint directory, as this life knows it."""
        return self._persistent.last_commit_step

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
    def values(self) -> dict[str, Any]:
        """This rank's own values (``ctx.values``), saved per rank and restored with it."""
        return self._state.values

    @values.setter
    def values(self, values: dict[str, Any]) -> None:   # rt.main hands its context's dict
        self._state.values = values

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

    # --- what to save -----------------------------------------------------------------

    def track(self, **objects: Any) -> None:
        """Objects with ``state_dict``/``load_state_dict`` (model, optimizer, scheduler,
        scaler), replicated on every rank; the primary writes them. A compiled or wrapped
        (DDP) model is tracked as the module underneath (state/tracked.py)."""
        self._state.add(**objects)
        self._advice.tracked()
        self._kept.tracked()

    @property
    def optimizer_steps(self) -> int:
        """Steps begun by the tracked optimizers and GradScalers (a skipped scaler step
        counts), in this manager's life."""
        return self._state.steps_called

    @property
    def stepped_since_boundary(self) -> bool:
        """Whether a tracked optimizer or GradScaler step began since the last
        :meth:`maybe_save` (a step boundary)."""
        return self._state.steps_called != self._state.steps_at_boundary

    def _step_begins(self, optimizer: bool) -> None:
        """A tracked optimizer's (or GradScaler's) step begins: the ring's exchange, once
        per step; before an optimizer step, the snapshot of a save that may still copy
        what it overwrites (its failure is the save's, raised by the writer)."""
        if self._ring is not None:
            self._ring.send_early(self._state.rank_state)
            if optimizer:   # after the exchange: one that failed began no step
                self._ring.writes.began()
        if optimizer:
            self._snapshot.wait(errors=False)

    # --- when to save -----------------------------------------------------------------

    def maybe_save(self, step: int) -> bool:
        """Call after each finished step (``step`` = steps done). Saves when the policy says so;
        cheap otherwise. Returns True when a save was started."""
        # The step is done even when the save before it failed (a peer lost in its
        # collective): its boundary first, so that this life's hand-over keeps its state.
        if self._ring is not None:
            self._ring.boundary(step, self._state.rank_state, self.values)
        self._kept.boundary()
        stepped = self._state.boundary()
        self._advice.boundary(step, self._state.steps_called)
        self._inflight.check()
        decision = self.scheduler.decide(step)
        if decision is Decision.SKIP:
            return False
        if not stepped:
            self._advice.saving_without_a_step(step)
        if decision is Decision.EMERGENCY:
            self._last.leave(step, self.emergency_save(step))
        else:
            # With a node-local tier, its cadence says which saves go to storage too.
            self.save(step, persistent=self._cadence is None or
                      self._cadence.due_now(self.scheduler))
        return True

    # --- saving -----------------------------------------------------------------------

    def save(self, step: int, *, blocking: bool | None = None, persistent: bool = True,
             node_local: bool = True) -> None:
        """Save now. Blocks only for the in-memory snapshot unless ``blocking`` (or the
        options) say otherwise; one save is in flight at a time. With a node-local tier
        the save goes there (unless ``node_local`` is False), and to the persistent tier
        too when ``persistent``."""
        self._inflight.check()
        t_wait = time.perf_counter()
        self._last.wait_or_leave()
        self._advice.saving(step, self._state.steps_called)
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
        tree: dict[str, Any] = {"rank": self._state.rank_state()}
        staged = self._sharded.stage(self._tracked)  # None unless some state is a DTensor
        save, tiers = self._tiers.taking(SaveRequest(
            step, persistent=persistent, node_local=node_local, sharded=staged is not None))
        if self._cadence is not None:
            self._cadence.saved(save.persistent)
        if any(t.needs_shared(save) for t in tiers):
            tree["shared"] = staged.replicated if staged else collect(self._tracked)
        check_weights_only(tree, where="checkpoint state")
        # A blocking save writes the live state (nothing can change it meanwhile); an async
        # one copies it into reused host buffers first, and that copy is all it blocks for.
        # Accelerator state always goes through the host copy, so every file holds CPU
        # tensors: torch.load(weights_only=True) reads it on a machine without a GPU.
        defer = self._state.deferrable() if not sync and overlap else frozenset()
        snap = tree if sync and tree_on_host(tree) else self._snapshot.snapshot(tree,
                                                                                defer=defer)
        if staged is not None:
            snap["dcp"] = staged  # already a host copy: DCP's stager made it
        self.scheduler.saving(step)
        # Its size, for the progress lines, is summed only if the loop waits for it. A
        # sharded save's total is DCP's to know.
        self._inflight.begin(step, [t.storage for t in tiers if t.storage is not None],
                             snap if staged is None else None)
        if sync:
            with self._inflight.progress():
                self._tiers.write(save, snap, tiers, self._snapshot.wait, self.scheduler.wrote)
            # Deleting old steps (about 1 s per GB on some disks) and the writer record (two
            # requests to a bucket) need not block anyone.
            self._inflight.submit(self._after_commit)
        else:
            self._inflight.submit(self._write_guarded, save, snap, tiers)

    def _write_guarded(self, save: SaveRequest, snap: dict[str, Any],
                       tiers: list[Tier]) -> None:
        """Writer thread: the save, its failure kept for the next call."""
        try:
            self._tiers.write(save, snap, tiers, self._snapshot.wait, self.scheduler.wrote)
        except SaveAbandoned:   # expected: the emergency save's deadline passed (logged)
            return
        except BaseException as exc:  # never lost: raised on the next call
            log.error("checkpoint save of step %d failed: %s", save.step, exc)
            self._inflight.failed(exc)
            return
        self._after_commit()

    def _after_commit(self) -> None:
        """Writer thread, after a save: the persistent tier's writer record and retention."""
        self._persistent.after_commit(stopping=self.scheduler.sigterm_received)

    def save_final(self, step: int) -> None:
        """The run's last step, committed to the persistent tier before this returns: the
        machines' own disks do not outlive the job, its output must hold the step. Nothing
        to do where the last save was of this step and went there too (with a node-local
        tier, most saves go to the machine's disk alone). A SIGTERM meanwhile: a save that
        cannot commit before its grace period ends is abandoned, and this rank leaves with
        exit 134, as at any other step (the previous step stays the latest)."""
        self._last.wait_or_leave()
        saved = self.last_saved_step == step
        if saved and (self._cadence is None or self._cadence.since == 0):
            return
        self.save(step, persistent=True, node_local=not saved)
        self._last.wait_or_leave()

    def wait(self) -> None:
        """Block until the save in flight is committed; raise its error if it failed."""
        self._inflight.wait()

    # --- restoring --------------------------------------------------------------------

    def start_restore(self) -> None:
        """Begin this life's restore before the training code builds what it restores
        into, where a tier can (tiers/early.py: the peers' memory): the ranks agree on the
        plan now and the state moves in a thread while the training function builds;
        ``restore_latest`` joins it and loads. A collective: every rank calls this at the
        same point, as rt.main does before the training function."""
        self._kept.take_over()
        self._early = self._early or self._tiers.begin_restore()

    def restore_latest(self, *, strict: bool = True) -> int | None:
        """Load the newest state into the tracked objects, the RNGs and ``values``; return
        its step, or None when there is none at all: from the first tier (fastest first)
        that can give every rank the same step. After an in-process recovery that is the
        survivors' memory (tiers/peers.py: at most the step in flight lost, no storage
        read); otherwise the node-local tier's newest step that every rank can get, else
        the newest committed step that verifies, read once and streamed to every rank.
        ``last_restore`` says which, with the bytes read per tier.
        A corrupt latest falls back to the previous one with a warning; if checkpoints
        exist but none verifies, raise instead of silently starting from scratch."""
        self.wait()
        t0 = time.perf_counter()
        early, self._early = self._early, None
        if early is None:
            self._kept.take_over()   # when start_restore did not
        got = early.result() if early is not None \
            else self._tiers.restore(uses_sharded_layout(self._tracked))
        step = self._load(got, strict)
        held = "no survivor holds the last step, and " if self._tiers.has("peer") else ""
        self._kept.after_restore(step, f"{held}{self.storage.url} has no checkpoint")
        self.last_restore = replace(got.record, seconds=time.perf_counter() - t0)
        if self._ring is not None and step:
            self._ring.restored(step, self._state.rank_state())
        return step

    def _load(self, got: Restored, strict: bool) -> int | None:
        """Load what a tier got into the tracked objects, the RNGs and ``values``."""
        if got.step is None:
            return None
        if got.load is not None:   # what the replicated tree cannot carry (sharded)
            got.load(self._tracked, strict)
        self._state.load(got.shared, got.mine, strict)
        self.scheduler.restored(*got.save_point)
        self._tiers.restored(got)
        log.info("%s", got.message)
        return got.step

    def hand_over(self, step: int) -> None:
        """This life ends on an error after ``step`` finished steps: leave its state in the
        process's memory, where the next life's restore finds it (tiers/peers.py). A reference,
        not a copy; nothing when the state is not that of step ``step``'s boundary."""
        self._kept.hand_over(trained=step > 0 or self._state.steps_called > 0)
        self._tiers.hand_over(step)

    # --- SIGTERM (lastsave.py) ----------------------------------------------------------

    def emergency_save(self, step: int) -> bool:
        """SIGTERM: save ``step`` to every tier, the fastest first, and have it committed
        before the grace period ends; True once it is. False: abandoned at the deadline
        (logged: ``abandoned`` says why), and the last committed step stays the latest."""
        return self._last.save(step)

    @property
    def abandoned(self) -> str:
        """Why the emergency save was abandoned, for the exit's line; "" if it was not."""
        return self._last.abandoned

    @property
    def left_behind(self) -> threading.Thread | None:
        """The writer of an abandoned save, left to the exit."""
        return self._last.left_behind

    # --- the end of a life ------------------------------------------------------------

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._state.remove_hooks()
            if self._ring is not None:
                self._ring.link.close()
            self._tiers.close()
            self._inflight.shutdown()
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
