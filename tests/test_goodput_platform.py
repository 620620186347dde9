"""Goodput in the platform's words: job.json's badput by ml-goodput-measurement's names, and
step time, goodput and recoveries as TensorBoard scalars (issue 18, part 5).

The accounting and the writer's decisions are checked on known numbers; the event files
are read back with TensorBoard's own EventAccumulator, and one job under the launcher (a
kill at step 15) is read back against its job.json. Tests that read event files skip where
the ``tensorboard`` package is missing; those of a missing package simulate it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from resilient_train.cli import main as cli
from resilient_train.observe import scalars as scalars_mod
from resilient_train.observe.goodput import BADPUT_TYPES, Goodput, account
from resilient_train.observe.scalars import (
    JobScalars,
    TensorBoardMode,
    TensorBoardUnavailable,
    open_scalars,
)
from resilient_train.observe.tbevents import INSTALL_HINT, ScalarWriter, tensorboard_installed
from resilient_train.observe.telemetry import LifeTelemetry, Restore, Segment

ROOT = Path(__file__).resolve().parents[1]

# ml-goodput-measurement's BadputType members (its goodput_utils.py, release 0.2.3).
ML_GOODPUT_BADPUT_TYPES = {
    "TPU_INITIALIZATION", "TRAINING_PREP", "PROGRAM_STARTUP", "DATA_LOADING_SYNC",
    "DATA_LOADING_ASYNC", "UNPRODUCTIVE_CHECKPOINT_SAVE_TIME",
    "UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME", "WASTED_PROGRESS_FROM_DISRUPTION",
    "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION", "CUSTOM_BADPUT_EVENTS", "OTHER",
    "ELASTIC_SLICE_DOWN", "ELASTIC_SCALE_UP", "ELASTIC_REINITIALIZATION"}


def _restore(t: float, seconds: float | None) -> Restore:
    return Restore(t=t, step=0, source="persistent", from_rank=None, generation=0,
                   seconds=seconds, bytes_read=(), reason="")


def _sums_to_wall(g: Goodput) -> None:
    assert g.productive_s + sum(g.badput_s().values()) == pytest.approx(g.wall_s)


# --- the names --------------------------------------------------------------------------------

def test_the_badput_names_are_ml_goodput_measurements() -> None:
    # The list of the issue: program startup, training preparation, data loading, checkpoint
    # save and restore, wasted progress and infrastructure recovery from disruption, other.
    assert BADPUT_TYPES == (
        "PROGRAM_STARTUP", "TRAINING_PREP", "DATA_LOADING_SYNC",
        "UNPRODUCTIVE_CHECKPOINT_SAVE_TIME", "UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME",
        "WASTED_PROGRESS_FROM_DISRUPTION", "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION", "OTHER")
    assert set(BADPUT_TYPES) <= ML_GOODPUT_BADPUT_TYPES


def test_each_of_our_buckets_maps_onto_the_platform_names() -> None:
    # Segment 1 (restored in 2 s) trains steps 1..30 in [10, 40] with 1 s of saves; the
    # primary dies at 40 and the launcher starts it again at 43; segment 2 restores step
    # 20 in 3 s and trains 21..60 in [50, 90] with 2 s of saves; the job ends at 95.
    segs = [Segment(0, 30, 10.0, 11.0, 40.0, 1.0), Segment(20, 60, 50.0, 51.0, 90.0, 2.0)]
    g = account(segs, 0.0, 95.0, restores=[_restore(10.0, 2.0), _restore(50.01, 3.0)],
                starts=[0.5, 43.0])
    # Our buckets are what they were without restores and starts.
    plain = account(segs, 0.0, 95.0)
    for name in ("startup_s", "productive_s", "lost_s", "checkpoint_s", "recovery_s", "other_s"):
        assert getattr(g, name) == getattr(plain, name), name
    assert (g.startup_restore_s, g.recovery_restore_s, g.recovery_startup_s) == (2.0, 3.0, 4.0)
    b = g.badput_s()
    assert list(b) == list(BADPUT_TYPES)
    assert b["PROGRAM_STARTUP"] == pytest.approx(8.0 + 4.0)      # both starts, less restores
    assert b["UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME"] == pytest.approx(2.0 + 3.0)
    assert b["INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION"] == pytest.approx(3.0)   # 40 -> 43
    assert b["UNPRODUCTIVE_CHECKPOINT_SAVE_TIME"] == g.checkpoint_s == 3.0
    assert b["WASTED_PROGRESS_FROM_DISRUPTION"] == g.lost_s
    assert b["OTHER"] == g.other_s == 5.0
    assert b["TRAINING_PREP"] == b["DATA_LOADING_SYNC"] == 0.0
    _sums_to_wall(g)
    # Without restores and starts, startup and recovery map whole.
    p = plain.badput_s()
    assert p["PROGRAM_STARTUP"] == plain.startup_s
    assert p["INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION"] == plain.recovery_s
    _sums_to_wall(plain)


def test_an_in_process_recovery_and_a_restore_longer_than_its_gap() -> None:
    # No process start between the segments (the group re-formed): the gap less its
    # restore is infrastructure recovery. A restore that says more than the gap (clocks)
    # takes the gap, never more; one that says nothing counts 0.
    segs = [Segment(0, 10, 1.0, 1.5, 10.0, 0.0), Segment(8, 20, 12.0, 12.5, 20.0, 0.0),
            Segment(18, 30, 21.0, 21.5, 30.0, 0.0)]
    g = account(segs, 0.0, 30.0, restores=[_restore(1.0, None), _restore(12.0, 0.5),
                                           _restore(21.0, 5.0)], starts=[0.2])
    assert g.startup_restore_s == 0.0
    assert g.recovery_restore_s == pytest.approx(0.5 + 1.0)
    assert g.recovery_startup_s == 0.0
    assert g.badput_s()["INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION"] == pytest.approx(1.5)
    _sums_to_wall(g)


def test_job_json_carries_both_namings() -> None:
    g = account([Segment(0, 5, 2.0, 2.5, 7.0, 0.5)], 0.0, 8.0, restores=[_restore(2.0, 0.25)])
    rec = json.loads(json.dumps(g.to_json()))
    for name in ("wall_s", "startup_s", "productive_s", "lost_s", "checkpoint_s",
                 "recovery_s", "other_s", "steps", "goodput"):
        assert name in rec   # every existing reader keeps working
    assert list(rec["badput_s"]) == list(BADPUT_TYPES)
    assert rec["badput_s"]["UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME"] == 0.25
    assert rec["badput_s"]["PROGRAM_STARTUP"] == 1.75
    assert rec["productive_s"] + sum(rec["badput_s"].values()) == pytest.approx(rec["wall_s"])


# --- whether anything is written --------------------------------------------------------------

def test_without_the_package_nothing_is_written_unless_asked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)   # as if not installed
    assert not tensorboard_installed()
    logs = str(tmp_path / "output" / "logs")
    assert open_scalars(TensorBoardMode.AUTO, logs, tmp_path, 1) is None
    assert open_scalars(TensorBoardMode.OFF, logs, tmp_path, 1) is None
    with pytest.raises(TensorBoardUnavailable, match="pip install"):
        open_scalars(TensorBoardMode.ON, logs, tmp_path, 1)
    # The launch fails at once, before it makes a job directory.
    monkeypatch.setenv("RESILIENT_TRAIN_QUOTA_DIR", str(tmp_path / "quota"))
    job_dir = tmp_path / "job"
    assert cli.main(["launch", "--tensorboard", "on", "--job-dir", str(job_dir), "--",
                     sys.executable, "-c", "pass"]) == cli.EXIT_USAGE
    assert INSTALL_HINT in capsys.readouterr().err
    assert not job_dir.exists() and not (tmp_path / "output").exists()


def test_auto_writes_a_local_directory_only(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    local = open_scalars(TensorBoardMode.AUTO, str(tmp_path / "logs") + "/", tmp_path, 1)
    assert local is not None and local.where == str(tmp_path / "logs" / "goodput")
    assert open_scalars(TensorBoardMode.AUTO, "gs://b/run/logs/", tmp_path, 1) is None
    remote = open_scalars(TensorBoardMode.ON, "gs://b/run/logs/", tmp_path, 1)
    assert remote is not None and remote.where == "gs://b/run/logs/goodput"
    assert remote.writer.path.parent == tmp_path / "tensorboard" / "goodput"
    assert "copied there" in remote.describe()
    assert list(cli.TENSORBOARD_MODES) == [m.value for m in TensorBoardMode]


# --- reading event files back -----------------------------------------------------------------

def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float, float]]]:
    """Every scalar under ``logdir``, by tag: (step, value, wall time), as TensorBoard
    reads them."""
    accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator")
    acc = accumulator.EventAccumulator(str(logdir), size_guidance={accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value, e.wall_time) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


def test_the_writer_writes_what_tensorboard_reads(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    w = ScalarWriter(str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()   # nothing until the first scalar
    w.scalar("a/b", 1.5, 3, wall_time=1000.0)
    w.scalar("a/b", 2.25, 4, wall_time=1001.0)
    w.scalar("c", 7.0, 0, wall_time=1002.0)
    w.close()
    assert read_scalars(tmp_path / "run") == {
        "a/b": [(3, 1.5, 1000.0), (4, 2.25, 1001.0)], "c": [(0, 7.0, 1002.0)]}


def test_a_url_gets_a_copy_of_the_local_file(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    import fsspec

    w = ScalarWriter("memory://tb-test/run/logs/goodput", staging=tmp_path / "staging",
                     upload_every_s=3600.0)
    w.scalar("x", 1.0, 1)
    w.flush()                       # the first flush copies; later ones wait
    fs = fsspec.filesystem("memory")
    remote = f"/tb-test/run/logs/goodput/{w.path.name}"
    first = fs.cat_file(remote)
    w.scalar("x", 2.0, 2)
    w.flush()
    assert fs.cat_file(remote) == first
    w.close()                       # the last copy, whatever the interval
    assert fs.cat_file(remote) == w.path.read_bytes() != first
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / w.path.name).write_bytes(fs.cat_file(remote))
    assert [(s, v) for s, v, _ in read_scalars(copy)["x"]] == [(1, 1.0), (2, 2.0)]
    fs.rm("/tb-test", recursive=True)


class FakeRecord:
    """What JobScalars reads of a JobRecord."""

    def __init__(self) -> None:
        self.lives: list[LifeTelemetry] = []
        self.recoveries: list[dict[str, Any]] = []
        self.goodput: dict[str, Any] | None = None
        self.asked_from = 0

    def primary_lives(self, first: int = 0) -> list[LifeTelemetry]:
        self.asked_from = first
        return self.lives[first:]

    def goodput_so_far(self, now: float) -> Goodput | None:
        return None


def _recovery(ranks: int, *, steps_lost: int, seconds: float | None) -> dict[str, Any]:
    return {"at": "2026-01-01T00:00:10.000Z", "step": 20, "steps_lost": steps_lost,
            "seconds": seconds, "ranks": [{"replica": f"r{i}"} for i in range(ranks)],
            "bytes_read": {"peer": 0, "node-local": 4096, "persistent": 1 << 20}}


def test_step_time_is_sampled_per_window_and_recoveries_once_complete(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("tensorboard")
    monkeypatch.setattr(scalars_mod, "_POLL_S", 0.0)
    scalars = JobScalars(ScalarWriter(str(tmp_path / "goodput")), replicas=2)
    record = FakeRecord()
    t0 = 1_000_000.0

    def life(*segs: Segment) -> LifeTelemetry:
        return LifeTelemetry(segs, ())

    # 4 s into a segment of 0.1 s steps: no window is full yet.
    record.lives = [life(Segment(0, 40, t0, t0 + 0.1, t0 + 4.0, 0.0))]
    record.recoveries = [_recovery(1, steps_lost=5, seconds=None)]   # one rank of two so far
    scalars.poll(t0 + 4.0, record)  # type: ignore[arg-type]
    # 12 s: a full window (with 1 s blocked by a save, left out); the recovery complete.
    record.lives = [life(Segment(0, 110, t0, t0 + 0.1, t0 + 12.0, 1.0))]
    record.recoveries = [_recovery(2, steps_lost=5, seconds=1.25)]
    scalars.poll(t0 + 12.0, record)  # type: ignore[arg-type]
    # The life dies at step 120; the next one's segment begins: the first one's rest.
    record.lives = [life(Segment(0, 120, t0, t0 + 0.1, t0 + 13.0, 1.0)),
                    life(Segment(110, 115, t0 + 20.0, t0 + 20.2, t0 + 21.0, 0.0))]
    scalars.poll(t0 + 21.0, record)  # type: ignore[arg-type]
    scalars.poll(t0 + 22.0, record)  # type: ignore[arg-type]
    assert record.asked_from == 1   # the first life is written to its end: not read again
    record.goodput = {"wall_s": 25.0, "productive_s": 20.0, "steps": 115,
                      "badput_s": dict.fromkeys(BADPUT_TYPES, 5.0 / len(BADPUT_TYPES))}
    scalars.close(record, t0 + 25.0)  # type: ignore[arg-type]
    scalars.close(record, t0 + 25.0)  # type: ignore[arg-type]   (once is enough)
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    got = read_scalars(tmp_path / "goodput")
    steps = [(s, round(v, 4)) for s, v, _ in got["step_time/seconds"]]
    assert steps == [(110, round(11.0 / 110, 4)), (120, 0.1), (115, 0.2)]
    assert [(s, v) for s, v, _ in got["recovery/seconds"]] == [(1, 1.25)]
    assert [(s, v) for s, v, _ in got["recovery/steps_lost"]] == [(1, 5.0)]
    assert [(s, v) for s, v, _ in got["recovery/bytes_read_node_local"]] == [(1, 4096.0)]
    assert [(s, v) for s, v, _ in got["goodput/goodput"]] == [(115, 80.0)]
    assert got["goodput/goodput"][0][2] == t0 + 25.0
    for name in BADPUT_TYPES:
        assert [s for s, _, _ in got[f"badput/{name.lower()}"]] == [115]
    assert sum(got[f"badput/{n.lower()}"][0][1] for n in BADPUT_TYPES) == pytest.approx(20.0)


# --- a launched job ---------------------------------------------------------------------------

STEPS, STEP_S = 30, 0.05


@pytest.mark.slow
def test_a_launched_job_writes_scalars_that_read_back_as_its_record(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    job_dir = tmp_path / "job"
    env = dict(os.environ, RESILIENT_TRAIN_QUOTA_DIR=str(tmp_path / "quota"),
               ORACLE=str(tmp_path / "oracle.jsonl"), STEPS=str(STEPS), STEP_S=str(STEP_S))
    proc = subprocess.run(
        [sys.executable, "-m", "resilient_train.cli.main", "launch", "--job-dir", str(job_dir),
         "--quiet", "--tensorboard", "on", "--chaos", "kill@step15", "--",
         sys.executable, str(ROOT / "tests" / "runtime_workers" / "synthetic_goodput.py")],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "TensorBoard scalars stopped" not in proc.stderr, proc.stderr[-3000:]
    logdir = job_dir / "output" / "logs" / "goodput"
    assert f"tensorboard: step time, goodput and recoveries to {logdir}" in proc.stdout
    job = json.loads((job_dir / "job.json").read_text())
    g, recoveries = job["goodput"], job["recoveries"]
    assert g["steps"] == STEPS and len(recoveries) == 1

    # job.json: the platform's names, adding up to the wall time with the productive time.
    badput = g["badput_s"]
    assert list(badput) == list(BADPUT_TYPES)
    assert g["productive_s"] + sum(badput.values()) == pytest.approx(g["wall_s"], abs=0.01)
    assert badput["UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME"] > 0     # two restores timed
    assert g["recovery_startup_s"] > 0      # the killed primary's new process starting up
    assert badput["WASTED_PROGRESS_FROM_DISRUPTION"] == g["lost_s"] > 0

    got = read_scalars(logdir)
    job_end = _epoch(job["end_time"])
    assert set(got) >= {"goodput/goodput", "goodput_seconds/productive", "goodput_seconds/wall",
                        "step_time/seconds", "recovery/seconds", "recovery/steps_lost",
                        "recovery/step", *(f"recovery/bytes_read_{t}" for t in
                                           ("peer", "node_local", "persistent")),
                        *(f"badput/{n.lower()}" for n in BADPUT_TYPES),
                        *(f"badput_seconds/{n.lower()}" for n in BADPUT_TYPES)}
    # The final goodput is job.json's, at the steps trained, at the job's end.
    step, value, when = got["goodput/goodput"][-1]
    assert (step, when) == (STEPS, pytest.approx(job_end, abs=1e-3))
    assert value == pytest.approx(100 * g["productive_s"] / g["wall_s"], rel=1e-5)
    for name in BADPUT_TYPES:
        assert got[f"badput_seconds/{name.lower()}"][-1][1] == pytest.approx(
            badput[name], rel=1e-5, abs=1e-6), name
    # The recovery, at its number.
    rec = recoveries[0]
    assert [(s, v) for s, v, _ in got["recovery/steps_lost"]] == [(1, rec["steps_lost"])]
    assert [(s, v) for s, v, _ in got["recovery/step"]] == [(1, rec["step"])]
    assert got["recovery/seconds"][0][1] == pytest.approx(rec["seconds"], rel=1e-5)
    assert got["recovery/bytes_read_persistent"][0][1] == pytest.approx(
        rec["bytes_read"]["persistent"], rel=1e-6)
    # Step time: a sample per segment here (each shorter than a window), at its last step;
    # each step sleeps STEP_S, so no mean is below it.
    samples = got["step_time/seconds"]
    assert [s for s, _, _ in samples][-1] == STEPS and len(samples) == 2
    assert all(STEP_S * 0.95 <= v < STEP_S * 20 for _, v, _ in samples), samples
    assert all(w <= job_end for _, _, w in samples)


def _epoch(iso: str) -> float:
    from resilient_train.observe.events import epoch

    value = epoch(iso)
    assert value is not None
    return value
