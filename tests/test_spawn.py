"""``resilient-train spawn``: a replica's processes with torchrun's variables and no agent
rendezvous, so that a restarted first machine rejoins the job (under torchrun its new
agent waited for agents that never came back: the job hung).

The environment is computed from the replica's own; the supervision (signals passed on,
the others stopped when one fails, the failed one's status) is checked on real processes;
and a 2x2 job under the launcher loses its first machine to a maintenance move and
recovers from the other machine's memory.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from jobs import assert_same_end, launch_job, the_recovery

from resilient_train.cluster import cluster_spec_json
from resilient_train.spawn.agent import SpawnError, count_gpus, parse_nproc, process_envs

HERE = Path(__file__).resolve().parent
CLUSTER = {"workerpool0": ["h0:2222"], "workerpool1": ["h1:2222"],
           "workerpool3": ["h3:2222"]}


def _machine(pool: str, index: int, **extra: str) -> dict[str, str]:
    """A replica's environment as the launcher gives it (the platform's, plus torchrun's)."""
    return {"CLUSTER_SPEC": cluster_spec_json(CLUSTER, pool, index), "PATH": "/bin",
            **extra}


def test_each_process_gets_its_rank_in_the_whole_job() -> None:
    envs = process_envs(_machine("workerpool1", 0, RANK="1", GROUP_RANK="1", WORLD_SIZE="2",
                                 MASTER_ADDR="10.0.0.2", MASTER_PORT="2222",
                                 LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                                 TORCHELASTIC_USE_AGENT_STORE="True"), 2)
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    assert [tuple(e[k] for k in keys) for e in envs] == [
        ("2", "0", "4", "2", "1", "2", "10.0.0.2", "2222"),
        ("3", "1", "4", "2", "1", "2", "10.0.0.2", "2222")]
    # torchrun's agent store is not there to use; the user's variables pass through.
    assert all("TORCHELASTIC_USE_AGENT_STORE" not in e and e["PATH"] == "/bin" for e in envs)
    assert {e["OMP_NUM_THREADS"] for e in envs} == {"1"}
    # Each process writes its own error report where it is told to.
    reported = process_envs(_machine("workerpool0", 0), 2, [Path("/r/0"), Path("/r/1")])
    assert [e["TORCHELASTIC_ERROR_FILE"] for e in reported] == ["/r/0", "/r/1"]


def test_the_cluster_spec_alone_places_the_replica() -> None:
    # A custom container gets CLUSTER_SPEC and no RANK: the primary pool comes first.
    [env] = process_envs(_machine("workerpool1", 0), 1)
    assert (env["RANK"], env["WORLD_SIZE"], env["GROUP_RANK"]) == ("1", "2", "1")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("h0", "2222")
    assert "OMP_NUM_THREADS" not in env   # one process: the machine's cores are its own


@pytest.mark.parametrize(("env", "says"), [
    (_machine("workerpool0", 0, LOCAL_WORLD_SIZE="2", LOCAL_RANK="1", RANK="1",
              WORLD_SIZE="2"), "instead of torchrun"),
    (_machine("workerpool3", 0), "not a training replica"),
    ({"CLUSTER_SPEC": "{not json"}, "place in the job"),
])
def test_a_replica_spawn_cannot_place_is_refused_saying_why(env: dict[str, str],
                                                           says: str) -> None:
    with pytest.raises(SpawnError, match=says):
        process_envs(env, 2)


def test_nproc_is_a_number_or_the_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_nproc("3") == 3
    assert parse_nproc("auto", gpus=0) == 1 and parse_nproc("auto", gpus=8) == 8
    assert parse_nproc("gpu", gpus=4) == 4
    with pytest.raises(SpawnError, match="shows no GPU"):
        parse_nproc("gpu", gpus=0)
    for bad in ("0", "-1", "two"):
        with pytest.raises(SpawnError, match="positive number"):
            parse_nproc(bad)
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert count_gpus(tmp_path) == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    assert count_gpus(tmp_path) == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert count_gpus(tmp_path) == 0


