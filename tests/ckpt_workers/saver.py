"""Crash-test worker: a warm parent that forks saving children and SIGKILLs them.

The parent imports torch and the package once (about 2 s), then serves commands, one JSON
object per line on stdin, answering one JSON line on stdout:

    {"cmd": "run", "url": ..., "storage_options": {...} | null, "async_save": bool,
     "numel": int, "train_s": float, "keep_last": int, "report": path, "error_file": path,
     "kill_after_s": float, "node_local": path | null, "kill_in": stop point | null,
     "kill_in_step": [mod, rem] | null, "from_first_commit": bool}
        fork a child that restores the latest checkpoint (like a restarted job) and then
        loops: advance the model one step (crash_model), simulated compute (train_s),
        save the step. Once the child is in its loop, wait kill_after_s (the randomised
        kill instant the test drew; with ``from_first_commit``, counted from the child's
        first commit instead), SIGKILL it, reap it, and answer
        {"event": "killed", "signal": 9, "main": ..., "writer": ..., "aim": ...,
         "hit": ..., ...}
        naming what the child was doing when it died.
        With ``kill_in`` (an aimed kill) the parent does not guess the instant: after the
        delay it arms that stop point in the shared page, and the child, the next time it
        gets there (in a save of a step ``step % mod == rem`` with ``kill_in_step``),
        stops itself: a SIGSTOP to the thread that got there, which stops at once, and
        with it the process; the parent sees it stopped (waitpid WUNTRACED) and SIGKILLs
        it there. The stop points (STOP_POINTS):
        ``node-local``, a file of the node-local tier's save just opened; ``data``, a file
        of the persistent tier's just opened; ``manifest``, ``marker``, before those are
        written; ``commit``, before the rename that commits the step. ``hit`` says the
        child stopped there (else, after AIM_LIMIT_S, it is killed wherever it is).
    {"cmd": "quit"}

The child reports to ``report`` (appending, no fsync needed: SIGKILL keeps the page
cache): ``restored <step|none>`` once, then ``committed <k>`` whenever the manager's
last committed step changes after a ``save`` returns. Where it was when it died is kept in
a shared memory page that the parent reads after the kill: ``main`` (restore / train /
save) and ``writer`` (idle / node-local / begin / data / manifest / marker / commit /
retention). An unaimed kill is a random instant, and the phase it names is wherever the
child happened to be, which depends on the machine's load; an aimed one lands at its stop
point by construction (the parent does not read the phase and then send SIGKILL, a race
with the child, which goes on meanwhile). Forking a warm parent makes a kill cost tens of
milliseconds instead of a fresh interpreter.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import signal
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import gcsfs  # noqa: F401 - warm import for the GCS children (no threads, no loop yet)
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import crash_model

from resilient_train.checkpoint.commit.manifest import MANIFEST, MARKER
from resilient_train.checkpoint.commit.retention import RetentionPolicy
from resilient_train.checkpoint.manager import CheckpointManager, CheckpointOptions
from resilient_train.checkpoint.storage.base import RetryOptions
from resilient_train.checkpoint.tiers.nodelocal import NodeLocal

MAIN_PHASES = ["start", "restore", "train", "save"]
WRITER_PHASES = ["idle", "begin", "data", "manifest", "marker", "commit", "retention",
                 "node-local"]
# Where an aimed kill stops the child (see the module's docstring), by writer phase.
STOP_POINTS = ("node-local", "data", "manifest", "marker", "commit")
# Shared page: main phase (byte 0), writer phase (byte 1), the armed stop point (byte 2,
# its WRITER_PHASES index; 0: none), whether the child stopped there (byte 3), the armed
# step condition (bytes 4, 5: mod and rem; mod 0: any step), step being written (8..16),
# saves started (16..24), last step reported committed (24..32, -1: none).
_LAYOUT = struct.Struct("<BBBBBB2xqqq")
READY_LIMIT_S = 120.0
AIM_LIMIT_S = 30.0   # an aimed kill whose stop point is not reached in this long kills anyway


class Shared:
    def __init__(self) -> None:
        self.page = mmap.mmap(-1, mmap.PAGESIZE)  # MAP_SHARED | MAP_ANONYMOUS: fork keeps it

    def reset(self) -> None:
        _LAYOUT.pack_into(self.page, 0, 0, 0, 0, 0, 0, 0, -1, 0, -1)

    def read(self) -> dict[str, Any]:
        main, writer, _, hit, _, _, step, saves, committed = _LAYOUT.unpack_from(self.page, 0)
        return {"main": MAIN_PHASES[main], "writer": WRITER_PHASES[writer],
                "hit": bool(hit), "writing_step": step, "saves_started": saves,
                "last_committed": committed}

    def arm(self, point: str, step: tuple[int, int] | None) -> None:
        """The parent's: stop the child at ``point`` (in a save of a step ``step % mod ==
        rem`` with ``step=(mod, rem)``); the condition is in place before the point."""
        assert point in STOP_POINTS, point
        mod, rem = step or (0, 0)
        self.page[4], self.page[5] = mod, rem
        self.page[2] = WRITER_PHASES.index(point)

    def reached(self, point: str) -> None:
        """The child's, at each stop point: stop here, all threads, if the parent armed it."""
        if self.page[2] != WRITER_PHASES.index(point):
            return
        mod, rem = self.page[4], self.page[5]
        if mod and self.get_int(8) % mod != rem:
            return
        self.page[2], self.page[3] = 0, 1   # disarmed: one stop; the parent reads the hit
        # To this thread: it stops before its next instruction, then the others. (Sent to
        # the process, the kernel woke another thread to act on it, and this one ran on
        # meanwhile: a rename stopped at "just before" went through, and retention after.)
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)

    def main(self, phase: str) -> None:
        self.page[0] = MAIN_PHASES.index(phase)

    def writer(self, phase: str) -> None:
        self.page[1] = WRITER_PHASES.index(phase)

    def set_int(self, offset: int, value: int) -> None:
        struct.pack_into("<q", self.page, offset, value)

    def get_int(self, offset: int) -> int:
        return int(struct.unpack_from("<q", self.page, offset)[0])


