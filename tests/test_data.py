"""ResumableSampler / ResumableLoader: a run resumed from any step sees the batches of an
uninterrupted run; a fresh epoch is DistributedSampler's; the global RNG is left alone."""

from __future__ import annotations

import io
import itertools
import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from resilient_train.data import ResumableLoader, ResumableSampler

N = 37  # not a multiple of the batch size nor of 2, 3 or 4
BATCH = 4


class IndexDataset(Dataset[int]):
    """Returns its index, so that tests check exact sample indices."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class RandomDataset(IndexDataset):
    """Draws from the (worker's) global RNG in __getitem__."""

    def __getitem__(self, i: int) -> Any:
        return i, torch.rand(())


class AugmentedDataset(IndexDataset):
    """Augments as users write it: draws from torch's, random's and numpy's global RNGs."""

    def __getitem__(self, i: int) -> Any:
        return i, torch.rand(()) + random.random() + float(np.random.rand())


class BatchedAugmentedDataset(AugmentedDataset):
    """Reads a batch at once (``__getitems__``), drawing as it goes."""

    def __getitems__(self, indices: list[int]) -> list[Any]:
        return [("batched", *AugmentedDataset.__getitem__(self, i)) for i in indices]


def tensor_dataset() -> TensorDataset:
    return TensorDataset(torch.arange(N * 2, dtype=torch.float32).view(N, 2), torch.arange(N))


def weights_only_roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    out: dict[str, Any] = torch.load(buf, weights_only=True)
    return out


def take(it: Any, n: int) -> list[Any]:
    return list(itertools.islice(it, n))


def assert_same_batches(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        g = g if isinstance(g, (list, tuple)) else [g]
        w = w if isinstance(w, (list, tuple)) else [w]
        assert len(g) == len(w), f"batch {i}"
        for a, b in zip(g, w):
            assert torch.equal(a, b), f"batch {i} differs: {a} vs {b}"


def as_indices(batches: list[Any]) -> list[int]:
    return [int(i) for b in batches for i in b]


# -- a fresh epoch is DistributedSampler's --------------------------------------------------

@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_fresh_epoch_matches_distributed_sampler(shuffle: bool, drop_last: bool) -> None:
    for n, world, seed, epoch in itertools.product((1, 3, 10, 13), range(1, 5), (0, 7),
                                                   (0, 1, 2)):
        for rank in range(world):
            ours = ResumableSampler(n, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                    num_replicas=world, rank=rank)
            ours.epoch = epoch
            ref = DistributedSampler(list(range(n)), num_replicas=world, rank=rank,
                                     shuffle=shuffle, seed=seed, drop_last=drop_last)
            ref.set_epoch(epoch)
            case = f"n={n} W={world} rank={rank} seed={seed} epoch={epoch}"
            assert list(ours) == list(ref), case
            assert len(ours) == len(ref), case


# -- resume from every step -----------------------------------------------------------------

@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world", [1, 2])
def test_resume_at_every_step_is_exact(world: int, drop_last: bool) -> None:
    ds = tensor_dataset()

    def make(rank: int) -> ResumableLoader:
        return ResumableLoader(ds, batch_size=BATCH, seed=3, drop_last=drop_last,
                               num_replicas=world, rank=rank)

    total = 3 * len(make(0)) + 2  # three epochs and into the fourth
    for rank in range(world):
        reference = take(make(rank).forever(), total)
        for k in range(total + 1):
            killed = make(rank)
            before = take(killed.forever(), k)
            state = weights_only_roundtrip(killed.state_dict())
            resumed = make(rank)
            resumed.load_state_dict(state)
            after = take(resumed.forever(), total - k)
            assert_same_batches(before + after, reference)


def test_state_is_the_same_on_every_rank() -> None:
    ds = tensor_dataset()
    loaders = [ResumableLoader(ds, batch_size=BATCH, num_replicas=3, rank=r) for r in range(3)]
    streams = [ld.forever() for ld in loaders]
    for _ in range(2 * len(loaders[0]) + 1):
        for s in streams:
            next(s)
        states = [ld.state_dict() for ld in loaders]
        assert states[0] == states[1] == states[2]


@pytest.mark.parametrize(("persistent", "cut"), [(False, 3), (True, 8)])
def test_resume_with_worker_processes_is_exact(persistent: bool, cut: int) -> None:
    ds = IndexDataset()

    def make(rank: int, workers: int) -> ResumableLoader:
        return ResumableLoader(ds, batch_size=BATCH, seed=5, num_replicas=2, rank=rank,
                               num_workers=workers, persistent_workers=persistent and workers > 0)

    total = 2 * len(make(0, 0)) + 2
    for rank in range(2):
        reference = take(make(rank, 0).forever(), total)
        killed = make(rank, 2)
        before = take(killed.forever(), cut)
        state = weights_only_roundtrip(killed.state_dict())
        resumed = make(rank, 2)
        resumed.load_state_dict(state)
        after = take(resumed.forever(), total - cut)
        assert as_indices(before + after) == as_indices(reference)


# -- world size change ----------------------------------------------------------------------

@pytest.mark.parametrize("drop_last", [False, True])
def test_world_size_change_covers_the_rest_of_the_epoch(drop_last: bool) -> None:
    ds = IndexDataset()
    k = 2
    old = [ResumableLoader(ds, batch_size=BATCH, seed=1, drop_last=drop_last, num_replicas=2,
                           rank=r) for r in range(2)]
    consumed = {i for ld in old for i in as_indices(take(ld.forever(), k))}
    state = weights_only_roundtrip(old[0].state_dict())
    assert state == old[1].state_dict()

    new = [ResumableLoader(ds, batch_size=BATCH, seed=1, drop_last=drop_last, num_replicas=3,
                           rank=r) for r in range(3)]
    got = []
    for ld in new:
        ld.load_state_dict(state)
        got.append(as_indices(list(ld)))  # the rest of the epoch
        assert ld.epoch == 1

    # Same count on every rank: no rank waits in a collective for a batch the others lack.
    assert len({len(g) for g in got}) == 1
    remaining = Counter(i for i in range(N) if i not in consumed)
    taken = Counter(i for g in got for i in g)
    if drop_last:
        assert not taken - remaining                         # nothing consumed comes back
        assert sum((remaining - taken).values()) < 3 + 3 * BATCH  # only the dropped tail
    else:
        assert not remaining - taken                         # every remaining index
        assert sum((taken - remaining).values()) < 3         # plus padding only

    # The next epoch is DistributedSampler's at the new world size.
    for rank, ld in enumerate(new):
        ref = DistributedSampler(ds, num_replicas=3, rank=rank, seed=1, drop_last=drop_last)
        ref.set_epoch(1)
        want = list(ref)
        if drop_last:
            want = want[:len(want) - len(want) % BATCH]
        assert as_indices(list(ld)) == want


# -- end of epoch ---------------------------------------------------------------------------

@pytest.mark.parametrize(("world", "drop_last"), [(1, False), (2, False), (1, True)])
def test_cut_after_the_last_batch_resumes_in_the_next_epoch(world: int, drop_last: bool) -> None:
    ds = IndexDataset()

    def make() -> ResumableLoader:
        return ResumableLoader(ds, batch_size=BATCH, seed=2, drop_last=drop_last,
                               num_replicas=world, rank=0)

    per_epoch = len(make())
    reference = as_indices(take(make().forever(), 2 * per_epoch))
    killed = make()
    stream = killed.forever()
    before = as_indices(take(stream, per_epoch))  # the generator waits after the last batch
    assert killed.epoch == 0
    state = weights_only_roundtrip(killed.state_dict())

    resumed = make()
    resumed.load_state_dict(state)
    assert list(resumed) == []  # nothing left of epoch 0: it ends at once
    assert resumed.epoch == 1
    resumed.load_state_dict(state)
    after = as_indices(take(resumed.forever(), per_epoch))
    assert before + after == reference
    assert resumed.epoch == 1


def test_for_loop_advances_the_epoch() -> None:
    loader = ResumableLoader(IndexDataset(), batch_size=BATCH, seed=4)
    first = as_indices(list(loader))
    assert loader.epoch == 1 and loader.state_dict()["consumed"] == 0
    second = as_indices(list(loader))
    assert sorted(first) == sorted(second) == list(range(N))
    assert first != second  # a new permutation each epoch

    # Stopping early keeps the position: the next iter() continues the epoch.
    part = as_indices(take(iter(loader), 3))
    rest = as_indices(list(loader))
    assert loader.epoch == 3
    assert sorted(part + rest) == list(range(N))


# -- global RNG and worker seeds ------------------------------------------------------------

def test_a_plain_dataloader_draws_from_the_global_rng() -> None:
    # The reason for the loader's own generator (if torch changes this, the test says so).
    torch.manual_seed(0)
    before = torch.get_rng_state()
    next(iter(DataLoader(IndexDataset(), batch_size=BATCH)))
    assert not torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("workers", [0, 2])
def test_iterating_leaves_the_global_rng_alone(workers: int) -> None:
    torch.manual_seed(0)
    before = torch.get_rng_state()
    loader = ResumableLoader(IndexDataset(), batch_size=BATCH, seed=9, num_workers=workers)
    take(loader.forever(), len(loader) + 2)  # into the second epoch: two iter() calls
    assert torch.equal(torch.get_rng_state(), before)


def test_worker_seeds_follow_the_position_not_the_global_rng() -> None:
    values = []
    for global_seed in (0, 1):
        torch.manual_seed(global_seed)
        loader = ResumableLoader(RandomDataset(), batch_size=BATCH, seed=9, num_workers=2)
        values.append(torch.cat([b[1] for b in take(loader.forever(), 3)]))
    assert torch.equal(values[0], values[1])


@pytest.mark.parametrize(("dataset", "persistent", "cut"), [
    (AugmentedDataset(), False, 3), (AugmentedDataset(), True, 12),
    (BatchedAugmentedDataset(), False, 7)])
def test_a_resume_augments_every_sample_as_the_uninterrupted_run_did(
        dataset: IndexDataset, persistent: bool, cut: int) -> None:
    """In a worker process the global RNGs' state depends on which batches that worker
    loaded since its iterator started; a resumed run starts a new iterator mid-epoch."""
    def make() -> ResumableLoader:
        return ResumableLoader(dataset, batch_size=BATCH, seed=5, num_replicas=2, rank=1,
                               num_workers=2, persistent_workers=persistent)

    total = 2 * len(make()) + 3   # into the third epoch
    reference = take(make().forever(), total)
    killed = make()
    before = take(killed.forever(), cut)
    resumed = make()
    resumed.load_state_dict(weights_only_roundtrip(killed.state_dict()))
    after = take(resumed.forever(), total - cut)
    if isinstance(dataset, BatchedAugmentedDataset):
        assert all(list(b[0]) == ["batched"] * len(b[0]) for b in reference)  # its own read
        reference, before, after = ([b[1:] for b in part] for part in (reference, before, after))
    assert_same_batches(before + after, reference)


def test_a_samples_draws_do_not_depend_on_the_worker_that_loads_it() -> None:
    one, three = (take(ResumableLoader(AugmentedDataset(), batch_size=BATCH, seed=5,
                                       num_workers=workers).forever(), 12)
                  for workers in (1, 2))
    assert_same_batches(one, three)


def test_a_random_split_keeps_a_seed_per_sample() -> None:
    # torch's Subset has a __getitems__ that loops over the samples: not a batched read.
    subset = torch.utils.data.random_split(AugmentedDataset(), [30, 7],
                                           generator=torch.Generator().manual_seed(0))[0]
    one, two = (list(ResumableLoader(subset, batch_size=BATCH, seed=5, num_workers=1,
                                     num_replicas=world, rank=0))   # an epoch
                for world in (1, 2))   # other batches: a seed per batch would differ
    draws = {int(i): float(d) for b in one for i, d in zip(*b)}
    assert all(draws[int(i)] == float(d) for b in two for i, d in zip(*b))


def test_each_epoch_draws_anew_also_with_persistent_workers() -> None:
    loader = ResumableLoader(AugmentedDataset(), batch_size=BATCH, shuffle=False,
                             num_workers=2, persistent_workers=True)
    first, second = (torch.cat([b[1] for b in loader]) for _ in range(2))
    assert loader.epoch == 2
    assert not torch.isclose(first, second).any()


@pytest.mark.parametrize(("workers", "seed_per_sample"), [(0, True), (2, False)])
def test_the_dataloader_gets_the_dataset_itself_where_samples_are_not_seeded(
        workers: int, seed_per_sample: bool) -> None:
    # With no worker the samples draw from the main process's RNGs, which checkpoints save.
    ds = AugmentedDataset()
    loader = ResumableLoader(ds, batch_size=BATCH, num_workers=workers,
                             seed_per_sample=seed_per_sample)
    assert loader.loader.dataset is ds
    assert as_indices([b[0] for b in take(loader.forever(), 2)]) == \
        as_indices([b[0] for b in take(ResumableLoader(ds, batch_size=BATCH).forever(), 2)])


def test_a_users_generator_is_kept() -> None:
    g = torch.Generator().manual_seed(11)
    loader = ResumableLoader(IndexDataset(), batch_size=BATCH, generator=g)
    assert loader.loader.generator is g
    state = g.get_state()
    list(loader)
    assert not torch.equal(g.get_state(), state)  # DataLoader drew its base seed from it


# -- state and errors -----------------------------------------------------------------------

def test_state_dict_is_plain_and_weights_only_loadable() -> None:
    loader = ResumableLoader(tensor_dataset(), batch_size=BATCH, seed=6, num_replicas=2, rank=1)
    take(loader.forever(), 7)
    state = loader.state_dict()
    assert state == {"epoch": 1, "consumed": 16, "seed": 6, "shuffle": True,
                     "dataset_len": N, "drop_last": False}
    assert all(type(v) in (int, bool) for v in state.values())
    assert weights_only_roundtrip(state) == state


@pytest.mark.parametrize(("change", "named"), [
    ({"dataset_len": N + 1}, "dataset_len"),
    ({"seed": 1}, "seed"),
    ({"shuffle": False}, "shuffle"),
])
def test_load_rejects_a_different_dataset_or_order(change: dict[str, Any], named: str) -> None:
    state = ResumableSampler(N, seed=0).state_dict() | change
    with pytest.raises(ValueError, match=f"{named}.*not be reproduced"):
        ResumableSampler(N, seed=0).load_state_dict(state)


def test_load_rejects_a_foreign_state() -> None:
    with pytest.raises(ValueError, match="lacks consumed"):
        ResumableSampler(N).load_state_dict({"epoch": 0, "seed": 0, "shuffle": True,
                                             "dataset_len": N, "drop_last": False})
    bad = ResumableSampler(N).state_dict() | {"consumed": -1}
    with pytest.raises(ValueError, match="consumed"):
        ResumableSampler(N).load_state_dict(bad)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"num_replicas": 2, "rank": 2}, "rank 2 is out of range"),
    ({"num_replicas": 2, "rank": -1}, "rank -1 is out of range"),
    ({"num_replicas": 0, "rank": 0}, "num_replicas must be"),
    ({"num_replicas": 2}, "pass rank"),
])
def test_bad_world_is_rejected(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ResumableSampler(N, **kwargs)


def test_a_stream_is_refused_with_what_to_do_instead() -> None:
    class Stream(torch.utils.data.IterableDataset[int]):
        def __iter__(self) -> Any:
            return iter(range(10))

    with pytest.raises(TypeError, match=r"iterable-style dataset .* keep the stream's "
                                        r"position in ctx.values"):
        ResumableLoader(Stream(), batch_size=2)


def test_empty_dataset_is_rejected() -> None:
    with pytest.raises(ValueError, match="0 samples"):
        ResumableSampler([])


@pytest.mark.parametrize("kwarg", ["sampler", "batch_sampler"])
def test_owned_dataloader_kwargs_are_rejected(kwarg: str) -> None:
    with pytest.raises(TypeError, match=f"{kwarg}="):
        ResumableLoader(IndexDataset(), batch_size=BATCH, **{kwarg: None})
    # A DataLoader's batch_sampler comes without batch_size: the same message, not
    # Python's "missing 1 required keyword-only argument".
    with pytest.raises(TypeError, match=f"got {kwarg}=: it builds its own sampler"):
        ResumableLoader(IndexDataset(), **{kwarg: None})
    with pytest.raises(TypeError, match="needs batch_size=N"):
        ResumableLoader(IndexDataset())


def test_load_while_iterating_raises() -> None:
    loader = ResumableLoader(IndexDataset(), batch_size=BATCH)
    stream = loader.forever()
    next(stream)
    loader.load_state_dict(loader.state_dict())
    with pytest.raises(RuntimeError, match="while this iterator was live"):
        next(stream)
    take(loader.forever(), 1)  # a new iterator is fine


def test_len() -> None:
    assert len(ResumableLoader(IndexDataset(), batch_size=BATCH)) == 10
    assert len(ResumableLoader(IndexDataset(), batch_size=BATCH, drop_last=True)) == 9
    assert len(ResumableLoader(IndexDataset(), batch_size=BATCH, num_replicas=2, rank=1)) == 5
    tiny = ResumableLoader(IndexDataset(3), batch_size=BATCH, drop_last=True)
    with pytest.raises(ValueError, match="no batch"):
        next(tiny.forever())


def test_a_loader_worker_whose_fork_deadlocked_is_replaced_and_no_batch_changes() -> None:
    """CPython gh-112275: a forked DataLoader worker can deadlock before it runs a line, and
    the loader would wait for its batch forever. The worker that has not started within
    the bound is killed and the workers start again from the same position: the batches
    are exactly those of a loader whose workers all started."""
    script = Path(__file__).parent / "runtime_workers" / "fork_stall.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "START_S": "2"}, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    loader = ResumableLoader(torch.arange(40.0), batch_size=4, seed=3, num_replicas=1, rank=0)
    expected = [b.tolist() for b in itertools.islice(loader.forever(), 15)]
    assert got["batches"] == expected
    # 2 workers, the first stuck: killed, 2 forked again; then 2 for the second epoch.
    assert got["forks"] == 6, got
    assert proc.stderr.count("has not started 2 s after it was forked") == 1, proc.stderr
    assert "gh-112275" in proc.stderr


def test_asking_whether_a_loader_forks_leaves_the_start_method_unset() -> None:
    code = ("import multiprocessing as mp\n"
            "from resilient_train.forkwatch import forks\n"
            "assert forks(None) == (mp.get_all_start_methods()[0] == 'fork')\n"
            "assert mp.get_start_method(allow_none=True) is None\n"
            "assert not forks('spawn') and forks(mp.get_context('fork'))\n"
            "mp.set_start_method('spawn')\n"
            "assert not forks(None)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
