"""Write a stream (torch.save's output) to a local file with O_DIRECT.

Buffered writes + fsync reach about half of what the local disk does with O_DIRECT
(docs/libraries.md, "Local disk and torch"), and they fill the page cache with dirty pages
that the kernel may make the training thread wait on. ``DirectWriter`` copies the stream
into a few reused, page-aligned buffers; a helper thread writes every full buffer with
``os.pwrite`` on the file descriptor switched to O_DIRECT (the GIL is released meanwhile,
so serialization and the disk overlap). The tail that is not a multiple of the block size
is written after clearing O_DIRECT again. The caller still fsyncs the file (the size and
the block map are metadata that O_DIRECT does not make durable).

Where the file system refuses O_DIRECT, ``DirectWriter.open`` returns None and the caller
keeps its buffered path; a refusal met later (EINVAL on the first direct write) switches
that file to buffered ``pwrite`` without failing the save.

``PartBuffers`` is the memory bound of a parallel upload to an object store
(storage/objectstore.py): a fixed number of equal buffers that the writer fills and the upload
threads give back, so a file of any size costs at most ``count * size`` bytes of memory.

``SeekableReader`` is the seeking half of a raw reader over bytes that are not a local file
(an object's ranged reads, a received buffer); its subclasses read.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import logging
import mmap
import os
import queue
import threading

from ..commit.manifest import Crc32c

log = logging.getLogger(__name__)

# Offsets, lengths and buffer addresses of O_DIRECT I/O must be multiples of the device's
# logical block size: 4096 covers 512-byte and 4K-sector disks alike.
ALIGN = 4096
BUFFER_SIZE = 16 << 20
BUFFERS = 4
# Off: callers take their buffered path (an escape hatch, and A/B benchmarks).
ENABLED = True

_O_DIRECT: int = getattr(os, "O_DIRECT", 0)


class _BufferPool:
    """Aligned buffers kept between saves: fresh pages cost a fault each, about as much as
    the copy itself (docs/libraries.md, "Local disk and torch")."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._free: dict[int, list[mmap.mmap]] = {}
        self._lock = threading.Lock()

    def take(self, size: int) -> mmap.mmap:
        with self._lock:
            free = self._free.get(size)
            if free:
                return free.pop()
        return mmap.mmap(-1, size)  # anonymous mappings are page-aligned

    def give(self, buf: mmap.mmap) -> None:
        with self._lock:
            free = self._free.setdefault(len(buf), [])
            if len(free) < self._keep:
                free.append(buf)
                return
        buf.close()


class PartBuffers:
    """At most ``count`` buffers of ``size`` bytes each: ``take`` blocks while all are out,
    ``give`` returns one. The memory bound of one parallel upload, whatever the file's size.

    Buffers are anonymous mappings made on first need (pages are faulted in only where
    written: a small file costs what it holds) and unmapped by ``close``; none are kept
    between files, so a process that saves to an object store holds no memory for it
    between saves. ``in_use`` and ``peak`` count buffers out at once (tests check the bound
    with them, benchmarks report them).
    """

    def __init__(self, count: int, size: int) -> None:
        if count < 1 or size < 1:
            raise ValueError(f"PartBuffers needs count >= 1 and size >= 1, got {count} "
                             f"and {size}")
        self.count = count
        self.size = size
        self._free: list[mmap.mmap] = []
        self._made = 0
        self.in_use = 0
        self.peak = 0
        self._closed = False
        self._cond = threading.Condition()

    def take(self) -> mmap.mmap:
        """A free buffer; waits while ``count`` are out."""
        with self._cond:
            while not self._free and self._made >= self.count:
                if self._closed:
                    raise ValueError("take from closed PartBuffers")
                self._cond.wait()
            if self._closed:
                raise ValueError("take from closed PartBuffers")
            if self._free:
                buf = self._free.pop()
            else:
                buf = mmap.mmap(-1, self.size)  # page-aligned, zero pages until written
                self._made += 1
            self.in_use += 1
            self.peak = max(self.peak, self.in_use)
            return buf

    def give(self, buf: mmap.mmap) -> None:
        with self._cond:
            self.in_use -= 1
            if self._closed:
                _unmap(buf)
            else:
                self._free.append(buf)
            self._cond.notify()

    def close(self) -> None:
        """Unmap the free buffers now; those still out are unmapped when given back."""
        with self._cond:
            self._closed = True
            free, self._free = self._free, []
            self._cond.notify_all()
        for buf in free:
            _unmap(buf)


def _unmap(buf: mmap.mmap) -> None:
    # A request that was cancelled may still hold a view of it (BufferError): then the
    # mapping goes when that view does.
    with contextlib.suppress(BufferError):
        buf.close()


# At most one writer's worth (64 MiB) stays allocated between saves.
_POOL = _BufferPool(keep=BUFFERS)


def _enable_direct(fd: int) -> int | None:
    """Switch fd to O_DIRECT; return its previous flags, or None when refused."""
    if not _O_DIRECT:
        return None
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            raise
        log.debug("O_DIRECT refused on fd %d (%s): buffered writes", fd, exc)
        return None
    return flags


