"""The job directory: ``job.json`` (rewritten atomically) and per-attempt log paths."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

JOB_FILE = "job.json"


def write_json_atomic(path: Path, data: Any) -> None:
    """Write-to-temp, fsync, rename: a reader sees the old record or the new one, never half."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def read_job(job_dir: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(job_dir)
    if path.is_dir():
        path = path / JOB_FILE
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)  # type: ignore[no-any-return]
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no job record at {path}; pass the job directory that 'resilient-train launch' "
            "printed (it holds job.json)") from None


def log_path(job_dir: Path, attempt: int, replica: str) -> Path:
    return job_dir / "logs" / f"attempt-{attempt}" / f"{replica}.log"


def report_path(job_dir: Path, attempt: int, replica: str, restart: int) -> Path:
    return job_dir / "reports" / f"attempt-{attempt}" / f"{replica}.restart-{restart}.json"


def telemetry_prefix(job_dir: Path, attempt: int, replica: str, restart: int) -> Path:
    """Where one worker life reports its training progress (telemetry.py)."""
    return job_dir / "telemetry" / f"attempt-{attempt}" / f"{replica}.restart-{restart}"


def failures_path(job_dir: Path) -> Path:
    """The job's failure log, for the auto checkpoint interval (telemetry.ObservedMtbf)."""
    return job_dir / "telemetry" / "failures.json"


def telemetry_prefixes(job_dir: Path, replica: str) -> list[Path]:
    """Every life of ``replica`` that reported, in no particular order."""
    found = {p.with_suffix("") for p in (job_dir / "telemetry").glob(f"attempt-*/{replica}.restart-*.*")
             if p.suffix in (".progress", ".jsonl")}
    return sorted(found)
