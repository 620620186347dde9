"""``launch --preload``: worker lives forked from a process that imported torch once
(launcher/preload.py, launcher/forkserver.py) see what a new ``python SCRIPT`` process
would, restart, fail and leave as one; a life the server cannot fork starts as a new
process, and so does every life when the modules cannot be imported."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from resilient_train.cli import main as cli
from resilient_train.launcher.preload import PRELOAD_SERVER_ENV, Preloader, read_at_start

PROBE = Path(__file__).resolve().parent / "workers" / "preload_probe.py"


def command(tmp: Path, workers: int, preload: str, *args: str,
            python_options: tuple[str, ...] = ()) -> list[str]:
    """A launch of the probe, its lives writing what they saw to ``tmp/seen``."""
    (tmp / "seen").mkdir(parents=True, exist_ok=True)
    return [sys.executable, "-m", "resilient_train.cli.main", "launch", "--workers",
            str(workers), "--job-dir", str(tmp / "job"), "--preload", preload, "--",
            sys.executable, *python_options, str(PROBE), str(tmp / "seen"), *args]


def launch(tmp: Path, workers: int, preload: str, *args: str,
           python_options: tuple[str, ...] = (), env: dict[str, str] | None = None
           ) -> tuple[int, str, dict[str, Any]]:
    """Run the probe under a launcher process: its status, output and job record."""
    proc = subprocess.run(
        command(tmp, workers, preload, *args, python_options=python_options),
        env=dict(os.environ, RESILIENT_TRAIN_QUOTA_DIR=str(tmp / "quota"), **(env or {})),
        cwd=tmp, capture_output=True, text=True, timeout=300, check=False)
    out = proc.stdout + proc.stderr
    return proc.returncode, out, json.loads((tmp / "job" / "job.json").read_text())


def seen(tmp: Path) -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in (tmp / "seen").glob("*.json")}


@pytest.mark.slow
def test_forked_lives_see_a_new_process_and_restart_as_one(tmp_path: Path) -> None:
    status, out, job = launch(tmp_path, 2, "torch,torch._dynamo", "--die-once")
    assert status == 0, out[-3000:]
    assert job["attempts"][0]["replicas"]["workerpool1-0"]["restarts"] == 1, out[-3000:]
    lives = seen(tmp_path)
    assert set(lives) == {"workerpool0-0.r0", "workerpool1-0.r0", "workerpool1-0.r1"}
    for name, life in lives.items():
        replica = name.split(".")[0]
        assert life["preloaded"] is True, name               # torch came with the fork
        assert life["argv"] == [str(PROBE), str(tmp_path / "seen"), "--die-once"], name
        assert life["path0"] == str(PROBE.parent) and life["name"] == "__main__", name
        assert replica in Path(life["cwd"]).parts, name      # the replica's own directory
        assert life["tmp"] == life["TMPDIR"] and replica in life["TMPDIR"], name
        assert life["session_leader"] and life["stdin"] == "", name
        assert life["threads"] == int(life["omp"]), name     # its own OMP_NUM_THREADS
        assert f"[{replica}] probe {replica} restart {name[-1]} preloaded=True" in out
    assert [lives[n]["rank"] for n in sorted(lives)] == ["0", "1", "1"]
    # Each life draws Python's and NumPy's seeds anew, as a new process does; torch's
    # default generator starts from its fixed seed in each, as in a new process.
    assert len({life["random"] for life in lives.values()}) == 3
    assert len({life["numpy"] for life in lives.values()}) == 3
    assert len({life["torch"] for life in lives.values()}) == 1


@pytest.fixture
def shared_server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``resilient-train preload-server`` (torch imported), for the launches of 2-replica
    jobs, and its socket's path."""
    folder = tempfile.mkdtemp(prefix="rt-shared-")   # short: a socket path has a limit
    path = os.path.join(folder, "s.sock")
    server = subprocess.Popen([sys.executable, "-m", "resilient_train.cli.main",
                               "preload-server", path, "--replicas", "2"])
    try:
        yield server, path
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_launches_share_a_listening_server_when_it_fits_them(
        tmp_path: Path, shared_server: tuple[subprocess.Popen[bytes], str]) -> None:
    server, path = shared_server
    shared = {PRELOAD_SERVER_ENV: path}
    for name in ("a", "b"):   # one after the other: both fork from the one server
        status, out, _ = launch(tmp_path / name, 2, "torch", env=shared)
        assert status == 0, out[-3000:]
        lives = seen(tmp_path / name)
        assert set(lives) == {"workerpool0-0.r0", "workerpool1-0.r0"}, lives
        for life in lives.values():
            assert life["ppid"] == server.pid and life["preloaded"] is True, life
            assert life["threads"] == int(life["omp"]), life
    # A start-up variable the server was not started with: a server of its own.
    status, out, _ = launch(tmp_path / "c", 2, "torch", env={**shared, "PYTHONHASHSEED": "7"})
    assert status == 0, out[-3000:]
    for life in seen(tmp_path / "c").values():   # (the other misfits: the test below)
        assert life["preloaded"] is True and life["ppid"] != server.pid, life
    # A launcher that dies takes its lives on the shared server with it.
    launcher = subprocess.Popen(command(tmp_path / "e", 2, "torch", "--sleep"),
                                env=dict(os.environ, **shared), cwd=tmp_path / "e",
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        first = tmp_path / "e" / "seen" / "workerpool0-0.r0.json"
        deadline = time.monotonic() + 120
        while not first.exists() and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        life = json.loads(first.read_text())
        assert life["ppid"] == server.pid, life
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.monotonic() + 30
    while Path(f"/proc/{life['pid']}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{life['pid']}").exists()
    assert server.poll() is None   # and the server serves on
    again = subprocess.run([sys.executable, "-m", "resilient_train.cli.main",
                            "preload-server", path], capture_output=True, text=True)
    assert (again.returncode, again.stderr.strip()) == (
        2, f"resilient-train preload-server: a server already listens at {path}")


@pytest.mark.slow
def test_an_uncaught_exception_in_a_forked_life_fails_the_job_with_its_traceback(
        tmp_path: Path) -> None:
    status, out, job = launch(tmp_path, 1, "torch", "--bug")
    assert status == 1, out[-3000:]
    assert job["state"] == "JOB_STATE_FAILED" and job["error"]["code"] == 3
    message = job["error"]["message"].splitlines()
    assert message[-1] == "ValueError: a bug in the probe", message
    assert any("preload_probe.py" in line and "in main" in line for line in message), message
    assert seen(tmp_path)["workerpool0-0.r0"]["preloaded"] is True


@pytest.mark.slow
def test_modules_that_cannot_be_imported_leave_every_life_a_new_process(
        tmp_path: Path) -> None:
    status, out, _ = launch(tmp_path, 1, "torch,no_such_module_here")
    assert status == 0, out[-3000:]
    assert ("cannot preload torch, no_such_module_here: ModuleNotFoundError: No module "
            "named 'no_such_module_here'; worker lives start as new processes from now on"
            ) in out, out[-3000:]
    assert seen(tmp_path)["workerpool0-0.r0"]["preloaded"] is False


def test_only_a_plain_python_script_with_the_start_up_environment_is_forked() -> None:
    preloader = Preloader(("torch",), {})
    py = sys.executable
    assert preloader.can_fork([py, "train.py", "--steps", "3"], {})
    assert preloader.can_fork(["python3", "train.py"], {})
    assert not preloader.can_fork([py, "-u", "train.py"], {})        # interpreter options
    assert not preloader.can_fork([py, "-m", "pkg.train"], {})
    assert not preloader.can_fork(["bash", "run.sh"], {})
    assert not preloader.can_fork([py], {})
    env = {"OMP_NUM_THREADS": "2", "PYTHONPATH": "/src", "LD_PRELOAD": "x.so", "RANK": "1",
           "CLUSTER_SPEC": "{}", "TORCH_LOGS": "dynamo", "LANG": "C.UTF-8"}
    assert read_at_start(env) == {"OMP_NUM_THREADS": "2", "PYTHONPATH": "/src",
                                  "LD_PRELOAD": "x.so", "TORCH_LOGS": "dynamo",
                                  "LANG": "C.UTF-8"}


def test_a_shared_server_fits_a_launch_only_as_a_server_of_its_own_would() -> None:
    py = sys.executable
    preloader = Preloader(("torch", "json"), {}, shared="/nowhere/server.sock")
    env = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1", "RANK": "0"}
    preloader._program, preloader._at_start = py, read_at_start(env)
    hello = {"ready": True, "program": py, "modules": ["torch", "json"],
             "env": {**env, "RANK": "3", "CLUSTER_SPEC": "{}"}}   # not read at start
    assert preloader.misfit(hello) is None
    assert preloader.misfit({**hello, "modules": ["torch"]}) == "it has not imported json"
    assert preloader.misfit({**hello, "program": "/opt/py"}) == f"it runs /opt/py, not {py}"
    assert preloader.misfit({**hello, "env": {**env, "OMP_NUM_THREADS": "4",
                                              "PYTHONHASHSEED": "7"}}) == (
        "its start-up environment differs in OMP_NUM_THREADS, PYTHONHASHSEED")
    assert preloader.misfit({"ready": False, "error": "ImportError: x"}) == (
        "it could not import its modules: ImportError: x")


@pytest.mark.parametrize("text", ["torch,", "torch,,numpy", "torch;numpy", "1torch"])
def test_a_malformed_preload_list_is_refused_before_the_job(
        text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["launch", "--preload", text, "--", sys.executable, str(PROBE)])
    assert exc.value.code == 2
    assert "expected module names separated by commas, e.g. torch,torch._dynamo" in \
        capsys.readouterr().err
