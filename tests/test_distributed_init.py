"""init_distributed: parallel start in any order, clear errors naming who never came,
generations, barriers, the hang watchdog, and recovery from a restarted peer.

Multi-process cases run tests/init_workers/form.py as real processes on gloo over
127.0.0.1; the rendezvous protocol itself is also exercised in-process with threads.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from lives import Life, run_lives

from resilient_train.distributed import (
    DistributedConfigError,
    DistributedOptions,
    HangWatchdog,
    PeerRestartedError,
    PrimaryUnreachableError,
    RendezvousTimeoutError,
    is_peer_failure,
)
from resilient_train.distributed.rendezvous import Rendezvous, connect_retry_cap_s
from resilient_train.distributed.resolve import resolve
from resilient_train.launcher.ports import free_port

FORM = Path(__file__).parent / "init_workers" / "form.py"
HELD = Path(__file__).parent / "init_workers" / "held.py"


def run_ranks(world: int, delays: dict[int, float], *, extra: dict[str, str] | None = None,
              ranks: list[int] | None = None, master_addr: str = "localhost",
              timeout: float = 120.0, script: Path = FORM) -> dict[int, dict[str, Any]]:
    """Start each rank of ``ranks`` (default all) as its own process (forked together from
    a warm server that imported torch: tests/lives.py), each waiting its delay before it
    forms."""
    port = free_port()
    job_id = f"test-{port}-{time.monotonic_ns()}"  # another job's store on a reused port
    lives = []
    chosen = ranks if ranks is not None else list(range(world))
    for rank in chosen:
        # Unbuffered and one thread, as a launched worker here is: forked from the same
        # warm server as the launched workers (tests/preloads.py).
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR=master_addr,
                   MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1",
                   DELAY_S=str(delays.get(rank, 0.0)), CLOUD_ML_JOB_ID=job_id, **(extra or {}))
        for var in ("CLUSTER_SPEC", "TF_CONFIG", "TORCHELASTIC_USE_AGENT_STORE"):
            env.pop(var, None)
        lives.append(Life([str(script)], env))
    procs = run_lives(lives, together=True, timeout=timeout)
    results: dict[int, dict[str, Any]] = {}
    for rank, proc in zip(chosen, procs):
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if not lines and script is not FORM and proc.returncode == 9:
            continue  # the survivor scripts' dead rank dies on purpose (os._exit(9))
        assert lines, (f"rank {rank} printed no result (exit {proc.returncode}):\n"
                       f"{proc.stderr[-3000:]}")
        results[rank] = json.loads(lines[-1]) | {"exit": proc.returncode,
                                                 "stderr": proc.stderr}
    return results


# --- parallel start -------------------------------------------------------------------------

@pytest.mark.slow
def test_primary_twelve_seconds_late_still_forms() -> None:
    results = run_ranks(4, {0: 12.0, 1: 0.0, 2: 1.5, 3: 0.5})
    for r in results.values():
        assert r["exit"] == 0, r["stderr"][-2000:]
        assert r["sum"] == 10.0  # 1+2+3+4: every rank took part
        assert r["generation"] == 0
    # The workers that came early waited for the primary (and said so in their logs). Each
    # rank's clock starts after its own imports, which run side by side and take a second
    # or more under load: rank 1's wait is the primary's 12 s delay, give or take that.
    assert results[1]["formed_s"] > 10.0
    assert "waiting for the primary workerpool0-0" in results[1]["stderr"]
    # 12 s of refused connections, and no C++ stack trace per attempt buries that line.
    assert "frame #" not in results[1]["stderr"], results[1]["stderr"][-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [2])
def test_random_start_orders_and_delays_form(seed: int) -> None:
    rng = random.Random(seed)
    world = rng.choice([3, 4])
    delays = {r: rng.uniform(0.0, 4.0) for r in range(world)}
    delays[0] = max(delays.values()) + 1.0  # the primary last
    results = run_ranks(world, delays)
    assert {r["sum"] for r in results.values()} == {world * (world + 1) / 2}
    assert all(r["exit"] == 0 for r in results.values())


@pytest.mark.slow
def test_primary_that_never_comes_is_named_within_the_deadline() -> None:
    t0 = time.monotonic()
    results = run_ranks(3, {}, ranks=[1, 2], extra={"JOIN_TIMEOUT_S": "4"})
    assert time.monotonic() - t0 < 40
    for r in results.values():
        assert r["exit"] == 3
        assert r["error"] == "PrimaryUnreachableError"
        assert "workerpool0-0" in r["message"] and "did not accept connections" in r["message"]
        assert r["missing"] == [0]
        assert r["after_s"] < 15


@pytest.mark.slow
def test_worker_that_never_comes_is_named() -> None:
    # 8 s: the join timeout also bounds rank 1's wait for the primary's store, which a
    # loaded machine (the suite on 2 cores) took more than 4 s to start once.
    results = run_ranks(3, {}, ranks=[0, 1], extra={"JOIN_TIMEOUT_S": "8"})
    for r in results.values():
        assert r["exit"] == 3
        assert r["error"] == "RendezvousTimeoutError"
        assert r["missing"] == [2]
        assert "rank 2 (workerpool1-1)" in r["message"]
        assert "1 of 3 ranks never arrived" in r["message"]


def test_the_wait_between_attempts_to_reach_the_store_grows_with_the_job() -> None:
    """A small job retries within 50 ms of the primary's store coming back; a larger one
    waits longer, so that up to 500 ranks the primary sees at most about 2000 attempts a
    second (full jitter: the mean wait is half the cap); beyond, 0.5 s as for every size
    before."""
    assert connect_retry_cap_s(1) == connect_retry_cap_s(3) == connect_retry_cap_s(50) == 0.05
    assert connect_retry_cap_s(200) == pytest.approx(0.2)
    assert connect_retry_cap_s(500) == connect_retry_cap_s(100_000) == 0.5
    for world in (2, 10, 60, 120, 499, 500):
        assert world * 2 / connect_retry_cap_s(world) <= 2000


@pytest.mark.slow
def test_unresolvable_primary_is_a_name_error_not_a_socket_timeout() -> None:
    results = run_ranks(2, {}, ranks=[1], master_addr="no-such-host.invalid",
                        extra={"JOIN_TIMEOUT_S": "3"})
    r = results[1]
    assert r["error"] == "PrimaryUnreachableError"
    assert "'no-such-host.invalid' did not resolve" in r["message"]


@pytest.mark.slow
def test_barrier_timeout_names_the_missing_rank_and_shutdown_is_clean() -> None:
    results = run_ranks(3, {}, extra={"SKIP_BARRIER_RANK": "2", "SKIP_SLEEP_S": "6",
                                      "BARRIER_TIMEOUT_S": "3"})
    for rank in (0, 1):
        r = results[rank]
        assert r["error"] == "BarrierTimeoutError", r
        assert r["missing"] == [2]
        assert "barrier 'after-allreduce.0' timed out" in r["message"]
        assert "rank 2 (workerpool1-1)" in r["message"]
    assert results[2]["exit"] == 0
    for r in results.values():
        if "threads_after_shutdown" in r:
            assert r["threads_after_shutdown"] == ["MainThread"]
            assert r["initialized_after_shutdown"] is False
        assert "was not destroyed" not in r["stderr"]


@pytest.mark.slow
def test_a_barrier_whose_primary_timed_out_first_still_names_the_missing_rank() -> None:
    # The ranks' clocks are never quite together: the primary (3 s) times out first and
    # takes the store with it while rank 1 (3.5 s) still asks it; rank 1 must report the
    # same timeout and missing rank, not a lost connection.
    results = run_ranks(3, {}, extra={"SKIP_BARRIER_RANK": "2", "SKIP_SLEEP_S": "7",
                                      "BARRIER_TIMEOUT_S": "3", "BARRIER_TIMEOUT_S_1": "3.5"})
    for rank in (0, 1):
        assert results[rank]["error"] == "BarrierTimeoutError", results[rank]
        assert results[rank]["missing"] == [2]
        assert "rank 2 (workerpool1-1)" in results[rank]["message"]


@pytest.mark.slow
def test_forms_from_the_platforms_cluster_spec_alone() -> None:
    # On the platform there is no RANK / MASTER_ADDR: only CLUSTER_SPEC
    # (docs/platform.md, "What a replica sees").
    from resilient_train.cluster import cluster_spec_json

    port = free_port()
    cluster = {"workerpool0": [f"localhost:{port}"],
               "workerpool1": [f"localhost:{port + 1}", f"localhost:{port + 2}"]}
    procs = []
    for pool, index in (("workerpool1", 1), ("workerpool0", 0), ("workerpool1", 0)):
        env = {k: v for k, v in os.environ.items() if k not in (
            "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG", "LOCAL_RANK",
            "TORCHELASTIC_USE_AGENT_STORE")}
        env.update(CLUSTER_SPEC=cluster_spec_json(cluster, pool, index,
                                                  job={"job_id": f"spec-{port}"}),
                   CLOUD_ML_JOB_ID=f"spec-{port}", GLOO_SOCKET_IFNAME="lo")
        procs.append(subprocess.Popen([sys.executable, str(FORM)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL))
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        results.append(json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1]))
    assert sorted(r["rank"] for r in results) == [0, 1, 2]
    assert {r["sum"] for r in results} == {6.0}


@pytest.mark.slow
def test_forms_under_torchrun_with_its_agent_store(tmp_path: Path) -> None:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    for var in ("CLUSTER_SPEC", "TF_CONFIG", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(FORM)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
        check=False)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(r["rank"] for r in results) == [0, 1], proc.stdout + proc.stderr[-3000:]
    assert {r["sum"] for r in results} == {3.0}


@pytest.mark.slow
def test_every_survivor_is_released_at_once_when_the_primary_dies() -> None:
    # A survivor that waits on another survivor (not on the dead primary) is released only
    # when that one closes its old group's sockets; else it waits the 60 s timeout.
    results = run_ranks(3, {}, script=Path(__file__).parent / "init_workers" / "survivor.py")
    for rank in (1, 2):
        r = results[rank]
        assert "unexpected" not in r, r
        assert r["recoveries"] == 1
        assert r["failed_after_s"] < 15, r


def test_a_survivor_says_once_that_the_primary_and_its_store_are_gone() -> None:
    """The survivors are between collectives when the primary dies: their watchers, which
    lose the store it hosted, notice first. Each says so in one line, the re-forming's,
    in words and without torch's advice (it said it three times: the watcher's line, the
    re-forming's, and that the store was gone)."""
    results = run_ranks(3, {}, extra={"BETWEEN_STEPS": "1"},
                        script=Path(__file__).parent / "init_workers" / "survivor.py")
    for rank, name in ((1, "workerpool1-0"), (2, "workerpool1-1")):
        r = results[rank]
        assert "unexpected" not in r and r["recoveries"] == 1, r
        said = [line for line in r["stderr"].splitlines() if "stopped or restarted" in line]
        assert len(said) == 1 and re.fullmatch(
            rf"{name}: generation 0 ended \(lost the rendezvous store at localhost:\d+: the "
            r"primary workerpool0-0 stopped or restarted \(DistNetworkError: Failed to recv, "
            r"got 0 bytes\)\); re-forming the process group", said[0]), r["stderr"][-3000:]


