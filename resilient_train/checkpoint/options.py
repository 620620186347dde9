"""The checkpoint manager's options: when to save, what to keep, how to write, which tiers.

Checked when built: a contradiction or a value out of range raises at once, naming the
option and what it takes, not at the first save hours later.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..validate import NONE, expect_type, options
from .commit.retention import RetentionPolicy
from .schedule.policies import FOUR_HOURS, SavePolicy, check_ceiling, every_n_steps, with_ceiling
from .storage.base import RetryOptions
from .tiers.nodelocal import NodeLocal


def _positive_seconds(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and 0 < value < math.inf)


@options
@dataclass(frozen=True)
class CheckpointOptions:
    """When to save, what to keep, how to write. One way to say when: ``save_every_steps=N``
    is short for ``policy=every_n_steps(N)``; either way the 4-hour ceiling
    (``max_interval_s``) joins it unless removed by name. Contradictions raise at once."""

    save_every_steps: int | None = None     # short for policy=every_n_steps(N)
    # The platform: a checkpoint at most 4 hours old, whatever the policy; None: no ceiling.
    max_interval_s: float | None = FOUR_HOURS
    policy: SavePolicy | None = None        # the general way; auto_interval() picks the
                                            # interval that maximizes goodput
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    async_save: bool = True
    retry: RetryOptions = field(default_factory=RetryOptions)
    storage_options: Mapping[str, Any] | None = None
    # Multi-rank: how often the ranks agree on the clock (time-based saves, SIGTERM).
    sync_interval_s: float = 1.0
    # None: not said here (the manager alone: off; under @rt.main: MainOptions decides, on).
    save_on_sigterm: bool | None = None
    # SIGTERM to SIGKILL: the emergency save commits within it or is abandoned
    # (schedule/emergency.py). None: $RESILIENT_TRAIN_SIGTERM_GRACE_S (the launcher's --grace), else
    # 30 s (a Spot VM's, the shortest the platform gives).
    sigterm_grace_s: float | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)   # JSON, in every manifest
    # Multi-rank: after a peer's restart, restore from the survivors' memory instead of
    # storage (tiers/peers.py). Costs each step a ring message of about 15 KB.
    peer_recovery: bool = True
    # Multi-rank, with peer_recovery: copy the parameters and optimizer state as each
    # step's first optimizer step begins, so that a survivor of a peer lost after it (a
    # GAN's second optimizer, a metric all-reduced after opt.step()) is taken back to the
    # step's start and recovers from memory, not from the last save. Costs that copy every
    # step, in memory on the parameters' device (state/stepwrites.py).
    undo_torn_steps: bool = False
    # An async save copies parameters and optimizer state to the host while the next step
    # computes; only the next optimizer step waits for that copy (state.HostSnapshot).
    overlap_snapshot: bool = True
    # A node-local tier (the machine's own disk) that every save goes to, the persistent
    # one (the checkpoint directory) every NodeLocal.persistent_every-th save: tiers/nodelocal.py.
    node_local: NodeLocal | None = None

    def __post_init__(self) -> None:
        n = self.save_every_steps
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"CheckpointOptions.save_every_steps={n!r}: expected a whole "
                             f"number >= 1, or None (no step-based saves)")
        expect_type("CheckpointOptions.policy", self.policy, (SavePolicy, NONE),
                    "a save policy such as rt.every_n_steps(1000) or rt.auto_interval()")
        if n is not None and self.policy is not None:
            raise ValueError(
                f"CheckpointOptions: save_every_steps={n} and policy={self.policy!r} both say "
                f"when to save; give one: policy=rt.every_n_steps({n}) | <your policy> "
                f"saves at whichever comes first")
        m = self.max_interval_s
        if m is not None and not _positive_seconds(m):
            raise ValueError(f"CheckpointOptions.max_interval_s={m!r}: expected a positive, "
                             f"finite number of seconds, or None (no ceiling)")
        if self.policy is not None:
            check_ceiling(self.policy, m)
        expect_type("CheckpointOptions.retention", self.retention, RetentionPolicy,
                    "rt.RetentionPolicy(keep_last=...)")
        expect_type("CheckpointOptions.retry", self.retry, RetryOptions, "rt.RetryOptions(...)")
        expect_type("CheckpointOptions.async_save", self.async_save, bool, "True or False")
        expect_type("CheckpointOptions.peer_recovery", self.peer_recovery, bool,
                    "True or False")
        expect_type("CheckpointOptions.undo_torn_steps", self.undo_torn_steps, bool,
                    "True or False")
        if self.undo_torn_steps and not self.peer_recovery:
            raise ValueError("CheckpointOptions: undo_torn_steps=True takes a torn step back "
                             "for peer recovery, which peer_recovery=False turns off: drop "
                             "one of them")
        expect_type("CheckpointOptions.overlap_snapshot", self.overlap_snapshot, bool,
                    "True or False")
        expect_type("CheckpointOptions.node_local", self.node_local, (NodeLocal, NONE),
                    "rt.NodeLocal(...), or None (no node-local tier)")
        expect_type("CheckpointOptions.save_on_sigterm", self.save_on_sigterm, (bool, NONE),
                    "True or False or None")
        g = self.sigterm_grace_s
        if g is not None and not _positive_seconds(g):
            raise ValueError(f"CheckpointOptions.sigterm_grace_s={g!r}: expected the "
                             f"SIGTERM-to-SIGKILL grace period in seconds (30 on a Spot VM, "
                             f"120 on a standard one), or None")
        if not _positive_seconds(self.sync_interval_s):
            raise ValueError(f"CheckpointOptions.sync_interval_s={self.sync_interval_s!r}: "
                             f"expected a positive, finite number of seconds")
        expect_type("CheckpointOptions.storage_options", self.storage_options, (Mapping, NONE),
                    "a dict of fsspec options, or None")
        try:  # here, not at the first save hours from now (commit/manifest.py writes it so)
            json.dumps(dict(self.metadata), sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"CheckpointOptions.metadata cannot be written into the "
                             f"manifest as JSON ({exc}): keep to str keys and str, number, "
                             f"bool, None, list or dict values") from None

    def save_policy(self) -> SavePolicy:
        """The policy the manager follows: ``policy`` (or every ``save_every_steps``) or
        ``max_interval_s`` after the last commit, whichever comes first."""
        given = self.policy
        if given is None and self.save_every_steps is not None:
            given = every_n_steps(self.save_every_steps)
        return with_ceiling(given, self.max_interval_s)
