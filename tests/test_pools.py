"""Every pool of a job spec runs its own program, env and machine (launcher/programs.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from resilient_train.platform.jobspec import JobSpecError, parse_job_spec
from resilient_train.platform.programs import plan_pools
from resilient_train.platform.resources import memory_limit_for

REDUCTION_SERVER = "us-docker.pkg.dev/vertex-ai-restricted/training/reductionserver:latest"


def _container(command: list[str] | None, image: str = "example.com/train:1",
               machine: str = "n1-standard-4", replicas: int = 1, env: dict[str, str] | None = None,
               **machine_spec: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"imageUri": image}
    if command is not None:
        spec["command"] = command
    if env:
        spec["env"] = [{"name": k, "value": v} for k, v in env.items()]
    return {"replicaCount": replicas, "machineSpec": {"machineType": machine, **machine_spec},
            "containerSpec": spec}


def _plan(body: dict[str, Any], **kw: Any) -> Any:
    args: dict[str, Any] = {"source": "job.yaml", "command": None, "counts": {}, "workers": None,
                            "memory_limit": None, "gpus_per_replica": None, "gpus_available": 0}
    args.update(kw)
    return plan_pools(parse_job_spec(body), **args)


def test_each_pool_gets_its_own_command_env_memory_and_gpus() -> None:
    body = {"workerPoolSpecs": [
        _container(["python", "train.py"], env={"ROLE": "chief"}, machine="g2-standard-8",
                   acceleratorType="NVIDIA_L4", acceleratorCount=1),
        _container(["python", "train.py"], replicas=2, env={"ROLE": "worker"},
                   machine="g2-standard-8", acceleratorType="NVIDIA_L4", acceleratorCount=1),
        _container(["python", "server.py"], machine="n1-highcpu-16"),
        {"replicaCount": 1, "machineSpec": {"machineType": "n1-standard-4"},
         "pythonPackageSpec": {"executorImageUri": "img", "packageUris": ["gs://b/e.tar.gz"],
                               "pythonModule": "evaluate", "args": ["--every", "10"],
                               "env": [{"name": "ROLE", "value": "eval"}]}}]}
    plan = _plan(body, gpus_available=3)
    assert plan.pools == (("workerpool0", 1), ("workerpool1", 2), ("workerpool2", 1),
                          ("workerpool3", 1))
    progs = {p.pool: p for p in plan.programs}
    assert progs["workerpool0"].command == ("python", "train.py")
    assert progs["workerpool2"].command == ("python", "server.py")
    assert progs["workerpool3"].command == ("python", "-m", "evaluate", "--every", "10")
    assert [dict(progs[p].env)["ROLE"] for p in ("workerpool0", "workerpool1", "workerpool3")] \
        == ["chief", "worker", "eval"]
    assert progs["workerpool1"].memory_limit == memory_limit_for("g2-standard-8")
    assert progs["workerpool2"].memory_limit == memory_limit_for("n1-highcpu-16")
    assert [progs[p].gpus_per_replica for p in sorted(progs)] == [1, 1, 0, 0]
    # The machine has 3 GPUs and the training pools want 3: no stockout note.
    assert not any("stockout" in n for n in plan.notes)
    # One line per image, saying its command runs on this host.
    assert any(n.startswith("workerpool0, workerpool1, workerpool2: the image example.com/"
                            "train:1 is not run locally") for n in plan.notes)


def test_the_command_after_the_separator_replaces_the_pools_that_run_the_primarys() -> None:
    body = {"workerPoolSpecs": [_container(["python", "train.py"]),
                                _container(["python", "train.py"], replicas=2),
                                _container(["python", "eval.py"])]}
    plan = _plan(body, command=("python", "mine.py"))
    cmds = {p.pool: p.command for p in plan.programs}
    assert cmds == {"workerpool0": ("python", "mine.py"), "workerpool1": ("python", "mine.py"),
                    "workerpool2": ("python", "eval.py")}
    assert "the command after -- replaces the spec's for workerpool0, workerpool1" in plan.notes


def test_the_reduction_server_image_is_listed_but_not_run() -> None:
    body = {"workerPoolSpecs": [_container(["python", "train.py"]),
                                _container(["python", "train.py"], replicas=3),
                                _container(None, image=REDUCTION_SERVER, replicas=2,
                                           machine="n1-highcpu-16")]}
    plan = _plan(body)
    assert plan.pools == (("workerpool0", 1), ("workerpool1", 3))
    assert plan.listed_only == (("workerpool2", 2),)
    note = next(n for n in plan.notes if "Reduction Server" in n)
    assert "CLUSTER_SPEC lists its 2 replica(s) under workerpool2" in note
    assert "WORLD_SIZE counts workerpool0 and workerpool1 only" in note


def test_a_pool_without_a_command_is_an_error_naming_the_pool_and_the_fix() -> None:
    body = {"workerPoolSpecs": [_container(["python", "train.py"]), {},
                                {}, _container(None, image="example.com/eval:2")]}
    with pytest.raises(JobSpecError) as err:
        _plan(body)
    message = str(err.value)
    assert "workerPoolSpecs[3] (workerpool3) has no command" in message
    assert "example.com/eval:2" in message and "--pool workerpool3=0" in message
    # ... which leaves it out.
    plan = _plan(body, counts={"workerpool3": 0})
    assert plan.pools == (("workerpool0", 1),)
    # A primary without a command needs one after --.
    body = {"workerPoolSpecs": [_container(None)]}
    with pytest.raises(JobSpecError, match="workerPoolSpecs\\[0\\] has no command"):
        _plan(body)
    assert _plan(body, command=("python", "t.py")).programs[0].command == ("python", "t.py")


def test_pool_counts_from_the_command_line_override_the_spec() -> None:
    body = {"workerPoolSpecs": [_container(["python", "train.py"]),
                                _container(["python", "train.py"], replicas=2),
                                _container(["python", "eval.py"])]}
    assert _plan(body, workers=4).pools == (("workerpool0", 1), ("workerpool1", 3),
                                            ("workerpool2", 1))
    assert _plan(body, workers=1).pools == (("workerpool0", 1), ("workerpool2", 1))
    assert _plan(body, counts={"workerpool2": 0, "workerpool1": 1}).pools == (
        ("workerpool0", 1), ("workerpool1", 1))
    # A pool the spec does not have runs the primary's program.
    plan = _plan(body, counts={"workerpool3": 1})
    assert plan.programs[-1].pool == "workerpool3"
    assert plan.programs[-1].command == ("python", "train.py")
    with pytest.raises(JobSpecError, match="workerpool0 \\(the primary\\) must run"):
        _plan(body, counts={"workerpool0": 0})


def test_custom_job_encryption_spec_is_reported_not_silently_dropped() -> None:
    spec = parse_job_spec({"displayName": "x",
                           "encryptionSpec": {"kmsKeyName": "projects/p/keys/k"},
                           "jobSpec": {"workerPoolSpecs": [_container(["python", "t.py"])]}})
    assert any("encryptionSpec (projects/p/keys/k) is not used locally" in n
               for n in spec.notes_for("fields"))


def test_a_four_pool_spec_runs_each_pools_own_program(tmp_path: Path) -> None:
    """Primary and workers train; pool 2 (a reduction server with its own command) and
    pool 3 (an evaluator, a Python module) each run their own program and env."""
    report = textwrap.dedent("""\
        import json, os, sys, time
        spec = json.loads(os.environ["CLUSTER_SPEC"])
        print(f"{sys.argv[1]} task={spec['task']['type']}:{spec['task']['index']} "
              f"rank={os.environ.get('RANK', '-')} world={os.environ['WORLD_SIZE']} "
              f"role={os.environ['ROLE']} pools={sorted(spec['cluster'])}", flush=True)
        if os.environ.get("RANK") == "0":
            time.sleep(1.5)   # the job ends when the primary exits: let the others print
        """)
    (tmp_path / "report.py").write_text(report)
    (tmp_path / "evaluate.py").write_text(
        "import runpy, sys\nsys.argv = ['report.py', 'evaluator']\n"
        "runpy.run_path('report.py', run_name='__main__')\n")
    python = sys.executable
    body = {"workerPoolSpecs": [
        _container([python, "report.py", "trainer"], env={"ROLE": "chief"}),
        _container([python, "report.py", "trainer"], env={"ROLE": "worker"}),
        _container([python, "report.py", "server"], env={"ROLE": "reducer"},
                   machine="n1-highcpu-16"),
        {"replicaCount": 1, "machineSpec": {"machineType": "n1-standard-4"},
         "pythonPackageSpec": {"executorImageUri": "img", "packageUris": ["gs://b/e.tar.gz"],
                               "pythonModule": "evaluate",
                               "env": [{"name": "ROLE", "value": "eval"}]}}],
        "scheduling": {"timeout": "60s"}}
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(body))
    job_dir = tmp_path / "job"
    env = {**os.environ, "RESILIENT_TRAIN_QUOTA_DIR": str(tmp_path / "quota"),
           "RESILIENT_TRAIN_GPUS": "none"}
    proc = subprocess.run(
        [python, "-m", "resilient_train.cli.main", "launch", "--job-spec", str(spec),
         "--job-dir", str(job_dir)],
        check=False, env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    logs = {log.stem: log.read_text() for log in job_dir.glob("logs/*/*.log")}
    pools = "pools=['workerpool0', 'workerpool1', 'workerpool2', 'workerpool3']"
    assert f"trainer task=workerpool0:0 rank=0 world=2 role=chief {pools}" in logs["workerpool0-0"]
    assert f"trainer task=workerpool1:0 rank=1 world=2 role=worker {pools}" in logs["workerpool1-0"]
    assert f"server task=workerpool2:0 rank=- world=2 role=reducer {pools}" in logs["workerpool2-0"]
    assert f"evaluator task=workerpool3:0 rank=- world=2 role=eval {pools}" in logs["workerpool3-0"]
    record = json.loads((job_dir / "job.json").read_text())
    specs = {p["pool"]: p for p in record["job_spec"]["worker_pool_specs"]}
    assert specs["workerpool2"]["memory_limit_bytes"] == memory_limit_for("n1-highcpu-16")
    assert specs["workerpool3"]["command"] == ["python", "-m", "evaluate"]
