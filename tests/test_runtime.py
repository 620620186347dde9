"""@rt.main and Context: resume after a failure ends bitwise equal to an uninterrupted run;
exceptions become the platform's exit codes with an error report."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from jobs import preloaded
from lives import Life, run_lives

from resilient_train.checkpoint.commit.directory import scan
from resilient_train.checkpoint.storage.base import Storage
from resilient_train.launcher.ports import free_port

SCRIPT = Path(__file__).parent / "runtime_workers" / "train_simple.py"


def outside_env() -> dict[str, str]:
    """This environment without a cluster of its own: the script starts standalone."""
    return {k: v for k, v in os.environ.items() if k not in (
        "RANK", "WORLD_SIZE", "CLUSTER_SPEC", "TF_CONFIG", "MASTER_ADDR", "MASTER_PORT")}


def life(tmp: Path, name: str, **env: str) -> Life:
    """train_simple.py with its checkpoints, result and error report in ``tmp/name``."""
    return Life([str(SCRIPT)], outside_env() | {
        "CKPT": str(tmp / name / "ckpt"), "OUT": str(tmp / name / "final.pt"),
        "TORCHELASTIC_ERROR_FILE": str(tmp / name / "report.json"), **env})


def run(tmp: Path, name: str, **env: str) -> subprocess.CompletedProcess[str]:
    """One life of train_simple.py, as a process started for it alone."""
    one = life(tmp, name, **env)
    return subprocess.run([sys.executable, *one.argv], env=dict(one.env), text=True,
                          capture_output=True, timeout=120, check=False)


@pytest.mark.slow
def test_a_transient_failure_exits_134_and_the_rerun_resumes_exactly(tmp_path: Path) -> None:
    once = str(tmp_path / "failed-once")
    clean, first, second = run_lives([
        life(tmp_path, "clean"),
        life(tmp_path, "faulty", FAIL_AT="12", FAIL_ONCE=once),
        life(tmp_path, "faulty", FAIL_AT="12", FAIL_ONCE=once)])   # the platform's restart
    assert clean.returncode == 0, clean.stderr[-2000:]
    assert first.returncode == 134, first.stderr[-2000:]
    report = json.loads((tmp_path / "faulty" / "report.json").read_text())["resilient_train"]
    assert report["classification"] == "transient"
    assert "the data loader lost its connection" in report["message"]

    assert second.returncode == 0, second.stderr[-2000:]
    # It resumed after the last save before the failure (every 5 steps: step 10), not anew.
    assert "restored_step=10 data_position=20" in second.stdout
    assert "restored_step=None" in clean.stdout
    a = torch.load(tmp_path / "clean" / "final.pt", weights_only=True)
    b = torch.load(tmp_path / "faulty" / "final.pt", weights_only=True)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.slow
def test_a_bug_exits_1_with_the_traceback_in_the_report(tmp_path: Path) -> None:
    proc = run(tmp_path, "bug", FAIL_AT="3", FAIL_KIND="bug",
               FAIL_ONCE=str(tmp_path / "bug-once"))
    assert proc.returncode == 1
    report = json.loads((tmp_path / "bug" / "report.json").read_text())["resilient_train"]
    assert report["classification"] == "permanent"
    assert "ValueError: a bug in the training step" in report["message"]
    assert "train_simple.py" in report["traceback"]


@pytest.mark.slow
def test_a_lone_workers_network_error_is_transient_in_its_own_words(tmp_path: Path) -> None:
    # One process has no peers: a broken connection is not "a peer went away".
    proc = run(tmp_path, "network", FAIL_AT="3", FAIL_KIND="network",
               FAIL_ONCE=str(tmp_path / "network-once"))
    assert proc.returncode == 134, proc.stderr[-2000:]
    report = json.loads((tmp_path / "network" / "report.json").read_text())["resilient_train"]
    assert report["classification"] == "transient"
    assert "ConnectionResetError" in report["message"] and "data service" in report["message"]
    assert "peer of the process group" not in proc.stderr


def _tutorial_port(tmp: Path, mode: str) -> list[subprocess.CompletedProcess[str]]:
    """runtime_workers/tutorial_port.py as ranks 0 and 1, checkpoints in ``tmp/ckpt``."""
    env = outside_env() | {
        "MODE": mode, "CKPT_DIR": str(tmp / "ckpt"), "NODE_LOCAL": str(tmp / "local"),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
        "GLOO_SOCKET_IFNAME": "lo", "RESILIENT_TRAIN_JOB_SECRET": "s" * 32,
        "AIP_CHECKPOINT_DIR": str(tmp / "ckpt")}
    script = Path(__file__).parent / "runtime_workers" / "tutorial_port.py"
    return run_lives([Life([str(script)], env | {"RANK": str(r)}) for r in range(2)],
                     together=True, timeout=120)


def test_the_ddp_tutorials_destroy_after_the_loop_keeps_the_last_checkpoint(
        tmp_path: Path) -> None:
    """The DDP tutorial ends with destroy_process_group(): it ended the collectives of the
    final save in flight, and the finished run failed (exit 1) over its last checkpoint.
    The loop's end now commits the last step first, to the checkpoint directory too,
    though the policy's save of that step went to the machine's disk alone (the job's
    output held step 10, and the node-local copy of 15 goes with the machine)."""
    procs = _tutorial_port(tmp_path, "destroy")
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0 and f"done {rank}" in proc.stdout, proc.stderr[-3000:]
    steps = [(i.step, i.ok) for i in scan(Storage(str(tmp_path / "ckpt")))]
    assert steps[-1] == (15, True), steps


@pytest.mark.parametrize("mode, says", [
    # The tutorial's own init_process_group() inside rt.main.
    ("init", "ValueError: the script calls torch.distributed.init_process_group() inside "
             "rt.main, which has already formed the process group"),
    # Each rank's total from its own shard of the data: the rank with more steps waited for
    # ever in its first extra step's all-reduce, while the primary ended and the job
    # succeeded without it.
    ("uneven", "ValueError: ctx.steps(total) differs across ranks (15 on rank 0; 18 on "
               "rank 1): every rank must run the same steps"),
])
def test_a_ported_scripts_mistake_fails_every_rank_before_the_first_step(
        tmp_path: Path, mode: str, says: str) -> None:
    procs = _tutorial_port(tmp_path, mode)
    for proc in procs:
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert says in proc.stderr, proc.stderr[-3000:]
        assert "done" not in proc.stdout
    assert scan(Storage(str(tmp_path / "ckpt"))) == []   # nothing trained


@pytest.mark.slow
def test_named_barriers_meet_again_after_an_in_process_recovery(tmp_path: Path) -> None:
    # The survivor has passed 'eval' twice when its peer restarts; the restarted peer counts
    # its barriers from zero, so the survivor must too, or both wait at different names
    # until the barrier times out and the job is retried.
    env = outside_env()
    env.update(CKPT=str(tmp_path / "ckpt"), OUT=str(tmp_path / "final.pt"), STEPS="60",
               BARRIER_EVERY="10", STEP_S="0.05", SHOW_LIVES="1",
               RESILIENT_TRAIN_QUOTA_DIR=str(tmp_path / "quota"), **preloaded())
    job_dir = tmp_path / "job"
    proc = subprocess.run(
        [sys.executable, "-m", "resilient_train.cli.main", "launch", "--job-dir", str(job_dir),
         "--workers", "2", "--chaos", "kill:workerpool1-0@step25", "--timeout", "150s", "--",
         sys.executable, str(SCRIPT)],
        env=env, text=True, capture_output=True, timeout=240, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    job = json.loads((job_dir / "job.json").read_text())
    assert len(job["attempts"]) == 1, out[-3000:]      # recovered in-process, no job retry
    assert "process group re-formed at generation 1" in out
    assert "BarrierTimeoutError" not in out
    # The survivor's second life reuses the first one's storage handle, whose writable
    # probe passed: kept by the life loop (runtime.py), not opened and probed again.
    primary = re.findall(r"workerpool0-0.*life rank=0 storage=(\d+) probes=(\d+)", out)
    assert len(primary) == 2, out[-3000:]
    assert primary[0] == primary[1] and primary[0][1] == "1", primary


def test_state_read_before_the_loop_is_restored_by_ctx_restore_or_named_stale(
        tmp_path: Path) -> None:
    """ctx.steps restores at its first iteration, so code before the loop reads fresh
    state: a run resumed at step 12 (epoch 2) read epoch 0, and ctx.values' "best" unset.
    ctx.restore() restores first (once: the loop does not again); reading early without
    it is named, setting a default is not."""
    script = Path(__file__).parent / "runtime_workers" / "state_before_loop.py"

    def life_of(steps: int, **env: str) -> Life:
        return Life([str(script)], outside_env() | {"CKPT": str(tmp_path / "ckpt"),
                                                    "STEPS": str(steps)} | env)

    first, stale, early = run_lives([life_of(12, LATE="1"), life_of(14),
                                     life_of(16, EARLY="1")])
    for proc in (first, stale, early):
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert "restore()=not called epoch_before_loop=0 best=100.0\nfirst_step=0 " \
        "restored_again=True" in first.stdout
    assert "ctx.track(late) after this life's restore" in first.stderr
    assert "was read before the restore" not in first.stderr   # nothing to restore
    assert "epoch_before_loop=0 best=100.0\nfirst_step=12 restored_again=True" in stale.stdout
    assert "data.epoch was read before the restore (it was 0; the checkpoint's is 2)" \
        in stale.stderr
    # The checkpoint of step 12 holds best = 50 - 11; the default set before it is not named.
    assert "ctx.values['best'] was read before the restore (it was <not set>; the " \
        "checkpoint's is 39.0)" in stale.stderr
    assert "ctx.values['seen']" not in stale.stderr
    assert "restore()=14 epoch_before_loop=2 best=37.0\nfirst_step=14 restored_again=False" \
        in early.stdout
    assert "was read before the restore" not in early.stderr
    saved = torch.load(tmp_path / "ckpt" / "values.pt", weights_only=True)["values"]
    assert saved == {"seen": 16, "best": 35.0}, saved


_NUMPY_VALUE = """
import os, sys
import numpy as np
import torch
import resilient_train as rt

