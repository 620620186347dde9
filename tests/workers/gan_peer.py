"""A GAN's step on 2+ ranks: the discriminator's optimizer steps, then the generator's
gradients are all-reduced and its optimizer steps (a collective after the first optimizer
step). ``GAN_KILL_AT=N``: rank 1's first life SIGKILLs itself right after step N's
discriminator step, so the survivors fail in the generator's all-reduce, their
discriminator a step ahead. ``GAN_UNDO=1``: ``CheckpointOptions(undo_torn_steps=True)``.

``gan_peer.py STEPS``: the primary writes ``$AIP_MODEL_DIR/model.pt``, every rank
``rank{R}.pt`` (its ``values`` and four draws from its RNG at the end)."""
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn

import resilient_train as rt

STEPS = int(sys.argv[1])
KILL_AT = int(os.environ.get("GAN_KILL_AT", "-1"))
FIRST_LIFE = os.environ.get("RESILIENT_TRAIN_RESTART_COUNT", "0") == "0"


def all_reduced(module: nn.Module, world: int) -> None:
    for p in module.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world


def train(ctx: rt.Context) -> None:
    torch.manual_seed(0)
    d = nn.Sequential(nn.Linear(4, 16), nn.LeakyReLU(), nn.Linear(16, 1))
    g = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 4))
    opt_d = torch.optim.AdamW(d.parameters(), lr=1e-2)
    opt_g = torch.optim.AdamW(g.parameters(), lr=1e-2)
    sched_d = torch.optim.lr_scheduler.StepLR(opt_d, 7, gamma=0.5)
    ctx.track(d=d, g=g, opt_d=opt_d, opt_g=opt_g, sched_d=sched_d)
    torch.manual_seed(100 + ctx.rank)   # each rank its own noise, restored with its RNG
    for step in ctx.steps(STEPS):
        if step == ctx.restored_step:
            print(f"rank {ctx.rank}: resumed from step {step} "
                  f"(from {ctx.checkpoints.last_restore.describe()})", flush=True)
        real = torch.randn(32, 4) * 0.5 + 1.0
        z = torch.randn(32, 2)
        d_loss = d(g(z).detach()).mean() - d(real).mean()
        opt_d.zero_grad()
        d_loss.backward()
        all_reduced(d, ctx.world_size)
        ctx.values["d_loss"] = round(d_loss.item(), 6)   # before the optimizer steps
        opt_d.step()
        sched_d.step()
        if step == KILL_AT and ctx.rank == 1 and FIRST_LIFE:
            os.kill(os.getpid(), signal.SIGKILL)
        g_loss = -d(g(z)).mean()
        opt_g.zero_grad()
        g_loss.backward()
        all_reduced(g, ctx.world_size)   # after opt_d.step(): a lost peer tears the step
        opt_g.step()
    out = os.environ["AIP_MODEL_DIR"]
    os.makedirs(out, exist_ok=True)
    torch.save({"values": dict(ctx.values), "draws": torch.rand(4)},
               os.path.join(out, f"rank{ctx.rank}.pt"))
    if ctx.is_primary:
        torch.save({**{f"d.{k}": v for k, v in d.state_dict().items()},
                    **{f"g.{k}": v for k, v in g.state_dict().items()}},
                   os.path.join(out, "model.pt"))


if __name__ == "__main__":
    rt.main(train, options=rt.MainOptions(checkpoint=rt.CheckpointOptions(
        save_every_steps=10, undo_torn_steps=bool(os.environ.get("GAN_UNDO")))))()
