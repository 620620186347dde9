"""The checkpoint errors a save raises to the training loop, transient or permanent for the
exit code (errors.py's taxonomy). A checkpoint that does not verify is
commit/manifest.py's CorruptCheckpointError."""

from __future__ import annotations

from ..errors import PermanentError, TransientError
from .commit.manifest import CheckpointError


class TransientCheckpointError(CheckpointError, TransientError):
    """A background save failed for a reason that a retry can fix (storage, network)."""


class CheckpointStorageFullError(CheckpointError, PermanentError):
    """A save ran out of space (ENOSPC / EDQUOT). Nothing was committed, what the save wrote
    is removed, the last committed step is kept; the next save tries again. Permanent for
    the exit code: a rerun fills the same disk unless someone frees space."""

    def __init__(self, message: str, *, directory: str | None, needed_bytes: int,
                 free_bytes: int | None) -> None:
        super().__init__(message)
        self.directory = directory
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes
