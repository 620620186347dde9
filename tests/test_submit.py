"""`resilient-train submit` and `status` of a Vertex AI job, against a fake JobService.

The fake (tests/fake_jobservice.py) is a real gRPC server on 127.0.0.1 speaking the
service's own messages; the CLI reaches it with --endpoint (or the environment), through
the same aiplatform_v1 client that talks to Google. It records every request and plays
back a script of states, so each test asserts on what the service received and on how
many times it was asked, never on timing.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

# The cloud extra (google-cloud-aiplatform, which brings grpcio).
aiplatform_v1 = pytest.importorskip("google.cloud.aiplatform_v1")
grpc = pytest.importorskip("grpc")

from fake_jobservice import FAILS, SUCCEEDS, FakeJobService
from test_export import IMAGE, _record, four_pool_spec

from resilient_train.cli import main as cli
from resilient_train.platform import submit as vertex
from resilient_train.platform.aiplatform_types import custom_job_message

PROJECT, REGION = "proj-7", "us-central1"
WHERE = ["--project", PROJECT, "--region", REGION]
FAILURE = (3, "The replica workerpool0-0 exited with a non-zero status of 1.")


@pytest.fixture
def fake() -> Iterator[FakeJobService]:
    service = FakeJobService().start()
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture(autouse=True)
def _environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # The four-pool spec has GPUs on its workers: a launch keeps them where the machine has
    # them. And no project, region or endpoint from the shell running the tests.
    monkeypatch.setenv("RESILIENT_TRAIN_GPUS", "8")
    for name in (*cli.PROJECT_ENV, *cli.REGION_ENV, vertex.ENDPOINT_ENV):
        monkeypatch.delenv(name, raising=False)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = cli.main(argv)
    out, err = capsys.readouterr()
    return status, out, err


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job_name(job_id: str = "4242") -> str:
    return f"projects/{PROJECT}/locations/{REGION}/customJobs/{job_id}"


# --- submit: the service receives exactly the exported job --------------------------------


def test_submit_sends_exactly_the_exported_custom_job(
        tmp_path: Path, fake: FakeJobService, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "four.yaml"
    spec.write_text(yaml.safe_dump(four_pool_spec(), sort_keys=False))
    options = ["--job-spec", str(spec), "--name", "rt4"]
    exported = tmp_path / "exported.yaml"
    status, _, err = _run(["export", *options, "--format", "custom-job", "-o", str(exported)],
                          capsys)
    assert status == 0, err

    status, out, err = _run(["submit", *options, *WHERE, "--endpoint", fake.endpoint], capsys)
    assert status == 0, err
    [request] = fake.requests("CreateCustomJob")
    assert request.parent == f"projects/{PROJECT}/locations/{REGION}"
    want = custom_job_message(yaml.safe_load(exported.read_text()))
    # The protobuf messages, field by field: the four pools, env, machines, accelerators,
    # scheduling, output directory, display name and labels.
    assert aiplatform_v1.CustomJob.pb(request.custom_job) == aiplatform_v1.CustomJob.pb(want)
    assert len(request.custom_job.job_spec.worker_pool_specs) == 4
    assert request.custom_job.labels == {"resilient-train": "export"}
    # The client's routing header names the same parent, as the real service requires.
    [call] = fake.calls
    assert call.metadata["x-goog-request-params"] == f"parent={request.parent}"
    [name] = fake.jobs
    job_id = name.rsplit("/", 1)[1]
    assert out.splitlines() == [
        f"submitted {name}",
        (f"console   https://console.cloud.google.com/vertex-ai/locations/{REGION}/training/"
         f"{job_id}/cpu?project={PROJECT}")]
    assert "error" not in err


def test_submit_from_launch_options_names_what_it_left_out(
        tmp_path: Path, fake: FakeJobService, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # Project, region and endpoint from the environment; the document also written out.
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", PROJECT)
    monkeypatch.setenv("CLOUD_ML_REGION", "europe-west4")
    monkeypatch.setenv(vertex.ENDPOINT_ENV, fake.endpoint)
    written = tmp_path / "submitted.json"
    status, out, err = _run(["submit", "--image", IMAGE, "--name", "chaotic", "--workers", "2",
                             "--chaos", "kill:1@30s", "-o", str(written), "--", "python",
                             "train.py"], capsys)
    assert status == 0, err
    [request] = fake.requests("CreateCustomJob")
    assert request.parent == f"projects/{PROJECT}/locations/europe-west4"
    assert request.custom_job == custom_job_message(json.loads(written.read_text()))
    assert request.custom_job.labels["resilient-train-left-out"].startswith("chaos")
    assert "submit: left out --chaos kill:1@30s" in err
    assert out.startswith("submitted projects/proj-7/locations/europe-west4/customJobs/")


def test_submit_from_a_job_record_sends_what_export_writes(
        tmp_path: Path, fake: FakeJobService, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "four.yaml"
    spec.write_text(yaml.safe_dump(four_pool_spec(), sort_keys=False))
    job_dir = _record(tmp_path, ["--job-spec", str(spec), "--name", "rec",
                                 "--chaos", "kill:1@5s"])
    status, out, err = _run(["export", "--from-job", str(job_dir), "--format", "custom-job"],
                            capsys)
    assert status == 0, err
    want = custom_job_message(yaml.safe_load(out))
    # submit's own options apply with --from-job; a launch option does not.
    status, out, err = _run(["submit", "--from-job", str(job_dir), *WHERE, "--endpoint",
                             fake.endpoint], capsys)
    assert status == 0, err
    [request] = fake.requests("CreateCustomJob")
    assert request.custom_job == want
    assert "submit: left out --chaos kill:1@5s" in err
    status, _, err = _run(["submit", "--from-job", str(job_dir), *WHERE, "--endpoint",
                           fake.endpoint, "--workers", "3"], capsys)
    assert status == cli.EXIT_USAGE
    assert "drop --workers" in err and "--region" not in err
    assert len(fake.requests("CreateCustomJob")) == 1


# --- status: a remote job's state, once or followed ------------------------------------------


def test_status_follows_a_job_to_succeeded(fake: FakeJobService,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    name = fake.add_job(_job_name(), SUCCEEDS)
    status, out, err = _run(["status", name, "--follow", "--interval", "0.05",
                             "--endpoint", fake.endpoint], capsys)
    assert status == 0, err
    lines = out.splitlines()
    assert [line.split()[1] for line in lines] == list(SUCCEEDS)   # one line per state
    assert fake.jobs[name].gets == len(SUCCEEDS)                   # one read per state
    assert [r.name for r in fake.requests("GetCustomJob")] == [name] * len(SUCCEEDS)


def test_status_follows_a_job_to_failed_with_its_error(
        fake: FakeJobService, capsys: pytest.CaptureFixture[str]) -> None:
    name = fake.add_job(_job_name(), FAILS, FAILURE)
    status, out, err = _run(["status", name, "--follow", "--interval", "0.05",
                             "--endpoint", fake.endpoint], capsys)
    assert status == cli.EXIT_JOB_FAILED == 1, err
    lines = out.splitlines()
    assert [line.split()[1] for line in lines[:-1]] == list(FAILS)
    assert lines[-1] == f"error     code {FAILURE[0]}: {FAILURE[1]}"
    assert fake.jobs[name].gets == len(FAILS)


def test_status_prints_a_remote_job_like_a_local_one(
        fake: FakeJobService, capsys: pytest.CaptureFixture[str]) -> None:
    name = fake.add_job(_job_name(), ("JOB_STATE_FAILED",), FAILURE)
    status, out, err = _run(["status", name, "--endpoint", fake.endpoint], capsys)
    assert status == 0, err   # printing a record succeeds, whatever the job did
    fields = dict(line.split(None, 1) for line in out.splitlines())
    assert fields["job"] == name and fields["state"] == "JOB_STATE_FAILED"
    assert fields["created"].endswith("Z") and fields["ended"].endswith("Z")
    assert fields["started"] == "-"
    assert fields["error"] == f"code {FAILURE[0]}: {FAILURE[1]}"
    assert fields["console"].endswith("/training/4242/cpu?project=proj-7")

    status, out, err = _run(["status", name, "--json", "--endpoint", fake.endpoint], capsys)
    assert status == 0, err
    doc = json.loads(out)
    assert doc["name"] == name and doc["state"] == "JOB_STATE_FAILED"
    assert doc["error"] == {"code": FAILURE[0], "message": FAILURE[1]}


def test_submit_wait_as_a_real_command(tmp_path: Path, fake: FakeJobService) -> None:
    # The installed entry point's module in a process of its own, the endpoint from the
    # environment: submit, then follow the job to FAILED.
    fake.script, fake.error = FAILS, FAILURE
    env = {**os.environ, vertex.ENDPOINT_ENV: fake.endpoint, "GOOGLE_CLOUD_PROJECT": PROJECT}
    done = subprocess.run(
        [sys.executable, "-m", "resilient_train.cli.main", "submit", "--image", IMAGE,
         "--region", REGION, "--output-dir", "gs://bucket/run", "--wait", "--interval", "0.05",
         "--", "python", "train.py"],
        capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path, env=env)
    assert done.returncode == 1, done.stderr
    [name] = fake.jobs
    lines = done.stdout.splitlines()
    assert lines[0] == f"submitted {name}"
    assert lines[1].startswith("console   https://console.cloud.google.com/vertex-ai/")
    assert [line.split()[1] for line in lines[2:-1]] == list(FAILS)
    assert lines[-1] == f"error     code {FAILURE[0]}: {FAILURE[1]}"
    [request] = fake.requests("CreateCustomJob")
    pool = request.custom_job.job_spec.worker_pool_specs[0]
    assert list(pool.container_spec.command) == ["python", "train.py"]
    assert pool.container_spec.image_uri == IMAGE


# --- errors: one line each, naming the problem and the fix ---------------------------------


def _one_line(err: str) -> str:
    """The error: one line, after submit's notes on what the export left out."""
    lines = [line for line in err.strip().splitlines() if not line.startswith("submit: ")]
    assert len(lines) == 1 and lines[0].startswith("resilient-train "), err
    return lines[0]


