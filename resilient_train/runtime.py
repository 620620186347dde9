"""``@rt.main`` and the `Context` it passes: the glue between a training function and the
parts below it (distributed init, checkpoints, exit codes).

The decorated function is one *life* of the training run: it builds its objects, calls
``ctx.track(...)``, and loops over ``ctx.steps(total)``, which first restores the latest
checkpoint and then saves by policy and feeds the hang watchdog after every step. When a
peer restarts, the group re-forms in-process and the function is called again: the same
path a restarted process takes. An exception that escapes becomes an error report and the
exit code the platform understands (errors.py): transient 134, permanent 1.
"""

from __future__ import annotations

import atexit
import collections
import functools
import logging
import os
import pickle
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

from . import lifecycle, sigterm
from .cluster import CLUSTER_SPEC_ENV, JOB_ID_ENV, TF_CONFIG_ENV
from .errors import exception_chain, record
from .observe.telemetry import Telemetry
from .validate import NONE, expect_type, holder, options

if TYPE_CHECKING:  # torch-heavy: loaded when a training script builds them
    from .checkpoint.manager import CheckpointOptions
    from .checkpoint.storage.base import Storage
    from .distributed.group import DistributedOptions

log = logging.getLogger(__name__)

def _telemetry() -> Telemetry | None:
    """One per process, shared by its lives (in-process recoveries): kept by their loop."""
    return lifecycle.current().kept("telemetry", Telemetry.from_env)

R = TypeVar("R")


@options
@dataclass(frozen=True)
class MainOptions:
    """What ``@rt.main`` sets up. ``checkpoint`` and ``distributed`` take the lower layers'
    own options (CheckpointOptions, DistributedOptions); None means their defaults."""

    # A path or fsspec URL; None: AIP_CHECKPOINT_DIR, else ./checkpoints.
    checkpoint_dir: str | os.PathLike[str] | None = None
    checkpoint: CheckpointOptions | None = None
    distributed: DistributedOptions | None = None
    final_save: bool = True             # save the last step when the loop ends
    # SIGTERM (maintenance, preemption): an emergency save at the next step boundary, then
    # exit 134. None: the checkpoint options' save_on_sigterm, and on when that is None too.
    # Both given and different is an error: one place decides.
    save_on_sigterm: bool | None = None

    def __post_init__(self) -> None:
        d = self.checkpoint_dir
        if d is not None and (not isinstance(d, (str, os.PathLike)) or not os.fspath(d)):
            raise ValueError(f"MainOptions.checkpoint_dir={d!r}: expected a path or URL "
                             f"(gs://bucket/run), or None for AIP_CHECKPOINT_DIR, else "
                             f"./checkpoints")
        if self.checkpoint is not None:
            from .checkpoint.manager import CheckpointOptions  # loaded: the caller built one

            expect_type("MainOptions.checkpoint", self.checkpoint, CheckpointOptions,
                        "rt.CheckpointOptions(...), or None for its defaults")
        if self.distributed is not None:
            from .distributed.group import DistributedOptions

            expect_type("MainOptions.distributed", self.distributed, DistributedOptions,
                        "rt.DistributedOptions(...), or None for its defaults")
        expect_type("MainOptions.final_save", self.final_save, bool, "True or False")
        mine = self.save_on_sigterm
        expect_type("MainOptions.save_on_sigterm", mine, (bool, NONE),
                    "True, False or None (the checkpoint options decide)")
        theirs = self.checkpoint.save_on_sigterm if self.checkpoint is not None else None
        if mine is not None and theirs is not None and mine != theirs:
            raise ValueError(
                f"MainOptions.save_on_sigterm={mine} and "
                f"MainOptions.checkpoint.save_on_sigterm={theirs} contradict: say it in one "
                f"place (leave the other None)")

    def checkpoint_options(self) -> CheckpointOptions:
        """The checkpoint options the manager gets: ``checkpoint`` with save_on_sigterm
        decided (here, else there, else on)."""
        from .checkpoint.manager import CheckpointOptions

        base = self.checkpoint or CheckpointOptions()
        on = self.save_on_sigterm if self.save_on_sigterm is not None else base.save_on_sigterm
        return replace(base, save_on_sigterm=True if on is None else on)


