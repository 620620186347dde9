"""The command line's output, read by a pipe whose reader goes away.

``resilient-train launch ... | head`` (or a ``tee`` that was killed) closes the launcher's
stdout while the job runs. The job must go on: before, the next line raised
BrokenPipeError, the launcher stopped the workers, and the record stayed QUEUED.
``resilient-train status ... | head`` must not print a traceback either. Real processes,
real pipes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
