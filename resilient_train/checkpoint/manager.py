"""CheckpointManager: when to save, the commit protocol, async writes, restore-latest.

Layout under the checkpoint directory (DESIGN.md section 3)::

    step-000000001200/          one directory per committed step
        shared.pt               replicated state (model, optimizer, ...): the primary writes it
        rank-00000.pt           per-rank state: RNG states and user values (data position)
        manifest.json           every file's size and crc32c, step, world size, metadata
        COMMITTED               written last; names the manifest's checksum

On local disk the step is written into ``.tmp-step-...-TOKEN`` and renamed into place
after every file and the directory are fsynced. Object stores have no atomic rename, so
the step is written in place as ``step-...-TOKEN`` (a fresh name per run, so a crashed
save can never mix its files into a later one) and the marker goes last. Readers see only
steps with a marker whose manifest verifies.

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
import fcntl
import io
import json
import logging
import math
import mmap
import os
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import torch

from .. import __version__, sigterm
from ..errors import Classification, PermanentError, TransientError, classify_exception
from ..telemetry import ObservedMtbf
from ..validate import NONE, expect_type
from . import fileio
from .coordination import Coordinator, default_coordinator
from .manifest import (
    MANIFEST,
    MARKER,
    CheckpointError,
    CorruptCheckpointError,
    Crc32c,
    FileEntry,
    Manifest,
    check_entry,
    check_marker,
    manifest_entry,
    marker_bytes,
    parse_step,
    read_verified,
    step_dirname,
)
from .policy import FOUR_HOURS, SaveContext, SavePolicy, check_ceiling, every_n_steps, with_ceiling
from .retention import CommittedStep, RetentionPolicy, to_delete
from .sharded import SHARDED_LAYOUT, ShardedCheckpointer
from .state import (
    HostSnapshot,
    capture_rng,
    check_weights_only,
    collect,
    restore,
    restore_rng,
    tree_map_tensors,
    tree_on_host,
    weights_only_refusal,
)
from .storage import (
    PROBE_PREFIX,
    TMP_FILE_PREFIX,
    RetryOptions,
    Storage,
    StorageFullError,
    format_bytes,
    free_bytes,
    is_no_space,
)

log = logging.getLogger(__name__)

SHARED_FILE = "shared.pt"
TMP_PREFIX = ".tmp-"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def default_directory() -> str:
    """``AIP_CHECKPOINT_DIR`` when the platform (or our launcher) sets it, else ./checkpoints."""
    return os.environ.get("AIP_CHECKPOINT_DIR") or "checkpoints"


def _positive_seconds(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and 0 < value < math.inf)


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
    metadata: Mapping[str, Any] = field(default_factory=dict)   # JSON, in every manifest

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
        expect_type("CheckpointOptions.save_on_sigterm", self.save_on_sigterm, (bool, NONE),
                    "True or False or None")
        if not _positive_seconds(self.sync_interval_s):
            raise ValueError(f"CheckpointOptions.sync_interval_s={self.sync_interval_s!r}: "
                             f"expected a positive, finite number of seconds")
        expect_type("CheckpointOptions.storage_options", self.storage_options, (Mapping, NONE),
                    "a dict of fsspec options, or None")
        try:  # here, not at the first save hours from now (manifest.py writes it so)
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


@dataclass(frozen=True)
class StepInfo:
    step: int
    name: str                # directory name under the root
    committed: bool          # has a marker
    problems: tuple[str, ...] = ()
    created: float | None = None
    world_size: int | None = None
    size_bytes: int | None = None

    @property
    def ok(self) -> bool:
        return self.committed and not self.problems


class _CrcWriter:
    """A file object for torch.save that checksums what passes through.

    On a local file it writes with O_DIRECT where the file system allows it
    (``fileio.DirectWriter``: about twice the disk throughput of buffered writes + fsync).
    Elsewhere, or where O_DIRECT is refused, it writes buffered and, on a local file,
    starts the disk writeback early: every ``sync_every`` bytes a helper thread fdatasyncs
    what is written so far (the GIL is released meanwhile), so the disk works while torch
    keeps serializing, and the final fsync has little left.
    """

    def __init__(self, f: BinaryIO, *, local: bool, sync_every: int = 128 << 20) -> None:
        self._f = f
        self.crc = Crc32c()
        self._fd = f.fileno() if local else None
        self._direct = (fileio.DirectWriter.open(self._fd, crc=self.crc)
                        if self._fd is not None and fileio.ENABLED else None)
        self._sync_every = sync_every
        self._unsynced = 0
        self._syncing: threading.Thread | None = None

    def write(self, data: bytes | memoryview) -> int:
        if self._direct is not None:
            return self._direct.write(data)
        self.crc.update(data)
        n = self._f.write(data)
        self._unsynced += n
        if self._fd is not None and self._unsynced >= self._sync_every and not (
                self._syncing and self._syncing.is_alive()):
            self._f.flush()
            self._unsynced = 0
            self._syncing = threading.Thread(target=os.fdatasync, args=(self._fd,),
                                             name="rt-ckpt-writeback", daemon=True)
            self._syncing.start()
        return n

    def flush(self) -> None:
        if self._direct is None:  # the direct path holds only a partial block: see close
            self._f.flush()

    def close(self) -> None:
        """After a complete torch.save: write what the direct path still holds (its write
        errors raise here); the caller's close then fsyncs."""
        if self._direct is not None:
            self._direct.close()

    def finish(self) -> None:
        """Always, success or not: stop the direct writer, wait for the writeback in flight."""
        if self._direct is not None:
            self._direct.abort()
        if self._syncing is not None:
            self._syncing.join()


