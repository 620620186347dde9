"""One interface for moving state between two ranks; the tiers say what and to whom.

A tier picks a transport and never implements one: the plan's moves (tiers/plan.py), a
sharded save's copies to the next rank (tiers/shards.py) and the node-local tier's
transfers all go through a :class:`Transport`. The one here, :class:`GroupTransport`,
runs over a gloo process group, point to point; a tree travels as a skeleton and raw
tensor data (transfer.py), bytes as a length and the bytes. torchft's checkpoint
transports (over HTTP, or a process group) are the model: another transport (NCCL, RDMA)
is another class with these methods.

The other two ways state moves are shaped by what they move, not by who sends it: the
per-step ring of each rank's own state (ringlink.py, a TCP stream between neighbours,
open for the whole life) and a file read once from storage and streamed to every rank
(readonce.py, a broadcast).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..progress import Progress
from .transfer import Moved, recv_tree, send_tree


class Transport(Protocol):
    """Point to point between this rank and another; both ends call in the same order."""

    def send_tree(self, tree: Any, dst: int, progress: Progress | None = None) -> int:
        """A state tree to ``dst``; returns its tensors' bytes."""

    def recv_tree(self, src: int, progress: Progress | None = None) -> Moved:
        """The tree ``src`` sends."""

    def send_bytes(self, data: bytes, dst: int) -> None: ...

    def recv_bytes(self, src: int) -> bytes: ...

    def exchange(self, data: bytes, nxt: int, prev: int) -> bytes:
        """``data`` to ``nxt`` and, at once, what ``prev`` sends: every rank of a ring
        calls it together, and none waits on another's send."""


class GroupTransport:
    """Over a torch.distributed process group (gloo; None: the default group)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def send_tree(self, tree: Any, dst: int, progress: Progress | None = None) -> int:
        return send_tree(tree, dst, self.group, progress)

    def recv_tree(self, src: int, progress: Progress | None = None) -> Moved:
        return recv_tree(src, self.group, progress)

    def send_bytes(self, data: bytes, dst: int) -> None:
        import torch.distributed as dist

        dist.send(torch.tensor([len(data)], dtype=torch.int64), dst, group=self.group)
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, group=self.group)

    def recv_bytes(self, src: int) -> bytes:
        import torch.distributed as dist

        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, src, group=self.group)
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(buf, src, group=self.group)
        return buf.numpy().tobytes()

    def exchange(self, data: bytes, nxt: int, prev: int) -> bytes:
        import torch.distributed as dist

        size_in = torch.zeros(1, dtype=torch.int64)
        for req in (dist.isend(torch.tensor([len(data)], dtype=torch.int64), nxt,
                               group=self.group),
                    dist.irecv(size_in, prev, group=self.group)):
            req.wait()
        got = torch.empty(int(size_in.item()), dtype=torch.uint8)
        out = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        for req in (dist.isend(out, nxt, group=self.group),
                    dist.irecv(got, prev, group=self.group)):
            req.wait()
        return got.numpy().tobytes()
