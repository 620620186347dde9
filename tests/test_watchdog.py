"""The watchdog's process-tree killing (resilient_train/launcher/watchdog.py), with real
processes: what it kills, and that a recorded pid now owned by another process is spared."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from resilient_train.launcher import watchdog

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

WAIT_S = 10.0
# A parent that starts a child in its own session with no environment, prints the
# child's pid, then sleeps: the child is not recorded anywhere, only found below it.
PARENT = """
import shutil, subprocess, sys, time
# Popen returns once the exec is done: the child's environment is empty by then.
child = subprocess.Popen([shutil.which("sleep"), "60"], env={}, start_new_session=True)
print(child.pid, flush=True)
time.sleep(60)
"""


def gone(proc: psutil.Process) -> bool:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        p.kill()
        p.wait()


def _sleeper(procs: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    p = subprocess.Popen(["sleep", "60"])
    procs.append(p)
    return p


def test_start_ticks_name_one_process(procs: list[subprocess.Popen[bytes]]) -> None:
    p = _sleeper(procs)
    ticks = watchdog.start_ticks(p.pid)
    assert ticks is not None and ticks >= (watchdog.start_ticks(os.getpid()) or 0)
    p.kill()
    p.wait()
    assert watchdog.start_ticks(p.pid) is None


def test_a_recorded_pid_with_another_start_time_is_not_killed(
        procs: list[subprocess.Popen[bytes]]) -> None:
    """A reused pid: same number, later start. It is someone else's process now."""
    p = _sleeper(procs)
    ticks = watchdog.start_ticks(p.pid)
    assert ticks is not None
    assert watchdog.kill_trees([(p.pid, ticks - 1)]) == 0
    assert p.poll() is None and psutil.Process(p.pid).status() != psutil.STATUS_STOPPED
    assert watchdog.kill_trees([(p.pid, ticks)]) == 1
    assert p.wait(timeout=WAIT_S) == -9


def test_what_was_born_below_a_recorded_process_dies_with_it(
        procs: list[subprocess.Popen[bytes]]) -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE)
    procs.append(parent)
    assert parent.stdout is not None
    child = psutil.Process(int(parent.stdout.readline()))
    assert child.environ() == {} and os.getsid(child.pid) != os.getsid(parent.pid)
    assert watchdog.descendants([parent.pid]) == [child.pid]
    ticks = watchdog.start_ticks(parent.pid)
    assert ticks is not None
    assert watchdog.kill_trees([(parent.pid, ticks)]) == 2
    assert parent.wait(timeout=WAIT_S) == -9
    assert gone(child)


def test_the_record_is_read_as_it_grows(tmp_path: Path) -> None:
    log = tmp_path / "processes.log"
    log.write_bytes(b"workerpool0-0 1 0 100 7\nworkerpool0-0 1 0 10")   # a line half written
    trees, reader = watchdog.Trees(), watchdog._Log(str(log))
    reader.load(trees)
    assert trees.lives == {(b"workerpool0-0", b"1", b"0"): {100: 7}}
    with open(log, "ab") as f:
        f.write(b"1 8\nworkerpool1-0 1 2 102 9\n")
    reader.load(trees)
    assert trees.lives == {(b"workerpool0-0", b"1", b"0"): {100: 7, 101: 8},
                           (b"workerpool1-0", b"1", b"2"): {102: 9}}
    assert trees.pop((b"workerpool0-0", b"1", b"0")) == {100: 7, 101: 8}
    assert trees.pop_all() == {102: 9}
