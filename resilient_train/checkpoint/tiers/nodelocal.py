"""The node-local tier: frequent saves to the replica's own machine, rare ones to storage.

A save to the persistent tier (``gs://``, a ``/gcs/`` mount, a shared path) costs what
the link allows; a save to the machine's own disk (a local SSD, ``/dev/shm``) costs what
the disk allows, often ten times less, but is lost with the machine. With
``CheckpointOptions(node_local=NodeLocal(...))`` every save goes to the node-local tier
and every ``persistent_every``-th save (and every emergency and final save) to the
persistent tier too, from the same host snapshot. One policy says when to save, this says
where; ``persistent_every="auto"`` derives K from the tiers' measured write times and the
MTBF (:func:`persistent_every_auto`).

Every rank writes its own complete copy into its machine's directory (the replicated
state, its own per-rank file, and the copy of the previous rank's per-rank state that the
peer ring gave it: so a rank whose machine was replaced still finds its RNG streams and
values on its neighbour's disk) and commits it on its own (a manifest, then the marker,
as on any storage: commit/protocol.py): a machine's disk is its own, so nothing needs agreeing to
commit. Agreement comes at the restore, by the plan peer recovery uses
(tiers/plan.py): the newest step, no older than the persistent tier's newest, whose
replicated state some machine has and whose per-rank state every rank can get; ranks
that lack it receive it from the ranks that have it. Otherwise the restore reads storage.

Where the platform keeps a machine's disk (a worker restarted in place after its own exit,
or with ``restartJobOnWorkerRestart``) a restarted process resumes from here; where it
does not (maintenance, node loss, preemption, a job retry: a new VM) its directory is
empty and the restore falls back to peers or storage. Under ``resilient-train launch``
the directory defaults to ``$RESILIENT_TRAIN_NODE_LOCAL_DIR/checkpoints``, which the
launcher wipes exactly where the platform would (launcher/machines.py). In a job of
several ranks each rank writes in a subdirectory of its own, ``rank00003``: processes on
one machine (torchrun's), or ranks given one directory, never write over each other.

A copy belongs to its run (:func:`run_owner`, in its manifest): the checkpoint directory
and the job id. Another run's copy in the same directory (one ``NodeLocal(directory=...)``
given to two runs) is named in a warning and never restored.

Sharded (DTensor) state is saved to the persistent tier, and to the neighbours' memory
(tiers/shards.py), not to the machine's disk.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ... import __version__
from ...cluster import JOB_ID_ENV, NODE_LOCAL_DIR_ENV, ClusterInfo
from ...text import format_duration
from ...validate import NONE, expect_type, options
from ..commit.directory import (
    SHARED_FILE,
    list_files,
    manifest_problems,
    prune,
    rank_file,
    read_manifest,
    scan,
)
from ..commit.loader import load_verified
from ..commit.manifest import CheckpointError, CorruptCheckpointError, Manifest
from ..commit.protocol import committer_for, remove_crashed_saves
from ..commit.retention import RetentionPolicy
from ..commit.sharded import ShardedCheckpointer
from ..commit.stepwriter import StepWriter, state_bytes, write_torch_file
from ..progress import Progress
from ..schedule.coordination import Coordinator
from ..schedule.policies import PRIOR_MTBF_S, daly_interval, resolve_mtbf
from ..schedule.scheduler import SaveScheduler
from ..storage.base import RetryOptions, Storage, format_bytes
from ..storage.errors import StorageError, StorageFullError
from ..transport.channel import GroupTransport
from .plan import Plan, Report, carry_out, dumps_rank_state, plan
from .restored import Restored, RestoreRecord, bytes_read
from .tier import SaveRequest, TierDefaults

log = logging.getLogger(__name__)



AUTO = "auto"
MAX_PERSISTENT_EVERY = 1000   # Orbax's example ratio is 100 (every 10 and every 1,000)
OWNER = "owner"   # the manifest's metadata entry naming the run a copy belongs to
NO_OWNER = "no run (saved before node-local copies recorded their run)"


@options
@dataclass(frozen=True)
class NodeLocal:
    """Where and how often the node-local tier saves."""

    # None: $RESILIENT_TRAIN_NODE_LOCAL_DIR/checkpoints (set by resilient-train launch).
    directory: str | None = None
    # Every N-th save also goes to the persistent tier (1: every save goes to both);
    # "auto": N from the tiers' measured costs and the MTBF (persistent_every_auto).
    persistent_every: int | str = 10
    keep_last: int = 1        # committed steps kept on the machine

    def __post_init__(self) -> None:
        expect_type("NodeLocal.directory", self.directory, (str, NONE),
                    "a local path such as /dev/shm/ckpt or /mnt/localssd/ckpt, or None")
        for name in ("persistent_every", "keep_last"):
            v = getattr(self, name)
            if name == "persistent_every" and v == AUTO:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                also = ", or \"auto\"" if name == "persistent_every" else ""
                raise ValueError(f"NodeLocal.{name}={v!r}: expected a whole number >= 1{also}")
        if self.directory is not None and "://" in self.directory:
            raise ValueError(f"NodeLocal.directory={self.directory!r} is a URL: the node-local "
                             f"tier is the machine's own disk (a local path); the persistent "
                             f"tier is the checkpoint directory")

    def resolve(self, env: Mapping[str, str] | None = None) -> str:
        env = os.environ if env is None else env
        if self.directory:
            return self.directory
        base = env.get(NODE_LOCAL_DIR_ENV, "")
        if not base:
            raise ValueError(
                f"NodeLocal(directory=None) takes the machine's local disk from "
                f"{NODE_LOCAL_DIR_ENV}, which is not set (resilient-train launch sets it): "
                f"give NodeLocal(directory='/dev/shm/ckpt') or another path on a local disk")
        return os.path.join(base, "checkpoints")


def persistent_every_auto(local_s: float, persistent_s: float, interval_s: float,
                          mtbf_s: float, ceiling_s: float | None) -> int:
    """How many saves apart the persistent ones should be, from what the tiers cost.

    Every save writes the node-local tier (``local_s`` seconds on the writer thread); a
    persistent one writes storage too (``persistent_s`` more). The policy puts
    ``interval_s`` of training between two saves, and one save is in flight at a time, so
    a write longer than that makes the next save wait: a persistent save costs the loop
    ``C = max(0, local + persistent - interval) - max(0, local - interval)``. It is needed
    only where the faster tiers are gone (a new VM with no live peer, a job retry), and
    the persistent saves' own interval is then Young/Daly's optimum for that ``C`` and the
    job's MTBF (policy.daly_interval), in saves: ``K = daly(C, M) / interval``. A write
    that fits in the interval costs nothing, and K is 1. K is at most
    MAX_PERSISTENT_EVERY, and at most the saves in ``ceiling_s`` (the platform's 4 hours:
    the persistent copy, the one that outlives the VM, is what must be that fresh).
    """
    cost = max(0.0, local_s + persistent_s - interval_s) - max(0.0, local_s - interval_s)
    k = 1.0
    if cost > 0 and interval_s > 0:
        k = daly_interval(cost, mtbf_s) / interval_s
    if ceiling_s is not None and interval_s > 0:
        k = min(k, ceiling_s / interval_s)
    return int(min(max(1.0, round(k)), MAX_PERSISTENT_EVERY))


class PersistentCadence:
    """Which saves also go to the persistent tier: every ``NodeLocal.persistent_every``-th,
    or, with "auto", every K-th for the K of :func:`persistent_every_auto` on measured
    costs (the same on every rank: the scheduler agrees on them). Logs each change of K."""

    def __init__(self, options: NodeLocal, ceiling_s: float | None) -> None:
        self.fixed = options.persistent_every if options.persistent_every != AUTO else None
        self.ceiling_s = ceiling_s
        self.k = self.fixed or 1   # auto: the first save measures both tiers
        self.since = 0             # saves to the node-local tier only, since the last
        # Read once, and only for an automatic K: it may read the launcher's failure log.
        self._mtbf = resolve_mtbf() if self.fixed is None else (PRIOR_MTBF_S, "prior")

    def due_now(self, sched: SaveScheduler) -> bool:
        """Whether the save the scheduler just decided on goes to the persistent tier
        too, on what the ranks agreed: every save while a machine's disk fails."""
        if sched.shared_local_failing:
            return True
        mtbf = self._mtbf if sched.shared_mtbf is None else (sched.shared_mtbf, "observed")
        return self.due(*sched.shared_tier_s, sched.policy_interval, mtbf)

    def due(self, local_s: float | None, persistent_s: float | None,
            interval_s: float | None, mtbf: tuple[float, str]) -> bool:
        """Whether the next save goes to the persistent tier too."""
        if self.fixed is None and None not in (local_s, persistent_s, interval_s):
            assert local_s is not None and persistent_s is not None and interval_s is not None
            k = persistent_every_auto(local_s, persistent_s, interval_s, mtbf[0],
                                      self.ceiling_s)
            if k != self.k:
                log.info("node-local tier: %s goes to storage too (a storage write "
                         "takes %s, a node-local one %s, saves come every %s, mean time "
                         "between failures %s, %s)",
                         "every save" if k == 1 else f"every {k}{_nth(k)} save",
                         format_duration(persistent_s), format_duration(local_s),
                         format_duration(interval_s), format_duration(mtbf[0]), mtbf[1])
                self.k = k
        return self.since + 1 >= self.k

    def saved(self, persistent: bool) -> None:
        self.since = 0 if persistent else self.since + 1


