"""Move a state tree from one rank of a process group to another.

A tree (what :func:`~.state.collect` returns: dicts, lists, tensors, plain values) travels
as a small *skeleton* (the tree with every tensor replaced by an empty one of its dtype,
serialized with ``torch.save`` and read back ``weights_only``, so a peer's bytes can never
run code) and then the tensor data itself, raw, with no serialization: each large tensor
as one message straight from its memory, the small ones packed together so that a state
of many small tensors (optimizer step counters) costs a few messages, not thousands.

Both sides walk the tensors in the same order (the skeleton's), so a receiver needs no
per-tensor header. Everything here runs over a gloo group on CPU tensors: the one group
every backend has (schedule/coordination.py). Tensors on an accelerator are copied to the host on
the sender and land on the host on the receiver; ``load_state_dict`` moves them back.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..progress import Progress
from ..state.capture import tree_map_tensors

# Tensors up to this size are packed into shared messages of up to PACK_BYTES each.
SMALL_BYTES = 1 << 20
PACK_BYTES = 32 << 20


@dataclass(frozen=True)
class Moved:
    """What one transfer carried: the tree, and the bytes of its tensor data."""

    tree: Any
    nbytes: int


def _split(tree: Any) -> tuple[bytes, list[torch.Tensor]]:
    """The skeleton's bytes and the unique tensors, in the skeleton's walking order."""
    tensors: list[torch.Tensor] = []
    index: dict[int, int] = {}
    order: list[int] = []   # per placeholder: which tensor (tied weights travel once)

    def placeholder(t: torch.Tensor) -> torch.Tensor:
        i = index.get(id(t))
        if i is None:
            i = index[id(t)] = len(tensors)
            tensors.append(t)
        order.append(i)
        return torch.empty(0, dtype=t.dtype)

    skeleton = tree_map_tensors(placeholder, tree)
    shapes = [list(t.shape) for t in tensors]
    dtypes = [str(t.dtype).removeprefix("torch.") for t in tensors]
    buf = io.BytesIO()
    torch.save({"tree": skeleton, "order": order, "shapes": shapes, "dtypes": dtypes}, buf)
    return buf.getvalue(), tensors


def _join(header: bytes) -> tuple[Any, list[torch.Tensor]]:
    """The skeleton and fresh (empty) host tensors to receive into, from a header."""
    meta = torch.load(io.BytesIO(header), map_location="cpu", weights_only=True)
    tensors = [torch.empty(shape, dtype=getattr(torch, dtype))
               for shape, dtype in zip(meta["shapes"], meta["dtypes"])]
    it: Iterator[int] = iter(meta["order"])
    tree = tree_map_tensors(lambda _t: tensors[next(it)], meta["tree"])
    return tree, tensors


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of ``t``'s data on the host (a copy only when it must be)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def _messages(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Which tensors go in which message: a large one alone, small ones packed in order.
    Computed from shapes and dtypes alone, so sender and receiver agree."""
    out: list[list[int]] = []
    pack: list[int] = []
    packed = 0
    for i, t in enumerate(tensors):
        n = t.numel() * t.element_size()
        if n == 0:
            continue
        if n > SMALL_BYTES:
            out.append([i])
            continue
        if packed + n > PACK_BYTES and pack:
            out.append(pack)
            pack, packed = [], 0
        pack.append(i)
        packed += n
    if pack:
        out.append(pack)
    return out


def _payload(tensors: list[torch.Tensor], message: list[int]) -> torch.Tensor:
    if len(message) == 1:
        return _bytes_of(tensors[message[0]])
    return torch.cat([_bytes_of(tensors[i]) for i in message])


def _unpack(tensors: list[torch.Tensor], message: list[int], data: torch.Tensor) -> None:
    if len(message) == 1:
        return   # received in place
    at = 0
    for i in message:
        view = _bytes_of(tensors[i])
        view.copy_(data[at:at + view.numel()])
        at += view.numel()


def _recv_target(tensors: list[torch.Tensor], message: list[int]) -> torch.Tensor:
    if len(message) == 1:
        return _bytes_of(tensors[message[0]])   # a view: the data lands in the tensor
    size = sum(tensors[i].numel() * tensors[i].element_size() for i in message)
    return torch.empty(size, dtype=torch.uint8)


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def send_tree(tree: Any, dst: int, group: Any, progress: Progress | None = None) -> int:
    """Send ``tree`` to rank ``dst`` (which calls :func:`recv_tree`); returns data bytes.
    ``progress`` learns the total and counts each message as it leaves."""
    import torch.distributed as dist

    header, tensors = _split(tree)
    if progress is not None:
        progress.total = _nbytes(tensors)
    dist.send(torch.tensor([len(header)], dtype=torch.int64), dst, group=group)
    dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8), dst, group=group)
    for message in _messages(tensors):
        payload = _payload(tensors, message)
        dist.send(payload, dst, group=group)
        if progress is not None:
            progress.add(payload.numel() * payload.element_size())
    return _nbytes(tensors)


def recv_tree(src: int, group: Any, progress: Progress | None = None) -> Moved:
    """The tree that rank ``src`` sends with :func:`send_tree`; ``progress`` learns the
    total from the skeleton and counts each message as it lands."""
    import torch.distributed as dist

    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    header = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(header, src, group=group)
    tree, tensors = _join(header.numpy().tobytes())
    if progress is not None:
        progress.total = _nbytes(tensors)
    for message in _messages(tensors):
        data = _recv_target(tensors, message)
        dist.recv(data, src, group=group)
        _unpack(tensors, message, data)
        if progress is not None:
            progress.add(data.numel())
    return Moved(tree, _nbytes(tensors))
