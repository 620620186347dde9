"""When to save: the one place that decides, after each step, whether this step is saved.

:class:`SaveScheduler` asks the save policy (every N steps, the max-interval ceiling,
auto_interval: policy.py) with a :class:`~.policy.SaveContext` and turns a SIGTERM into an
emergency save. Multi-rank, every rank must decide the same at the same step, so the
scheduler agrees with the others on everything the decision reads: the policy itself (the
primary's copy), the clock (the primary's), a pending SIGTERM (anyone's), the cost of a
save (the slowest rank's) and the job's observed MTBF (the primary reads the launcher's
failure log, ``telemetry.ObservedMtbf``).
"""

from __future__ import annotations

import enum
import logging
import pickle
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from ... import sigterm
from ...observe.telemetry import ObservedMtbf
from ..commit.manifest import CheckpointError
from .coordination import Coordinator
from .policies import SaveContext, SavePolicy

log = logging.getLogger(__name__)

# The tiers whose write times the node-local cadence weighs (nodelocal.PersistentCadence),
# in the order of shared_tier_s.
TIMED_TIERS = ("node-local", "persistent")


class Decision(enum.Enum):
    SKIP = "skip"
    SAVE = "save"              # the policy says so
    EMERGENCY = "emergency"    # a SIGTERM: save blocking, then leave (exit 134)


class SigtermWatch:
    """Notes a SIGTERM for an emergency save at the next step boundary, from the moment
    it is created: the manager creates it first, so a SIGTERM that arrives while the ranks
    still set up is not lost; one that came before (@rt.main notes it while the group
    forms) counts too."""

    def __init__(self, enabled: bool) -> None:
        self.received = enabled and sigterm.received()
        self._old: Any = None
        if enabled:
            self._install()

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise CheckpointError("save_on_sigterm needs the manager to be created in the "
                                  "main thread")

        def on_sigterm(signum: int, frame: Any) -> None:
            self.received = True
            sigterm.note()  # for the waits on peers, which must not outlast the grace period
                            # (and the grace period's clock: since())

        self._old = signal.signal(signal.SIGTERM, on_sigterm)

    def elapsed(self) -> float | None:
        """Seconds since the SIGTERM (None: none): how much of its grace period is gone."""
        if not self.received:
            return None
        since = sigterm.since()
        return 0.0 if since is None else since

    def close(self) -> None:
        """Put back the handler that was there before."""
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
            self._old = None


