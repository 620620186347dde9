"""Each replica's own machine: its container's files and its VM's local disk.

On the platform every replica is a container on a VM of its own. What it writes to its own
filesystem no other replica sees, and a restart replaces the container (a fresh copy of
the image). Our reading of what each fault keeps (docs/platform.md, "What a replica's
files survive"):

| the replica's new life | its container's files: TMPDIR, working directory | its VM's local disk: RESILIENT_TRAIN_NODE_LOCAL_DIR |
|---|---|---|
| the job's first start, a job retry | new | new |
| restarted in place after its own exit (a policy's restart_worker) | new | kept |
| restarted along with a peer (restartJobOnWorkerRestart) | new | kept |
| maintenance, node loss, preemption | new | new (moved, or assume the worst) |

Shared storage (the output directory, `gs://`, a `/gcs/` mount) survives everything.

Locally each replica gets a directory tree standing for that machine, wiped exactly where
the table says. Its working directory is a *view* of the launcher's: one symbolic link
per entry of the launcher's working directory (the user's code, data), and whatever the
replica creates there is its own. Writing inside a linked subdirectory still reaches the
shared tree (a view, not a copy): only the top level is the replica's own.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..platform.rules import Cause

log = logging.getLogger(__name__)

# Causes after which the replica's next life runs on another VM (the table above).
_VM_LOST = frozenset({Cause.MAINTENANCE, Cause.NODE_LOSS, Cause.PREEMPTION})
# A working directory with more entries than this is not mirrored (one link per entry per
# life): the replicas then run in the launcher's own, with a warning.
MAX_VIEW_ENTRIES = 10_000


def new_vm_after(cause: Cause) -> bool:
    """Whether a replica restarted after ``cause`` gets a new VM (its local disk wiped)."""
    return cause in _VM_LOST


@dataclass(frozen=True)
class Placement:
    """Where one life of a replica runs, and what its start wiped."""

    workdir: Path | None        # its working directory; None: the launcher's own
    tmpdir: Path                # TMPDIR
    node_local: Path            # NODE_LOCAL_DIR_ENV
    wiped: tuple[str, ...]      # what of the previous life is gone, for the event line
    kept: tuple[str, ...]       # what of it this life still has


class Machines:
    """The replicas' machine directories of one launch.

    ``JOB_DIR/machines/REPLICA/{container/workdir, vm/local}`` (kept after the job, to look
    at) and TMPDIR under the launcher's temporary directory, short because Unix socket paths
    are at most 107 bytes (multiprocessing puts its sockets there), removed at the end."""

    def __init__(self, job_dir: Path, launch_id: str, *, source: Path | None,
                 tmp_base: str | None = None) -> None:
        self.root = job_dir / "machines"
        base = Path(tmp_base or tempfile.gettempdir())
        self.tmp_root = base / f"rt-{launch_id[:10]}"
        self.source = source
        self._reported: set[tuple[str, str]] = set()
        self._linked: set[str] = set()   # names the views link to the launcher's directory
        self._lived: set[str] = set()
        # The entry of the working directory that holds the job directory (rt-jobs/ by
        # default) is not linked into the views: a link from inside a tree to its own top
        # makes a loop that a walk following links never leaves (setuptools' package
        # discovery hung on `pip install -e .` after one launch), and no platform replica
        # sees the launcher's records anyway.
        self._outside_view: str | None = None
        if source is not None:
            try:
                inside = self.root.resolve().relative_to(source.resolve()).parts
            except ValueError:   # the job directory is elsewhere
                inside = ()
            self._outside_view = inside[0] if inside else None
            try:
                count = sum(1 for _ in os.scandir(source))
            except OSError as exc:
                raise OSError(f"cannot list the working directory {source}: "
                              f"{exc.strerror or exc}") from None
            if count > MAX_VIEW_ENTRIES:
                log.warning("the working directory %s has %d entries (more than %d): every "
                            "replica runs in it, and sees the files the others write there",
                            source, count, MAX_VIEW_ENTRIES)
                self.source = None

    def workdir(self, replica: str) -> Path:
        return self.root / replica / "container" / "workdir"

    def node_local(self, replica: str) -> Path:
        return self.root / replica / "vm" / "local"

    def tmpdir(self, replica: str) -> Path:
        return self.tmp_root / replica

    def prepare(self, replica: str, *, new_vm: bool) -> Placement:
        """Set up the machine for the next life of ``replica``: a new container always, a
        new VM when ``new_vm``; say what of the previous life went and what stayed."""
        first = replica not in self._lived
        self._lived.add(replica)
        container = [*self._entries(self.workdir(replica), own_only=True),
                     *(f"tmp/{n}" for n in self._entries(self.tmpdir(replica)))]
        local = self._entries(self.node_local(replica))
        wiped: list[str] = []
        kept: list[str] = []
        if not first:
            if container:
                wiped.append(f"its container's files ({_listing(container)})")
            if local:
                (wiped if new_vm else kept).append(f"its node-local disk ({_listing(local)})")
        for path in (self.workdir(replica), self.tmpdir(replica)):
            _wipe(path)
        if new_vm:
            _wipe(self.node_local(replica))
        self.node_local(replica).mkdir(parents=True, exist_ok=True)
        self.tmpdir(replica).mkdir(parents=True, exist_ok=True)
        workdir = None
        if self.source is not None:
            workdir = self.workdir(replica)
            self._link_view(workdir)
        return Placement(workdir, self.tmpdir(replica), self.node_local(replica),
                         tuple(wiped), tuple(kept))

    def written(self, replica: str) -> list[str]:
        """Entries ``replica`` created in its working directory and that were not reported
        yet (each name once per job)."""
        out = []
        for name in self._entries(self.workdir(replica), own_only=True):
            if (replica, name) not in self._reported:
                self._reported.add((replica, name))
                out.append(name)
        return out

    def close(self) -> None:
        """Remove every TMPDIR (the rest stays in the job directory)."""
        _wipe(self.tmp_root)

    # --- helpers ---

    def _link_view(self, workdir: Path) -> None:
        assert self.source is not None
        workdir.mkdir(parents=True, exist_ok=True)
        for entry in os.scandir(self.source):
            if entry.name == self._outside_view:
                continue
            try:
                os.symlink(entry.path, workdir / entry.name)
            except FileExistsError:
                pass
            self._linked.add(entry.name)

    def _entries(self, path: Path, *, own_only: bool = False) -> list[str]:
        """Names in ``path`` (a directory shown with a trailing /); with ``own_only``, not
        the links into the launcher's working directory that the view was made of."""
        try:
            entries = list(os.scandir(path))
        except OSError:
            return []
        out = []
        for entry in entries:
            if own_only and entry.name in self._linked and entry.is_symlink():
                continue
            out.append(entry.name + ("/" if entry.is_dir(follow_symlinks=False) else ""))
        return sorted(out)


def _listing(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


def _wipe(path: Path) -> None:
    """Remove a tree; links in it are removed, never followed (shutil.rmtree's rule)."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        for entry in os.scandir(path):   # (rmtree's onerror / onexc differ by version)
            try:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("cannot remove %s: %s", entry.path, exc)
        try:
            path.rmdir()
        except OSError as exc:
            log.warning("cannot remove %s: %s", path, exc)