def _instrument(mgr: CheckpointManager, shared: Shared) -> None:
    """Record the phase each wrapped call is in; wrappers only, no behaviour change."""
    storage = mgr.storage

    def wrap(obj: Any, name: str, before: Any, after: Any = None) -> None:
        real = getattr(obj, name)   # renamed: this must fail, not stop instrumenting

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            before(*args)
            try:
                return real(*args, **kwargs)
            finally:
                if after is not None:
                    after()

        setattr(obj, name, wrapper)

    def stop_in_files(tier: Any, point: str, phase: str | None) -> None:
        """``tier``'s files being written: the phase (None: the caller's is kept), and the
        stop point ``point`` as each file has just been opened (there, not yet whole)."""
        real_open_write = tier.open_write

        @contextlib.contextmanager
        def open_write(rel: str, **kw: Any) -> Any:
            if phase is not None:
                shared.writer(phase)
            with real_open_write(rel, **kw) as f:
                shared.reached(point)
                yield f

        tier.open_write = open_write

    stop_in_files(storage, "data", "data")

    def write_bytes(rel: str, *a: Any) -> None:
        phase = "marker" if rel.endswith(MARKER) else "manifest" if rel.endswith(
            MANIFEST) else "data"
        shared.writer(phase)
        if phase != "data":
            shared.reached(phase)

    wrap(storage, "write_bytes", write_bytes)
    def fsync_dir(*a: Any) -> None:
        if shared.read()["writer"] != "retention":  # prune fsyncs too
            shared.writer("commit")

    wrap(storage, "fsync_dir", fsync_dir)

    def rename_dir(*a: Any) -> None:
        shared.writer("commit")
        shared.reached("commit")   # the rename is the commit: stopped just before it

    wrap(storage, "rename_dir", rename_dir)

    def begin_write(save: Any, *a: Any) -> None:
        shared.set_int(8, save.step)
        shared.writer("begin")

    persistent = mgr._persistent
    wrap(persistent, "write", begin_write, lambda: shared.writer("idle"))
    local = next((t for t in mgr._tiers.tiers if t.name == "node-local"), None)
    if local is not None:   # the node-local tier's write (and commit), before storage's
        wrap(local, "write_step", lambda step, *a: (shared.set_int(8, step),
                                                    shared.writer("node-local")),
             lambda: shared.writer("idle"))
        stop_in_files(local.storage, "node-local", None)
    wrap(persistent, "_apply_retention", lambda *a: shared.writer("retention"))

    def begin_save(*a: Any) -> None:
        shared.set_int(16, shared.get_int(16) + 1)
        shared.main("save")

    wrap(mgr, "save", begin_save, lambda: shared.main("train"))


