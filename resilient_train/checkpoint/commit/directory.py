"""What is in a checkpoint directory: its layout, listing, checks and retention.

Torch-free, so that ``resilient-train checkpoints list`` starts in a fraction of a second;
only a deep check of a torch file (:func:`verify_step`) loads torch, through commit/loader.py.

Layout under the checkpoint directory (docs/design.md, "Commit protocols")::

    step-000000001200/          one directory per committed step
        shared.pt               replicated state (model, optimizer, ...): the primary writes it
        rank-00000.pt           per-rank state: RNG states and user values (data position)
        manifest.json           every file's size and crc32c, step, world size, metadata
        COMMITTED               written last; names the manifest's checksum

A save in flight is ``.tmp-step-...-TOKEN`` (ATOMIC_RENAME: renamed into place when done)
or ``step-...-TOKEN`` (COMMIT_FILE: committed in place by its marker); commit/protocol.py writes
both. Readers see only steps with a marker whose manifest verifies.

A delete (:func:`delete_step`) is as crash-proof as a commit: on local disk the step is
renamed to ``.del-step-...-RANDOM`` first, and on object stores a record
``.deleting-<name>`` is written before its marker goes. What a crash leaves is debris
(``StepInfo.debris``), which readers skip and :func:`prune` and the next start remove.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field, replace

from ..storage.base import Storage, StorageNotFoundError
from .manifest import (
    MANIFEST,
    MARKER,
    CorruptCheckpointError,
    Manifest,
    check_marker,
    parse_step,
    read_verified,
    step_dirname,
)
from .retention import CommittedStep, RetentionPolicy, to_delete

__all__ = [
    "DEBRIS_DELETE", "DEBRIS_SAVE", "DELETING_PREFIX", "DEL_PREFIX", "MANIFEST", "MARKER",
    "SHARED_FILE", "TMP_PREFIX", "KnownSteps", "StepInfo", "debris_note",
    "default_directory", "delete_step", "find_committed", "in_place_dirname", "is_held",
    "leftover_dir_step", "list_files", "manifest_problems", "parse_step", "prune",
    "rank_file", "read_manifest", "scan", "step_dirname", "structural_problems",
    "temporary_dirname", "unless_held", "verify_step",
]

log = logging.getLogger(__name__)

SHARED_FILE = "shared.pt"
TMP_PREFIX = ".tmp-"
# Local disk: a step renamed out of the readers' namespace, to be removed (delete_step).
DEL_PREFIX = ".del-"
# Object stores: the record of a delete in progress of the directory named after it.
DELETING_PREFIX = ".deleting-"
# Why a leftover is debris (StepInfo.debris): safe to remove, never read.
DEBRIS_DELETE = "delete"   # an interrupted delete
DEBRIS_SAVE = "save"       # a save that never finished, older than the newest commit


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def temporary_dirname(step: int, token: str) -> str:
    """Where an ATOMIC_RENAME save of ``step`` writes before its rename into place."""
    return f"{TMP_PREFIX}{step_dirname(step)}-{token}"


def in_place_dirname(step: int, token: str) -> str:
    """Where a COMMIT_FILE save of ``step`` writes and commits: a fresh name per run, so a
    crashed save can never mix its files into a later one."""
    return f"{step_dirname(step)}-{token}"


def leftover_dir_step(name: str) -> int | None:
    """The step of a local leftover directory name (``.tmp-step-N-TOKEN``, ``.del-step-N
    [-TOKEN]-RANDOM``), else None."""
    if name.startswith(TMP_PREFIX):
        return parse_step(name[len(TMP_PREFIX):])
    if name.startswith(DEL_PREFIX) and "-" in name[len(DEL_PREFIX):]:
        return parse_step(name[len(DEL_PREFIX):].rsplit("-", 1)[0])
    return None


def default_directory() -> str:
    """``AIP_CHECKPOINT_DIR`` when the platform (or our launcher) sets it, else ./checkpoints."""
    return os.environ.get("AIP_CHECKPOINT_DIR") or "checkpoints"


@dataclass(frozen=True)
class StepInfo:
    step: int
    name: str                # directory name under the root
    committed: bool          # has a marker
    problems: tuple[str, ...] = ()
    created: float | None = None
    world_size: int | None = None
    size_bytes: int | None = None
    debris: str = ""         # DEBRIS_DELETE / DEBRIS_SAVE: a leftover to remove, never read

    @property
    def ok(self) -> bool:
        return self.committed and not self.problems


@dataclass
class KnownSteps:
    """What this run already knows about step directories, so retention checks none of
    them again: the last commit and the restored step verify; those restore skipped do not."""

    committed: str | None = None
    restored: str | None = None
    bad: set[str] = field(default_factory=set)

    def good(self) -> set[str]:
        return {n for n in (self.committed, self.restored) if n}

    def commit(self, name: str) -> None:
        self.committed = name
        self.bad.discard(name)   # a broken one of this name was moved aside


# --- reading -------------------------------------------------------------------------------

def list_files(storage: Storage, name: str) -> list[str]:
    """Every file under the step directory ``name``, relative to it."""
    out: list[str] = []
    for child in storage.listdir(name):
        rel = f"{name}/{child}"
        sub = storage.listdir(rel)
        if sub:
            out.extend(f"{child}/{f}" for f in list_files(storage, rel))
        else:
            out.append(child)
    return out


def find_committed(storage: Storage, step: int) -> str:
    """The name of the committed directory of ``step``."""
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


def manifest_problems(manifest: Manifest, present: set[str], storage: Storage,
                      name: str) -> list[str]:
    """How the files ``present`` in ``name`` differ from its manifest (names and sizes)."""
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


def scan(storage: Storage, *, with_manifest: bool = True) -> list[StepInfo]:
    """Every step directory (committed or not) under the root, oldest first, with the
    debris of interrupted deletes and saves marked (``StepInfo.debris``, never committed).
    One listing of the root: a delete's record sits beside the directory it deletes."""
    names = storage.listdir("")
    present = set(names)
    records = {n[len(DELETING_PREFIX):] for n in names if n.startswith(DELETING_PREFIX)}
    infos = []
    for child in names:
        if child.startswith(DELETING_PREFIX):
            target = child[len(DELETING_PREFIX):]
            step = parse_step(target)
            if step is not None and target not in present:   # only the record is left
                infos.append(StepInfo(step, child, False, debris=DEBRIS_DELETE))
            continue
        if child.startswith(DEL_PREFIX):
            step = leftover_dir_step(child)
            if step is not None:
                infos.append(StepInfo(step, child, False, debris=DEBRIS_DELETE))
            continue
        base = child.removeprefix(TMP_PREFIX)
        step = parse_step(base)
        if step is None:
            continue
        if child in records:   # being deleted: gone for readers, marker or not
            infos.append(StepInfo(step, child, False, debris=DEBRIS_DELETE))
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
    # A save older than the newest commit that never committed is over: it crashed (or, an
    # older version's delete stopped after the marker). A newer one may be in flight.
    latest = max((i.step for i in infos if i.committed), default=None)
    infos = [StepInfo(i.step, i.name, False, debris=DEBRIS_SAVE)
             if not i.committed and not i.debris and latest is not None and i.step < latest
             else i for i in infos]
    return sorted(infos, key=lambda i: (i.step, i.name))


