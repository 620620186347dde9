"""Two jobs that commit into one checkpoint directory are named; a job resumed from
another's checkpoint is not. Real managers, real files."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch

import resilient_train as rt
from resilient_train.checkpoint.commit.lastwriter import RECORD, WriterWatch
from resilient_train.cluster import JOB_ID_ENV

LOGGER = "resilient_train.checkpoint.commit.lastwriter"


def manager(directory: Path, monkeypatch: pytest.MonkeyPatch,
            job: str | None) -> rt.CheckpointManager:
    if job is None:
        monkeypatch.delenv(JOB_ID_ENV, raising=False)
    else:
        monkeypatch.setenv(JOB_ID_ENV, job)
    mgr = rt.CheckpointManager(directory, options=rt.CheckpointOptions(async_save=False))
    mgr.track(model=torch.nn.Linear(2, 2))
    return mgr


def saved(mgr: rt.CheckpointManager, step: int) -> None:
    """A blocking save, and its writer record, which the writer thread writes after it."""
    mgr.save(step)
    mgr.wait()


def test_two_jobs_committing_into_one_directory_are_named_each_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    a = manager(tmp_path, monkeypatch, "job-a")
    saved(a, 1)
    b = manager(tmp_path, monkeypatch, "job-b")
    assert b.restore_latest() == 1        # job b resumes job a's step: a resubmitted job
    saved(b, 2)
    assert caplog.text == ""              # ... which is not said
    saved(a, 3)                           # job a is still running: both now commit here
    saved(b, 4)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert said[0].startswith(f"checkpoint directory {tmp_path}: job job-b committed step 2 "
                              "there since this job (job-a) last looked")
    assert "give each job its own" in said[0]
    assert "job job-a committed step 3 there since this job (job-b) last looked" in said[1]
    saved(a, 5)
    saved(b, 6)
    assert len(caplog.records) == 2       # once per job

    # A retry of job a (the same job id) resumes from b's last step: not said.
    caplog.clear()
    for mgr in (a, b):
        mgr.close()
    retry = manager(tmp_path, monkeypatch, "job-a")
    assert retry.restore_latest() == 6
    saved(retry, 7)
    retry.close()
    assert caplog.text == ""


def test_without_a_job_id_nothing_is_recorded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = manager(tmp_path, monkeypatch, None)
    mgr.save(1)
    mgr.close()
    assert not (tmp_path / RECORD).exists()
    assert (tmp_path / "step-000000000001").is_dir()


def test_a_blocking_save_does_not_wait_for_the_writer_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two requests to a bucket after each commit: advice, never the loop's to wait for.
    release, recorded = threading.Event(), []
    real = WriterWatch.committed

    def held(self: WriterWatch, step: int) -> None:
        release.wait(60)
        real(self, step)
        recorded.append(step)

    monkeypatch.setattr(WriterWatch, "committed", held)
    mgr = manager(tmp_path, monkeypatch, "job-a")
    saving = threading.Thread(target=mgr.save, args=(1,))
    saving.start()
    saving.join(30)
    assert not saving.is_alive() and recorded == []   # returned, the record still held
    assert (tmp_path / "step-000000000001" / "COMMITTED").exists()
    release.set()
    mgr.close()
    assert recorded == [1] and (tmp_path / RECORD).exists()
