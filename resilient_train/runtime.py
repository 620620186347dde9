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

import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from .errors import record
from .telemetry import Telemetry

log = logging.getLogger(__name__)

@functools.cache
def _telemetry() -> Telemetry | None:
    """One per process, shared by its lives (in-process recoveries)."""
    return Telemetry.from_env()

R = TypeVar("R")


@dataclass(frozen=True)
class MainOptions:
    """What ``@rt.main`` sets up. ``checkpoint`` and ``distributed`` take the lower layers'
    own options (CheckpointOptions, DistributedOptions); None means their defaults."""

    checkpoint_dir: str | None = None   # None: AIP_CHECKPOINT_DIR, else ./checkpoints
    checkpoint: Any = None              # CheckpointOptions
    distributed: Any = None             # DistributedOptions
    final_save: bool = True             # save the last step when the loop ends
    # SIGTERM (maintenance, preemption): an emergency save at the next step boundary, then
    # exit 134. Overrides the checkpoint options' own save_on_sigterm.
    save_on_sigterm: bool = True


class Context:
    """One life of the training function: who this process is, and its checkpoints."""

    def __init__(self, group: Any, options: MainOptions) -> None:
        from .checkpoint.manager import CheckpointManager, CheckpointOptions

        self.group = group
        self.options = options
        self.checkpoints = CheckpointManager(
            options.checkpoint_dir,
            options=replace(options.checkpoint or CheckpointOptions(),
                            save_on_sigterm=options.save_on_sigterm))
        self.step = 0                    # steps done (the restored step before the loop)
        self.restored_step: int | None = None

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

    def track(self, **objects: Any) -> None:
        """Objects with state_dict/load_state_dict: model, optimizer, scheduler, scaler."""
        self.checkpoints.track(**objects)

    def steps(self, total: int) -> Iterator[int]:
        """Restore the latest checkpoint, then yield the remaining step indices; after each
        step, save by policy (or on SIGTERM: save and exit 134) and feed the watchdog."""
        start = self.checkpoints.restore_latest() or 0
        self.restored_step = start or None
        self.step = start
        if start:
            log.info("resuming after step %d", start)
        mgr, group, tele = self.checkpoints, self.group, _telemetry()
        if tele is not None:
            tele.begin_segment(start)   # the launcher's goodput accounting (telemetry.py)
        for step in range(start, total):
            yield step
            self.step = done = step + 1
            if tele is not None:   # first: an emergency save on SIGTERM exits in maybe_save
                tele.step(done)
            if mgr.maybe_save(done) and tele is not None:
                tele.saved(done, mgr.last_blocking_s)
            group.step_done(done)

    def _finish(self) -> None:
        mgr = self.checkpoints
        if self.options.final_save and self.step and mgr.last_saved_step != self.step:
            mgr.save(self.step)
        mgr.close()


def _life(fn: Callable[..., R], group: Any, options: MainOptions, args: tuple[Any, ...],
          kwargs: dict[str, Any]) -> R:
    ctx = Context(group, options)
    with ctx.checkpoints:  # on an error: waits for the save in flight, never raises over it
        result = fn(ctx, *args, **kwargs)
        ctx._finish()
    return result


def main(fn: Callable[..., R] | None = None, *,
         options: MainOptions | None = None) -> Any:
    """Decorate ``def train(ctx: rt.Context, ...)``; use as ``@rt.main`` or
    ``@rt.main(options=rt.MainOptions(...))``."""
    opts = options or MainOptions()

    def decorate(func: Callable[..., R]) -> Callable[..., R]:
        @functools.wraps(func)
        @record  # an escaping exception: error report + transient/permanent exit code
        def wrapper(*args: Any, **kwargs: Any) -> R:
            from .distributed.group import init_distributed

            group = init_distributed(opts.distributed)
            try:
                with group:
                    return group.run(_life, func, group, opts, args, kwargs)
            finally:
                tele = _telemetry()
                if tele is not None:
                    tele.close()

        return wrapper

    return decorate(fn) if fn is not None else decorate
