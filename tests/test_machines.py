"""Each replica is its own machine: what it writes to its working directory, TMPDIR and
node-local directory is its own, and survives exactly what the table in
launcher/machines.py (and docs/platform.md, "What a replica's files survive") says, fault by fault."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from resilient_train.cli import main as cli
from resilient_train.launcher.machines import Machines, new_vm_after
from resilient_train.platform.rules import Cause

# A replica's life: say which of its three local places hold the file an earlier life (or
# another replica) wrote, write it in all three, report step 1 once the other replica (if
# any) has written too, then act out MODE on its first life and exit 0 on a later one.
WORKER = textwrap.dedent("""\
    import json, os, pathlib, sys, tempfile, time
    from resilient_train.observe.telemetry import Telemetry
    name = os.environ["RESILIENT_TRAIN_REPLICA"]
    life = (int(os.environ["RESILIENT_TRAIN_ATTEMPT"]), int(os.environ["RESILIENT_TRAIN_RESTART_COUNT"]))
    out = pathlib.Path(os.environ["T_OUT"])
    places = {"workdir": pathlib.Path("mine.txt"),
              "tmp": pathlib.Path(tempfile.gettempdir(), "mine.txt"),
              "node": pathlib.Path(os.environ["RESILIENT_TRAIN_NODE_LOCAL_DIR"], "mine.txt")}
    world = int(os.environ["WORLD_SIZE"])
    if name != "workerpool0-0":   # look only once the primary has written its files
        while not (out / "written-workerpool0-0").exists():
            time.sleep(0.01)
    seen = {k: p.exists() for k, p in places.items()}
    with open(out / "seen.jsonl", "a") as f:
        f.write(json.dumps({"replica": name, "life": life, "seen": seen}) + "\\n")
    for p in places.values():
        p.write_text(name)
    (out / f"written-{name}").touch()
    first = life == (1, 0)
    if not first:
        (out / f"relived-{name}").touch()
        deadline = time.monotonic() + 60   # the primary's exit ends the job: wait for the peer
        while (name == "workerpool0-0" and world > 1 and time.monotonic() < deadline
               and not (out / "relived-workerpool1-0").exists()):
            time.sleep(0.01)
        sys.exit(0)
    mode = os.environ["T_MODE"]
    if name == "workerpool0-0":
        while world > 1 and not (out / "written-workerpool1-0").exists():
            time.sleep(0.01)
        tele = Telemetry.from_env()
        tele.begin_segment(0)
        tele.step(1)               # the launcher's step faults fire now
    if mode == "exit" and name == os.environ["T_TARGET"]:
        sys.exit(int(os.environ["T_CODE"]))
    time.sleep(120)                # until the fault (or the job's end) stops it
    """)


def _run(tmp_path: Path, mode: str, *, workers: int = 1, target: str = "workerpool0-0",
         code: int = 0, extra: list[str] | None = None) -> tuple[int, dict[str, Any], list[Any]]:
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    job_dir = tmp_path / "job"
    os.environ.update(T_OUT=str(out), T_MODE=mode, T_TARGET=target, T_CODE=str(code))
    try:
        status = cli.main(["launch", "--workers", str(workers), "--job-dir", str(job_dir),
                           "--timeout", "90s", "--grace", "5s", "--quiet", *(extra or []),
                           "--", sys.executable, str(script)])
    finally:
        for key in ("T_OUT", "T_MODE", "T_TARGET", "T_CODE"):
            os.environ.pop(key, None)
    record = json.loads((job_dir / "job.json").read_text())
    seen = [json.loads(line) for line in (out / "seen.jsonl").read_text().splitlines()]
    return status, record, seen


def _later_life(seen: list[Any], replica: str) -> dict[str, bool]:
    lives = [s for s in seen if s["replica"] == replica and tuple(s["life"]) != (1, 0)]
    assert lives, f"{replica} never started again: {seen}"
    return lives[0]["seen"]


NOTHING = {"workdir": False, "tmp": False, "node": False}
NODE_KEPT = {"workdir": False, "tmp": False, "node": True}


@pytest.fixture(autouse=True)
def _quota(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESILIENT_TRAIN_QUOTA_DIR", str(tmp_path / "quota"))
    monkeypatch.setenv("RESILIENT_TRAIN_GPUS", "none")
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("chaos, expected", [
    ("kill:0@step1", NOTHING),            # node loss: another VM
    ("maintenance:0@step1", NOTHING),     # moved to another VM
    ("preempt:0@step1", NOTHING),
], ids=["node-loss", "maintenance", "preemption"])
def test_a_replica_moved_to_another_vm_keeps_nothing_local(
        tmp_path: Path, chaos: str, expected: dict[str, bool]) -> None:
    status, record, seen = _run(tmp_path, "wait", extra=["--chaos", chaos])
    assert status == 0, record["error"]
    assert seen[0]["seen"] == NOTHING       # a fresh machine at the start
    assert _later_life(seen, "workerpool0-0") == expected
    wiped = [e["message"] for e in record["events"] if e["kind"] == "machine"
             and "restarted on" in e["message"]]
    assert wiped == [("workerpool0-0: restarted on a new VM: its container's files (mine.txt, "
                      "tmp/mine.txt) wiped; its node-local disk (mine.txt) wiped")]


def test_a_restart_in_place_keeps_the_vms_disk_only(tmp_path: Path) -> None:
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"rules": [
        {"match": {"exit_codes": [42]}, "actions": ["restart_worker"]}]}))
    status, record, seen = _run(tmp_path, "exit", code=42, extra=["--policy", str(policy)])
    assert status == 0, record["error"]
    assert _later_life(seen, "workerpool0-0") == NODE_KEPT
    messages = [e["message"] for e in record["events"] if e["kind"] == "machine"]
    assert ("workerpool0-0: restarted on the same VM, a new container: its container's files "
            "(mine.txt, tmp/mine.txt) wiped; its node-local disk (mine.txt) kept") in messages
    # The file it wrote in its working directory is named, once.
    written = [m for m in messages if "wrote mine.txt in its working directory" in m]
    assert len(written) == 1 and "RESILIENT_TRAIN_NODE_LOCAL_DIR" in written[0]


def test_a_job_retry_starts_every_replica_on_a_new_machine(tmp_path: Path) -> None:
    status, record, seen = _run(tmp_path, "exit", code=134)   # transient: the job is retried
    assert status == 0, record["error"]
    assert len(record["attempts"]) == 2
    assert _later_life(seen, "workerpool0-0") == NOTHING


def test_replicas_do_not_see_each_others_files_and_peers_restarted_along_keep_their_disk(
        tmp_path: Path) -> None:
    status, record, seen = _run(tmp_path, "wait", workers=2,
                                extra=["--chaos", "kill:1@step1",
                                       "--restart-job-on-worker-restart"])
    assert status == 0, record["error"]
    first = {s["replica"]: s["seen"] for s in seen if tuple(s["life"]) == (1, 0)}
    # workerpool1-0 looked after workerpool0-0 had written its three files: none is visible.
    assert first == {"workerpool0-0": NOTHING, "workerpool1-0": NOTHING}
    # The primary, restarted along with its lost peer, is on its own VM still.
    assert _later_life(seen, "workerpool0-0") == NODE_KEPT
    assert _later_life(seen, "workerpool1-0") == NOTHING


def test_shared_storage_and_the_launchers_own_directory_are_left_alone(tmp_path: Path) -> None:
    """The view links the launcher's working directory; wiping a replica's machine never
    follows a link into it."""
    source = tmp_path / "src"
    (source / "data").mkdir(parents=True)
    (source / "data" / "x.bin").write_bytes(b"x")
    (source / "train.py").write_text("print()")
    machines = Machines(tmp_path / "job", "0123456789abcdef", source=source,
                        tmp_base=str(tmp_path / "tmp"))
    first = machines.prepare("workerpool0-0", new_vm=True)
    assert first.workdir is not None
    assert sorted(os.listdir(first.workdir)) == ["data", "train.py"]
    (first.workdir / "snapshot.pt").write_bytes(b"s")
    (first.workdir / "data" / "y.bin").write_bytes(b"y")   # inside a link: the shared tree
    assert machines.written("workerpool0-0") == ["snapshot.pt"]
    assert machines.written("workerpool0-0") == []          # once per file
    again = machines.prepare("workerpool0-0", new_vm=True)
    assert again.wiped == ("its container's files (snapshot.pt)",)
    assert sorted(os.listdir(source / "data")) == ["x.bin", "y.bin"]
    assert (source / "train.py").exists()
    machines.close()
    assert not machines.tmp_root.exists()


@pytest.mark.parametrize("job_dir", ["rt-jobs/rt-1", "."])
def test_the_view_never_links_back_to_the_job_directory(tmp_path: Path, job_dir: str) -> None:
    """A job directory inside the working directory (rt-jobs/ by default) is left out of
    the views: a link to it would make a loop, and a walk that follows links (setuptools'
    package discovery in `pip install -e .`) would never end."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "train.py").write_text("print()")
    machines = Machines(source / job_dir, "0123456789abcdef", source=source,
                        tmp_base=str(tmp_path / "tmp"))
    placement = machines.prepare("workerpool0-0", new_vm=True)
    assert placement.workdir is not None
    assert sorted(os.listdir(placement.workdir)) == ["train.py"]
    # The whole tree, links followed, is finite and small.
    walked = sum(1 for _ in zip(range(1000), os.walk(source, followlinks=True)))
    assert walked < 20, walked
    machines.close()


def test_the_table_of_causes() -> None:
    assert [c for c in Cause if new_vm_after(c)] == [Cause.MAINTENANCE, Cause.PREEMPTION,
                                                     Cause.NODE_LOSS]


def test_an_output_dir_under_gcs_without_a_mount_says_where_it_goes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from resilient_train.launcher.workerenv import fuse_path_note

    note = fuse_path_note("/gcs/my-bucket/run1/")
    assert note is not None and "nothing is mounted at /gcs/ here" in note
    assert note.endswith("use gs://my-bucket/run1")
    assert fuse_path_note("gs://my-bucket/run1") is None
    assert fuse_path_note("/data/run1") is None and fuse_path_note(None) is None
    # A bucket mounted with gcsfuse at /gcs/my-bucket, as on the platform: nothing to say.
    monkeypatch.setattr("os.path.ismount", lambda p: p == "/gcs/my-bucket")
    assert fuse_path_note("/gcs/my-bucket/run1") is None
