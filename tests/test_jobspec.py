"""`resilient-train launch --job-spec`: a Vertex AI CustomJob spec as launcher options.

Every test that reads a spec in this process runs twice: through the platform's own types
(the cloud extra, google-cloud-aiplatform's aiplatform_v1, which CI installs) and through
the launcher's own tables, as on a machine without the extra.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from resilient_train.cli import main as cli
from resilient_train.platform import aiplatform_types as platform_types
from resilient_train.platform.jobspec import JobSpecError, load_job_spec, parse_job_spec
from resilient_train.platform.resources import memory_limit_for
from resilient_train.platform.rules import Strategy

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "platform" / "custom_job.yaml"
SCHEMA_SOURCES = ("aiplatform", "own-tables")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Both ways for the in-process tests; an end-to-end launch (slow) reads it one way.
    if "slow" not in metafunc.definition.keywords:
        metafunc.parametrize("schema_source", SCHEMA_SOURCES, indirect=True)


@pytest.fixture(autouse=True)
def schema_source(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which schema the reader checks against: the extra's types, or its own tables."""
    source = getattr(request, "param", "aiplatform")
    if source == "aiplatform":
        pytest.importorskip("google.cloud.aiplatform_v1")
    else:
        monkeypatch.setattr(platform_types, "available", lambda: False)
    platform_types.known_fields.cache_clear()
    request.addfinalizer(platform_types.known_fields.cache_clear)
    return source


def _pool(replicas: Any = 1, **container: Any) -> dict[str, Any]:
    return {"replicaCount": replicas,
            "machineSpec": {"machineType": "n1-standard-4"},
            "containerSpec": {"imageUri": "example.com/img:1", "command": ["python", "t.py"],
                              **container}}


def _spec(**top: Any) -> dict[str, Any]:
    return {"workerPoolSpecs": [_pool(), _pool(2)], **top}


def test_one_value_where_a_list_goes_is_a_list_of_it_as_gcloud_reads_it() -> None:
    """gcloud's own --config example writes workerPoolSpecs as one pool's fields, not a
    list: gcloud (protorpc's JSON decoding) reads a repeated field given one value as a
    list of it, and so does the launcher, for the pools, command, args, packageUris and
    env; the platform's own types then accept the document too."""
    spec = parse_job_spec({"workerPoolSpecs": {
        "machineSpec": {"machineType": "n1-highmem-2"}, "replicaCount": 1,
        "containerSpec": {"imageUri": "gcr.io/ucaip-test/ucaip-training-test",
                          "command": "start", "args": "--port=8500",
                          "env": {"name": "MODE", "value": "train"}}}})
    assert spec.pools == (("workerpool0", 1),)
    assert spec.command == ("start", "--port=8500")
    assert dict(spec.env) == {"MODE": "train"}
    # An argument may hold spaces; a command that does would be one executable's name.
    assert parse_job_spec(_set(_spec(), "workerPoolSpecs.0.containerSpec.args",
                               "--msg=a b")).command == ("python", "t.py", "--msg=a b")
    with pytest.raises(JobSpecError, match="write one item per argument"):
        parse_job_spec(_set(_spec(), "workerPoolSpecs.0.containerSpec.command", "python t.py"))


# --- the example ------------------------------------------------------------------------


def test_the_example_spec_parses_into_pools_command_env_and_scheduling() -> None:
    spec = load_job_spec(EXAMPLE)
    assert spec.pools == (("workerpool0", 1), ("workerpool1", 1))
    assert spec.command == ("python", "examples/train_charlm.py", "--steps", "2000")
    assert dict(spec.env) == {"RESILIENT_TRAIN_JOIN_TIMEOUT_S": "900",
                              "RESILIENT_TRAIN_HANG_TIMEOUT_S": "600"}
    assert spec.machine_type == "g2-standard-8"
    assert spec.memory_limit == memory_limit_for("g2-standard-8")
    assert (spec.gpus_per_worker, spec.accelerator_type) == (1, "NVIDIA_L4")
    assert spec.output_dir is not None and spec.output_dir.startswith("gs://")
    assert spec.timeout == 7200.0
    assert spec.strategy is Strategy.STANDARD
    assert spec.restart_job_on_worker_restart is False
    assert spec.disable_retries is False
    assert spec.max_wait is None
    # Every pool runs the same command and env, so nothing about them needs saying.
    assert spec.notes_for("command", "env", "gpus", "memory") == []