def _same_on_every_rank(totals: list[int]) -> None:
    """Every rank runs the same steps (``totals``: each rank's): a rank with more would
    wait for ever in its first extra step's collectives (DDP's all-reduce), while the
    others end and the job succeeds without it. Raised on every rank alike, before the
    restore."""
    if len(set(totals)) == 1:
        return
    by_total: dict[int, list[int]] = {}
    for rank, t in enumerate(totals):
        by_total.setdefault(t, []).append(rank)
    said = "; ".join(f"{t} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}"
                     for t, r in sorted(by_total.items()))
    raise ValueError(
        f"ctx.steps(total) differs across ranks ({said}): every rank must run the same "
        f"steps, or a rank with more waits for ever in the collectives of its first extra "
        f"step. Compute the total from what every rank shares (epochs * len(loader) over a "
        f"DistributedSampler, which gives each rank the same number of batches), not from "
        f"this rank's own shard of the data")


# What an unnamed tracked object is called in the fix that names it, by its classes.
_KIND_NAMES = (("Module", "model"), ("Optimizer", "optimizer"), ("LRScheduler", "scheduler"),
               ("ReduceLROnPlateau", "scheduler"), ("GradScaler", "scaler"),
               ("ResumableLoader", "data"))


def _names_for(objects: tuple[Any, ...]) -> str:
    """``model=..., optimizer=...`` for objects passed to ctx.track unnamed."""
    names: list[str] = []
    seen: collections.Counter[str] = collections.Counter()
    for obj in objects:
        classes = {c.__name__ for c in type(obj).__mro__}
        name = next((n for kind, n in _KIND_NAMES if kind in classes), "name")
        seen[name] += 1
        names.append(name if seen[name] == 1 else f"{name}{seen[name]}")
    return ", ".join(f"{n}=..." for n in names)


class _Values(dict):  # type: ignore[type-arg]
    """``ctx.values``: a dict that

    - checks each value as it is set (about 2 us): one that a checkpoint could not load as
      weights only (a numpy scalar, say) raises at the line that set it, not at the first
      save, perhaps hours later;
    - notes what the code before the restore read (``[]``, ``get``), so that the restore
      can name a read it made stale (``best = ctx.values.get("best")`` before the loop).
      ``setdefault`` and ``in`` are not noted: they set defaults, which the restore may
      replace."""

    def __init__(self, check: Callable[..., None]) -> None:
        super().__init__()
        self._check = check   # state.check_weights_only (runtime imports no torch itself)
        self.early: dict[Any, tuple[bytes, str]] | None = {}   # key -> the value read,
        # pickled (tensors, where == is elementwise, compare too) and shown

    def __setitem__(self, key: Any, value: Any) -> None:
        # The same object again (a list set back every step) was checked when first set;
        # what changed inside it, the save checks.
        if super().get(key, _ABSENT) is not value:
            self._check({key: value}, where="ctx.values")
        super().__setitem__(key, value)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return super().__getitem__(key)

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def _note(self, key: Any, value: Any) -> None:
        if self.early is not None and key not in self.early:
            self.early[key] = _pickled(value), _shown(value)

    def __getitem__(self, key: Any) -> Any:
        value = super().__getitem__(key)
        self._note(key, value)
        return value

    def get(self, key: Any, default: Any = None) -> Any:
        self._note(key, super().get(key, _ABSENT))
        return super().get(key, default)

    def __reduce__(self) -> tuple[Any, ...]:
        # Saved as an OrderedDict (what a state_dict is), never as a class of ours:
        # torch.load(weights_only=True) takes those, not a plain dict's reduction.
        return collections.OrderedDict, (), None, None, iter(self.items())

    def stale_reads(self) -> list[tuple[str, str, str]]:
        """Stop noting; (``ctx.values[key]``, the value read, the value now) for each key
        read before now whose value has changed since."""
        early, self.early = self.early or {}, None
        now = {key: super(_Values, self).get(key, _ABSENT) for key in early}
        return [(f"ctx.values[{key!r}]", shown, _shown(now[key]))
                for key, (was, shown) in early.items() if was != _pickled(now[key])]


