"""Recovery from live peers (checkpoint/peers.py, transport/transfer.py): the plan every rank computes,
the state moved between real processes over gloo, and a 3-worker job under the launcher
that loses a worker, then its primary, then the whole attempt, and ends with the weights,
RNG streams and values of a run that never failed, having read no storage for the first
two faults."""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from pathlib import Path

import pytest
import torch
from jobs import assert_same_end, launch_job, the_recovery
from lives import Life, run_lives

from resilient_train import sigterm
from resilient_train.checkpoint.commit.directory import (
    SHARED_FILE,
    find_committed,
    rank_file,
    read_manifest,
)
from resilient_train.checkpoint.state.capture import capture_rng
from resilient_train.checkpoint.storage.base import Storage
from resilient_train.checkpoint.tiers.early import Early
from resilient_train.checkpoint.tiers.plan import NoPlan, Plan, Recovered, Report, plan
from resilient_train.checkpoint.tiers.plan import dumps_rank_state as _dumps
from resilient_train.checkpoint.tiers.plan import loads_rank_state as _loads
from resilient_train.checkpoint.transport.ringlink import ring_order
from resilient_train.distributed.errors import StopRequestedError
from resilient_train.launcher.ports import free_port

HERE = Path(__file__).resolve().parent


def report(rank: int, replicated: int | None = None, own: tuple[int, ...] = (),
           held: tuple[int, ...] = (), world: int = 3, last_commit: int | None = None,
           why_not: str = "") -> Report:
    return Report(rank=rank, replicated=() if replicated is None else (replicated,), own=own,
                  held_for=(rank - 1) % world if held else None, held=held,
                  last_commit=last_commit, save_point=(last_commit, 0.0), why_not=why_not)


# --- the plan ---------------------------------------------------------------------------


def test_a_restarted_rank_gets_its_state_from_the_next_rank_and_the_model_from_the_lowest():
    got = plan([report(0, 40, (39, 40), (39, 40)), report(1),
                report(2, 40, (39, 40), (39, 40))])
    assert isinstance(got, Plan)
    assert (got.step, got.holder, got.needs_state) == (40, 0, (1,))
    assert got.rank_source == {0: 0, 1: 2, 2: 2}   # rank 1's RNG and values: rank 2 holds them


def test_survivors_a_step_apart_agree_on_the_older_step_that_everyone_can_restore():
    # Rank 0 finished step 41 (it holds rank 1's early copy of 41? no: rank 1 died before
    # sending it), rank 2 waited before its optimizer step and is still at 40.
    got = plan([report(0, 41, (40, 41), (40, 41)), report(1),
                report(2, 40, (39, 40), (39, 40))])
    assert isinstance(got, Plan)
    assert got.step == 40 and got.holder == 2
    assert got.needs_state == (0, 1)                   # rank 0 is a step ahead: it gets 40
    assert got.rank_source == {0: 0, 1: 2, 2: 2}


def test_no_plan_when_a_rank_and_its_holder_are_both_lost():
    got = plan([report(0, 40, (39, 40), (39, 40)), report(1), report(2)])
    assert isinstance(got, NoPlan) and got.survivors
    assert "rank 1's RNG, values and buffers of step 40" in got.reason


def test_the_ring_puts_each_ranks_copy_on_another_machine() -> None:
    # torchrun on multi-GPU replicas numbers a machine's ranks together: 2 machines x 2
    # processes are ranks [0, 1] and [2, 3]. A plain ring 0-1-2-3 would keep rank 0's copy
    # on rank 1, its own machine, and a lost machine would take both.
    for machines in (["A", "A", "B", "B"], ["A", "A", "A", "B", "B", "B"],
                     ["A", "B", "C", "A", "B", "C"], ["A"] * 4 + ["B"] * 4 + ["C"] * 4):
        order = ring_order(machines)
        assert sorted(order) == list(range(len(machines)))
        for at, rank in enumerate(order):
            nxt = order[(at + 1) % len(order)]
            assert machines[rank] != machines[nxt], (machines, order)
    assert ring_order(["A", "A", "B", "B"]) == [0, 2, 1, 3]
    # One process per machine (the launcher's replicas), or one machine: the plain ring.
    assert ring_order(["m0", "m1", "m2"]) == [0, 1, 2]
    assert ring_order(["A", "A", "A"]) == [0, 1, 2]


def test_no_plan_at_a_fresh_start_and_none_when_every_survivor_is_torn():
    fresh = plan([report(0), report(1), report(2)])
    assert isinstance(fresh, NoPlan) and not fresh.survivors
    torn = plan([report(0, None, (40,), (40,), why_not="its step 41 had already changed"),
                 report(1), report(2, None, (40,), (40,), why_not="its step 41 had already")])
    assert isinstance(torn, NoPlan) and torn.survivors
    assert "rank 0: its step 41 had already changed" in torn.reason


