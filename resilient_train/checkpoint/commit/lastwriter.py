"""Two jobs writing one checkpoint directory, named.

A checkpoint directory is one job's: a job restores the newest step it finds there. A
``checkpoint_dir`` written into a script that is then run twice at once, or two
experiments given one ``baseOutputDirectory``, make two jobs commit into one directory,
and each restart of either then resumes from whichever job saved last, silently.

So the primary keeps a small record at the directory's root: the job that committed last,
its step, when. It reads the record when it restores from storage and, after each commit
to the directory, reads it again, writes its own, and keeps what it wrote. A record of
another job that changed since it last looked is another job committing here now: said
once per job. Another job's record found unchanged is a job that resumed from another
job's checkpoint (a job resubmitted): not said.

Jobs are told apart by the platform's ``CLOUD_ML_JOB_ID`` (the launcher sets it too),
which a job's restarts and retries share. Without it (a plain local run, torchrun)
nothing tells two runs apart, and nothing is checked. The record is advice: a failure to
read or write it never fails a save.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ...cluster import JOB_ID_ENV
from ...lifecycle import current, say_once
from ..storage.base import RetryOptions, Storage
from ..storage.errors import StorageNotFoundError

log = logging.getLogger(__name__)

RECORD = ".rt-last-writer.json"
_RETRY = RetryOptions(deadline_s=5.0, max_wait_s=1.0)



@dataclass(frozen=True)
class Writer:
    job: str
    step: int
    time: float


class WriterWatch:
    """The primary's view of who commits into the checkpoint directory ``url``."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None,
                 job: str | None = None) -> None:
        self._url = url
        self._options = dict(storage_options or {})
        self._job = job if job is not None else os.environ.get(JOB_ID_ENV) or None
        self._opened: Storage | None = None

    @property
    def _storage(self) -> Storage:
        # Its own, with a short deadline: advice must not hold the writer thread for the
        # saves' two minutes of retries when the storage fails right after a commit.
        if self._opened is None:
            self._opened = Storage(self._url, retry=_RETRY, storage_options=self._options)
        return self._opened

    @staticmethod
    def _seen() -> dict[tuple[str, str], Writer | None]:
        """What each job's process saw last, per directory: a life's manager is new, the
        process is not (a life restored from peers reads no storage, and its first commit
        must still compare). Kept by the lives' owner (lifecycle.py)."""
        return current().kept("last writers seen", dict)

    def looked(self) -> None:
        """A restore from storage: note who committed here last."""
        if self._job is not None:
            self._seen()[self._url, self._job] = self._read()

    def committed(self, step: int) -> None:
        """After a commit of ``step``: name another job that committed here since this
        process last looked, then record this one."""
        if self._job is None:
            return
        url, key = self._url, (self._url, self._job)
        now = self._read()
        seen = self._seen()
        if key in seen and now is not None and now.job != self._job and now != seen[key]:
            say_once(log, f"another writer {url} {now.job}", logging.WARNING,
                     "checkpoint directory %s: job %s committed step %d there since this job "
                     "(%s) last looked. Two jobs that save into one directory restore each "
                     "other's steps: give each job its own (the platform's "
                     "AIP_CHECKPOINT_DIR follows baseOutputDirectory, or pass "
                     "checkpoint_dir per run)", url, now.job, now.step, self._job)
        mine = Writer(self._job, step, time.time())
        try:
            self._storage.write_bytes(RECORD, json.dumps(asdict(mine)).encode())
        except Exception as exc:   # advice only: the step is committed
            log.debug("could not write %s: %s", RECORD, exc)
            return
        seen[key] = mine

    def _read(self) -> Writer | None:
        try:   # one request: a missing record is the read's not-found
            raw = json.loads(self._storage.read_bytes(RECORD))
            return Writer(str(raw["job"]), int(raw["step"]), float(raw["time"]))
        except StorageNotFoundError:
            return None
        except Exception as exc:   # unreadable, torn or foreign: as if none
            log.debug("could not read %s: %s", RECORD, exc)
            return None
