from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient_train.launcher.quota import Capacity, Lease, LocalQuota, Request, default_quota_dir

REPO = Path(__file__).resolve().parents[1]
CAP = Capacity(gpu_ids=(0, 1, 2, 3), cpu_slots=8)

# A second launcher: takes a lease, reports it, holds it until stdin closes.
HOLDER = """
import json, sys
from pathlib import Path
from resilient_train.launcher.quota import Capacity, LocalQuota, Request
quota = LocalQuota(Path(sys.argv[1]), Capacity(tuple(range(4)), 8))
lease = quota.try_acquire(sys.argv[2], Request(gpus=int(sys.argv[3]), cpu_slots=int(sys.argv[4])))
print(json.dumps(None if lease is None else list(lease.gpu_ids)), flush=True)
sys.stdin.read()
"""


def _holder(directory: Path, job: str, gpus: int, cpus: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory), job, str(gpus), str(cpus)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_default_quota_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert default_quota_dir({"RESILIENT_TRAIN_QUOTA_DIR": str(tmp_path)}) == tmp_path
    assert default_quota_dir({"XDG_CACHE_HOME": "/c"}) == Path("/c/resilient-train/quota")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_quota_dir({}) == tmp_path / ".cache/resilient-train/quota"


def test_fits_ever_and_bad_requests(tmp_path: Path) -> None:
    quota = LocalQuota(tmp_path / "q", CAP)
    assert quota.fits_ever(Request(gpus=4, cpu_slots=8))
    assert not quota.fits_ever(Request(gpus=5))
    assert not quota.fits_ever(Request(cpu_slots=9))
    assert quota.try_acquire("big", Request(gpus=5)) is None
    with pytest.raises(ValueError, match="non-negative"):
        Request(gpus=-1)
    with pytest.raises(ValueError, match="not a live process"):
        quota.try_acquire("ghost", Request(gpus=1), pid=2**22 + 1)


def test_two_quota_objects_share_the_ledger(tmp_path: Path) -> None:
    a, b = LocalQuota(tmp_path, CAP), LocalQuota(tmp_path, CAP)
    la = a.try_acquire("a", Request(gpus=3, cpu_slots=5))
    assert la == Lease("a", os.getpid(), (0, 1, 2), 5)
    assert b.try_acquire("b", Request(gpus=2)) is None  # one GPU left
    assert b.try_acquire("b", Request(gpus=1, cpu_slots=4)) is None  # 3 slots left
    lb = b.try_acquire("b", Request(gpus=1, cpu_slots=3))
    assert lb is not None and lb.gpu_ids == (3,)
    assert a.usage() == [la, lb]
    a.release(la)
    a.release(la)  # idempotent
    assert b.usage() == [lb]
    lc = a.try_acquire("c", Request(gpus=2))
    assert lc is not None and lc.gpu_ids == (0, 1)  # lowest free ids first


def test_second_process_contends_and_its_lease_is_reclaimed_after_sigkill(tmp_path: Path) -> None:
    quota = LocalQuota(tmp_path, CAP)
    holder = _holder(tmp_path, "other", 3, 6)
    try:
        assert json.loads(holder.stdout.readline()) == [0, 1, 2]
        assert [lease.job_id for lease in quota.usage()] == ["other"]
        assert quota.try_acquire("mine", Request(gpus=2)) is None
        assert quota.try_acquire("mine", Request(cpu_slots=3)) is None
        holder.kill()  # a SIGKILLed launcher cannot release
        holder.wait()
        mine = quota.try_acquire("mine", Request(gpus=4, cpu_slots=8))
        assert mine is not None and mine.gpu_ids == (0, 1, 2, 3)
        assert quota.usage() == [mine]
    finally:
        holder.kill()
        holder.wait()


def test_concurrent_processes_get_disjoint_gpus(tmp_path: Path) -> None:
    holders = [_holder(tmp_path, f"job{i}", 1, 1) for i in range(6)]
    try:
        grants = [json.loads(h.stdout.readline()) for h in holders]
        won = [g for g in grants if g is not None]
        assert len(won) == 4
        assert sorted(gpu for g in won for gpu in g) == [0, 1, 2, 3]
        assert sum(lease.cpu_slots for lease in LocalQuota(tmp_path, CAP).usage()) == 4
    finally:
        for h in holders:
            h.stdin.close()
            h.wait()
    assert LocalQuota(tmp_path, CAP).usage() == []


def test_reused_pid_does_not_keep_a_lease(tmp_path: Path) -> None:
    quota = LocalQuota(tmp_path, CAP)
    lease = quota.try_acquire("old", Request(gpus=4))
    assert lease is not None
    ledger = tmp_path / "leases.json"
    data = json.loads(ledger.read_text())
    # Same (live) pid, but recorded for a process that started earlier: the pid was reused.
    data["leases"][0]["create_time"] = psutil.Process().create_time() - 1000
    ledger.write_text(json.dumps(data))
    assert quota.usage() == []
    assert quota.try_acquire("new", Request(gpus=4)) is not None


@pytest.mark.parametrize(
    "content", ["{not json", '{"leases": 3}', '{"leases": [{"pid": "x"}]}', "[]"]
)
def test_corrupt_ledger_is_logged_and_empty(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: str
) -> None:
    (tmp_path / "leases.json").write_text(content)
    quota = LocalQuota(tmp_path, CAP)
    with caplog.at_level(logging.WARNING, logger="resilient_train.launcher.quota"):
        assert quota.usage() == []
    assert "corrupt" in caplog.text
    assert quota.try_acquire("j", Request(gpus=1)) is not None
    assert len(quota.usage()) == 1


@settings(max_examples=30, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(0, 3), st.integers(0, 4), st.integers(0, 10)),
        max_size=25,
    )
)
def test_leases_never_overcommit(tmp_path_factory: pytest.TempPathFactory, ops: list) -> None:
    quota = LocalQuota(tmp_path_factory.mktemp("q"), CAP)
    held: list[Lease] = []
    # A job id per acquisition, as launches have: two leases of one id, no GPUs and no
    # CPU slots are equal, and releasing one took the first where the model popped another.
    for n, (acquire, gpus, cpus, pick) in enumerate(ops):
        if acquire or not held:
            lease = quota.try_acquire(f"j{n}", Request(gpus=gpus, cpu_slots=cpus))
            if lease is not None:
                held.append(lease)
        else:
            quota.release(held.pop(pick % len(held)))
        usage = quota.usage()
        assert usage == held
        gpu_ids = [g for lease in usage for g in lease.gpu_ids]
        assert len(gpu_ids) == len(set(gpu_ids)) and set(gpu_ids) <= set(CAP.gpu_ids)
        assert sum(lease.cpu_slots for lease in usage) <= CAP.cpu_slots