@rt.main(options=rt.MainOptions(checkpoint_dir=sys.argv[1],
                                checkpoint=rt.CheckpointOptions(save_every_steps=1000)))
def train(ctx):
    ctx.track(model=torch.nn.Linear(2, 1))
    ctx.values.update(seen=0)
    for step in ctx.steps(5):
        ctx.values["seen"] = step + 1
        print(f"step {step}", flush=True)
        if step == 2:
            ctx.values["acc"] = np.mean([0.5, 1.0])   # numpy.float64

train()
"""


def test_a_value_no_checkpoint_could_load_raises_where_it_is_set(tmp_path: Path) -> None:
    """A numpy scalar in ctx.values failed at the first save (with save_every_steps=1000,
    step 1000): it raises at the assignment, naming the key and the fix, exit 1."""
    script = tmp_path / "train.py"   # a file: the traceback then shows the line
    script.write_text(_NUMPY_VALUE)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")],
                          text=True, capture_output=True, timeout=120, check=False,
                          env=outside_env())
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stdout.split() == ["step", "0", "step", "1", "step", "2"], proc.stdout
    assert "ctx.values['acc']: numpy.float64 (numpy scalar: use x.item()" in proc.stderr
    assert 'ctx.values["acc"] = np.mean' in proc.stderr   # the user's line, in the traceback


DRAW_ORDER = Path(__file__).parent / "runtime_workers" / "draw_order.py"


def _draw_order_runs(tmp: Path, runs: list[tuple[str, str, dict[str, str]]]
                     ) -> dict[str, dict[str, object]]:
    """Run draw_order.py once per (name, order, env), side by side: what each wrote."""
    procs = run_lives([Life([str(DRAW_ORDER)], outside_env() | {
        "CKPT": str(tmp / name), "OUT": str(tmp / f"{name}.pt"), "ORDER": order,
        "FAIL_ONCE": str(tmp / f"{name}.failed"), **env}) for name, order, env in runs],
        together=True)
    for (name, _, env), proc in zip(runs, procs):
        assert proc.returncode == (134 if "FAIL_AT" in env and not (tmp / f"{name}.pt").exists()
                                   else 0), (proc.stdout + proc.stderr)[-3000:]
    return {name: torch.load(tmp / f"{name}.pt", weights_only=True)
            for name, _, _ in runs if (tmp / f"{name}.pt").exists()}


@pytest.mark.slow
def test_a_batch_drawn_before_ctx_steps_ends_the_step_is_the_next_steps(
        tmp_path: Path) -> None:
    """A loop that draws a step's batch before ctx.steps has ended the step before it (an
    epoch loop, ``for x, y in data: step = next(steps)``) or that prefetches the next batch
    after ``opt.step()``: the checkpoint of a step leaves that batch out, so a resume
    trains on it. Before, the step's checkpoint counted it as consumed, and the resumed
    run skipped it (found with an epoch-style script killed under the launcher)."""
    fail = {"FAIL_AT": "6"}   # after step 6's optimizer step: back to the save of step 4
    first = _draw_order_runs(tmp_path, [("clean", "steps-first", {}),
                                        ("draw-first", "draw-first", fail),
                                        ("prefetch", "prefetch", fail)])
    assert set(first) == {"clean"}   # the other two failed, exit 134
    clean = first["clean"]
    assert len(clean["seen"]) == 30 and clean["restored"] is None
    again = _draw_order_runs(tmp_path, [("draw-first", "draw-first", fail),
                                        ("prefetch", "prefetch", fail)])
    for name, got in again.items():
        assert got["restored"] == 4, name
        assert got["seen"] == clean["seen"], name   # no batch skipped, none twice
        for key, value in clean["weights"].items():
            assert torch.equal(got["weights"][key], value), (name, key)


@pytest.mark.slow
def test_a_loop_left_after_its_optimizer_step_saves_that_step_as_done(tmp_path: Path) -> None:
    """``zip(data, ctx.steps(n))`` over one epoch: the data runs out first, so ctx.steps
    never sees its last step end. Its optimizer step ran: the final checkpoint is of 10
    steps, not 9 (which a later run would resume from, training step 10 twice), and the
    next run goes on from there with the next epoch."""
    def life_of(order: str, out: str) -> Life:   # every life resumes from one directory
        return Life([str(DRAW_ORDER)], outside_env() | {
            "CKPT": str(tmp_path / "zip"), "OUT": str(tmp_path / out), "ORDER": order})

    # The third: without ctx.restore() first, zip's first draw starts the loader's iterator
    # before ctx.steps restores: named, with the fix, at the next batch.
    *runs, late = run_lives([life_of("zip", "first.pt"), life_of("zip", "second.pt"),
                             life_of("zip-unrestored", "x")])
    for proc in runs:
        assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = (torch.load(tmp_path / name, weights_only=True)
                     for name in ("first.pt", "second.pt"))
    assert len(first["seen"]) == 10 and first["restored"] is None
    assert second["restored"] == 10
    assert len(second["seen"]) == 20 and second["seen"][:10] == first["seen"]
    assert sorted(i for ids in second["seen"][10:] for i in ids) == list(range(40))
    assert late.returncode == 1, late.stderr[-3000:]
    assert "began before the checkpoint was restored into it" in late.stderr
    assert "call ctx.restore() before drawing the first batch" in late.stderr


def test_a_resumable_loader_left_untracked_is_named_once(tmp_path: Path) -> None:
    """Under rt.main, a ResumableLoader drawn from but not tracked keeps its position in
    no checkpoint: a restart would begin its epoch again. Said once, by rank 0; a tracked
    one is not named."""
    def life_of(name: str, **env: str) -> Life:
        return Life([str(DRAW_ORDER)], outside_env() | {
            "CKPT": str(tmp_path / name), "ORDER": "steps-first",
            "OUT": str(tmp_path / f"{name}.pt"), **env})

    untracked, tracked = run_lives([life_of("untracked", UNTRACKED_DATA="1"),
                                    life_of("tracked")], together=True)
    for proc in (untracked, tracked):
        assert proc.returncode == 0, proc.stderr[-3000:]
    line = "a ResumableLoader is iterated under rt.main but is not tracked"
    assert untracked.stderr.count(line) == 1
    assert line not in tracked.stderr


def _at_a_terminal(tmp: Path, name: str, presses: int,
                   pause_s: float) -> tuple[int, str, list[str]]:
    """train_simple.py started by hand at a terminal (stdin a pty), pressed Ctrl-C
    ``presses`` times once its first checkpoint exists (step 5), inside step 6, which
    lasts ``pause_s``: exit status, stderr, the steps committed."""
    import pty
    import signal
    import time

    ckpt = tmp / name / "ckpt"
    env = outside_env()
    env.update(CKPT=str(ckpt), OUT=str(tmp / name / "final.pt"), STEPS="1000",
               STEP_S="0.05", PAUSE_AT="6", PAUSE_S=str(pause_s),
               TORCHELASTIC_ERROR_FILE=str(tmp / name / "r.json"))
    for var in ("CLOUD_ML_JOB_ID", "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    controller, terminal = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, str(SCRIPT)], env=env, stdin=terminal,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # A bound for a run that never gets there, not a speed target: a start under a
        # loaded suite has taken over 60 s.
        deadline = time.monotonic() + 240
        while not (ckpt / "step-000000000005" / "COMMITTED").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        time.sleep(0.3)   # into step 6's pause
        for _ in range(presses):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.3)   # the handler has run: the next press is a second one
        _, err = proc.communicate(timeout=200)
    finally:
        os.close(controller)
        os.close(terminal)
    return proc.returncode, err, sorted(p.name for p in ckpt.iterdir() if p.is_dir())


@pytest.mark.slow
def test_ctrl_c_at_a_terminal_saves_the_step_and_twice_stops_at_once(tmp_path: Path) -> None:
    """A run started by hand: the first Ctrl-C saves the step it is in as a SIGTERM would
    (at the end of step 6, a pause of 2 s), so a rerun loses nothing; a second one stops
    at once (inside a pause of 120 s), as Ctrl-C does in Python."""
    code, err, steps = _at_a_terminal(tmp_path, "twice", presses=2, pause_s=120)
    assert code != 134 and "KeyboardInterrupt" in err, err[-2000:]
    assert "Ctrl-C: saving a checkpoint at the end of this step, then stopping" in err
    assert "emergency checkpoint" not in err and steps == ["step-000000000005"], steps

    code, err, steps = _at_a_terminal(tmp_path, "once", presses=1, pause_s=2)
    assert code == 134, err[-2000:]
    assert "SIGTERM: emergency checkpoint of step 7 committed" in err, err[-2000:]
    assert steps == ["step-000000000005", "step-000000000007"], steps
    assert "no step left" not in err
    # The rerun resumes from that step; with the total at that step it runs no step and
    # says so (a finished job run again, or a total not raised to train on).
    again = run(tmp_path, "once", STEPS="7")
    assert again.returncode == 0 and "restored_step=7 " in again.stdout, again.stderr
    assert ("ctx.steps(7) has no step left to run: the checkpoint restored is of step 7 "
            "(raise the total to train on)") in again.stderr