def test_a_whole_custom_job_in_json_with_string_counts_and_an_empty_pool(tmp_path: Path) -> None:
    body = _spec(scheduling={"strategy": "FLEX_START", "maxWaitDuration": "0s",
                             "disableRetries": True})
    body["workerPoolSpecs"] = [_pool("1"), {}, _pool("3")]   # describe writes int64 as "3"
    body["workerPoolSpecs"][0]["containerSpec"]["args"] = ["--x", "1"]
    body["workerPoolSpecs"][0]["containerSpec"]["env"] = [{"name": "A", "value": "b"}]
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"displayName": "my run", "labels": {"team": "x"},
                                "state": "JOB_STATE_SUCCEEDED", "jobSpec": body}))
    spec = load_job_spec(path)
    assert spec.pools == (("workerpool0", 1), ("workerpool2", 3))
    assert spec.command == ("python", "t.py", "--x", "1")
    assert dict(spec.env) == {"A": "b"}
    assert spec.display_name == "my run"
    assert (spec.strategy, spec.max_wait, spec.disable_retries) == (Strategy.FLEX_START, 0.0, True)
    # Each pool keeps its own program: pool 2 has no args and no env.
    pool2 = spec.pool("workerpool2")
    assert pool2 is not None and pool2.command == ("python", "t.py") and dict(pool2.env) == {}
    assert spec.pool("workerpool1") is None
    # CustomJob labels are not silently dropped; output-only fields (state) are.
    fields = " ".join(spec.notes_for("fields"))
    assert "labels (team=x) are not used locally" in fields and "state" not in fields


def test_python_package_spec_and_ignored_fields_are_reported() -> None:
    body = _spec(network="projects/1/global/networks/n", serviceAccount="sa@x")
    body["workerPoolSpecs"] = [{
        "replicaCount": 1, "machineSpec": {"machineType": "a2-highgpu-1g",
                                           "acceleratorType": "NVIDIA_TESLA_A100",
                                           "acceleratorCount": 1},
        "diskSpec": {"bootDiskSizeGb": 100},
        "pythonPackageSpec": {"executorImageUri": "img", "packageUris": ["gs://b/t.tar.gz"],
                              "pythonModule": "trainer.task", "args": ["--epochs", "3"]}}]
    spec = parse_job_spec(body)
    assert spec.command == ("python", "-m", "trainer.task", "--epochs", "3")
    ignored = " ".join(spec.notes_for("fields"))
    for name in ("network", "serviceAccount", "workerPoolSpecs[0].diskSpec"):
        assert name in ignored
    assert "not installed locally" in " ".join(spec.notes_for("command"))


# --- malformed specs --------------------------------------------------------------------


