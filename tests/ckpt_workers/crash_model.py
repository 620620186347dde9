"""The model the crash tests save and check: its weights at step k are known exactly.

Step 0 is ``base`` (random integers stored as float32, fixed by ``SEED``); each step adds 1
to every element in place, so the weights of step k are ``base + k``, exactly (integers
far below 2**24 are exact in float32), whether the process got there by training from
step 0 or by restoring step j and adding 1 (k - j) times.
"""

from __future__ import annotations

import functools

import torch

SEED = 20261129
PARTS = 4  # tensors in the model: a torn save could mix steps across files or tensors


@functools.lru_cache(maxsize=4)
def _base(numel: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(SEED)
    per = max(1, numel // PARTS)
    return tuple(torch.randint(-1000, 1000, (per,), generator=g, dtype=torch.float32)
                 for _ in range(PARTS))


def base(numel: int) -> list[torch.Tensor]:
    return [t.clone() for t in _base(numel)]


def build(numel: int, fill: float | None = None) -> torch.nn.ParameterList:
    """The model at step 0 (or filled with ``fill``: a sentinel no checkpoint holds)."""
    if fill is not None:
        tensors = [torch.full_like(t, fill) for t in _base(numel)]
    else:
        tensors = base(numel)
    return torch.nn.ParameterList([torch.nn.Parameter(t) for t in tensors])


def advance(model: torch.nn.ParameterList) -> None:
    """One training step."""
    with torch.no_grad():
        for p in model:
            p.add_(1.0)


def expected(numel: int, step: int) -> list[torch.Tensor]:
    return [t + float(step) for t in _base(numel)]


def values_of(step: int) -> dict[str, int]:
    """The user values saved with step k (a data-loader position and the step)."""
    return {"step": step, "data_pos": 7 * step}


def mismatch(model: torch.nn.ParameterList, numel: int, step: int) -> str | None:
    for i, (p, want) in enumerate(zip(model, expected(numel, step))):
        if not torch.equal(p.detach(), want):
            diff = (p.detach() - want).abs().max().item()
            return f"tensor {i} differs from step {step}'s weights (max abs diff {diff})"
    return None
