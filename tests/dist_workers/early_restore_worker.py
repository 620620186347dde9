"""Two ranks, two lives, one process each: rank 1's second life is a restarted process
(an empty PeerMemory), and its state comes from rank 0's memory *before* rank 1 has built
the model it restores into (CheckpointManager.start_restore, tiers/early.py).

Life 1: both ranks train 4 steps (the ring keeps each rank's RNG and values at every
boundary) and hand over. Life 2: both call start_restore; rank 1 waits until the
transfer is over and only then builds its model (with other initial weights) and
optimizer, tracks them and restores. Each rank writes ``$RESULT_DIR/rankR.pt``: its
weights, the optimizer's state, the restore record, and a draw from its RNG.
``FAIL_LAST_SAVE=1``: rank 0's last boundary raises a failed background save.
``FUSED_TORN=1``: the optimizer is fused (its step moves no version counter), and life 1
ends in a fifth step that failed after its optimizer step: no rank holds a boundary.
``LATE_LOST=1``: rank 1 sets a value after its optimizer step in step 2 (as an evaluation
does), and is lost after its last optimizer step, before that step's end.
``SKIP_LOST=1``: a tracked GradScaler skips every step (its scale is infinite), so the
optimizer never steps; rank 1 is lost after its last ``scaler.step()``, before the step's
end.
``LARGE=1``: rank 0 keeps a loss history of 150k floats in its values (1.35 MB).
``POST_COLLECTIVE=1``: each step all-reduces its loss after ``opt.step()``, as a script
logging the mean loss does.
``EMA=1``: an SWA average of the model (``AveragedModel``, tracked) is updated after each
optimizer step, which writes its buffer ``n_averaged``; nobody is lost."""
import gc
import logging
import os
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.swa_utils import AveragedModel

from resilient_train.checkpoint.manager import CheckpointManager, CheckpointOptions
from resilient_train.checkpoint.tiers.peers import PeerMemory

STEPS = 4


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 300), nn.ReLU(), nn.Linear(300, 1))
    fused = bool(os.environ.get("FUSED_TORN"))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)


def manager(memory: PeerMemory | None = None) -> CheckpointManager:
    return CheckpointManager(os.environ["CKPT_DIR"], peer_memory=memory, options=CheckpointOptions(
        async_save=False, save_every_steps=1000, peer_recovery=True))


def main() -> None:
    rank = int(os.environ["RANK"])
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    # Life 1.
    model, opt = build(0)
    mgr = manager()
    skipping = bool(os.environ.get("SKIP_LOST"))
    scaler = torch.amp.GradScaler("cpu", init_scale=float("inf"), enabled=skipping)
    mgr.track(model=model, optimizer=opt, **({"scaler": scaler} if skipping else {}))
    ema = AveragedModel(model) if os.environ.get("EMA") else None
    if ema is not None:
        mgr.track(ema=ema)
    assert mgr.restore_latest() is None
    torch.manual_seed(50 + rank)   # each rank its own stream from here
    for step in range(STEPS):
        x = torch.randn(16, 8)
        mgr.values["seen"] = (step + 1) * (rank + 1)
        if os.environ.get("LARGE") and rank == 0:
            mgr.values["history"] = [0.5] * 150_000
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        for p in model.parameters():   # what DDP's all-reduce would do
            dist.all_reduce(p.grad)
            p.grad /= 2
        scaler.step(opt)               # opt.step(), unless it skips
        scaler.update()
        if os.environ.get("POST_COLLECTIVE"):
            dist.all_reduce(loss.detach().clone())   # after opt.step(): tears a survivor
        if ema is not None:
            ema.update_parameters(model)   # after opt.step(), as every EMA is
        if skipping and rank == 1 and step + 1 == STEPS:
            continue                   # lost before its step's end: no boundary
        late = rank == 1 and os.environ.get("LATE_LOST")
        if late and step == 1:
            mgr.values["best"] = step   # after opt.step(): its early copies stop counting
        if late and step + 1 == STEPS:
            continue                    # lost before its step's end: no boundary
        if step + 1 == STEPS and rank == 0 and os.environ.get("FAIL_LAST_SAVE"):
            # The save before failed in the background, as when a peer is lost in its
            # collective: the next boundary raises it, and the step is done all the same.
            mgr._inflight.error = ConnectionError("injected: the previous save lost a peer")
            try:
                mgr.maybe_save(step + 1)
            except Exception as exc:  # noqa: BLE001 - what ends this life
                print(f"rank 0: the boundary raised {type(exc).__name__}: {exc}", flush=True)
            continue
        mgr.maybe_save(step + 1)
    if os.environ.get("FUSED_TORN"):   # step 5: its optimizer step, then the failure
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()
    # The life ends (a peer lost, in a real job, which takes longer than this): by then
    # each rank's last ring message has reached its neighbour.
    dist.barrier()
    mgr.hand_over(STEPS)
    mgr.close()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    ema_life1 = None if ema is None else {k: v.clone() for k, v in ema.state_dict().items()}
    draw_after = torch.rand(3)     # what the RNG gives next at the boundary: a restore
    # rewinds each rank's RNG to it.
    # The life's objects go with it, as a real life's do when its frames are freed (those
    # kept alive for the next life are another case: PeerMemory.detach).
    del model, opt, ema, scaler, mgr
    gc.collect()
    # Life 2: rank 1 is a new process as far as peer recovery knows.
    memory = PeerMemory() if rank == 1 else None
    mgr = manager(memory)
    mgr.start_restore()
    early = mgr._early
    arrived_first = None
    if rank == 1 and not (os.environ.get("FUSED_TORN") or os.environ.get("LATE_LOST")
                          or skipping):
        assert early is not None, "no transfer started"
        arrived_first = early.join(60)   # before anything below was built
    model2, opt2 = build(1 + rank)     # other initial weights: the restore must replace them
    scaler2 = torch.amp.GradScaler("cpu", init_scale=2.0, enabled=skipping)
    mgr.track(model=model2, optimizer=opt2, **({"scaler": scaler2} if skipping else {}))
    ema2 = AveragedModel(model2) if ema_life1 is not None else None
    if ema2 is not None:
        mgr.track(ema=ema2)
    step = mgr.restore_latest()
    record = asdict(mgr.last_restore)
    out = {"step": step, "record": record, "arrived_first": arrived_first,
           "weights_life1": weights, "weights": model2.state_dict(),
           "values": dict(mgr.values), "draw": torch.rand(3), "draw_life1": draw_after,
           "opt_steps": [float(s["step"]) for s in opt2.state_dict()["state"].values()],
           "scale": scaler2.get_scale() if skipping else None,
           "ema_life1": ema_life1, "ema": None if ema2 is None else ema2.state_dict()}
    mgr.close()
    torch.save(out, os.path.join(os.environ["RESULT_DIR"], f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