def _set(body: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of body with the dotted path (list indexes as numbers) set to value."""
    out = copy.deepcopy(body)
    node: Any = out
    parts = [int(p) if p.isdigit() else p for p in path.split(".")]
    for part in parts[:-1]:
        node = node[part]
    node[parts[-1]] = value
    return out


BAD = [
    ("workerPoolSpecs.1.replicaCount", "two",
     'workerPoolSpecs[1].replicaCount: expected an integer, found "two"; write e.g. replicaCount: 2'),
    ("workerPoolSpecs.0.replicaCount", 2,
     "workerPoolSpecs[0].replicaCount: the primary pool must have exactly 1 replica, found 2"),
    ("workerPoolSpecs.1.replicaCount", 0, "workerPoolSpecs[1].replicaCount: must be at least 1"),
    ("workerPoolSpecs.0", {}, "workerPoolSpecs[0]: the primary's pool cannot be empty"),
    ("workerPoolSpecs.1.replicaCout", 1,
     "workerPoolSpecs[1].replicaCout: unknown field; did you mean replicaCount?"),
    ("worker_pool_specs", [],
     ("worker_pool_specs: unknown field; the API's names are camelCase "
      "(gcloud rejects underscores): write workerPoolSpecs")),
    ("scheduling", {"timeout": 3600},
     ('scheduling.timeout: expected a duration in seconds with '
      'an s, as the API writes it (e.g. "3600s" or "1.5s"), found 3600')),
    ("scheduling", {"timeout": "1h"}, 'scheduling.timeout: expected a duration'),
    ("scheduling", {"timeout": "9" * 400 + "s"},
     "scheduling.timeout: a duration is at most 8760h (365 days)"),
    ("scheduling", {"maxWaitDuration": "9" * 400 + "s"},
     "scheduling.maxWaitDuration: a duration is at most 8760h (365 days)"),
    ("scheduling", {"strategy": "spot"},
     'scheduling.strategy: expected one of STANDARD, SPOT, FLEX_START'),
    ("scheduling", {"restartJobOnWorkerRestart": "yes"},
     'scheduling.restartJobOnWorkerRestart: expected true or false, found "yes"'),
    ("workerPoolSpecs.0.containerSpec.args", ["--steps", 2000],
     'workerPoolSpecs[0].containerSpec.args[1]: expected a string, found 2000; quote it: "2000"'),
    ("workerPoolSpecs.0.containerSpec.command", "python t.py",
     ('workerPoolSpecs[0].containerSpec.command: expected a list of strings, found "python t.py"; '
      'write one item per argument, e.g. [python, t.py]')),
    ("workerPoolSpecs.0.containerSpec.env", {"A": "b"},
     "workerPoolSpecs[0].containerSpec.env: expected a list of {name: NAME, value: VALUE} items"),
    ("workerPoolSpecs.0.containerSpec.env", [{"name": "N", "value": 3}],
     'workerPoolSpecs[0].containerSpec.env[0].value: expected a string, found 3; quote it: "3"'),
    ("workerPoolSpecs.0.containerSpec.imageUri", None,
     "workerPoolSpecs[0].containerSpec.imageUri: expected a string, found null"),
    ("workerPoolSpecs.0.machineSpec", {"machineType": "n1-standard-4", "acceleratorCount": 2},
     "workerPoolSpecs[0].machineSpec.acceleratorType: missing; acceleratorCount 2 needs"),
    ("workerPoolSpecs.0.machineSpec", {"machineType": "g2-standard-8",
                                       "acceleratorType": "NVIDIA_L4", "acceleratorCount": 2},
     "workerPoolSpecs[0].machineSpec: machine type g2-standard-8 comes with 1 NVIDIA_L4"),
    ("workerPoolSpecs.1.pythonPackageSpec", {"pythonModule": "m"},
     ("workerPoolSpecs[1]: give exactly one of containerSpec (a custom container) and "
      "pythonPackageSpec (a Python package on a prebuilt image), found both")),
    ("baseOutputDirectory", {"outputUriPrefix": "/tmp/out"},
     "baseOutputDirectory.outputUriPrefix: the platform takes only a Cloud Storage URI"),
    ("workerPoolSpecs", [_pool()] * 5, "workerPoolSpecs: at most 4 worker pools"),
]


@pytest.mark.parametrize(("path", "value", "message"), BAD, ids=[b[0] + "=" + repr(b[1])[:20]
                                                                  for b in BAD])
def test_a_malformed_field_names_its_path_and_the_fix(path: str, value: Any, message: str) -> None:
    with pytest.raises(JobSpecError) as err:
        parse_job_spec(_set(_spec(), path, value))
    assert message in str(err.value)


def test_paths_inside_a_whole_custom_job_start_with_jobspec() -> None:
    body = {"jobSpec": _set(_spec(), "workerPoolSpecs.1.replicaCount", "two")}
    with pytest.raises(JobSpecError, match=r"^jobSpec\.workerPoolSpecs\[1\]\.replicaCount: "):
        parse_job_spec(body)


def test_unreadable_files_name_the_file_and_the_place(tmp_path: Path) -> None:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("workerPoolSpecs:\n  - replicaCount: [1\n")
    with pytest.raises(JobSpecError, match=r"bad\.yaml: not valid YAML: .* at line \d+"):
        load_job_spec(bad_yaml)
    with pytest.raises(JobSpecError, match="cannot read it"):
        load_job_spec(tmp_path / "missing.yaml")
    top_list = tmp_path / "list.yaml"
    top_list.write_text("- replicaCount: 1\n")
    with pytest.raises(JobSpecError, match="expected a mapping at the top"):
        load_job_spec(top_list)


# --- bounds: size, aliases, depth, quotes ------------------------------------------------

# "Billion laughs": nine aliases of nine aliases ... of "lol", 9**9 of them, in 500 bytes.
# replicaCount must be an integer, so an error quotes it: written out in full, that is GBs.
LAUGHS = ", ".join(f"&{name} [{', '.join([f'*{prev}' if prev else 'lol'] * 9)}]"
                   for prev, name in zip([None, *"abcdefgh"], "abcdefghi"))
BOMB = textwrap.dedent(f"""\
    workerPoolSpecs:
      - replicaCount: [{LAUGHS}]
        machineSpec: {{machineType: n1-standard-4}}
        containerSpec: {{imageUri: example.com/img:1, command: [python, t.py]}}
    """)
# Load it in a process that cannot take more than 1 GiB of address space, so that a
# loader that expands it fails there (MemoryError) instead of swamping this machine.
LOAD_BOUNDED = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
import yaml
from resilient_train.platform.jobspec import JobSpecError, load_job_spec
t = time.monotonic()
try:
    load_job_spec(sys.argv[1])
except JobSpecError as exc:
    print(time.monotonic() - t)
    # VmHWM, not ru_maxrss: after fork + exec, ru_maxrss keeps the parent's peak (pytest's).
    with open("/proc/self/status") as f:
        print(next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:")))
    print(exc)
"""


def test_a_yaml_alias_bomb_is_refused_at_once_in_little_memory(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    assert len(BOMB) < 600
    done = subprocess.run([sys.executable, "-c", LOAD_BOUNDED, str(path)], capture_output=True,
                          text=True, timeout=60, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    seconds, peak_rss, message = done.stdout.split("\n", 2)
    assert float(seconds) < 5.0, done.stdout   # (milliseconds, unless the machine is busy)
    assert int(peak_rss) < 200 * 2**20, done.stdout   # the interpreter, not the bomb
    assert message.startswith(f"job spec {path}: its aliases (*name) expand it to more than "
                              f"{4 << 20} nodes and characters (from line ")
    assert "alias bomb" in message and len(message) < 400


def test_aliases_that_share_a_block_between_pools_are_allowed(tmp_path: Path) -> None:
    path = tmp_path / "shared.yaml"
    path.write_text(textwrap.dedent("""\
        workerPoolSpecs:
          - replicaCount: 1
            machineSpec: &machine {machineType: n1-standard-4}
            containerSpec: &container
              imageUri: example.com/img:1
              command: [python, t.py]
              env: [{name: A, value: "1"}]
          - {replicaCount: 2, machineSpec: *machine, containerSpec: *container}
        """))
    spec = load_job_spec(path)
    assert spec.pools == (("workerpool0", 1), ("workerpool1", 2))
    assert dict(spec.env) == {"A": "1"} and spec.notes_for("command", "env") == []


@pytest.mark.parametrize("name, text, message", [
    ("recursive.yaml", "workerPoolSpecs: &w [*w]\n",
     "an alias at line 1 refers to a node that contains it; a job spec cannot be recursive"),
    ("deep.yaml", "workerPoolSpecs: " + "[" * 100 + "]" * 100 + "\n",
     "nested more than 64 levels deep at line 1; a CustomJob spec needs about ten"),
    ("deep.json", "[" * 100_000 + "]" * 100_000,
     "nested more than 64 levels deep; a CustomJob spec needs about ten"),
    ("deep-enough.json", "[" * 65 + "]" * 65,
     "nested more than 64 levels deep; a CustomJob spec needs about ten"),
    ("big.yaml", "#" * (1 << 20) + "\n",
     ("larger than 1 MiB; a CustomJob spec is a few KiB (pools, commands, env): is it the "
      "right file?")),
    ("digits.yaml", f"workerPoolSpecs: [{{replicaCount: {'9' * 5000}}}]\n", "not valid YAML: "),
])
def test_documents_past_the_bounds_are_refused(tmp_path: Path, name: str, text: str,
                                               message: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(JobSpecError) as err:
        load_job_spec(path)
    assert str(err.value).startswith(f"job spec {path}: {message}")


def test_an_error_quotes_a_bounded_excerpt_of_a_huge_value(tmp_path: Path) -> None:
    path = _write(tmp_path, _set(_spec(), "workerPoolSpecs.1.replicaCount", "x" * 500_000))
    with pytest.raises(JobSpecError) as err:
        load_job_spec(path)
    assert str(err.value) == (f'job spec {path}: workerPoolSpecs[1].replicaCount: expected an '
                              f'integer, found "{"x" * 79}…; write e.g. replicaCount: 2')
    with pytest.raises(JobSpecError) as err:
        parse_job_spec({"k" * 500_000: 1, **_spec()})
    assert str(err.value).startswith(f"{'k' * 80}…: unknown field; known fields here: ")
    assert len(str(err.value)) < 400


# --- the CLI ----------------------------------------------------------------------------


def _write(tmp_path: Path, body: dict[str, Any]) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def test_cli_malformed_spec_is_a_usage_error(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, _set(_spec(), "workerPoolSpecs.1.replicaCount", "two"))
    assert cli.main(["launch", "--job-spec", str(path), "--job-dir", str(tmp_path / "j")]) == 2
    err = capsys.readouterr().err
    assert f'job spec {path}: workerPoolSpecs[1].replicaCount: expected an integer, found "two"' in err
    assert not (tmp_path / "j").exists()


def test_cli_spec_without_a_command_needs_one_after_the_separator(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    body = _spec()
    for pool in body["workerPoolSpecs"]:
        del pool["containerSpec"]["command"]
    path = _write(tmp_path, body)
    assert cli.main(["launch", "--job-spec", str(path), "--job-dir", str(tmp_path / "j")]) == 2
    assert "workerPoolSpecs[0] has no command" in capsys.readouterr().err


def _options(argv: list[str]) -> tuple[Any, list[str]]:
    args = cli._parser().parse_args(["launch", *argv])
    command = [c for c in args.command if c != "--"]
    spec = load_job_spec(args.job_spec) if args.job_spec else None
    return cli._options(args, tuple(command), spec)


def test_cli_takes_everything_from_the_spec_when_nothing_is_given(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESILIENT_TRAIN_GPUS", "4")
    opts, notes = _options(["--job-spec", str(EXAMPLE)])
    assert opts.pools == (("workerpool0", 1), ("workerpool1", 1))
    assert opts.command == ("python", "examples/train_charlm.py", "--steps", "2000")
    assert opts.program("workerpool1").env["RESILIENT_TRAIN_HANG_TIMEOUT_S"] == "600"
    assert opts.gpus_per_worker == 1
    assert opts.memory_limit == memory_limit_for("g2-standard-8")
    assert opts.timeout == 7200.0 and opts.max_wait == 24 * 3600.0
    assert opts.output_dir == "gs://YOUR_BUCKET/charlm"
    assert opts.strategy is Strategy.STANDARD and opts.restart_job_on_worker_restart is False
    assert any("--output-dir DIR to keep this run local" in n for n in notes)


def test_cli_explicit_options_beat_the_spec(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESILIENT_TRAIN_GPUS", "4")
    opts, notes = _options([
        "--job-spec", str(EXAMPLE), "--workers", "3", "--gpus-per-worker", "0",
        "--timeout", "0", "--strategy", "flex-start", "--max-wait", "5m",
        "--memory-limit", "1G", "--output-dir", str(tmp_path / "out"),
        "--restart-job-on-worker-restart", "--", "python", "other.py"])
    assert opts.pools == (("workerpool0", 1), ("workerpool1", 2))
    assert opts.command == ("python", "other.py")
    assert opts.gpus_per_worker == 0                 # explicit 0 beats the spec's 1
    assert opts.timeout is None                      # explicit 0 (= none) beats 7200s
    assert opts.strategy is Strategy.FLEX_START and opts.max_wait == 300.0
    assert opts.memory_limit == 1 << 30
    assert opts.output_dir == str(tmp_path / "out")
    assert opts.restart_job_on_worker_restart is True
    assert opts.program("workerpool0").env["RESILIENT_TRAIN_HANG_TIMEOUT_S"] == "600"  # the spec's
    assert not any("--output-dir" in n for n in notes)
    # --pool (a pool's count, 0 leaves it out) and --machine-type are explicit too.
    opts, _ = _options(["--job-spec", str(EXAMPLE), "--pool", "workerpool1=0",
                        "--machine-type", "n1-standard-4"])
    assert opts.pools == (("workerpool0", 1),)
    assert opts.memory_limit == memory_limit_for("n1-standard-4")
    assert [p.memory_limit for p in opts.programs] == [memory_limit_for("n1-standard-4")]


def test_cli_spec_gpus_only_where_the_machine_has_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESILIENT_TRAIN_GPUS", "none")
    opts, notes = _options(["--job-spec", str(EXAMPLE)])
    assert opts.gpus_per_worker == 0
    assert any("this machine has no GPUs" in n for n in notes)
    monkeypatch.setenv("RESILIENT_TRAIN_GPUS", "1")        # 2 replicas x 1 > 1: a stockout
    opts, notes = _options(["--job-spec", str(EXAMPLE)])
    assert opts.gpus_per_worker == 1
    assert any("the job is a stockout" in n for n in notes)


def test_cli_runs_a_two_pool_spec_end_to_end(tmp_path: Path) -> None:
    script = textwrap.dedent("""\
        import json, os, time
        task = json.loads(os.environ["CLUSTER_SPEC"])["task"]
        print(f"rank={os.environ['RANK']} task={task['type']}:{task['index']} "
              f"greeting={os.environ['RT_GREETING']}", flush=True)
        if os.environ["RANK"] == "0":
            time.sleep(1.0)   # the job ends when the primary exits: let the worker print
        """)
    pool = {"replicaCount": 1, "machineSpec": {"machineType": "n1-standard-4"},
            "containerSpec": {"imageUri": "local/test:1", "command": [sys.executable, "-c"],
                              "args": [script],
                              "env": [{"name": "RT_GREETING", "value": "hello"}]}}
    body = {"workerPoolSpecs": [pool, copy.deepcopy(pool)], "scheduling": {"timeout": "60s"}}
    spec = _write(tmp_path, body)
    job_dir = tmp_path / "job"
    env = {**os.environ, "RESILIENT_TRAIN_QUOTA_DIR": str(tmp_path / "quota"),
           "RESILIENT_TRAIN_GPUS": "none"}
    proc = subprocess.run(
        [sys.executable, "-m", "resilient_train.cli.main", "launch", "--job-spec", str(spec),
         "--job-dir", str(job_dir)],
        check=False, env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads((job_dir / "job.json").read_text())
    assert record["state"] == "JOB_STATE_SUCCEEDED"
    assert [p["replica_count"] for p in record["job_spec"]["worker_pool_specs"]] == [1, 1]
    logs = {log.stem: log.read_text() for log in job_dir.glob("logs/*/*.log")}
    assert "rank=0 task=workerpool0:0 greeting=hello" in logs["workerpool0-0"]
    assert "rank=1 task=workerpool1:0 greeting=hello" in logs["workerpool1-0"]
    assert ("job spec: workerpool0, workerpool1: the image local/test:1 is not run locally"
            in proc.stdout)


def test_a_note_about_an_env_value_masks_a_secret_one() -> None:
    env = [{"name": "API_TOKEN", "value": "tok-123$(SUFFIX)"}, {"name": "MODE", "value": "$(M)"}]
    spec = parse_job_spec(_set(_spec(), "workerPoolSpecs.0.containerSpec.env", env))
    notes = spec.notes_for("env")
    assert any("API_TOKEN gets *** as written" in n for n in notes)
    assert any('MODE gets "$(M)" as written' in n for n in notes)
    assert not any("tok-123" in n for n in notes)
