"""A small real model: a character-level transformer language model trained with DDP on the
Python standard library's own source code (it ships with every Python: no download).

    python examples/train_charlm.py --steps 300                       # one process
    resilient-train launch --workers 2 -- python examples/train_charlm.py
    resilient-train launch --workers 2 --chaos "kill:1@10s,maintenance:0@20s" \\
        -- python examples/train_charlm.py
    torchrun --nproc-per-node 2 examples/train_charlm.py

Everything that makes it survive restarts is `@rt.main`, `ctx.track(...)`, `ctx.steps(...)`
and `rt.ResumableLoader`: a restarted worker (or the whole job, retried) resumes from the
last committed checkpoint with the same weights, optimizer moments, learning-rate
schedule, RNG states (dropout) and position in the shuffled data, so the final weights
are bitwise those of a run that never failed, at any number of workers (on CPU; CUDA
kernels may not be deterministic). Uses CUDA (nccl, bf16 autocast) when a GPU is
visible, else the CPU (gloo).
"""

from __future__ import annotations

import argparse
import math
import os
import sysconfig
import time
from pathlib import Path

import fsspec
import torch
from torch import nn
from torch.utils.data import Dataset

import resilient_train as rt

# Modules of the standard library whose source is the corpus (about 400 KB of text).
CORPUS = ("json/decoder.py", "json/encoder.py", "json/__init__.py", "textwrap.py",
          "string.py", "functools.py", "argparse.py", "dataclasses.py", "heapq.py")


def load_corpus() -> torch.Tensor:
    root = Path(sysconfig.get_paths()["stdlib"])
    text = b"".join((root / name).read_bytes() for name in CORPUS)
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


class Windows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of ``context + 1`` bytes: inputs and next-byte targets."""

    def __init__(self, tokens: torch.Tensor, context: int) -> None:
        self.tokens, self.context = tokens, context

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.context

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[i * self.context: (i + 1) * self.context + 1]
        return chunk[:-1], chunk[1:]


class CharLM(nn.Module):
    """A GPT-style decoder: byte embeddings, learned positions, pre-norm blocks."""

    def __init__(self, context: int, dim: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.embed(x) + self.pos[:t]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def lr_at(step: int, total: int, warmup: int = 20) -> float:
    """Linear warm-up, then cosine decay to 10%: a multiplier for LambdaLR."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=16, help="per worker")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--loader-workers", type=int, default=2,
                   help="DataLoader worker processes per training process")
    p.add_argument("--step-time", type=float, default=0.0,
                   help="extra seconds per step (so that injected faults land mid-training)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="default: AIP_CHECKPOINT_DIR (set by the platform and the launcher), "
                        "else ./checkpoints")
    p.add_argument("--model-dir", default=os.environ.get("AIP_MODEL_DIR", "model"),
                   help="where the primary writes model.pt at the end (default: AIP_MODEL_DIR)")
    p.add_argument("--hang-timeout", type=float, default=None,
                   help="exit transient (134) when no step finishes for this many seconds")
    p.add_argument("--bug-at-step", type=int, default=None,
                   help="(fault injection) the last rank raises a ValueError at this step")
    p.add_argument("--hang-at-step", type=int, default=None,
                   help="(fault injection) the last rank hangs in this step, in the job's "
                        "first attempt")
    return p.parse_args()


def train(ctx: rt.Context, args: argparse.Namespace) -> None:
    """One life of the run: build everything, then `ctx.steps` restores and trains on."""
    torch.manual_seed(0)  # the same initial weights on every rank, before any restore
    cuda = ctx.device.type == "cuda"
    tokens = load_corpus()
    split = int(len(tokens) * 0.95)
    train_data = Windows(tokens[:split], args.context)
    val_data = Windows(tokens[split:], args.context)

    model = CharLM(args.context).to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, args.steps))
    # Shuffled, sharded across ranks like DistributedSampler; its position is checkpointed.
    loader = rt.ResumableLoader(train_data, batch_size=args.batch_size, shuffle=True, seed=0,
                                drop_last=True, num_workers=args.loader_workers,
                                pin_memory=cuda)
    ctx.track(model=model, optimizer=opt, scheduler=sched, data=loader)
    # From 3 ranks on, the order in which gloo sums a gradient depends on DDP's bucket
    # layout, which DDP rebuilds after a process's first step: a resumed process's first
    # step would sum in another order than the uninterrupted run's. find_unused_parameters
    # keeps the first layout for good (about 3% slower here); 2 ranks sum alike either way.
    ddp = nn.parallel.DistributedDataParallel(
        model, find_unused_parameters=ctx.world_size > 2) if ctx.world_size > 1 else model

    batches = loader.forever()   # lazy: the first batch is drawn after ctx.steps restored
    t0, seen = time.perf_counter(), 0
    for step in ctx.steps(args.steps):
        if ctx.restored_step is not None and step == ctx.restored_step and ctx.is_primary:
            print(f"resumed from step {step} (epoch {loader.epoch})", flush=True)
        x, y = (t.to(ctx.device, non_blocking=True) for t in next(batches))
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = ddp(x)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()             # the gradient all-reduce: fails if a peer died
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        seen += x.numel()
        if args.step_time:
            time.sleep(args.step_time)
        if ctx.rank == ctx.world_size - 1:  # fault injection, for the tests
            if step == args.bug_at_step:
                raise ValueError(f"a bug at step {step}: the tokenizer returned an empty batch")
            if step == args.hang_at_step and os.environ.get("RESILIENT_TRAIN_ATTEMPT") == "1":
                time.sleep(10_000)  # stuck (a dead NFS mount, a deadlock): the watchdog fires
        if ctx.is_primary and (step + 1) % 50 == 0:
            rate = seen * ctx.world_size / (time.perf_counter() - t0)
            print(f"step {step + 1}/{args.steps} loss {loss.item():.3f} "
                  f"lr {sched.get_last_lr()[0]:.2e} {rate:,.0f} tokens/s", flush=True)

    if ctx.is_primary:
        val = evaluate(model, val_data, ctx.device)
        print(f"finished {args.steps} steps: validation loss {val:.3f} "
              f"(perplexity {math.exp(val):.1f} per byte; uniform would be 256)", flush=True)
        print("sample: " + repr(generate(model, b"def ", 60, args.context, ctx.device)), flush=True)
        with fsspec.open(f"{args.model_dir.rstrip('/')}/model.pt", "wb", auto_mkdir=True) as f:
            torch.save(model.state_dict(), f)


@torch.no_grad()
def evaluate(model: nn.Module, data: Windows, device: torch.device) -> float:
    model.eval()
    xs, ys = zip(*(data[i] for i in range(len(data))))
    x, y = torch.stack(xs).to(device), torch.stack(ys).to(device)
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    model.train()
    return loss


@torch.no_grad()
def generate(model: nn.Module, prompt: bytes, n: int, context: int, device: torch.device) -> str:
    model.eval()
    out = list(prompt)
    for _ in range(n):
        x = torch.tensor([out[-context:]], device=device)
        out.append(int(model(x)[0, -1].argmax()))
    model.train()
    return bytes(out).decode("utf-8", errors="replace")


def main() -> None:
    args = parse_args()
    options = rt.MainOptions(
        checkpoint_dir=args.checkpoint_dir,
        checkpoint=rt.CheckpointOptions(save_every_steps=args.save_every),
        distributed=rt.DistributedOptions(hang_timeout_s=args.hang_timeout))
    rt.main(train, options=options)(args)


if __name__ == "__main__":
    main()