def test_a_survivor_under_torchrun_says_a_lost_first_machine_may_not_come_back() -> None:
    from resilient_train.distributed.group import store_gone_message

    plain = store_gone_message("workerpool1-0", "10.0.0.2:2222", "workerpool0-0", 0)
    assert plain.endswith("waiting for it to come back"), plain
    assert store_gone_message("workerpool1-0", "h:1", "workerpool0-0", 1) == \
        plain.replace("10.0.0.2:2222", "h:1")   # torchrun on one machine: nothing to add
    hint = store_gone_message("workerpool1-0/local0", "h:1", "workerpool0-0/local0", 2)
    assert "waits for the other machines' agents" in hint
    assert "resilient-train spawn --nproc-per-node N" in hint


# --- supervision, on real processes -----------------------------------------------------------

CHILD = textwrap.dedent("""
    import json, os, signal, sys, time
    from pathlib import Path
    out, local = Path(sys.argv[1]), os.environ["LOCAL_RANK"]
    behaviour = json.loads(sys.argv[2])[int(local)]

    def on_term(signum, frame):
        (out / f"term-{local}").touch()
        if behaviour != "ignore-term":
            sys.exit(134)   # as an emergency save ends
    signal.signal(signal.SIGTERM, on_term)
    (out / f"env-{local}").write_text(json.dumps(dict(os.environ)))
    if behaviour.startswith("exit"):
        # Once every process listens for SIGTERM: one that does not yet would die of it.
        while len(list(out.glob("env-*"))) < int(os.environ["LOCAL_WORLD_SIZE"]):
            time.sleep(0.01)
        sys.exit(int(behaviour[4:]))
    while True:
        time.sleep(0.05)
""")


