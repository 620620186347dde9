"""The job directory: ``job.json`` (rewritten atomically) and per-attempt log paths."""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

JOB_FILE = "job.json"
SECRET_MASK = "***"


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


def processes_path(job_dir: Path) -> Path:
    """The worker processes the launcher has seen, one line each (watchdog.py reads it)."""
    return job_dir / "processes.log"


# --- secrets in what is recorded ---------------------------------------------------------
#
# A name is secret when one of its words is, or ends in, token, key, secret, password or
# passwd. Words: split at every non-alphanumeric and at camelCase, so API_KEY, api-key,
# apiKey, HFToken and AWS_SECRET_ACCESS_KEY are secret; keep_last, tokenizer, max_tokens,
# keyword are not. A compound ending in a secret word is secret too (apikey, authtoken),
# and so monkey is: masking too much costs only a less readable record.
_SECRET_WORDS = ("token", "key", "secret", "password", "passwd")
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
_OPTION = re.compile(r"(-{1,2})([A-Za-z0-9][\w.-]*)(=.*)?", re.DOTALL)    # --name[=value]
_ASSIGNMENT = re.compile(r"([+~]*[A-Za-z_][\w.-]*)=.*", re.DOTALL)        # NAME=value


def is_secret_name(name: str) -> bool:
    """Whether a variable or option called ``name`` holds a secret (see the rule above)."""
    return any(word.lower().endswith(_SECRET_WORDS) for word in _WORD.findall(name))


def mask_command(argv: Iterable[str]) -> list[str]:
    """``argv`` with the values of secret options and assignments replaced by ``***``:
    ``--token=V``, ``--api-key V``, ``-password V``, ``API_KEY=V`` (``env API_KEY=V cmd``,
    Hydra's ``db.password=V``). After a secret option without ``=``, the next argument
    is its value unless it is another long option (``--...``).

    The one function for every place that records or shows a job's command (job.json,
    the report); applying it twice changes nothing."""
    out: list[str] = []
    value_next = False
    for arg in map(str, argv):
        if value_next:
            value_next = False
            if not arg.startswith("--"):
                out.append(SECRET_MASK)
                continue
        option = _OPTION.fullmatch(arg)
        if option is not None and is_secret_name(option.group(2)):
            if option.group(3) is None:
                value_next = True
                out.append(arg)
            else:
                out.append(f"{option.group(1)}{option.group(2)}={SECRET_MASK}")
            continue
        assignment = _ASSIGNMENT.fullmatch(arg) if option is None else None
        if assignment is not None and is_secret_name(assignment.group(1)):
            out.append(f"{assignment.group(1)}={SECRET_MASK}")
            continue
        out.append(arg)
    return out

