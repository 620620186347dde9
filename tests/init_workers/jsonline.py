"""The workers' one JSON line of results."""

from __future__ import annotations

import json
import sys
from typing import Any


def emit(record: dict[str, Any]) -> None:
    """One line in one write: ranks may share a stdout pipe (torchrun's), and under
    PYTHONUNBUFFERED a print writes a line and its newline apart, so two ranks' lines could
    interleave."""
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()
