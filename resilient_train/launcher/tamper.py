"""What the ``wipe`` and ``corrupt`` chaos faults do to a replica's node-local disk.

A wipe empties the directory, as a replacement VM would, while the replica keeps running:
the next restore that looks there finds nothing. A corruption flips one byte in the middle
of the largest file of the newest committed checkpoint step found on the disk (any
directory ``step-N`` holding the commit marker, at any depth): a restore must find it by
its checksum and fall back, never load it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..checkpoint.commit.directory import parse_step
from ..checkpoint.commit.manifest import MARKER


def wipe_disk(root: Path) -> list[str]:
    """Empty ``root``; the names of what was there."""
    if not root.is_dir():
        return []
    gone = sorted(p.name for p in root.iterdir())
    for entry in root.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    return gone


def corrupt_newest_checkpoint(root: Path) -> Path | None:
    """Flip a byte of the newest committed step's largest file under ``root``; that file,
    or None when there is no committed step."""
    steps = [(step, d) for d in root.rglob("*") if d.is_dir() and (d / MARKER).exists()
             and (step := parse_step(d.name)) is not None]
    if not steps:
        return None
    _, newest = max(steps, key=lambda s: s[0])
    files = [f for f in newest.iterdir() if f.is_file() and f.name != MARKER]
    if not files:
        return None
    target = max(files, key=lambda f: f.stat().st_size)
    with open(target, "r+b") as f:
        size = f.seek(0, 2)
        if size == 0:
            return None
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    return target
