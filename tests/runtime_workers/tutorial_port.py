"""A script ported from PyTorch's DDP tutorial that kept its process-group calls, under
rt.main, 15 steps saved every 5 with a node-local tier whose every 2nd save also goes to
the checkpoint directory (so the policy's save of the last step, 15, is node-local only).
``MODE``: ``destroy``: ``destroy_process_group()`` after the loop, as the tutorial's
``cleanup()``; ``init``: ``init_process_group()`` inside the function, as its ``setup()``;
``uneven``: each rank's total from its own shard (15 + 3 * rank steps). Prints ``done
RANK`` after the loop."""

import os

import torch
import torch.distributed as dist
from torch import nn

import resilient_train as rt

MODE = os.environ["MODE"]


def train(ctx: rt.Context) -> None:
    if MODE == "init":
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx.track(model=model, optimizer=opt)
    ddp = nn.parallel.DistributedDataParallel(model)
    for _ in ctx.steps(15 + 3 * ctx.rank if MODE == "uneven" else 15):
        loss = ddp(torch.randn(16, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"done {ctx.rank}", flush=True)
    if MODE == "destroy":
        dist.destroy_process_group()


if __name__ == "__main__":
    local = rt.NodeLocal(directory=os.environ["NODE_LOCAL"] + f"/{os.environ['RANK']}",
                         persistent_every=2)
    rt.main(train, options=rt.MainOptions(checkpoint=rt.CheckpointOptions(
        save_every_steps=5, node_local=local)))()
