"""The launcher's watchdog: a tiny process in its own session that outlives a SIGKILLed launcher.

    python -m resilient_train.launcher.watchdog RESILIENT_TRAIN_LAUNCH_ID=ID JOB_DIR/processes.log

The launcher snapshots each worker's process tree every fraction of a second and appends
each process it has not seen before to ``processes.log``, one line
``REPLICA ATTEMPT RESTART PID START`` (START: when PID started, in clock ticks since boot,
/proc/PID/stat field 22). The watchdog's stdin is a pipe from the launcher; each line
``LIFE REPLICA ATTEMPT RESTART`` says that worker life is over: kill what is left of it.
At EOF (the launcher ended, or died) it kills what is left of every life.

"What is left" is found two ways: by the recorded process tree, each process still alive
with its recorded start time (a reused pid is never killed) and everything now below
those; and by environment (whatever carries the life's, or at EOF the launch id's,
``RESILIENT_TRAIN_*`` variables). Neither finds all alone: a daemon that left the worker's
session and cleared its environment is found by the tree, one born after the last
snapshot by its environment. Workers themselves die with the launcher by
PR_SET_PDEATHSIG. Linux only (it reads /proc); imports nothing beyond the standard library.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterable

# A stopped process cannot fork; its children are stopped in turn, generation by
# generation, before anything is killed. Bounds the walk if something forks without end.
_MAX_GENERATIONS = 64


def _read(path: str) -> bytes:
    """A small /proc file, read at the os level (a snapshot reads many: no file objects)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, 1 << 16)
        # A /proc read stops at a record that does not fit: short of full, there may be
        # more only when it came close (thousands of children of one thread).
        while len(data) > 1 << 15:
            more = os.read(fd, 1 << 16)
            if not more:
                break
            data += more
        return data
    finally:
        os.close(fd)


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot; None when there is no such process.
    With the pid it names one process for good: a reused pid has a later start."""
    try:
        data = _read(f"/proc/{pid}/stat")
    except OSError:
        return None
    # Field 2 (the command name) may hold spaces and parentheses: split after the last ')'.
    fields = data[data.rfind(b")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def children(pid: int) -> list[int] | None:
    """The children of ``pid`` from /proc/PID/task/*/children (each thread's own: a child
    forked from a thread is listed there). Cost grows with the process's threads, not
    with the machine's processes. None when the kernel has no such files."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []   # gone
    found: list[int] = []
    for tid in tids:
        try:
            found += [int(c) for c in _read(f"/proc/{pid}/task/{tid}/children").split()]
        except FileNotFoundError:
            if os.path.isdir(f"/proc/{pid}/task/{tid}"):
                return None   # the thread is there, the file is not: CONFIG_PROC_CHILDREN=n
        except (OSError, ValueError):
            pass
    return found


def _parent_map() -> dict[int, list[int]]:
    """Every process's children, from one scan of /proc (the fallback: it reads a file per
    process on the machine)."""
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
            ppid = int(data[data.rfind(b")") + 2:].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(name))
    return kids


def descendants(roots: Iterable[int]) -> list[int]:
    """Every process below ``roots`` (not the roots themselves), parents before children."""
    out: list[int] = []
    seen = set(roots)
    todo = list(seen)
    scan: dict[int, list[int]] | None = None
    while todo:
        pid = todo.pop()
        found = children(pid) if scan is None else scan.get(pid, [])
        if found is None:   # no children files: one full scan answers for every process
            scan = _parent_map()
            found = scan.get(pid, [])
        for child in found:
            if child not in seen:
                seen.add(child)
                out.append(child)
                todo.append(child)
    return out


def _signal(pid: int, ticks: int, sig: int) -> bool:
    """Send ``sig`` to ``pid`` if it is still the process that started at ``ticks``."""
    pidfd = getattr(os, "pidfd_open", None)
    if pidfd is not None:
        # The pidfd pins the process: once the start time checks out, the signal cannot
        # reach a newer process that got the same pid.
        try:
            fd = pidfd(pid)
        except OSError:
            return False
        try:
            if start_ticks(pid) != ticks:
                return False
            signal.pidfd_send_signal(fd, sig)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
    if start_ticks(pid) != ticks:
        return False
    try:
        os.kill(pid, sig)
        return True
    except OSError:
        return False


def kill_trees(procs: Iterable[tuple[int, int]]) -> int:
    """SIGKILL each (pid, start ticks) still alive, and every process now below them.

    Top-down, each generation is SIGSTOPped before its children are looked up, so nothing
    forks past the walk; then all are killed. Returns how many were killed."""
    me = os.getpid()
    stopped: dict[int, int] = {}
    frontier = [(pid, ticks) for pid, ticks in procs if pid != me]
    for _ in range(_MAX_GENERATIONS):
        new = []
        for pid, ticks in frontier:
            if pid not in stopped and _signal(pid, ticks, signal.SIGSTOP):
                stopped[pid] = ticks
                new.append(pid)
        if not new:
            break
        frontier = []
        for child in descendants(new):
            born = start_ticks(child)
            if born is not None and child not in stopped and child != me:
                frontier.append((child, born))
    return sum(_signal(pid, ticks, signal.SIGKILL) for pid, ticks in stopped.items())


def sweep(key: bytes, extra: list[bytes]) -> None:
    """SIGKILL every process whose environment has ``key`` and all of ``extra``; repeat
    while that finds any, since a dying process may have forked."""
    me = os.getpid()
    for _ in range(5):
        hits = 0
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == me:
                continue
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if key in env and all(e in env for e in extra):
                try:
                    os.kill(int(name), signal.SIGKILL)
                    hits += 1
                except OSError:
                    pass
        if not hits:
            return


class Trees:
    """The processes the launcher recorded, by worker life."""

    def __init__(self) -> None:
        self.lives: dict[tuple[bytes, ...], dict[int, int]] = {}
        self._size, self._pruned_at = 0, 64

    def add(self, life: tuple[bytes, ...], pid: int, ticks: int) -> None:
        procs = self.lives.setdefault(life, {})
        self._size += pid not in procs
        procs[pid] = ticks
        if self._size > self._pruned_at:
            # A long life forks many short-lived helpers: forget the dead ones now and then
            # (amortized: when the table has doubled since the last time).
            for known in self.lives.values():
                for dead in [p for p, t in known.items() if start_ticks(p) != t]:
                    del known[dead]
            self._size = sum(len(p) for p in self.lives.values())
            self._pruned_at = max(64, 2 * self._size)

    def pop(self, life: tuple[bytes, ...]) -> dict[int, int]:
        procs = self.lives.pop(life, {})
        self._size -= len(procs)
        return procs

    def pop_all(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for life in list(self.lives):
            out.update(self.pop(life))
        return out


class _Log:
    """Reads the lines ``processes.log`` has gained since the last call."""

    def __init__(self, path: str | None) -> None:
        self.path, self.offset, self.partial = path, 0, b""

    def load(self, trees: Trees) -> None:
        if self.path is None:
            return
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        for line in lines:
            parts = line.split()
            if len(parts) == 5:
                try:
                    trees.add(tuple(parts[:3]), int(parts[3]), int(parts[4]))
                except ValueError:
                    continue


def main(argv: list[str]) -> None:
    key = argv[1].encode()
    trees, recorded = Trees(), _Log(argv[2] if len(argv) > 2 else None)
    for line in sys.stdin.buffer:
        parts = line.split()
        if len(parts) == 4 and parts[0] == b"LIFE":
            recorded.load(trees)
            kill_trees(trees.pop(tuple(parts[1:4])).items())
            sweep(key, [b"RESILIENT_TRAIN_REPLICA=" + parts[1],
                        b"RESILIENT_TRAIN_ATTEMPT=" + parts[2],
                        b"RESILIENT_TRAIN_RESTART_COUNT=" + parts[3]])
    recorded.load(trees)
    kill_trees(trees.pop_all().items())
    sweep(key, [])


if __name__ == "__main__":
    main(sys.argv)