class DirectWriter:
    """A write-only file object over ``fd`` (positioned at 0, empty) that writes with
    O_DIRECT; ``crc`` (if given) gets exactly the bytes written.

    Use ``open`` (None where O_DIRECT is refused); then ``write`` ..., and ``close()`` on
    success (writes the tail, raises the helper thread's error). ``abort()`` (always, e.g.
    in a ``finally``) stops the thread and returns the buffers; it never raises.
    """

    def __init__(self, fd: int, old_flags: int, *, crc: Crc32c | None = None,
                 buffer_size: int = BUFFER_SIZE, buffers: int = BUFFERS) -> None:
        if buffer_size <= 0 or buffer_size % ALIGN or buffers < 2:
            raise ValueError(f"buffer_size must be a positive multiple of {ALIGN} and "
                             f"buffers >= 2, found {buffer_size} and {buffers}")
        self._fd = fd
        self._old_flags = old_flags
        self._direct = True
        self.crc = crc
        self.size = 0  # bytes accepted by write()
        self._offset = 0  # file offset of the current buffer's first byte
        self._free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        self._full: queue.SimpleQueue[tuple[mmap.mmap, int, int] | None] = queue.SimpleQueue()
        self._bufs = [_POOL.take(buffer_size) for _ in range(buffers)]
        for b in self._bufs[1:]:
            self._free.put(b)
        self._cur: mmap.mmap = self._bufs[0]
        self._fill = 0
        self._error: BaseException | None = None
        self._done = False
        self._thread = threading.Thread(target=self._run, name="rt-ckpt-direct-write",
                                         daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, fd: int, *, crc: Crc32c | None = None, buffer_size: int = BUFFER_SIZE,
             buffers: int = BUFFERS) -> DirectWriter | None:
        """A writer over fd, or None where the file system refuses O_DIRECT."""
        old = _enable_direct(fd)
        if old is None:
            return None
        try:
            return cls(fd, old, crc=crc, buffer_size=buffer_size, buffers=buffers)
        except BaseException:
            fcntl.fcntl(fd, fcntl.F_SETFL, old)
            raise

    # -- the caller's side

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if self._done:  # its buffers may already serve another writer
            raise ValueError("write to a closed DirectWriter")
        if self._error is not None:
            raise self._error  # a disk error stops torch.save at its next write
        mv = memoryview(data)
        if mv.ndim != 1 or mv.format != "B":
            mv = mv.cast("B")
        if self.crc is not None:
            self.crc.update(mv)
        n = mv.nbytes
        pos = 0
        size = len(self._cur)
        while pos < n:
            k = min(n - pos, size - self._fill)
            self._cur[self._fill:self._fill + k] = mv[pos:pos + k]
            self._fill += k
            pos += k
            if self._fill == size:
                self._full.put((self._cur, size, self._offset))
                self._offset += size
                self._fill = 0
                self._cur = self._free.get()  # waits while the disk is behind
                if self._error is not None:
                    raise self._error
        self.size += n
        return n

    def flush(self) -> None:
        """Nothing: a partial block cannot be written with O_DIRECT; ``close`` writes it."""

    def close(self) -> None:
        """Write what is buffered, the unaligned tail with O_DIRECT cleared; then restore
        the fd's flags. The caller fsyncs."""
        if self._done:
            return
        aligned = self._fill - self._fill % ALIGN
        tail = self._cur
        if aligned:
            self._full.put((tail, aligned, self._offset))
        self._stop()
        if self._error is not None:
            raise self._error
        rest = self._fill - aligned
        fcntl.fcntl(self._fd, fcntl.F_SETFL, self._old_flags)
        if rest:
            _pwrite_all(self._fd, memoryview(tail)[aligned:self._fill], self._offset + aligned)
        self._release()

    def abort(self) -> None:
        """Stop the helper thread, restore the flags, return the buffers (idempotent)."""
        if self._done:
            return
        self._stop()
        try:
            fcntl.fcntl(self._fd, fcntl.F_SETFL, self._old_flags)
        except OSError:  # a closed fd: nothing left to restore
            pass
        self._release()

    def _stop(self) -> None:
        if self._thread.is_alive():
            self._full.put(None)
            self._thread.join()

    def _release(self) -> None:
        self._done = True
        for b in self._bufs:
            _POOL.give(b)
        self._bufs = []

    # -- the helper thread

    def _run(self) -> None:
        while (item := self._full.get()) is not None:
            buf, n, offset = item
            try:
                if self._error is None:
                    self._write_block(memoryview(buf)[:n], offset)
            except BaseException as exc:  # noqa: BLE001 - raised by the next write / close
                self._error = exc
            finally:
                self._free.put(buf)

    def _write_block(self, mv: memoryview, offset: int) -> None:
        if self._direct:
            try:
                _pwrite_all(self._fd, mv, offset)
                return
            except OSError as exc:
                # Flag accepted but I/O refused (alignment stricter than ALIGN, a file
                # system that checks only at write time, a short direct write that left an
                # unaligned offset): the file goes on buffered, this block rewritten whole
                # (pwrite is positional, so bytes already written are simply rewritten).
                if exc.errno != errno.EINVAL:
                    raise
                log.warning("O_DIRECT write refused (%s): this file continues buffered", exc)
                self._direct = False
                fcntl.fcntl(self._fd, fcntl.F_SETFL, self._old_flags)
        _pwrite_all(self._fd, mv, offset)


def _pwrite_all(fd: int, mv: memoryview, offset: int) -> None:
    while mv.nbytes:
        n = os.pwrite(fd, mv, offset)
        if n <= 0:
            raise OSError(errno.EIO, f"pwrite wrote {n} bytes")
        mv = mv[n:]
        offset += n


class SeekableReader(io.RawIOBase):
    """A raw reader over ``size`` bytes that seeks anywhere in them; a subclass implements
    ``readinto`` from ``self.pos`` (and moves it)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self.pos = base + offset
        return self.pos