# --- the rendezvous protocol, in-process -------------------------------------------------

def _rdzv(port: int, rank: int, world: int, **kw: Any) -> Rendezvous:
    return Rendezvous(host=kw.pop("host", "127.0.0.1"), port=port, rank=rank, world_size=world,
                      hosts_store=rank == 0, namespace="t",
                      name_of=lambda r: f"replica{r}", join_timeout_s=kw.pop("timeout", 30.0),
                      **kw)


def _join_all(members: list[Rendezvous], at_least: int = 0) -> list[int]:
    out: list[int] = [-1] * len(members)
    errors: list[BaseException] = []

    def go(i: int, r: Rendezvous) -> None:
        try:
            if r.store is None:
                r.connect(time.monotonic() + 30)
            out[i] = r.join(at_least, time.monotonic() + 30)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(i, r)) for i, r in enumerate(members)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return out


def test_a_restarted_rank_starts_a_new_generation_and_survivors_follow() -> None:
    port = free_port()
    first = [_rdzv(port, r, 3) for r in range(3)]
    assert _join_all(first) == [0, 0, 0]
    # Rank 2 restarts: a new process, a new incarnation, the same rank.
    reborn = _rdzv(port, 2, 3)
    reborn.connect(time.monotonic() + 10)
    gens: list[int] = []
    t = threading.Thread(target=lambda: gens.append(reborn.join(0, time.monotonic() + 30)))
    t.start()
    deadline = time.monotonic() + 10
    while first[0].generation() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    # It never re-joins generation 0 (its old self was a member): generation 1 began.
    assert first[0].generation() == 1
    assert "replica2 (rank 2) restarted" in first[0].cause(1)
    assert _join_all(first[:2], at_least=1) == [1, 1]
    t.join(30)
    assert gens == [1]


