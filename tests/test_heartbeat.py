"""Peers' heartbeats (distributed/heartbeat.py) and the hang watchdog's use of them
outside a step, on a real torch store (HashStore) and a clock the test moves."""

from __future__ import annotations

import threading

import torch.distributed as dist

from resilient_train.distributed.hang import HangWatchdog
from resilient_train.distributed.heartbeat import PeerBeats


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def beats(clock: Clock, rank: int, world: int = 3) -> PeerBeats:
    return PeerBeats(lambda r: f"g/0/beat/{r}", rank, world, period_s=1.0, clock=clock)


def test_a_peer_that_stops_beating_is_the_silent_one_since_its_last_beat() -> None:
    store, clock, heard = dist.HashStore(), Clock(), 0.0   # heard: the store's last answer
    me, live, frozen = (beats(clock, r) for r in range(3))
    for t in range(4):
        clock.now = float(t)
        heard = clock.now
        for b in (me, live) if t >= 2 else (me, live, frozen):   # rank 2 stops after t=1
            b.beat(store)
        me.observe(store)
    assert me.quietest(heard) == (2, 1.0)   # its counter last moved when seen at t=1
    clock.now = 10.0
    live.beat(store)
    heard = clock.now
    me.observe(store)
    assert me.quietest(heard) == (2, 1.0)


def test_a_peer_frozen_before_its_first_beat_does_not_block_the_reader() -> None:
    # multi_get waits for a key that does not exist: the reader creates it first.
    store, clock, heard = dist.HashStore(), Clock(), 0.0   # heard: the store's last answer
    me = beats(clock, 0, world=2)
    me.observe(store)
    assert me.quietest(heard) == (1, 0.0)
    assert int(store.get("g/0/beat/1")) == 0


def test_a_peer_that_left_is_never_silent() -> None:
    store, clock, heard = dist.HashStore(), Clock(), 0.0   # heard: the store's last answer
    me, gone = beats(clock, 0, world=2), beats(clock, 1, world=2)
    gone.beat(store)
    gone.leave(store)
    for t in range(0, 30, 2):
        clock.now = float(t)
        heard = clock.now
        me.observe(store)
    assert me.quietest(heard) == (1, 28.0)   # seen again at every look: silent for 0 s


def test_reads_and_beats_at_most_once_a_period() -> None:
    store, clock, heard = dist.HashStore(), Clock(), 0.0   # heard: the store's last answer
    me, peer = beats(clock, 0, world=2), beats(clock, 1, world=2)
    for t in (0.0, 0.3, 0.6, 0.9):
        clock.now = t
        peer.beat(store)
    assert int(store.get("g/0/beat/1")) == 1
    me.observe(store)                    # at 0.9: the next look at 1.9
    assert me.quietest(heard) == (1, 0.9)
    clock.now = 1.0
    peer.beat(store)
    assert int(store.get("g/0/beat/1")) == 2
    me.observe(store)                    # too soon: not read
    assert me.quietest(heard) == (1, 0.9)
    clock.now = 1.9
    heard = clock.now
    me.observe(store)
    assert me.quietest(heard) == (1, 1.9)


def test_watching_starts_afresh_when_the_rank_trains_again() -> None:
    store, clock, heard = dist.HashStore(), Clock(), 0.0   # heard: the store's last answer
    me = beats(clock, 0, world=2)
    me.observe(store)
    me.stop_observing()
    assert me.quietest(heard) is None
    clock.now = 50.0
    heard = clock.now
    me.observe(store)
    assert me.quietest(heard) == (1, 50.0)   # not silent since 0: this rank was not waiting


def test_a_store_that_stops_answering_the_watcher_is_the_silent_one() -> None:
    store, clock, heard = dist.HashStore(), Clock(), 0.0   # heard: the store's last answer
    me = beats(clock, 0, world=2)
    clock.now = 3.0
    heard = clock.now
    me.observe(store)
    clock.now = 5.0      # two periods without an answer: still the peer's view
    assert me.quietest(heard) == (1, 3.0)
    clock.now = 5.1
    assert me.quietest(heard) == (None, 3.0)


def watchdog(clock: Clock, silent: list[tuple[str, float] | None], **kwargs: Clock) -> tuple[
        HangWatchdog, list[str], threading.Event]:
    fired: list[str] = []
    event = threading.Event()

    def on_hang(msg: str) -> None:
        fired.append(msg)
        event.set()

    dog = HangWatchdog(2.0, on_hang=on_hang, clock=clock, **kwargs)
    dog.listen(lambda: silent[0])
    return dog, fired, event


def test_the_watchdog_fires_on_a_silent_peer_while_its_rank_waits_in_a_save() -> None:
    clock, silent = Clock(), [("workerpool1-0 (rank 1) sent no heartbeat", 10.0)]
    dog, fired, event = watchdog(clock, silent)
    try:
        dog.arm()            # formed; no step yet (a restore, say): a peer's silence counts
        dog.phase("save")
        assert dog.waiting
        clock.now = 11.9
        assert not event.wait(0.5)
        clock.now = 12.0
        assert event.wait(10)
        assert fired[0].startswith("hang: workerpool1-0 (rank 1) sent no heartbeat for 2 s "
                                   "while this rank waited in its save (stopped, frozen")
    finally:
        dog.close()


def test_the_watchdog_ignores_peers_in_a_step_and_before_the_group_formed() -> None:
    clock, silent = Clock(), [("workerpool1-0 (rank 1) sent no heartbeat", 0.0)]
    dog, fired, event = watchdog(clock, silent)
    try:
        dog.phase("restore")
        clock.now = 100.0
        assert not dog.waiting and not event.wait(0.5)   # not armed: between generations
        dog.arm()
        dog.phase("step")    # in a step only the step's own time counts (not begun yet)
        assert not dog.waiting and not event.wait(0.5)
        dog.phase("restore")
        assert event.wait(10)
        assert "while this rank waited in its restore" in fired[0]
    finally:
        dog.close()


def test_the_watchdog_does_not_blame_peers_for_its_own_process_stopping() -> None:
    # The launcher's hang stops a replica (SIGSTOP) and continues it for the SIGTERM of a
    # job retry: the peers' and the store's last answers are then as old as the stop.
    clock, silent = Clock(), [("the rendezvous store at 127.0.0.1:1, did not answer", 0.0)]
    dog, fired, event = watchdog(clock, silent, pace=clock)   # one jump for both clocks
    try:
        dog.arm()
        dog.phase("save")
        clock.now = 30.0              # 30 s between two of its polls: it did not run
        assert not event.wait(0.6)
        clock.now = 31.9
        assert not event.wait(0.5)
        clock.now = 32.1              # silent for 2 s since it runs again: that counts
        assert event.wait(10)
        assert "did not answer for 2 s" in fired[0]
    finally:
        dog.close()