class SaveScheduler:
    """Decides, step by step, whether to save; the same decision on every rank.

    Creating one is collective (the ranks agree on the policy); so is :meth:`start`
    (the primary's clock) and, about once per ``sync_interval_s``, :meth:`decide`.
    """

    def __init__(self, policy: SavePolicy, coord: Coordinator, watch: SigtermWatch, *,
                 clock: Callable[[], float] = time.time, sync_interval_s: float = 1.0) -> None:
        self.coord = coord
        self.watch = watch
        self.clock = clock
        self.sync_interval_s = sync_interval_s
        self._multi = coord.world_size > 1
        self._primary = coord.rank == 0
        self.policy = self._agree_on_policy(policy)
        # The last save (or the restored step) and when: SaveContext.last_save_*.
        self.last_save_step: int | None = None
        self._last_save_time = 0.0
        # What a save costs the training loop (waiting for the previous one, the snapshot,
        # the write when blocking), an EMA: SaveContext.save_cost_s, for auto_interval.
        self.save_cost: float | None = None
        # The job's observed MTBF (the launcher's failure log), read on the primary:
        # SaveContext.mtbf_s, for auto_interval.
        self._observed = ObservedMtbf.from_env() if self._primary else None
        self._next_mtbf_read = float("-inf")
        # Multi-rank, as of the last _sync: the primary's clock (a max over all ranks'
        # clocks would let one rank's skew, a clock ahead, postpone every time-based
        # save), the slowest rank's save cost and the primary's MTBF.
        self._shared_now = 0.0
        self._shared_save_cost: float | None = None
        self._shared_mtbf: float | None = None
        # Seconds since the SIGTERM, the earliest-signalled rank's, as of the decision to
        # save in an emergency: every rank plans the save for the same deadline.
        self.sigterm_elapsed_s = 0.0
        # The node-local tier's cadence (nodelocal.PersistentCadence): this rank's write
        # times per tier (EMAs, from the writer thread), the slowest rank's as agreed, and
        # the time between two saves on the agreed clock.
        self._tier_s: list[float | None] = [None] * len(TIMED_TIERS)
        self.shared_tier_s: tuple[float | None, float | None] = (None, None)
        # The tiers whose last save on this rank failed, and the tier let it (a full
        # node-local disk); agreed: any rank's did, and every save goes to the
        # persistent tier too until they work again.
        self._failing: set[str] = set()
        self.shared_local_failing = False
        self.save_interval: float | None = None
        self.next_sync_step = 0          # the step of the next agreement (0: the next one)
        self._step_time = 0.0
        self._last_step_clock: float | None = None

    def _agree_on_policy(self, policy: SavePolicy) -> SavePolicy:
        """This life's copy of the save policy, the primary's on every rank.

        A policy may keep state (auto_interval: its MTBF, read from this process's
        environment, and when it started counting); each life starts from a fresh copy, and
        every rank takes the primary's so that they all decide to save at the same step.
        """
        try:
            blob = pickle.dumps(policy) if self._primary else None
        except Exception as exc:  # a policy holding a lambda: keep each rank's own
            log.warning("the save policy %r cannot be copied (%s); each rank uses its own, "
                        "so it must decide from its SaveContext alone", policy, exc)
            blob = None
        if self._multi:
            blob = self.coord.broadcast(blob)
        return policy if blob is None else pickle.loads(blob)  # noqa: S301 - our own bytes

    def start(self) -> None:
        """Start the clock that time-based saves count from (collective: the primary's)."""
        self._shared_now = float(self.coord.broadcast(self.clock()))
        self._last_save_time = self._shared_now

    @property
    def sigterm_received(self) -> bool:
        """This process got a SIGTERM (multi-rank, the others save with it at once)."""
        return self.watch.received

    def decide(self, step: int) -> Decision:
        """After each finished step (``step`` = steps done): save now, or not. Cheap."""
        if not self._multi:
            now = self.clock()
            emergency = self.watch.received
            self.sigterm_elapsed_s = self.watch.elapsed() or 0.0
            self.shared_tier_s = (self._tier_s[0], self._tier_s[1])
            self.shared_local_failing = bool(self._failing)
            cost = self.save_cost
            if now >= self._next_mtbf_read:   # a stat() per second, not per step
                self._next_mtbf_read = now + self.sync_interval_s
                self._shared_mtbf = self._observed.at(now) if self._observed else None
        else:
            now, emergency = self._sync(step)
            cost = self._shared_save_cost
        if emergency:
            return Decision.EMERGENCY
        if self.policy.should_save(SaveContext(step, now, self.last_save_step,
                                               self._last_save_time, cost, self._shared_mtbf)):
            return Decision.SAVE
        return Decision.SKIP

    def _sync(self, step: int) -> tuple[float, bool]:
        """Multi-rank: agree on the clock, a pending SIGTERM, the cost of a save (the
        slowest rank's: it blocks the job) and the MTBF, about once per
        ``sync_interval_s``, so every rank takes the same decision at the same step."""
        now_local = time.monotonic()
        if self._last_step_clock is not None:
            dt = now_local - self._last_step_clock
            self._step_time = dt if self._step_time == 0 else 0.9 * self._step_time + 0.1 * dt
        self._last_step_clock = now_local
        if step < self.next_sync_step:
            return self._shared_now, False
        stride = max(1, int(self.sync_interval_s / self._step_time)) if self._step_time else 1
        my_now = int(self.clock() * 1000) if self._primary else 0
        my_cost = -1 if self.save_cost is None else int(self.save_cost * 1e6)
        mtbf = self._observed.at(my_now / 1000.0) if self._observed else None
        my_mtbf = -1 if mtbf is None else int(mtbf * 1000)   # the primary's only
        elapsed = self.watch.elapsed()
        my_sigterm = -1 if elapsed is None else int(elapsed * 1000)
        my_tiers = [-1 if t is None else int(t * 1000) for t in self._tier_s]
        now_ms, stride, sigterm_ms, cost_us, mtbf_ms, local_ms, persistent_ms, failing = \
            self.coord.allreduce_max([my_now, stride, my_sigterm, my_cost, my_mtbf, *my_tiers,
                                      int(bool(self._failing))])
        self.shared_local_failing = bool(failing)
        self.shared_tier_s = tuple(None if t < 0 else t / 1000.0   # type: ignore[assignment]
                                   for t in (local_ms, persistent_ms))
        self.sigterm_elapsed_s = max(0, sigterm_ms) / 1000.0
        self._shared_now = now_ms / 1000.0
        self._shared_save_cost = None if cost_us < 0 else cost_us / 1e6
        self._shared_mtbf = None if mtbf_ms < 0 else mtbf_ms / 1000.0
        self.next_sync_step = step + stride
        return self._shared_now, sigterm_ms >= 0

    def saving(self, step: int) -> None:
        """A save of ``step`` starts now: the policy's clock restarts."""
        now = self._shared_now if self._multi else self.clock()
        if self.last_save_step is not None and now > self._last_save_time:
            dt = now - self._last_save_time
            self.save_interval = dt if self.save_interval is None else \
                0.7 * self.save_interval + 0.3 * dt
        self.last_save_step = step
        self._last_save_time = now

    @property
    def policy_interval(self) -> float | None:
        """The time from one save to the next that the policy gives: between two saves,
        less what a save blocks the loop (waiting for the one before included). The same
        on every rank (the agreed clock and cost)."""
        cost = self._shared_save_cost if self._multi else self.save_cost
        if self.save_interval is None:
            return None
        return max(1e-3, self.save_interval - (cost or 0.0))

    @property
    def shared_mtbf(self) -> float | None:
        """The job's observed MTBF, as agreed (None: not known)."""
        return self._shared_mtbf

    def wrote(self, tier: str, seconds: float | None) -> None:
        """The writer thread wrote a step to the tier named ``tier`` in ``seconds``; None:
        the write failed, and the tier tolerated it (Tier.write returned False)."""
        if seconds is None:
            self._failing.add(tier)
            return
        self._failing.discard(tier)
        if tier in TIMED_TIERS:
            i = TIMED_TIERS.index(tier)
            old = self._tier_s[i]
            self._tier_s[i] = seconds if old is None else 0.7 * old + 0.3 * seconds

    def measured(self, cost_s: float) -> None:
        """What the save just taken blocked the training loop for."""
        self.save_cost = cost_s if self.save_cost is None else \
            0.7 * self.save_cost + 0.3 * cost_s

    def restored(self, step: int | None, created: float) -> None:
        """The run resumed from ``step``, committed at ``created``."""
        self.last_save_step = step
        self._last_save_time = created

    @property
    def save_point(self) -> tuple[int | None, float]:
        """The last save (or restored step) and when: what a peer restore carries over, so
        time-based saves keep their clock across an in-process recovery."""
        return self.last_save_step, self._last_save_time

    def close(self) -> None:
        self.watch.close()