# --- checking ------------------------------------------------------------------------------

def structural_problems(storage: Storage, info: StepInfo) -> list[str]:
    """The cheap checks of a committed step: marker, manifest, every file present at its
    size (no checksums: :func:`verify_step` reads every byte)."""
    try:
        manifest = read_manifest(storage, info.name, info.step)
    except CorruptCheckpointError as exc:
        return [str(exc)]
    return manifest_problems(manifest, set(list_files(storage, info.name)), storage,
                             info.name)


def verify_step(storage: Storage, info: StepInfo) -> StepInfo:
    """A deep check: marker, manifest, and every file's size and checksum; torch files
    must also load as restore loads them (this loads torch)."""
    if info.debris:
        return replace(info, problems=(debris_note(storage, info),))
    if not info.committed:
        if info.name.startswith(TMP_PREFIX):
            what = "a temporary directory of a save in progress or one that never finished"
        elif info.name.startswith(DEL_PREFIX):
            what = "a step being deleted by a live process"
        else:
            what = (f"{MARKER} is missing: a save that never finished (or is still running), "
                    "or a marker that was deleted; restore skips it")
        return StepInfo(info.step, info.name, False, (f"not committed: {what}",))
    try:
        manifest = read_manifest(storage, info.name, info.step)
        problems = manifest_problems(manifest, set(list_files(storage, info.name)),
                                     storage, info.name)
        for fname in manifest.files:
            if not any(p.startswith(fname) for p in problems):
                try:
                    if fname.endswith(".pt"):  # torch files: must load as restore loads them
                        from .loader import load_verified  # torch: only for a deep check

                        load_verified(storage, info.name, fname, manifest)
                    else:
                        read_verified(storage, info.name, fname, manifest)
                except CorruptCheckpointError as exc:
                    problems.append(str(exc))
    except CorruptCheckpointError as exc:
        return StepInfo(info.step, info.name, True, (str(exc),))
    return StepInfo(info.step, info.name, True, tuple(problems), manifest.created,
                    manifest.world_size, sum(e.size for e in manifest.files.values()))


