"""`resilient-train export`: the tested job as the platform's CustomJob and as a JobSet.

The CustomJob round-trips: what is exported is what `launch --job-spec` runs. The JobSet
validates against the JobSet CRD's published OpenAPI schema (tests/schemas/, read as the
API server reads it) and carries the platform's restart rules in the fields the
documentation names.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from resilient_train.cli import main as cli
from resilient_train.cluster import ClusterInfo
from resilient_train.errors import PLATFORM_TRANSIENT_EXIT_CODES
from resilient_train.platform import export, platformjob
from resilient_train.platform.export import PlatformJob, job_from_record
from resilient_train.platform.jobset import jobset_name
from resilient_train.platform.jobspec import load_job_spec, parse_job_spec
from resilient_train.platform.resources import memory_limit_for
from resilient_train.platform.rules import Strategy

SCHEMA = Path(__file__).resolve().parent / "schemas" / "jobset.x-k8s.io_jobsets.yaml"
IMAGE = "us-central1-docker.pkg.dev/proj/training/charlm:7"
REDUCTION_SERVER = "us-docker.pkg.dev/vertex-ai-restricted/training/reductionserver:latest"
TRANSIENT = sorted(PLATFORM_TRANSIENT_EXIT_CODES)


def _container(command: list[str] | None, env: dict[str, str], image: str = IMAGE
               ) -> dict[str, Any]:
    spec: dict[str, Any] = {"imageUri": image}
    if command is not None:
        spec["command"] = command[:2]
        spec["args"] = command[2:]
    if env:
        spec["env"] = [{"name": k, "value": v} for k, v in env.items()]
    return spec


def four_pool_spec() -> dict[str, Any]:
    """Every pool, GPUs on the workers, env per pool, every scheduling field."""
    train = ["python", "train.py", "--steps", "100"]
    return {
        "workerPoolSpecs": [
            {"replicaCount": 1, "machineSpec": {"machineType": "n1-standard-8"},
             "containerSpec": _container(train, {"RESILIENT_TRAIN_HANG_TIMEOUT_S": "600"})},
            {"replicaCount": 2,
             "machineSpec": {"machineType": "g2-standard-8", "acceleratorType": "NVIDIA_L4",
                             "acceleratorCount": 1},
             "containerSpec": _container(train, {"RESILIENT_TRAIN_HANG_TIMEOUT_S": "600",
                                                 "NCCL_DEBUG": "WARN"})},
            {"replicaCount": 1, "machineSpec": {"machineType": "n1-highcpu-16"},
             "containerSpec": _container(None, {}, REDUCTION_SERVER)},
            {"replicaCount": 1, "machineSpec": {"machineType": "n1-standard-4"},
             "containerSpec": _container(["python", "evaluate.py", "--every", "50"],
                                         {"EVAL_SPLIT": "valid"})},
        ],
        "scheduling": {"timeout": "7200s", "restartJobOnWorkerRestart": True,
                       "disableRetries": False, "strategy": "FLEX_START",
                       "maxWaitDuration": "3600s"},
        "baseOutputDirectory": {"outputUriPrefix": "gs://bucket/charlm"},
    }


@pytest.fixture(autouse=True)
def _eight_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    # Launch options keep a spec's GPUs only where the machine has them: fake enough.
    monkeypatch.setenv("RESILIENT_TRAIN_GPUS", "8")


def _write(path: Path, doc: Any) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _launch_options(argv: list[str]) -> Any:
    args = cli._parser().parse_args(["launch", *argv])
    command = [c for c in args.command if c != "--"]
    spec = load_job_spec(args.job_spec) if args.job_spec else None
    return cli._options(args, tuple(command), spec)[0]


def _export(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = cli.main(["export", *argv])
    out, err = capsys.readouterr()
    return status, out, err


# --- the CustomJob: export -> launch --job-spec -----------------------------------------


def test_a_four_pool_spec_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    original = _write(tmp_path / "four.yaml", four_pool_spec())
    exported = tmp_path / "exported.yaml"
    status, _, err = _export(["--job-spec", str(original), "--name", "rt4", "-o", str(exported)],
                             capsys)
    assert status == 0, err
    # The same spec, field by field: pools (programs, images, env, machines, accelerators),
    # scheduling and output directory.
    want, got = load_job_spec(original), load_job_spec(exported)
    assert replace(got, notes=()) == replace(want, notes=())
    assert got.pool("workerpool1").accelerator_count == 1
    assert dict(got.pool("workerpool3").env) == {"EVAL_SPLIT": "valid"}
    assert got.pool("workerpool2").is_reduction_server
    assert (got.timeout, got.max_wait, got.strategy) == (7200.0, 3600.0, Strategy.FLEX_START)
    # And the same launch: every option launch derives from either file is equal.
    common = ["--name", "rt4", "--job-dir", str(tmp_path / "job")]
    assert (_launch_options(["--job-spec", str(exported), *common])
            == _launch_options(["--job-spec", str(original), *common]))
    assert "export: left out" not in err     # nothing local-only in a spec's job


def test_launch_options_round_trip_through_the_exported_spec(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    options = ["--pool", "workerpool0=1", "--pool", "workerpool1=2", "--pool", "workerpool2=1",
               "--pool", "workerpool3=1", "--machine-type", "n1-standard-8",
               "--gpus-per-worker", "1", "--timeout", "2h", "--strategy", "spot",
               "--restart-job-on-worker-restart", "--output-dir", "gs://bucket/run",
               "--name", "rt4", "--job-dir", str(tmp_path / "job")]
    command = ["--", "python", "train.py", "--steps", "10"]
    exported = tmp_path / "exported.json"
    status, _, err = _export(["--image", IMAGE, "--accelerator-type", "NVIDIA_TESLA_T4",
                              *options, "-o", str(exported), *command], capsys)
    assert status == 0, err
    doc = json.loads(exported.read_text())          # .json: JSON
    spec = parse_job_spec(doc)
    assert spec.pools == (("workerpool0", 1), ("workerpool1", 2), ("workerpool2", 1),
                          ("workerpool3", 1))
    for pool in spec.pool_specs:
        assert pool.command == ("python", "train.py", "--steps", "10")
        assert (pool.image, pool.machine_type) == (IMAGE, "n1-standard-8")
        assert (pool.accelerator_type, pool.accelerator_count) == ("NVIDIA_TESLA_T4", 1)
    assert doc["scheduling"] == {"timeout": "7200s", "restartJobOnWorkerRestart": True,
                                 "disableRetries": False, "strategy": "SPOT"}
    assert spec.output_dir == "gs://bucket/run"
    direct = _launch_options([*options, *command])
    via_spec = _launch_options(["--job-spec", str(exported), "--name", "rt4",
                                "--job-dir", str(tmp_path / "job")])
    assert via_spec.pools == direct.pools and via_spec.command == direct.command
    for pool, _ in direct.pools:
        a, b = direct.program(pool), via_spec.program(pool)
        assert (a.command, a.memory_limit, a.gpus_per_replica) == (
            b.command, b.memory_limit, b.gpus_per_replica)
    assert a.memory_limit == memory_limit_for("n1-standard-8")
    for name in ("strategy", "timeout", "max_wait", "restart_job_on_worker_restart",
                 "output_dir", "policy"):
        assert getattr(via_spec, name) == getattr(direct, name), name


def test_the_custom_job_format_carries_name_and_labels(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = _export(["--image", IMAGE, "--name", "charlm", "--format", "custom-job",
                                "--output-dir", "gs://b/r", "--", "python", "t.py"], capsys)
    assert status == 0, err
    doc = yaml.safe_load(out)
    assert doc["displayName"] == "charlm"
    assert doc["labels"] == {"resilient-train": "export"}
    assert parse_job_spec(doc).pools == (("workerpool0", 1),)   # a whole CustomJob parses
    # No --machine-type: the platform needs one; the default is named.
    assert doc["jobSpec"]["workerPoolSpecs"][0]["machineSpec"] == {"machineType": "n1-standard-4"}
    assert "n1-standard-4 assumed" in err


def test_a_python_package_pool_stays_one(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    body = four_pool_spec()
    body["workerPoolSpecs"][3] = {
        "replicaCount": 1, "machineSpec": {"machineType": "n1-standard-4"},
        "pythonPackageSpec": {"executorImageUri": IMAGE, "packageUris": ["gs://b/ev.tar.gz"],
                              "pythonModule": "trainer.evaluate", "args": ["--every", "50"]}}
    original = _write(tmp_path / "package.yaml", body)
    status, out, err = _export(["--job-spec", str(original), "--name", "p"], capsys)
    assert status == 0, err
    pool = yaml.safe_load(out)["workerPoolSpecs"][3]
    assert pool["pythonPackageSpec"] == body["workerPoolSpecs"][3]["pythonPackageSpec"]
    assert parse_job_spec(yaml.safe_load(out)).pool_specs == load_job_spec(original).pool_specs


# --- what is left out, and what is missing ----------------------------------------------


def test_local_only_options_are_named_in_labels_header_and_notes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"rules": [{"name": "retry-42", "match": {"exit_codes": [42]},
                                             "actions": ["retry_job:job_retries"]}]}))
    argv = ["--image", IMAGE, "--name", "chaotic", "--workers", "2", "--chaos",
            "kill:1@30s,preempt~60sx2", "--policy", str(policy), "--memory-limit", "2GiB",
            "--", "python", "t.py"]
    status, out, err = _export(["--format", "custom-job", *argv], capsys)
    assert status == 0, err
    left = yaml.safe_load(out)["labels"][platformjob.LEFT_OUT_LABEL]
    assert left == "chaos_policy_memory-limit_output-dir"
    assert re.fullmatch(r"[a-z][a-z0-9_-]{0,62}", left)          # a valid label value
    assert "export: left out --chaos kill:1@30s,preempt~60sx2: faults are injected" in err
    assert "export: left out --policy retry-42: the platform applies its own" in err
    assert "export: left out --memory-limit 2GiB" in err
    assert "--output-dir gs://BUCKET/PREFIX" in err
    # The spec format says the same in its header, and how to submit with the label.
    status, out, _ = _export(argv, capsys)
    assert status == 0
    header = [line for line in out.splitlines() if line.startswith("#")]
    assert any("--labels=resilient-train=export,resilient-train-left-out=chaos_policy" in line
               for line in header)
    assert any(line.startswith("#   --chaos kill:1@30s") for line in header)
    assert "chaos" not in json.dumps(yaml.safe_load(out))    # nothing of it in the spec


def test_without_an_image_the_error_names_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = _export(["--workers", "2", "--", "python", "t.py"], capsys)
    assert status == 2 and out == ""
    assert "no container image for workerpool0, workerpool1" in err
    assert "give --image us-central1-docker.pkg.dev/" in err
    # GPUs need their type, as the platform's machineSpec does.
    status, _, err = _export(["--image", IMAGE, "--gpus-per-worker", "1", "--", "python", "t"],
                             capsys)
    assert status == 2 and "give --accelerator-type TYPE" in err
    # A machine type that comes with its GPUs needs nothing more.
    status, out, err = _export(["--image", IMAGE, "--machine-type", "g2-standard-8", "--",
                                "python", "t"], capsys)
    assert status == 0, err
    machine = yaml.safe_load(out)["workerPoolSpecs"][0]["machineSpec"]
    assert machine == {"machineType": "g2-standard-8", "acceleratorType": "NVIDIA_L4",
                       "acceleratorCount": 1}


# --- from a finished job's record -------------------------------------------------------


def _record(tmp_path: Path, argv: list[str], **extra: Any) -> Path:
    """A job directory whose job.json has what the launcher records for ``argv``."""
    options = _launch_options(argv)
    job_dir = tmp_path / "recorded"
    job_dir.mkdir()
    record = {"name": options.job_name, "state": "JOB_STATE_SUCCEEDED",
              "job_spec": {"platform": options.platform_job.to_json(), **extra}}
    (job_dir / "job.json").write_text(json.dumps(record))
    return job_dir


def test_export_from_a_job_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec_file = _write(tmp_path / "four.yaml", four_pool_spec())
    job_dir = _record(tmp_path, ["--job-spec", str(spec_file), "--name", "rec",
                                 "--chaos", "kill:1@5s"])
    out_file = tmp_path / "out.yaml"
    status, _, err = _export(["--from-job", str(job_dir), "-o", str(out_file)], capsys)
    assert status == 0, err
    got, want = load_job_spec(out_file), load_job_spec(spec_file)
    assert got.pool_specs == want.pool_specs
    assert "export: left out --chaos kill:1@5s" in err
    # Other launch options do not apply to a record: they are refused, by name.
    status, _, err = _export(["--from-job", str(job_dir), "--workers", "3"], capsys)
    assert status == 2 and "drop --workers" in err
    # The job's directory where the command goes: no image would be the error; the fix is.
    with pytest.raises(SystemExit) as exc:
        cli.main(["export", str(job_dir)])
    assert exc.value.code == 2
    assert (f"{job_dir} is a job's directory, not a command: resilient-train export "
            f"--from-job {job_dir}") in capsys.readouterr().err


def test_a_record_with_masked_secrets_is_not_exported_with_stars(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    body = four_pool_spec()
    body["workerPoolSpecs"][0]["containerSpec"]["env"].append(
        {"name": "WANDB_API_KEY", "value": "k-123"})
    spec_file = _write(tmp_path / "secret.yaml", body)
    job_dir = _record(tmp_path, ["--job-spec", str(spec_file), "--name", "s"])
    assert "k-123" not in (job_dir / "job.json").read_text()
    status, _, err = _export(["--from-job", str(job_dir)], capsys)
    assert status == 2
    assert "masks secrets (workerpool0 env WANDB_API_KEY)" in err
    assert "Export from the launch's options instead" in err


def test_an_older_record_gives_what_it_has(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    job_dir = tmp_path / "old"
    job_dir.mkdir()
    (job_dir / "job.json").write_text(json.dumps({
        "name": "old-run",
        "job_spec": {"worker_pool_specs": [
            {"pool": "workerpool0", "replica_count": 1, "command": ["python", "t.py"],
             "gpus_per_replica": 0, "memory_limit_bytes": None},
            {"pool": "workerpool1", "replica_count": 2, "command": ["python", "t.py"],
             "gpus_per_replica": 0, "memory_limit_bytes": None}],
            "base_output_directory": "/tmp/out", "master_port": 1},
        "scheduling": {"strategy": "standard", "restart_job_on_worker_restart": False,
                       "timeout_s": 3600.0, "max_wait_duration_s": 86400.0},
        "budgets": {"job_retries": {"limit": 0, "scope": "job", "used": 0}}}))
    status, out, err = _export(["--from-job", str(job_dir), "--image", IMAGE,
                                "--output-dir", "gs://b/old"], capsys)
    assert status == 0, err
    spec = parse_job_spec(yaml.safe_load(out))
    assert spec.pools == (("workerpool0", 1), ("workerpool1", 2))
    assert (spec.timeout, spec.disable_retries, spec.output_dir) == (3600.0, True, "gs://b/old")
    assert "predates job.json's platform section" in err


def test_a_launch_records_the_platform_job_and_export_reads_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job_dir = tmp_path / "job"
    env = {**os.environ, "RESILIENT_TRAIN_QUOTA_DIR": str(tmp_path / "quota"),
           "RESILIENT_TRAIN_GPUS": "none"}
    proc = subprocess.run(
        [sys.executable, "-m", "resilient_train.cli.main", "launch", "--name", "tiny", "--job-dir",
         str(job_dir), "--machine-type", "n1-standard-4", "--quiet", "--",
         sys.executable, "-c", "pass"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    platform = json.loads((job_dir / "job.json").read_text())["job_spec"]["platform"]
    assert platform["pools"][0]["machine_type"] == "n1-standard-4"
    status, out, err = _export(["--from-job", str(job_dir), "--image", IMAGE], capsys)
    assert status == 0, err
    spec = parse_job_spec(yaml.safe_load(out))
    assert spec.command == (sys.executable, "-c", "pass")
    assert spec.machine_type == "n1-standard-4"
    assert "export: left out --output-dir" in err     # the run wrote to its job directory


# --- the JobSet ---------------------------------------------------------------------------


def _as_the_api_server_reads(schema: dict[str, Any]) -> dict[str, Any]:
    """A structural schema as JSON Schema, with the Kubernetes extensions that matter here
    read as the API server reads them (tests/schemas/README.md): no unknown fields, sets
    without duplicates, int-or-string."""
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: _as_the_api_server_reads(v)
                             for k, v in out["properties"].items()}
        if ("additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _as_the_api_server_reads(out["additionalProperties"])
    if isinstance(out.get("items"), dict):
        out["items"] = _as_the_api_server_reads(out["items"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [_as_the_api_server_reads(s) for s in out[key]]
    if out.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


@functools.cache
def jobset_validator() -> jsonschema.Draft4Validator:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)   # 0.8 MB: libyaml when there
    crd = yaml.load(SCHEMA.read_text(encoding="utf-8"), Loader=loader)
    version = crd["spec"]["versions"][0]
    assert (crd["spec"]["group"], version["name"]) == ("jobset.x-k8s.io", "v1alpha2")
    return jsonschema.Draft4Validator(
        _as_the_api_server_reads(version["schema"]["openAPIV3Schema"]))


def _errors(manifest: dict[str, Any]) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in jobset_validator().iter_errors(manifest)]


@pytest.fixture
def four_pool_jobset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[str, dict]:
    spec_file = _write(tmp_path / "four.yaml", four_pool_spec())
    status, out, err = _export(["--job-spec", str(spec_file), "--name", "Charlm_4",
                                "--format", "jobset"], capsys)
    assert status == 0, err
    return out, yaml.safe_load(out)


def test_the_jobset_validates_against_the_crd_schema(four_pool_jobset: tuple[str, dict]) -> None:
    _, manifest = four_pool_jobset
    assert _errors(manifest) == []
    assert (manifest["apiVersion"], manifest["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", manifest["metadata"]["name"])
    # Negative controls: the check can fail.
    broken = json.loads(json.dumps(manifest))
    broken["spec"]["successPolicy"]["operator"] = "Some"
    job = broken["spec"]["replicatedJobs"][1]["template"]["spec"]
    job["backofLimitPerIndex"] = job.pop("backoffLimitPerIndex")            # a typo
    broken["spec"]["replicatedJobs"][0]["replicas"] = "1"
    job["podFailurePolicy"]["rules"][1]["onExitCodes"]["values"] = [134, 134]
    errors = "\n".join(_errors(broken))
    assert "spec.successPolicy.operator: 'Some' is not one of ['All', 'Any']" in errors
    assert "'backofLimitPerIndex' was unexpected" in errors
    assert "spec.replicatedJobs.0.replicas: '1' is not of type 'integer'" in errors
    assert "has non-unique elements" in errors


def test_the_jobset_carries_the_platform_rules(four_pool_jobset: tuple[str, dict]) -> None:
    text, manifest = four_pool_jobset
    spec = manifest["spec"]
    assert spec["successPolicy"] == {"operator": "Any", "targetReplicatedJobs": ["workerpool0"]}
    failure = spec["failurePolicy"]
    assert failure["maxRestarts"] == 3 and failure["restartStrategy"] == "Recreate"
    assert [(r["action"], r["onJobFailureReasons"]) for r in failure["rules"]] == [
        ("FailJobSet", ["PodFailurePolicy"]), ("FailJobSet", ["DeadlineExceeded"]),
        ("RestartJobSet", ["MaxFailedIndexesExceeded", "FailedIndexes",
                           "BackoffLimitExceeded"])]
    assert all(re.fullmatch(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?", r["name"])
               for r in failure["rules"])
    assert spec["network"] == {"enableDNSHostnames": True, "subdomain": "charlm-4",
                               "publishNotReadyAddresses": True}
    jobs = {rj["name"]: rj for rj in spec["replicatedJobs"]}
    assert list(jobs) == ["workerpool0", "workerpool1", "workerpool2", "workerpool3"]
    for name, rj in jobs.items():
        job = rj["template"]["spec"]
        replicas = {"workerpool1": 2}.get(name, 1)
        assert rj["replicas"] == 1
        assert (job["completionMode"], job["completions"], job["parallelism"]) == (
            "Indexed", replicas, replicas)
        assert (job["backoffLimitPerIndex"], job["maxFailedIndexes"]) == (5, 0)
        assert job["activeDeadlineSeconds"] == 7200
        assert job["podFailurePolicy"]["rules"] == [
            {"action": "Count",
             "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            {"action": "FailIndex",
             "onExitCodes": {"containerName": "trainer", "operator": "In",
                             "values": TRANSIENT}},
            {"action": "FailJob",
             "onExitCodes": {"containerName": "trainer", "operator": "NotIn",
                             "values": TRANSIENT}}]
        pod = job["template"]["spec"]
        # The Job API's own rules, which the CRD schema leaves to it.
        assert pod["restartPolicy"] == "Never"          # podFailurePolicy needs it
        assert job["maxFailedIndexes"] <= job["completions"]
        assert [c["name"] for c in pod["containers"]] == ["trainer"]
    workers = jobs["workerpool1"]["template"]["spec"]["template"]["spec"]
    assert workers["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    assert workers["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-l4",
                                       "node.kubernetes.io/instance-type": "g2-standard-8"}
    server = jobs["workerpool2"]["template"]["spec"]["template"]["spec"]["containers"][0]
    assert server["image"] == REDUCTION_SERVER and "command" not in server
    # Comments say what Kubernetes cannot.
    comments = " ".join(line.strip("# ") for line in text.splitlines()
                        if line.lstrip().startswith("#"))
    assert "not the same container restarted in place" in comments
    assert "restartJobOnWorkerRestart" in comments and "maxWaitDuration" in comments


def _pod_env(manifest: dict, pool: str, index: int) -> dict[str, str]:
    """The environment of pod ``index`` of ``pool``, as Kubernetes would give it (the
    downward API's index, $(VAR) expansion, the RANK the command's shell exports)."""
    rj = next(r for r in manifest["spec"]["replicatedJobs"] if r["name"] == pool)
    container = rj["template"]["spec"]["template"]["spec"]["containers"][0]
    env: dict[str, str] = {}
    for var in container["env"]:
        if "valueFrom" in var:
            assert "job-completion-index" in var["valueFrom"]["fieldRef"]["fieldPath"]
            env[var["name"]] = str(index)
        else:
            env[var["name"]] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                                      lambda m: env.get(m.group(1), m.group(0)), var["value"])
    command = container.get("command") or []
    if command[:2] == ["/bin/sh", "-c"]:
        shown = subprocess.run([*command[:3], "printenv", "RANK"],
                               env={**env, "PATH": os.environ.get("PATH", os.defpath)}, text=True,
                               capture_output=True, check=True, timeout=10).stdout
        env["RANK"] = shown.strip()
    return env


def test_each_pod_sees_what_the_platform_gives_its_replica(
        four_pool_jobset: tuple[str, dict]) -> None:
    _, manifest = four_pool_jobset
    ranks = {("workerpool0", 0): 0, ("workerpool1", 0): 1, ("workerpool1", 1): 2,
             ("workerpool2", 0): -1, ("workerpool3", 0): -1}
    for (pool, index), rank in ranks.items():
        env = _pod_env(manifest, pool, index)
        info = ClusterInfo.from_env(env)
        assert (info.rank, info.world_size) == (rank, 3), (pool, index)
        assert (info.pool, info.pool_index) == (pool, index)
        assert info.master_addr == "charlm-4-workerpool0-0-0.charlm-4"
        assert env["AIP_CHECKPOINT_DIR"] == "gs://bucket/charlm/checkpoints/"
        cluster = json.loads(env["CLUSTER_SPEC"])["cluster"]
        assert cluster["workerpool1"] == [f"charlm-4-workerpool1-0-{i}.charlm-4:29500"
                                          for i in range(2)]
    assert _pod_env(manifest, "workerpool1", 1)["NCCL_DEBUG"] == "WARN"   # the pool's env


def test_scheduling_choices_in_the_jobset(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = _export(["--image", IMAGE, "--name", "spot", "--strategy", "spot",
                                "--disable-retries", "--timeout", "0", "--format", "jobset",
                                "--", "python", "t.py"], capsys)
    assert status == 0, err
    manifest = yaml.safe_load(out)
    assert _errors(manifest) == []
    assert manifest["spec"]["failurePolicy"]["maxRestarts"] == 0     # disableRetries
    job = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert "activeDeadlineSeconds" not in job                       # no timeout
    pod = job["template"]["spec"]
    assert pod["nodeSelector"]["cloud.google.com/gke-spot"] == "true"
    assert "--timeout 0" not in out                                 # carried, not left out


def test_names_and_formats() -> None:
    assert jobset_name("Charlm_Run 7!") == "charlm-run-7"
    assert jobset_name("7up") == "rt-7up"
    assert len(jobset_name("x" * 100)) <= 40
    assert cli.EXPORT_FORMATS == export.FORMATS
    job = PlatformJob("j", (export.PlatformPool("workerpool0", 1, ("python", "t.py")),))
    assert PlatformJob.from_json(job.to_json()) == job
    assert job_from_record({"job_spec": {"platform": job.to_json()}}) == job
