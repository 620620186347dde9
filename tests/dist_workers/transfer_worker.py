"""Three ranks move one state tree around: rank 0 sends it to rank 2 point to point (once
bare, once by a recovery plan whose send is held after its first message until rank 2 has
said how far it got), then streams a file of it to everyone (transport/readonce.py, in chunks much
smaller than the file), the same file where rank 2's manifest says another size, a
truncated copy, a copy whose read fails half-way, and last the file again while rank 2
dies after its first chunk. Each rank writes what it received and what it raised to
``$RESULT_DIR/rankR.pt``."""
import io
import logging
import os
import re
import time

import torch
import torch.distributed as dist

from resilient_train.checkpoint import progress
from resilient_train.checkpoint.commit.manifest import FileEntry, crc32c
from resilient_train.checkpoint.storage.base import Storage
from resilient_train.checkpoint.tiers.plan import Plan, carry_out, dumps_rank_state
from resilient_train.checkpoint.transport import readonce, transfer
from resilient_train.checkpoint.transport.channel import GroupTransport
from resilient_train.checkpoint.transport.transfer import recv_tree, send_tree


def tree() -> dict:
    g = torch.Generator().manual_seed(7)
    shared = torch.randn(3, 5, generator=g)
    return {
        "model": {"w": torch.randn(300, 1000, generator=g),          # 1.2 MB: its own message
                  "b": torch.randn(7, generator=g).to(torch.bfloat16),
                  "tied_a": shared, "tied_b": shared,
                  "mask": torch.rand(9, generator=g) > 0.5,
                  "empty": torch.empty(0, 4),
                  "t": torch.arange(6).reshape(2, 3).t()},           # not contiguous
        "optimizer": {"state": {0: {"step": torch.tensor(12.0)}},
                      "param_groups": [{"lr": 0.1, "params": [0]}]},
        "plain": ("a", 3, None, [1.5, {"k": b"bytes"}]),
    }


def entry_of(data: bytes) -> FileEntry:
    return FileEntry(len(data), crc32c(data))


def streamed(storage: Storage, rel: str, entry: FileEntry, rank: int) -> dict:
    """What read_once gave this rank: the tree, or the error's type and message."""
    read: list[int] = []
    try:
        got = readonce.read_once(storage, rel, entry, src=0, rank=rank, group=None,
                                 counted=read.append)
        ts = [got["model"]["w"], got["model"]["b"], got["optimizer"]["state"][0]["step"]]
        # Views of the received buffer: all of the data inside one file-sized span.
        span = max(t.data_ptr() + t.nbytes for t in ts) - min(t.data_ptr() for t in ts)
        return {"tree": got, "read": sum(read), "span": span}
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc), "read": sum(read)}


class FailsHalfWay:
    """Rank 0's reader of the third file: the read fails after 0.5 MB."""

    def __init__(self, f: io.BufferedReader) -> None:
        self.f, self.at = f, 0

    def readinto(self, view: memoryview) -> int:
        if self.at > 500_000:
            raise ConnectionResetError("the connection dropped half-way (injected)")
        n = self.f.readinto(view)
        self.at += n
        return n


def halves() -> dict:
    """Two tensors of 1.2 MB, a message each: held after the first, half has come."""
    g = torch.Generator().manual_seed(8)
    return {"a": torch.randn(300, 1000, generator=g), "b": torch.randn(300, 1000, generator=g)}


class Memory:
    """recovery_plan.Holdings: :func:`halves`, and each rank's own small state."""

    where = "memory"

    def shared(self, step: int) -> dict:
        return halves()

    def rank_state(self, rank: int, step: int, own: bool) -> bytes:
        return dumps_rank_state({"values": {"rank": rank}})