_ABSENT = "<not set>"


def _pickled(value: Any) -> bytes:
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - unpicklable: the save says so, not this check
        return b""


def _shown(value: Any) -> str:
    text = value if value is _ABSENT else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class Context:
    """One life of the training function: who this process is, and its checkpoints."""

    def __init__(self, group: Any, options: MainOptions) -> None:
        from .checkpoint.manager import CheckpointManager

        self.group = group
        self.options = options
        checkpoint_options = options.checkpoint_options()
        self.checkpoints = CheckpointManager(
            options.checkpoint_dir, options=checkpoint_options,
            storage=_kept_storage(options.checkpoint_dir, checkpoint_options))
        from .checkpoint.state.capture import check_weights_only

        self._values = _Values(check_weights_only)   # see _Values
        self.checkpoints.values = self._values
        self.step = 0                    # steps done (the restored step before the loop)
        self.restored_step: int | None = None
        self._loaders: dict[str, Any] = {}   # tracked ResumableLoaders, by name
        self._began = False   # restored: from here a failure hands this life's state over
        self._unreported = False   # restored, and the restore not yet in the telemetry
        self._in_step = False   # ctx.steps yielded a step whose end it has not seen

    @property
    def rank(self) -> int:
        return int(self.group.rank)

    @property
    def world_size(self) -> int:
        return int(self.group.world_size)

    @property
    def is_primary(self) -> bool:
        return bool(self.group.is_primary)

    @property
    def device(self) -> Any:
        return self.group.device

    @property
    def values(self) -> dict[str, Any]:
        """User values saved with every checkpoint (data position, epoch, metrics)."""
        return self.checkpoints.values

    def track(self, *unnamed: Any, **objects: Any) -> None:
        """Objects with state_dict/load_state_dict: model, optimizer, scheduler, scaler."""
        if unnamed:   # the names key the checkpoint's entries: they are not guessed
            raise TypeError(f"ctx.track() takes each object by name, the name it has in "
                            f"the checkpoint: ctx.track({_names_for(unnamed)})")
        if self._began:
            log.warning(
                "ctx.track(%s) after this life's restore: saved from now on, but a restarted "
                "run tracks it after its restore too, so it is never restored: track "
                "everything before ctx.steps() or ctx.restore()", ", ".join(objects))
        self.checkpoints.track(**objects)
        from .data import ResumableLoader

        for name, obj in objects.items():
            if isinstance(obj, ResumableLoader):
                self._loaders[name] = obj
                obj._follow_steps(self)   # the position at the start of the step in flight
            else:
                self._loaders.pop(name, None)

    def restore(self) -> int | None:
        """Restore the latest checkpoint into the tracked objects, RNGs and ``values`` now,
        once per life, and return its step (None on a fresh start). ``ctx.steps`` calls it
        at its first iteration; call it first where the code before the loop reads restored
        state (``data.epoch``, ``ctx.values``, a scheduler's last epoch)."""
        if self._began:
            return self.restored_step
        with self.group.in_phase("restore"):   # a long read is no hang; a silent peer is
            start = self.checkpoints.restore_latest() or 0
        self.restored_step = start or None
        self.step = start
        self._began = True
        if start:
            log.info("resuming after step %d", start)
        stale = [(f"{name}.epoch", str(loader._epoch_read_early), str(loader.epoch))
                 for name, loader in self._loaders.items()
                 if loader._epoch_read_early not in (None, loader.epoch)]
        stale += self._values.stale_reads()
        for what, was, now in stale:
            log.warning(
                "%s was read before the restore (it was %s; the checkpoint's is %s), so what "
                "the code before the loop computed from it is stale: read it inside the "
                "loop, or call ctx.restore() before reading it", what, was, now)
        self._unreported = self.checkpoints.last_restore is not None
        return self.restored_step

    def steps(self, total: int) -> Iterator[int]:
        """Restore the latest checkpoint (unless ``ctx.restore()`` has), then yield the
        remaining step indices; after each step, save by policy (or on SIGTERM: save and
        exit 134) and feed the watchdog. A second loop in the same life goes on from the
        step the first ended at."""
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise TypeError(f"ctx.steps(total={total!r}): expected a whole number of steps "
                            f">= 0 (an int: ctx.steps(int(total)) for a float such as 1e4)")
        if self.world_size > 1:
            _same_on_every_rank(self.checkpoints.coord.allgather(total))
        self.restore()
        start = self.step
        if start >= total and start == self.restored_step and self.is_primary:
            # A finished job run again, or a total left as it was: the loop does nothing.
            from .lifecycle import say_once

            say_once(log, f"no step left {total} {start}", logging.WARNING,
                     "ctx.steps(%d) has no step left to run: the checkpoint restored is of "
                     "step %d (raise the total to train on)", total, start)
        mgr, group, tele = self.checkpoints, self.group, _telemetry()
        if tele is not None:
            tele.begin_segment(start, self.rank)   # the launcher's goodput (telemetry.py)
            if self._unreported:   # the job record's recoveries
                tele.event("restore", **asdict(mgr.last_restore),  # type: ignore[arg-type]
                           generation=getattr(group, "generation", 0))
        self._unreported = False
        # torch installs its DataLoader SIGCHLD handler with the first multi-process
        # iterator: from then on a worker's death raises at a batch only (sigterm.py).
        loading = sys.modules.get("torch.utils.data._utils.signal_handling")
        deferred = not hasattr(loading, "_SIGCHLD_handler_set") or \
            sigterm.defer_loader_failures()
        for step in range(start, total):
            self._in_step = True   # until the loop comes back for the next one
            yield step
            self._in_step = False
            self.step = done = step + 1
            self._step_ended()
            if not deferred and loading._SIGCHLD_handler_set:  # type: ignore[union-attr]
                deferred = sigterm.defer_loader_failures()
            if tele is not None:   # first: an emergency save on SIGTERM exits in maybe_save
                tele.step(done)
            group.phase("save")   # a long save is no hang (the watchdog counts steps)
            if mgr.maybe_save(done) and tele is not None:
                tele.saved(done, mgr.last_blocking_s)
            group.phase("step")
            group.step_done(done)
        if self.options.final_save and self.step:
            # Committed before the code after the loop runs: an evaluation that crashes, or
            # the DDP tutorial's destroy_process_group(), which ends the collectives a
            # save in flight needs, cannot cost the finished run its last checkpoint.
            group.phase("save")
            mgr.save_final(self.step)
            group.phase("step")

    def _step_ended(self) -> None:
        """The step in flight is done: the loaders' batches drawn so far are its own, but
        for those drawn after its optimizer step (the next step's)."""
        stepped = self.checkpoints.stepped_since_boundary
        for loader in self._loaders.values():
            loader._at_boundary(stepped)

    def _settle(self) -> None:
        """The step in flight ran its optimizer step, and ctx.steps will not see it end: the
        loop was left (a break at the end of the body, a zip whose data ran out first), or
        its next batch's draw failed (an epoch loop draws it before ctx.steps ends the
        step). The state is that step's end: count it as done, for the save that follows."""
        if self._in_step and self.checkpoints.stepped_since_boundary:
            self._in_step = False
            self.step += 1
            self._step_ended()

    def _hand_over(self) -> None:
        """The life ends on an error: leave its state at the last step boundary in the
        process's memory, for the next life's restore from peers (checkpoint/peers.py).
        A life that failed before its restore leaves the previous one's in place."""
        if not self._began:
            return
        try:
            for loader in self._loaders.values():   # the step in flight's batches: undone
                loader._rewind_to_boundary()
            self.checkpoints.hand_over(self.step)
        except Exception as exc:  # noqa: BLE001 - the failure on its way out matters more
            log.warning("could not keep this life's state for peer recovery: %s", exc)

    def _finish(self) -> None:
        mgr = self.checkpoints
        self._settle()
        self.group.phase("save")   # the last save and the upload in flight: no hang
        if self.options.final_save and self.step:
            mgr.save_final(self.step)   # after a break (the loop's end saved it otherwise)
        mgr.close()

    def _after_loader_death(self, exc: BaseException) -> None:
        """A DataLoader's worker died (``exc`` says so). With a SIGTERM pending, or arriving
        within LOADER_SIGTERM_WAIT_S (a SIGTERM to the whole process group stops the
        workers too, and this process's handler may run a moment after the loader
        noticed), the run is being stopped: save the last finished step and exit 134.
        Returns without one: a dead worker is then what it always was (exit 1)."""
        from .errors import exit_transient

        mgr = self.checkpoints
        if not mgr.options.save_on_sigterm:
            return   # no handler of ours: a SIGTERM ends the process by itself
        undo = sigterm.quiet_loader_failures()   # the other workers' deaths: no second raise
        if not sigterm.wait(LOADER_SIGTERM_WAIT_S):
            undo()
            return
        what = "SIGTERM: the DataLoader's workers were stopped with this process"
        if self.world_size > 1:
            # The ranks save together at a step boundary, and the others are inside
            # this step (its collectives): no save can be agreed on now.
            exit_transient(f"{what} in the middle of step {self.step + 1}; no emergency "
                           f"checkpoint (the {self.world_size} ranks save only together, "
                           f"at a step boundary): the run resumes from step "
                           f"{mgr.last_commit_step or 0}", exc=exc, one_line=True)
        if not _raised_in_data_loading(exc):
            # torch's handler raised wherever the step was, before it was deferred (the
            # first step's batch started the workers): perhaps in opt.step(), so the
            # model need not be at the boundary.
            exit_transient(f"{what} while step {self.step + 1} ran outside the data "
                           f"loading, so the state is not at a step boundary; no "
                           f"emergency checkpoint: the run resumes from step "
                           f"{mgr.last_commit_step or 0}", exc=exc, one_line=True)
        self._settle()
        if not self.step:
            exit_transient(f"{what} before the first step finished; nothing to save",
                           exc=exc, one_line=True)
        for loader in self._loaders.values():   # undo the unfinished step's batches
            loader._rewind_to_boundary()
        committed = mgr.last_saved_step == self.step or mgr.emergency_save(self.step)
        mgr.close()   # waits for a save of this step still in flight, and retention
        exit_transient(f"{what}; emergency checkpoint of step {self.step}" if committed
                       else f"{what}; {mgr.abandoned}", exc=exc, one_line=True)


