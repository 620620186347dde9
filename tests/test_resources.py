from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from resilient_train.platform.resources import (
    MACHINE_TYPES,
    GiB,
    MiB,
    detect_gpus,
    memory_limit_for,
    parse_memory,
    process_tree,
    process_tree_memory,
    process_tree_rss,
    reserved_fraction,
)

MB100 = 100 * MiB


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512M", 512 * MiB),
        ("2G", 2 * GiB),
        ("2GiB", 2 * GiB),
        ("1.5GB", 3 * GiB // 2),
        ("800MiB", 800 * MiB),
        ("800mi", 800 * MiB),
        ("1024", 1024),
        ("4k", 4096),
        ("1T", 1 << 40),
        (" 2 gb ", 2 * GiB),
    ],
)
def test_parse_memory(text: str, expected: int) -> None:
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "2X", "-1G", "1.5", "2GG", "G"])
def test_parse_memory_rejects(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_memory(text)
    assert repr(text) in str(info.value)
    assert "512M" in str(info.value) or "1536" in str(info.value)


def test_machine_types_and_limits() -> None:
    assert MACHINE_TYPES["n1-standard-4"].memory_bytes == 15 * GiB
    assert MACHINE_TYPES["a3-highgpu-8g"].gpus == 8
    assert MACHINE_TYPES["g2-standard-24"].accelerator == "NVIDIA_L4"
    assert reserved_fraction(8 * GiB) == 0.40
    assert reserved_fraction(8 * GiB + 1) == 0.25
    assert reserved_fraction(64 * GiB) == 0.15
    assert reserved_fraction(65 * GiB) == 0.08
    assert memory_limit_for("n1-standard-4") == int(15 * GiB * 0.75)
    assert memory_limit_for("e2-standard-16") == int(64 * GiB * 0.85)
    assert memory_limit_for("A2-HIGHGPU-1G") == int(85 * GiB * 0.92)
    for machine in MACHINE_TYPES.values():
        assert 0 < memory_limit_for(machine.name) < machine.memory_bytes


def test_unknown_machine_type_suggests_close_matches() -> None:
    with pytest.raises(ValueError) as info:
        memory_limit_for("n1-standrd-4")
    message = str(info.value)
    assert "'n1-standrd-4'" in message and "did you mean n1-standard-4" in message
    assert "--memory-limit" in message


@pytest.mark.parametrize(
    ("value", "expected"),
    [("4", (0, 1, 2, 3)), ("0,2,5", (0, 2, 5)), ("3,", (3,)), ("", ()), ("none", ()), ("0", ())],
)
def test_detect_gpus_env_override(value: str, expected: tuple[int, ...]) -> None:
    assert detect_gpus({"RESILIENT_TRAIN_GPUS": value, "PATH": ""}) == expected


@pytest.mark.parametrize("value", ["two", "1,1", "-2"])
def test_detect_gpus_bad_override(value: str) -> None:
    with pytest.raises(ValueError, match="RESILIENT_TRAIN_GPUS"):
        detect_gpus({"RESILIENT_TRAIN_GPUS": value})


def _fake_nvidia_smi(directory: Path, body: str) -> str:
    script = directory / "nvidia-smi"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return f"{directory}{os.pathsep}{os.environ.get('PATH', '')}"


def test_detect_gpus_from_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _fake_nvidia_smi(tmp_path, 'printf "0\\n1\\n"')
    assert detect_gpus({"PATH": path}) == (0, 1)
    monkeypatch.setenv("PATH", path)
    monkeypatch.delenv("RESILIENT_TRAIN_GPUS", raising=False)
    assert detect_gpus() == (0, 1)


def test_detect_gpus_failing_or_missing_nvidia_smi(tmp_path: Path) -> None:
    assert detect_gpus({"PATH": str(tmp_path)}) == ()  # no binary
    assert detect_gpus({"PATH": _fake_nvidia_smi(tmp_path, "echo 'no driver' >&2; exit 9")}) == ()
    assert detect_gpus({"PATH": _fake_nvidia_smi(tmp_path, "echo garbage")}) == ()


# Prints "start", waits for a line, allocates (and touches) ~100 MB, prints "ready", then
# holds it until stdin closes.
ALLOCATOR = """
import sys
print("start", flush=True)
sys.stdin.readline()
block = b"x" * (100 * 1024 * 1024)
print("ready", flush=True)
sys.stdin.read()
"""
# Runs the allocator as a grandchild that inherits stdin and stdout.
NEST = "import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', sys.argv[1]]))"


@pytest.fixture
def allocator(request: pytest.FixtureRequest) -> Iterator[subprocess.Popen[str]]:
    nested = getattr(request, "param", False)
    args = [sys.executable, "-c", NEST, ALLOCATOR] if nested else [sys.executable, "-c", ALLOCATOR]
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)


def _step(proc: subprocess.Popen[str], expect: str) -> None:
    assert proc.stdout.readline().strip() == expect


def test_process_tree_rss_of_allocating_child(allocator: subprocess.Popen[str]) -> None:
    _step(allocator, "start")
    before = process_tree_rss(allocator.pid)
    assert before > 0
    allocator.stdin.write("go\n")
    allocator.stdin.flush()
    _step(allocator, "ready")
    after = process_tree_rss(allocator.pid)
    assert after >= MB100
    assert after - before >= 0.9 * MB100


@pytest.mark.parametrize("allocator", [True], indirect=True)
def test_process_tree_includes_grandchildren(allocator: subprocess.Popen[str]) -> None:
    _step(allocator, "start")  # printed by the grandchild through the inherited pipe
    tree = process_tree(allocator.pid)
    assert [p.pid for p in tree][0] == allocator.pid and len(tree) == 2
    allocator.stdin.write("go\n")
    allocator.stdin.flush()
    _step(allocator, "ready")
    assert process_tree_rss(allocator.pid) >= MB100 + tree[0].memory_info().rss


# Allocates (and touches) ~100 MB, forks two children that share it copy-on-write and
# never touch it, prints "ready", holds until stdin closes.
FORKER = """
import os, sys, time
block = b"x" * (100 * 1024 * 1024)
pids = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        time.sleep(120)
        os._exit(0)
    pids.append(pid)
print("ready", flush=True)
sys.stdin.read()
for pid in pids:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
"""


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux PSS")
def test_process_tree_memory_counts_pages_shared_by_a_fork_once() -> None:
    proc = subprocess.Popen([sys.executable, "-c", FORKER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        _step(proc, "ready")
        assert len(process_tree(proc.pid)) == 3
        assert process_tree_rss(proc.pid) >= 3 * 0.9 * MB100   # the block counted 3 times
        assert 0.9 * MB100 <= process_tree_memory(proc.pid) < 1.5 * MB100  # once
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)


def test_missing_process() -> None:
    beyond_pid_max = 2**22 + 1  # Linux pid_max is at most 2**22
    assert process_tree(beyond_pid_max) == []
    assert process_tree_rss(beyond_pid_max) == 0