def by_plan(rank: int) -> list[str]:
    """Rank 2 receives the tree by a plan from rank 0, both with progress lines every 50
    ms; rank 0 holds the send after the first message until a line of each end shows bytes
    moved (a file per rank says so)."""
    def seen(r: int) -> str:
        return os.path.join(os.environ["RESULT_DIR"], f"progress-seen.{r}")

    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())
            if re.search(r": [1-9][0-9.]* (B|KiB|MiB) of ", lines[-1]):
                open(seen(rank), "a").close()

    progress.AFTER_S, progress.EVERY_S = 0.0, 0.05
    logging.getLogger(progress.__name__).addHandler(Lines())
    logging.getLogger(progress.__name__).setLevel(logging.INFO)
    if rank == 0:
        built, calls = transfer._payload, [0]

        def held(tensors: list, message: list) -> torch.Tensor:
            calls[0] += 1
            deadline = time.monotonic() + 60
            while calls[0] == 2 and not all(os.path.exists(seen(r)) for r in (0, 2)) \
                    and time.monotonic() < deadline:
                time.sleep(0.01)
            return built(tensors, message)

        transfer._payload = held
    the_plan = Plan(step=5, holder=0, needs_state=(2,), rank_source={0: 0, 1: 1, 2: 2},
                    save_point=(None, 0.0), last_commit=None)
    got = carry_out(the_plan, Memory(), rank, GroupTransport(None))
    assert all(torch.equal(got.shared[k], v) for k, v in halves().items())
    return lines


def main() -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=3)
    out = {}
    if rank == 0:
        out["sent_bytes"] = send_tree(tree(), 2, None)
    elif rank == 2:
        moved = recv_tree(0, None)
        out["p2p"], out["p2p_bytes"] = moved.tree, moved.nbytes
    out["progress"] = by_plan(rank)
    readonce.CHUNK_BYTES = 64 << 10   # some 20 chunks of a 1.2 MB file
    storage = Storage(os.environ["RESULT_DIR"])
    buf = io.BytesIO()
    torch.save(tree(), buf)
    data = buf.getvalue()
    entry = entry_of(data)
    if rank == 0:
        storage.write_bytes("whole.pt", data)
        storage.write_bytes("short.pt", data[:-1000])   # truncated, as the manifest won't say
        storage.write_bytes("drops.pt", data)
    dist.barrier()
    out["whole"] = streamed(storage, "whole.pt", entry, rank)
    # Rank 2's manifest says another size (a step rewritten while it was read).
    out["disagree"] = streamed(storage, "whole.pt", FileEntry(entry.size + 5, entry.crc32c)
                               if rank == 2 else entry, rank)
    out["short"] = streamed(storage, "short.pt", entry, rank)
    if rank == 0:
        opened = storage.open_read

        def failing(rel: str):  # the third file's reads fail half-way on the reading rank
            class Ctx:
                def __enter__(self):
                    self.cm = opened(rel)
                    return FailsHalfWay(self.cm.__enter__())

                def __exit__(self, *exc):
                    return self.cm.__exit__(*exc)
            return Ctx()

        storage.open_read = failing   # type: ignore[method-assign]
    out["drops"] = streamed(storage, "drops.pt", entry, rank)
    out["file_bytes"] = len(data)
    torch.save(out, os.path.join(os.environ["RESULT_DIR"], f"rank{rank}.pt"))
    # Last, as it breaks the group: rank 2 dies after the first chunk of another stream.
    if rank == 0:
        storage.open_read = opened   # type: ignore[method-assign]
    if rank == 2:
        calls, sent = [0], readonce._broadcast

        def dies(chunk: torch.Tensor, src: int, group: object) -> None:
            sent(chunk, src, group)
            calls[0] += 1
            if calls[0] == 2:   # the size, then one chunk
                os._exit(17)

        readonce._broadcast = dies
    got = streamed(storage, "whole.pt", entry, rank)
    torch.save({k: v for k, v in got.items() if k != "tree"},
               os.path.join(os.environ["RESULT_DIR"], f"dies.rank{rank}.pt"))
    os._exit(0)   # the group is broken: nothing to tear down


if __name__ == "__main__":
    main()