def _nth(k: int) -> str:
    return "" if k == 1 else ("st" if k % 10 == 1 and k % 100 != 11 else
                              "nd" if k % 10 == 2 and k % 100 != 12 else
                              "rd" if k % 10 == 3 and k % 100 != 13 else "th")


def processes_on_this_machine() -> int:
    """How many training processes share this machine (``LOCAL_WORLD_SIZE``: torchrun's
    ``--nproc-per-node``); 1 where the environment does not say."""
    info = ClusterInfo.from_env_or_none()
    return 1 if info is None else info.local_world_size


def run_owner(checkpoint_url: str, env: Mapping[str, str] | None = None
              ) -> dict[str, str | None]:
    """Whose a node-local copy is, as its manifest records it: the run's checkpoint
    directory (normalized: one directory, one spelling) and its job id where there is one
    (the launcher's and the platform's, the same across a job's restarts and retries). A
    plain run has none: the same checkpoint directory is the same run, and a re-run of the
    script resumes from its copy as a restart does."""
    env = os.environ if env is None else env
    url = checkpoint_url.rstrip("/") if "://" in checkpoint_url \
        else os.path.realpath(checkpoint_url)
    return {"checkpoint_directory": url, "job_id": env.get(JOB_ID_ENV) or None}


def _whose(owner: object) -> str:
    """A copy's owner (its manifest's), as a warning names it."""
    if not isinstance(owner, Mapping):
        return NO_OWNER
    job = owner.get("job_id")
    return f"checkpoint directory {owner.get('checkpoint_directory')}" + \
        (f", job {job}" if job else "")


