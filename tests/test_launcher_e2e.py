"""End-to-end tests of the launcher with real worker processes (docs/platform.md).

Workers are the small scripts in tests/workers/. They write marker files into a
per-test ready directory, and the tests wait on those files (never on a fixed sleep).
Every test runs with its own quota ledger and a unique ``E2E_MARKER`` in the environment
that every worker and grandchild inherits; after each test no live process may still
carry that marker.

Most jobs run in-process through ``resilient_train.cli.main.main`` (cheap: no interpreter
start for the launcher). Tests that signal the launcher, or run two launchers at once,
start it as a real ``python -m resilient_train.cli.main`` process.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from resilient_train.cli import main as cli
from resilient_train.launcher import runner
from resilient_train.observe.jobdir import read_job
from resilient_train.observe.telemetry import ObservedMtbf

WORKERS = Path(__file__).resolve().parent / "workers"
REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
PRIMARY = "workerpool0-0"
# A safety net: a job that hangs because of a launcher bug fails instead of hanging pytest.
JOB_TIMEOUT = "90s"
WAIT_S = 30.0        # generous: a loaded 2-core machine starts Python slowly
ORPHAN_WAIT_S = 10.0

STOCKOUT_MESSAGE = ("Resources are insufficient in region: local. Try a different region "
                    "or use a different accelerator.")


# --------------------------------------------------------------------------- helpers

def wait_until(predicate: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.02)


def marked_processes(marker: str) -> list[psutil.Process]:
    """Live processes (not zombies, not this one) whose environment carries the marker."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get("E2E_MARKER") == marker:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def describe(procs: list[psutil.Process]) -> str:
    out = []
    for p in procs:
        try:
            out.append(f"pid {p.pid} ppid {p.ppid()} {' '.join(p.cmdline())[:120]}")
        except psutil.Error:
            out.append(f"pid {p.pid} (gone)")
    return "; ".join(out)


@dataclass
class E2E:
    tmp: Path
    marker: str
    ready: Path
    quota: Path
    monkeypatch: pytest.MonkeyPatch
    capsys: pytest.CaptureFixture[str]
    _count: int = 0

    def job_dir(self, name: str = "job") -> Path:
        return self.tmp / "jobs" / name

    def files(self, pattern: str) -> list[Path]:
        return sorted(self.ready.glob(pattern))

    def read(self, name: str) -> dict[str, Any]:
        return json.loads((self.ready / name).read_text())

    def wait_file(self, name: str, timeout: float = WAIT_S) -> dict[str, Any]:
        wait_until(lambda: (self.ready / name).exists(), f"{name} in the ready directory",
                   timeout)
        return self.read(name)

    def primary_waits_for(self, *patterns: str) -> None:
        self.monkeypatch.setenv("E2E_PRIMARY_WAIT", ";".join(patterns))

    def argv(self, args: list[str], script: str | list[str], script_args: list[str],
             name: str) -> list[str]:
        command = [PY, str(WORKERS / script), *script_args] if isinstance(script, str) else script
        return ["launch", "--name", f"e2e-{name}-{self.marker[:6]}",
                "--job-dir", str(self.job_dir(name)), "--timeout", JOB_TIMEOUT,
                *args, "--", *command]

    def launch(self, *args: str, script: str | list[str] = "hang.py",
               script_args: tuple[str, ...] = (), name: str = "job"
               ) -> tuple[int, dict[str, Any], str]:
        """Run a job in-process through the CLI: (exit status, job.json, output)."""
        status = cli.main(self.argv(list(args), script, list(script_args), name))
        out = self.capsys.readouterr()
        return status, read_job(self.job_dir(name)), out.out + out.err

    def spawn(self, *args: str, script: str | list[str] = "hang.py",
              script_args: tuple[str, ...] = (), name: str = "job") -> tuple[
                  subprocess.Popen[bytes], Path]:
        """Start the launcher as its own process; its output goes to a file."""
        self._count += 1
        out = self.tmp / f"launcher-{name}-{self._count}.out"
        argv = [PY, "-m", "resilient_train.cli.main",
                *self.argv(list(args), script, list(script_args), name)]
        with open(out, "wb") as f:
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
        return proc, out


