"""A DDP job whose every kind of state matters for an exact resume: dropout (the RNG),
batch norm's running statistics (buffers the forward writes), a shuffled ResumableLoader
with a worker process (the data position; its augmentation draws from the worker's
global RNGs), AdamW and a schedule (the optimizer), per-rank
``ctx.values``. ``find_unused_parameters=True`` keeps DDP's first bucket layout, so 3
ranks sum in the same order after a resume (docs/checkpointing.md).

``peer_ddp.py STEPS SAVE_EVERY STEP_TIME_S``: the primary writes ``$AIP_MODEL_DIR/model.pt``,
and every rank ``rank{R}.pt``: its ``values`` and four draws from its RNG at the end.
``PEER_DDP_NODE_LOCAL=K`` adds a node-local tier (every K-th save to storage too);
``PEER_DDP_KILL_IN_TRANSFER`` kills a rank in the middle of a peer transfer;
``PEER_DDP_FSDP=1`` shards the model with FSDP2 (``fully_shard``) instead of DDP;
``PEER_DDP_KEEP_MODEL=1`` builds the model once per process and every life trains it on.
"""
import logging
import os
import random
import sys
import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

import resilient_train as rt

STEPS, SAVE_EVERY, STEP_TIME = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
FSDP = bool(os.environ.get("PEER_DDP_FSDP"))


