"""Warm fork servers for the suite: one process per start-up environment, per test process,
that imported torch once (``launcher/forkserver.py --listen``), and from which the suite's
training processes are forked instead of each importing torch again (4-5 CPU-seconds with
the ``torch._dynamo`` that an optimizer's first step imports: most of a short run's cost).

Launches reach one through ``RESILIENT_TRAIN_PRELOAD_SERVER`` (jobs.py), the lives of
tests/lives.py through the launcher's own client (``launcher/preload.py``). A process is
forked from a server only where it fits: the start-up environment each server is keyed by
is the one its lives have (``read_at_start``), so a forked process starts as a new one
would, and any other starts as before.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping

from resilient_train.launcher import forkserver
from resilient_train.launcher.preload import read_at_start
from resilient_train.launcher.workerenv import started_as_worker

MODULES = ("torch", "torch._dynamo")
# The suite's environment as this module is imported: a server's, whichever test starts
# it (not a test's own variables, such as the marker its orphan check looks for).
_SUITE_ENV = dict(os.environ)
_servers: dict[frozenset[tuple[str, str]], tuple[subprocess.Popen[bytes], str]] = {}


def server_for(env: Mapping[str, str]) -> str:
    """The socket of this test process's server whose lives start as ``env``'s would
    (started at the first call for that start-up environment)."""
    at_start = read_at_start(env)
    key = frozenset(at_start.items())
    if key not in _servers:
        if not _servers:
            atexit.register(_stop)
        folder = tempfile.mkdtemp(prefix="rt-preload-")   # short: a socket path has a limit
        server_env = {k: v for k, v in _SUITE_ENV.items() if k not in read_at_start(_SUITE_ENV)}
        server = subprocess.Popen(
            [sys.executable, forkserver.__file__, "--listen",
             os.path.join(folder, "server.sock"), *MODULES],
            env={**server_env, **at_start}, stdin=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        _servers[key] = (server, folder)
    return os.path.join(_servers[key][1], "server.sock")


def for_launched_workers() -> str:
    """The server for the workers of a 2- or 3-replica launch here (most of the suite's):
    the suite's environment with what the launcher adds at start-up."""
    return server_for(started_as_worker(_SUITE_ENV, 2))


def _stop() -> None:
    for server, folder in _servers.values():
        server.kill()
        server.wait()
        shutil.rmtree(folder, ignore_errors=True)
