"""Data order that survives a restart: a run killed at any step and resumed from its
checkpoint sees exactly the batches an uninterrupted run would have seen.

A plain ``DataLoader`` restarts its epoch from the first batch, so a resumed run repeats
data it has trained on and skips the rest. Here the position (epoch, samples consumed) is
state that the checkpoint manager saves (``ctx.track(data=loader)``), and the epoch order
is a function of (seed, epoch), as in ``DistributedSampler``. Ranks take the remaining
order interleaved (rank r takes every W-th), so what has been consumed is always a prefix
of the epoch order: the state is the same on every rank and does not depend on the world
size, and a run resumed with a different number of workers still covers the rest of the
epoch with the same count on every rank.

Randomness in the dataset's ``__getitem__`` (a random crop, a flip, noise) is drawn, in a
loader worker process, from that worker's global RNGs, whose state depends on which
batches the worker has loaded since its iterator started: a resumed run would augment the
same samples differently. So each sample's loading is seeded from (seed, epoch, index)
alone, as Grain does per record: the same sample gets the same draws whichever worker
loads it, after any resume, with any number of workers.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import sys
from collections.abc import Iterator, Mapping, Sized
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, Subset

from . import forkwatch, lifecycle, sigterm
from .checkpoint.state.capture import FollowsSteps
from .lifecycle import say_once

__all__ = ["ResumableLoader", "ResumableSampler"]

log = logging.getLogger(__name__)

_STATE_KEYS = ("epoch", "consumed", "seed", "shuffle", "dataset_len", "drop_last")


def _world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """(num_replicas, rank), defaulting to the process group's, else 1 and 0."""
    initialized = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if initialized else 1
    if rank is None:
        if not initialized and num_replicas > 1:
            raise ValueError(
                f"num_replicas={num_replicas} but no rank, and torch.distributed is not "
                "initialized to provide one: pass rank= as well (0 .. num_replicas-1), or "
                "initialize the process group before building the sampler")
        rank = dist.get_rank() if initialized else 0
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an int >= 1 (the world size), got {num_replicas!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
        raise ValueError(
            f"rank {rank!r} is out of range for num_replicas={num_replicas}: it must be in "
            f"0 .. {num_replicas - 1}; pass this process's rank within the world size")
    return num_replicas, rank


class ResumableSampler(Sampler[int]):
    """``DistributedSampler``'s order with a position: yields this rank's rest of the epoch.

    A fresh epoch (``consumed == 0``) yields exactly what ``DistributedSampler`` yields for
    the same seed, epoch, rank, num_replicas and drop_last. ``consumed`` counts samples of
    the epoch order taken by all ranks together; the sampler never advances it itself (a
    DataLoader prefetches ahead of the training loop): ``ResumableLoader`` does, as batches
    are handed out.
    """

    def __init__(self, dataset_or_len: Sized | int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, num_replicas: int | None = None,
                 rank: int | None = None) -> None:
        n = dataset_or_len if isinstance(dataset_or_len, int) else len(dataset_or_len)
        if isinstance(n, bool) or n <= 0:
            raise ValueError(
                f"the dataset has {n} samples; a sampler needs at least one: check the "
                "dataset (or the length passed) before building the loader")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        self.num_replicas, self.rank = _world(num_replicas, rank)
        self.dataset_len = int(n)
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.consumed = 0

    def _order(self) -> list[int]:
        # The same permutation as DistributedSampler for (seed, epoch).
        n = self.dataset_len
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def _remaining_total(self) -> int:
        """Samples all ranks together still take this epoch (padding included)."""
        rest = max(0, self.dataset_len - self.consumed)
        w = self.num_replicas
        return rest - rest % w if self.drop_last else math.ceil(rest / w) * w

    def __iter__(self) -> Iterator[int]:
        # Computed now, not lazily: the position may move while the DataLoader consumes it.
        order = self._order()
        rest = order[self.consumed:]
        w = self.num_replicas
        if self.drop_last:
            rest = rest[:len(rest) - len(rest) % w]
        else:
            # Pad from the start of the epoch order, wrapping when pad > n, as
            # DistributedSampler does: with consumed a multiple of W the padding is the same
            # as in the uninterrupted epoch.
            pad = -len(rest) % w
            if pad and rest:
                rest += (order * math.ceil(pad / len(order)))[:pad]
        return iter(rest[self.rank::w])

    def __len__(self) -> int:
        return self._remaining_total() // self.num_replicas

    def state_dict(self) -> dict[str, Any]:
        # Plain ints and bools (torch.load(weights_only=True)); the world size is left out
        # on purpose: the position is a prefix of the epoch order whatever W is.
        return {"epoch": int(self.epoch), "consumed": int(self.consumed), "seed": int(self.seed),
                "shuffle": bool(self.shuffle), "dataset_len": int(self.dataset_len),
                "drop_last": bool(self.drop_last)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(
                f"data sampler state lacks {', '.join(missing)}: it was not written by "
                "ResumableSampler.state_dict(); restore from a checkpoint of this loader")
        diffs = [f"{key}: checkpoint {state[key]!r}, this run {getattr(self, key)!r}"
                 for key in ("dataset_len", "seed", "shuffle")
                 if state[key] != getattr(self, key)]
        if diffs:
            raise ValueError(
                "the checkpoint's data position does not match this sampler ("
                + "; ".join(diffs) + "), so the data order would not be reproduced: "
                "resume with the same dataset, seed and shuffle, or start a new checkpoint "
                "directory")
        epoch, consumed = state["epoch"], state["consumed"]
        for key, value in (("epoch", epoch), ("consumed", consumed)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"data sampler state has {key}={value!r}; expected an int >= 0")
        if bool(state["drop_last"]) != self.drop_last:
            # Only the end of the epoch differs (padding vs truncation); the position holds.
            log.warning("data sampler: checkpoint has drop_last=%s, this run drop_last=%s; "
                        "the end of each epoch changes accordingly",
                        state["drop_last"], self.drop_last)
        self.epoch, self.consumed = epoch, consumed
        if consumed % self.num_replicas and consumed < self.dataset_len:
            log.info("data position %d is not a multiple of the world size %d (the world "
                     "size changed?): the rest of epoch %d is split among %d ranks",
                     consumed, self.num_replicas, epoch, self.num_replicas)


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finalizer: neighbouring inputs give unrelated 64-bit outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The 64-bit seed of loading sample ``index`` in ``epoch`` of a loader seeded ``seed``."""
    return _mix64(_mix64(_mix64(seed & _MASK64) ^ epoch) ^ index)


def seed_global_rngs(seed: int) -> None:
    """Seed the global RNGs a dataset's ``__getitem__`` draws from: torch's CPU generator,
    ``random`` and, where it is loaded, numpy's legacy ``np.random`` (7 us here)."""
    torch.default_generator.manual_seed(seed)   # not torch.manual_seed: 80 us, CUDA's too
    random.seed(seed)
    np = sys.modules.get("numpy")   # never imported here for a dataset that does not use it
    if np is not None:
        np.random.seed(seed & 0xFFFFFFFF)


class _KeyedSampler(Sampler[tuple[int, int]]):
    """The sampler's indices, each with its epoch: what a worker needs to seed a sample."""

    def __init__(self, sampler: ResumableSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.sampler.epoch
        return ((i, epoch) for i in self.sampler)   # iter(sampler) runs now, at iter()

    def __len__(self) -> int:
        return len(self.sampler)


class _SeededSamples(Dataset[Any]):
    """The user's dataset, each sample loaded after seeding the worker's global RNGs from
    (seed, epoch, index). A dataset with ``__getitems__`` (a batched read) gets one seed per
    batch, its first sample's."""

    def __init__(self, dataset: Any, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        index, epoch = key
        seed_global_rngs(sample_seed(self.seed, epoch, index))
        return self.dataset[index]


class _SeededBatches(_SeededSamples):
    def __getitems__(self, keys: list[tuple[int, int]]) -> Any:
        if keys:
            index, epoch = keys[0]
            seed_global_rngs(sample_seed(self.seed, epoch, index))
        return self.dataset.__getitems__([index for index, _ in keys])


def _reads_batches(dataset: Any) -> bool:
    """Whether ``dataset`` reads a batch at once (``__getitems__``). torch's ``Subset`` (what
    ``random_split`` returns) has one that loops over its dataset's samples unless that
    dataset reads batches itself: such a subset keeps a seed per sample."""
    if not getattr(dataset, "__getitems__", None):
        return False
    if type(dataset).__getitems__ is Subset.__getitems__:
        return _reads_batches(dataset.dataset)
    return True


def _say_if_untracked(rank: int) -> None:
    """A ResumableLoader iterated under ``rt.main`` but not tracked: its position is in no
    checkpoint. Said once per process, by rank 0."""
    if lifecycle.running_context() is None:
        return
    say_once(
        log, "untracked loader", logging.WARNING if rank == 0 else logging.DEBUG,
        "a ResumableLoader is iterated under rt.main but is not tracked: its position "
        "(epoch, samples consumed) is in no checkpoint, so a restart begins its epoch again "
        "and trains on other batches than an uninterrupted run. Track it before the loop: "
        "ctx.track(data=loader) (an evaluation loader, read from its start each time, needs "
        "nothing)")


class ResumableLoader(FollowsSteps):
    """A DataLoader whose position (epoch, samples consumed) is part of the checkpoint.

    ``ctx.track(data=loader)`` and draw batches with ``batches = loader.forever()`` and
    ``next(batches)``, or ``for batch in loader`` per epoch (it yields the rest of the
    current epoch, then moves to the next). ``num_workers``, ``collate_fn``,
    ``pin_memory``, ``persistent_workers`` and the other DataLoader arguments pass through;
    ``drop_last`` applies to both the sharding (no padding) and the batches (no short last
    batch).

    The position advances in the main process when a batch is handed out, after the
    workers' prefetch, so a checkpoint taken between two steps records exactly the batches
    the loop has trained on.

    Worker seeds: the DataLoader would draw its workers' base seed from the global torch
    RNG at each ``iter()``, shifting the training RNG stream; the loader gets its own
    generator, seeded from (seed, epoch, consumed, rank) before each ``iter()``, so data
    loading never touches the global RNG and worker seeds are a function of the position
    (unless you pass ``generator=``: it is used as is). ``persistent_workers`` keeps the
    worker seeds of the first ``iter()``.

    Randomness inside the dataset's ``__getitem__``: in worker processes
    (``num_workers > 0``) each sample is loaded right after the worker's global RNGs
    (torch's CPU generator, ``random``, numpy's ``np.random``) are seeded from (seed,
    epoch, sample index), so its draws do not depend on which worker loads it, nor on
    where the iteration started: a resume augments every sample as the uninterrupted run
    did (``seed_per_sample=False`` keeps the DataLoader's seeding, once per worker, which
    a resume does not reproduce). Generators of the dataset's own are not reseeded. With
    ``num_workers=0`` samples draw from the main process's global RNGs, which the
    checkpoint saves.

    Restore (``load_state_dict``) before drawing the first batch: an iterator that was live
    when the state was loaded raises on its next batch. ``@rt.main``'s ``ctx.steps()``
    restores on its first iteration, and ``forever()`` starts its iterator lazily, at the
    first ``next()``, so the usual loop is in the right order; a loop that draws before
    ``ctx.steps`` begins calls ``ctx.restore()`` first. Under ``@rt.main`` the state is
    that of the finished steps: batches drawn after a step's optimizer step are the next
    step's, whichever order the loop draws in.
    """

    # shuffle= is a parameter of its own here, so it never reaches the DataLoader.
    _OWNED = ("sampler", "batch_sampler")

    def __init__(self, dataset: Any, *, batch_size: int | None = None, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, num_replicas: int | None = None,
                 rank: int | None = None, seed_per_sample: bool = True,
                 **dataloader_kwargs: Any) -> None:
        owned = [k for k in self._OWNED if k in dataloader_kwargs]
        if owned:
            raise TypeError(
                f"ResumableLoader got {', '.join(owned)}=: it builds its own sampler to "
                "checkpoint the data order; use its shuffle=, seed=, drop_last=, "
                "num_replicas= and rank= arguments instead")
        if batch_size is None:   # optional in the signature so that the check above comes first
            raise TypeError("ResumableLoader needs batch_size=N: it checkpoints its position "
                            "in batches of N samples")
        if dataloader_kwargs.get("in_order", True) is False:
            raise ValueError("in_order=False hands batches out of order, so the position "
                             "could not be checkpointed exactly: leave in_order at True")
        if isinstance(dataset, IterableDataset) or not isinstance(dataset, Sized):
            raise TypeError(
                f"ResumableLoader needs a map-style dataset with __len__ and __getitem__, got "
                f"{type(dataset).__name__}: an iterable-style dataset keeps its position "
                "itself and cannot be resumed through a sampler; use a plain DataLoader and "
                "keep the stream's position in ctx.values "
                '(docs/checkpointing.md, "Exact data position")')
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        self.batch_size = batch_size
        self.drop_last = bool(drop_last)
        self.sampler = ResumableSampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                        num_replicas=num_replicas, rank=rank)
        self._own_generator = dataloader_kwargs.get("generator") is None
        if self._own_generator:
            dataloader_kwargs["generator"] = torch.Generator()
        # Forked workers mark their start, so that one whose fork deadlocked is noticed.
        self._marks: forkwatch.StartMarks | None = None
        workers = dataloader_kwargs.get("num_workers", 0)
        if workers and forkwatch.forks(dataloader_kwargs.get("multiprocessing_context")):
            self._marks = forkwatch.StartMarks(workers, dataloader_kwargs.get("worker_init_fn"))
            dataloader_kwargs["worker_init_fn"] = self._marks
        sampler: Sampler[Any] = self.sampler
        if workers and seed_per_sample:
            seeded = _SeededBatches if _reads_batches(dataset) else _SeededSamples
            dataset, sampler = seeded(dataset, seed), _KeyedSampler(self.sampler)
        self.loader: DataLoader[Any] = DataLoader(
            cast("Dataset[Any]", dataset), batch_size=batch_size, sampler=sampler,
            drop_last=drop_last, **dataloader_kwargs)
        self._restores = 0  # bumped by load_state_dict: a live iterator notices and stops
        # Under @rt.main: the Context, and the batches handed out for the step in flight: the
        # position before the first of them (None: none yet) and the count of optimizer
        # steps begun when it was handed out. A batch drawn after a step's optimizer step
        # is the next step's, even when the loop draws it before ctx.steps ends the step
        # (`for x, y in data: step = next(steps)`, or a prefetch at the end of the body):
        # the step's checkpoint leaves it out, and so does a life's hand-over.
        self._steps: Any = None
        self._span: tuple[int, int] | None = None   # (epoch, consumed)
        self._span_opt = 0
        self._epoch_read_early: int | None = None   # .epoch as read before the restore

    @property
    def epoch(self) -> int:
        if self._steps is not None and not self._steps._began and \
                self._epoch_read_early is None:
            self._epoch_read_early = self.sampler.epoch   # the restore warns if it moves
        return self.sampler.epoch

    def __len__(self) -> int:
        """Batches per full epoch for this rank."""
        s = self.sampler
        per_rank = s.dataset_len // s.num_replicas if s.drop_last else math.ceil(
            s.dataset_len / s.num_replicas)
        if self.drop_last:
            return per_rank // self.batch_size
        return math.ceil(per_rank / self.batch_size)

    def _worker_seed(self) -> int:
        s = self.sampler
        key = f"{s.seed}:{s.epoch}:{s.consumed}:{s.rank}".encode()
        return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & (2**63 - 1)

    def __iter__(self) -> Iterator[Any]:
        return self._epoch()

    def _epoch(self) -> Iterator[Any]:
        s = self.sampler
        if self._steps is None:
            _say_if_untracked(s.rank)
        restores = self._restores
        left = len(s)  # this rank's samples left, at the position the DataLoader starts from
        batches, watch = self._start()
        steps = self._steps
        while True:
            before = s.epoch, s.consumed
            failure = sigterm.take_loader_failure()
            if failure is not None:
                # A worker died while the step computed (a SIGTERM to the process group):
                # stop here, before waiting for a batch that may never come.
                raise RuntimeError(failure)
            try:
                batch = next(batches)
            except StopIteration:
                break
            except RuntimeError:
                if watch is None or not watch.killed:
                    raise
                # A worker whose fork deadlocked was killed (forkwatch.py): nothing of this
                # iterator was handed out since, so start again from the same position.
                sigterm.take_loader_failure()
                getattr(batches, "_shutdown_workers", lambda: None)()
                batches, watch = self._start()
                continue
            if self._restores != restores:
                if steps is not None:   # under @rt.main: the restore came after the draw
                    raise RuntimeError(
                        "this loader's iterator began before the checkpoint was restored "
                        "into it (ctx.steps restores at its first iteration), so its "
                        "batches no longer follow the checkpoint: call ctx.restore() "
                        "before drawing the first batch (before a batch drawn ahead of "
                        "the loop, or zip(data, ctx.steps(n)))")
                raise RuntimeError(
                    "the loader's state was loaded while this iterator was live, so its "
                    "batches no longer follow the checkpoint: call iter(loader) or "
                    "loader.forever() again after load_state_dict")
            # Counted from the sizes the sampler and batch_size imply, not from the batch
            # (whose structure collate_fn decides); every rank takes as many, so x W.
            taken = min(self.batch_size, left)
            left -= taken
            s.consumed += taken * s.num_replicas
            if steps is not None:
                begun = steps.checkpoints.optimizer_steps
                if self._span is None or begun != self._span_opt:
                    self._span, self._span_opt = before, begun
            yield batch
        # Not reached when the consumer stops early (GeneratorExit): the epoch goes on.
        s.epoch += 1
        s.consumed = 0

    def _start(self) -> tuple[Iterator[Any], forkwatch.StartWatch | None]:
        """The DataLoader's iterator from the current position, and the watch over the
        workers it forked (None when it forked none)."""
        if self._own_generator:
            generator = self.loader.generator
            assert generator is not None
            generator.manual_seed(self._worker_seed())
        # Persistent workers forked once, by the first iterator: nothing new to watch.
        marks = None if self.loader.persistent_workers and \
            getattr(self.loader, "_iterator", None) is not None else self._marks
        if marks is not None:
            marks.reset()
        batches = iter(self.loader)
        if self.loader.num_workers:
            sigterm.defer_loader_failures()   # torch's SIGCHLD handler exists now
        return batches, None if marks is None else forkwatch.StartWatch(batches, marks)

    def forever(self) -> Iterator[Any]:
        """Batches across epochs without end; lazy: nothing is drawn before the first next()."""
        if len(self) == 0:
            raise ValueError(
                f"an epoch has no batch for this rank ({self.sampler.dataset_len} samples, "
                f"{self.sampler.num_replicas} ranks, batch_size {self.batch_size}, "
                "drop_last=True): use a smaller batch_size or drop_last=False")
        while True:
            yield from self._epoch()

    def state_dict(self) -> dict[str, Any]:
        """The position of the finished steps: under ``@rt.main``, without the batches
        already handed out for the step in flight."""
        state = self.sampler.state_dict()
        if self._span is not None:
            state["epoch"], state["consumed"] = self._span
        return state

    def _follow_steps(self, steps: Any) -> None:
        """Count the batches of the step in flight (``ctx.track`` passes the Context; its
        checkpoint manager counts the tracked optimizers' steps begun)."""
        self._steps, self._span, self._epoch_read_early = steps, None, None

    def _at_boundary(self, stepped: bool) -> None:
        """A step ended (``stepped``: it ran an optimizer step). Batches handed out since
        then stay the next step's; any others were the ended step's."""
        if not (stepped and self._span is not None
                and self._span_opt == self._steps.checkpoints.optimizer_steps):
            self._span = None

    def _rewind_to_boundary(self) -> None:
        """Set the position back to the start of the step in flight, undoing the batches
        it drew (micro-batches), for a save of the last finished step. The iterator in
        flight is stale afterwards."""
        if self._span is not None:
            self.sampler.epoch, self.sampler.consumed = self._span
            self._span = None
            self._restores += 1
        # Otherwise the step in flight has drawn nothing: the position is the boundary's.

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sampler.load_state_dict(state)
        self._restores += 1
        self._span = None
        log.info("data position restored: epoch %d, %d samples consumed",
                 self.sampler.epoch, self.sampler.consumed)