@pytest.fixture
def e2e(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> Iterator[E2E]:
    marker = uuid.uuid4().hex
    ready = tmp_path / "ready"
    ready.mkdir()
    quota = tmp_path / "quota"
    monkeypatch.setenv("E2E_MARKER", marker)
    monkeypatch.setenv("E2E_READY_DIR", str(ready))
    monkeypatch.setenv("RESILIENT_TRAIN_QUOTA_DIR", str(quota))
    monkeypatch.setenv("RESILIENT_TRAIN_GPUS", "none")
    for var in ("E2E_PRIMARY_WAIT", "CUDA_VISIBLE_DEVICES", "TF_CONFIG", "CLUSTER_SPEC",
                "RESILIENT_TRAIN_CPU_SLOTS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    ctx = E2E(tmp_path, marker, ready, quota, monkeypatch, capsys)
    yield ctx
    # No orphans: nothing that inherited this test's marker may outlive the test.
    try:
        wait_until(lambda: not marked_processes(marker), "no process left with the marker",
                   ORPHAN_WAIT_S)
    except AssertionError:
        left = marked_processes(marker)
        text = describe(left)
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        pytest.fail(f"orphans survived the job: {text}")


def replica(record: dict[str, Any], name: str, attempt: int = 1) -> dict[str, Any]:
    return record["attempts"][attempt - 1]["replicas"][name]


def event_messages(record: dict[str, Any]) -> list[str]:
    return [e["message"] for e in record["events"]]


def event_time(record: dict[str, Any], fragment: str) -> float:
    for e in record["events"]:
        if fragment in e["message"]:
            return float(e["elapsed_s"])
    raise AssertionError(f"no event with {fragment!r} in {event_messages(record)}")


def env_of(e2e: E2E, name: str, attempt: int = 1, restart: int = 0) -> dict[str, str]:
    return e2e.read(f"{name}.a{attempt}.r{restart}.env")["env"]  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- environment

def test_environment_of_a_three_replica_job(e2e: E2E) -> None:
    e2e.monkeypatch.setenv("RESILIENT_TRAIN_GPUS", "4")
    e2e.primary_waits_for("workerpool1-0.a1.r0.env", "workerpool1-1.a1.r0.env")
    status, rec, _ = e2e.launch("--workers", "3", "--gpus-per-worker", "1",
                                script="dump_env.py")
    assert (status, rec["state"]) == (0, "JOB_STATE_SUCCEEDED")
    names = [PRIMARY, "workerpool1-0", "workerpool1-1"]
    envs = {n: env_of(e2e, n) for n in names}
    job_dir = e2e.job_dir()
    port = rec["job_spec"]["master_port"]
    for rank, name in enumerate(names):
        env = envs[name]
        pool, index = name.rsplit("-", 1)
        spec = json.loads(env["CLUSTER_SPEC"])
        assert set(spec["cluster"]) == {"workerpool0", "workerpool1"}  # empty pools absent
        assert len(spec["cluster"]["workerpool0"]) == 1
        assert len(spec["cluster"]["workerpool1"]) == 2
        assert spec["environment"] == "cloud"
        assert spec["task"] == {"type": pool, "index": int(index), "trial": ""}
        assert spec["job"]["job_id"] == rec["name"]
        tf = json.loads(env["TF_CONFIG"])
        assert set(tf["cluster"]) == {"chief", "worker"}
        assert tf["cluster"]["chief"] == spec["cluster"]["workerpool0"]
        assert tf["cluster"]["worker"] == spec["cluster"]["workerpool1"]
        assert tf["task"]["type"] == ("chief" if rank == 0 else "worker")
        assert tf["task"]["index"] == int(index)
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", str(port))
        assert spec["cluster"]["workerpool0"] == [f"127.0.0.1:{port}"]
        assert (env["RANK"], env["GROUP_RANK"], env["WORLD_SIZE"]) == (str(rank),) * 2 + ("3",)
        assert env["LOCAL_RANK"] == "0"
        assert env["CLOUD_ML_JOB_ID"] == rec["name"]
        assert env["CLOUD_ML_PROJECT_ID"].isdigit()  # a project number, as on the platform
        assert env["RESILIENT_TRAIN_FAILURES_FILE"] == str(
            job_dir.resolve() / "telemetry" / "failures.json")
        assert env["RESILIENT_TRAIN_REPLICA"] == name
        for var, sub in (("AIP_MODEL_DIR", "model"), ("AIP_CHECKPOINT_DIR", "checkpoints"),
                         ("AIP_TENSORBOARD_LOG_DIR", "logs")):
            assert Path(env[var]).resolve() == (job_dir / "output" / sub).resolve()
            assert env[var].endswith(f"/{sub}/")
            assert os.path.isabs(env[var])  # a worker that changes directory still finds it
            # A gs:// prefix exists for every write: a script that saves to AIP_MODEL_DIR
            # without creating it works on the platform, so here too.
            assert Path(env[var]).is_dir(), var
        assert env["TORCHELASTIC_RESTART_COUNT"] == env["RESILIENT_TRAIN_RESTART_COUNT"] == "0"
        assert env["E2E_MARKER"] == e2e.marker  # the user's environment passes through
        # Three replicas share this machine's cores: each gets its share of threads.
        assert env["OMP_NUM_THREADS"] == str(max(1, len(os.sched_getaffinity(0)) // 3))
    gpus = [envs[n]["CUDA_VISIBLE_DEVICES"] for n in names]
    assert sorted(gpus) == ["0", "1", "2"]  # one fake GPU each, disjoint


def test_relative_job_and_output_dirs_reach_workers_as_absolute_paths(e2e: E2E) -> None:
    # A worker that changes directory must still find its error report path, telemetry
    # and AIP_* directories: relative paths would land them under its new directory.
    e2e.monkeypatch.chdir(e2e.tmp)
    e2e.primary_waits_for("workerpool0-0.a1.r0.env")
    status = cli.main(["launch", "--job-dir", "jobs/rel", "--output-dir", "out/base",
                       "--timeout", JOB_TIMEOUT, "--", PY, str(WORKERS / "dump_env.py")])
    e2e.capsys.readouterr()
    assert status == 0
    env = env_of(e2e, PRIMARY)
    for var in ("TORCHELASTIC_ERROR_FILE", "RESILIENT_TRAIN_TELEMETRY",
                "RESILIENT_TRAIN_JOB_DIR", "AIP_CHECKPOINT_DIR", "AIP_MODEL_DIR"):
        assert os.path.isabs(env[var]), (var, env[var])
    assert env["RESILIENT_TRAIN_JOB_DIR"] == str(e2e.tmp.resolve() / "jobs" / "rel")
    assert env["AIP_CHECKPOINT_DIR"] == f"{e2e.tmp.resolve()}/out/base/checkpoints/"


def fake_user_credentials(tmp_path: Path) -> Path:
    """What `gcloud auth application-default login` writes (never used to call Google
    here: the workers only dump their environment)."""
    path = tmp_path / "adc.json"
    path.write_text(json.dumps({"type": "authorized_user", "client_id": "e2e.apps",
                                "client_secret": "e2e", "refresh_token": "e2e"}))
    return path


def test_environment_of_explicit_pools_with_gs_output(e2e: E2E) -> None:
    e2e.monkeypatch.setenv("RESILIENT_TRAIN_GPUS", "4")  # GPUs exist, the job asks for none
    e2e.monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS",
                           str(fake_user_credentials(e2e.tmp)))
    e2e.monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    names = [PRIMARY, "workerpool1-0", "workerpool1-1", "workerpool2-0", "workerpool3-0"]
    e2e.primary_waits_for(*(f"{n}.a1.r0.env" for n in names[1:]))
    status, rec, _ = e2e.launch(
        "--pool", "workerpool0=1", "--pool", "workerpool1=2", "--pool", "workerpool2=1",
        "--pool", "workerpool3=1", "--output-dir", "gs://e2e-bucket/run-7/",
        script="dump_env.py")
    assert (status, rec["state"]) == (0, "JOB_STATE_SUCCEEDED")
    assert rec["replicas"] == names
    for name in names:
        env = env_of(e2e, name)
        spec = json.loads(env["CLUSTER_SPEC"])
        assert set(spec["cluster"]) == {"workerpool0", "workerpool1", "workerpool2",
                                        "workerpool3"}
        tf = json.loads(env["TF_CONFIG"])
        assert set(tf["cluster"]) == {"chief", "worker", "ps"}  # never "evaluator"
        assert env["AIP_MODEL_DIR"] == "gs://e2e-bucket/run-7/model/"
        assert env["AIP_CHECKPOINT_DIR"] == "gs://e2e-bucket/run-7/checkpoints/"
        assert env["AIP_TENSORBOARD_LOG_DIR"] == "gs://e2e-bucket/run-7/logs/"
        assert env["WORLD_SIZE"] == "3"  # pools 0 and 1 train
        assert env["CUDA_VISIBLE_DEVICES"] == ""  # no accelerators asked: none visible
    assert [env_of(e2e, n).get("RANK") for n in names] == ["0", "1", "2", None, None]
    assert json.loads(env_of(e2e, "workerpool3-0")["TF_CONFIG"])["task"]["type"] == "evaluator"
    assert json.loads(env_of(e2e, "workerpool2-0")["TF_CONFIG"])["task"]["type"] == "ps"


def test_environment_of_a_single_replica_job(e2e: E2E) -> None:
    e2e.monkeypatch.setenv("RESILIENT_TRAIN_GPUS", "4")
    e2e.monkeypatch.chdir(e2e.tmp)   # and a relative --job-dir
    e2e.monkeypatch.setenv("OMP_NUM_THREADS", "7")   # the user's choice wins over our share
    code = ("import os, json, sys; sys.path.insert(0, os.environ['E2E_WORKERS']); "
            "os.chdir('/'); import _common; _common.mark('env', env=dict(os.environ))")
    status = cli.main(["launch", "--job-dir", "jobs/rel", "--gpus-per-worker", "4", "--", PY,
                       "-c", code])
    e2e.capsys.readouterr()
    rec = read_job(e2e.tmp / "jobs" / "rel")
    assert (status, rec["state"]) == (0, "JOB_STATE_SUCCEEDED")
    env = env_of(e2e, PRIMARY)
    # Local paths are absolute, so a worker that changes directory still finds them.
    assert env["AIP_CHECKPOINT_DIR"].endswith("/checkpoints/")
    job_dir = (e2e.tmp / "jobs" / "rel").resolve()
    assert Path(env["AIP_CHECKPOINT_DIR"]) == job_dir / "output" / "checkpoints"
    assert Path(env["RESILIENT_TRAIN_JOB_DIR"]) == job_dir
    assert "TF_CONFIG" not in env  # single-replica jobs get none
    assert json.loads(env["CLUSTER_SPEC"])["cluster"] == {
        "workerpool0": [f"127.0.0.1:{rec['job_spec']['master_port']}"]}
    assert (env["RANK"], env["WORLD_SIZE"]) == ("0", "1")
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert env["OMP_NUM_THREADS"] == "7"


@pytest.fixture(autouse=True)
def _workers_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("E2E_WORKERS", str(WORKERS))


def test_kill_chaos_restarts_the_worker_with_rising_restart_count(e2e: E2E) -> None:
    e2e.primary_waits_for("workerpool1-0.a1.r2.env")
    status, rec, out = e2e.launch("--workers", "2",
                                  "--chaos", "kill:workerpool1-0@0.5s,kill:1@1.2s",
                                  script="dump_env.py")
    assert (status, rec["state"], rec["error"]) == (0, "JOB_STATE_SUCCEEDED", None)
    assert len(rec["attempts"]) == 1
    killed = replica(rec, "workerpool1-0")
    assert killed["restarts"] == 2 and killed["uncounted_restarts"] == 0
    assert killed["exit_codes"][:2] == [137, 137]
    assert replica(rec, PRIMARY) == {"status": "exited", "restarts": 0,
                                     "uncounted_restarts": 0, "peer_restarts": 0,
                                     "maintenance_restarts": 0, "exit_codes": [0]}
    messages = event_messages(rec)
    assert messages.count("chaos: kill on workerpool1-0") == 2
    assert "workerpool1-0: exited with status 137 (node_loss)" in messages
    assert "workerpool1-0: restarting (restart 2 in this job)" in messages
    assert rec["budgets"]["worker_restarts"]["used"] == 2
    # Each life sees its own restart count; the replica keeps its name and rank.
    lives = e2e.files("workerpool1-0.a1.r*.env")
    failures = e2e.job_dir() / "telemetry" / "failures.json"
    assert "workerpool1-0.a1.r2.env" in [p.name for p in lives]
    for path in lives:
        env = json.loads(path.read_text())["env"]
        restart = path.name.split(".")[2][1:]
        assert env["TORCHELASTIC_RESTART_COUNT"] == env["RESILIENT_TRAIN_RESTART_COUNT"] == restart
        assert (env["RANK"], env["RESILIENT_TRAIN_REPLICA"]) == ("1", "workerpool1-0")
        # Each life reports its progress to its own telemetry files (goodput accounting),
        assert env["RESILIENT_TRAIN_TELEMETRY"].endswith(
            f"telemetry/attempt-1/workerpool1-0.restart-{restart}")
        # and every life learns the job's observed MTBF by one channel, the failure log.
        assert env["RESILIENT_TRAIN_FAILURES_FILE"] == str(failures)
        assert "RESILIENT_TRAIN_OBSERVED_MTBF_S" not in env
    mtbf = ObservedMtbf(failures).at(time.time())
    assert json.loads(failures.read_text())["failures"] == 2 and mtbf is not None and mtbf > 0
    assert [p.name for p in e2e.files("workerpool0-0.*.env")] == ["workerpool0-0.a1.r0.env"]
    assert "chaos: kill on workerpool1-0" in out


def test_secrets_reach_the_worker_but_no_file_of_the_job(e2e: E2E) -> None:
    """Tokens on the command line and the job's secret variable: the worker gets them as
    given; job.json and the report record the command with the values masked."""
    e2e.monkeypatch.setenv("RESILIENT_TRAIN_JOB_SECRET", "job-secret-" + uuid.uuid4().hex)
    e2e.monkeypatch.setenv("HF_TOKEN", "hf-" + uuid.uuid4().hex)
    e2e.primary_waits_for("workerpool0-0.a1.r0.env")
    args = ["--token=tok-1a2b3c", "--api-key", "key-4d5e6f", "DB_PASSWORD=pw-7a8b9c",
            "--keep-last", "3"]
    status, rec, out = e2e.launch(script="dump_env.py", script_args=tuple(args))
    assert status == 0
    assert rec["job_spec"]["command"][2:] == ["--token=***", "--api-key", "***",
                                              "DB_PASSWORD=***", "--keep-last", "3"]
    assert cli.main(["report", str(e2e.job_dir())]) == 0
    e2e.capsys.readouterr()
    page = (e2e.job_dir() / "report.html").read_text()
    assert "--token=*** --api-key *** DB_PASSWORD=*** --keep-last 3" in page
    env = env_of(e2e, PRIMARY)
    secrets = ["tok-1a2b3c", "key-4d5e6f", "pw-7a8b9c", env["HF_TOKEN"],
               env["RESILIENT_TRAIN_JOB_SECRET"]]   # (the launcher may set its own)
    for path in e2e.job_dir().rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            leaked = [s for s in secrets if s.encode() in data]
            assert not leaked, f"{path} holds {leaked}"
    assert not any(s in out for s in secrets)   # nor the launcher's output


# --------------------------------------------------------------------------- outcomes

def test_primary_success_stops_a_hanging_worker(e2e: E2E) -> None:
    e2e.primary_waits_for("workerpool1-0.a1.r0.ready")
    status, rec, _ = e2e.launch("--workers", "2", script="hang.py")
    assert (status, rec["state"], rec["error"], rec["exit_status"]) == (
        0, "JOB_STATE_SUCCEEDED", None, 0)
    assert replica(rec, PRIMARY)["exit_codes"] == [0]
    assert replica(rec, "workerpool1-0") == {"status": "stopped", "restarts": 0,
                                             "uncounted_restarts": 0, "peer_restarts": 0,
                                             "maintenance_restarts": 0, "exit_codes": [143]}
    assert "stopping workerpool1-0 (succeeded)" in event_messages(rec)
    assert rec["attempts"][0]["result"] == "succeeded"
    assert rec["start_time"] and rec["end_time"]


def test_start_jitter_delays_each_worker_by_its_seeded_amount(e2e: E2E) -> None:
    import random

    e2e.primary_waits_for("workerpool1-0.a1.r0.ready", "workerpool1-1.a1.r0.ready")
    status, rec, _ = e2e.launch("--workers", "3", "--start-jitter", "1.5s", "--seed", "7",
                                script="hang.py")
    assert (status, rec["state"]) == (0, "JOB_STATE_SUCCEEDED")
    rng = random.Random(7)   # the launcher draws one delay per worker, in rank order
    delays = {name: rng.uniform(0, 1.5) for name in (PRIMARY, "workerpool1-0", "workerpool1-1")}
    pending = event_time(rec, "JOB_STATE_PENDING")
    started = {name: event_time(rec, f"{name}: started") for name in delays}
    for name, delay in delays.items():
        assert started[name] - pending >= delay - 0.01, (name, started, delays)
    # Workers start in the order of their delays, not in rank order; RUNNING waits for all.
    assert sorted(started, key=started.__getitem__) == sorted(delays, key=delays.__getitem__)
    assert event_time(rec, "JOB_STATE_RUNNING") >= max(started.values())


def test_a_bug_fails_the_job_at_once_with_the_traceback(e2e: E2E) -> None:
    status, rec, _ = e2e.launch("--workers", "2", script="raise_bug.py",
                                script_args=("workerpool1-0",))
    assert (status, rec["state"]) == (1, "JOB_STATE_FAILED")
    assert rec["error"]["code"] == 3
    first, *excerpt = rec["error"]["message"].splitlines()
    assert first == ("The replica workerpool1-0 exited with a non-zero status of 1. "
                     "Termination reason: Error.")
    assert excerpt[0].startswith("Traceback (most recent call last)")
    assert excerpt[-1] == "ValueError: e2e bug: learning rate 'fast' is not a number"
    assert any("load_config" in line for line in excerpt)
    assert len(rec["attempts"]) == 1
    assert replica(rec, "workerpool1-0")["exit_codes"] == [1]
    assert replica(rec, "workerpool1-0")["restarts"] == 0
    assert replica(rec, PRIMARY)["status"] == "stopped"
    assert rec["budgets"]["job_retries"]["used"] == 0
    assert rec["attempts"][0]["result"] == "failed: user-code-error"


def test_an_accelerator_oom_fails_the_job_as_out_of_memory(e2e: E2E) -> None:
    # The worker's report says "oom" (torch.OutOfMemoryError): the job fails at once with
    # the platform's OOM message, and the traceback says which device and how much.
    status, rec, _ = e2e.launch("--workers", "2", script="cuda_oom.py",
                                script_args=("workerpool1-0",))
    assert (status, rec["state"]) == (137, "JOB_STATE_FAILED")
    first, *excerpt = rec["error"]["message"].splitlines()
    assert first == ("The replica workerpool1-0 ran out of memory and exited with a non-zero "
                     "status of 1.")
    assert excerpt[-1].startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to "
                                  "allocate 20.00 GiB")
    assert len(rec["attempts"]) == 1
    assert replica(rec, "workerpool1-0")["restarts"] == 0


def test_exit_134_retries_the_job_three_times_then_fails(e2e: E2E) -> None:
    status, rec, _ = e2e.launch(script="exit_code.py", script_args=("134",))
    assert (status, rec["state"]) == (134, "JOB_STATE_FAILED")
    assert rec["error"] == {
        "code": 3, "message": "The replica workerpool0-0 exited with a non-zero status of "
                              "134. Termination reason: Error."}
    assert [a["attempt"] for a in rec["attempts"]] == [1, 2, 3, 4]
    assert [a["result"] for a in rec["attempts"]] == [
        "retry: transient-exit-code"] * 3 + ["failed: transient-exit-code"]
    assert all(a["replicas"][PRIMARY]["exit_codes"] == [134] for a in rec["attempts"])
    assert rec["budgets"]["job_retries"] == {"limit": 3, "scope": "job", "used": 3}
    # Each attempt ran the user's code afresh; as under torchrun, a whole-job retry
    # counts as a restart too (TORCHELASTIC_RESTART_COUNT rises with every new life).
    assert [p.name for p in e2e.files("workerpool0-0.a*.ready")] == [
        f"workerpool0-0.a{i}.r{i - 1}.ready" for i in (1, 2, 3, 4)]


def test_a_command_that_cannot_start_is_a_start_error(e2e: E2E) -> None:
    # A name the replica's PATH resolves (a path is checked before the job starts).
    command = f"no-such-trainer-{uuid.uuid4().hex[:8]}"
    reason = "No such file or directory"
    status, rec, out = e2e.launch(script=[command, "--lr", "1"])
    assert (status, rec["state"]) == (128, "JOB_STATE_FAILED")
    assert rec["error"] == {
        "code": 3,
        "message": "The replica workerpool0-0 exited with a non-zero status of 128. "
                   f"Termination reason: StartError.\ncannot start {command!r}: {reason}"}
    assert len(rec["attempts"]) == 1
    assert f"cannot start {command!r}" in out


@pytest.mark.parametrize(("command", "missing", "hint"), [
    # A typo: found before the job starts, not under a replica's long path once it ran.
    ([PY, "examples/trian_demo.py", "--steps", "2"], "examples/trian_demo.py",
     "did you mean examples/train_demo.py?"),
    (["python3", "-u", "-W", "ignore", "-X", "dev", "missing.py"], "missing.py", None),
    ([PY, "-O", "--", "gone/train.py"], "gone/train.py", None),
    (["./train.sh", "--lr", "1"], "./train.sh", None),
], ids=["python-typo", "python3-options", "after-dashes", "program-path"])
def test_a_missing_script_is_refused_before_the_job_starts(
        tmp_path: Path, command: list[str], missing: str, hint: str | None) -> None:
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "train_demo.py").write_text("")
    job_dir = tmp_path / "job"
    result = subprocess.run(
        [PY, "-m", "resilient_train.cli", "launch", "--job-dir", str(job_dir), "--", *command],
        capture_output=True, text=True, timeout=WAIT_S, cwd=tmp_path, check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    err = result.stderr
    assert err.startswith("resilient-train launch: error: "), err
    assert f"{missing} does not exist" in err, err                  # the file, as given
    assert f"resolved against {tmp_path}" in err, err               # and where it was looked for
    assert hint is None or hint in err, err
    assert "Traceback" not in err
    assert not job_dir.exists()


def test_a_script_not_there_at_launch_is_refused_from_a_job_spec_too(tmp_path: Path) -> None:
    """A spec's command runs on this host, in each replica's working directory: a view of
    the one the launch started in, so a relative script is looked for there."""
    spec = tmp_path / "spec.yaml"
    spec.write_text("workerPoolSpecs:\n- machineSpec: {machineType: n1-standard-4}\n"
                    "  replicaCount: 1\n  containerSpec:\n    imageUri: local/x:1\n"
                    f"    command: [{PY}, trainer/task.py]\n")
    result = subprocess.run(
        [PY, "-m", "resilient_train.cli", "launch", "--job-spec", str(spec), "--job-dir",
         str(tmp_path / "job")], capture_output=True, text=True, timeout=WAIT_S,
        cwd=tmp_path, check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "trainer/task.py does not exist" in result.stderr, result.stderr
    assert f"resolved against {tmp_path}" in result.stderr
    assert not (tmp_path / "job").exists()


@pytest.mark.parametrize("command", [
    [PY, "-c", "pass"], [PY, "-m", "json.tool", "--help"], [PY, "-W", "ignore", "-c", "pass"],
    ["true"], ["sh", "-c", "exit 0"]])
def test_what_the_launcher_cannot_check_still_runs(e2e: E2E, command: list[str]) -> None:
    status, rec, _ = e2e.launch(script=command)
    assert (status, rec["state"]) == (0, "JOB_STATE_SUCCEEDED")


def test_a_job_wide_fault_during_a_retry_hits_the_next_attempt(e2e: E2E) -> None:
    # The stockout is due while attempt 1 is still being stopped (its workers ignore SIGTERM
    # for the whole grace period): it must hit attempt 2, not vanish.
    e2e.primary_waits_for("workerpool0-0.a3.*.ready")
    status, rec, _ = e2e.launch("--grace", "1.5s", "--chaos", "internal@0.5s,stockout@1s",
                                script="ignore_term.py")
    assert (status, rec["state"]) == (0, "JOB_STATE_SUCCEEDED")
    assert [a["result"] for a in rec["attempts"]] == [
        "retry: internal-error", "retry: stockout", "succeeded"]


def test_maintenance_restarts_the_worker_without_counting(e2e: E2E) -> None:
    e2e.primary_waits_for("workerpool1-0.a1.r1.ready")
    status, rec, _ = e2e.launch("--workers", "2", "--chaos", "maintenance:workerpool1-0@0.3s/2s",
                                script="hang.py")
    assert (status, rec["state"]) == (0, "JOB_STATE_SUCCEEDED")
    r = replica(rec, "workerpool1-0")
    assert (r["restarts"], r["uncounted_restarts"]) == (0, 1)
    assert r["exit_codes"][0] == 143  # SIGTERM first, as a VM shutdown does
    assert rec["budgets"]["worker_restarts"]["used"] == 0
    assert "workerpool1-0: restart_worker (maintenance)" in event_messages(rec)


def test_sigterm_goes_to_the_main_process_only_so_a_dataloader_survives_it(e2e: E2E) -> None:
    # As the platform signals the container's PID 1: had the DataLoader's worker processes
    # been terminated too, the loop would fail mid-step (exit 1) instead of leaving cleanly.
    e2e.primary_waits_for("workerpool1-0.a1.r1.ready")
    # At 20 s: at 9 s, a start on loaded cores (torch's import, the loader's two workers)
    # once had no batch yet when the SIGTERM came.
    status, rec, _ = e2e.launch("--workers", "2", "--chaos", "maintenance:workerpool1-0@20s/5s",
                                script="loader_on_sigterm.py")
    assert (status, rec["state"]) == (0, "JOB_STATE_SUCCEEDED")
    fault = next(e for e in rec["events"] if e["kind"] == "fault")
    iterating = e2e.read("workerpool1-0.a1.r0.iterating")["time"]
    assert iterating < _epoch(fault["time"])   # the batches flowed when SIGTERM came
    assert replica(rec, "workerpool1-0")["exit_codes"][0] == 134


def _epoch(iso: str) -> float:
    import datetime
    return datetime.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def test_real_allocation_over_the_memory_limit_is_oom(e2e: E2E) -> None:
    status, rec, _ = e2e.launch("--memory-limit", "200MiB", script="alloc.py",
                                script_args=("512",))
    assert (status, rec["state"]) == (137, "JOB_STATE_FAILED")
    assert rec["error"] == {
        "code": 3, "message": "The replica workerpool0-0 ran out of memory and exited with a "
                              "non-zero status of 137."}
    assert any("workerpool0-0: out of memory" in m and "limit 200 MiB" in m
               for m in event_messages(rec))
    assert len(rec["attempts"]) == 1  # permanent: no retry
    assert not e2e.files("*.allocated")  # killed before it could hold 512 MiB


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_worker_killed_from_outside_is_a_node_loss_and_restarts(e2e: E2E, sig: int) -> None:
    # Rule 7: a worker killed from outside (not by the launcher, not by its own crash) is an
    # infrastructure fault, restarted in place with the same name; not a bug (user-code-error).
    e2e.primary_waits_for("workerpool1-0.a1.r1.ready")
    proc, out = e2e.spawn("--workers", "2")
    victim = e2e.wait_file("workerpool1-0.a1.r0.ready")
    os.kill(victim["pid"], sig)
    assert proc.wait(timeout=90) == 0, out.read_text()
    rec = read_job(e2e.job_dir())
    assert rec["state"] == "JOB_STATE_SUCCEEDED"
    assert replica(rec, "workerpool1-0")["restarts"] == 1
    assert replica(rec, "workerpool1-0")["exit_codes"][0] == 128 + sig
    assert len(rec["attempts"]) == 1
    name = signal.Signals(sig).name
    assert any(f"workerpool1-0: killed by {name} from outside the launcher" in m
               for m in event_messages(rec))
    # A failure of the job: the live failure log (for the auto checkpoint interval) says so.
    log = json.loads((e2e.job_dir() / "telemetry" / "failures.json").read_text())
    assert log["failures"] == 1


def test_pages_shared_by_forked_processes_count_once_against_the_limit(e2e: E2E) -> None:
    # DataLoader workers share the parent's memory copy-on-write: a sum of RSS counts it
    # once per process (here 4 x 150 MiB > 300 MiB), a container's limit once.
    status, rec, _ = e2e.launch("--memory-limit", "300MiB", script="fork_shared.py",
                                script_args=("150", "3", "2"))
    forked = e2e.read("workerpool0-0.a1.r0.forked")
    assert forked["rss_sum"] > 300 * 2**20 > forked["pss_sum"]
    assert (status, rec["state"]) == (0, "JOB_STATE_SUCCEEDED")
    assert not any("out of memory" in m for m in event_messages(rec))


def test_timeout_stops_a_hanging_job(e2e: E2E) -> None:
    status, rec, _ = e2e.launch("--timeout", "2s", script="hang.py")
    assert (status, rec["state"]) == (124, "JOB_STATE_FAILED")
    assert rec["error"] == {"code": 4,
                            "message": "The job ran longer than its timeout of 2 s and was stopped."}
    # Event times are recorded to the millisecond: 2.006 - 0.006 is 1.9999999999999998.
    assert 2.0 - 0.0015 <= event_time(rec, "timeout of 2 s reached") - event_time(
        rec, "JOB_STATE_RUNNING") < 4.0


def test_a_worker_ignoring_sigterm_is_killed_after_the_grace_period(e2e: E2E) -> None:
    e2e.primary_waits_for("workerpool1-0.a1.r0.ready")
    status, rec, out = e2e.launch("--workers", "2", "--grace", "0.7s", script="ignore_term.py")
    assert (status, rec["state"]) == (0, "JOB_STATE_SUCCEEDED")
    assert replica(rec, "workerpool1-0")["exit_codes"] == [137]
    waited = event_time(rec, "workerpool1-0: stopped") - event_time(rec, "stopping workerpool1-0")
    assert 0.6 <= waited < 5.0
    assert any(line.endswith("[launcher] workerpool1-0: grace period over, SIGKILL")
               and line[:8].count(":") == 2 for line in out.splitlines())  # HH:MM:SS first
    assert "workerpool1-0: grace period over, SIGKILL" in event_messages(rec)


@pytest.mark.parametrize("setsid", [False, True], ids=["same-group", "own-session"])
def test_a_grandchild_ignoring_sigterm_is_killed(e2e: E2E, setsid: bool) -> None:
    e2e.primary_waits_for("workerpool1-0.a1.r0.parent")
    status, rec, _ = e2e.launch("--workers", "2", "--grace", "0.5s",
                                script="grandchild_ignores_term.py",
                                script_args=("--setsid",) if setsid else ())
    assert (status, rec["state"]) == (0, "JOB_STATE_SUCCEEDED")
    assert not alive(e2e.read("workerpool1-0.a1.r0.grandchild")["pid"])
    # (the fixture also checks that nothing with this test's marker is left)


def test_a_daemon_left_by_a_finished_worker_dies_with_that_worker_life(e2e: E2E) -> None:
    """A worker exits 0 (done) leaving a grandchild in its own session: like a container's
    processes, it must not outlive its worker, not just the job."""
    e2e.primary_waits_for("release")
    proc, _ = e2e.spawn("--workers", "2", script="grandchild_ignores_term.py",
                        script_args=("--setsid", "--exit", "0"))
    try:
        grandchild = e2e.wait_file("workerpool1-0.a1.r0.grandchild")["pid"]
        wait_until(lambda: not alive(grandchild),
                   "the finished worker's daemon to be killed")
        assert proc.poll() is None  # the job is still running
        (e2e.ready / "release").write_text("")
        assert proc.wait(timeout=WAIT_S) == 0
    finally:
        proc.kill()
        proc.wait()
    rec = read_job(e2e.job_dir())
    assert replica(rec, "workerpool1-0") == {"status": "done", "restarts": 0,
                                             "uncounted_restarts": 0, "peer_restarts": 0,
                                             "maintenance_restarts": 0, "exit_codes": [0]}


def test_a_launcher_failure_stops_the_workers_and_records_an_internal_error(
        e2e: E2E, monkeypatch: pytest.MonkeyPatch) -> None:
    original = runner.Launcher._inject_faults

    def broken(self: runner.Launcher, now: float) -> None:
        if e2e.files("*.parent") and len(e2e.files("*.parent")) == 2:
            raise RuntimeError("e2e: the launcher broke")
        original(self, now)

    monkeypatch.setattr(runner.Launcher, "_inject_faults", broken)
    status, rec, out = e2e.launch("--workers", "2", script="grandchild_ignores_term.py")
    assert (status, rec["state"]) == (70, "JOB_STATE_FAILED")
    assert rec["error"] == {"code": 13,
                            "message": "Internal error occurred for the current attempt."}
    assert "internal error: RuntimeError('e2e: the launcher broke')" in out
    # (the fixture checks that the workers and their grandchildren are gone)


# --------------------------------------------------------------------------- the launcher process

@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "SIGHUP", "SIGINT-twice"])
def test_a_signal_to_the_launcher_cancels_the_job(e2e: E2E, how: str) -> None:
    # Twice: the workers ignore SIGTERM and the grace period is long; the second Ctrl-C
    # kills them at once. SIGHUP: the launcher's terminal closed.
    twice = how == "SIGINT-twice"
    sig = signal.SIGINT if twice else getattr(signal, how)
    started = time.monotonic()
    proc, out = e2e.spawn("--workers", "2", "--grace", "60s" if twice else "5s",
                          script="ignore_term.py" if twice else "hang.py")
    try:
        e2e.wait_file("workerpool0-0.a1.r0.ready")
        e2e.wait_file("workerpool1-0.a1.r0.ready")
        proc.send_signal(sig)
        if twice:
            wait_until(lambda: read_job(e2e.job_dir())["state"] == "JOB_STATE_CANCELLING",
                       "the job to be CANCELLING")
            proc.send_signal(sig)
        assert proc.wait(timeout=WAIT_S) == 130
    finally:
        proc.kill()
        proc.wait()
    assert time.monotonic() - started < 40  # never the 60 s grace period
    rec = read_job(e2e.job_dir())
    assert rec["state"] == "JOB_STATE_CANCELLED"
    assert rec["error"] == {"code": 1, "message": "The job was cancelled."}
    states = [e["state"] for e in rec["events"] if e["kind"] == "state"]
    assert states[-2:] == ["JOB_STATE_CANCELLING", "JOB_STATE_CANCELLED"]
    codes = {replica(rec, n)["exit_codes"][-1] for n in (PRIMARY, "workerpool1-0")}
    assert codes == ({137} if twice else {143})
    assert replica(rec, PRIMARY)["status"] == "stopped"
    # Said as it happened: what asked (a Ctrl-C is the user's interrupt), and that the
    # workers got SIGTERM from the launcher, which their own lines then name.
    cause = {"SIGINT": "your interrupt (SIGINT)", "SIGTERM": "a SIGTERM to the launcher",
             "SIGHUP": "the terminal closing (SIGHUP)"}[sig.name]
    lines = out.read_text().splitlines()
    assert any(ln.endswith(f"[launcher] {cause}: cancelling the job: each worker gets "
                           f"SIGTERM, as on the platform (again to kill at once)")
               for ln in lines), lines
    passed = "SIGTERM, then SIGKILL at the second" if twice else "SIGTERM"
    assert lines[-1].startswith("job record: ") and lines[-2] == (
        f"the job was cancelled by {cause}, which the launcher passed to its workers as "
        f"{passed}: a worker's line that says SIGTERM is this"), lines[-3:]


@pytest.mark.parametrize("setsid", [False, True], ids=["same-group", "own-session"])
def test_sigkilled_launcher_leaves_no_workers(e2e: E2E, setsid: bool) -> None:
    proc, _ = e2e.spawn("--workers", "2", script="grandchild_ignores_term.py",
                        script_args=("--setsid",) if setsid else ())
    try:
        e2e.wait_file("workerpool0-0.a1.r0.parent")
        e2e.wait_file("workerpool1-0.a1.r0.parent")
        assert len(marked_processes(e2e.marker)) >= 4  # two workers, two grandchildren
        proc.kill()
        proc.wait(timeout=WAIT_S)
    finally:
        proc.kill()
        proc.wait()
    # The fixture waits (with a deadline) until no process with the marker is left.
    # The record still says RUNNING; `status` tells a person it is stale.
    assert cli.main(["status", str(e2e.job_dir())]) == 0
    out = e2e.capsys.readouterr().out
    assert "JOB_STATE_RUNNING  (stale: its launcher is no longer running" in out


def recorded_pids(job_dir: Path) -> set[int]:
    """The pids in the launcher's record of its workers' process trees."""
    try:
        text = (job_dir / "processes.log").read_text()
    except FileNotFoundError:
        return set()
    return {int(parts[3]) for parts in map(str.split, text.splitlines()) if len(parts) == 5}


@pytest.mark.parametrize("double_fork", [False, True], ids=["setsid-child", "double-fork"])
def test_sigkilled_launcher_kills_a_daemon_with_a_clean_environment(
        e2e: E2E, double_fork: bool) -> None:
    """A daemon that left the worker's session and exec'd with an empty environment has
    nothing a scan by environment could find: the watchdog kills it by the process tree
    the launcher recorded. Double-forked, its parent exits at once; the worker (a child
    subreaper, like a container's PID 1) adopts it, so it is still in the tree."""
    proc, _ = e2e.spawn(script="clean_daemon.py",
                        script_args=("--double-fork",) if double_fork else ())
    daemon: psutil.Process | None = None
    try:
        mark = e2e.wait_file(f"{PRIMARY}.a1.r0.daemon")
        daemon = psutil.Process(mark["daemon"])
        wait_until(lambda: daemon.name() == "sleep", "the daemon to exec sleep")
        assert daemon.environ() == {}
        assert os.getsid(daemon.pid) != os.getsid(mark["pid"])   # not the worker's session
        assert daemon.ppid() == mark["pid"]   # adopted, when double-forked
        wait_until(lambda: daemon.pid in recorded_pids(e2e.job_dir()),
                   "the launcher to record the daemon")
        proc.kill()
        proc.wait(timeout=WAIT_S)
        wait_until(lambda: not alive(daemon.pid) or not daemon.is_running(),
                   "the watchdog to kill the daemon", ORPHAN_WAIT_S)
    finally:
        proc.kill()
        proc.wait()
        if daemon is not None and daemon.is_running():
            daemon.kill()


def test_the_job_directory_records_every_worker_process(e2e: E2E) -> None:
    e2e.primary_waits_for("workerpool1-0.a1.r0.parent")
    status, rec, _ = e2e.launch("--workers", "2", script="grandchild_ignores_term.py")
    assert (status, rec["state"]) == (0, "JOB_STATE_SUCCEEDED")
    worker = e2e.read("workerpool1-0.a1.r0.parent")
    assert {worker["pid"], worker["child"]} <= recorded_pids(e2e.job_dir())


# --------------------------------------------------------------------------- quota

def test_a_job_waits_in_queued_while_another_holds_the_gpus(e2e: E2E) -> None:
    e2e.monkeypatch.setenv("RESILIENT_TRAIN_GPUS", "4")
    # Job A takes all four GPUs; its primary finishes once the test drops "release".
    code = ("import os, sys; sys.path.insert(0, os.environ['E2E_WORKERS']); "
            "import _common; _common.mark(); _common.wait_for(['release'])")
    holder, _ = e2e.spawn("--gpus-per-worker", "4", name="holder", script=[PY, "-c", code])
    waiter = None
    try:
        e2e.wait_file("workerpool0-0.a1.r0.ready")
        e2e.primary_waits_for("workerpool1-0.a1.r0.env")
        waiter, waiter_out = e2e.spawn("--workers", "2", "--gpus-per-worker", "2",
                                       name="waiter", script="dump_env.py")
        wait_until(lambda: "queued: the quota is in use by" in waiter_out.read_text(),
                   "the second job to report that it is queued")
        rec = read_job(e2e.job_dir("waiter"))
        assert rec["state"] == "JOB_STATE_QUEUED" and rec["attempts"] == []
        assert "e2e-holder" in waiter_out.read_text()
        (e2e.ready / "release").write_text("")
        assert holder.wait(timeout=WAIT_S) == 0
        # Job B then runs: both its replicas start with the freed GPUs.
        env0 = e2e.wait_file("workerpool0-0.a1.r0.env")["env"]
        env1 = e2e.wait_file("workerpool1-0.a1.r0.env")["env"]
        assert {env0["CUDA_VISIBLE_DEVICES"], env1["CUDA_VISIBLE_DEVICES"]} == {"0,1", "2,3"}
        assert waiter.wait(timeout=WAIT_S) == 0
    finally:
        for p in (holder, waiter):
            if p is not None:
                p.kill()
                p.wait()
    rec = read_job(e2e.job_dir("waiter"))
    states = [e["state"] for e in rec["events"] if e["kind"] == "state"]
    assert states[:3] == ["JOB_STATE_QUEUED", "JOB_STATE_PENDING", "JOB_STATE_RUNNING"]
    assert read_job(e2e.job_dir("holder"))["end_time"] <= rec["attempts"][0]["start_time"]


def test_more_gpus_than_exist_is_a_stockout_after_retries(e2e: E2E) -> None:
    e2e.monkeypatch.setenv("RESILIENT_TRAIN_GPUS", "4")
    status, rec, _ = e2e.launch("--workers", "2", "--gpus-per-worker", "4", script="hang.py")
    assert (status, rec["state"]) == (69, "JOB_STATE_FAILED")
    assert rec["error"] == {"code": 8, "message": STOCKOUT_MESSAGE}
    assert rec["budgets"]["job_retries"]["used"] == 3
    assert not e2e.files("*.ready")  # no worker ever started


def test_flex_start_waits_for_capacity_then_fails(e2e: E2E) -> None:
    e2e.monkeypatch.setenv("RESILIENT_TRAIN_GPUS", "4")
    started = time.monotonic()
    status, rec, _ = e2e.launch("--gpus-per-worker", "8", "--strategy", "flex-start",
                                "--max-wait", "1s", script="hang.py")
    assert time.monotonic() - started >= 1.0
    assert (status, rec["state"]) == (69, "JOB_STATE_FAILED")
    assert rec["error"] == {"code": 8, "message": STOCKOUT_MESSAGE}
    assert 1.0 <= event_time(rec, "JOB_STATE_FAILED") < 5.0
    assert not e2e.files("*.ready")


# --------------------------------------------------------------------------- bad input

def _bad(e2e: E2E, tmp: Path, case: str) -> tuple[list[str], str]:
    job = str(tmp / "bad-job")
    if case == "chaos-kind":
        return ["--chaos", "explode@1s", "--job-dir", job], "unknown fault kind 'explode'"
    if case == "chaos-target":
        return (["--workers", "2", "--chaos", "kill:workerpool1-5@1s", "--job-dir", job],
                "workerpool1-5")
    if case == "chaos-rank":
        return ["--workers", "2", "--chaos", "kill:7@1s", "--job-dir", job], "rank 7"
    if case == "job-dir-under-file":
        (tmp / "plain-file").write_text("")
        return (["--job-dir", str(tmp / "plain-file" / "job")],
                (f"--job-dir {tmp}/plain-file/job: its parent {tmp}/plain-file is a file, not "
                 f"a directory; pass the path of a directory (it is created if missing)"))
    if case == "job-dir-is-a-file":
        (tmp / "plain-file").write_text("")
        return (["--job-dir", str(tmp / "plain-file")],
                (f"--job-dir {tmp}/plain-file is a file, not a directory; pass the path of a "
                 f"directory (it is created if missing)"))
    if case == "output-dir-under-file":
        (tmp / "plain-file").write_text("")
        return (["--job-dir", job, "--output-dir", str(tmp / "plain-file" / "out")],
                (f"--output-dir {tmp}/plain-file/out: its parent {tmp}/plain-file is a file, "
                 "not a directory; pass the path of a directory (it is created if missing)"))
    if case == "job-dir-taken":
        (tmp / "taken").mkdir()
        (tmp / "taken" / "job.json").write_text("{}")
        return ["--job-dir", str(tmp / "taken")], "already holds a job (job.json)"
    if case == "policy-action":
        policy = tmp / "policy.json"
        policy.write_text(json.dumps({"rules": [{"match": {"exit_codes": [1]},
                                                 "actions": ["explode"]}]}))
        return ["--policy", str(policy), "--job-dir", job], "unknown action 'explode'"
    if case == "policy-missing":
        return (["--policy", str(tmp / "nope.json"), "--job-dir", job],
                "nope.json' does not exist")
    if case == "workers-0":
        return ["--workers", "0", "--job-dir", job], "--workers must be at least 1, found 0"
    if case == "pool-without-primary":
        return (["--pool", "workerpool1=2", "--job-dir", job],
                "workerpool0 must have exactly one replica")
    if case == "quota-dir-under-file":
        (tmp / "plain-file").write_text("")
        e2e.monkeypatch.setenv("RESILIENT_TRAIN_QUOTA_DIR", str(tmp / "plain-file" / "quota"))
        return ["--job-dir", job], "cannot use the quota directory"
    if case == "negative-gpus":
        return ["--gpus-per-worker", "-1", "--job-dir", job], "non-negative"
    if case == "workers-and-pool":
        return (["--workers", "2", "--pool", "workerpool0=1", "--job-dir", job],
                "either --workers or --pool")
    if case == "memory-0":
        return ["--memory-limit", "0", "--job-dir", job], "--memory-limit must be more than 0"
    if case == "max-wait-standard":
        return ["--max-wait", "5s", "--job-dir", job], "--max-wait applies to --strategy flex-start"
    if case == "name-with-slash":
        return ["--name", "a/b", "--job-dir", job], "a job name is letters, digits"
    raise AssertionError(case)


@pytest.mark.parametrize("case", [
    "chaos-kind", "chaos-target", "chaos-rank", "job-dir-under-file", "job-dir-is-a-file",
    "output-dir-under-file", "job-dir-taken",
    "policy-action", "policy-missing", "workers-0", "pool-without-primary", "workers-and-pool",
    "quota-dir-under-file", "negative-gpus", "memory-0", "max-wait-standard",
    "name-with-slash"])
def test_bad_input_is_a_clear_usage_error(e2e: E2E, case: str) -> None:
    args, fragment = _bad(e2e, e2e.tmp, case)
    status = cli.main(["launch", *args, "--", PY, str(WORKERS / "hang.py")])
    out = e2e.capsys.readouterr()
    assert status == 2
    assert out.err.startswith("resilient-train launch: error: ")
    assert fragment in out.err
    assert not e2e.files("*.ready")  # nothing ran
    assert not (e2e.tmp / "bad-job").exists()  # a refused job leaves no directory behind


@pytest.mark.parametrize("pool", ["workerpool1", "workerpool9=1", "pool0=1", "workerpool1=x"])
def test_malformed_pool_is_a_usage_error(e2e: E2E, pool: str) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["launch", "--pool", pool, "--job-dir", str(e2e.tmp / "j"), "--", "true"])
    assert exc.value.code == 2
    err = e2e.capsys.readouterr().err
    assert "expected POOL=COUNT" in err and repr(pool) in err