def test_a_newer_committed_checkpoint_wins_over_memory():
    got = plan([report(0, 40, (40,), (40,), last_commit=45), report(1),
                report(2, 40, (40,), (40,))])
    assert isinstance(got, NoPlan)
    assert "newer checkpoint (step 45)" in got.reason


def test_rank_state_bytes_are_the_same_for_the_same_state_and_round_trip():
    # The step's early and final copies are compared as bytes: equal state, equal bytes.
    state = {"rng": capture_rng(), "values": {"seen": 3, "t": torch.arange(4)}}
    a, b = _dumps(state), _dumps({"rng": capture_rng(), "values": {"seen": 3,
                                                                   "t": torch.arange(4)}})
    assert a == b
    back = _loads(a)
    assert torch.equal(back["rng"]["torch_cpu"], state["rng"]["torch_cpu"])
    assert back["rng"]["python"] == state["rng"]["python"]
    assert torch.equal(back["values"]["t"], torch.arange(4))
    torch.rand(3)
    assert _dumps({"rng": capture_rng(), "values": {}}) != _dumps({"rng": state["rng"],
                                                                    "values": {}})


def test_a_handed_over_state_is_copied_only_while_its_objects_live_on() -> None:
    import gc
    import weakref

    from resilient_train.checkpoint.tiers.peers import PeerMemory

    def handed_over(model: torch.nn.Module) -> PeerMemory:
        m = PeerMemory(replicated={"model": model.state_dict()}, replicated_step=7)
        m.owners = [weakref.ref(model)]
        return m

    kept = torch.nn.Linear(3, 3)
    m = handed_over(kept)
    m.detach(rank=1)
    copy = m.replicated["model"]["weight"]
    assert not m.owners and copy.data_ptr() != kept.weight.data_ptr()
    with torch.no_grad():
        kept.weight.fill_(0.0)   # what DDP's broadcast of a fresh rank 0 does
    assert copy.abs().sum() > 0   # the memory kept the state of step 7

    gone = torch.nn.Linear(3, 3)
    m = handed_over(gone)
    weight = m.replicated["model"]["weight"]
    del gone
    gc.collect()
    m.detach(rank=1)   # the usual case: the next life builds new objects, nothing copied
    assert m.replicated["model"]["weight"] is weight


def test_shard_copies_count_only_after_a_hand_over_of_the_same_directory() -> None:
    from resilient_train.checkpoint.tiers import shards as shard_copies
    from resilient_train.checkpoint.tiers.peers import PeerMemory

    m = PeerMemory()
    shard_copies.keep(m, "gs://b/run", 10, b"own10", b"prev10", 2, 100.0)
    shard_copies.keep(m, "gs://b/run", 20, b"own20", b"prev20", 2, 200.0)
    shard_copies.keep(m, "gs://b/run", 30, b"own30", b"prev30", 2, 300.0)
    assert sorted(m.shards) == [20, 30]      # an exchange in flight keeps the one before
    shard_copies.confirm(m, 30)               # every rank holds 30: 20 is dropped
    assert sorted(m.shards) == [30] and sorted(m.partner_shards) == [30]
    # A manager that merely starts in this process does not take them: storage decides.
    assert shard_copies.report(m, 0, "gs://b/run").own == ()
    m.shards_handed_over = True               # a life of this job ended on an error
    got = shard_copies.report(m, 0, "gs://b/run")
    assert (got.own, got.held_for, got.held, got.save_point) == ((30,), 2, (30,),
                                                                 (30, 300.0))
    assert shard_copies.report(m, 0, "gs://b/other").own == ()   # another run's directory
    shard_copies.keep(m, "gs://b/other", 5, b"o", b"p", 2, 1.0)  # its saves replace them
    assert sorted(m.shards) == [5]


# --- the early transfer ----------------------------------------------------------------


def _recovered(step: int) -> Recovered:
    return Recovered(step=step, shared={}, mine={}, mine_bytes=b"", from_rank=0, nbytes=1,
                     save_point=(None, 0.0), last_commit=None)


def test_an_early_restore_hands_its_result_or_its_failure_to_the_restore() -> None:
    assert Early(lambda: _recovered(7), "the state of step 7").result().step == 7

    def lost() -> Recovered:
        raise ConnectionResetError("a peer went away mid-transfer")

    with pytest.raises(ConnectionResetError, match="mid-transfer"):
        Early(lost, "the state of step 7").result()


