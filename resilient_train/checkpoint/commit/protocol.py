"""How a written step becomes committed: the two commit protocols, one class each.

Orbax's names (docs/design.md, "Commit protocols"):

- ATOMIC_RENAME (plain local disk): the ranks write into ``.tmp-step-...-TOKEN``, each
  holding a shared ``flock`` on it; the primary writes the manifest and the marker, fsyncs
  the directory and renames it to ``step-...``. Files need no rename of their own.
- COMMIT_FILE (object stores, FUSE mounts of them): no atomic directory rename, so the
  ranks write in place into ``step-...-TOKEN`` (a fresh name per run, so a crashed save
  can never mix its files into a later one), each file atomically, and the marker goes last.

The manager picks one with :func:`committer_for` when it starts, from the commit protocol
its storage backend declares (``Storage.commit_protocol``), and asks it where to write, to
hold the directory, to commit and to discard.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import ClassVar

from ..storage.base import PROBE_PREFIX, TMP_FILE_PREFIX, CommitProtocol, Storage, format_bytes
from .directory import (
    MANIFEST,
    MARKER,
    TMP_PREFIX,
    StepInfo,
    in_place_dirname,
    leftover_dir_step,
    step_dirname,
    temporary_dirname,
    unless_held,
    verify_step,
)
from .manifest import Manifest, marker_bytes

log = logging.getLogger(__name__)

_SCRATCH_STALE_S = 60.0


class Committer(ABC):
    """One commit protocol over one storage, for the saves of one run (``token``)."""

    protocol: ClassVar[CommitProtocol]
    files_atomic: ClassVar[bool]   # each file needs an atomic write (a rename) of its own

    def __init__(self, storage: Storage, token: str) -> None:
        self.storage = storage
        self.token = token

    @abstractmethod
    def work_dir(self, step: int) -> str:
        """Where this run writes its save of ``step``."""

    def already_committed(self, work: str) -> bool:
        """Whether ``work`` is a commit of this run already (then it is not written again)."""
        return False

    def hold(self, work: str) -> contextlib.AbstractContextManager[None]:
        """Held by every rank while it writes into ``work``."""
        return contextlib.nullcontext()

    def commit(self, work: str, manifest: Manifest) -> str:
        """Commit ``work`` (every rank's files are written): the manifest, the marker that
        names its checksum, then the protocol's own step. Returns the committed name."""
        data = manifest.to_bytes()
        self.storage.write_bytes(f"{work}/{MANIFEST}", data)
        self.storage.write_bytes(f"{work}/{MARKER}", marker_bytes(data, manifest.step))
        return self._publish(manifest.step, work)

    @abstractmethod
    def _publish(self, step: int, work: str) -> str: ...

    @abstractmethod
    def discard(self, work: str, *, transient: bool) -> None:
        """Delete what a failed save wrote (primary, once every rank is done writing)."""

    def _delete_work(self, work: str) -> None:
        try:
            self._delete(work)
            log.info("removed %s, written by a save that failed", self.storage.url_of(work))
        except Exception as exc:  # noqa: BLE001 - the save's own error matters more
            log.warning("could not remove %s after a failed save (the next start removes "
                        "it): %s", self.storage.url_of(work), exc)

    def _delete(self, work: str) -> None:
        self.storage.delete(work, recursive=True)


class AtomicRename(Committer):
    """Write into a temporary directory, commit by renaming it into place."""

    protocol = CommitProtocol.ATOMIC_RENAME
    files_atomic = False   # the directory's rename commits them all

    def work_dir(self, step: int) -> str:
        return temporary_dirname(step, self.token)

    def hold(self, work: str) -> contextlib.AbstractContextManager[None]:
        return _held(self.storage.local_path(work))

    def _publish(self, step: int, work: str) -> str:
        final = step_dirname(step)
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
        return final

    def discard(self, work: str, *, transient: bool) -> None:
        self._delete_work(work)


class CommitFile(Committer):
    """Write in place under a name of this run, commit by writing the marker last."""

    protocol = CommitProtocol.COMMIT_FILE
    files_atomic = True    # a reader must never see a torn file

    def work_dir(self, step: int) -> str:
        return in_place_dirname(step, self.token)

    def already_committed(self, work: str) -> bool:
        # This run committed this step under this name already (an emergency save right
        # after a periodic one); rewriting it in place could tear it.
        return self.storage.exists(f"{work}/{MARKER}")

    def _publish(self, step: int, work: str) -> str:
        return work   # the marker was the commit

    def discard(self, work: str, *, transient: bool) -> None:
        """Not after a storage outage (``transient``): each delete would wait out the retry
        deadline again. Such a leftover is an uncommitted directory that retention removes
        once a newer step of a later run commits."""
        if transient:
            log.warning("the failed save left %s behind (storage unavailable); retention "
                        "removes it later", self.storage.url_of(work))
            return
        self._delete_work(work)

    def _delete(self, work: str) -> None:
        # Marker first, as in prune: a crash part-way never leaves a committed half.
        self.storage.delete(f"{work}/{MARKER}")
        self.storage.delete(work, recursive=True)


_STRATEGIES: dict[CommitProtocol, type[Committer]] = {
    CommitProtocol.ATOMIC_RENAME: AtomicRename, CommitProtocol.COMMIT_FILE: CommitFile}


def committer_for(storage: Storage, token: str) -> Committer:
    """The commit strategy of the protocol ``storage`` declares: the one place that chooses."""
    return _STRATEGIES[storage.commit_protocol](storage, token)


# --- at start: what crashed saves left ----------------------------------------------------

def remove_crashed_saves(storage: Storage) -> None:
    """Where the root is a local path, at start, on the primary: delete the directories
    that runs which crashed mid-save (``.tmp-``) or mid-delete (``.del-``, directory.py's
    ``delete_step``) left in the root, and our scratch files. Readers never see them, and
    on a full disk they hold the space the next save needs. A directory that a live
    process holds (a save: AtomicRename.hold; a delete under way) is kept.

    Object stores keep an unfinished save under its final name without a marker, and an
    unfinished delete beside its record; neither costs local space, retention removes
    both (directory.prune), so nothing is deleted here."""
    root = storage.local_path("")
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
        is_leftover_dir = leftover_dir_step(name) is not None and os.path.isdir(path)
        # Scratch files live for milliseconds (a probe, an atomic write being renamed):
        # an old one is stale, a fresh one may be another process's probe.
        is_scratch = name.startswith((TMP_FILE_PREFIX, PROBE_PREFIX)) and \
            os.path.isfile(path) and _age_s(path) > _SCRATCH_STALE_S
        if not (is_leftover_dir or is_scratch):
            continue
        size = _tree_size(path)
        with unless_held(path if is_leftover_dir else None) as free_to_delete:
            if not free_to_delete:
                log.info("keeping %s: a live process holds it", path)
                continue
            try:
                storage.delete(name, recursive=True)
            except Exception as exc:  # noqa: BLE001 - check_writable reports what matters
                log.warning("could not remove %s, left by a crashed save or delete: %s",
                            path, exc)
                continue
        removed.append(name)
        freed += size
    if removed:
        log.warning("removed %d leftover(s) of saves that never finished and of "
                    "interrupted deletes from %s (%s): %s", len(removed), root,
                    format_bytes(freed),
                    ", ".join(removed[:5])
                    + (f" and {len(removed) - 5} more" if len(removed) > 5 else ""))


# --- locks: a live save's directory is never cleaned up (directory.unless_held) -----------

def _age_s(path: str) -> float:
    try:
        return time.time() - os.stat(path).st_mtime
    except OSError:
        return 0.0


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
