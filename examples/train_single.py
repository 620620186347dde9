"""The smallest complete example: one process, one decorator, exact resume.

    python examples/train_single.py                 # Ctrl-C (it saves) or kill it, run it
                                                    # again: it resumes
    python examples/train_single.py --steps 4000    # train further from the last checkpoint

It fits a small network to a function of generated data (no download). Checkpoints go to
./checkpoints (or AIP_CHECKPOINT_DIR): every 200 steps, at most every 4 hours, on
SIGTERM or a first Ctrl-C, and at the end. A rerun restores the weights, the optimizer,
the RNG states and the position in the shuffled data, and continues exactly where the
last checkpoint was taken.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import TensorDataset

import resilient_train as rt


def make_data(n: int = 8192) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, 2, generator=g) * 6 - 3
    y = torch.sin(x[:, :1]) * torch.cos(x[:, 1:]) + 0.05 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def train(ctx: rt.Context, args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 1)).to(ctx.device)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    loader = rt.ResumableLoader(make_data(), batch_size=128, shuffle=True, seed=0)
    ctx.track(model=model, optimizer=opt, data=loader)   # all of it is in every checkpoint

    batches = loader.forever()
    for step in ctx.steps(args.steps):    # restores first, then saves by policy after each step
        if step == ctx.restored_step:
            print(f"resumed after step {step} (epoch {loader.epoch})", flush=True)
        x, y = (t.to(ctx.device) for t in next(batches))
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % 250 == 0:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f}", flush=True)
    print(f"done: {args.steps} steps, checkpoints in {ctx.checkpoints.storage.url}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--checkpoint-dir", default=None)
    args = p.parse_args()
    rt.main(train, options=rt.MainOptions(
        checkpoint_dir=args.checkpoint_dir,
        checkpoint=rt.CheckpointOptions(save_every_steps=200)))(args)


if __name__ == "__main__":
    main()
