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


def test_tests_sharing_a_module_fixture_run_in_one_process_and_it_runs_once(
        tmp_path: Path) -> None:
    (tmp_path / "test_probe.py").write_text(PROBE)
    log = tmp_path / "probe.log"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "xdist.plugin",
         "-p", "suite_layout", "-n", "2", "--dist", "loadgroup", "test_probe.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
        # Without the other installed plugins (hypothesis, anyio...): 2 s instead of 10.
        env=dict(os.environ, PROBE_LOG=str(log), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
                 PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line.split() for line in log.read_text().splitlines()]
    setups = [pid for what, pid in lines if what == "setup"]
    assert len(setups) == 1, lines          # two processes would each have run the job
    assert [pid for what, pid in lines if what == "test"] == setups * 6, lines