class _Writer:
    """One background thread that runs jobs in order.

    A daemon thread, unlike ThreadPoolExecutor's: a process that exits because a peer died
    must not hang at exit on a save stuck in a collective with that peer. A save cut off
    like that is simply never committed; ``close()`` still waits for the save in flight.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]
                                      | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        self._jobs.put((fut, fn, args))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        return fut

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fut, fn, args = job
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:  # handed to whoever waits on the future
                    fut.set_exception(exc)

    def shutdown(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None


class TransientCheckpointError(CheckpointError, TransientError):
    """A background save failed for a reason that a retry can fix (storage, network)."""


class CheckpointStorageFullError(CheckpointError, PermanentError):
    """A save ran out of space (ENOSPC / EDQUOT). Nothing was committed, what the save wrote
    is removed, the last committed step is kept; the next save tries again. Permanent for
    the exit code: a rerun fills the same disk unless someone frees space."""

    def __init__(self, message: str, *, directory: str | None, needed_bytes: int,
                 free_bytes: int | None) -> None:
        super().__init__(message)
        self.directory = directory
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes


@dataclass(frozen=True)
class _RankFailure:
    """What a rank whose writes failed tells the primary, with its (partial) file list."""

    rank: int
    error: str
    state_bytes: int                 # what its files would have held (tensor bytes)
    transient: bool = False
    no_space: bool = False
    directory: str | None = None     # where a no-space write failed: the root, or TMPDIR
    file: str | None = None          # and the file it was writing


def _state_bytes(snap: Mapping[str, Any]) -> int:
    """About what a save of ``snap`` writes: its tensor bytes (a DTensor: its local shard)."""
    seen: dict[int, int] = {}

    def count(t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if hasattr(t, "to_local") else t
        seen[id(t)] = local.numel() * local.element_size()
        return t

    for key, tree in snap.items():
        tree_map_tensors(count, tree.dcp_state if key == "dcp" else tree)
    return sum(seen.values())


class CheckpointManager:
    """Save, keep and restore training state; see the module docstring for the layout."""

    def __init__(self, directory: str | os.PathLike[str] | None = None, *,
                 options: CheckpointOptions | None = None,
                 coordinator: Coordinator | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.options = options or CheckpointOptions()
        self.directory = os.fspath(directory) if directory is not None else default_directory()
        # First, so a SIGTERM that arrives while the ranks still set up is not lost; one
        # that came before (@rt.main notes it while the group forms) counts too.
        self._sigterm = bool(self.options.save_on_sigterm) and sigterm.received()
        self._old_sigterm: Any = None
        if self.options.save_on_sigterm:
            self._install_sigterm()
        self.storage = Storage(self.directory, retry=self.options.retry,
                               storage_options=self.options.storage_options)
        self.coord = coordinator or default_coordinator()
        self.rank, self.world_size = self.coord.rank, self.coord.world_size
        self.is_primary = self.rank == 0
        self.clock = clock
        self.policy = self._agree_on_policy(self.options.save_policy())
        if self.is_primary:
            # Every rank is past the policy broadcast and waits for the token below, so no
            # rank of this run is saving: what temporary saves exist are from crashed runs.
            self._remove_crashed_saves()
            self.storage.check_writable()   # a missing bucket fails now, not hours from now
        # A fresh name per run for in-flight saves: a crashed run's leftovers never mix in.
        self._token: str = self.coord.broadcast(os.urandom(4).hex())
        self._tracked: dict[str, Any] = {}
        self.values: dict[str, Any] = {}
        self._snapshot = HostSnapshot()
        self._sharded = ShardedCheckpointer(self.coord)  # FSDP2 / DTensor state: sharded.py
        self._executor = _Writer("rt-ckpt-writer")
        self._inflight: Future[None] | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self.last_saved_step: int | None = None
        self.last_commit_step: int | None = None
        # For retention: steps known to verify (the last commit, the restored one) and
        # committed steps that the restore found broken; neither is checked again.
        self._committed_name: str | None = None
        self._restored_name: str | None = None
        self._known_bad: set[str] = set()
        self.last_blocking_s = 0.0
        # What a save costs the training loop (waiting for the previous one, the snapshot,
        # the write when blocking), an EMA: SaveContext.save_cost_s, for auto_interval.
        # Multi-rank, the max over ranks as of the last _sync: every rank decides the same.
        self._save_cost: float | None = None
        self._shared_save_cost: float | None = None
        # The job's observed MTBF (the launcher's failure log), read on the primary and
        # shared like the clock: SaveContext.mtbf_s, for auto_interval.
        self._observed = ObservedMtbf.from_env() if self.is_primary else None
        self._shared_mtbf: float | None = None
        self._next_mtbf_read = float("-inf")
        # The primary's clock, as in _sync: a max over all ranks' clocks would let one
        # rank's skew (a clock ahead) postpone every time-based save.
        self._shared_now = float(self.coord.broadcast(clock()))
        self._last_save_time = self._shared_now
        self._next_sync_step = 0
        self._step_time = 0.0
        self._last_step_clock: float | None = None

    def _agree_on_policy(self, policy: SavePolicy) -> SavePolicy:
        """This life's copy of the save policy, the primary's on every rank.

        A policy may keep state (auto_interval: its MTBF, read from this process's
        environment, and when it started counting); each life starts from a fresh copy, and
        every rank takes the primary's so that they all decide to save at the same step.
        """
        try:
            blob = pickle.dumps(policy) if self.is_primary else None
        except Exception as exc:  # a policy holding a lambda: keep each rank's own
            log.warning("the save policy %r cannot be copied (%s); each rank uses its own, "
                        "so it must decide from its SaveContext alone", policy, exc)
            blob = None
        if self.world_size > 1:
            blob = self.coord.broadcast(blob)
        return policy if blob is None else pickle.loads(blob)  # noqa: S301 - our own bytes

    # --- what to save -----------------------------------------------------------------

    def track(self, **objects: Any) -> None:
        """Objects with ``state_dict``/``load_state_dict`` (model, optimizer, scheduler,
        scaler), replicated on every rank; the primary writes them."""
        self._tracked.update(objects)

    # --- when to save -----------------------------------------------------------------

    def maybe_save(self, step: int) -> bool:
        """Call after each finished step (``step`` = steps done). Saves when the policy says so;
        cheap otherwise. Returns True when a save was started."""
        if self._error is not None:
            self._raise_error()
        if self.world_size == 1:
            now = self.clock()
            emergency = self._sigterm
            cost = self._save_cost
            if now >= self._next_mtbf_read:   # a stat() per second, not per step
                self._next_mtbf_read = now + self.options.sync_interval_s
                self._shared_mtbf = self._observed.at(now) if self._observed else None
        else:
            now, emergency = self._sync(step)
            cost = self._shared_save_cost
        if emergency or self.policy.should_save(SaveContext(
                step, now, self.last_saved_step, self._last_save_time, cost,
                self._shared_mtbf)):
            self.save(step, blocking=emergency)
            if emergency:
                self._exit_after_emergency(step)
            return True
        return False

    def _sync(self, step: int) -> tuple[float, bool]:
        """Multi-rank: agree on the clock, a pending SIGTERM and the cost of a save (the
        slowest rank's: it blocks the job), about once per ``sync_interval_s``, so every
        rank takes the same decision at the same step."""
        now_local = time.monotonic()
        if self._last_step_clock is not None:
            dt = now_local - self._last_step_clock
            self._step_time = dt if self._step_time == 0 else 0.9 * self._step_time + 0.1 * dt
        self._last_step_clock = now_local
        if step < self._next_sync_step:
            return self._shared_now, False
        stride = max(1, int(self.options.sync_interval_s / self._step_time)) if self._step_time else 1
        my_now = int(self.clock() * 1000) if self.is_primary else 0
        my_cost = -1 if self._save_cost is None else int(self._save_cost * 1e6)
        mtbf = self._observed.at(my_now / 1000.0) if self._observed else None
        my_mtbf = -1 if mtbf is None else int(mtbf * 1000)   # the primary's only
        now_ms, stride, sigterm, cost_us, mtbf_ms = self.coord.allreduce_max(
            [my_now, stride, int(self._sigterm), my_cost, my_mtbf])
        self._shared_now = now_ms / 1000.0
        self._shared_save_cost = None if cost_us < 0 else cost_us / 1e6
        self._shared_mtbf = None if mtbf_ms < 0 else mtbf_ms / 1000.0
        self._next_sync_step = step + stride
        return self._shared_now, bool(sigterm)

    # --- saving -----------------------------------------------------------------------

    def save(self, step: int, *, blocking: bool | None = None) -> None:
        """Save now. Blocks only for the in-memory snapshot unless ``blocking`` (or the
        options) say otherwise; one save is in flight at a time."""
        if self._error is not None:
            self._raise_error()
        t_wait = time.perf_counter()
        self.wait()
        t0 = time.perf_counter()
        tree: dict[str, Any] = {"rank": {"rng": capture_rng(), "values": dict(self.values)}}
        staged = self._sharded.stage(self._tracked)  # None unless some state is a DTensor
        if self.is_primary:
            tree["shared"] = staged.replicated if staged else collect(self._tracked)
        check_weights_only(tree, where="checkpoint state")
        sync = bool(blocking or (blocking is None and not self.options.async_save))
        # A blocking save writes the live state (nothing can change it meanwhile); an async
        # one copies it into reused host buffers first, and that copy is all it blocks for.
        # Accelerator state always goes through the host copy, so every file holds CPU
        # tensors: torch.load(weights_only=True) reads it on a machine without a GPU.
        snap = tree if sync and tree_on_host(tree) else self._snapshot.snapshot(tree)
        if staged is not None:
            snap["dcp"] = staged  # already a host copy: DCP's stager made it
        self.last_blocking_s = time.perf_counter() - t0
        self.last_saved_step = step
        self._last_save_time = self._shared_now if self.world_size > 1 else self.clock()
        if sync:
            self._write(step, snap)
            # Deleting old steps (about 1 s per GB on some disks) need not block anyone.
            self._inflight = self._executor.submit(self._apply_retention)
        else:
            self._inflight = self._executor.submit(self._write_guarded, step, snap)
        cost = time.perf_counter() - t_wait   # a blocking save: its write too
        self._save_cost = cost if self._save_cost is None else 0.7 * self._save_cost + 0.3 * cost

    def wait(self) -> None:
        """Block until the save in flight is committed; raise its error if it failed."""
        fut, self._inflight = self._inflight, None
        if fut is not None:
            fut.result()  # _write_guarded never raises; errors land in self._error
        if self._error is not None:
            self._raise_error()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._executor.shutdown()
            self._sharded.close()
            if self._old_sigterm is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)
                self._old_sigterm = None

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

    def _write_guarded(self, step: int, snap: dict[str, Any]) -> None:
        try:
            self._write(step, snap)
        except BaseException as exc:  # never lost: raised on the next call
            log.error("checkpoint save of step %d failed: %s", step, exc)
            self._error = exc
            return
        self._apply_retention()

    def _write(self, step: int, snap: dict[str, Any]) -> None:
        final = step_dirname(step)
        work = f"{TMP_PREFIX}{final}-{self._token}" if self.storage.atomic_rename \
            else f"{final}-{self._token}"
        if not self.storage.atomic_rename and self.storage.exists(f"{work}/{MARKER}"):
            # Object store: this run already committed this step under this name (an
            # emergency save right after a periodic one); rewriting it in place could tear it.
            log.info("checkpoint step %d is already committed; not saving it again", step)
            return
        with _held(self.storage.local_path(work) if self.storage.atomic_rename else None):
            self._write_held(step, snap, final, work)

    def _write_held(self, step: int, snap: dict[str, Any], final: str, work: str) -> None:
        entries: dict[str, FileEntry] = {}
        failure: Exception | None = None
        try:
            if "dcp" in snap:
                # First: dcp.save is collective and fails on every rank together, so no rank
                # waits in it for one whose own files already failed.
                entries.update(self._sharded.write(self.storage, work, snap["dcp"]))
            if self.is_primary:
                entries[SHARED_FILE] = self._write_file(f"{work}/{SHARED_FILE}",
                                                        snap["shared"])
            entries[rank_file(self.rank)] = self._write_file(f"{work}/{rank_file(self.rank)}",
                                                             snap["rank"])
        except Exception as exc:  # reported to the primary below, then raised
            failure = exc
        # Every rank gets here, also after a failure: no one waits in the gather for a rank
        # that gave up, and the primary learns that the step must not be committed.
        mine = None if failure is None else self._failure(snap, failure)
        gathered = self.coord.gather((step, entries, mine))
        if gathered is None:  # only the primary commits (and cleans up)
            if mine is not None:
                self._raise_failed(step, [mine], 0, failure)
            return
        failed = [f for _, _, f in gathered if f is not None]
        # What the ranks that did not fail wrote, to the byte: part of what the step needs.
        written = sum(e.size for _, files, f in gathered if f is None for e in files.values())
        if failed:
            self._discard(work, transient=any(f.transient for f in failed))
            self._raise_failed(step, failed, written, failure)
        try:
            self._commit(step, final, work, snap, gathered)
        except Exception as exc:
            self._discard(work, transient=classify_exception(exc) is Classification.TRANSIENT)
            if is_no_space(exc):
                # The files are all written (in ``written``): the commit's own did not fit.
                self._raise_failed(step, [self._failure(snap, exc, state_bytes=0)], written,
                                   exc)
            raise

    def _failure(self, snap: Mapping[str, Any], failure: Exception, *,
                 state_bytes: int | None = None) -> _RankFailure:
        full = next((e for e in _chain(failure) if isinstance(e, StorageFullError)), None)
        root = self.storage.local_path("") or self.storage.url
        directory = full.directory if full is not None and full.directory else root
        if directory == root or directory.startswith(root.rstrip("/") + "/"):
            directory = root  # not the step's directory: it is removed by now
        return _RankFailure(
            self.rank, f"{type(failure).__name__}: {failure}",
            _state_bytes(snap) if state_bytes is None else state_bytes,
            transient=classify_exception(failure) is Classification.TRANSIENT,
            no_space=is_no_space(failure), directory=directory,
            file=full.url if full is not None else None)

    def _raise_failed(self, step: int, failed: list[_RankFailure], written: int,
                      own: Exception | None) -> None:
        """Raise why step was not committed: a full disk with the space it needs; else this
        rank's own error; else (primary) what the other ranks reported. ``written``: the
        bytes the ranks that did not fail wrote."""
        full = [r for r in failed if r.no_space]
        if full:
            directory = full[0].directory
            needed = written + sum(r.state_bytes for r in failed)
            free = free_bytes(directory) if directory else None
            last = (f"the last committed step, {self.last_commit_step}, is kept"
                    if self.last_commit_step is not None else "no step was committed before")
            keep = self.options.retention.keep_last
            where = directory or self.storage.url
            who = "; ".join(f"rank {r.rank} writing {r.file}" if r.file else
                            f"rank {r.rank}: {r.error}" for r in full[:2])
            msg = (
                f"checkpoint step {step} was not saved: no space left in {where} ({who}). "
                f"This save needs about {format_bytes(needed)}; {format_bytes(free)} is "
                f"free there now. {'What it' if self.is_primary else 'What this rank'} "
                f"wrote was removed; {last}. Free space, lower RetentionPolicy.keep_last "
                f"(now {keep}: the directory needs room for {keep} committed step(s) plus "
                f"the one being written, until retention runs) or use a larger disk; the "
                f"next save tries again.")
            raise CheckpointStorageFullError(msg, directory=directory, needed_bytes=needed,
                                             free_bytes=free) from own
        if own is not None:
            raise own
        text = "; ".join(f"rank {r.rank}: {r.error}" for r in failed[:3])
        cls = TransientCheckpointError if all(r.transient for r in failed) else CheckpointError
        raise cls(f"checkpoint step {step} was not committed: {len(failed)} rank(s) failed to "
                  f"write their files ({text}); what they wrote was removed")

    def _discard(self, work: str, *, transient: bool) -> None:
        """Delete what a failed save wrote (primary, once every rank is done writing).

        On an object store, not after a storage outage (``transient``): each delete would
        wait out the retry deadline again. Such a leftover is an uncommitted directory that
        retention removes once a newer step of a later run commits."""
        if not self.storage.atomic_rename and transient:
            log.warning("the failed save left %s behind (storage unavailable); retention "
                        "removes it later", self.storage.url_of(work))
            return
        try:
            if not self.storage.atomic_rename:
                # Marker first, as in prune: a crash part-way never leaves a committed half.
                self.storage.delete(f"{work}/{MARKER}")
            self.storage.delete(work, recursive=True)
            log.info("removed %s, written by a save that failed", self.storage.url_of(work))
        except Exception as exc:  # noqa: BLE001 - the save's own error matters more
            log.warning("could not remove %s after a failed save (the next start removes "
                        "it): %s", self.storage.url_of(work), exc)

    def _remove_crashed_saves(self) -> None:
        """Local disk, at start, on the primary: delete the temporary step directories (and
        our scratch files) that runs which crashed mid-save left in the root. They are
        never committed, and on a full disk they hold the space the next save needs.

        Object stores keep an unfinished save under its final name without a marker; it
        costs no local space and retention deletes it once a newer step commits (and
        restore names it), so nothing is deleted here."""
        root = self.storage.local_path("")
        if root is None:
            return
        try:
            names = os.listdir(root)
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as exc:
            log.warning("could not list %s for leftovers of crashed saves: %s", root, exc)
            return
        removed, freed = [], 0
        for name in sorted(names):
            path = os.path.join(root, name)
            is_tmp_step = name.startswith(TMP_PREFIX) and \
                parse_step(name[len(TMP_PREFIX):]) is not None and os.path.isdir(path)
            # Scratch files live for milliseconds (a probe, an atomic write being renamed):
            # an old one is stale, a fresh one may be another process's probe.
            is_scratch = name.startswith((TMP_FILE_PREFIX, PROBE_PREFIX)) and \
                os.path.isfile(path) and _age_s(path) > _SCRATCH_STALE_S
            if not (is_tmp_step or is_scratch):
                continue
            size = _tree_size(path)
            with _unless_held(path if is_tmp_step else None) as free_to_delete:
                if not free_to_delete:
                    log.info("keeping %s: a live save holds it", path)
                    continue
                try:
                    self.storage.delete(name, recursive=True)
                except Exception as exc:  # noqa: BLE001 - check_writable reports what matters
                    log.warning("could not remove %s, left by a crashed save: %s", path, exc)
                    continue
            removed.append(name)
            freed += size
        if removed:
            log.warning("removed %d leftover(s) of saves that never finished from %s (%s): %s",
                        len(removed), root, format_bytes(freed), ", ".join(removed[:5])
                        + (f" and {len(removed) - 5} more" if len(removed) > 5 else ""))

    def _commit(self, step: int, final: str, work: str, snap: dict[str, Any],
                gathered: list[Any]) -> None:
        steps = {rank: s for rank, (s, _, _) in enumerate(gathered)}
        if set(steps.values()) != {step}:
            # Committing would pair this manifest with other steps' files: refuse.
            raise CheckpointError(
                f"the ranks saved different steps ({', '.join(f'rank {r}: step {s}' for r, s in steps.items())}): "
                "their save policies decided differently. A SavePolicy must decide from its "
                "SaveContext (and state that is the same on every rank) alone; step "
                f"{step} is not committed.")
        files: dict[str, FileEntry] = {}
        for _, part, _ in gathered:
            files.update(part)
        layout = SHARDED_LAYOUT if "dcp" in snap else "replicated"
        manifest = Manifest(step=step, world_size=self.world_size, layout=layout,
                            files=files, library=f"resilient-train {__version__}",
                            metadata=dict(self.options.metadata))
        data = manifest.to_bytes()
        self.storage.write_bytes(f"{work}/{MANIFEST}", data)
        self.storage.write_bytes(f"{work}/{MARKER}", marker_bytes(data, step))
        if self.storage.atomic_rename:
            self.storage.fsync_dir(work)
            existing = self.storage.exists(final)
            if existing and verify_step(self.storage, StepInfo(
                    step, final, self.storage.exists(f"{final}/{MARKER}"))).ok:
                # This step is already committed (e.g. an emergency save right after a
                # restore): keep the existing commit, drop the duplicate.
                self.storage.delete(work, recursive=True)
            else:
                if existing:
                    # A broken or markerless directory of this step (restore fell back past
                    # it): move it aside as an uncommitted leftover, or this save is lost.
                    self.storage.rename_dir(final, f"{TMP_PREFIX}{final}-{os.urandom(4).hex()}")
                self.storage.rename_dir(work, final)  # the commit; fsyncs the parent
        self.last_commit_step = step
        committed_as = final if self.storage.atomic_rename else work
        self._committed_name = committed_as
        self._known_bad.discard(committed_as)   # a broken one of this name was moved aside
        log.info("checkpoint step %d committed to %s", step, self.storage.url_of(committed_as))

    def _write_file(self, rel: str, obj: Any) -> FileEntry:
        # Files of a temporary step directory need no rename of their own: the directory's
        # rename commits them all.
        with self.storage.open_write(rel, atomic=not self.storage.atomic_rename) as f:
            w = _CrcWriter(f, local=self.storage.local_path(rel) is not None)
            try:
                torch.save(obj, w)  # type: ignore[arg-type]
                w.close()
            finally:
                w.finish()
        return FileEntry(w.crc.size, w.crc.hexdigest())

    # --- what to keep -----------------------------------------------------------------

    def _apply_retention(self) -> None:
        if not self.is_primary:
            return
        # The step is committed: a failure to clean up must not report the save as failed.
        try:
            known_good = {n for n in (self._committed_name, self._restored_name) if n}
            prune(self.storage, self.options.retention, protect=self._token,
                  known_good=known_good, known_bad=self._known_bad)
        except Exception as exc:  # noqa: BLE001 - retried after the next commit
            log.warning("retention after a commit failed (retried after the next one): %s", exc)

    # --- restoring --------------------------------------------------------------------

    def restore_latest(self, *, strict: bool = True) -> int | None:
        """Load the newest committed step that verifies into the tracked objects, the RNGs
        and ``values``; return its step, or None when there is no checkpoint at all.
        A corrupt latest falls back to the previous one with a warning; if checkpoints
        exist but none verifies, raise instead of silently starting from scratch."""
        self.wait()
        infos = scan(self.storage, with_manifest=False) if self.is_primary else []
        names: list[tuple[int, str]] = self.coord.broadcast(
            [(i.step, i.name) for i in infos if i.committed] if self.is_primary else None)
        if self.is_primary:
            self._warn_uncommitted(infos)
        problems: list[str] = []
        for step, name in sorted(names, reverse=True):
            loaded: tuple[Manifest, dict[str, Any], dict[str, Any] | None] | None = None
            try:
                loaded = self._load_step(step, name)
            except CorruptCheckpointError as exc:
                problems.append(str(exc))
            # Every rank must restore the same step: one rank's bad file skips it for all.
            if self.coord.allreduce_max([0 if loaded else 1])[0] == 0 and loaded is not None:
                manifest, shared, mine = loaded
                self._apply(manifest, shared, mine, strict)
                self._restored_name = name
                return step
            self._known_bad.add(name)
            log.warning("checkpoint %s does not verify%s; trying the previous one",
                        self.storage.url_of(name), f": {problems[-1]}" if problems else
                        " on another rank")
        if names:
            raise CorruptCheckpointError(
                f"{len(names)} committed checkpoint(s) in {self.storage.url} but none verifies: "
                + "; ".join(problems[:5])
                + ". Refusing to start from scratch silently: fix or move the directory, "
                "or pass a new checkpoint directory to start over.")
        if self.is_primary:
            self._explain_fresh_start()
        return None

    def _warn_uncommitted(self, infos: list[StepInfo]) -> None:
        """Name each step directory newer than the newest commit that has no marker: restore
        skips it, and a silent skip hides a deleted marker or a save that never finished.
        (Only uncommitted steps at all: _explain_fresh_start says so.)"""
        committed = [i.step for i in infos if i.committed]
        if not committed:
            return
        for info in infos:
            if not info.committed and info.step > max(committed) \
                    and not info.name.startswith(TMP_PREFIX):
                log.warning("checkpoint %s has no %s marker, so it is not a checkpoint and is "
                            "skipped: a save that never finished, or a marker that was "
                            "deleted (`resilient-train checkpoints verify %s` lists it)",
                            self.storage.url_of(info.name), MARKER, self.storage.url)

    def _explain_fresh_start(self) -> None:
        """One line on a fresh start, and a warning where the directory suggests a mistake:
        only uncommitted steps (every save crashed), or step directories one level down."""
        try:
            infos = scan(self.storage, with_manifest=False)
            nested = [] if infos else [
                child for child in self.storage.listdir("")[:20]
                if any(parse_step(g) is not None for g in self.storage.listdir(child)[:50])]
        except Exception as exc:  # noqa: BLE001 - a hint must not fail the restore
            log.debug("could not look for hints in %s: %s", self.storage.url, exc)
            infos, nested = [], []
        if infos:
            log.warning("no committed checkpoint in %s, only %d uncommitted step "
                        "director%s without a %s marker (saves that never finished): %s; "
                        "starting from step 0", self.storage.url, len(infos),
                        "y" if len(infos) == 1 else "ies", MARKER,
                        ", ".join(i.name for i in infos[-5:]))
        elif nested:
            log.warning("no checkpoint in %s, but %s hold%s step directories: is the "
                        "checkpoint directory one level too high? Starting from step 0",
                        self.storage.url, ", ".join(self.storage.url_of(n) for n in nested),
                        "s" if len(nested) == 1 else "")
        else:
            log.info("no checkpoint in %s: starting from step 0", self.storage.url)

    def _load_step(self, step: int, name: str
                   ) -> tuple[Manifest, dict[str, Any], dict[str, Any] | None]:
        where = self.storage.url_of(name)
        manifest = read_manifest(self.storage, name, step)
        present = set(_list_files(self.storage, name))
        problems = _structural_problems(manifest, present, self.storage, name)
        if problems:
            raise CorruptCheckpointError(f"{where}: " + "; ".join(problems))
        shared = _load_verified(self.storage, name, SHARED_FILE, manifest)
        if manifest.layout == SHARDED_LAYOUT:  # deep-check the DCP files this rank reads
            self._sharded.verify(self.storage, name, manifest)
        own = rank_file(self.rank)
        mine = _load_verified(self.storage, name, own, manifest) if own in manifest.files else None
        return manifest, shared, mine

    def _apply(self, manifest: Manifest, shared: dict[str, Any], mine: dict[str, Any] | None,
               strict: bool) -> None:
        if manifest.layout == SHARDED_LAYOUT:
            self._sharded.load(self.storage, manifest, self._tracked, shared, strict=strict)
        else:
            restore(self._tracked, shared, strict=strict)
        if mine is None:
            log.warning("checkpoint step %d was written by %d ranks and has no file for rank %d: "
                        "its RNG state stays as it is and the values of rank 0 are used", manifest.step,
                        manifest.world_size, self.rank)
            mine = _load_verified(self.storage, _dir_for(self.storage, manifest.step),
                                  rank_file(0), manifest)
        else:
            restore_rng(mine["rng"])
        self.values.clear()
        self.values.update(mine["values"])
        self.last_saved_step = self.last_commit_step = manifest.step
        self._last_save_time = manifest.created
        log.info("restored checkpoint step %d from %s", manifest.step, self.storage.url)

    # --- SIGTERM ----------------------------------------------------------------------

    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise CheckpointError("save_on_sigterm needs the manager to be created in the main thread")

        def on_sigterm(signum: int, frame: Any) -> None:
            self._sigterm = True
            sigterm.note()  # for the waits on peers, which must not outlast the grace period

        self._old_sigterm = signal.signal(signal.SIGTERM, on_sigterm)

    @property
    def sigterm_received(self) -> bool:
        return self._sigterm

    def _exit_after_emergency(self, step: int) -> None:
        from ..errors import exit_transient

        if self.world_size > 1:
            # A non-primary's blocking save returns once the primary has its file list, before
            # the commit: wait for the primary here, so no rank leaves (and gets the job torn
            # down) before the marker is written.
            self.coord.allreduce_max([0])
        if self._sigterm:  # only the signalled rank leaves; the others saved with it
            self.close()
            exit_transient(f"SIGTERM: emergency checkpoint of step {step} committed",
                           one_line=True)


_SCRATCH_STALE_S = 60.0


def _age_s(path: str) -> float:
    try:
        return time.time() - os.stat(path).st_mtime
    except OSError:
        return 0.0


@contextlib.contextmanager
def _held(path: str | None) -> Iterator[None]:
    """A shared flock on the temporary step directory this rank writes into, for as long
    as it writes (the kernel drops it when the process dies): the start-up clean-up of
    another process leaves a held directory alone. Where locks are not supported the save
    goes on without one."""
    fd = None
    if path is not None:
        try:
            os.makedirs(path, exist_ok=True)
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # only a clean-up holds it EX
        except OSError as exc:  # no locks, or no space for the directory: the write says
            log.debug("no lock on %s: %s", path, exc)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


@contextlib.contextmanager
def _unless_held(path: str | None) -> Iterator[bool]:
    """True (holding an exclusive flock on path meanwhile) unless a live save holds it.
    Where locks are not supported: True, since the caller runs before this run saves."""
    fd = None
    held = False
    if path is not None:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held = True
        except OSError as exc:
            log.debug("cannot lock %s (%s): treating it as stale", path, exc)
    try:
        yield not held
    finally:
        if fd is not None:
            os.close(fd)


def _chain(exc: BaseException) -> list[BaseException]:
    """exc and the exceptions it was raised from (or while handling)."""
    out: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and all(e is not seen for seen in out):
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def _tree_size(path: str) -> int:
    """Bytes of the files under path (or of the file): for the log only."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for parent, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(parent, name)).st_size
            except OSError:
                pass
    return total


# --- reading a directory (also used by the CLI) ---------------------------------------

def _list_files(storage: Storage, name: str) -> list[str]:
    out: list[str] = []
    for child in storage.listdir(name):
        rel = f"{name}/{child}"
        sub = storage.listdir(rel)
        if sub:
            out.extend(f"{child}/{f}" for f in _list_files(storage, rel))
        else:
            out.append(child)
    return out


def _dir_for(storage: Storage, step: int) -> str:
    for info in scan(storage, with_manifest=False):
        if info.step == step and info.committed:
            return info.name
    raise CorruptCheckpointError(f"step {step} vanished from {storage.url}")


def read_manifest(storage: Storage, name: str, step: int) -> Manifest:
    where = storage.url_of(name)
    try:
        data = storage.read_bytes(f"{name}/{MANIFEST}")
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: {MANIFEST} is missing") from None
    try:
        marker = storage.read_bytes(f"{name}/{MARKER}")
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: not committed ({MARKER} is missing)") from None
    check_marker(marker, data, step, where)
    manifest = Manifest.from_bytes(data, where)
    if manifest.step != step:
        raise CorruptCheckpointError(f"{where}: the manifest says step {manifest.step}")
    return manifest


def _structural_problems(manifest: Manifest, present: set[str], storage: Storage,
                         name: str) -> list[str]:
    problems = []
    for fname, entry in sorted(manifest.files.items()):
        if fname not in present:
            problems.append(f"{fname} is missing")
            continue
        size = storage.size(f"{name}/{fname}")
        if size != entry.size:
            problems.append(f"{fname} is {size} bytes, the manifest says {entry.size} (truncated?)")
    extra = sorted(present - set(manifest.files) - {MANIFEST, MARKER})
    if extra:
        problems.append(f"files not in the manifest: {', '.join(extra[:10])}")
    return problems


def _verify_local_file(path: str, entry: FileEntry, where: str) -> None:
    """Checksum a local file through a memory map: no copy, and the pages it faults in
    are the ones torch.load(mmap=True) then uses."""
    crc = Crc32c()
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    crc.update(mm)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: missing") from None
    check_entry(FileEntry(crc.size, crc.hexdigest()), entry, where)


def _load_verified(storage: Storage, name: str, fname: str, manifest: Manifest) -> dict[str, Any]:
    rel = f"{name}/{fname}"
    where = storage.url_of(rel)
    path = storage.local_path(rel)
    try:
        if path is not None:
            _verify_local_file(path, manifest_entry(manifest, fname, where), where)
            source: Any = path
        else:
            source = io.BytesIO(read_verified(storage, name, fname, manifest))
        obj = torch.load(source, map_location="cpu", weights_only=True, mmap=path is not None)
    except CorruptCheckpointError:
        raise
    except Exception as exc:  # a checksum-valid file that torch cannot read
        # The reason without torch's advice to load with weights_only=False, which is
        # exactly wrong for a file that may have been tampered with.
        raise CorruptCheckpointError(
            f"{where}: unreadable as a weights-only torch file, refused without running "
            f"anything ({type(exc).__name__}: {weights_only_refusal(exc)})") from None
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"{where}: not a checkpoint file")
    return obj


