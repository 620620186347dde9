"""Shared fixtures: a fake-gcs-server for the session, fresh buckets, a fault proxy. How
the suite is spread over processes is suite_layout.py's (pytest-xdist, in pyproject.toml)."""

from __future__ import annotations

import compileall
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from gcs import FaultProxy, GcsEmulator, emulator_binary, start_emulator
from suite_layout import (  # noqa: F401  (hooks: pytest finds them here)
    pytest_collection_modifyitems,
    pytest_configure_node,
    pytest_unconfigure,
    pytest_xdist_auto_num_workers,
    pytest_xdist_make_scheduler,
)
from suite_layout import pytest_configure as configure_layout


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcsEmulator]:
    """fake-gcs-server on 127.0.0.1 (skips where the bundled binary cannot run)."""
    binary, why_not = emulator_binary()
    if binary is None:
        pytest.skip(f"no GCS emulator: {why_not}")
    log = tmp_path_factory.mktemp("fake-gcs-server") / "server.log"
    try:
        server = start_emulator(binary, log)
    except OSError as exc:  # e.g. ENOEXEC: a binary for another platform
        pytest.skip(f"no GCS emulator: cannot run {binary}: {exc}")
    try:
        yield server
    finally:
        server.stop()


@dataclass(frozen=True)
class GcsBucket:
    name: str
    url: str  # gs://name
    storage_options: dict[str, Any]
    server: GcsEmulator


@pytest.fixture
def gcs_bucket(gcs_server: GcsEmulator) -> GcsBucket:
    """A fresh, empty bucket on the session's emulator and the options to reach it."""
    name = gcs_server.create_bucket()
    return GcsBucket(name, f"gs://{name}",
                     {"endpoint_url": gcs_server.endpoint, "token": "anon"}, gcs_server)


@pytest.fixture
def gcs_proxy(gcs_server: GcsEmulator) -> Iterator[FaultProxy]:
    """A fault-injecting proxy in front of the session's emulator (fresh rules per test)."""
    proxy = FaultProxy(gcs_server.endpoint).start()
    try:
        yield proxy
    finally:
        proxy.stop()


# --- the cost of starting a process --------------------------------------------------------

# The suite runs more processes than the machine has cores, and a torch process waiting for
# work in its intra-op threads (OpenMP) spins on its core by default: a single-process
# example that needs 4 CPU-seconds took 25 beside two busy processes on 2 cores, 4 with
# waiting threads that sleep. Only how idle threads wait changes, never the thread count or
# what is computed, and a user's own setting is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    """Compile the repository's Python files once, before any test starts a process.

    The suite starts about 470 Python processes (launchers, workers, helpers). Where
    PYTHONDONTWRITEBYTECODE is set (as on this project's machines), none of them writes
    the bytecode it compiles, so each worker compiled the package again: about 0.18 s of
    CPU each. Existing bytecode is still read, and a stale file is recompiled by its
    timestamp, so this changes nothing but the time. (Once, in pytest-xdist's controller.)
    """
    configure_layout(config)
    if hasattr(config, "workerinput"):
        return
    for folder in ("resilient_train", "tests", "examples", "benchmarks"):
        compileall.compile_dir(ROOT / folder, quiet=1)
