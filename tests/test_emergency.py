"""SIGTERM's emergency save within its grace period (checkpoint/emergency.py): committed
to every tier, the fastest first, or abandoned at the deadline so that the previous
committed step stays the latest. A stalled link is a FaultProxy that holds the uploads
until the test lets them go: nothing here races a timer against a save of some size."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import resilient_train as rt
from resilient_train.checkpoint.commit.directory import scan
from resilient_train.checkpoint.schedule.emergency import CommitGate, Grace, Outcome, SaveAbandoned
from resilient_train.checkpoint.storage.base import RetryOptions, Storage
from resilient_train.launcher.workerenv import JobEnv, replicas_for, worker_env
from resilient_train.sigterm import GRACE_ENV

HERE = Path(__file__).resolve().parent
FAST = RetryOptions(deadline_s=30.0, initial_s=0.01, max_wait_s=0.1)
# gcsfs's uploads (simple, multipart, resumable) of a step's data, not of the manifest or
# the marker: the save stalls before its commit, so the outcome is certain (abandoned).
UPLOADS = r"^/upload/(?!.*(COMMITTED|manifest\.json))"
SAFETY_S = 60.0          # waits on conditions: a hang fails the test, never a timing


def test_the_grace_period_comes_from_the_option_then_the_launcher_then_spot() -> None:
    assert Grace.resolve(120.0, {GRACE_ENV: "5"}) == Grace(120.0, "given")
    assert Grace.resolve(None, {GRACE_ENV: "5"}) == Grace(5.0, GRACE_ENV)
    spot = Grace.resolve(None, {})
    assert spot.seconds == 30.0 and "Spot" in spot.source
    assert spot.budget(10.0) == 30.0 - 10.0 - spot.reserve_s   # counted from the SIGTERM
    with pytest.raises(ValueError, match=f"{GRACE_ENV}='soon'.*seconds"):
        Grace.resolve(None, {GRACE_ENV: "soon"})
    with pytest.raises(ValueError, match="sigterm_grace_s=0.*Spot"):
        rt.CheckpointOptions(sigterm_grace_s=0)


def test_the_launcher_tells_each_worker_its_grace_period(tmp_path: Path) -> None:
    job = JobEnv(job_id="j", replicas=replicas_for([("workerpool0", 1)]),
                 master_addr="127.0.0.1", master_port=29500, output_base=str(tmp_path),
                 job_dir=str(tmp_path), grace_s=7.5)
    env = worker_env(job, job.replicas[0], attempt=0, restart=0, error_file="e",
                     gpu_ids=None, base={})
    assert env[GRACE_ENV] == "7.5"


def test_the_commit_gate_lets_exactly_one_of_commit_and_abandon_happen() -> None:
    late = CommitGate()
    with late.commit(8):                        # an earlier step's commit...
        pass
    assert late.close(9, timeout_s=1.0) is Outcome.ABANDONED   # ...then 9, before its own...
    with pytest.raises(SaveAbandoned, match="step 9"), late.commit(9):
        pytest.fail("a commit after the deadline ran")   # ...so the commit is refused
    early = CommitGate()
    with early.commit(9):
        pass
    assert early.close(9, timeout_s=1.0) is Outcome.COMMITTED  # the commit got in first
    busy = CommitGate()
    inside, leave = threading.Event(), threading.Event()

    def committing() -> None:
        with busy.commit(9):
            inside.set()
            leave.wait(SAFETY_S)

    t = threading.Thread(target=committing)
    t.start()
    assert inside.wait(SAFETY_S)
    assert busy.close(9, timeout_s=0.05) is Outcome.UNDER_WAY  # its marker may yet land
    leave.set()
    t.join(SAFETY_S)
    assert busy.last == 9


def _manager(url: str, storage_options: dict[str, Any], local: Path | None,
             grace_s: float) -> tuple[rt.CheckpointManager, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr = rt.CheckpointManager(url, options=rt.CheckpointOptions(
        retry=FAST, storage_options=storage_options, sigterm_grace_s=grace_s,
        node_local=rt.NodeLocal(directory=str(local), persistent_every=100)
        if local is not None else None))
    mgr.track(model=model, optimizer=opt)
    return mgr, model


def _committed(url: str, storage_options: dict[str, Any]) -> list[int]:
    st = Storage(url, storage_options=storage_options)
    return sorted(i.step for i in scan(st, with_manifest=False) if i.committed)


def test_an_emergency_save_that_fits_commits_to_every_tier(gcs_bucket: Any,
                                                           tmp_path: Path) -> None:
    url, opts = f"{gcs_bucket.url}/fits", gcs_bucket.storage_options
    mgr, _ = _manager(url, opts, tmp_path / "local", grace_s=30.0)
    assert mgr.emergency_save(4)
    mgr.close()
    assert _committed(url, opts) == [4]
    assert _committed(str(tmp_path / "local"), {}) == [4]


def test_an_emergency_save_past_its_deadline_is_abandoned_and_never_commits(
        gcs_bucket: Any, gcs_proxy: Any, tmp_path: Path) -> None:
    url = f"{gcs_bucket.url}/stalls"
    opts = {**gcs_bucket.storage_options, "endpoint_url": gcs_proxy.endpoint}
    mgr, model = _manager(url, opts, tmp_path / "local", grace_s=1.0)
    mgr.save(3, blocking=True)
    release = threading.Event()
    gcs_proxy.inject(release, count=None, path=UPLOADS)   # the link stalls from here on
    with torch.no_grad():
        model.weight.add_(1.0)
    try:
        assert not mgr.emergency_save(5)
        assert "checkpoint of step 5 was abandoned" in mgr.abandoned
        assert "step 3 stays the latest" in mgr.abandoned
        assert "step 5 is on this machine's node-local disk" in mgr.abandoned
        assert gcs_proxy.requests_matching(path=UPLOADS)   # it was held, not skipped
    finally:
        release.set()   # the uploads go through now; the commit must still be refused
    assert mgr.left_behind is not None
    mgr.left_behind.join(SAFETY_S)
    assert not mgr.left_behind.is_alive()
    mgr.close()
    assert _committed(url, opts) == [3]                  # the previous step stays the latest
    objects = Storage(url, storage_options=opts).fs.find(f"{gcs_bucket.name}/stalls")
    left = [o for o in objects if not o.split("/")[2].startswith("step-000000000003-")]
    assert left == [], "what the abandoned save wrote was not discarded"
    # A restart on the same VM takes step 5 from its disk; a new VM, step 3 from storage.
    same, _ = _manager(url, opts, tmp_path / "local", grace_s=30.0)
    assert same.restore_latest() == 5
    same.close()
    new, _ = _manager(url, opts, None, grace_s=30.0)
    assert new.restore_latest() == 3
    new.close()


def _wait_for(cond: Any, what: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + SAFETY_S
    while not cond():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{what}: not seen; stderr:\n{proc.communicate()[1][-3000:]}")
        time.sleep(0.05)


def _worker(url: str, gcs_proxy: Any, tmp_path: Path, grace: float,
            **env: str) -> subprocess.Popen[str]:
    """train_simple.py saving to ``url`` through the proxy, told its grace period."""
    env = {**os.environ, "CKPT": url, "OUT": str(tmp_path / "out.pt"),
           "STORAGE_EMULATOR_HOST": gcs_proxy.endpoint, GRACE_ENV: f"{grace:g}",
           "RESILIENT_TRAIN_ERROR_FILE": str(tmp_path / "err.json"), **env}
    return subprocess.Popen([sys.executable, str(HERE / "runtime_workers" / "train_simple.py")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stopped_in_time(proc: subprocess.Popen[str], grace: float) -> tuple[str, str]:
    """SIGTERM ``proc``: it exits 134 by itself within ``grace``. Its stdout, and its
    one ``SIGTERM: ... exit 134`` line."""
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=SAFETY_S)
    took = time.monotonic() - t0
    assert proc.returncode == 134, err[-3000:]
    line = next(x for x in err.splitlines() if "SIGTERM:" in x and "exit 134" in x)
    assert took < grace, f"exited {took:.1f} s after the SIGTERM, past its {grace} s grace"
    return out, line


def test_sigterm_with_a_stalled_link_exits_134_before_the_grace_ends(
        gcs_bucket: Any, gcs_proxy: Any, tmp_path: Path) -> None:
    """A worker under SIGTERM whose uploads stall leaves on its own within the grace
    period, exit 134, saying that the step was abandoned and which one stays the latest:
    the platform's SIGKILL never has to come."""
    url, opts = f"{gcs_bucket.url}/worker", gcs_bucket.storage_options
    # A 6 s grace left the exit a 1.2 s reserve, and 2 loaded cores took 1.3 once; from
    # 10 s on, the reserve is the 2 s that the platform's 30 s grace periods get too.
    grace = 10.0
    proc = _worker(url, gcs_proxy, tmp_path, grace, STEPS="100000", STEP_S="0.02")
    _wait_for(lambda: _committed(url, opts), "a committed step", proc)
    release = threading.Event()
    gcs_proxy.inject(release, count=None, path=UPLOADS)
    try:
        _, line = _stopped_in_time(proc, grace)
    finally:
        release.set()
    assert "was abandoned: not committed in time" in line and "stays the latest" in line
    last = int(line.split("; step ")[1].split()[0])
    # What the stalled save wrote never became a step: the latest is the one it named.
    assert max(_committed(url, opts)) == last