def test_concurrent_survivors_agree_on_one_next_generation() -> None:
    port = free_port()
    members = [_rdzv(port, r, 3) for r in range(3)]
    assert _join_all(members) == [0, 0, 0]
    # Every survivor saw the failure and moves on at once: they still meet in generation 1.
    assert _join_all(members, at_least=1) == [1, 1, 1]
    assert _join_all(members, at_least=2) == [2, 2, 2]


def test_resolution_that_fails_for_a_while_then_succeeds() -> None:
    calls = []

    def flaky(host: str, port: int, **kw: Any) -> Any:
        calls.append(time.monotonic())
        if len(calls) < 4:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]

    port = free_port()
    host = _rdzv(port, 0, 2)
    client = _rdzv(port, 1, 2, host="primary-not-yet.example", resolver=flaky)
    assert _join_all([host, client]) == [0, 0]
    assert len(calls) >= 4


def test_resolution_that_never_succeeds_names_the_host() -> None:
    def never(host: str, port: int, **kw: Any) -> Any:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    t0 = time.monotonic()
    with pytest.raises(PrimaryUnreachableError, match="'workerpool0-0' did not resolve within 1 s"):
        resolve("workerpool0-0", 2222, deadline_s=1.0, resolver=never)
    assert time.monotonic() - t0 < 10