def test_a_sigterm_while_an_early_restore_hangs_leaves_after_the_stall_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer frozen mid-transfer: nothing ends the wait by itself, and StallGuard does not
    see a main thread that waits on another thread. After a SIGTERM the restore gives the
    transfer STALL_S, then leaves (exit 134); a transfer that ends in time is taken."""
    monkeypatch.setattr(sigterm, "STALL_S", 0.3)
    frozen, slow = threading.Event(), threading.Event()
    try:
        sigterm.note()
        with pytest.raises(StopRequestedError, match="restoring the state of step 7"):
            Early(lambda: (frozen.wait(), _recovered(7))[1], "the state of step 7").result()
        # Ends 0.1 s after the SIGTERM, inside the 0.3 s: the restore goes on.
        threading.Timer(0.1, slow.set).start()
        assert Early(lambda: (slow.wait(), _recovered(7))[1], "the state of step 7"
                     ).result().step == 7
    finally:
        frozen.set()
        sigterm.forget()


# --- moving state between processes -----------------------------------------------------


def test_a_state_tree_moves_point_to_point_and_is_read_once_between_real_processes(
        tmp_path: Path) -> None:
    """send_tree / recv_tree, and readonce.read_once: a file streamed by rank 0 in chunks
    lands whole on every rank as views of one buffer; manifests that disagree on its size,
    a truncated file and a read that fails half-way raise the same error on every rank, and
    no rank waits for ever, also when a receiver dies mid-stream."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE="3", RESULT_DIR=str(tmp_path), GLOO_SOCKET_IFNAME="lo")
    procs = run_lives([Life([str(HERE / "dist_workers" / "transfer_worker.py")],
                            env | {"RANK": str(r)}) for r in range(3)],
                      together=True)
    outs = [p.stdout + p.stderr for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 17], outs   # rank 2 died mid-stream
    sys.path.insert(0, str(HERE / "dist_workers"))
    try:
        from transfer_worker import tree
    finally:
        sys.path.pop(0)
    want = tree()
    nbytes = 300 * 1000 * 4 + 7 * 2 + 15 * 4 + 9 + 6 * 8 + 4   # tied tensors travel once
    got = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(3)]
    for rank in range(3):
        whole = got[rank]["whole"]
        assert "error" not in whole, (rank, whole)
        for key in ("p2p", "whole") if rank == 2 else ("whole",):
            tree_ = got[rank][key] if key == "p2p" else whole["tree"]
            for name, t in want["model"].items():
                assert tree_["model"][name].dtype == t.dtype, (rank, key, name)
                assert torch.equal(tree_["model"][name], t), (rank, key, name)
            assert tree_["optimizer"]["param_groups"] == want["optimizer"]["param_groups"]
            assert torch.equal(tree_["optimizer"]["state"][0]["step"], torch.tensor(12.0))
            assert tree_["plain"] == want["plain"]
        assert whole["span"] <= got[rank]["file_bytes"]   # views of one buffer: no copy
        assert whole["read"] == (got[0]["file_bytes"] if rank == 0 else 0)
        disagree = got[rank]["disagree"]
        assert disagree["error"] == "CorruptCheckpointError", (rank, disagree)
        assert "manifests disagree on its size" in disagree["message"]
        short, drops = got[rank]["short"], got[rank]["drops"]
        assert short["error"] == "CorruptCheckpointError", (rank, short)
        assert "short.pt: " in short["message"] and "the manifest says" in short["message"]
        assert drops["error"] == ("ConnectionResetError" if rank == 0 else "StorageError")
        assert "the connection dropped half-way" in drops["message"], (rank, drops)
        if rank:
            assert "read by rank 0" in drops["message"]
    assert got[1]["short"]["message"] == got[0]["short"]["message"]
    # A receiver that dies mid-stream: the others get an error, not a wait.
    for rank in (0, 1):
        dies = torch.load(tmp_path / f"dies.rank{rank}.pt", weights_only=True)
        assert "error" in dies, (rank, dies)
    assert 0 < got[0]["drops"]["read"] < got[0]["file_bytes"]
    assert got[2]["p2p_bytes"] == got[0]["sent_bytes"] == nbytes
    # A transfer by a recovery plan: the receiver and the sender say how far it got, of
    # how much (held part-way at the sender), and a closing line; the third rank nothing.
    for rank, head in ((2, r"rank 2: receiving step 5 from rank 0's memory: "),
                       (0, r"rank 0: sending step 5 from its memory to rank 2: ")):
        lines = got[rank]["progress"]
        shown = [m for m in (re.fullmatch(head + r"([0-9.]+) (B|KiB|MiB) of 2\.3 MiB "
                                           r"\(([0-9]+)%, .*/s\)", ln) for ln in lines) if m]
        assert any(int(m.group(3)) == 50 for m in shown), lines
        assert re.fullmatch(head + r"done, 2\.3 MiB in [0-9]+ s \(.*/s\)", lines[-1]), lines
    assert got[1]["progress"] == []


# Each scenario of the early transfer: its two ranks' output, and their results' directory.
EarlyRuns = dict[str, tuple[list[str], Path]]
EARLY_SCENARIOS = ("PLAIN", "FAIL_LAST_SAVE", "FUSED_TORN", "LATE_LOST", "EMA", "LARGE",
                   "POST_COLLECTIVE", "SKIP_LOST")


