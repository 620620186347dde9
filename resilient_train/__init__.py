"""resilient-train: PyTorch training that survives restarts, preemptions and crashes.

The light parts (exit codes, cluster environment) import at once; the parts that need
torch load on first use, so the launcher and the CLI start fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .cluster import ClusterInfo, ClusterSpecError
from .errors import (
    EXIT_PERMANENT,
    EXIT_TRANSIENT,
    PermanentError,
    TransientError,
    exit_permanent,
    exit_transient,
    record,
)

__version__ = "0.1.0"

_LAZY = {
    "CheckpointManager": "resilient_train.checkpoint.manager",
    "CheckpointOptions": "resilient_train.checkpoint.manager",
    "RetentionPolicy": "resilient_train.checkpoint.commit.retention",
    "NodeLocal": "resilient_train.checkpoint.tiers.nodelocal",
    "every_n_steps": "resilient_train.checkpoint.schedule.policies",
    "auto_interval": "resilient_train.checkpoint.schedule.policies",
    "never": "resilient_train.checkpoint.schedule.policies",
    "every": "resilient_train.checkpoint.schedule.policies",
    "RetryOptions": "resilient_train.checkpoint.storage.base",
    "main": "resilient_train.runtime",
    "Context": "resilient_train.runtime",
    "MainOptions": "resilient_train.runtime",
    "ResumableLoader": "resilient_train.data",
    "ResumableSampler": "resilient_train.data",
    "init_distributed": "resilient_train.distributed.group",
    "DistributedGroup": "resilient_train.distributed.group",
    "DistributedOptions": "resilient_train.distributed.group",
    "is_peer_failure": "resilient_train.distributed.group",
    "BarrierTimeoutError": "resilient_train.distributed.errors",
    "PeerRestartedError": "resilient_train.distributed.errors",
    "PrimaryUnreachableError": "resilient_train.distributed.errors",
    "RendezvousTimeoutError": "resilient_train.distributed.errors",
}

__all__ = [
    "EXIT_PERMANENT", "EXIT_TRANSIENT", "ClusterInfo", "ClusterSpecError", "PermanentError",
    "TransientError", "exit_permanent", "exit_transient", "record",
    # loaded on first use (see _LAZY)
    "CheckpointManager", "CheckpointOptions", "NodeLocal", "RetentionPolicy", "RetryOptions", "every", "auto_interval",
    "every_n_steps", "never", "main", "Context", "MainOptions", "ResumableLoader", "ResumableSampler", "init_distributed", "DistributedGroup", "DistributedOptions",
    "is_peer_failure", "BarrierTimeoutError", "PeerRestartedError", "PrimaryUnreachableError",
    "RendezvousTimeoutError",
]

if TYPE_CHECKING:
    from .checkpoint.commit.retention import RetentionPolicy
    from .checkpoint.manager import CheckpointManager, CheckpointOptions
    from .checkpoint.schedule.policies import auto_interval, every, every_n_steps, never
    from .checkpoint.storage.base import RetryOptions
    from .checkpoint.tiers.nodelocal import NodeLocal
    from .data import ResumableLoader, ResumableSampler
    from .distributed.errors import (
        BarrierTimeoutError,
        PeerRestartedError,
        PrimaryUnreachableError,
        RendezvousTimeoutError,
    )
    from .distributed.group import (
        DistributedGroup,
        DistributedOptions,
        init_distributed,
        is_peer_failure,
    )
    from .runtime import Context, MainOptions, main


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'resilient_train' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    # The lazily loaded names too: dir() and tab completion show the whole API.
    return sorted(set(globals()) | set(__all__))
