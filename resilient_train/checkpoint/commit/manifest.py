"""A checkpoint step on storage: its directory name, manifest, commit marker and checks.

A step exists for readers only when its marker is present, the marker names the
manifest's checksum, and (for a deep check) every file in the manifest has the recorded
size and crc32c, with no file the manifest does not know.
"""

from __future__ import annotations

import json
import mmap
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import crc32c as _crc32c

if TYPE_CHECKING:
    from ..storage.base import Storage

MANIFEST = "manifest.json"
MARKER = "COMMITTED"
FORMAT_VERSION = 1
# step-000000001200 (local commit) or step-000000001200-TOKEN (object-store commit).
_STEP_DIR = re.compile(r"^step-(\d{12})(?:-[0-9a-f]+)?$")


class CheckpointError(Exception):
    """Base of checkpoint errors."""


class CorruptCheckpointError(CheckpointError):
    """A committed step does not verify."""


def step_dirname(step: int) -> str:
    if step < 0:
        raise ValueError(f"a checkpoint step must be >= 0, found {step}")
    return f"step-{step:012d}"


def parse_step(name: str) -> int | None:
    m = _STEP_DIR.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


class Crc32c:
    """Streaming crc32c over any buffer, without copying it (and with the GIL released, so
    a background save does not stall the training thread)."""

    def __init__(self) -> None:
        self._crc = 0
        self.size = 0

    def update(self, data: bytes | bytearray | memoryview | mmap.mmap) -> None:
        self._crc = _crc32c.crc32c(data, value=self._crc)
        self.size += memoryview(data).nbytes

    def hexdigest(self) -> str:
        return f"{self._crc:08x}"  # the same digest as GCS's (big-endian hex)

    def entry(self) -> FileEntry:
        """What a manifest records of the bytes seen so far: their size and checksum."""
        return FileEntry(self.size, self.hexdigest())


def crc32c(data: bytes | memoryview) -> str:
    c = Crc32c()
    c.update(data)
    return c.hexdigest()


@dataclass(frozen=True)
class FileEntry:
    size: int
    crc32c: str


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    layout: str                               # "replicated" or "sharded"
    files: Mapping[str, FileEntry]            # relative to the step directory
    created: float = field(default_factory=time.time)
    version: int = FORMAT_VERSION
    library: str = ""
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        doc = {"version": self.version, "step": self.step, "world_size": self.world_size,
               "layout": self.layout, "created": self.created, "library": self.library,
               "metadata": dict(self.metadata),
               "files": {k: {"size": v.size, "crc32c": v.crc32c}
                         for k, v in sorted(self.files.items())}}
        return json.dumps(doc, indent=1, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Manifest:
        try:
            doc = json.loads(data)
            files = {str(k): FileEntry(int(v["size"]), str(v["crc32c"]))
                     for k, v in doc["files"].items()}
            return cls(step=int(doc["step"]), world_size=int(doc["world_size"]),
                       layout=str(doc["layout"]), files=files, created=float(doc["created"]),
                       version=int(doc["version"]), library=str(doc.get("library", "")),
                       metadata=dict(doc.get("metadata", {})))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptCheckpointError(f"{where}: the manifest is unreadable ({exc!r})") from None


def marker_bytes(manifest_data: bytes, step: int) -> bytes:
    return json.dumps({"step": step, "manifest_crc32c": crc32c(manifest_data)}).encode()


def check_marker(marker_data: bytes, manifest_data: bytes, step: int, where: str) -> None:
    try:
        doc = json.loads(marker_data)
        ok = doc["step"] == step and doc["manifest_crc32c"] == crc32c(manifest_data)
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise CorruptCheckpointError(
            f"{where}: the commit marker does not match the manifest (the manifest was changed "
            "or replaced after the commit)")


def manifest_entry(manifest: Manifest, fname: str, where: str) -> FileEntry:
    entry = manifest.files.get(fname)
    if entry is None:
        raise CorruptCheckpointError(f"{where}: not listed in the manifest")
    return entry


def check_entry(got: FileEntry, entry: FileEntry, where: str) -> None:
    if got != entry:
        raise CorruptCheckpointError(
            f"{where}: checksum mismatch (crc32c {got.crc32c}, {got.size} bytes; the manifest "
            f"says {entry.crc32c}, {entry.size} bytes)")


def read_verified(storage: Storage, name: str, fname: str, manifest: Manifest) -> bytes:
    """A file of step directory ``name``, read whole and checked against the manifest."""
    where = storage.url_of(f"{name}/{fname}")
    entry = manifest_entry(manifest, fname, where)
    try:
        data = storage.read_bytes(f"{name}/{fname}")
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: missing") from None
    crc = Crc32c()
    crc.update(data)
    check_entry(crc.entry(), entry, where)
    return data