@pytest.mark.parametrize(("option", "value", "expected"), [
    ("--grace", "abc", "expected a duration like 500ms, 20s"),
    ("--timeout", "-5s", "expected a duration like 500ms, 20s"),
    ("--memory-limit", "12XB", "expected a memory size like 512M")])
def test_malformed_duration_or_size_says_what_is_expected(e2e: E2E, option: str, value: str,
                                                          expected: str) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["launch", f"{option}={value}", "--job-dir", str(e2e.tmp / "j"), "--", "true"])
    assert exc.value.code == 2
    err = e2e.capsys.readouterr().err
    assert f"argument {option}: {expected}" in err and repr(value) in err


INFINITE = "9" * 400   # a number of seconds float() reads as infinity


@pytest.mark.parametrize(("args", "fragment"), [
    # No time between SIGTERM and SIGKILL: every worker exited 1 on its grace variable.
    (["launch", "--grace", "0"], "--grace: a grace period is more than 0 s and at most 8760h"),
    (["launch", "--grace=0ms"], "--grace: a grace period is more than 0 s and at most 8760h"),
    (["launch", "--grace", INFINITE], "--grace: a grace period is more than 0 s and at most"),
    (["launch", "--grace", "9000h"], "--grace: a grace period is more than 0 s and at most"),
    (["launch", "--timeout", INFINITE + "h"], "--timeout: a duration is at most 8760h"),
    (["launch", "--start-jitter", INFINITE], "--start-jitter: a duration is at most 8760h"),
    (["launch", "--strategy", "flex-start", "--max-wait", INFINITE],
     "--max-wait: a duration is at most 8760h"),
    (["spawn", "--stop-grace", "0"], "--stop-grace: a grace period is more than 0 s"),
    (["spawn", "--stop-grace", INFINITE], "--stop-grace: a grace period is more than 0 s"),
    (["status", "projects/p/locations/r/customJobs/1", "--follow", "--interval", "0"],
     "--interval: an interval is more than 0 s and at most 8760h"),
], ids=["grace-0", "grace-0ms", "grace-inf", "grace-9000h", "timeout-inf", "jitter-inf",
        "max-wait-inf", "stop-grace-0", "stop-grace-inf", "interval-0"])
