"""Signals as real users send them: SIGTERM to the whole process group (``timeout``,
``docker stop`` with an init, Slurm's ``scancel``) also stops the DataLoader's workers;
a worker waiting for its primary; and the emergency-save exit's own log line.

Real processes: tests/runtime_workers/signals_loader.py under ``@rt.main`` with
``rt.ResumableLoader(num_workers=2)``, started in its own session so that ``os.killpg``
reaches it and its loader workers as a terminal's Ctrl-C or ``timeout`` would.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import torch

from resilient_train.checkpoint.commit.directory import scan, verify_step
from resilient_train.checkpoint.storage.base import Storage
from resilient_train.launcher.ports import free_port

SCRIPT = Path(__file__).parent / "runtime_workers" / "signals_loader.py"
BATCH = 4      # the script's batch size
SEED = 1       # and its loader's seed

LOADER_LINE = ("SIGTERM: the DataLoader's workers were stopped with this process; "
               "emergency checkpoint of step {step}, exit 134")
BOUNDARY_LINE = "SIGTERM: emergency checkpoint of step {step} committed, exit 134"
CPP_STACK = re.compile(r"^frame #\d+:|Exception raised from ", re.MULTILINE)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (
        "RANK", "WORLD_SIZE", "CLUSTER_SPEC", "TF_CONFIG", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_USE_AGENT_STORE")}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


@dataclass
class Run:
    """A started script; its stdout and stderr lines arrive in queues as they are written."""

    proc: subprocess.Popen[str]
    out: queue.Queue[str] = field(default_factory=queue.Queue)
    err: queue.Queue[str] = field(default_factory=queue.Queue)
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)
    pumps: list[threading.Thread] = field(default_factory=list)

    def __post_init__(self) -> None:
        for stream, q, lines in ((self.proc.stdout, self.out, self.stdout),
                                 (self.proc.stderr, self.err, self.stderr)):
            pump = threading.Thread(target=_pump, args=(stream, q, lines), daemon=True)
            pump.start()
            self.pumps.append(pump)

    def wait_line(self, pattern: str, *, stream: str = "out", timeout: float = 60.0) -> str:
        """The first line (from now on) matching ``pattern``; fails the test at the timeout."""
        q = self.out if stream == "out" else self.err
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.proc.kill()
                pytest.fail(f"no line matching {pattern!r} within {timeout:.0f} s; stderr:\n"
                            + "".join(self.stderr)[-3000:])
            if re.search(pattern, line):
                return line

    def finish(self, timeout: float = 60.0) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # Stuck: its every thread's stack (the script's faulthandler) says where.
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(2.0)
            self.proc.kill()
            self.proc.wait()
            for pump in self.pumps:
                pump.join(timeout=10.0)
            pytest.fail(f"the process did not exit within {timeout:.0f} s; stderr:\n"
                        + "".join(self.stderr)[-6000:])
        for pump in self.pumps:   # end-of-file once the process (and its workers) are gone
            pump.join(timeout=10.0)
        return rc

    @property
    def err_text(self) -> str:
        return "".join(self.stderr)

    @property
    def out_text(self) -> str:
        return "".join(self.stdout)


def _pump(stream: object, q: queue.Queue[str], lines: list[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        lines.append(line)
        q.put(line)


def start(tmp: Path, name: str = "run", **env: str) -> Run:
    full = clean_env(CKPT=str(tmp / "ckpt"),
                     TORCHELASTIC_ERROR_FILE=str(tmp / f"{name}-report.json"), **env)
    proc = subprocess.Popen([sys.executable, str(SCRIPT)], env=full, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)   # its own process group, as under a shell
    return Run(proc)


def wait_dead(procs: list[psutil.Process], timeout: float = 10.0) -> None:
    """Until each has exited (a zombie: its parent, the training process, reaps it later)."""
    deadline = time.monotonic() + timeout
    for p in procs:
        while True:
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            assert time.monotonic() < deadline, f"{p} did not exit"
            time.sleep(0.01)


def committed_steps(directory: Path) -> list[int]:
    storage = Storage(str(directory))
    return [i.step for i in scan(storage) if verify_step(storage, i).ok]


def saved_position(directory: Path, step: int) -> dict[str, int]:
    shared = torch.load(directory / f"step-{step:012d}" / "shared.pt", weights_only=True)
    return shared["data"]


def first_sample_at(consumed: int) -> int:
    """The first sample of the batch at position ``consumed`` of epoch 0: the dataset's
    sample i is the number i, in ResumableSampler's (DistributedSampler's) order."""
    order = torch.randperm(4096, generator=torch.Generator().manual_seed(SEED))
    return int(order[consumed])


def step_lines(text: str) -> dict[int, int]:
    lines = re.finditer(r"^step (\d+) batch (\d+)$", text, re.MULTILINE)
    return {int(m[1]): int(m[2]) for m in lines}


def check_resumes_at(tmp: Path, step: int, interrupted: Run) -> None:
    """The platform's rerun resumes after ``step`` with the batches that step had."""
    again = start(tmp, "again", MICRO="2", STEP_S="0", STEPS=str(step + 2))
    assert again.finish() == 0, again.err_text[-3000:]
    assert f"restored {step} position {step * 2 * BATCH}\n" in again.out_text
    resumed = step_lines(again.out_text)
    assert min(resumed) == step
    assert resumed[step] == first_sample_at(step * 2 * BATCH)
    # The interrupted run had started that step with the same first batch.
    assert step_lines(interrupted.out_text)[step] == resumed[step]