def test_sigterm_during_the_final_save_leaves_before_the_grace_ends(
        gcs_bucket: Any, gcs_proxy: Any, tmp_path: Path) -> None:
    """The loop's end waits for the last step's save to commit; a SIGTERM while its
    upload stalls leaves within the grace period (exit 134, the step before stays the
    latest), as at any other step, instead of waiting past the grace for the SIGKILL."""
    url, opts = f"{gcs_bucket.url}/final", gcs_bucket.storage_options
    gate = tmp_path / "gate"
    grace = 10.0   # the exit's reserve is then 2 s: enough on loaded cores
    proc = _worker(url, gcs_proxy, tmp_path, grace, STEPS="20", GATE_AT="19", GATE=str(gate))
    _wait_for(gate.exists, "the last step", proc)   # saves of 5, 10 and 15 behind it
    _wait_for(lambda: 15 in _committed(url, opts), "step 15 committed", proc)
    release = threading.Event()
    gcs_proxy.inject(release, count=None, path=UPLOADS)   # the link stalls from here on
    gate.unlink()
    try:
        _wait_for(lambda: any(e.outcome == "held" for e in gcs_proxy.requests_matching(
            path=UPLOADS)), "the last step's upload", proc)
        out, line = _stopped_in_time(proc, grace)
    finally:
        release.set()
    assert "checkpoint of step 20 was abandoned" in line and "step 15 stays the latest" \
        in line, line
    assert "restored_step" not in out   # the code after the loop never ran
    assert max(_committed(url, opts)) == 15
