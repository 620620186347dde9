"""A plain DDP script (no ``@rt.main``, no ``@rt.record``): what a user brings unchanged.

``plain_ddp.py STEPS [PAUSE_S]``: every rank forms a gloo group from the launcher's
MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE and runs STEPS DDP steps (an all-reduce in
each backward), PAUSE_S apart (default 10 ms). A lost peer makes the survivors' collective
raise, uncaught: exit 1 with torch's ``[rankN]:``-prefixed traceback, as in the field.
The primary reports its steps to the launcher's telemetry, so ``kill:1@stepN`` lands
mid-training; that is reporting only, the failure handling stays plain.
"""
import sys
import time

import _common
import torch
import torch.distributed as dist
from torch import nn

from resilient_train.observe.telemetry import Telemetry

_common.start()
steps = int(sys.argv[1])
pause = float(sys.argv[2]) if len(sys.argv) > 2 else 0.01
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
tele = Telemetry.from_env() if _common.PRIMARY else None
if tele is not None:
    tele.begin_segment(0)
for step in range(1, steps + 1):
    loss = model(torch.randn(4, 8)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if tele is not None:
        tele.step(step)
    time.sleep(pause)
if tele is not None:
    tele.close()
dist.destroy_process_group()
print(f"{_common.REPLICA}: {steps} steps", flush=True)
