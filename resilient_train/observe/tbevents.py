"""Scalars in a TensorBoard event file, for any directory TensorBoard reads.

The messages are the ``tensorboard`` package's own protocol buffers (``Event``,
``Summary``); the file around them is TFRecord framing (a length, the data, a masked
CRC-32C of each), written here with the ``crc32c`` this package already needs. So a
writer costs one small import (the protos, a few tens of milliseconds), not the
package's ``EventFileWriter`` (which loads its TensorFlow stub, about half a second) nor
torch's ``SummaryWriter`` (which loads torch).

The event file is written locally. For a URL (``gs://bucket/run/logs``) the file is kept
in a local directory and copied to the URL on :meth:`ScalarWriter.flush`, at most every
``upload_every_s``, and on :meth:`ScalarWriter.close`: object stores cannot append, so
each copy replaces the object with the longer file, which TensorBoard reads on from where
it was.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import struct
import time
from pathlib import Path
from typing import IO, Any

import crc32c

log = logging.getLogger(__name__)

INSTALL_HINT = 'pip install "resilient-train[tensorboard]"'
_FILE_VERSION = "brain.Event:2"   # what TensorBoard's own writers put first
_MASK_DELTA = 0xA282EAD8


def tensorboard_installed() -> bool:
    """Whether the ``tensorboard`` package can be imported (looked up, not imported)."""
    try:
        return importlib.util.find_spec("tensorboard") is not None
    except (ImportError, ValueError):   # ValueError: sys.modules holds None for it
        return False


def is_url(path: str) -> bool:
    """Whether ``path`` is a URL such as ``gs://...`` rather than a local path."""
    return "://" in path and not path.startswith("file://")


def _masked_crc(data: bytes) -> int:
    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def frame(data: bytes) -> bytes:
    """One TFRecord: length, its masked CRC, the data, the data's masked CRC."""
    header = struct.pack("<Q", len(data))
    return (header + struct.pack("<I", _masked_crc(header)) + data
            + struct.pack("<I", _masked_crc(data)))


class ScalarWriter:
    """Writes scalars to one new event file under ``logdir`` (created at the first
    scalar, so a job that reports nothing leaves no empty file). ``staging``: where the
    file is kept when ``logdir`` is a URL. Raises ImportError without ``tensorboard``."""

    def __init__(self, logdir: str, *, staging: Path | None = None,
                 upload_every_s: float = 30.0) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        self.logdir = logdir.rstrip("/")
        self.remote = is_url(self.logdir)
        if self.remote and staging is None:
            raise ValueError(f"{logdir} is a URL: the writer needs a local staging directory")
        local = staging if self.remote else Path(self.logdir.removeprefix("file://"))
        assert local is not None
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                f"{os.getpid()}.resilient-train")
        self.path = local / name
        self.upload_every_s = upload_every_s
        self._file: IO[bytes] | None = None
        self._uploaded = -float("inf")    # monotonic time of the last copy to the URL
        self._dirty = False               # written since the last copy
        self._closed = False

    def scalar(self, tag: str, value: float, step: int, wall_time: float | None = None) -> None:
        """One point of ``tag``'s curve: ``value`` at ``step`` (``wall_time``: when it was
        true, epoch seconds; now when None)."""
        summary = self._summary_pb2.Summary(
            value=[self._summary_pb2.Summary.Value(tag=tag, simple_value=float(value))])
        self._write(self._event_pb2.Event(wall_time=time.time() if wall_time is None
                                          else wall_time, step=int(step), summary=summary))

    def flush(self, *, force_upload: bool = False) -> None:
        """Flush the file; for a URL, copy it there when ``upload_every_s`` has passed."""
        if self._file is None:
            return
        self._file.flush()
        if self.remote and self._dirty and (
                force_upload or time.monotonic() - self._uploaded >= self.upload_every_s):
            self._upload()

    def close(self) -> None:
        """Flush, copy to the URL one last time, close. Later calls do nothing."""
        self._closed = True
        if self._file is None:
            return
        try:
            self.flush(force_upload=True)
        finally:
            self._file.close()
            self._file = None

    def _write(self, event: Any) -> None:
        if self._closed:
            raise ValueError(f"{self.path}: the event file is closed")
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "ab")  # noqa: SIM115 - held open until close()
            first = self._event_pb2.Event(wall_time=time.time(), file_version=_FILE_VERSION)
            self._file.write(frame(first.SerializeToString()))
        self._file.write(frame(event.SerializeToString()))
        self._dirty = True

    def _upload(self) -> None:
        import fsspec

        fs, root = fsspec.core.url_to_fs(self.logdir)
        fs.put_file(str(self.path), f"{root.rstrip('/')}/{self.path.name}")
        self._uploaded = time.monotonic()
        self._dirty = False