def partner_file(rank: int) -> str:
    """The copy of ``rank``'s per-rank state on the machine of the next rank of the ring."""
    return f"peer-rank{rank:05d}.pt"


# A partner's copy for a step: (the previous rank of the ring, its per-rank state), or None.
PartnerCopy = Callable[[int], "tuple[int, dict[str, Any]] | None"]


class LocalTier(TierDefaults):
    """This rank's node-local directory: its saves, its committed steps, its restore."""

    name = "node-local"

    def __init__(self, options: NodeLocal, coord: Coordinator, token: str,
                 sharded: ShardedCheckpointer, checkpoint_url: str, *,
                 newest: Callable[[], int | None], partner: PartnerCopy,
                 ceiling_s: float | None) -> None:
        self.options = options
        self.coord = coord
        rank, world_size = self.rank, self.world_size = coord.rank, coord.world_size
        self._newest = newest     # the persistent tier's newest committed step (a listing)
        self._partner = partner   # the ring's copy of the previous rank's state
        # Which saves go to the persistent tier too (the manager asks it before a save).
        self.cadence = PersistentCadence(options, ceiling_s)
        # Written into each copy's manifest; a copy that names another is not restored.
        self.owner = run_owner(checkpoint_url)
        self._named: set[str] = set()   # other runs' copies warned about already
        root = options.resolve()
        if world_size > 1 or processes_on_this_machine() > 1:
            # Ranks may share a directory (torchrun's processes on one machine, or one
            # path given to all): a directory each, or their saves of a step (same names,
            # same job token) would overwrite each other.
            root = os.path.join(root, f"rank{rank:05d}")
        self.storage = Storage(root, retry=RetryOptions())
        if not self.storage.is_local:
            raise ValueError(f"the node-local tier {self.storage.url} is not on a local disk")
        remove_crashed_saves(self.storage)   # only this rank writes here
        try:   # a typo or a disk that is not mounted fails now, not as a warning per save
            self.storage.check_writable()
        except StorageFullError:
            pass   # full now, maybe not later: each save says so and storage takes it
        except StorageError as exc:
            raise ValueError(
                f"cannot use {self.storage.url} for the node-local tier: {exc}. Give "
                f"NodeLocal(directory=...) a path on this machine's own disk that this "
                f"process can write (a local SSD's mount, /dev/shm/...)") from exc
        self.committer = committer_for(self.storage, token)
        self.writer = StepWriter(self.storage, sharded, rank=rank,
                                 files_atomic=self.committer.files_atomic)
        self._token = token
        self.read_bytes = 0
        # Saves failed in a row (a full or broken disk), and the kind of the last failure:
        # the first warns, the rest are counted until one works again (saved()).
        self.failing = 0
        self._failure_kind = ""

    @property
    def url(self) -> str:
        return self.storage.url

    # --- the tier interface (base.Tier) -------------------------------------------------

    def takes(self, save: SaveRequest) -> bool:
        return save.node_local and not save.sharded   # sharded: DCP writes to storage only

    def needs_shared(self, save: SaveRequest) -> bool:
        return True   # every machine's copy is complete

    def write(self, save: SaveRequest, snap: dict[str, Any],
              ready: Callable[[], None]) -> bool:
        ready()   # the snapshot's deferred copies (an overlapped snapshot)
        return self.save(save.step, snap, self._partner(save.step))

    def restore(self, sharded: bool) -> Restored | str:
        """From the machines' disks by plan (plan.py): the newest step, no older than the
        persistent tier's newest, that every rank can get from its own disk or another
        rank's; else why not."""
        coord = self.coord
        newest = coord.broadcast(self._newest() if self.rank == 0 else None)
        reports = coord.allgather(self.report(newest))
        bad: set[int] = set()
        while True:
            usable = [replace(r, replicated=tuple(s for s in r.replicated if s not in bad),
                              own=tuple(s for s in r.own if s not in bad),
                              held=tuple(s for s in r.held if s not in bad)) for r in reports]
            the_plan = plan(usable, where="on the machines' disks",
                            nothing="a fresh start, or every machine is new")
            if not isinstance(the_plan, Plan):
                if bad:   # what was there did not verify: say that, not "nothing there"
                    return (f"the node-local copy of step(s) "
                            f"{', '.join(map(str, sorted(bad)))} does not verify on some rank")
                return the_plan.reason
            holdings = None
            try:
                holdings = self.holdings(the_plan)
            except CorruptCheckpointError as exc:
                log.warning("node-local checkpoint of step %d does not verify: %s",
                            the_plan.step, exc)
            # Every rank's part verified, or this step is skipped by all (no transfer waits
            # on a rank that could not read its part).
            if coord.allreduce_max([0 if holdings else 1])[0] or holdings is None:
                bad.add(the_plan.step)
                continue
            got = carry_out(the_plan, holdings, self.rank,
                            GroupTransport(getattr(coord, "main_group", None)))
            break
        # Saves since the last persistent one, alike on every rank (they must all decide
        # alike which save goes to storage): the holder's, up to the restored step.
        since = sum(1 for s in reports[the_plan.holder].own
                    if s <= got.step and (newest is None or s > newest))
        record = RestoreRecord(
            step=got.step, source=self.name, seconds=0.0,
            bytes_read=bytes_read(node_local=self.read_bytes, peer=got.nbytes),
            from_rank=got.from_rank, where=self.url)
        machine = "" if got.from_rank is None else f" (rank {got.from_rank}'s machine)"
        return Restored(record, step=got.step, shared=got.shared, mine=got.mine,
                        last_commit=newest,
                        save_point=(got.step, holdings.created or time.time()),
                        message=f"restored checkpoint step {got.step} from the node-local "
                                f"tier{machine}", since_persistent=since)

    def restored(self, got: Restored) -> None:
        self.cadence.since = got.since_persistent

    # --- this machine's directory -------------------------------------------------------

    def write_step(self, step: int, snap: Mapping[str, Any],
                   partner: tuple[int, dict[str, Any]] | None = None) -> None:
        """Write and commit ``snap`` (``shared`` and ``rank``) as ``step``, with
        ``partner``'s (rank, per-rank state) when the ring gave one, then prune."""
        work = self.committer.work_dir(step)
        if self.committer.already_committed(work):
            return
        with self.committer.hold(work):
            try:
                files = self.writer.write(work, {k: snap[k] for k in ("shared", "rank")})
                if partner is not None:
                    name = partner_file(partner[0])
                    files[name] = write_torch_file(self.storage, f"{work}/{name}", partner[1],
                                                   atomic=self.committer.files_atomic)
                self.committer.commit(work, Manifest(
                    step=step, world_size=self.world_size, layout="replicated", files=files,
                    library=f"resilient-train {__version__}", metadata={OWNER: self.owner}))
            except BaseException:
                self.committer.discard(work, transient=True)
                raise
        prune(self.storage, RetentionPolicy(keep_last=self.options.keep_last),
              protect=self._token)

    def save(self, step: int, snap: Mapping[str, Any],
             partner: tuple[int, dict[str, Any]] | None = None) -> bool:
        """:meth:`write_step`, and whether it committed. A failure only warns: the scheduler
        then sends every save to the persistent tier too until a node-local one works
        again, so a full or broken disk never leaves the job with fewer checkpoints."""
        try:
            self.write_step(step, snap, partner)
        except Exception as exc:
            self._failed(step, exc, snap)
            return False
        if self.failing:
            log.warning("node-local checkpoint of step %d in %s committed, after %d failed "
                        "save(s): storage again takes only the saves that "
                        "NodeLocal.persistent_every asks for", step, self.url, self.failing)
        self.failing, self._failure_kind = 0, ""
        return True

    def _failed(self, step: int, exc: Exception, snap: Mapping[str, Any]) -> None:
        self.failing += 1
        full = isinstance(exc, StorageFullError)
        kind = type(exc).__name__ + "/" + type(exc.__cause__ or exc).__name__
        if kind == self._failure_kind:   # said already: one line per kind, not per save
            log.info("node-local checkpoint of step %d in %s failed again (%d in a row): %s",
                     step, self.url, self.failing, exc)
            return
        self._failure_kind = kind
        if full:
            assert isinstance(exc, StorageFullError)
            keep = self.options.keep_last
            why = (f"no space left: this save needs about {format_bytes(state_bytes(snap))} "
                   f"and {format_bytes(exc.free_bytes)} is free there (the tier keeps "
                   f"NodeLocal.keep_last={keep} committed step(s) beside the one being "
                   f"written). Give NodeLocal(directory=...) a disk with room for "
                   f"{keep + 1} saves, or free space there")
        else:
            why = str(exc)
        log.warning("node-local checkpoint of step %d in %s failed: %s. Until a node-local "
                    "save works again, every save goes to storage too", step, self.url, why)

    def report(self, persistent: int | None) -> Report:
        """What this machine holds, for the plan: this run's committed steps no older than
        the persistent tier's newest (``persistent``), with or without the partner's copy.
        Another run's copies are named (once) and left out."""
        owner_of = {partner_file(r): r for r in range(self.world_size) if r != self.rank}
        steps: list[int] = []
        partner: dict[int, int] = {}   # step -> whose copy it holds (the ring's previous rank)
        foreign: dict[str, list[int]] = {}   # whose -> their steps here
        for info in scan(self.storage, with_manifest=False):
            if not info.committed:
                continue
            try:   # the marker and the manifest, as scan(with_manifest=True) reads them
                manifest = read_manifest(self.storage, info.name, info.step)
            except CheckpointError:
                continue
            if manifest.metadata.get(OWNER) != self.owner:
                if info.name not in self._named:
                    self._named.add(info.name)
                    foreign.setdefault(_whose(manifest.metadata.get(OWNER)), []).append(
                        info.step)
                continue
            if persistent is not None and info.step < persistent:
                continue
            steps.append(info.step)
            partner.update((info.step, owner_of[f]) for f in manifest.files if f in owner_of)
        for whose, theirs in foreign.items():
            what = (f"it names {whose}, so it may be another run's (this one: "
                    f"{_whose(self.owner)}). Retention deletes it once this run has saved "
                    f"newer steps") if whose == NO_OWNER else (
                    f"it belongs to another run ({whose}), not to this one "
                    f"({_whose(self.owner)}). Give each run a node-local directory of its "
                    f"own (NodeLocal(directory=...)): runs that share one also prune each "
                    f"other's copies")
            log.warning("ignoring the node-local checkpoint of step%s %s in %s: %s",
                        "s" if len(theirs) > 1 else "", ", ".join(map(str, theirs)),
                        self.url, what)
        held_for = partner[max(partner)] if partner else None
        held = tuple(sorted(s for s, r in partner.items() if r == held_for))
        return Report(rank=self.rank, replicated=tuple(steps), own=tuple(steps),
                      held_for=held_for, held=held,
                      last_commit=persistent, save_point=(None, 0.0), why_not="")

    def holdings(self, the_plan: Plan) -> LocalHoldings:
        """Read and verify now what this rank gives in ``the_plan`` (so that a bad file
        is found before any rank waits on a transfer); raises CorruptCheckpointError."""
        self.read_bytes = 0
        step = the_plan.step
        gives_shared = self.rank not in the_plan.needs_state
        gives = [o for o, g in the_plan.rank_source.items() if g == self.rank]
        if not gives_shared and not gives:
            return LocalHoldings(step, None, {}, 0.0)   # a new machine: receives it all
        name = next(i.name for i in scan(self.storage, with_manifest=False)
                    if i.committed and i.step == step)
        manifest = read_manifest(self.storage, name, step)
        problems = manifest_problems(manifest, set(list_files(self.storage, name)),
                                     self.storage, name)
        if manifest.metadata.get(OWNER) != self.owner:   # replaced since the report
            problems.append(f"another run's copy ({_whose(manifest.metadata.get(OWNER))})")
        if problems:
            raise CorruptCheckpointError(f"{self.storage.url_of(name)}: " + "; ".join(problems))

        def load(fname: str) -> dict[str, Any]:
            self.read_bytes += manifest.files[fname].size
            return load_verified(self.storage, name, fname, manifest)

        files = ([SHARED_FILE] if gives_shared else []) + [
            rank_file(owner) if owner == self.rank else partner_file(owner)
            for owner, giver in the_plan.rank_source.items() if giver == self.rank]
        # Tens of GB from a local disk take a while too: the same lines as any restore.
        with Progress(f"rank {self.rank}: reading step {step} from {self.storage.url_of(name)}",
                      lambda: self.storage.bytes_moved, log=log,
                      total=sum(manifest.files[f].size for f in files)):
            shared = load(SHARED_FILE) if gives_shared else None
            states: dict[tuple[int, bool], bytes] = {}
            for owner, giver in the_plan.rank_source.items():
                if giver == self.rank:
                    own = owner == self.rank
                    tree = load(rank_file(owner) if own else partner_file(owner))
                    states[(owner, own)] = dumps_rank_state(tree)
        return LocalHoldings(step, shared, states, manifest.created)


@dataclass(frozen=True)
class LocalHoldings:
    """What this rank read from its disk for a plan (recovery_plan.Holdings)."""

    step: int
    shared_state: dict[str, Any] | None
    states: Mapping[tuple[int, bool], bytes]
    created: float

    where = "node-local disk"

    def shared(self, step: int) -> dict[str, Any]:
        assert step == self.step and self.shared_state is not None
        return self.shared_state

    def rank_state(self, rank: int, step: int, own: bool) -> bytes:
        return self.states[(rank, own)]
