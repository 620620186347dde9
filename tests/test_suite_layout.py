"""The suite's layout over processes (suite_layout.py), on a probe run by pytest-xdist: the
tests that share a module-scoped fixture run in one process, so its job runs once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

PROBE = '''
import os
import pytest

LOG = os.environ["PROBE_LOG"]


def note(what):
    with open(LOG, "a") as f:
        f.write(f"{what} {os.getpid()}\\n")


@pytest.fixture(scope="module")
def job():
    note("setup")


@pytest.mark.parametrize("i", range(6))
def test_shares_the_job(job, i):
    note("test")


@pytest.mark.parametrize("i", range(6))
def test_alone(i):
    pass
'''


def probe(tmp: Path, *args: str) -> tuple[str, list[list[str]]]:
    """Run the probe module under pytest-xdist with this layout: its output, and the log
    of what ran in which process."""
    (tmp / "test_probe.py").write_text(PROBE)
    log = tmp / "probe.log"
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_AUTO_NUM_WORKERS"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "xdist.plugin",
         "-p", "suite_layout", "--dist", "loadgroup", *args, "test_probe.py"],
        cwd=tmp, capture_output=True, text=True, timeout=120, check=False,
        # Without the other installed plugins (hypothesis, anyio...): 2 s instead of 10.
        env=env | {"PROBE_LOG": str(log), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
                   "PYTHONPATH": os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])})
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, [line.split() for line in log.read_text().splitlines()]


def test_tests_sharing_a_module_fixture_run_in_one_process_and_it_runs_once(
        tmp_path: Path) -> None:
    _, lines = probe(tmp_path, "-q", "-n", "2")
    setups = [pid for what, pid in lines if what == "setup"]
    assert len(setups) == 1, lines          # two processes would each have run the job
    assert [pid for what, pid in lines if what == "test"] == setups * 6, lines


def test_auto_starts_twice_as_many_processes_as_the_cores(tmp_path: Path) -> None:
    out, _ = probe(tmp_path, "-n", "auto", "--maxprocesses", "64")
    want = 2 * len(os.sched_getaffinity(0))
    assert f"created: {want}/{want} workers" in out, out
