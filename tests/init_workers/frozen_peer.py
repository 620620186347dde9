"""Two ranks wait for each other outside a training step (in a save), as the runtime's
ranks do in a checkpoint's collectives, with the hang watchdog on (``HANG_S``).

``MODE=frozen``: rank ``FROZEN`` stops itself (SIGSTOP, as a frozen machine) right after a
barrier; the other then waits in an all-reduce that never completes. Its watchdog must
notice that the stopped rank (or, when that is the primary, its store) went silent and
exit 134 (the test kills the stopped one).

``MODE=slow``: rank 1 spends 1.5x ``HANG_S`` in its save (alive: it beats) before the
all-reduce, and afterwards rank 0 spends as long again in a save while rank 1 has shut
down: nobody may fire, both print ``done`` and exit 0.

``MODE=reform`` (three ranks, under ``group.run``): in step 3 rank 2 dies and the primary
stops itself; rank 1 fails in the all-reduce and re-forms the group, where torch's store
client waits for good on the stopped primary's store. Its watchdog must exit 134, naming
the store, instead (it waited past the join timeout before).

``MODE=forming``: the primary stops itself while the group first forms, once rank 1 has
joined, so that rank 1 waits in a store call (gloo's connect) on a store that never
answers: with a hang timeout it must exit 134 naming the store, without one its
connections to the store are cut and the formation fails within the join timeout.

``HANG_S=0``: no hang watchdog. ``STORE_SILENT_S``, ``LOST_PEER_STALL_S``,
``HANDSHAKE_TIMEOUT_S``: the library's bounds on a store that does not answer, on a thread
held after the cut and on a connect's wait for the store's greeting (60 s, 30 s and 5 s
there; the same mechanism, only slower to test).

Environment: RANK, WORLD_SIZE (2; 3 for reform), MASTER_ADDR, MASTER_PORT (torchrun style),
MODE, HANG_S, FROZEN, JOIN_S (the join timeout, 20 s).
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

import resilient_train as rt
from resilient_train.distributed import group as group_module
from resilient_train.distributed import storeauth

for bound in ("STORE_SILENT_S", "LOST_PEER_STALL_S"):
    if bound in os.environ:
        setattr(group_module, bound, float(os.environ[bound]))
if "HANDSHAKE_TIMEOUT_S" in os.environ:   # how long a connect waits for the store's greeting
    storeauth.HANDSHAKE_TIMEOUT_S = float(os.environ["HANDSHAKE_TIMEOUT_S"])
hang_s = float(os.environ["HANG_S"])
mode = os.environ["MODE"]
if mode == "forming" and os.environ["RANK"] == "0":
    from resilient_train.distributed.rendezvous import Rendezvous

    wait_members = Rendezvous._wait_members

    def stop_once_joined(self: Rendezvous, gen: int, deadline: float) -> bool:
        while not self.store.check([self.key("g", gen, "member", 1)]):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGSTOP)
        return wait_members(self, gen, deadline)

    Rendezvous._wait_members = stop_once_joined  # type: ignore[method-assign]

group = rt.init_distributed(rt.DistributedOptions(
    join_timeout_s=float(os.environ.get("JOIN_S", 20)), collective_timeout_s=120,
    hang_timeout_s=hang_s or None))


def reform() -> None:
    for step in range(6):
        if group.generation == 0 and step == 3:
            if group.rank == 2:
                os._exit(1)
            if group.rank == 0:
                os.kill(os.getpid(), signal.SIGSTOP)
        dist.all_reduce(torch.ones(4))
        group.step_done(step + 1)


if mode == "reform":
    with group:
        group.run(reform)
    raise SystemExit(f"rank {group.rank}: re-formed without its primary")
with group:
    for step in range(3):   # a few steps: the watchdog is armed
        dist.all_reduce(torch.ones(4))
        group.step_done(step + 1)
    group.phase("save")   # the barrier too: a rank may still be in it when the other stops
    group.barrier("before")
    if mode == "frozen" and group.rank == int(os.environ.get("FROZEN", "1")):
        os.kill(os.getpid(), signal.SIGSTOP)
    if mode == "slow" and group.rank == 1:
        time.sleep(1.5 * hang_s)
    dist.all_reduce(torch.ones(4))
    if mode == "slow" and group.rank == 0:
        time.sleep(1.5 * hang_s)   # rank 1 shuts down meanwhile
    group.phase("step")
print(f"rank {group.rank}: done", flush=True)
