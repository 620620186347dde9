"""Local resources: GPUs, memory sizes, machine types and process-tree memory.

No torch import: the launcher must start fast and must not initialise CUDA itself.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import psutil

logger = logging.getLogger(__name__)

__all__ = [
    "MACHINE_TYPES",
    "MachineType",
    "detect_gpus",
    "kernel_oom_kills",
    "memory_limit_for",
    "parse_memory",
    "process_start_time",
    "process_tree",
    "process_tree_memory",
    "process_tree_rss",
    "tree_pss",
    "tree_rss",
    "reserved_fraction",
]

GPUS_ENV = "RESILIENT_TRAIN_GPUS"
_NVIDIA_SMI_TIMEOUT_S = 5.0
KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


# ---------------------------------------------------------------------------- GPUs


def _parse_gpu_env(value: str) -> tuple[int, ...]:
    text = value.strip()
    if text.lower() in ("", "none"):
        return ()
    parts = [part.strip() for part in text.split(",")]
    try:
        numbers = [int(part) for part in parts if part]
    except ValueError:
        numbers = []
    if numbers and min(numbers) >= 0 and len(set(numbers)) == len(numbers):
        return tuple(range(numbers[0])) if len(parts) == 1 else tuple(numbers)
    raise ValueError(
        f"{GPUS_ENV}={value!r} is not a GPU count or list; expected a count like 4, "
        "distinct ids like 0,2,5 (a single id: 3,), or none"
    )


def detect_gpus(env: Mapping[str, str] | None = None) -> tuple[int, ...]:
    """GPU indices: ``$RESILIENT_TRAIN_GPUS`` if set, else ``nvidia-smi``, else ().

    ``RESILIENT_TRAIN_GPUS`` is a count (``4`` -> 0..3), a list (``0,2,5``; one id is ``3,``)
    or ``""``/``none`` for no GPUs.
    """
    env = os.environ if env is None else env
    if GPUS_ENV in env:
        return _parse_gpu_env(env[GPUS_ENV])
    exe = shutil.which("nvidia-smi", path=env.get("PATH", os.defpath))
    if exe is None:
        return ()
    try:
        result = subprocess.run(
            [exe, "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=_NVIDIA_SMI_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.warning(
            "nvidia-smi failed (%s); assuming no GPUs. Set %s to override.", exc, GPUS_ENV
        )
        return ()
    if result.returncode != 0:
        # Typical on machines with the binary but no driver loaded.
        logger.info("nvidia-smi exited %d; assuming no GPUs", result.returncode)
        return ()
    try:
        return tuple(int(line) for line in result.stdout.split() if line.strip())
    except ValueError:
        logger.warning(
            "unexpected nvidia-smi output %r; assuming no GPUs. Set %s to override.",
            result.stdout[:200],
            GPUS_ENV,
        )
        return ()


# ---------------------------------------------------------------------------- memory sizes

_MEMORY_RE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(?:ib?|b)?|b)?$", re.IGNORECASE)
_MEMORY_UNITS = {None: 1, "k": KiB, "m": MiB, "g": GiB, "t": TiB}


def parse_memory(text: str) -> int:
    """Bytes from a size like ``512M``, ``2G``, ``2GiB``, ``1.5GB``, ``800MiB`` or ``1024``.

    Case-insensitive. K, M, G and T are powers of 1024, as Kubernetes' Ki/Mi/Gi/Ti; plain
    ``GB`` (and KB, MB, TB) is read as GiB too, because the platform's machine-type tables
    say GB and mean GiB. A bare number is bytes.
    """
    match = _MEMORY_RE.match(text.strip()) if isinstance(text, str) else None
    if not match:
        raise ValueError(
            f"expected a memory size like 512M, 2G, 2GiB, 1.5GB, 800MiB or 1024 (bytes), "
            f"found {text!r}"
        )
    unit = match.group(2).lower() if match.group(2) else None
    value = float(match.group(1)) * _MEMORY_UNITS[unit]
    if unit is None and value != int(value):
        raise ValueError(f"a size in bytes must be whole, found {text!r}; write e.g. 1.5K or 1536")
    return int(round(value))


# ---------------------------------------------------------------------------- machine types


@dataclass(frozen=True)
class MachineType:
    name: str
    vcpus: int
    memory_bytes: int
    gpus: int = 0
    accelerator: str | None = None


def _table(*rows: tuple[str, int, float, int, str | None]) -> Mapping[str, MachineType]:
    return MappingProxyType(
        {
            name: MachineType(name, cpus, int(mem * GiB), gpus, acc)
            for name, cpus, mem, gpus, acc in rows
        }
    )


# Published Compute Engine shapes (memory "GB" in the docs is GiB: memoryMb = GB * 1024).
MACHINE_TYPES: Mapping[str, MachineType] = _table(
    ("e2-standard-4", 4, 16, 0, None),
    ("e2-standard-8", 8, 32, 0, None),
    ("e2-standard-16", 16, 64, 0, None),
    ("e2-standard-32", 32, 128, 0, None),
    ("n1-standard-4", 4, 15, 0, None),
    ("n1-standard-8", 8, 30, 0, None),
    ("n1-standard-16", 16, 60, 0, None),
    ("n1-standard-32", 32, 120, 0, None),
    ("n1-highmem-8", 8, 52, 0, None),
    ("n1-highmem-16", 16, 104, 0, None),
    # The Reduction Server's usual shapes.
    ("n1-highcpu-8", 8, 7.2, 0, None),
    ("n1-highcpu-16", 16, 14.4, 0, None),
    ("n1-highcpu-32", 32, 28.8, 0, None),
    ("n2-standard-8", 8, 32, 0, None),
    ("n2-standard-16", 16, 64, 0, None),
    ("n2-standard-32", 32, 128, 0, None),
    ("g2-standard-4", 4, 16, 1, "NVIDIA_L4"),
    ("g2-standard-8", 8, 32, 1, "NVIDIA_L4"),
    ("g2-standard-12", 12, 48, 1, "NVIDIA_L4"),
    ("g2-standard-24", 24, 96, 2, "NVIDIA_L4"),
    ("a2-highgpu-1g", 12, 85, 1, "NVIDIA_TESLA_A100"),
    ("a2-highgpu-2g", 24, 170, 2, "NVIDIA_TESLA_A100"),
    ("a2-highgpu-4g", 48, 340, 4, "NVIDIA_TESLA_A100"),
    ("a2-highgpu-8g", 96, 680, 8, "NVIDIA_TESLA_A100"),
    ("a2-ultragpu-1g", 12, 170, 1, "NVIDIA_A100_80GB"),
    ("a2-ultragpu-8g", 96, 1360, 8, "NVIDIA_A100_80GB"),
    ("a3-highgpu-8g", 208, 1872, 8, "NVIDIA_H100_80GB"),
)


def reserved_fraction(memory_bytes: int) -> float:
    """Share of a node's memory the platform keeps for its own agents.

    Our reading of "up to 40% on the smallest machine types" (docs/platform.md, "Common
    errors"): 40% up to 8 GiB, 25% up to 16 GiB, 15% up to 64 GiB, 8% above.
    """
    if memory_bytes <= 8 * GiB:
        return 0.40
    if memory_bytes <= 16 * GiB:
        return 0.25
    if memory_bytes <= 64 * GiB:
        return 0.15
    return 0.08


def memory_limit_for(machine_type: str) -> int:
    """Bytes a worker on ``machine_type`` may use before the launcher calls it out of memory."""
    key = machine_type.strip().lower()
    machine = MACHINE_TYPES.get(key)
    if machine is None:
        close = difflib.get_close_matches(key, MACHINE_TYPES, n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ValueError(
            f"unknown machine type {machine_type!r}; {hint}known types: "
            f"{', '.join(MACHINE_TYPES)}. For another shape pass --memory-limit (e.g. "
            "--memory-limit 12G) instead of --machine-type"
        )
    return int(machine.memory_bytes * (1.0 - reserved_fraction(machine.memory_bytes)))


# ---------------------------------------------------------------------------- process trees


def process_tree(pid: int) -> list[psutil.Process]:
    """The process ``pid`` and all its descendants; [] when it is gone."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def process_tree_rss(pid: int) -> int:
    """Sum of the RSS in bytes of ``pid`` and its descendants (0 when it is gone): an
    upper bound of what the tree uses (:func:`process_tree_memory` counts pages once)."""
    return tree_rss(process_tree(pid))


def process_tree_memory(pid: int) -> int:
    """Bytes that ``pid`` and its descendants use, each page counted once (see
    :func:`tree_pss`); 0 when it is gone."""
    return tree_pss(process_tree(pid))


def tree_rss(procs: list[psutil.Process]) -> int:
    """Sum of the processes' RSS: cheap, but a page shared by N of them counts N times."""
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue  # vanished mid-walk, or not ours to read
    return total


def tree_pss(procs: list[psutil.Process]) -> int:
    """The memory of a process tree as a container's memory limit sees it: each page once.

    Forked processes (DataLoader workers, a shell and its child) share pages copy-on-write,
    and a sum of their RSS counts those pages once per process: 4 DataLoader workers of a
    1 GB process look like 5 GB. The sum of PSS (each shared page split among its
    sharers) counts them once. It costs the kernel a page-table walk (we measured 65 ms
    per GB here), so callers read it only when the RSS sum is over their limit. Where
    PSS is not readable (not Linux), a process counts its RSS.
    """
    total = 0
    for proc in procs:
        pss = _pss(proc.pid)
        if pss is None:
            pss = tree_rss([proc])
        total += pss
    return total


def _pss(pid: int) -> int | None:
    """Proportional set size in bytes from /proc/PID/smaps_rollup; None where unreadable."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * KiB
    except (OSError, ValueError, IndexError):
        return None
    return None


def process_start_time(pid: int) -> float | None:
    """When ``pid`` started (psutil's create time, epoch seconds); None when there is no
    such process. With the pid it tells one process from a later one that reused it."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def kernel_oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has killed since boot (``oom_kill`` in
    /proc/vmstat, Linux 4.13+); None where unknown. A worker that died of SIGKILL while
    this rose was, in all likelihood, the victim: the machine ran out of memory."""
    try:
        with open("/proc/vmstat", "rb") as f:
            for line in f:
                if line.startswith(b"oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None