@pytest.mark.slow
def test_a_process_group_sigterm_during_a_dataloader_saves_and_exits_134(
        tmp_path: Path) -> None:
    # SIGTERM to the group (as `timeout` or `docker stop` with an init send it) while step 4
    # is between its two micro-batches: the workers die with the process, the step stops at
    # its second batch, and the checkpoint is of step 4, its first batch not counted.
    run = start(tmp_path, MICRO="2", PAUSE_AT="4")
    run.wait_line(r"^paused 4$")
    t0 = time.monotonic()
    os.killpg(run.proc.pid, signal.SIGTERM)
    rc = run.finish()
    took = time.monotonic() - t0
    err = run.err_text
    assert rc == 134, err[-3000:]
    assert committed_steps(tmp_path / "ckpt") == [4], err[-2000:]
    assert [line for line in err.splitlines() if line.strip()] == [
        LOADER_LINE.format(step=4)], err
    assert "done 3\n" in run.out_text and "done 4\n" not in run.out_text
    position = saved_position(tmp_path / "ckpt", 4)
    assert (position["epoch"], position["consumed"]) == (0, 4 * 2 * BATCH)
    report = json.loads((tmp_path / "run-report.json").read_text())["resilient_train"]
    assert report["classification"] == "transient" and report["exit_code"] == 134
    assert "is killed by signal" in report["traceback"]   # the detail: in the report
    assert took < 10.0, took
    check_resumes_at(tmp_path, 4, run)


@pytest.mark.slow
def test_a_sigterm_at_an_epoch_loops_draw_saves_the_step_it_finished(tmp_path: Path) -> None:
    # An epoch loop draws a step's batch before ctx.steps ends the step before it: the
    # group's SIGTERM lands after step 4's optimizer step, and the next draw finds the
    # workers dead. Step 4 is done: its checkpoint is of 5 steps and 5 batches (it was
    # saved as step 4, with the state of 5, before).
    run = start(tmp_path, DRAW_FIRST="1", PAUSE_AT="4")
    run.wait_line(r"^paused 4$")
    os.killpg(run.proc.pid, signal.SIGTERM)
    rc = run.finish()
    assert rc == 134, run.err_text[-3000:]
    assert committed_steps(tmp_path / "ckpt") == [5], run.err_text[-2000:]
    assert LOADER_LINE.format(step=5) in run.err_text
    position = saved_position(tmp_path / "ckpt", 5)
    assert (position["epoch"], position["consumed"]) == (0, 5 * BATCH)


