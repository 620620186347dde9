"""SIGKILL a process while it saves checkpoints, at random instants, and check the commit
protocol (docs/design.md, "Commit protocols") held every time.

`tests/ckpt_workers/saver.py` is a warm parent (torch imported once) that forks a child per
run: the child restores the latest checkpoint like a restarted job, then saves every step
(sync or async, tensors of 1-8 MiB so that one save takes tens of milliseconds) while its
weights follow a known formula (`crash_model`: step k's weights are exactly base + k). The
parent SIGKILLs the child at the instant the test drew from a seeded RNG and reports where
the child was (restore / between saves / snapshot / writing data / manifest / marker /
commit / retention, from a shared memory page the child updates). Three such parents work
at the same time, each killing into its own share of the directories. An aimed kill
(``Aim``) is no instant: the child stops itself at the point aimed at and is killed there,
so the phases a test names are covered on every run, however loaded the machine.

After every kill, in the test process, with fresh objects:
  * ``restore_latest()`` returns None only if nothing was ever reported committed (and no
    committed step exists), else the newest committed step, whose weights and user values
    are exactly that step's;
  * every committed step verifies (``verify_step``: marker, manifest, sizes, checksums);
  * nothing reported committed is lost: the restored step is >= every step the children
    reported committed (retention may delete old steps, never the newest);
  * the next child restores the same step the test restored.

A directory's first kill may land before anything was committed; later kills into a
directory still empty count their instant from the run's first commit (``kill_once``).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from ckpt_workers import crash_model
from warm import WarmProcess

from resilient_train.checkpoint.commit.directory import scan, verify_step
from resilient_train.checkpoint.manager import CheckpointManager, CheckpointOptions
from resilient_train.checkpoint.storage.base import RetryOptions, Storage
from resilient_train.checkpoint.tiers.nodelocal import NodeLocal

pytestmark = pytest.mark.slow

SAVER = Path(__file__).parent / "ckpt_workers" / "saver.py"
FAST = RetryOptions(deadline_s=30.0, initial_s=0.01, max_wait_s=0.1)
ANSWER_LIMIT_S = 120.0
SEED = 20261129
MIB = 1 << 20


@dataclass(frozen=True)
class Config:
    async_save: bool
    numel: int           # float32 elements in the model (4 tensors)
    train_s: float       # simulated compute per step
    max_delay_s: float   # kill instants are uniform in [0, max_delay_s] after the restore
    node_local: bool = False   # every save to a node-local tier, every third to storage

    def describe(self) -> str:
        return (f"{'async' if self.async_save else 'sync'} {self.numel * 4 // MIB} MiB "
                f"train {self.train_s * 1000:.0f} ms")


# A save of 1 / 4 / 8 MiB takes about 20 / 40 / 70 ms on this machine's local disk (fsync
# included); the delays span several saves so kills land all across them.
LOCAL_CONFIGS = [
    Config(False, MIB // 4, 0.010, 0.20),
    Config(True, MIB // 4, 0.040, 0.25),
    Config(False, MIB, 0.003, 0.25),
    Config(True, MIB, 0.010, 0.25),
    Config(False, 2 * MIB, 0.0, 0.40),
    Config(True, 2 * MIB, 0.020, 0.40),
    Config(False, MIB // 4, 0.0, 0.15),
    Config(True, 2 * MIB, 0.0, 0.40),
    Config(False, MIB, 0.020, 0.25),
    Config(True, MIB // 4, 0.005, 0.20),
]
LOCAL_KILLS_PER_DIR = 10   # 10 directories x 10 kills = 100 kills

# Through gcsfs to the emulator: 1 and 1.5 MiB are single-request uploads; at 6 MiB
# shared.pt is above gcsfs's 5 MiB threshold and goes up as a resumable upload.
GCS_CONFIGS = [
    Config(False, MIB // 4, 0.005, 0.6),
    Config(True, (3 * MIB) // 8, 0.010, 0.6),
    Config(False, (3 * MIB) // 2, 0.0, 1.0),
]
GCS_KILLS_PER_BUCKET = 10  # 3 buckets x 10 kills = 30 kills

# A node-local tier beside a local persistent directory: kills land in either tier's write.
NODE_LOCAL_CONFIGS = [
    Config(False, MIB // 2, 0.005, 0.30, node_local=True),
    Config(True, MIB, 0.010, 0.30, node_local=True),
    Config(True, MIB // 4, 0.0, 0.20, node_local=True),
]


@dataclass(frozen=True)
class Aim:
    """A kill at a stop point of the saver (saver.STOP_POINTS), in a save of a step with
    ``step % mod == rem`` when ``step=(mod, rem)``: the child stops itself there."""

    point: str
    step: tuple[int, int] | None = None


# Every save goes to the node-local tier, every third (step % 3 == 0) to storage too. Each
# directory's kills cycle through: a random instant; in the node-local write of a step
# storage does not take (so the newest committed step is the previous one, on the node-local
# tier alone); in a file of the persistent write; just before the persistent commit's
# rename (the node-local tier committed that step first). Every directory (sync and async
# saves) gets each.
NODE_LOCAL_AIMS = (None, Aim("node-local", (3, 2)), Aim("data"), Aim("commit"))
NODE_LOCAL_KILLS_PER_DIR = 6   # 3 directories x 6 kills = 18 kills


# --- the worker ----------------------------------------------------------------------------


class Saver(WarmProcess):
    """The warm parent process; one JSON command in, one JSON answer out. ``wait_ready``
    waits for its imports (started first, several savers import torch at the same time)."""

    def __init__(self, log_path: Path) -> None:
        super().__init__(SAVER, log_path, "the saver",
                         env={"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"},
                         answer_limit_s=ANSWER_LIMIT_S)

    def run(self, **cmd: Any) -> dict[str, Any]:
        return self.request({"cmd": "run", **cmd})


# Warm parents killing into different directories at the same time: a kill costs mostly
# the wait for its instant and the checks after it, which overlap well (three GCS
# buckets: one each).
SAVERS = 3


@pytest.fixture(scope="module")
def savers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Saver]]:
    """The warm parents, shared by both tests (a saver keeps no state between runs)."""
    logs = tmp_path_factory.mktemp("savers")
    started = [Saver(logs / f"saver-{i}.log") for i in range(SAVERS)]
    try:
        for s in started:
            s.wait_ready()
        yield started
    finally:
        with ThreadPoolExecutor(len(started)) as pool:   # each takes a moment to exit
            list(pool.map(Saver.stop, started))


# --- the checks ------------------------------------------------------------------------------


@dataclass
class Directory:
    """One checkpoint directory, killed into over and over."""

    url: str
    storage_options: dict[str, Any] | None
    config: Config
    work: Path                   # report and error files (and the node-local tier)
    restored: int | None = None  # what the test restored after the last kill
    runs: int = 0

    @property
    def report(self) -> Path:
        return self.work / "committed.txt"

    @property
    def node_local(self) -> str | None:
        return str(self.work / "node-local") if self.config.node_local else None

    @property
    def errors(self) -> Path:
        return self.work / "child-errors.txt"

    def reported(self) -> tuple[list[int], list[str]]:
        committed, restored = [], []
        if self.report.exists():
            for line in self.report.read_text().splitlines():
                kind, _, value = line.partition(" ")
                if kind == "committed":
                    committed.append(int(value))
                elif kind == "restored":
                    restored.append(value)
        return committed, restored


def kill_once(saver: Saver, d: Directory, delay: float, aim: Aim | None = None
              ) -> dict[str, Any]:
    """One run killed ``delay`` seconds into its loop (with ``aim``: where the child stops
    itself at that point, the first time after the delay). Into a directory that is still
    empty after a first kill, the delay counts from the run's first commit: on a loaded
    machine a save can outlast every delay drawn, and each run was killed before it
    committed anything, leaving nothing for the checks to restore. A first kill still may
    land before any commit, and checks that a restore then finds nothing."""
    d.work.mkdir(parents=True, exist_ok=True)
    answer = saver.run(url=d.url, storage_options=d.storage_options,
                       async_save=d.config.async_save, numel=d.config.numel,
                       train_s=d.config.train_s, keep_last=2, report=str(d.report),
                       error_file=str(d.errors), kill_after_s=delay,
                       node_local=d.node_local, kill_in=aim and aim.point,
                       kill_in_step=aim and aim.step,
                       from_first_commit=d.restored is None and d.runs > 0)
    d.runs += 1
    errors = d.errors.read_text() if d.errors.exists() else ""
    assert answer["signal"] == 9 and not answer["died_early"], (
        f"the child was not killed by us: {answer}\nchild errors:\n{errors}\n"
        f"saver log:\n{saver.log()}")
    assert aim is None or answer["hit"], (
        f"the child never reached {aim} within the saver's AIM_LIMIT_S: {answer}\n"
        f"saver log:\n{saver.log()}")
    check_directory(d)
    answer["delay_s"] = delay
    answer["aimed"] = aim
    answer["kill"] = d.runs - 1   # this directory's n-th kill
    answer["restored_after"] = d.restored
    return answer


def check_directory(d: Directory) -> None:
    numel = d.config.numel
    committed_reports, restored_reports = d.reported()
    # The child restored what the test restored after the previous kill.
    assert len(restored_reports) == d.runs, restored_reports
    assert restored_reports[-1] == ("none" if d.restored is None else str(d.restored))

    model = crash_model.build(numel, fill=float("nan"))  # a restore must overwrite all of it
    mgr = CheckpointManager(d.url, options=CheckpointOptions(
        retry=FAST, storage_options=d.storage_options, async_save=False,
        node_local=NodeLocal(directory=d.node_local, keep_last=2) if d.node_local else None))
    try:
        mgr.track(model=model)
        restored = mgr.restore_latest()
        tiers = [mgr.storage] + ([Storage(d.node_local)] if d.node_local else [])
        committed = []
        for storage in tiers:   # every committed step of every tier verifies
            for info in scan(storage):
                if not info.committed:
                    continue
                committed.append(info)
                checked = verify_step(storage, info)
                assert checked.ok, (f"committed step {info.name} in {storage.url} does not "
                                    f"verify: {checked.problems}")
        if restored is None:
            assert not committed and not committed_reports, (committed, committed_reports)
        else:
            assert restored == max(i.step for i in committed)
            problem = crash_model.mismatch(model, numel, restored)
            assert problem is None, problem
            assert mgr.values == crash_model.values_of(restored)
            assert restored >= max(committed_reports, default=0), (
                f"step {max(committed_reports)} was reported committed, the latest is "
                f"{restored}")
    finally:
        mgr.close()
    d.restored = restored


def where(answer: dict[str, Any]) -> str:
    """'between saves' or 'mid-save: <phase>' (or 'restore': the child's own start)."""
    if answer["writer"] not in ("idle",):
        return f"mid-save: {answer['writer']}"
    if answer["main"] == "save":
        return "mid-save: snapshot or waiting for the previous save"
    if answer["main"] == "train":
        return "between saves"
    return answer["main"]


def summarise(title: str, answers: list[dict[str, Any]], dirs: list[Directory]) -> Counter[str]:
    places = Counter(where(a) for a in answers)
    mid = sum(n for k, n in places.items() if k.startswith("mid-save"))
    lines = [(f"{title}: {len(answers)} kills, {mid} mid-save, {places['between saves']} "
              f"between saves")]
    lines += [f"  {n:4d}  {k}" for k, n in sorted(places.items())]
    nothing = sum(1 for a in answers if a["last_committed"] < 0)
    empty = sum(1 for a in answers if a["restored_after"] is None)
    lines.append(f"  kills before that run's first commit: {nothing}; kills after which the "
                 f"directory had no commit yet: {empty}; steps restored at the end: "
                 f"{[d.restored for d in dirs]}")
    print("\n".join(lines))
    return places


def crash_loop(savers: list[Saver], dirs: list[Directory], kills_per_dir: int, seed: int,
               aims: tuple[Aim | None, ...] = (None,)) -> list[dict[str, Any]]:
    """``kills_per_dir`` kills into each directory, one after the other (each starts from
    what the previous left); the directories are shared out among the savers, which work
    at the same time. The kill instants are drawn first, directory by directory, so they
    depend on the seed alone. A directory's k-th kill is aimed at ``aims[k % len(aims)]``
    (None: the random instant alone): a short phase that random instants can all miss is
    still covered in every run. Answers come back in that order."""
    rng = random.Random(seed)
    delays = [[rng.uniform(0.0, d.config.max_delay_s) for _ in range(kills_per_dir)]
              for d in dirs]

    def aimed(k: int) -> Aim | None:
        return aims[k % len(aims)]

    def one_saver(i: int) -> dict[int, list[dict[str, Any]]]:
        return {j: [kill_once(savers[i], dirs[j], delay, aimed(k))
                    for k, delay in enumerate(delays[j])]
                for j in range(i, len(dirs), len(savers))}

    by_dir: dict[int, list[dict[str, Any]]] = {}
    with ThreadPoolExecutor(len(savers)) as pool:
        for done in pool.map(one_saver, range(len(savers))):  # re-raises a failed check
            by_dir.update(done)
    return [a for j in range(len(dirs)) for a in by_dir[j]]


def test_sigkill_during_saves_local_disk(savers: list[Saver], tmp_path: Path) -> None:
    dirs = [Directory(str(tmp_path / f"ckpt-{i}"), None, c, tmp_path / f"work-{i}")
            for i, c in enumerate(LOCAL_CONFIGS)]
    answers = crash_loop(savers, dirs, LOCAL_KILLS_PER_DIR, SEED)
    places = summarise("local disk", answers, dirs)
    assert len(answers) == 100
    # The kills really spread over the save: most land inside one, some between saves,
    # and across its stages, not all in one.
    mid = sum(n for k, n in places.items() if k.startswith("mid-save"))
    assert mid >= 50 and places["between saves"] >= 3, places
    assert places["mid-save: data"] >= 20, places
    assert sum(n for k, n in places.items()
               if k.split(": ")[-1] in ("manifest", "marker", "commit", "retention")) >= 3
    # Not vacuous: after most kills there was a commit to restore and check.
    assert sum(a["restored_after"] is not None for a in answers) >= 50
    assert sum(d.restored is not None for d in dirs) >= 8, [d.restored for d in dirs]


def test_sigkill_during_saves_with_a_node_local_tier(savers: list[Saver],
                                                     tmp_path: Path) -> None:
    """Kills in the node-local tier's write as well as in the persistent one's: neither
    tier ever holds a torn step that a restore would pick, and the restore takes the
    newest step of either (the machine's disk usually, as a restart in place does)."""
    dirs = [Directory(str(tmp_path / f"ckpt-{i}"), None, c, tmp_path / f"work-{i}")
            for i, c in enumerate(NODE_LOCAL_CONFIGS)]
    answers = crash_loop(savers, dirs, NODE_LOCAL_KILLS_PER_DIR, SEED + 2,
                         aims=NODE_LOCAL_AIMS)
    places = summarise("node-local tier + local disk", answers, dirs)
    assert len(answers) == len(dirs) * NODE_LOCAL_KILLS_PER_DIR
    aimed = [a for a in answers if a["aimed"] is not None]
    # Each phase is covered on every run: every aimed kill landed where it was aimed
    # (kill_once checked that the child stopped there), whatever the load.
    missed = [a for a in aimed if where(a) != f"mid-save: {a['aimed'].point}"]
    assert not missed, missed
    assert {where(a) for a in aimed} == {"mid-save: node-local", "mid-save: data",
                                         "mid-save: commit"}, places
    for a in aimed:
        step = a["writing_step"]
        if a["aimed"].point == "node-local":
            # The node-local tier served the restore: the step before, which storage never
            # got (every third step goes there), and nothing newer is committed anywhere.
            assert step % 3 == 2 and a["restored_after"] == step - 1, a
        else:
            # Storage's write of the step was cut; the node-local tier had committed it.
            assert step % 3 == 0 and a["restored_after"] == step, a
    # Not vacuous: after every kill but a directory's first there was a commit to restore
    # and check (kill_once counts those kills from the run's first commit).
    assert all(a["restored_after"] is not None for a in answers if a["kill"]), \
        [a["restored_after"] for a in answers]


def test_sigkill_during_saves_gcs_emulator(savers: list[Saver], tmp_path: Path,
                                           gcs_server: Any) -> None:
    options = {"endpoint_url": gcs_server.endpoint, "token": "anon"}
    dirs = [Directory(f"gs://{gcs_server.create_bucket()}/run", options, c,
                      tmp_path / f"work-{i}") for i, c in enumerate(GCS_CONFIGS)]
    answers = crash_loop(savers, dirs, GCS_KILLS_PER_BUCKET, SEED + 1)
    places = summarise("GCS emulator", answers, dirs)
    assert len(answers) == 30
    mid = sum(n for k, n in places.items() if k.startswith("mid-save"))
    assert mid >= 15, places
    assert sum(a["restored_after"] is not None for a in answers) >= 15