def test_barrier_in_process_names_missing_and_sees_a_new_generation() -> None:
    port = free_port()
    members = [_rdzv(port, r, 2) for r in range(2)]
    assert _join_all(members) == [0, 0]
    with pytest.raises(RendezvousTimeoutError, match=r"rank 1 \(replica1\)") as info:
        members[0].barrier(0, "solo", timeout_s=0.3)
    assert info.value.missing == (1,)
    # A newer generation ends any barrier of the old one.
    members[1].store.compare_set("t/gen", "0", "1")
    with pytest.raises(PeerRestartedError, match="generation 0 ended during barrier"):
        members[0].barrier(0, "stale", timeout_s=5)


# --- classification, options, watchdog -------------------------------------------------

@pytest.mark.parametrize("text", [
    "[pair.cc:553] Connection closed by peer [127.0.0.1]:30080",
    "Read error [127.0.0.1]:31116: Connection reset by peer",
    "NCCL communicator was aborted on rank 1",
])
def test_peer_failures_are_recognised(text: str) -> None:
    assert is_peer_failure(RuntimeError(text))
    try:
        try:
            raise RuntimeError(text)
        except RuntimeError as inner:
            raise ValueError("a background checkpoint save failed") from inner
    except ValueError as outer:
        assert is_peer_failure(outer)  # found through the cause chain


def test_ordinary_bugs_are_not_peer_failures() -> None:
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_peer_failure(KeyError("weight"))
    assert not is_peer_failure(RendezvousTimeoutError("connection refused for 900 s"))
    assert is_peer_failure(PeerRestartedError("generation 2 began", 1))