@pytest.mark.slow
def test_a_sigterm_just_after_the_workers_died_still_saves(tmp_path: Path) -> None:
    # The workers are stopped first (a sender that signals one process after another): the
    # loop meets their death at its next batch, and the SIGTERM that follows within the
    # window still turns it into the emergency save.
    run = start(tmp_path, MICRO="2", PAUSE_AT="3")
    run.wait_line(r"^paused 3$")
    workers = psutil.Process(run.proc.pid).children()
    assert len(workers) == 2, workers   # the loader's num_workers=2
    for w in workers:
        w.send_signal(signal.SIGTERM)
    wait_dead(workers)
    run.wait_line(r"^resumed 3$")   # and straight on to its next batch, which fails
    run.proc.send_signal(signal.SIGTERM)
    rc = run.finish()
    err = run.err_text
    assert rc == 134, err[-3000:]
    assert [line for line in err.splitlines() if line.strip()] == [
        LOADER_LINE.format(step=3)], err
    assert committed_steps(tmp_path / "ckpt") == [3]
    position = saved_position(tmp_path / "ckpt", 3)
    assert (position["epoch"], position["consumed"]) == (0, 3 * 2 * BATCH)


@pytest.mark.slow
def test_a_plain_dataloader_gets_the_emergency_save_too(tmp_path: Path) -> None:
    run = start(tmp_path, MICRO="2", PAUSE_AT="4", PLAIN="1")
    run.wait_line(r"^paused 4$")
    os.killpg(run.proc.pid, signal.SIGTERM)
    rc = run.finish()
    err = run.err_text
    assert rc == 134, err[-3000:]
    steps = committed_steps(tmp_path / "ckpt")
    # Step 5's second batch may still have been in the loader's queue: then step 5 ends
    # and its boundary saves; else the step stops at that batch and step 4 is saved.
    assert steps in ([4], [5]), (steps, err[-2000:])
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines in ([LOADER_LINE.format(step=4)], [BOUNDARY_LINE.format(step=5)]), err


@pytest.mark.slow
def test_a_dead_loader_worker_without_a_sigterm_is_still_exit_1(tmp_path: Path) -> None:
    run = start(tmp_path, STEP_S="0.02")
    run.wait_line(r"^done 2$")
    workers = psutil.Process(run.proc.pid).children()
    assert len(workers) == 2, workers   # the loader's num_workers=2
    workers[0].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    rc = run.finish()
    took = time.monotonic() - t0
    err = run.err_text
    assert rc == 1, err[-3000:]
    assert "exiting with code 1 (permanent): RuntimeError: DataLoader worker" in err
    assert "Killed" in err
    assert committed_steps(tmp_path / "ckpt") == []   # no emergency save
    assert took < 15.0, took


@pytest.mark.slow
def test_a_worker_waiting_for_its_primary_leaves_at_once_on_sigterm(tmp_path: Path) -> None:
    port = free_port()   # nobody listens: the primary never comes
    run = start(tmp_path, RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port), LOG_LEVEL="INFO",
                RESILIENT_TRAIN_JOB_SECRET="signals-test-secret-0123456789")
    run.wait_line(r"waiting for the primary workerpool0-0 at 127\.0\.0\.1:\d+", stream="err")
    t0 = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    run.wait_line(r"leaving, exit 134$", stream="err", timeout=10.0)
    took = time.monotonic() - t0   # the interpreter's own exit comes on top
    rc = run.finish()
    err = run.err_text
    assert rc == 134, err[-3000:]
    assert took < 2.0, took
    assert not CPP_STACK.search(err), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert (f"SIGTERM while waiting for the primary workerpool0-0 at 127.0.0.1:{port} to "
            f"accept connections; leaving, exit 134") in err
    report = json.loads((tmp_path / "run-report.json").read_text())["resilient_train"]
    assert report["message"].startswith("StopRequestedError: SIGTERM while waiting")
    assert "Traceback" in report["traceback"]   # the detail stays in the report


