"""Crash-test worker: a warm parent that forks a child per request to run retention
(``directory.prune``) and SIGKILLs that child just before its k-th change to the storage.

The parent imports the package once, then serves requests, one JSON object per line on
stdin, answering one JSON line on stdout:

    {"url": ..., "storage_options": {...} | null, "object_store_mounts": [...] | null,
     "keep_last": int, "kill_at": int}
        fork a child that runs ``prune(storage, RetentionPolicy(keep_last))``, counting
        each change it makes: each call of the backend's primitives that change the
        namespace (``_write``, ``_delete``, ``_rename_dir``) and, on a local path, each
        ``os.unlink / remove / rmdir / rename / replace`` (the single files a recursive
        delete removes). Just before the change numbered ``kill_at`` the child SIGKILLs
        itself: no ``finally`` runs, the kernel drops its locks, as for a real kill.
        Answer {"killed": bool, "changes": n (a child that finished: how many it made),
        "error": traceback | null}.
    {"cmd": "quit"}

No torch: the delete does not need it, and a fork of a process that never started
fsspec's event loop is safe for the gs:// children.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import gcsfs  # noqa: F401 - warm import for the gs:// children (no loop yet)

from resilient_train.checkpoint.commit.directory import prune
from resilient_train.checkpoint.commit.retention import RetentionPolicy
from resilient_train.checkpoint.storage.base import RetryOptions, Storage

FAST = RetryOptions(deadline_s=20.0, initial_s=0.01, max_wait_s=0.1)
OS_CHANGES = ("unlink", "remove", "rmdir", "rename", "replace")
PRIMITIVES = ("_write", "_delete", "_rename_dir")


def _child(request: dict[str, Any], report: int) -> None:
    changes = 0

    def counted(fn: Callable[..., Any]) -> Callable[..., Any]:
        def change(*args: Any, **kwargs: Any) -> Any:
            nonlocal changes
            changes += 1
            if changes == request["kill_at"]:
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*args, **kwargs)
        return change

    kwargs: dict[str, Any] = {"retry": FAST,
                              "storage_options": request.get("storage_options")}
    if request.get("object_store_mounts"):
        kwargs["object_store_mounts"] = tuple(request["object_store_mounts"])
    backend = type(Storage(request["url"], **kwargs))
    counting = type("Counting", (backend,), {
        name: counted(getattr(backend, name)) for name in PRIMITIVES})
    storage = counting(request["url"], **kwargs)
    if storage.is_local:
        for name in OS_CHANGES:
            setattr(os, name, counted(getattr(os, name)))
    prune(storage, RetentionPolicy(keep_last=request["keep_last"]))
    os.write(report, json.dumps({"changes": changes}).encode())


def serve(request: dict[str, Any]) -> dict[str, Any]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            _child(request, write)
            code = 0
        except BaseException:  # noqa: BLE001 - whatever it is, the test reads it
            os.write(write, json.dumps({"error": traceback.format_exc()}).encode())
            code = 1
        os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        said = f.read()
    _, status = os.waitpid(pid, 0)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    answer = json.loads(said) if said else {}
    return {"killed": killed, "changes": answer.get("changes"), "error": answer.get("error")}


def main() -> None:
    print(json.dumps({"event": "ready"}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("cmd") == "quit":
            return
        print(json.dumps(serve(request)), flush=True)


if __name__ == "__main__":
    main()