def test_options_validate_and_read_the_environment() -> None:
    with pytest.raises(DistributedConfigError, match="on_peer_restart"):
        DistributedOptions(on_peer_restart="ignore")  # type: ignore[arg-type]
    with pytest.raises(DistributedConfigError, match="backend"):
        DistributedOptions(backend="mpi")
    with pytest.raises(DistributedConfigError, match="join_timeout_s must be > 0"):
        DistributedOptions(join_timeout_s=0)
    opts = DistributedOptions.from_env(env={"RESILIENT_TRAIN_JOIN_TIMEOUT_S": "30",
                                            "RESILIENT_TRAIN_HANG_TIMEOUT_S": "120",
                                            "RESILIENT_TRAIN_ON_PEER_RESTART": "exit"})
    assert (opts.join_timeout_s, opts.hang_timeout_s, opts.on_peer_restart) == (30, 120, "exit")
    with pytest.raises(DistributedConfigError, match="RESILIENT_TRAIN_JOIN_TIMEOUT_S"):
        DistributedOptions.from_env(env={"RESILIENT_TRAIN_JOIN_TIMEOUT_S": "soon"})


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_hang_watchdog_fires_only_when_armed_and_idle() -> None:
    clock = FakeClock()
    fired: list[str] = []
    event = threading.Event()

    def on_hang(msg: str) -> None:
        fired.append(msg)
        event.set()

    dog = HangWatchdog(0.5, on_hang=on_hang, clock=clock)
    try:
        clock.now = 100.0  # a long start-up before the first step: not a hang
        assert not event.wait(0.3)
        dog.arm()
        dog.beat(1)          # the first step after arming starts the count
        clock.now = 100.4
        dog.beat(2)
        assert not event.wait(0.3)
        clock.now = 101.0    # 0.6 s without a step
        assert event.wait(10)
        assert "no training step finished for 1 s" in fired[0]
        assert "the last one was step 2" in fired[0]
    finally:
        dog.close()


def test_hang_watchdog_counts_steps_not_a_long_save() -> None:
    # A blocking save (or one waiting for the previous upload) between two steps can last
    # longer than the hang timeout: only time in the "step" phase counts.
    clock = FakeClock()
    fired: list[str] = []
    event = threading.Event()

    def on_hang(msg: str) -> None:
        fired.append(msg)
        event.set()

    dog = HangWatchdog(0.5, on_hang=on_hang, clock=clock)
    try:
        dog.arm()
        dog.beat(1)
        dog.phase("save")
        clock.now = 100.0    # a 100 s save
        assert not event.wait(0.3)
        dog.phase("step")    # the count starts afresh
        clock.now = 100.4
        assert not event.wait(0.3)
        clock.now = 101.0
        assert event.wait(10)
        assert "no training step finished for 1 s" in fired[0]
    finally:
        dog.close()


def test_hang_watchdog_disarmed_never_fires() -> None:
    clock = FakeClock()
    event = threading.Event()
    dog = HangWatchdog(0.2, on_hang=lambda m: event.set(), clock=clock)
    try:
        dog.arm()
        dog.beat(1)
        dog.disarm()  # e.g. while the group re-forms after a peer restart
        clock.now = 50.0
        assert not event.wait(0.5)
    finally:
        dog.close()


def test_a_teardown_stuck_in_torch_exits_instead_of_hanging(monkeypatch: pytest.MonkeyPatch) -> None:
    # A gloo group whose peer died mid-collective can block its own teardown; recovery then
    # must not wait (deaf to SIGTERM) for the job's timeout: past the bound it exits 134.
    from resilient_train.distributed.group import DistributedGroup

    group = DistributedGroup.__new__(DistributedGroup)
    group.options = DistributedOptions(form_timeout_s=0.3)
    group.generation = 4
    group._watcher = None
    group._watch_stop = threading.Event()
    release = threading.Event()
    exits: list[str] = []
    monkeypatch.setattr(group, "_destroy_pg", lambda: release.wait(10))
    monkeypatch.setattr(group, "_sever", lambda: None)
    group._on_stuck = lambda message: (exits.append(message), release.set())
    t0 = time.monotonic()
    group._teardown("workerpool0-0")
    assert time.monotonic() - t0 < 5
    assert exits == ["workerpool0-0: tearing down generation 4 did not finish in 0.3 s "
                     "(stuck inside torch.distributed); exiting so that the worker is restarted"]


def test_sigterm_ends_a_wait_for_peers_that_are_being_stopped_too() -> None:
    # A process told to stop (SIGTERM: a preemption, a job retry) that waits for a peer
    # that will never come sat out the grace period until the SIGKILL.
    from resilient_train import sigterm
    from resilient_train.distributed import StopRequestedError

    port = free_port()
    primary = _rdzv(port, 0, 2)
    primary.connect(time.monotonic() + 30)
    timer = threading.Timer(0.5, sigterm.note)
    timer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(StopRequestedError, match="SIGTERM while waiting for 1 of 2 ranks"):
            primary.join(0, time.monotonic() + 60)
        assert time.monotonic() - t0 < 10     # not the 60 s join deadline
        with pytest.raises(StopRequestedError, match="barrier 'eval'"):
            primary.barrier(0, "eval", timeout_s=60)
    finally:
        timer.cancel()
        sigterm.forget()          # process-wide: the other tests run after this one
        primary.store = None