# How long a dead DataLoader worker waits for this process's SIGTERM (a process group's
# SIGTERM reaches every member at once; our handler runs at the next bytecode).
LOADER_SIGTERM_WAIT_S = 2.0

# How long a broken connection out of a batch fetch waits for the SIGCHLD handler to say
# that a loader worker died (it comes within milliseconds of the worker's death).
LOADER_DEATH_WAIT_S = 1.0

_LOADER_DEATH = "DataLoader worker (pid"   # torch: "... exited unexpectedly", "... is killed"


def _loader_death(exc: BaseException) -> bool:
    """Whether ``exc`` (or one it was raised from) is torch's "a DataLoader worker died"."""
    return any(isinstance(e, RuntimeError) and str(e).startswith(_LOADER_DEATH)
               for e in exception_chain(exc))


def _surfaced_loader_death(exc: BaseException) -> RuntimeError | None:
    """torch's "DataLoader worker (pid N) is killed by signal" when ``exc`` is a broken
    connection out of a batch fetch because a loader worker died; else None.

    A worker killed while it hands over a batch breaks the connection the batch comes
    through (multiprocessing's fd passing), and that error can reach the main thread before
    the SIGCHLD handler that names the death: the same event would then read as a network
    failure. The handler runs within moments (it is deferred here, sigterm.py), so this
    waits for it, at most LOADER_DEATH_WAIT_S."""
    if not (_raised_in_data_loading(exc) and any(
            isinstance(e, (ConnectionError, EOFError)) for e in exception_chain(exc))):
        return None
    deadline = time.monotonic() + LOADER_DEATH_WAIT_S
    try:
        while True:
            failure = sigterm.take_loader_failure()
            if failure is not None:
                return RuntimeError(failure)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)   # the handler runs in this thread, between two sleeps
    except RuntimeError as raised:   # torch's own handler, where none of ours defers it
        if str(raised).startswith(_LOADER_DEATH):
            return raised
        raise