def scan(storage: Storage, *, with_manifest: bool = True) -> list[StepInfo]:
    """Every step directory (committed or not) under the root, oldest first."""
    infos = []
    for child in storage.listdir(""):
        base = child.removeprefix(TMP_PREFIX)
        step = parse_step(base)
        if step is None:
            continue
        committed = not child.startswith(TMP_PREFIX) and storage.exists(f"{child}/{MARKER}")
        info = StepInfo(step, child, committed)
        if committed and with_manifest:
            try:
                m = read_manifest(storage, child, step)
                info = StepInfo(step, child, True, (), m.created, m.world_size,
                                sum(e.size for e in m.files.values()))
            except CorruptCheckpointError as exc:
                info = StepInfo(step, child, True, (str(exc),))
        infos.append(info)
    return sorted(infos, key=lambda i: (i.step, i.name))


def prune(storage: Storage, retention: RetentionPolicy, *, protect: str | None = None,
          known_good: Collection[str] = (), known_bad: Collection[str] = (),
          deep: bool = False, dry_run: bool = False) -> list[str]:
    """Apply retention to committed steps and drop uncommitted leftovers older than the
    latest commit (crashed saves). Never deletes without a newer usable commit, nor a
    directory whose name carries ``protect`` (a save in flight). Returns the names deleted.

    Only usable steps count towards ``keep_last``. From the newest down, until
    ``keep_last`` usable ones are found, each step is checked: names in ``known_good``
    (the manager's last commit and restore) pass, names in ``known_bad`` (those its restore
    skipped) fail, others get the structural check (marker, manifest, file sizes), or
    with ``deep`` every checksum as ``verify`` does.
    """
    # Commit times are read only when time milestones need them (a request per step).
    infos = scan(storage, with_manifest=retention.milestone_every_seconds is not None)
    committed = [i for i in infos if i.committed]
    if not committed:
        return []
    usable: dict[str, bool] = {}
    found, last_found = 0, None
    for info in reversed(committed):
        # Past keep_last usable steps, but not past another directory of the same step.
        if found >= retention.keep_last and info.step != last_found:
            break
        problems = [] if info.name in known_good else (
            ["it did not verify when restoring"] if info.name in known_bad
            else _usability_problems(storage, info, deep))
        usable[info.name] = not problems
        if not problems:
            found, last_found = found + 1, info.step
        else:
            log.warning("checkpoint %s does not verify (%s): retention does not count it",
                        storage.url_of(info.name), "; ".join(problems)[:300])
    latest = max(i.step for i in committed)
    doomed = {c.name for c in to_delete(
        [CommittedStep(i.step, i.created or 0.0, usable.get(i.name, True), i.name)
         for i in committed], retention)}
    removed = []
    for info in infos:
        if info.committed and info.name in doomed:
            reason = "retention" if usable.get(info.name, True) else \
                "does not verify, and a step as new or newer does"
        elif (not info.committed and info.step < latest
              and (protect is None or protect not in info.name)):
            reason = "uncommitted leftover"
        else:
            continue
        log.info("deleting %s (%s)", storage.url_of(info.name), reason)
        if not dry_run:
            if info.committed:
                # Marker first: a crash part-way through the delete must leave an
                # uncommitted leftover, never a committed step with files missing.
                storage.delete(f"{info.name}/{MARKER}")
                storage.fsync_dir(info.name)
            storage.delete(info.name, recursive=True)
        removed.append(info.name)
    return removed