def child(cmd: dict[str, Any], shared: Shared) -> None:
    shared.main("start")
    torch.set_num_threads(1)
    numel = int(cmd["numel"])
    report = os.open(cmd["report"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def say(line: str) -> None:
        os.write(report, (line + "\n").encode())

    model = crash_model.build(numel)
    options = CheckpointOptions(
        async_save=bool(cmd["async_save"]),
        retention=RetentionPolicy(keep_last=int(cmd["keep_last"])),
        retry=RetryOptions(deadline_s=30.0, initial_s=0.01, max_wait_s=0.1),
        storage_options=cmd.get("storage_options"),
        node_local=NodeLocal(directory=cmd["node_local"], keep_last=int(cmd["keep_last"]))
        if cmd.get("node_local") else None)
    mgr = CheckpointManager(cmd["url"], options=options)
    _instrument(mgr, shared)
    mgr.track(model=model)
    shared.main("restore")
    restored = mgr.restore_latest()
    step = restored or 0
    problem = crash_model.mismatch(model, numel, step)
    if problem is None and restored is not None and mgr.values != crash_model.values_of(step):
        problem = f"values {mgr.values} are not step {step}'s"
    if problem:
        raise AssertionError(f"the child restored step {restored}: {problem}")
    say(f"restored {'none' if restored is None else restored}")
    last = mgr.last_commit_step
    shared.main("train")
    while True:
        step += 1
        crash_model.advance(model)
        mgr.values.clear()
        mgr.values.update(crash_model.values_of(step))
        if cmd["train_s"]:
            time.sleep(float(cmd["train_s"]))  # the simulated compute of one step
        # With a node-local tier every save goes there, every third to storage too.
        mgr.save(step, persistent=not cmd.get("node_local") or step % 3 == 0)
        if mgr.last_commit_step != last:
            last = mgr.last_commit_step
            assert last is not None
            say(f"committed {last}")
            shared.set_int(24, last)


def _wait_alive(pid: int, until: Callable[[], bool], deadline: float) -> int | None:
    """Poll until ``until()`` holds or the deadline passes; the child's wait status if it
    exited first (it was meant to be killed), else None."""
    while not until() and time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.0005)
    return None


def _wait_stopped(pid: int, deadline: float) -> int | None:
    """Wait until the child stops itself at the armed stop point, or the deadline passes;
    the child's wait status if it exited instead, else None (stopped, or still running)."""
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG | os.WUNTRACED)
        if done:
            return None if os.WIFSTOPPED(status) else status
        time.sleep(0.0005)
    return None


def run(cmd: dict[str, Any], shared: Shared) -> dict[str, Any]:
    shared.reset()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 0
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)  # stdout is the parent's answer channel
            child(cmd, shared)
        except BaseException:  # noqa: BLE001 - any failure of the child is reported
            with open(cmd["error_file"], "a", encoding="utf-8") as f:
                f.write(traceback.format_exc())
            code = 3
        os._exit(code)
    deadline = time.monotonic() + READY_LIMIT_S
    early = _wait_alive(pid, lambda: shared.read()["main"] in ("train", "save"), deadline)
    if early is None and cmd.get("from_first_commit"):
        early = _wait_alive(pid, lambda: shared.read()["last_committed"] >= 0, deadline)
    if early is None:
        time.sleep(float(cmd["kill_after_s"]))  # the randomised kill instant
        if cmd.get("kill_in"):   # then the child's own stop at the point aimed at
            step = cmd.get("kill_in_step")
            shared.arm(cmd["kill_in"], None if step is None else (step[0], step[1]))
            early = _wait_stopped(pid, time.monotonic() + AIM_LIMIT_S)
    if early is None:
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    else:
        status = early
    state = shared.read()
    return {"event": "killed",
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "died_early": early is not None, "aim": cmd.get("kill_in"), **state}


def main() -> None:
    shared = Shared()
    print(json.dumps({"event": "ready", "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        answer = run(cmd, shared)
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
