"""One interface for every place a step can be restored from.

A tier keeps the state of saved steps somewhere: the live peers' memory (peertier.py),
the machines' own disks (nodelocal.py), the persistent checkpoint directory
(persistent.py). The manager holds an ordered list of tiers, fastest first, and knows no
kind: a save goes to every tier that takes it (:meth:`Tier.takes`), a restore takes the
first tier that can serve every rank (:meth:`Tier.restore`), each faster one saying why
not in one line. Adding a tier is one class (tests/test_tiers.py adds one).

The models are Orbax's emergency checkpoint manager (a local and a persistent tier behind
one manager, the local one restored first where every process has it) and torchft's
checkpoint transports (how the state moves, apart from where it is kept: transport/).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..storage.base import Storage
from .early import Early
from .restored import Restored


@dataclass(frozen=True)
class SaveRequest:
    """One save, as every tier sees it: decided alike on every rank."""

    step: int
    persistent: bool    # it must reach the persistent tier (the cadence, a final save)
    node_local: bool    # False: the caller keeps it off the machines' disks
    sharded: bool       # the state holds DTensors: DCP writes it (commit/sharded.py)


class Tier(Protocol):
    """A place a step can be restored from. Every method is called on every rank alike;
    ``write`` on the writer thread, the others on the training thread."""

    name: str                 # the job record's key: "peer", "node-local", "persistent"
    # What its saves are written to, for the save's progress lines; None: memory.
    storage: Storage | None

    def takes(self, save: SaveRequest) -> bool:
        """Whether ``save`` goes to this tier."""

    def needs_shared(self, save: SaveRequest) -> bool:
        """Whether this rank's snapshot must hold the replicated state for this tier."""

    def write(self, save: SaveRequest, snap: dict[str, Any],
              ready: Callable[[], None]) -> bool:
        """Writer thread: keep ``snap`` as ``save.step`` (``ready()`` first waits for the
        snapshot's deferred copies). True once kept; False where the tier itself chose
        to tolerate the failure (a machine's disk: the save still reaches storage).
        Raises what must fail the save."""

    def restore(self, sharded: bool) -> Restored | str:
        """A collective: the newest step this tier can give every rank, moved to the
        ranks that lack it, or why it cannot, in one line (every rank gets the same
        answer). Why the faster tiers could not is the chain's to add to the record."""

    def begin_restore(self) -> Early[Restored] | None:
        """A collective at a life's start, before the model is built: a restore started
        in a thread, to run meanwhile (it needs no tracked object), or None."""

    def restored(self, got: Restored) -> None:
        """A restore from any tier was loaded: what this tier learns from it."""

    def hand_over(self, step: int) -> None:
        """The life ends on an error after ``step`` steps: keep what the next life of
        this process can restore from."""

    def close(self) -> None:
        """The life ends: let go of connections and threads."""


class TierDefaults:
    """The no-op half of :class:`Tier`, for tiers that need only some of it."""

    storage: Storage | None = None

    def needs_shared(self, save: SaveRequest) -> bool:
        return False

    def begin_restore(self) -> Early[Restored] | None:
        return None

    def restored(self, got: Restored) -> None:
        return None

    def hand_over(self, step: int) -> None:
        return None

    def close(self) -> None:
        return None