def _usability_problems(storage: Storage, info: StepInfo, deep: bool) -> list[str]:
    return list(verify_step(storage, info).problems) if deep else structural_problems(
        storage, info)


def structural_problems(storage: Storage, info: StepInfo) -> list[str]:
    """The cheap checks of a committed step: marker, manifest, every file present at its
    size (no checksums: :func:`verify_step` reads every byte)."""
    try:
        manifest = read_manifest(storage, info.name, info.step)
    except CorruptCheckpointError as exc:
        return [str(exc)]
    return _structural_problems(manifest, set(_list_files(storage, info.name)), storage,
                                info.name)


def verify_step(storage: Storage, info: StepInfo) -> StepInfo:
    """A deep check: marker, manifest, and every file's size and checksum."""
    if not info.committed:
        if info.name.startswith(TMP_PREFIX):
            what = "a temporary directory of a save in progress or one that never finished"
        else:
            what = (f"{MARKER} is missing: a save that never finished (or is still running), "
                    "or a marker that was deleted; restore skips it")
        return StepInfo(info.step, info.name, False, (f"not committed: {what}",))
    try:
        manifest = read_manifest(storage, info.name, info.step)
        problems = _structural_problems(manifest, set(_list_files(storage, info.name)),
                                        storage, info.name)
        for fname in manifest.files:
            if not any(p.startswith(fname) for p in problems):
                try:
                    if fname.endswith(".pt"):  # torch files: must load as restore loads them
                        _load_verified(storage, info.name, fname, manifest)
                    else:
                        read_verified(storage, info.name, fname, manifest)
                except CorruptCheckpointError as exc:
                    problems.append(str(exc))
    except CorruptCheckpointError as exc:
        return StepInfo(info.step, info.name, True, (str(exc),))
    return StepInfo(info.step, info.name, True, tuple(problems), manifest.created,
                    manifest.world_size, sum(e.size for e in manifest.files.values()))
