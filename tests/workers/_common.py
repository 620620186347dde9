"""Shared helpers for the end-to-end worker scripts (tests/workers/*.py).

Every script calls ``start()`` first. It writes a marker file into ``$E2E_READY_DIR``
named ``<replica>.a<attempt>.r<restart>.ready`` holding the pid and the time the user code
started, so a test (or the benchmark) can wait on a file instead of sleeping.

When ``$E2E_PRIMARY_WAIT`` is set (``;``-separated globs relative to the ready dir), the
primary replica waits until every glob matches a file, then exits 0: "the primary
finishes while the others are still busy".
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time

REPLICA = os.environ.get("RESILIENT_TRAIN_REPLICA", "unknown-0")
ATTEMPT = int(os.environ.get("RESILIENT_TRAIN_ATTEMPT", "1"))
RESTART = int(os.environ.get("RESILIENT_TRAIN_RESTART_COUNT", "0"))
PRIMARY = REPLICA == "workerpool0-0"
READY_DIR = os.environ.get("E2E_READY_DIR", ".")
WAIT_LIMIT_S = 60.0


def stem() -> str:
    return f"{REPLICA}.a{ATTEMPT}.r{RESTART}"


def write_atomic(path: str, data: object) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def mark(kind: str = "ready", **extra: object) -> None:
    record = {"pid": os.getpid(), "time": time.time(), "replica": REPLICA,
              "attempt": ATTEMPT, "restart": RESTART, **extra}
    write_atomic(os.path.join(READY_DIR, f"{stem()}.{kind}"), record)


def wait_for(patterns: list[str], limit: float = WAIT_LIMIT_S) -> None:
    deadline = time.monotonic() + limit
    while not all(glob.glob(os.path.join(READY_DIR, p)) for p in patterns):
        if time.monotonic() > deadline:
            print(f"{REPLICA}: gave up waiting for {patterns}", flush=True)
            sys.exit(99)
        time.sleep(0.01)


def hang() -> None:
    while True:
        time.sleep(3600)


def start() -> None:
    mark()
    wait = os.environ.get("E2E_PRIMARY_WAIT")
    if PRIMARY and wait:
        wait_for([p for p in wait.split(";") if p])
        print(f"{REPLICA}: done", flush=True)
        sys.exit(0)


def targeted(argv_index: int) -> bool:
    """True when sys.argv[argv_index] is absent, or names this replica."""
    return len(sys.argv) <= argv_index or sys.argv[argv_index] in (REPLICA, "all")
