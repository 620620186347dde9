"""The persistent tier: the checkpoint directory (local disk, ``/gcs/``, ``gs://``), the one
that outlives the job's machines.

A save writes each rank's files, the ranks report to the primary, and the primary commits
the step by the storage's protocol (commit/protocol.py), then applies retention; a failed
rank's files and the step are removed, the last committed step is kept. A restore takes the
newest committed step that verifies on every rank, the replicated state read once by the
primary and streamed to the others (transport/readonce.py), a corrupt step skipped for the
one before it, and never a silent fresh start where steps exist but none verifies.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from ... import __version__
from ...errors import Classification, classify_exception
from ..commit.directory import (
    SHARED_FILE,
    TMP_PREFIX,
    KnownSteps,
    StepInfo,
    find_committed,
    list_files,
    manifest_problems,
    parse_step,
    prune,
    rank_file,
    read_manifest,
    scan,
)
from ..commit.lastwriter import WriterWatch
from ..commit.loader import load_verified
from ..commit.manifest import (
    MARKER,
    CheckpointError,
    CorruptCheckpointError,
    FileEntry,
    Manifest,
    manifest_entry,
)
from ..commit.protocol import committer_for, remove_crashed_saves
from ..commit.retention import RetentionPolicy
from ..commit.sharded import SHARDED_LAYOUT, ShardedCheckpointer
from ..commit.stepwriter import RankFailure, StepWriter
from ..errors import CheckpointStorageFullError, TransientCheckpointError
from ..progress import Progress
from ..schedule.coordination import Coordinator
from ..schedule.emergency import CommitGate
from ..storage.base import Storage, format_bytes, free_bytes, is_no_space
from ..transport.readonce import read_once
from .restored import Restored, RestoreRecord, bytes_read
from .tier import SaveRequest

log = logging.getLogger(__name__)


class PersistentTier:
    """The checkpoint directory: every rank's files of a step, committed by the primary."""

    name = "persistent"

    def __init__(self, storage: Storage, coord: Coordinator, sharded: ShardedCheckpointer,
                 gate: CommitGate, *, retention: RetentionPolicy,
                 metadata: Mapping[str, Any], storage_options: Mapping[str, Any] | None
                 ) -> None:
        self.storage, self.coord, self.sharded, self.gate = storage, coord, sharded, gate
        self.rank, self.world_size = coord.rank, coord.world_size
        self.is_primary = self.rank == 0
        self.retention, self.metadata = retention, metadata
        self._writers = WriterWatch(storage.url, storage_options)
        if self.is_primary:
            # Every rank is past the policy agreement and waits for the token below, so no
            # rank of this run is saving: what temporary saves exist are from crashed runs.
            remove_crashed_saves(storage)
            storage.check_writable(again=False)   # a missing bucket fails now, not hours later
        # A fresh name per run for in-flight saves: a crashed run's leftovers never mix in.
        self._token: str = coord.broadcast(os.urandom(4).hex())
        self.committer = committer_for(storage, self._token)
        self.writer = StepWriter(storage, sharded, rank=self.rank,
                                 files_atomic=self.committer.files_atomic)
        self.last_commit_step: int | None = None
        self._recorded: int | None = None   # committed, its writer record not yet written
        # For retention: the steps known to verify or not; neither is checked again.
        self.known = KnownSteps()
        self._read_bytes = 0   # checkpoint bytes this rank read in a restore

    @property
    def token(self) -> str:
        """This run's name for its saves in flight (the node-local tier's too)."""
        return self._token

    # --- saving -------------------------------------------------------------------------

    def takes(self, save: SaveRequest) -> bool:
        return save.persistent

    def needs_shared(self, save: SaveRequest) -> bool:
        return self.is_primary   # the primary writes the replicated state

    def write(self, save: SaveRequest, snap: dict[str, Any],
              ready: Callable[[], None]) -> bool:
        """Writer thread: write this rank's files, hand them to the primary, which commits
        the step or, if any rank failed, discards it and raises why. ``ready`` waits for
        the snapshot's deferred copies; its failure is this rank's, reported like a write's."""
        step = save.step
        if not self.is_primary:   # the primary's alone (another tier may need this one's)
            snap = {k: v for k, v in snap.items() if k != "shared"}
        work = self.committer.work_dir(step)
        if self.committer.already_committed(work):
            log.info("checkpoint step %d is already committed; not saving it again", step)
            return True
        with self.committer.hold(work):
            self._write_held(step, snap, work, ready)
        return True

    def _write_held(self, step: int, snap: dict[str, Any], work: str,
                    ready: Callable[[], None]) -> None:
        entries: dict[str, FileEntry] = {}
        failure: Exception | None = None
        try:
            ready()   # the snapshot's deferred copies (an overlapped snapshot)
            entries = self.writer.write(work, snap)
        except Exception as exc:  # reported to the primary below, then raised
            failure = exc
        # Every rank gets here, also after a failure: no one waits in the gather for a rank
        # that gave up, and the primary learns that the step must not be committed.
        mine = None if failure is None else self.writer.failure(snap, failure)
        gathered = self.coord.gather((step, entries, mine))
        if gathered is None:  # only the primary commits (and cleans up)
            if mine is not None:
                self._raise_failed(step, [mine], 0, failure)
            return
        failed = [f for _, _, f in gathered if f is not None]
        # What the ranks that did not fail wrote, to the byte: part of what the step needs.
        written = sum(e.size for _, files, f in gathered if f is None for e in files.values())
        if failed:
            self.committer.discard(work, transient=any(f.transient for f in failed))
            self._raise_failed(step, failed, written, failure)
        try:
            self._commit(step, work, "dcp" in snap, gathered)
        except Exception as exc:
            self.committer.discard(
                work, transient=classify_exception(exc) is Classification.TRANSIENT)
            if is_no_space(exc):
                # The files are all written (in ``written``): the commit's own did not fit.
                self._raise_failed(step, [self.writer.failure(snap, exc, nbytes=0)],
                                   written, exc)
            raise

    def _raise_failed(self, step: int, failed: list[RankFailure], written: int,
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
            keep = self.retention.keep_last
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

    def _commit(self, step: int, work: str, sharded: bool, gathered: list[Any]) -> None:
        steps = {rank: s for rank, (s, _, _) in enumerate(gathered)}
        if set(steps.values()) != {step}:
            # Committing would pair this manifest with other steps' files: refuse.
            ranks = ", ".join(f"rank {r}: step {s}" for r, s in steps.items())
            raise CheckpointError(
                f"the ranks saved different steps ({ranks}): "
                "their save policies decided differently. A SavePolicy must decide from its "
                "SaveContext (and state that is the same on every rank) alone; step "
                f"{step} is not committed.")
        files: dict[str, FileEntry] = {}
        for _, part, _ in gathered:
            files.update(part)
        manifest = Manifest(step=step, world_size=self.world_size,
                            layout=SHARDED_LAYOUT if sharded else "replicated",
                            files=files, library=f"resilient-train {__version__}",
                            metadata=dict(self.metadata))
        with self.gate.commit(step):   # refused after an emergency save's deadline
            committed_as = self.committer.commit(work, manifest)
        self.last_commit_step = self._recorded = step
        self.known.commit(committed_as)
        log.info("checkpoint step %d committed to %s", step, self.storage.url_of(committed_as))

    def after_commit(self, *, stopping: bool) -> None:
        """Writer thread, after a save: the writer record of the step it committed (the
        primary's; not while ``stopping``: a stop's exit does not wait on advice) and
        retention."""
        step, self._recorded = self._recorded, None
        if step is not None and not stopping:
            self._writers.committed(step)
        self._apply_retention()

    def _apply_retention(self) -> None:
        if not self.is_primary:
            return
        # The step is committed: a failure to clean up must not report the save as failed.
        try:
            prune(self.storage, self.retention, protect=self._token,
                  known_good=self.known.good(), known_bad=self.known.bad)
        except Exception as exc:
            log.warning("retention after a commit failed (retried after the next one): %s", exc)

    def latest_step(self) -> int | None:
        """The newest committed step in the checkpoint directory (its marker written), or
        None: a listing, no checkpoint read. For a process that follows a job's checkpoints
        (an evaluator): call ``restore_latest()`` when it moves."""
        return max((i.step for i in scan(self.storage, with_manifest=False) if i.committed),
                   default=None)

    def begin_restore(self) -> None:
        return None   # reads and a broadcast would compete with the model's build

    def restore(self, sharded: bool) -> Restored:
        """A collective: the newest committed step that verifies on every rank (each
        rank's own file, and the replicated state read once, by the primary, and streamed
        to the others), or a fresh start."""
        self._read_bytes = 0
        infos = scan(self.storage, with_manifest=False) if self.is_primary else []
        names: list[tuple[int, str]] = self.coord.broadcast(
            [(i.step, i.name) for i in infos if i.committed] if self.is_primary else None)
        if self.is_primary:
            self._warn_uncommitted(infos)
            self._writers.looked()
        problems: list[str] = []
        for step, name in sorted(names, reverse=True):
            # A restore of tens of GB takes minutes: the primary, which reads the
            # replicated state for every rank, says how far it has got.
            with Progress(f"restoring step {step} from {self.storage.url_of(name)}",
                          lambda: self.storage.bytes_moved,
                          after_s=None if self.is_primary else math.inf,
                          log=log) as progress:
                fetched = self._fetch_step(step, name, problems, progress)
            if fetched is not None:
                return fetched
            self.known.bad.add(name)
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
        return Restored(self._record(0), step=None, shared={}, mine={},
                        last_commit=None, save_point=(None, 0.0))

    def _fetch_step(self, step: int, name: str, problems: list[str],
                    progress: Progress) -> Restored | None:
        """One committed step from storage on every rank, or None (and the problem noted)
        where it does not verify on some rank."""
        loaded: tuple[Manifest, dict[str, Any], dict[str, Any] | None] | None = None
        try:
            loaded = self._load_step(step, name, progress)
        except CorruptCheckpointError as exc:
            problems.append(str(exc))
        # Every rank must restore the same step: one rank's bad file skips it for all.
        if self.coord.allreduce_max([0 if loaded else 1])[0] != 0 or loaded is None:
            return None
        manifest, shared, mine = loaded
        try:
            shared = self._share(name, manifest, shared)
        except CorruptCheckpointError as exc:   # raised alike on every rank
            problems.append(str(exc))
            return None
        if mine is None:
            mine = self._values_of_rank_0(manifest)
        if self.is_primary and manifest.world_size > self.world_size:
            self._say_ranks_dropped(manifest)
        sharded = manifest.layout == SHARDED_LAYOUT

        def load_sharded(tracked: Mapping[str, Any], strict: bool) -> None:
            self.sharded.load(self.storage, manifest, tracked, shared, strict=strict)

        return Restored(self._record(step), step=step,
                        shared=None if sharded else shared, mine=mine, last_commit=step,
                        save_point=(step, manifest.created),
                        load=load_sharded if sharded else None,
                        message=f"restored checkpoint step {step} from {self.storage.url}",
                        name=name)

    def _record(self, step: int) -> RestoreRecord:
        return RestoreRecord(step=step, source="persistent" if step else "none", seconds=0.0,
                             bytes_read=bytes_read(persistent=self._read_bytes),
                             where=self.storage.url)

    def _values_of_rank_0(self, manifest: Manifest) -> dict[str, Any]:
        """A step saved by fewer ranks has no file for this one: rank 0's ``values``, and
        this rank's RNG streams as they are (another rank's are not ours)."""
        log.warning("checkpoint step %d was written by %d ranks and has no file for rank "
                    "%d: its RNG state stays as it is and the values of rank 0 are used",
                    manifest.step, manifest.world_size, self.rank)
        theirs = load_verified(self.storage, find_committed(self.storage, manifest.step),
                               rank_file(0), manifest)
        self._read_bytes += manifest.files[rank_file(0)].size
        return {"values": theirs["values"]}

    def _say_ranks_dropped(self, manifest: Manifest) -> None:
        """A step saved by more ranks than this job has: the extra ranks' own state (RNG
        streams, values, buffers) has no rank to go to. Said once, by the primary."""
        first, last = self.world_size, manifest.world_size - 1
        ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
        log.warning("checkpoint step %d was written by %d ranks and this job has %d: the "
                    "RNG states and values of %s are not used (the tracked objects and a "
                    "ResumableLoader's position do not depend on the world size)",
                    manifest.step, manifest.world_size, self.world_size, ranks)

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
        except Exception as exc:
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

    def _load_step(self, step: int, name: str, progress: Progress
                   ) -> tuple[Manifest, dict[str, Any], dict[str, Any] | None]:
        where = self.storage.url_of(name)
        manifest = read_manifest(self.storage, name, step)
        if manifest.layout != SHARDED_LAYOUT:   # what this rank reads: the primary the most
            reads = [rank_file(self.rank), *([SHARED_FILE] if self.is_primary else [])]
            progress.total = sum(manifest.files[f].size for f in reads if f in manifest.files)
        present = set(list_files(self.storage, name))
        problems = manifest_problems(manifest, present, self.storage, name)
        if problems:
            raise CorruptCheckpointError(f"{where}: " + "; ".join(problems))
        # Read once: the replicated state is the same for every rank, so in a group the
        # primary streams it to the others (_share) once every rank's own file verified.
        shared: dict[str, Any] = {}
        if self._group() is None:
            shared = load_verified(self.storage, name, SHARED_FILE, manifest)
            self._read_bytes += manifest.files[SHARED_FILE].size
        if manifest.layout == SHARDED_LAYOUT:  # deep-check the DCP files this rank reads
            self.sharded.verify(self.storage, name, manifest)
        own = rank_file(self.rank)
        mine = None
        if own in manifest.files:
            mine = load_verified(self.storage, name, own, manifest)
            self._read_bytes += manifest.files[own].size
        return manifest, shared, mine

    def _group(self) -> Any:
        """The process group that a read-once restore streams over; None: read alone."""
        return None if self.world_size == 1 else getattr(self.coord, "main_group", None)

    def _share(self, name: str, manifest: Manifest, shared: dict[str, Any]
               ) -> dict[str, Any]:
        """The replicated state on every rank: read by the primary alone and streamed to
        the others as it is read (transport/readonce.py); ``shared`` where this rank read
        it alone."""
        group = self._group()
        if group is None:
            return shared
        rel = f"{name}/{SHARED_FILE}"
        entry = manifest_entry(manifest, SHARED_FILE, self.storage.url_of(rel))

        def counted(n: int) -> None:
            self._read_bytes += n

        return read_once(self.storage, rel, entry, src=0, rank=self.rank, group=group,
                         counted=counted)

    def restored(self, got: Restored) -> None:
        """A restore was loaded (from any tier): the commit it counts from, and the step
        read from here, which retention then knows verifies."""
        self.last_commit_step = got.last_commit
        if got.record.source == self.name:
            self.known.restored = got.name

    def hand_over(self, step: int) -> None:
        return None   # what it holds outlives the process

    def close(self) -> None:
        return None
