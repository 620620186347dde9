"""benchmarks/run_all.py --from-json: the results page and its plots from the JSON files,
without running any benchmark."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_ALL = ROOT / "benchmarks" / "run_all.py"
RESULTS = ROOT / "benchmarks" / "results"
NAMES = ["checkpoint", "distributed", "runtime", "launcher", "goodput", "soak"]
SVG = "{http://www.w3.org/2000/svg}svg"

# A minimal goodput.json, for a checkout where bench_goodput.py has not been run yet.
GOODPUT = {
    "benchmark": "goodput", "time": "2026-01-01T00:00:00+00:00",
    "machine": {"python": "3.11", "torch": "2.13", "cpus": 2},
    "config": {"quick": True, "workers": 2, "steps": 800, "step_time_s": 0.02,
               "state_mb": 32, "kills": 3, "seed": 2},
    "rates": [{"mean_s": 10.0, "chaos": "kill~10sx3", "seed": 2,
               "schedule": [{"at_s": 11.89, "target": "workerpool0-0"}]}],
    "runs": [
        {"policy": "steps:100", "mean_s": 10.0, "faults": 3, "saves": 8,
         "state": "JOB_STATE_SUCCEEDED",
         "goodput": {"wall_s": 40.0, "startup_s": 4.0, "productive_s": 22.0, "lost_s": 4.0,
                     "checkpoint_s": 0.5, "recovery_s": 8.0, "other_s": 1.5, "steps": 800,
                     "steps_lost": 150, "segments": 4, "recoveries": 3, "goodput": 0.55}},
        {"policy": "auto", "mean_s": 10.0, "error": "job ended JOB_STATE_FAILED",
         "state": "JOB_STATE_FAILED", "goodput": None},
    ],
    "notes": [],
}


def run_from_json(results: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(RUN_ALL), "--from-json", "--results",
                           str(results)], check=False, capture_output=True, text=True, timeout=60)


def copy_results(tmp_path: Path) -> Path:
    results = tmp_path / "results"
    results.mkdir()
    for src in RESULTS.glob("*.json"):
        shutil.copy(src, results / src.name)
    if not (results / "goodput.json").exists():
        (results / "goodput.json").write_text(json.dumps(GOODPUT))
    return results


def test_from_json_writes_every_section_and_valid_svg(tmp_path: Path) -> None:
    results = copy_results(tmp_path)
    proc = run_from_json(results)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    readme = (results / "README.md").read_text()
    for name in NAMES:
        assert f'<a id="{name}"></a>' in readme
        if (results / f"{name}.json").exists():
            assert f"{name}.json` is missing" not in readme
    assert "Could not render" not in readme
    assert "torch.save" in readme and "DCP" in readme and "torchrun" in readme
    svgs = sorted(results.glob("*.svg"))
    assert {p.stem for p in svgs} >= set(NAMES)
    for path in svgs:
        root = ET.parse(path).getroot()
        assert root.tag == SVG, path
        assert f"]({path.name})" in readme   # linked from the page


def test_a_missing_json_is_reported_not_a_crash(tmp_path: Path) -> None:
    results = copy_results(tmp_path)
    (results / "launcher.json").unlink()
    (results / "runtime.json").write_text("{not json")
    (results / "run_all.json").write_text(json.dumps({"benchmarks": {"launcher": {
        "status": "failed", "why": "timed out after 900 s (killed)",
        "output_tail": ["restart 3 of 5"]}}}))
    proc = run_from_json(results)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    readme = (results / "README.md").read_text()
    assert "`launcher.json` is missing" in readme
    assert "`runtime.json` is unreadable" in readme
    assert "**FAILED**: timed out after 900 s (killed)" in readme
    assert "restart 3 of 5" in readme
    assert not (results / "launcher.svg").exists()
    assert '<a id="goodput"></a>' in readme and (results / "goodput.svg").exists()
    ET.parse(results / "goodput.svg")


def test_only_rejects_an_unknown_benchmark(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(RUN_ALL), "--only", "checkpoint,nope",
                           "--results", str(tmp_path)], check=False, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "nope" in proc.stderr