def _raised_in_data_loading(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while the step fetched a batch (a DataLoader iterator, or
    ResumableLoader's check before one): the step had not changed the model yet."""
    from .data import ResumableLoader

    check = ResumableLoader._epoch.__code__
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code is check or sigterm.is_data_loading(code):
            return True
        tb = tb.tb_next
    return False


def _kept_storage(directory: str | os.PathLike[str] | None,
                  options: CheckpointOptions) -> Storage:
    """The checkpoint directory's storage handle, opened by this loop's first life and
    kept for the later ones (its connections, the writable probe it passed)."""
    from .checkpoint.commit.directory import default_directory
    from .checkpoint.storage.base import Storage

    url = os.fspath(directory) if directory is not None else default_directory()
    return lifecycle.current().kept(f"storage {url}", lambda: Storage(
        url, retry=options.retry, storage_options=options.storage_options))


def _life(fn: Callable[..., R], group: Any, options: MainOptions, args: tuple[Any, ...],
          kwargs: dict[str, Any]) -> R:
    ctx = Context(group, options)
    with lifecycle.current().running(ctx):
        return _live(ctx, fn, args, kwargs)


def _live(ctx: Context, fn: Callable[..., R], args: tuple[Any, ...],
          kwargs: dict[str, Any]) -> R:
    with ctx.checkpoints:  # on an error: waits for the save in flight, never raises over it
        try:
            # The state is fetched while fn builds the model (checkpoint/early.py). The
            # ranks agree on it first: a peer stopped meanwhile is a hang (its silence).
            with ctx.group.in_phase("restore"):
                ctx.checkpoints.start_restore()
            result = fn(ctx, *args, **kwargs)
        except Exception as exc:
            death = exc if _loader_death(exc) else _surfaced_loader_death(exc)
            if death is not None:
                ctx._after_loader_death(death)   # exits 134 when a SIGTERM stops the run
            ctx._hand_over()
            if death is not None and death is not exc:
                raise death   # its context: the connection error it surfaced as
            misuse = _misuse(exc)
            if misuse is not None:
                raise misuse from exc
            raise
        ctx._finish()
    return result


def _misuse(exc: BaseException) -> Exception | None:
    """What torch raised for a call that rt.main makes for the script, said with the fix
    (torch's own words do not say who formed the group first)."""
    if isinstance(exc, ValueError) and "default process group twice" in str(exc):
        return ValueError(
            "the script calls torch.distributed.init_process_group() inside rt.main, which "
            "has already formed the process group (and forms it again after a peer's "
            "restart): remove the call; ctx.rank, ctx.world_size and ctx.device say who "
            "this process is")
    return None


# Set where a launcher, the platform or torchrun runs the process: Ctrl-C is theirs then
# (the launcher's own cancel sends SIGTERM; torchrun's agent too).
_SUPERVISED_ENV = (CLUSTER_SPEC_ENV, TF_CONFIG_ENV, JOB_ID_ENV, "TORCHELASTIC_RUN_ID", "RANK",
                   "WORLD_SIZE")


def _alone_at_a_terminal(group: Any) -> bool:
    """A single process started by hand at a terminal (not a notebook's kernel, whose
    interrupt is a SIGINT too, nor a process a launcher supervises)."""
    try:
        tty = sys.stdin is not None and sys.stdin.isatty()
    except (AttributeError, ValueError):   # replaced or closed
        tty = False
    return tty and group.world_size == 1 and not any(v in os.environ for v in _SUPERVISED_ENV)


class _Uncalled:
    """Says, at exit, that the script decorated its training function with ``@rt.main``
    and never called it: the run then ends at once with exit 0, and a job of it
    "succeeds" having trained nothing (the decorator does not run the function, as
    ``if __name__ == "__main__": train()`` at the script's end does). Only for functions
    of the script itself (``__main__``), and only when none of them was called: a script
    with two entry points calls one; and only in a job (``CLUSTER_SPEC`` set, by the
    platform or the launcher), where the job's SUCCEEDED hides it: at a terminal the
    script's silence shows it, and ``python train.py --help`` ends without calling it."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.ran = False

    def decorated(self, func: Callable[..., Any]) -> None:
        if getattr(func, "__module__", None) != "__main__" or CLUSTER_SPEC_ENV not in os.environ:
            return
        if not self.names:
            atexit.register(self.check)
        self.names.append(getattr(func, "__qualname__", "the function"))

    def called(self) -> None:
        self.ran = True

    def check(self) -> None:
        if self.names and not self.ran:
            some = len(self.names) > 1
            log.warning("%s %s decorated with @rt.main but the script never called %s, so "
                        "nothing was trained: end the script with `if __name__ == "
                        "\"__main__\": %s()`", " and ".join(f"{n}()" for n in self.names),
                        "are" if some else "is", "either" if some else "it", self.names[0])


_UNCALLED = _Uncalled()


def main(fn: Callable[..., R] | None = None, *,
         options: MainOptions | None = None) -> Any:
    """Decorate ``def train(ctx: rt.Context, ...)``; use as ``@rt.main`` or
    ``@rt.main(options=rt.MainOptions(...))``."""
    if fn is not None and not callable(fn):   # @rt.main(rt.MainOptions(...))
        raise TypeError(f"rt.main({type(fn).__name__}(...)): the options go by name, "
                        f"@rt.main(options=rt.MainOptions(...))")
    if options is not None and not isinstance(options, MainOptions):
        # A lower layer's options: MainOptions holds them (checkpoint=, distributed=).
        where = holder(MainOptions, type(options))
        inside = (f"rt.MainOptions({where}=rt.{type(options).__name__}(...))" if where
                  else "rt.MainOptions(...)")
        raise TypeError(f"rt.main(options={type(options).__name__}(...)): options takes "
                        f"rt.MainOptions; pass options={inside}")
    opts = options or MainOptions()

    def decorate(func: Callable[..., R]) -> Callable[..., R]:
        _UNCALLED.decorated(func)

        @functools.wraps(func)
        @record  # an escaping exception: error report + transient/permanent exit code
        def wrapper(*args: Any, **kwargs: Any) -> R:
            from .distributed.group import init_distributed

            _UNCALLED.called()

            # SIGTERM before the checkpoint manager exists (forming the group) or between
            # two lives (re-forming it): the waits for peers leave, with exit 134.
            saves = bool(opts.checkpoint_options().save_on_sigterm)
            # What outlives each life (the peers' memory, telemetry, the life running):
            # this call's own, handed to every life it runs.
            with lifecycle.Lifecycle().installed(), sigterm.noted(saves):
                group = init_distributed(opts.distributed)
                try:
                    with group, sigterm.ctrl_c_saves(saves and _alone_at_a_terminal(group)):
                        return group.run(_life, func, group, opts, args, kwargs)
                finally:
                    tele = _telemetry()
                    if tele is not None:
                        tele.close()

        return wrapper

    return decorate(fn) if fn is not None else decorate