def test_a_duration_out_of_its_range_is_refused_when_parsed(tmp_path: Path, args: list[str],
                                                            fragment: str) -> None:
    """The range is checked as the command line is parsed (exit 2, the range named), not
    found by the workers once the job has started."""
    job_dir = tmp_path / "j"
    command = {"launch": [*args, "--job-dir", str(job_dir), "--", PY, "-c", "pass"],
               "spawn": [*args, "--", PY, "-c", "pass"]}.get(args[0], args)
    result = subprocess.run(
        [PY, "-m", "resilient_train.cli", *command],
        capture_output=True, text=True, timeout=WAIT_S, cwd=tmp_path, check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    assert fragment in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not job_dir.exists()   # nothing ran, nothing was written


def test_bad_input_through_the_real_cli_process(e2e: E2E) -> None:
    result = subprocess.run(
        [PY, "-m", "resilient_train.cli.main", "launch", "--chaos", "kill:workerpool3-0@1s",
         "--job-dir", str(e2e.tmp / "j"), "--", PY, "-c", "pass"],
        capture_output=True, text=True, timeout=WAIT_S, cwd=REPO, check=False)
    assert result.returncode == 2
    assert "workerpool3-0" in result.stderr and "Traceback" not in result.stderr


# --------------------------------------------------------------------------- status

def test_status_prints_state_attempts_and_error(e2e: E2E) -> None:
    status, _, _ = e2e.launch("--workers", "2", script="exit_code.py",
                              script_args=("3", "workerpool1-0"))
    assert status == 3
    result = subprocess.run([PY, "-m", "resilient_train.cli.main", "status", str(e2e.job_dir())],
                            capture_output=True, text=True, timeout=WAIT_S, cwd=REPO, check=False)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "state     JOB_STATE_FAILED" in text
    assert ("error     code 3: The replica workerpool1-0 exited with a non-zero status of 3. "
            "Termination reason: Error.") in text
    assert "attempt 1:" in text and "failed: user-code-error" in text
    assert "workerpool1-0" in text and "exit codes 3" in text
    assert cli.main(["status", "--json", str(e2e.job_dir())]) == 0
    assert json.loads(e2e.capsys.readouterr().out)["state"] == "JOB_STATE_FAILED"


def test_status_of_a_missing_job_dir_fails_clearly(e2e: E2E) -> None:
    missing = e2e.tmp / "never-ran"
    assert cli.main(["status", str(missing)]) == 2
    err = e2e.capsys.readouterr().err
    assert err.startswith("resilient-train status: error: no job record at ")
    assert str(missing) in err


def test_a_gs_output_without_credentials_is_refused_before_anything_starts(
        tmp_path: Path) -> None:
    """No credentials and no emulator: every write under the gs:// output would fail
    (where the network is down, only after minutes of retries per attempt). The launch
    is refused at once, naming the fixes, and leaves no job directory."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST")}
    # No gcloud configuration, and not a GCE VM's metadata server (CI may run on one).
    env.update(HOME=str(tmp_path), CLOUDSDK_CONFIG=str(tmp_path / "gcloud"),
               NO_GCE_CHECK="true", RESILIENT_TRAIN_QUOTA_DIR=str(tmp_path / "quota"))
    job_dir = tmp_path / "job"
    done = subprocess.run(
        [sys.executable, "-m", "resilient_train.cli.main", "launch", "--job-dir", str(job_dir),
         "--output-dir", "gs://e2e-bucket/run", "--", sys.executable, "-c", "pass"],
        env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert ("the job's outputs and checkpoints go to gs://e2e-bucket/run, but this machine "
            "has no Google Cloud credentials") in done.stderr
    assert "gcloud auth application-default login" in done.stderr
    assert "--output-dir DIR to keep this run local" in done.stderr
    assert not job_dir.exists()


def test_the_credentials_check_passes_quietly_where_there_are_credentials(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """google.auth's own lines (no project id in an authorized-user file) would read as
    the launcher's: the check keeps them out of the output."""
    from resilient_train.launcher.workerenv import gcs_credentials_problem

    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(fake_user_credentials(tmp_path)))
    for var in ("GOOGLE_CLOUD_PROJECT", "GCLOUD_PROJECT", "CLOUDSDK_CORE_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    with caplog.at_level(logging.DEBUG):
        assert gcs_credentials_problem("gs://e2e-bucket/run", {}) is None
    assert [r.getMessage() for r in caplog.records if r.name.startswith("google.auth")
            and r.levelno >= logging.WARNING] == []
    assert gcs_credentials_problem("gs://e2e-bucket/run",
                                   {"STORAGE_EMULATOR_HOST": "http://127.0.0.1:1"}) is None
    assert gcs_credentials_problem(str(tmp_path), {}) is None