@pytest.mark.slow
def test_the_emergency_save_exit_prints_one_line(tmp_path: Path) -> None:
    # SIGTERM to the main process only, as the platform sends it to the container's PID 1:
    # the loader's workers live on, and the step boundary does the emergency save.
    run = start(tmp_path, STEP_S="0.02")
    run.wait_line(r"^done 3$")
    run.proc.send_signal(signal.SIGTERM)
    rc = run.finish()
    err = run.err_text
    assert rc == 134, err[-3000:]
    steps = committed_steps(tmp_path / "ckpt")
    assert len(steps) == 1, steps
    assert [line for line in err.splitlines() if line.strip()] == [
        BOUNDARY_LINE.format(step=steps[0])], err
    report = json.loads((tmp_path / "run-report.json").read_text())["resilient_train"]
    assert report["message"] == f"SIGTERM: emergency checkpoint of step {steps[0]} committed"
    assert "File " in report["traceback"]   # where it exited: in the report, not the log


RACE = """
import signal, sys, time
from resilient_train import sigterm
signal.signal(signal.SIGALRM, lambda signum, frame: sigterm.note())   # as the SIGTERM handler
signal.setitimer(signal.ITIMER_REAL, 0.0001, 0.0005)
end = time.monotonic() + float(sys.argv[1])
waits = noted = 0
while time.monotonic() < end:
    noted += sigterm.wait(0.0005)
    sigterm.forget()
    waits += 1
signal.setitimer(signal.ITIMER_REAL, 0)
sigterm.forget()
assert not sigterm.received() and not sigterm.wait(0.01)   # forgotten: the byte is gone too
print("waits", waits, "noted", noted)
"""


def test_a_sigterm_handled_inside_a_wait_for_it_never_deadlocks() -> None:
    # The handler runs in the main thread between two bytecodes, also while that thread is
    # inside sigterm.wait (the loader-death path waits there for the SIGTERM that stopped the
    # workers). A threading.Event deadlocked there: set() wanted the lock that wait() held.
    # A timer interrupts thousands of waits; each must end, and see the note. (Every 0.5 ms:
    # at 50 us a loaded machine ran the next handler inside the last, to RecursionError.)
    proc = subprocess.run([sys.executable, "-c", RACE, "1.5"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    waits, noted = (int(x) for x in re.findall(r"\d+", proc.stdout))
    # Thousands of waits here; a coarser timer elsewhere still interrupts hundreds.
    assert waits >= noted >= 100, proc.stdout


class _Unreachable(torch.utils.data.Dataset):
    """A dataset whose fetch breaks a connection (as a batch's fd passing does when the
    loader worker that sends it is killed)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        raise ConnectionResetError(104, "Connection reset by peer")


def _fetch_error() -> BaseException:
    try:
        next(iter(torch.utils.data.DataLoader(_Unreachable(), batch_size=2)))
    except ConnectionResetError as exc:
        return exc
    raise AssertionError("the fetch did not fail")


def test_a_broken_fetch_is_the_loader_workers_death_once_the_handler_names_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The connection error reached the loop before the SIGCHLD handler that names the
    # death: it is judged as that death (exit 1, torch's words), not as a lost network.
    from resilient_train import runtime, sigterm
    from resilient_train.errors import Classification, classify_exception

    told = iter([None, None, "DataLoader worker (pid 4242) is killed by signal: Killed. "])
    monkeypatch.setattr(sigterm, "take_loader_failure", lambda: next(told))
    death = runtime._surfaced_loader_death(_fetch_error())
    assert isinstance(death, RuntimeError) and runtime._loader_death(death)
    assert "is killed by signal: Killed" in str(death)
    assert classify_exception(death) is Classification.PERMANENT


def test_a_broken_fetch_with_no_dead_worker_stays_what_it_is(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from resilient_train import runtime, sigterm

    asked = []
    monkeypatch.setattr(sigterm, "take_loader_failure", lambda: asked.append(1))
    assert runtime._surfaced_loader_death(_fetch_error()) is None   # a dataset's own error
    assert len(asked) > 1                                           # after waiting for one
    asked.clear()
    assert runtime._surfaced_loader_death(ConnectionResetError(104, "elsewhere")) is None
    assert asked == []                                              # not a fetch: no wait