def test_a_training_thread_held_inside_torch_is_told_from_one_that_is_not() -> None:
    # What a rank checks after a lost peer's connections were cut (group._leave_if_stuck):
    # whether its training thread (this test's, the main thread) stays at one call inside
    # torch. Here: a torch Future that only the watching thread completes.
    from resilient_train.sigterm import main_stuck_in_torch

    held = torch.futures.Future()
    seen: dict[str, bool] = {}

    def watch(key: str, watching: Callable[[], bool]) -> None:
        seen[key] = main_stuck_in_torch(0.3, watching)
        if not held.done():
            held.set_result(None)

    watcher = threading.Thread(target=watch, args=("held", lambda: True))
    watcher.start()
    held.wait()
    watcher.join()
    assert seen["held"] is True
    # Outside torch (a sleep here) it is never stuck, and the watch ends when told to.
    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=("free", lambda: not stop.is_set()))
    watcher.start()
    time.sleep(1.0)
    stop.set()
    watcher.join()
    assert seen["free"] is False


def test_a_training_thread_held_on_the_peer_ring_counts_as_held_too() -> None:
    # A rank waits for its previous rank's state before its optimizer step (tiers/peers.py) on a
    # plain socket, outside torch. With that rank frozen, a SIGTERM's handler runs inside
    # the read and the read goes on: the stall guard must see the thread held there, and
    # the severing that ends collectives ends the read too.
    import socket

    from resilient_train.checkpoint.transport.ringlink import PeerRingError, RingLink
    from resilient_train.sigterm import main_stuck_in_torch

    frozen, inc = socket.socketpair()
    out, sink = socket.socketpair()
    listener = socket.create_server(("127.0.0.1", 0))
    link = RingLink(listener, out, inc, prev=1, nxt=1, timeout_s=30)
    seen: dict[str, bool] = {}

    def watch() -> None:
        deadline = time.monotonic() + 10
        seen["held"] = main_stuck_in_torch(0.3, lambda: time.monotonic() < deadline)
        inc.shutdown(socket.SHUT_RDWR)   # what sever_gloo does to the ring's connections

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with pytest.raises(PeerRingError, match="connection closed by peer"):
            link.receive(1)
        watcher.join()
        assert seen["held"] is True
    finally:
        link.close()
        for s in (frozen, sink):
            s.close()