def _spawn(tmp_path: Path, behaviours: list[str], *extra: str) -> subprocess.Popen[str]:
    (tmp_path / "child.py").write_text(CHILD)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="29999")
    for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "CLUSTER_SPEC", "TF_CONFIG"):
        env.pop(k, None)
    return subprocess.Popen(
        [sys.executable, "-m", "resilient_train.cli.main", "spawn", "--nproc-per-node",
         str(len(behaviours)), *extra, "--", sys.executable, str(tmp_path / "child.py"),
         str(tmp_path), json.dumps(behaviours)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(paths: list[Path], proc: subprocess.Popen[str], within: float = 60) -> None:
    deadline = time.monotonic() + within
    while not all(p.exists() for p in paths):
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, [p.name for p in paths if not p.exists()]
        time.sleep(0.05)


def test_a_failed_process_stops_the_others_and_its_status_is_spawns(tmp_path: Path) -> None:
    proc = _spawn(tmp_path, ["run", "exit3"])
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 3, out
    assert (tmp_path / "term-0").exists(), out      # the survivor was told to stop
    assert "local process 1 exited 3: stopping the other 1" in out
    assert "local process 0 exited 134" in out
    env = json.loads((tmp_path / "env-1").read_text())
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("1", "1", "2")


def test_a_sigterm_is_passed_on_and_the_emergency_exit_is_kept(tmp_path: Path) -> None:
    proc = _spawn(tmp_path, ["run", "run"])
    _wait_for([tmp_path / "env-0", tmp_path / "env-1"], proc)
    proc.send_signal(signal.SIGTERM)   # the platform signals the container's first process
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 134, out   # torchrun made it 1
    assert (tmp_path / "term-0").exists() and (tmp_path / "term-1").exists(), out
    assert "SIGTERM: passing it on to 2 processes" in out


def test_a_process_deaf_to_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    proc = _spawn(tmp_path, ["ignore-term", "exit5"], "--stop-grace", "1")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 5, out
    assert (tmp_path / "term-0").exists(), out
    assert "local process 0 exited 137" in out   # 128 + SIGKILL


PRINTER = textwrap.dedent("""
    import os, sys
    local = os.environ["LOCAL_RANK"]
    for n in range(400):
        print(f"rank {local} line {n} " + "x" * 40)   # text and newline: two writes, unbuffered
    sys.stderr.write(f"warning from rank {local}\\n")
    sys.stdout.write(f"rank {local} progress 50%\\rrank {local} progress 100%\\n")
""")


def test_the_processes_lines_never_mix(tmp_path: Path) -> None:
    """The processes share the replica's output; with PYTHONUNBUFFERED=1 (common in
    images) print() writes a line and its newline apart, and two ranks' lines ran into each
    other. Each line arrives whole, stdout on stdout and stderr on stderr."""
    (tmp_path / "printer.py").write_text(PRINTER)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="29999", PYTHONUNBUFFERED="1")
    done = subprocess.run(
        [sys.executable, "-m", "resilient_train.cli.main", "spawn", "--nproc-per-node", "3", "--",
         sys.executable, str(tmp_path / "printer.py")],
        env=env, capture_output=True, timeout=120, check=False)   # bytes: \r kept
    stdout, stderr = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, stderr
    lines = stdout.split("\n")
    prints = [ln for ln in lines if " line " in ln]
    assert len(prints) == 1200, lines[:5]
    assert all(re.fullmatch(r"rank [012] line \d+ x{40}", ln) for ln in prints), \
        [ln for ln in prints if not re.fullmatch(r"rank [012] line \d+ x{40}", ln)][:3]
    for r in range(3):   # a progress bar's \r-updates pass through as they were
        assert f"rank {r} progress 50%\rrank {r} progress 100%" in lines
        assert f"warning from rank {r}" in stderr.split("\n")
        assert f"warning from rank {r}" not in stdout


def test_without_a_command_spawn_says_how_to_call_it(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "resilient_train.cli.main", "spawn"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "spawn needs a command" in done.stderr, done.stderr
    done = subprocess.run([sys.executable, "-m", "resilient_train.cli.main", "spawn", "--",
                           "no-such-program-here"], capture_output=True, text=True,
                          timeout=60, check=False, env=dict(os.environ, RANK="0",
                                                            WORLD_SIZE="1"))
    assert done.returncode == 2, done.stderr
    assert "cannot run 'no-such-program-here': No such file or directory" in done.stderr


# --- under the launcher ---------------------------------------------------------------------

@pytest.mark.slow
def test_a_first_machine_moved_for_maintenance_rejoins_and_ends_bitwise(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two machines of two processes, FSDP2: the first machine (the primary's, which hosts
    the store) is moved for maintenance. Under torchrun its new agent waited for the other
    machine's agent forever; under spawn it keeps the 134 of the emergency save, every
    process resumes from memory (its shards from the other machine), and the run ends
    bitwise equal to one without faults."""
    monkeypatch.setenv("PEER_DDP_FSDP", "1")
    script = ["-m", "resilient_train.cli.main", "spawn", "--nproc-per-node", "2", "--",
              sys.executable, str(HERE / "workers" / "peer_ddp.py"), "60", "10", "0.03"]
    _, _, clean = launch_job(tmp_path, "clean", 2, [], script)
    job, out, faulted = launch_job(tmp_path, "spawned", 2,
                                   ["--chaos", "maintenance:workerpool0-0@step33"], script)
    assert job["state"] == "JOB_STATE_SUCCEEDED", out[-3000:]
    assert "workerpool0-0: exited with status 134 (maintenance)" in out, out[-3000:]
    recovery = the_recovery(job, out)
    assert [r["rank"] for r in recovery["ranks"]] == [0, 1, 2, 3], recovery
    assert {r["source"] for r in recovery["ranks"]} == {"peer"}, recovery
    assert recovery["steps_lost"] <= 1 and recovery["bytes_read"]["persistent"] == 0, recovery
    assert_same_end(clean, faulted, ranks=4)


@pytest.mark.slow
def test_a_bug_in_one_process_fails_the_job_with_its_own_message(tmp_path: Path) -> None:
    """Each process writes its own error report, and the failed one's becomes the
    replica's: the job record says which bug it was, as with one process per replica."""
    script = ["-m", "resilient_train.cli.main", "spawn", "--nproc-per-node", "2", "--",
              sys.executable, str(HERE.parent / "examples" / "train_charlm.py"),
              "--steps", "50", "--bug-at-step", "5"]
    proc = subprocess.run(
        [sys.executable, "-m", "resilient_train.cli.main", "launch", "--workers", "2",
         "--job-dir", str(tmp_path / "job"), "--", sys.executable, *script],
        env=dict(os.environ, RESILIENT_TRAIN_QUOTA_DIR=str(tmp_path / "quota")),
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    job = json.loads((tmp_path / "job" / "job.json").read_text())
    assert (job["state"], job["error"]["code"]) == ("JOB_STATE_FAILED", 3), out[-3000:]
    assert job["error"]["message"].splitlines()[-1] == (
        "ValueError: a bug at step 5: the tokenizer returned an empty batch"), job["error"]
    assert "local process 1 exited 1: stopping the other 1" in out, out[-3000:]
