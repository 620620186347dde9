"""Three ranks move one state tree around: rank 0 sends it to rank 2 point to point, then
broadcasts it to everyone. Each rank writes what it received to ``$RESULT_DIR/rankR.pt``."""
import os

import torch
import torch.distributed as dist

from resilient_train.checkpoint.transfer import broadcast_tree, recv_tree, send_tree


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


def main() -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=3)
    out = {}
    if rank == 0:
        out["sent_bytes"] = send_tree(tree(), 2, None)
    elif rank == 2:
        moved = recv_tree(0, None)
        out["p2p"], out["p2p_bytes"] = moved.tree, moved.nbytes
    moved = broadcast_tree(tree() if rank == 0 else None, 0, rank, None)
    out["bcast"], out["bcast_bytes"] = moved.tree, moved.nbytes
    torch.save(out, os.path.join(os.environ["RESULT_DIR"], f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