@pytest.mark.slow
def test_a_rank_held_inside_torch_after_its_peer_left_exits_transient(tmp_path: Path) -> None:
    stall_s = 3.0
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
                   READY=str(tmp_path / "ready"), STALL_S=str(stall_s))
        for var in ("CLUSTER_SPEC", "TF_CONFIG", "TORCHELASTIC_USE_AGENT_STORE"):
            env.pop(var, None)
        procs.append(subprocess.Popen([sys.executable, str(HELD)], env=env, text=True,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    try:
        _, err = procs[1].communicate(timeout=stall_s + 90)
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
    assert procs[1].returncode == 134, err[-3000:]
    assert (f"its training thread stayed at one call inside torch for "
            f"{stall_s:g} s") in err, err[-3000:]
    assert "torch/futures/__init__.py" in err   # the stacks of all threads, in the log


FROZEN_PEER = Path(__file__).parent / "init_workers" / "frozen_peer.py"


def _ranks(mode: str, hang_s: float, frozen: int = 1, world: int = 2, **bounds: float
           ) -> list[subprocess.Popen[str]]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
                   MODE=mode, HANG_S=str(hang_s), FROZEN=str(frozen),
                   **{k: str(v) for k, v in bounds.items()})
        for var in ("CLUSTER_SPEC", "TF_CONFIG", "TORCHELASTIC_USE_AGENT_STORE"):
            env.pop(var, None)
        procs.append(subprocess.Popen([sys.executable, str(FROZEN_PEER)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return procs


def _outcome(procs: list[subprocess.Popen[str]], rank: int, timeout_s: float
             ) -> tuple[str, str]:
    """Rank ``rank``'s output once it ended; then every process of the job is killed (a
    stopped one too)."""
    try:
        return procs[rank].communicate(timeout=timeout_s)
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("frozen", [1, 0])
def test_a_rank_waiting_in_a_save_on_a_frozen_peer_exits_transient_naming_it(
        frozen: int) -> None:
    # Before the peers' heartbeats, the watchdog counted only time in a step: a rank that
    # waited in a save's collective on a stopped machine sat there until the collective
    # timeout (10 minutes), or the job's; and on a stopped primary for good, since torch's
    # store client then never times out (its watcher thread waits with it).
    hang_s = 3.0
    procs = _ranks("frozen", hang_s, frozen)
    waiter = 1 - frozen
    out, err = _outcome(procs, waiter, hang_s + 90)
    silent = ("workerpool1-0 (rank 1) sent no heartbeat for" if frozen else
              "the rendezvous store at 127.0.0.1:")
    assert procs[waiter].returncode == 134, err[-3000:]
    assert "done" not in out
    assert f"hang: {silent}" in err, err[-3000:]
    assert "while this rank waited in its save (stopped, frozen or cut off" in err
    if not frozen:
        assert ", on workerpool0-0, did not answer for" in err


@pytest.mark.slow
def test_a_peer_in_a_long_save_or_shut_down_is_waited_for_not_taken_for_a_hang() -> None:
    hang_s = 3.0   # the beats come every 0.5 s: a loaded machine's delays are no silence
    procs = _ranks("slow", hang_s)
    try:
        results = [p.communicate(timeout=4 * hang_s + 90) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
    for rank, (out, err) in enumerate(results):
        assert procs[rank].returncode == 0, (rank, err[-3000:])
        assert f"rank {rank}: done" in out
        assert "hang:" not in err


@pytest.mark.slow
def test_a_rank_re_forming_on_a_stopped_primarys_store_exits_transient() -> None:
    # Re-forming waits for peers as long as the join timeout allows, which is no hang;
    # but torch's store client waits for good on a store whose host stopped: before, the
    # survivor sat past the join timeout (20 s), still there at 60 s.
    hang_s = 3.0
    procs = _ranks("reform", hang_s, world=3)
    out, err = _outcome(procs, 1, hang_s + 90)
    assert procs[1].returncode == 134, err[-3000:]
    assert "re-formed without its primary" not in out + err
    assert "generation 0 ended" in err, err[-3000:]
    assert re.search(r"hang: the rendezvous store at 127\.0\.0\.1:\d+, on workerpool0-0, did "
                     r"not answer for \d+ s while this rank waited in its rendezvous", err), \
        err[-3000:]


@pytest.mark.slow
def test_a_rank_forming_on_a_stopped_primarys_store_exits_transient() -> None:
    # The first formation was not watched: a primary stopped once the other rank had
    # joined left it in gloo's connect, a store call that torch's client never gives up.
    hang_s = 3.0
    procs = _ranks("forming", hang_s)
    out, err = _outcome(procs, 1, hang_s + 90)
    assert procs[1].returncode == 134, err[-3000:]
    assert "done" not in out
    assert re.search(r"hang: the rendezvous store at 127\.0\.0\.1:\d+, on workerpool0-0, did "
                     r"not answer for \d+ s while this rank waited in its rendezvous", err), \
        err[-3000:]


@pytest.mark.slow
def test_without_a_hang_timeout_forming_on_a_stopped_store_leaves_saying_why(
        ) -> None:
    # The same stop without the watchdog: a store call that does not return has its
    # connections cut after STORE_SILENT_S (or the call fails by itself), and connecting
    # again meets a port that accepts and never answers, whose silence counts on from the
    # store's last answer: the rank leaves, saying why (before: still waiting at the test's
    # bound, 45 s; the join timeout is 60 s).
    procs = _ranks("forming", 0, STORE_SILENT_S=2, JOIN_S=60, HANDSHAKE_TIMEOUT_S=1.5)
    out, err = _outcome(procs, 1, 90)
    assert procs[1].returncode not in (0, 134) and "done" not in out, err[-3000:]
    assert re.search(r"PrimaryUnreachableError: the primary workerpool0-0 at 127\.0\.0\.1:\d+ "
                     r"has not answered for \d+ s and its port still accepts connections", err), \
        err[-3000:]
    assert "hang:" not in err


def _rank_1_facing_a_silent_port(hang_s: float, **bounds: float
                                 ) -> tuple[int, str, float]:
    """Rank 1 alone, its primary's port held by a socket that the kernel accepts
    connections on and nobody answers (a stopped process's, as SIGSTOP leaves it):
    (exit status, stderr, seconds)."""
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(128)
        env = dict(os.environ, RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(lst.getsockname()[1]), GLOO_SOCKET_IFNAME="lo",
                   OMP_NUM_THREADS="1", MODE="frozen", HANG_S=str(hang_s), JOIN_S="60",
                   **{k: str(v) for k, v in bounds.items()})
        for var in ("CLUSTER_SPEC", "TF_CONFIG", "TORCHELASTIC_USE_AGENT_STORE"):
            env.pop(var, None)
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, str(FROZEN_PEER)], env=env, text=True,
                              capture_output=True, timeout=120)
        return done.returncode, done.stderr, time.monotonic() - t0


@pytest.mark.slow
def test_a_primary_whose_port_accepts_but_never_answers_is_a_hang_not_a_late_start(
        ) -> None:
    # A connect attempt that reached the port and got no greeting ticked the rendezvous
    # like a refused one (a primary not up yet): the rank waited out the join timeout
    # (60 s here), the hang watchdog none the wiser (measured: exit 1 at 42 s of a 40 s
    # join timeout, with an 8 s hang timeout).
    code, err, took = _rank_1_facing_a_silent_port(3.0, HANDSHAKE_TIMEOUT_S=1.5)
    assert code == 134, err[-3000:]
    assert re.search(r"the primary workerpool0-0 at 127\.0\.0\.1:\d+ accepts connections but "
                     r"its store does not answer \(.* sent no greeting within 1.5 s\): stopped "
                     r"or frozen\?", err), err[-3000:]
    assert re.search(r"hang: the rendezvous store at 127\.0\.0\.1:\d+, on workerpool0-0, did "
                     r"not answer for \d+ s while this rank waited in its rendezvous", err)
    assert took < 45, took


@pytest.mark.slow
def test_without_a_hang_timeout_a_port_that_never_answers_is_left_before_the_join_timeout(
        ) -> None:
    code, err, took = _rank_1_facing_a_silent_port(0, STORE_SILENT_S=2,
                                                   HANDSHAKE_TIMEOUT_S=1.5)
    assert code not in (0, 134), err[-3000:]   # a bare script: the error's own exit
    assert re.search(r"PrimaryUnreachableError: the primary workerpool0-0 at 127\.0\.0\.1:\d+ "
                     r"has not answered for \d+ s and its port still accepts connections: its "
                     r"process is stopped or frozen, or another program holds the port", err), \
        err[-3000:]
    assert took < 45, took   # the join timeout is 60 s
    assert "hang:" not in err


@pytest.mark.slow
def test_without_a_hang_timeout_a_stopped_primarys_store_is_cut_and_the_rank_leaves() -> None:
    # torch's store client waits for good on a store whose host stopped: without the hang
    # watchdog the rank waited with it until the job's timeout. Now, past STORE_SILENT_S
    # without an answer to its watcher, its connections to the store are cut, the loss is
    # the primary's, and the rank's collective fails (or, held in it, the rank leaves
    # after LOST_PEER_STALL_S); under group.run it would re-form, within the join timeout.
    procs = _ranks("frozen", 0, frozen=0, STORE_SILENT_S=2, LOST_PEER_STALL_S=3)
    out, err = _outcome(procs, 1, 90)
    assert procs[1].returncode != 0 and "done" not in out, err[-3000:]
    assert re.search(r"workerpool1-0: the rendezvous store at 127\.0\.0\.1:\d+ \(on "
                     r"workerpool0-0\) has not answered for \d+ s: its host stopped, froze or "
                     r"is cut off; closing this process's connections to it", err), err[-3000:]
    # The loss is the primary's: what the training thread waited in failed (the barrier's
    # store call, or the collective, as on a peer's loss), or, held in it, the rank left
    # (exit 134) naming the store.
    assert ("Connection closed by peer" in err or "DistNetworkError" in err or (
        procs[1].returncode == 134 and "lost the rendezvous store at 127.0.0.1:" in err
        and "stayed at one call inside torch for 3 s" in err)), err[-3000:]
    assert "hang:" not in err