def debris_note(storage: Storage, info: StepInfo) -> str:
    """What a debris entry is and how to remove it (``checkpoints list`` and ``verify``)."""
    what = {DEBRIS_DELETE: "an interrupted delete (retention or prune stopped part-way)",
            DEBRIS_SAVE: "a save that never finished (or an older version's interrupted "
                         "delete), older than the newest commit"}.get(info.debris, info.debris)
    return (f"debris of {what}: restore never reads it; safe to remove with "
            f"`resilient-train checkpoints prune {storage.url}` (the job's retention "
            f"removes it too)")


# --- deleting ------------------------------------------------------------------------------

def delete_step(storage: Storage, name: str) -> bool:
    """Delete the step directory ``name`` as crash-proof as a commit: at every instant
    readers see the whole step or none of it, and what a crash leaves is debris that
    :func:`prune` (and, on local disk, the next start) removes. Never through a link:
    a linked step is this directory's name only, so the link goes and its target stays.
    Returns False where another process is deleting it already.

    * Local disk: rename to ``.del-<name>-RANDOM`` (one atomic rename: the delete, for
      readers), then remove that, holding an exclusive flock on it meanwhile so that
      another process's clean-up leaves it alone.
    * Object stores and FUSE mounts (no atomic rename): write the record
      ``.deleting-<name>`` (the delete, for readers), the marker next (for readers that
      know no record), then the directory, the record last. A directory without a marker
      and without a record is never taken for debris: it may be a save in flight.
    """
    if storage.is_link(name):
        path = storage.url_of(name)
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        storage.delete(name)   # the link itself
        log.info("removed %s, a link to %s; what it points to is left alone", path, target)
        return True
    if storage.atomic_rename:
        with unless_held(storage.local_path(name)) as free:
            if not free:
                log.info("not deleting %s: another process is deleting it",
                         storage.url_of(name))
                return False
            debris = f"{DEL_PREFIX}{name}-{os.urandom(4).hex()}"
            try:
                storage.rename_dir(name, debris)   # fsyncs the parent: the delete holds
            except StorageNotFoundError:
                return False   # deleted meanwhile
            storage.delete(debris, recursive=True)
        return True
    record = f"{DELETING_PREFIX}{name}"
    storage.write_bytes(record, json.dumps({
        "deleting": name, "since": time.time(), "host": socket.gethostname(),
        "pid": os.getpid()}).encode())
    storage.delete(f"{name}/{MARKER}")
    storage.delete(name, recursive=True)
    storage.delete(record)
    return True


