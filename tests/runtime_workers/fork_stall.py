"""A ResumableLoader whose first forked worker deadlocks in its after-fork code, as a fork
does under CPython gh-112275: a lock the parent held at the fork, never released in the
child. Prints the batches of 15 steps (an epoch and a half) as one JSON line.

Environment: START_S, the loader's bound on a worker's start (forkwatch.FORK_START_S).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys
import threading

import torch

import resilient_train as rt
from resilient_train import forkwatch

logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
forkwatch.FORK_START_S = float(os.environ["START_S"])

held = threading.Lock()
held.acquire()   # held by the parent for good: a child that takes it never runs on
forked = {"n": 0}


def before_fork() -> None:
    forked["n"] += 1


def in_child() -> None:
    if forked["n"] == 1:
        held.acquire()


os.register_at_fork(before=before_fork, after_in_child=in_child)
loader = rt.ResumableLoader(torch.arange(40.0), batch_size=4, seed=3, num_workers=2,
                            num_replicas=1, rank=0)
batches = [b.tolist() for b in itertools.islice(loader.forever(), 15)]
print(json.dumps({"batches": batches, "forks": forked["n"]}))