@pytest.fixture(scope="module")
def early(tmp_path_factory: pytest.TempPathFactory) -> EarlyRuns:
    """dist_workers/early_restore_worker.py as ranks 0 and 1, once for every scenario the
    tests below look at, all side by side (lives of one process: tests/lives.py): for each,
    the two ranks' output and the directory of their results."""
    tmp = tmp_path_factory.mktemp("early")
    worker = HERE / "dist_workers" / "early_restore_worker.py"
    lives = []
    for name in EARLY_SCENARIOS:
        (tmp / name).mkdir()
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   RESULT_DIR=str(tmp / name), CKPT_DIR=str(tmp / name / "ckpt"),
                   GLOO_SOCKET_IFNAME="lo", **({} if name == "PLAIN" else {name: "1"}))
        lives += [Life([str(worker)], env | {"RANK": str(r)}) for r in range(2)]
    procs = run_lives(lives, together=True, timeout=300)
    outs = [p.stdout + p.stderr for p in procs]
    assert [p.returncode for p in procs] == [0] * len(lives), outs
    return {name: (outs[2 * i:2 * i + 2], tmp / name)
            for i, name in enumerate(EARLY_SCENARIOS)}


@pytest.mark.parametrize("scenario", ["PLAIN", "FAIL_LAST_SAVE"])
def test_a_restarted_ranks_state_arrives_before_it_has_built_its_model(
        early: EarlyRuns, scenario: str) -> None:
    """start_restore: the ranks agree on the plan as the life begins and the state
    moves in a thread; rank 1 (a new process as far as peer recovery knows) waits for the
    transfer to end, only then builds a model with other initial weights, and restores
    exactly rank 0's step-4 state, its own RNG and values from rank 0's copy."""
    # FAIL_LAST_SAVE: rank 0's last boundary raises a background save's failure (a peer
    # lost in the save's collective, as in a 2x2 job killed mid-save). The step was done:
    # its state is kept all the same, and the restore still comes from memory.
    outs, result = early[scenario]
    if scenario == "FAIL_LAST_SAVE":
        assert "rank 0: the boundary raised TransientCheckpointError" in outs[0], outs[0]
    got = [torch.load(result / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert got[1]["arrived_first"] is True
    for r in range(2):
        assert got[r]["step"] == 4, got[r]["record"]
        record = got[r]["record"]
        assert record["source"] == "peer" and record["bytes_read"]["persistent"] == 0
        for name, t in got[0]["weights_life1"].items():
            assert torch.equal(got[r]["weights"][name], t), (r, name)
        assert got[r]["values"] == {"seen": 4 * (r + 1)}
        assert torch.equal(got[r]["draw"], got[r]["draw_life1"]), r
        assert got[r]["opt_steps"] == [4.0] * 4
    assert got[1]["record"]["from_rank"] == 0 and got[1]["record"]["bytes_read"]["peer"] > 0
    assert got[0]["record"]["from_rank"] is None
    # The restore loaded what the early transfer moved (and said so), moving nothing again.
    assert re.search(r"restored step 4 from rank 0 \(\S+ \S+ of state received in "
                     r"[\d.]+ s while the model was built\)", outs[1]), outs[1]
    assert not (result / "ckpt").exists() or not any((result / "ckpt").iterdir())


# --- a job under the launcher -----------------------------------------------------------

STEPS = 100
RANK_OF = {"workerpool0-0": 0, "workerpool1-0": 1, "workerpool1-1": 2}


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The job without faults, run once for every test that compares with it (its end
    does not depend on the tier options or the kill points the tests set)."""
    return launch(tmp_path_factory.mktemp("clean"), "clean", None)[2]


def launch(tmp: Path, name: str, chaos: str | None) -> tuple[dict, str, Path]:
    return launch_job(tmp, name, 3, ["--chaos", chaos] if chaos else [],
                      [str(HERE / "workers" / "peer_ddp.py"), str(STEPS), "25", "0.03"])


def restores(job_dir: Path) -> list[dict]:
    """Every restore event the workers reported, in time order."""
    events = []
    for path in (job_dir / "telemetry").rglob("*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec["kind"] == "restore":
                events.append(rec | {"life": str(path.relative_to(job_dir))})
    return sorted(events, key=lambda e: e["t"])


@pytest.mark.slow
def test_a_lost_machine_of_two_processes_restores_from_the_other_machines_memory(
        tmp_path: Path) -> None:
    """Two replicas of two processes each (torchrun on each machine, as on a multi-GPU VM,
    examples/torchrun_replica.sh): ranks [0, 1] and [2, 3]. The second machine is lost.
    The ring runs 0-2-1-3, so its ranks' RNG and values were held on the first machine,
    and every rank restores from memory. (In the ring 0-1-2-3, rank 2's copy was on rank 3,
    lost with it, and the job went back to its last checkpoint.)"""
    script = [str(HERE.parent / "examples" / "torchrun_replica.sh"), "--steps", "100"]
    job, out, _ = launch_job(tmp_path, "machines", 2,
                             ["--chaos", "kill:workerpool1-0@step60"], script, program="bash")
    assert job["state"] == "JOB_STATE_SUCCEEDED", out[-3000:]
    recovery = the_recovery(job, out)
    # One entry per process, though a replica's two processes share its telemetry.
    assert [(r["replica"], r["rank"]) for r in recovery["ranks"]] == [
        ("workerpool0-0", 0), ("workerpool0-0", 1), ("workerpool1-0", 2),
        ("workerpool1-0", 3)], recovery
    assert {r["source"] for r in recovery["ranks"]} == {"peer"}, (recovery, out[-3000:])
    assert recovery["bytes_read"]["persistent"] == 0 and recovery["steps_lost"] <= 1, recovery
    # Goodput counts each replica's steps once, though its two processes report them.
    goodput = job["goodput"]
    assert goodput["recoveries"] == 1 and goodput["steps_lost"] <= 1, goodput
    assert "restoring from" not in out, out[-3000:]   # the fallback's line
    resumed = re.findall(r"rank (\d): resumed from step (\d+) \(from (.*?)\)", out)
    assert sorted(r for r, _, _ in resumed) == ["0", "1", "2", "3"], resumed
    assert all("memory" in source for _, _, source in resumed), resumed


@pytest.mark.slow
def test_a_rank_killed_in_the_middle_of_a_peer_transfer_leaves_nothing_torn(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean: Path) -> None:
    """Rank 1 is lost at step 30; its new process is killed while it receives the model,
    and the survivors, whose memory the transfer never touched, give it again. Rank 2 is
    lost at step 60, and the rank sending the model is killed while it sends: a rank's
    RNG and values were on it alone, so the restore reads storage (step 50), and says
    why. The run ends bitwise equal to one without faults."""
    monkeypatch.setenv("PEER_DDP_KILL_IN_TRANSFER", "receiver:30,sender:60")
    monkeypatch.setenv("PEER_DDP_MARKS", str(tmp_path))
    job, out, faulted = launch(tmp_path, "faulted", "kill:workerpool1-0@step30,"
                                                    "kill:workerpool1-1@step60")
    assert job["state"] == "JOB_STATE_SUCCEEDED", out[-3000:]
    assert out.count("killed in the middle of a peer transfer") == 2, out[-3000:]
    events = [e for e in restores(faulted) if "attempt-1" in e["life"]]
    by_generation: dict[int, list[dict]] = {}
    for e in events:
        by_generation.setdefault(e["generation"], []).append(e)
    done = [g for g in sorted(by_generation) if len(by_generation[g]) == 3]
    # A generation whose transfer was cut has no complete restore; the ones that finished:
    peers_ = [by_generation[g] for g in done if {e["source"] for e in
                                                 by_generation[g]} == {"peer"}]
    stored = [by_generation[g] for g in done if {e["source"] for e in
                                                 by_generation[g]} == {"persistent"}]
    # The kill fires once the launcher reads step 30 from the telemetry: on loaded cores the
    # ranks may have finished one or two more steps before the SIGKILL lands.
    assert peers_ and 30 <= peers_[0][0]["step"] <= 32, events
    assert any(e["from_rank"] is not None and "workerpool1-0.restart-2" in e["life"]
               for e in peers_[0]), peers_[0]     # the second new process got it
    assert len(stored) == 1 and stored[0][0]["step"] == 50, events
    assert all("RNG, values and buffers of step" in e["reason"] for e in stored[0]), stored
    assert_same_end(clean, faulted, ranks=3)


@pytest.mark.slow
def test_a_model_kept_across_lives_is_copied_before_ddp_overwrites_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean: Path) -> None:
    """The model, optimizer and schedule built once per process (as at a script's top) and
    trained on by every life, whose loop zeroes gradients after opt.step(). The primary is
    lost: its new process builds a fresh model, and each survivor's DDP constructor
    broadcasts those fresh parameters into the model its memory of the last step
    referenced. That memory is copied as the life begins, so every rank still restores the
    last step from memory; and the restore drops the gradients the failed step left, which
    the first step after it would have added to its own. The run ends bitwise equal to one
    without faults (it ended on other weights, without a word, before)."""
    monkeypatch.setenv("PEER_DDP_KEEP_MODEL", "1")
    job, out, faulted = launch(tmp_path, "kept", "kill:workerpool0-0@step60")
    assert job["state"] == "JOB_STATE_SUCCEEDED", out[-3000:]
    recovery = the_recovery(job, out)
    assert {r["source"] for r in recovery["ranks"]} == {"peer"}, (recovery, out[-3000:])
    assert recovery["bytes_read"]["persistent"] == 0, recovery
    assert_same_end(clean, faulted, ranks=3)
    copied = re.findall(r"rank (\d): the last life's Sequential and AdamW are still in use "
                        r"\(built outside the training function\), so its state of step "
                        r"(\d+) is copied", out)
    assert sorted(r for r, _ in copied) == ["1", "2"], out[-3000:]   # the survivors


@pytest.mark.slow
def test_nothing_to_restore_with_a_kept_model_starts_the_job_afresh(tmp_path: Path) -> None:
    """A model kept across lives and no checkpoint yet; the survivor is torn (its peer is
    lost in a metric's all-reduce after opt.step()), so there is nothing to restore while
    its model holds 6 steps of training. Training on from it with the step count back at
    0 is what happened before; now the survivor exits transient, saying why, and the job
    retry starts every replica afresh."""
    script = [str(HERE / "workers" / "kept_fresh_start.py"), "30", "6"]
    job, out, _ = launch_job(tmp_path, "kept", 2, [], script)
    assert job["state"] == "JOB_STATE_SUCCEEDED", out[-3000:]
    assert job["budgets"]["job_retries"]["used"] == 1, job["budgets"]
    assert ("rank 0: nothing to restore after a peer's loss (no survivor holds the last "
            "step, and ") in out and ("this life trains the last life's Sequential and SGD "
                                      "on (built outside the training function)") in out, \
        out[-3000:]
    # The retry's new processes built new objects and trained all 30 steps from the start.
    assert len(re.findall(r"final weights sum", out)) == 1, out[-2000:]


@pytest.mark.slow
def test_three_workers_survive_every_kind_of_fault_in_one_run_and_end_bitwise(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean: Path) -> None:
    """One run of a 3-worker DDP job with a node-local tier (every 2nd save to storage)
    that loses: rank 2's node, the primary's node (and the store with it), rank 1 to a
    maintenance move (SIGTERM, an emergency save, then a new VM: its disk wiped), rank 2
    to a preemption (the same) and, last, the attempt (a job retry: every process and
    disk new). The first four restore from the survivors' memory; the retry reads the
    persistent tier once. It ends bitwise equal to a run without faults."""
    monkeypatch.setenv("PEER_DDP_NODE_LOCAL", "2")
    job, out, faulted = launch(tmp_path, "faulted", ",".join([
        "kill:workerpool1-1@step20",          # rank 2's node: peers restore it
        "kill:workerpool0-0@step35",          # the primary, and the store with it: peers
        "maintenance:workerpool1-0@step50",   # SIGTERM, emergency save, a new VM: peers
        "preempt:workerpool1-1@step65",       # the same, as a preemption
        "internal@step80",                    # the attempt fails: every process is new
    ]))
    assert job["state"] == "JOB_STATE_SUCCEEDED"
    assert len(job["attempts"]) == 2, out[-3000:]
    assert out.count("emergency checkpoint of step") >= 2, out[-3000:]
    events = restores(faulted)
    # One in-process recovery per fault of the first attempt, each in a generation of its
    # own, in the faults' order. Their numbers need not run 1 to 4: a generation whose mesh
    # does not connect within form_timeout_s (15 s here, launch_job: a member that got no
    # CPU for that long on loaded cores) is given up, and the ranks form the next one
    # (distributed/group.py, _join_and_connect), so it has no restore at all; the first
    # start, too, may be in generation 1. Every generation that restores does so on all 3.
    recovered = [e for e in events if "attempt-1" in e["life"] and e["source"] != "none"]
    generations = sorted({e["generation"] for e in recovered})
    assert len(generations) == 4, (generations, job["recoveries"], events)
    in_memory = [[e for e in recovered if e["generation"] == g] for g in generations]
    lost = ("workerpool1-1", "workerpool0-0", "workerpool1-0", "workerpool1-1")
    for recovery, replica in zip(in_memory, lost, strict=True):
        assert len(recovery) == 3, (replica, job["recoveries"], events)
        assert {e["source"] for e in recovery} == {"peer"}, events   # every rank
        assert {e["step"] for e in recovery} == {recovery[0]["step"]}
        assert any(f"{replica}.restart-" in e["life"] and e["from_rank"] is not None
                   for e in recovery), recovery
        assert all(e["bytes_read"]["persistent"] == 0 for e in recovery)
        receivers = [e for e in recovery if e["from_rank"] is not None]
        assert len(receivers) >= 1 and all(e["bytes_read"]["peer"] > 0 for e in receivers)
    # Peers restore the step the victim had reached, not the checkpoint (every 25 steps).
    # The kill fires once the launcher reads the step from the telemetry: on loaded cores
    # the ranks may have finished one or two more steps before the SIGKILL lands.
    first, second = (r[0]["step"] for r in in_memory[:2])
    assert 20 <= first <= 22 and 35 <= second <= 37, events
    retried = [e for e in events if "attempt-2" in e["life"]]
    assert len(retried) == 3 and {e["source"] for e in retried} == {"persistent"}, events
    assert len({e["step"] for e in retried}) == 1 and retried[0]["step"] >= 65, events
    assert len({e["generation"] for e in retried}) == 1, retried
    # Read once: the primary reads the replicated file, each rank its own file only.
    storage = Storage(str(faulted / "output" / "checkpoints"))
    step = retried[0]["step"]
    files = read_manifest(storage, find_committed(storage, step), step).files
    read = {RANK_OF[Path(e["life"]).name.split(".")[0]]: e["bytes_read"]["persistent"]
            for e in retried}
    assert read == {r: files[rank_file(r)].size + (files[SHARED_FILE].size if r == 0 else 0)
                    for r in range(3)}, (read, files)
    assert all(e["reason"].startswith("no process holds training state in memory")
               for e in retried), retried
    # The job record says the same, one entry per recovery, with what caused it.
    recoveries = job["recoveries"]
    assert [(r["attempt"], r["generation"]) for r in recoveries] == \
        [*((1, g) for g in generations), (2, retried[0]["generation"])], recoveries
    assert [r["fault"]["cause"] for r in recoveries] == \
        ["node_loss", "node_loss", "maintenance", "preemption", "internal"], recoveries
    for r in recoveries[:4]:
        assert {x["source"] for x in r["ranks"]} == {"peer"}
        assert r["bytes_read"]["persistent"] == 0 and r["steps_lost"] <= 1, r
    assert {x["source"] for x in recoveries[4]["ranks"]} == {"persistent"}
    assert_same_end(clean, faulted, ranks=3)


@pytest.mark.slow
def test_an_fsdp2_job_rebuilds_a_lost_ranks_shard_from_its_neighbours_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP2 on CPU/gloo, 3 workers: rank 1 is lost at step 33. Its shard of the weights
    and AdamW moments exists on no survivor but as the copy rank 2 received at the last
    save (step 30), so every rank goes back to step 30 from memory, nothing read from
    storage; the run ends bitwise equal to one without faults."""
    monkeypatch.setenv("PEER_DDP_FSDP", "1")
    script = [str(HERE / "workers" / "peer_ddp.py"), "60", "10", "0.03"]
    _, _, clean = launch_job(tmp_path, "clean", 3, [], script)
    job, out, faulted = launch_job(tmp_path, "faulted", 3,
                                   ["--chaos", "kill:workerpool1-0@step33"], script)
    assert job["state"] == "JOB_STATE_SUCCEEDED", out[-3000:]
    recovery = the_recovery(job, out)
    assert recovery["step"] == 30, recovery
    assert {r["source"] for r in recovery["ranks"]} == {"peer"}, recovery
    assert recovery["bytes_read"]["persistent"] == 0, recovery
    events = [e for e in restores(faulted) if e["generation"] == 1]
    new = [e for e in events if "workerpool1-0.restart-1" in e["life"]]
    assert len(events) == 3 and new and new[0]["bytes_read"]["peer"] > 0, events
    assert_same_end(clean, faulted, ranks=3)


@pytest.mark.slow
def test_a_gans_step_torn_between_its_optimizers_recovers_from_memory_when_asked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GAN, 2 workers: rank 1 dies right after step 23's discriminator step, and the
    survivor fails in the generator's all-reduce with its discriminator (and its
    scheduler) a step ahead. With undo_torn_steps the survivor puts back the copy taken
    as the step's first optimizer step began: every rank resumes at step 23 from memory,
    nothing read from storage, and the run ends bitwise equal to one without faults (and
    without the option). Without it the survivor is torn and the job goes back to its
    save of step 20 (tests/test_stepwrites.py)."""
    script = [str(HERE / "workers" / "gan_peer.py"), "40"]
    _, clean_out, clean = launch_job(tmp_path, "clean", 2, [], script)   # without the copy
    # The primary names the pattern at its first step, before any fault, and the option.
    assert ("rank 0: step 1 ran a collective on the default process group after opt.step() "
            "(an all-reduce of a metric, a barrier, a second optimizer's gradients)"
            ) in clean_out, clean_out[-3000:]
    assert "CheckpointOptions(undo_torn_steps=True) takes such a step back" in clean_out
    monkeypatch.setenv("GAN_UNDO", "1")
    monkeypatch.setenv("GAN_KILL_AT", "23")
    job, out, faulted = launch_job(tmp_path, "faulted", 2, [], script)
    assert "ran a collective" not in out   # taken care of
    recovery = the_recovery(job, out)
    assert recovery["step"] == 23, recovery
    assert {r["source"] for r in recovery["ranks"]} == {"peer"}, recovery
    assert recovery["bytes_read"]["persistent"] == 0, recovery
    assert "rank 1: resumed from step 23 (from rank 0's memory)" in out, out[-3000:]
    assert_same_end(clean, faulted, ranks=2)


def test_a_fused_optimizers_step_before_the_failure_tears_the_survivor(
        early: EarlyRuns) -> None:
    """A fused optimizer writes the parameters without moving their version counters: its
    step pre-hook says the step began, so a survivor whose step failed after it (a loss
    all-reduced after opt.step()) hands over nothing, rather than a step ahead."""
    outs, result = early["FUSED_TORN"]
    for r in range(2):
        got = torch.load(result / f"rank{r}.pt", weights_only=True)
        assert got["step"] is None and got["record"]["source"] != "peer", got["record"]
    assert "its step 5 had already changed the model's parameters" in outs[0], outs[0]


def test_a_rank_lost_after_changing_its_state_past_opt_step_is_named_with_the_fix(
        early: EarlyRuns) -> None:
    """A rank that once changed its values after its optimizer step (an evaluation's
    metric) sends the copy that counts only at its steps' ends. Lost between its last
    optimizer step and that step's end, it leaves no copy of the step: the restore goes to
    storage, and the line says that this is why and what to change, and the rank itself
    said so at the step it first did it."""
    outs, result = early["LATE_LOST"]
    for r in range(2):
        got = torch.load(result / f"rank{r}.pt", weights_only=True)
        assert got["step"] is None and got["record"]["source"] != "peer", got["record"]
    assert ("no survivor has rank 1's RNG, values and buffers of step 4: it changes them "
            "after opt.step() (as in step 2) and died before its step's end; change them "
            "before it to recover from memory") in outs[0], outs[0]
    assert "rank 1: step 2 changed ctx.values 'best' after opt.step()" in outs[1], outs[1]


def test_an_ema_updated_after_opt_step_comes_back_with_its_update_count(
        early: EarlyRuns) -> None:
    """An SWA/EMA model's ``update_parameters`` runs after ``opt.step()`` and writes the
    buffer ``n_averaged``, which the SWA average divides by. The copy of each rank's own
    state (its buffers among them) taken before the optimizer step must not stand for the
    step's end: restored from memory, the count is every step's, the average exact, and
    the primary names the buffer once (without the check, the count came back one short)."""
    outs, result = early["EMA"]
    for r in range(2):
        got = torch.load(result / f"rank{r}.pt", weights_only=True)
        assert got["step"] == 4 and got["record"]["source"] == "peer", got["record"]
        assert int(got["ema"]["n_averaged"]) == 4
        for key, value in got["ema_life1"].items():
            assert torch.equal(got["ema"][key], value), key
    assert "rank 0: step 1 changed the buffer ema.n_averaged after opt.step()" in outs[0]


def test_a_large_per_rank_state_is_named_once_with_what_makes_it_large(
        early: EarlyRuns) -> None:
    """The ring pickles and sends each rank's own state every step: a loss history kept
    in ctx.values grows that cost without end. Past 1 MB the rank says so, once, naming
    the value, and the recovery from memory still works."""
    outs, result = early["LARGE"]
    line = "rank 0: its own state (RNG, ctx.values, buffers) is 1.4 MB, mostly " \
           "ctx.values['history'] (1.4 MB)"
    assert outs[0].count(line) == 1, outs[0]
    got = torch.load(result / "rank0.pt", weights_only=True)
    assert got["step"] == 4 and got["record"]["source"] == "peer", got["record"]
    assert "its own state" not in outs[1]   # rank 1's is small


def test_a_collective_after_opt_step_is_named_once_at_the_first_step(
        early: EarlyRuns) -> None:
    """A metric all-reduced after opt.step(): a peer lost during it leaves the survivors
    past their optimizer step, and the recovery goes to storage. The default group's
    collective count, read when the optimizer step begins and at the step's end, tells:
    the primary says so at the first step, once; the all-reduces DDP (here, by hand) runs
    before opt.step() are not named."""
    outs, result = early["POST_COLLECTIVE"]
    line = "step 1 ran a collective on the default process group after opt.step()"
    assert outs[0].count(f"rank 0: {line}") == 1, outs[0]
    assert "ran a collective" not in early["PLAIN"][0][0]


def test_a_rank_lost_after_a_skipped_gradscaler_step_leaves_its_copy_with_its_peer(
        early: EarlyRuns) -> None:
    """A GradScaler that skips a step (an overflow) never calls the optimizer's step, whose
    pre-hook sends the rank's state round the ring: the tracked scaler's step() sends it
    too. Rank 1, lost after its last scaler.step() and before that step's end, leaves its
    copy of step 4 with rank 0, and both resume there from memory, its RNG and values
    exact."""
    result = early["SKIP_LOST"][1]
    got = [torch.load(result / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for r in range(2):
        assert got[r]["step"] == 4, got[r]["record"]
        assert got[r]["record"]["source"] == "peer", got[r]["record"]
        assert got[r]["values"] == {"seen": 4 * (r + 1)}
        assert torch.equal(got[r]["draw"], got[r]["draw_life1"]), r
        assert got[r]["opt_steps"] == [] and got[r]["scale"] == float("inf"), got[r]
