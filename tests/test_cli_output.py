"""The command line's output, read by a pipe whose reader goes away.

``resilient-train launch ... | head`` (or a ``tee`` that was killed) closes the launcher's
stdout while the job runs. The job must go on: before, the next line raised
BrokenPipeError, the launcher stopped the workers, and the record stayed QUEUED.
``resilient-train status ... | head`` must not print a traceback either. Real processes,
real pipes.

A ``job.json`` that is no job record (nested 100,000 deep, 400 MB, not JSON) is one clear
error for every command that reads it, not a RecursionError's traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "resilient_train.cli.main"]
LINES = 150
WORKER = ("import time\n"
          f"for i in range({LINES}):\n"
          "    print('line', i, flush=True)\n"
          "    time.sleep(0.01)\n")


def test_a_reader_that_goes_away_stops_neither_the_job_nor_its_record(tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    proc = subprocess.Popen(
        [*CLI, "launch", "--job-dir", str(job_dir), "--", sys.executable, "-c", WORKER],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()   # as `| head -1` does once it has its line
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, err
    assert first.startswith("job ") and "directory" in first
    assert "stdout cannot be written (Broken pipe); the job goes on" in err, err
    assert "Traceback" not in err, err
    record = json.loads((job_dir / "job.json").read_text())
    assert record["state"] == "JOB_STATE_SUCCEEDED" and record["exit_status"] == 0
    log = next((job_dir / "logs").glob("attempt-1/workerpool0-0.log")).read_text()
    assert f"line {LINES - 1}" in log   # the worker ran to its end

    # `status | head` on a reader that is already gone: no traceback.
    read, write = os.pipe()
    os.close(read)
    done = subprocess.run([*CLI, "status", str(job_dir)], stdout=write,
                          stderr=subprocess.PIPE, text=True, timeout=60)
    os.close(write)
    assert done.returncode == 1 and done.stderr == "", done.stderr


# --- a malformed job record: one reader, one clear error for every command -----------------

READERS = {
    "status": ["status"],
    "report": ["report"],
    "export": ["export", "--from-job"],
    "checkpoints": ["checkpoints", "list"],
}


def _deep(job_dir: Path) -> str:
    """Nested 100,000 deep: Python's json parser ends in a RecursionError."""
    (job_dir / "job.json").write_text('{"name": "x", "job_spec": ' + "[" * 100_000
                                      + "]" * 100_000 + "}", encoding="utf-8")
    return "nested deeper than"


def _huge(job_dir: Path) -> str:
    """Larger than any record: sparse, so that the test writes nothing (a 317 MB record
    took `report` 61 s and 5.8 GB)."""
    with open(job_dir / "job.json", "wb") as f:
        f.truncate(400 * 1024 * 1024)
    return "larger than any job record"


def _not_json(job_dir: Path) -> str:
    (job_dir / "job.json").write_text("{not json", encoding="utf-8")
    return "not valid JSON"


def _a_list(job_dir: Path) -> str:
    (job_dir / "job.json").write_text("[1, 2]", encoding="utf-8")
    return "not a JSON object"


@pytest.mark.parametrize("command", sorted(READERS))
@pytest.mark.parametrize("make", [_deep, _huge, _not_json, _a_list],
                         ids=["deep", "huge", "not-json", "a-list"])
def test_a_malformed_record_is_one_clear_error_for_every_reader(
        tmp_path: Path, command: str, make: Callable[[Path], str]) -> None:
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    problem = make(job_dir)
    done = subprocess.run([*CLI, *READERS[command], str(job_dir)], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    err = done.stderr
    assert "Traceback" not in err, err
    assert err.startswith(f"resilient-train {command}: error: "), err
    assert f"{job_dir / 'job.json'} is not a job record" in err, err   # the file
    assert problem in err, err                                          # the problem
    assert "written by 'resilient-train launch'" in err, err            # the fix
    assert len(err) < 2000, err   # no 100,000 brackets quoted back

