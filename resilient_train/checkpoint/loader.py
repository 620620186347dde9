"""Loading one verified file of a committed step with torch, and nothing that runs code.

Apart from directory.py so that listing a directory never imports torch; restore and the
deep check (:func:`~.directory.verify_step`) both load through :func:`load_verified`.
"""

from __future__ import annotations

import io
import mmap
import os
from typing import Any

import torch

from .manifest import (
    CorruptCheckpointError,
    Crc32c,
    FileEntry,
    Manifest,
    check_entry,
    manifest_entry,
    read_verified,
)
from .state import weights_only_refusal
from .storage import Storage


def _verify_local_file(path: str, entry: FileEntry, where: str) -> None:
    """Checksum a local file through a memory map: no copy, and the pages it faults in
    are the ones torch.load(mmap=True) then uses."""
    crc = Crc32c()
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    crc.update(mm)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: missing") from None
    check_entry(FileEntry(crc.size, crc.hexdigest()), entry, where)


def load_verified(storage: Storage, name: str, fname: str, manifest: Manifest) -> dict[str, Any]:
    """``name/fname`` as a dict, once its size and checksum match the manifest; loaded
    weights-only (a file that would run code is refused) onto the CPU, memory-mapped where
    the file has a local path."""
    rel = f"{name}/{fname}"
    where = storage.url_of(rel)
    path = storage.local_path(rel)
    try:
        if path is not None:
            _verify_local_file(path, manifest_entry(manifest, fname, where), where)
            source: Any = path
        else:
            source = io.BytesIO(read_verified(storage, name, fname, manifest))
        obj = torch.load(source, map_location="cpu", weights_only=True, mmap=path is not None)
    except CorruptCheckpointError:
        raise
    except Exception as exc:  # a checksum-valid file that torch cannot read
        # The reason without torch's advice to load with weights_only=False, which is
        # exactly wrong for a file that may have been tampered with.
        raise CorruptCheckpointError(
            f"{where}: unreadable as a weights-only torch file, refused without running "
            f"anything ({type(exc).__name__}: {weights_only_refusal(exc)})") from None
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"{where}: not a checkpoint file")
    return obj