def kill_in_transfers(spec: str, marks: str) -> None:
    """``PEER_DDP_KILL_IN_TRANSFER="receiver:20,sender:45"``: SIGKILL this process in the
    middle of a peer recovery's transfer of the replicated state, once per role (a marker
    file in ``PEER_DDP_MARKS``): as a restarted process receives (after the header's
    size), or as any sends (likewise), in the first recovery whose step is at least the
    number given. The rest
    is the real transfer (checkpoint/recovery_plan.py): only the moment of death is set."""
    import signal

    from resilient_train.checkpoint.tiers import peers
    from resilient_train.checkpoint.transport.channel import GroupTransport

    roles = {role: int(step) for role, step in (x.split(":") for x in spec.split(","))}
    planned = [0]
    real_carry, real_send, real_recv = (peers.carry_out, GroupTransport.send_tree,
                                        GroupTransport.recv_tree)

    def due(role: str) -> bool:
        mark = os.path.join(marks, role)
        if role not in roles or planned[0] < roles[role] or os.path.exists(mark):
            return False
        open(mark, "w").close()
        return True

    def die() -> None:
        print(f"rank {os.environ['RANK']}: killed in the middle of a peer transfer",
              flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def carry_out(the_plan, *args):
        planned[0] = the_plan.step
        return real_carry(the_plan, *args)

    def send_tree(self, tree, dst, progress=None):
        if due("sender"):
            import torch.distributed as dist
            dist.send(torch.tensor([1 << 20], dtype=torch.int64), dst, group=self.group)
            die()
        return real_send(self, tree, dst, progress)

    restarted = os.environ.get("RESILIENT_TRAIN_RESTART_COUNT", "0") != "0"

    def recv_tree(self, src, progress=None):
        # The receiver that dies is a restarted process (not a survivor a step ahead).
        if restarted and due("receiver"):
            import torch.distributed as dist
            dist.recv(torch.zeros(1, dtype=torch.int64), src, group=self.group)
            die()
        return real_recv(self, src, progress)

    peers.carry_out = carry_out
    GroupTransport.send_tree, GroupTransport.recv_tree = send_tree, recv_tree


if os.environ.get("PEER_DDP_KILL_IN_TRANSFER"):
    kill_in_transfers(os.environ["PEER_DDP_KILL_IN_TRANSFER"], os.environ["PEER_DDP_MARKS"])


class Data(Dataset):
    def __len__(self) -> int:
        return 600

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(16, generator=torch.Generator().manual_seed(i))
        # An augmentation, as users write them, from the loader worker's global RNGs.
        noise = 0.05 * torch.randn(16) * (1 + random.random()) + float(np.random.normal())
        return x + 0.01 * noise, x[:4].sum(dim=0, keepdim=True).tanh()


# PEER_DDP_KEEP_MODEL=1: the model, optimizer and schedule are built once per process and
# trained on again by every life, as a script does that builds them at its top; its loop
# zeroes the gradients after the step.
KEPT: list[tuple[nn.Module, torch.optim.Optimizer, object]] = []
if os.environ.get("PEER_DDP_KEEP_MODEL"):   # the line that says the memory is copied
    logging.basicConfig(format="%(message)s")
    logging.getLogger("resilient_train.checkpoint.tiers.peers").setLevel(logging.INFO)


def train(ctx: rt.Context) -> None:
    torch.manual_seed(0)
    if KEPT:
        model, opt, sched = KEPT[0]
    else:
        model, opt, sched = build()
        if os.environ.get("PEER_DDP_KEEP_MODEL"):
            KEPT.append((model, opt, sched))
    torch.manual_seed(100 + ctx.rank)   # each rank its own dropout stream
    loader = rt.ResumableLoader(Data(), batch_size=8, shuffle=True, seed=0, num_workers=1)
    ctx.track(model=model, optimizer=opt, scheduler=sched, data=loader)
    # Kept: no broadcast of rank 0's buffers in the forward, so a survivor meets the
    # loss of a peer in the backward's all-reduce, with the gradients of that step half
    # made (the model's weights and rank 0's buffers end alike: training-mode batch norm
    # normalizes by the batch's own statistics).
    net = model if FSDP else nn.parallel.DistributedDataParallel(
        model, find_unused_parameters=True, broadcast_buffers=not KEPT)
    batches = loader.forever()
    for step in ctx.steps(STEPS):
        if step == ctx.restored_step:
            print(f"rank {ctx.rank}: resumed from step {step} "
                  f"(from {ctx.checkpoints.last_restore.describe()})", flush=True)
        x, y = next(batches)
        ctx.values["seen"] = ctx.values.get("seen", 0) + len(x) * (ctx.rank + 1)
        loss = nn.functional.mse_loss(net(x), y)
        if KEPT:   # zeroed after the step instead, as Hugging Face's examples do
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
        else:
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        time.sleep(STEP_TIME)
    weights = {k: v.full_tensor() for k, v in model.state_dict().items()} if FSDP \
        else model.state_dict()   # full_tensor: collective
    out = os.environ["AIP_MODEL_DIR"]
    os.makedirs(out, exist_ok=True)
    torch.save({"values": dict(ctx.values), "draws": torch.rand(4)},
               os.path.join(out, f"rank{ctx.rank}.pt"))
    if ctx.is_primary:
        torch.save(weights, os.path.join(out, "model.pt"))
        print(f"finished {STEPS} steps", flush=True)


def build() -> tuple[nn.Module, torch.optim.Optimizer, object]:
    # Batch norm (under DDP) writes its running statistics in the forward, and DDP
    # broadcasts rank 0's to the others there too: a survivor whose step failed in the
    # backward has written them, and puts them back (checkpoint/stepwrites.py).
    norm = [] if FSDP else [nn.BatchNorm1d(64)]
    model = nn.Sequential(nn.Linear(16, 64), *norm, nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(64, 1))
    if FSDP:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.7)


# PEER_DDP_NODE_LOCAL=K: a node-local tier, every K-th save to storage too.
K = int(os.environ.get("PEER_DDP_NODE_LOCAL", "0"))
# The ranks act on a SIGTERM at their next agreement (sync_interval_s); the tests' faults
# are about 15 steps (1 s) apart, so at the default of 1 s a preempted rank's emergency
# save could land after the next fault had already fired. A quarter second keeps it
# within a few steps of the signal.
rt.main(train, options=rt.MainOptions(
    checkpoint=rt.CheckpointOptions(save_every_steps=SAVE_EVERY, sync_interval_s=0.25,
                                    node_local=rt.NodeLocal(persistent_every=K) if K
                                    else None)))()
