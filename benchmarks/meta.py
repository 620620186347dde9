"""When and where a benchmark ran: the fields run_all.py's page reads from each JSON."""

from __future__ import annotations

import datetime as dt
import os
import platform
from importlib import metadata
from typing import Any


def stamp(**machine: Any) -> dict[str, Any]:
    """``time`` (UTC, ISO) and ``machine`` (Python, torch, cores, platform, and what the
    benchmark adds: its load averages, memory)."""
    try:
        torch_version: str | None = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    return {"time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": {"python": platform.python_version(), "torch": torch_version,
                        "cpus": os.cpu_count(), "platform": platform.platform(), **machine}}
