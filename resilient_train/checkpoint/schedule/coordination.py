"""How the ranks of one job agree on checkpoint decisions.

Two gloo groups, one per thread: the training thread's group carries the rare save
decisions (the time-based trigger, which step to restore) and the writer thread's group
carries the commit (every rank's file list to the primary). Each group is only ever used
from one thread, so collectives can never interleave in different orders across ranks.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any, Protocol


class Coordinator(Protocol):
    rank: int
    world_size: int

    def broadcast(self, obj: Any) -> Any:
        """The primary's ``obj`` on every rank (training thread)."""

    def allreduce_max(self, values: Sequence[int]) -> list[int]:
        """Element-wise max over ranks (training thread)."""

    def gather(self, payload: Any) -> list[Any] | None:
        """Every rank's payload on the primary, None elsewhere (writer thread)."""

    def allgather(self, payload: Any) -> list[Any]:
        """Every rank's payload on every rank, in rank order (training thread)."""

    def writer_barrier(self) -> None:
        """Every rank has reached this point of its writes (writer thread)."""


class SingleProcess:
    rank = 0
    world_size = 1

    def broadcast(self, obj: Any) -> Any:
        return obj

    def allreduce_max(self, values: Sequence[int]) -> list[int]:
        return list(values)

    def gather(self, payload: Any) -> list[Any] | None:
        return [payload]

    def allgather(self, payload: Any) -> list[Any]:
        return [payload]

    def writer_barrier(self) -> None:
        return None


class TorchDistributed:
    """Over an initialised default process group (any backend: the groups here are gloo)."""

    def __init__(self, timeout_s: float = 600.0) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        from torch.distributed.distributed_c10d import _set_pg_timeout

        # new_group is collective: every rank creates both, in this order, here. Connecting
        # gets a short timeout (a peer dying meanwhile must not stall us for long); the
        # collectives then get the full one.
        connect = datetime.timedelta(seconds=min(30.0, timeout_s))
        self._main = dist.new_group(backend="gloo", timeout=connect)
        self._writer = dist.new_group(backend="gloo", timeout=connect)
        for group in (self._main, self._writer):
            _set_pg_timeout(datetime.timedelta(seconds=timeout_s), group)

    def broadcast(self, obj: Any) -> Any:
        box = [obj if self.rank == 0 else None]
        self._dist.broadcast_object_list(box, src=0, group=self._main)
        return box[0]

    def allreduce_max(self, values: Sequence[int]) -> list[int]:
        import torch

        t = torch.tensor(list(values), dtype=torch.int64)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self._main)
        return [int(v) for v in t.tolist()]

    def gather(self, payload: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        self._dist.gather_object(payload, out, dst=0, group=self._writer)
        return out

    def allgather(self, payload: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, payload, group=self._main)
        return out

    def writer_barrier(self) -> None:
        self._dist.barrier(group=self._writer)

    @property
    def main_group(self) -> Any:
        """The training thread's gloo group (decisions, restore)."""
        return self._main

    @property
    def writer_group(self) -> Any:
        """The writer thread's gloo group (commits, DCP saves)."""
        return self._writer

    def close(self) -> None:
        for group in (self._main, self._writer):
            try:
                self._dist.destroy_process_group(group)
            except (RuntimeError, ValueError):
                pass


def default_coordinator() -> Coordinator:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return SingleProcess()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchDistributed()
    return SingleProcess()
