"""Job specs through the platform's own types (the cloud extra: google-cloud-aiplatform).

Every spec the project ships or tests with parses into ``aiplatform_v1.CustomJob`` /
``CustomJobSpec`` without losing a field; what the types refuse, at any depth, is an error
with its path; the export is checked by the same types; and without the extra the reader
falls back to its own tables, which name no field the types lack.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from resilient_train.cli import main as cli
from resilient_train.platform import aiplatform_types as platform_types
from resilient_train.platform.jobspec import _FIELDS, _USED, JobSpecError, parse_job_spec

pytest.importorskip("google.cloud.aiplatform_v1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from test_export import four_pool_spec  # noqa: E402

_YAML_BLOCK = re.compile(r"```ya?ml\n(.*?)```", re.DOTALL)


def _shipped_specs() -> list[tuple[str, dict[str, Any]]]:
    """Every CustomJob or CustomJobSpec in examples/, the docs and the README."""
    found = [(str(p.relative_to(ROOT)), yaml.safe_load(p.read_text()))
             for p in sorted((ROOT / "examples").rglob("*.yaml"))]
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for n, block in enumerate(_YAML_BLOCK.findall(page.read_text())):
            doc = yaml.safe_load(block)
            if isinstance(doc, dict) and ({"workerPoolSpecs", "jobSpec"} & doc.keys()):
                found.append((f"{page.relative_to(ROOT)} block {n}", doc))
    found.append(("tests/test_export.py four_pool_spec", four_pool_spec()))
    return found


def _as_the_api_writes(doc: Any) -> Any:
    """``doc`` as the JSON mapping writes it back: int64 (replicaCount) as a string, and a
    field at its default (false, 0, "", empty) left out as proto3 leaves it."""
    if isinstance(doc, dict):
        return {k: str(v) if k == "replicaCount" else _as_the_api_writes(v)
                for k, v in doc.items() if v not in (False, 0, "", [], {}, None)}
    if isinstance(doc, list):
        return [_as_the_api_writes(v) for v in doc]
    return doc


def _message(doc: dict[str, Any]) -> Any:
    return (platform_types.custom_job_message(doc) if "jobSpec" in doc
            else platform_types.spec_message(doc))


@pytest.mark.parametrize("name,doc", _shipped_specs(), ids=lambda v: v if isinstance(v, str)
                         else "")
def test_every_shipped_spec_parses_through_the_types_without_losing_a_field(
        name: str, doc: dict[str, Any]) -> None:
    message = _message(doc)
    assert platform_types.to_document(message) == _as_the_api_writes(doc), name
    parse_job_spec(doc)   # and the launcher reads it (through the same types)


def test_the_shipped_specs_include_the_example() -> None:
    names = [name for name, _ in _shipped_specs()]
    assert "examples/platform/custom_job.yaml" in names, names


@pytest.mark.parametrize("message", platform_types.MESSAGES)
def test_the_launchers_own_tables_name_only_fields_the_types_have(message: str) -> None:
    # Without the extra the reader uses _FIELDS; it must never accept a field the API
    # refuses (one it lacked, multihostGpuNodeCount, was found and dropped this way).
    types = platform_types.known_fields(message)
    assert types is not None
    assert set(_FIELDS[message]) <= types, set(_FIELDS[message]) - types
    assert set(_USED[message]) <= types


def _pool(**extra: Any) -> dict[str, Any]:
    return {"replicaCount": 1, "machineSpec": {"machineType": "n1-standard-4"},
            "containerSpec": {"imageUri": "example.com/img:1", "command": ["python", "t.py"]},
            **extra}


BAD = [
    # Fields the launcher does not read itself: the types still check them, at any depth.
    ({"workerPoolSpecs": [_pool(), _pool(diskSpec={"bootDiskSizGb": 100})]},
     "workerPoolSpecs[1].diskSpec.bootDiskSizGb: unknown field (aiplatform_v1.DiskSpec has "
     "no such field); did you mean bootDiskSizeGb?"),
    ({"workerPoolSpecs": [_pool(diskSpec={"bootDiskSizeGb": "big"})]},
     "workerPoolSpecs[0].diskSpec.bootDiskSizeGb: expected an integer, found 'big'"),
    ({"workerPoolSpecs": [_pool(nfsMounts=[{"server": "10.0.0.2", "pth": "/x"}])]},
     "workerPoolSpecs[0].nfsMounts[0].pth: unknown field (aiplatform_v1.NfsMount has no such "
     "field); did you mean path?"),
    ({"workerPoolSpecs": [{**_pool(), "machineSpec": {
        "machineType": "n1-standard-4",
        "reservationAffinity": {"reservationAffinityType": "ANY"}}}]},
     "workerPoolSpecs[0].machineSpec.reservationAffinity.reservationAffinityType: expected "
     "one of TYPE_UNSPECIFIED, NO_RESERVATION, ANY_RESERVATION, SPECIFIC_RESERVATION"),
    ({"displayName": "x", "encryptionSpec": {"kmsKey": "k"},
      "jobSpec": {"workerPoolSpecs": [_pool()]}},
     "encryptionSpec.kmsKey: unknown field (aiplatform_v1.EncryptionSpec has no such field); "
     "did you mean kmsKeyName?"),
    ({"workerPoolSpecs": [_pool(), None]},
     "workerPoolSpecs[1]: an empty item (null) in a list; the API refuses it: write an empty "
     "worker pool as {}"),
    # Fields the launcher reads: its own checks come first, with the same path.
    ({"workerPoolSpecs": [{**_pool(), "machineSpec": {"machineType": "n1-standard-4",
                                                      "multihostGpuNodeCount": 2}}]},
     "workerPoolSpecs[0].machineSpec.multihostGpuNodeCount: unknown field; known fields "
     "here: acceleratorCount, acceleratorType, gpuPartitionSize, machineType, "
     "reservationAffinity, tpuTopology"),
]


@pytest.mark.parametrize("doc,message", BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_what_the_types_refuse_is_an_error_with_its_path(doc: dict[str, Any],
                                                          message: str) -> None:
    with pytest.raises(JobSpecError) as err:
        parse_job_spec(doc)
    assert str(err.value).startswith(message), str(err.value)


def test_the_export_is_the_types_json_of_the_tested_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RESILIENT_TRAIN_GPUS", "8")
    spec = tmp_path / "four.yaml"
    spec.write_text(yaml.safe_dump(four_pool_spec()))
    out = tmp_path / "job.json"
    assert cli.main(["export", "--job-spec", str(spec), "--format", "custom-job",
                     "--name", "rt4", "-o", str(out)]) == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    message = platform_types.custom_job_message(doc)
    assert platform_types.to_document(message) == _as_the_api_writes(doc)
    assert message.display_name == "rt4"
    assert message.job_spec.worker_pool_specs[1].machine_spec.accelerator_count == 1
    assert message.job_spec.scheduling.strategy.name == "FLEX_START"
    assert message.job_spec.scheduling.max_wait_duration.total_seconds() == 3600


def test_without_the_extra_the_launcher_uses_its_own_tables() -> None:
    # A process where google.cloud.aiplatform_v1 cannot be imported, as after a plain
    # `pip install resilient-train`.
    code = textwrap.dedent("""
        import importlib.abc, sys

        class NoCloud(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.startswith("google.cloud.aiplatform"):
                    raise ModuleNotFoundError(name)
                return None

        sys.meta_path.insert(0, NoCloud())
        from resilient_train.platform import aiplatform_types as platform_types
        from resilient_train.platform.jobspec import JobSpecError, parse_job_spec

        assert not platform_types.available()
        assert platform_types.known_fields("MachineSpec") is None
        pool = {"replicaCount": 1, "machineSpec": {"machineType": "n1-standard-4"},
                "containerSpec": {"imageUri": "i", "command": ["python", "t.py"]}}
        print(parse_job_spec({"workerPoolSpecs": [pool, {**pool, "replicaCount": 2}]}).pools)
        try:
            parse_job_spec({"workerPoolSpecs": [{**pool, "replicaCuont": 1}]})
        except JobSpecError as exc:
            print(exc)
        try:
            platform_types.require("resilient-train submit")
        except platform_types.CloudExtraMissing as exc:
            print(exc)
        assert "google.cloud.aiplatform_v1" not in sys.modules
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "(('workerpool0', 1), ('workerpool1', 2))"
    assert lines[1].startswith("workerPoolSpecs[0].replicaCuont: unknown field; did you mean "
                               "replicaCount?")
    assert lines[2] == ("resilient-train submit needs Google's aiplatform types, which are "
                        "not installed: pip install 'resilient-train[cloud]'")