def test_an_unreachable_service_is_one_line_at_once(
        capsys: pytest.CaptureFixture[str]) -> None:
    endpoint = f"127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    status, out, err = _run(["submit", "--image", IMAGE, *WHERE, "--endpoint", endpoint,
                             "--output-dir", "gs://b/r", "--", "python", "t.py"], capsys)
    assert status == cli.EXIT_USAGE and "submitted" not in out
    line = _one_line(err)
    assert "unreachable" in line and endpoint in line and "--endpoint" in line
    status, _, err = _run(["status", _job_name(), "--follow", "--interval", "0.05",
                           "--endpoint", endpoint], capsys)
    assert status == cli.EXIT_USAGE and "unreachable" in _one_line(err)
    assert time.monotonic() - started < 20   # refused, not waited out


@pytest.mark.parametrize("name", ["projects/p/customJobs/1", "projects/p/locations/r/jobs/1",
                                  "locations/us-central1/customJobs/1"])
def test_a_malformed_job_name_is_refused(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = _run(["status", name], capsys)
    assert status == cli.EXIT_USAGE
    assert "projects/PROJECT/locations/REGION/customJobs/ID" in _one_line(err)


@pytest.mark.parametrize("code, message, expected", [
    (grpc.StatusCode.PERMISSION_DENIED,
     "Permission 'aiplatform.customJobs.create' denied on resource", "roles/aiplatform.user"),
    (grpc.StatusCode.INVALID_ARGUMENT,
     "Machine type n1-standard-4 is not supported with accelerator NVIDIA_L4.",
     "refused the request: Machine type n1-standard-4 is not supported"),
])
def test_a_refused_create_says_why(code: grpc.StatusCode, message: str, expected: str,
                                   fake: FakeJobService,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    fake.fail_next = (code, message)
    status, out, err = _run(["submit", "--image", IMAGE, *WHERE, "--endpoint", fake.endpoint,
                             "--", "python", "t.py"], capsys)
    assert status == cli.EXIT_USAGE and "submitted" not in out
    line = _one_line(err)
    assert expected in line and message.rstrip(".") in line
    assert len(fake.requests("CreateCustomJob")) == 1   # not retried: no second job


def test_no_credentials_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    # No endpoint: Application Default Credentials, here a key file that is not there.
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing-key.json"))
    status, _, err = _run(["status", _job_name()], capsys)
    assert status == cli.EXIT_USAGE
    line = _one_line(err)
    assert "no Google Cloud credentials" in line
    assert "gcloud auth application-default login" in line


def test_submit_needs_a_project_and_a_region(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["submit", "--image", IMAGE, "--", "python", "t.py"]
    status, _, err = _run([*argv[:1], "--region", REGION, *argv[1:]], capsys)
    assert status == cli.EXIT_USAGE and "--project" in _one_line(err)
    status, _, err = _run([*argv[:1], "--project", PROJECT, *argv[1:]], capsys)
    assert status == cli.EXIT_USAGE and "--region" in _one_line(err)
    status, _, err = _run([*argv[:1], *WHERE[:2], "--region", "US Central", *argv[1:]], capsys)
    assert status == cli.EXIT_USAGE and "us-central1" in _one_line(err)


def test_remote_options_on_a_job_directory_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = _run(["status", str(tmp_path), "--follow"], capsys)
    assert status == cli.EXIT_USAGE and "--follow" in _one_line(err)


# Blocks the cloud extra in a process of its own, as if it were not installed.
_WITHOUT_THE_EXTRA = """
import sys

class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.startswith("google.cloud.aiplatform"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
from resilient_train.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("argv", [
    ["submit", "--image", IMAGE, *WHERE, "--", "python", "t.py"],
    ["status", _job_name()],
])
def test_without_the_cloud_extra_it_says_how_to_install_it(tmp_path: Path,
                                                            argv: list[str]) -> None:
    done = subprocess.run([sys.executable, "-c", _WITHOUT_THE_EXTRA, *argv],
                          capture_output=True, text=True, timeout=120, check=False,
                          cwd=tmp_path)
    assert done.returncode == cli.EXIT_USAGE, done.stderr
    line = _one_line(done.stderr)
    assert "pip install 'resilient-train[cloud]'" in line
