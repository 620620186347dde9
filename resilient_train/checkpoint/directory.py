"""What is in a checkpoint directory: its layout, listing, checks and retention.

Torch-free, so that ``resilient-train checkpoints list`` starts in a fraction of a second;
only a deep check of a torch file (:func:`verify_step`) loads torch, through loader.py.

Layout under the checkpoint directory (docs/design.md, "Commit protocols")::

    step-000000001200/          one directory per committed step
        shared.pt               replicated state (model, optimizer, ...): the primary writes it
        rank-00000.pt           per-rank state: RNG states and user values (data position)
        manifest.json           every file's size and crc32c, step, world size, metadata
        COMMITTED               written last; names the manifest's checksum

A save in flight is ``.tmp-step-...-TOKEN`` (ATOMIC_RENAME: renamed into place when done)
or ``step-...-TOKEN`` (COMMIT_FILE: committed in place by its marker); commit.py writes
both. Readers see only steps with a marker whose manifest verifies.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from dataclasses import dataclass, field

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
from .storage import Storage

__all__ = [
    "MANIFEST", "MARKER", "SHARED_FILE", "TMP_PREFIX", "KnownSteps", "StepInfo",
    "default_directory", "find_committed", "in_place_dirname", "list_files",
    "manifest_problems", "parse_step", "prune", "rank_file", "read_manifest", "scan",
    "step_dirname", "structural_problems", "temporary_dirname", "verify_step",
]

log = logging.getLogger(__name__)

SHARED_FILE = "shared.pt"
TMP_PREFIX = ".tmp-"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def temporary_dirname(step: int, token: str) -> str:
    """Where an ATOMIC_RENAME save of ``step`` writes before its rename into place."""
    return f"{TMP_PREFIX}{step_dirname(step)}-{token}"


def in_place_dirname(step: int, token: str) -> str:
    """Where a COMMIT_FILE save of ``step`` writes and commits: a fresh name per run, so a
    crashed save can never mix its files into a later one."""
    return f"{step_dirname(step)}-{token}"


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
    if not info.committed:
        if info.name.startswith(TMP_PREFIX):
            what = "a temporary directory of a save in progress or one that never finished"
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
                        from .loader import load_verified   # torch: only for a deep check

                        load_verified(storage, info.name, fname, manifest)
                    else:
                        read_verified(storage, info.name, fname, manifest)
                except CorruptCheckpointError as exc:
                    problems.append(str(exc))
    except CorruptCheckpointError as exc:
        return StepInfo(info.step, info.name, True, (str(exc),))
    return StepInfo(info.step, info.name, True, tuple(problems), manifest.created,
                    manifest.world_size, sum(e.size for e in manifest.files.values()))


# --- retention -----------------------------------------------------------------------------

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
        if not dry_run and storage.is_link(info.name):
            _remove_link(storage, info.name)
        elif not dry_run:
            if info.committed:
                # Marker first: a crash part-way through the delete must leave an
                # uncommitted leftover, never a committed step with files missing.
                storage.delete(f"{info.name}/{MARKER}")
                storage.fsync_dir(info.name)
            storage.delete(info.name, recursive=True)
        removed.append(info.name)
    return removed


def _remove_link(storage: Storage, name: str) -> None:
    """A linked step is this directory's name only (another run's step, say): the link
    goes, what it points to stays. Deleting its marker through the link would uncommit
    the other run's step."""
    path = storage.url_of(name)
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    storage.delete(name)   # the link itself
    log.info("removed %s, a link to %s; what it points to is left alone", path, target)


def _usability_problems(storage: Storage, info: StepInfo, deep: bool) -> list[str]:
    return list(verify_step(storage, info).problems) if deep else structural_problems(
        storage, info)