def _remove_debris(storage: Storage, info: StepInfo) -> bool:
    """Finish what an interrupted delete or save left; False where a live process holds
    it (a save in flight, or a delete under way)."""
    name = info.name
    if name.startswith(DELETING_PREFIX):          # the directory is gone, its record not
        storage.delete(name)
        return True
    if storage.is_link(name):
        return delete_step(storage, name)
    if name.startswith((TMP_PREFIX, DEL_PREFIX)):   # out of the readers' namespace already
        with unless_held(storage.local_path(name)) as free:
            if not free:
                log.info("keeping %s: a live process holds it", storage.url_of(name))
                return False
            storage.delete(name, recursive=True)
        return True
    if info.debris == DEBRIS_DELETE:               # its record is there: finish
        storage.delete(name, recursive=True)
        storage.delete(f"{DELETING_PREFIX}{name}")
        return True
    return delete_step(storage, name)              # an old uncommitted step


# --- retention -----------------------------------------------------------------------------

def prune(storage: Storage, retention: RetentionPolicy, *, protect: str | None = None,
          known_good: Collection[str] = (), known_bad: Collection[str] = (),
          deep: bool = False, dry_run: bool = False) -> list[str]:
    """Apply retention to committed steps, and remove debris (``StepInfo.debris``): what
    interrupted deletes left, and saves older than the latest commit that never committed.
    Never deletes without a newer usable commit, nor a directory whose name carries
    ``protect`` (this run's save in flight) or that a live process holds (a flock, local
    disk). Every delete is :func:`delete_step`'s. Returns the names deleted.

    Only usable steps count towards ``keep_last``. From the newest down, until
    ``keep_last`` usable ones are found, each step is checked: names in ``known_good``
    (the manager's last commit and restore) pass, names in ``known_bad`` (those its restore
    skipped) fail, others get the structural check (marker, manifest, file sizes), or
    with ``deep`` every checksum as ``verify`` does.
    """
    # Commit times are read only when time milestones need them (a request per step).
    infos = scan(storage, with_manifest=retention.milestone_every_seconds is not None)
    removed = []
    for info in infos:
        # Debris of this run's own save in flight (its token) stays: it is being written.
        if not info.debris or (info.debris == DEBRIS_SAVE and protect is not None
                               and protect in info.name):
            continue
        log.info("deleting %s (debris of an interrupted %s)", storage.url_of(info.name),
                 info.debris)
        if dry_run or _remove_debris(storage, info):
            removed.append(info.name)
    committed = [i for i in infos if i.committed]
    if not committed:
        return removed
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
    doomed = {c.name for c in to_delete(
        [CommittedStep(i.step, i.created or 0.0, usable.get(i.name, True), i.name)
         for i in committed], retention)}
    for info in committed:
        if info.name not in doomed:
            continue
        reason = "retention" if usable.get(info.name, True) else \
            "does not verify, and a step as new or newer does"
        log.info("deleting %s (%s)", storage.url_of(info.name), reason)
        if dry_run or delete_step(storage, info.name):
            removed.append(info.name)
    return removed


def _usability_problems(storage: Storage, info: StepInfo, deep: bool) -> list[str]:
    return list(verify_step(storage, info).problems) if deep else structural_problems(
        storage, info)


# --- locks: a live save's (or delete's) directory is never cleaned up -----------------------

@contextlib.contextmanager
def unless_held(path: str | None) -> Iterator[bool]:
    """True (holding an exclusive flock on path meanwhile) unless a live process holds it:
    a save writing into it (commit/protocol.py's ``_held``) or a delete removing it. Where locks
    are not supported, or path is None (not a local disk): True."""
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


def is_held(storage: Storage, name: str) -> bool:
    """Whether a live process holds the local directory ``name`` (a save in flight, a
    delete under way); False off local disk, where nothing holds a directory."""
    with unless_held(storage.local_path(name)) as free:
        return not free
