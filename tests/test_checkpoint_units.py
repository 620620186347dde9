"""Save policy, retention, manifest and the `checkpoints` CLI (local disk, real files)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from resilient_train.checkpoint.commit.directory import DEL_PREFIX, DELETING_PREFIX, TMP_PREFIX
from resilient_train.checkpoint.commit.manifest import (
    CorruptCheckpointError,
    FileEntry,
    Manifest,
    check_marker,
    crc32c,
    marker_bytes,
    parse_step,
    step_dirname,
)
from resilient_train.checkpoint.commit.protocol import committer_for
from resilient_train.checkpoint.commit.retention import CommittedStep, RetentionPolicy, to_delete
from resilient_train.checkpoint.manager import CheckpointManager, CheckpointOptions
from resilient_train.checkpoint.schedule.policies import (
    FOUR_HOURS,
    SaveContext,
    default_save_policy,
    every,
    every_n_steps,
    never,
)
from resilient_train.checkpoint.storage.base import Storage
from resilient_train.cli import main as cli


def ctx(step: int, now: float = 0.0, last_step: int | None = None, last_time: float = 0.0
        ) -> SaveContext:
    return SaveContext(step, now, last_step, last_time)


# --- when to save -------------------------------------------------------------------------

def test_every_n_steps_saves_on_multiples_once() -> None:
    p = every_n_steps(10)
    assert [s for s in range(1, 35) if p.should_save(ctx(s))] == [10, 20, 30]
    assert not p.should_save(ctx(20, last_step=20))      # already saved this step


def test_every_saves_at_most_the_interval_after_the_last_commit() -> None:
    p = every(60)
    assert not p.should_save(ctx(5, now=59.9, last_time=0))
    assert p.should_save(ctx(5, now=60, last_time=0))
    assert not p.should_save(ctx(5, now=60, last_step=5, last_time=0))


def test_or_and_compose_like_tenacity() -> None:
    p = every_n_steps(100) | every(3600)
    assert p.should_save(ctx(100, now=1))                 # steps first
    assert p.should_save(ctx(7, now=3600))                # time first
    assert not p.should_save(ctx(7, now=10))
    both = every_n_steps(2) & every(10)
    assert not both.should_save(ctx(2, now=5)) and both.should_save(ctx(4, now=10))
    assert not never().should_save(ctx(100, now=1e9))


def test_default_policy_is_steps_or_four_hours() -> None:
    p = default_save_policy(500)
    assert p.should_save(ctx(500)) and p.should_save(ctx(3, now=FOUR_HOURS))
    assert not p.should_save(ctx(3, now=FOUR_HOURS - 1))
    assert default_save_policy().should_save(ctx(3, now=FOUR_HOURS))
    with pytest.raises(ValueError, match="n >= 1"):
        every_n_steps(0)
    with pytest.raises(ValueError, match="positive"):
        every(0)


# --- what to keep -------------------------------------------------------------------------

def gone(committed: list[CommittedStep], policy: RetentionPolicy) -> list[int]:
    return [c.step for c in to_delete(committed, policy)]


def test_retention_counts_only_usable_steps() -> None:
    bad = CommittedStep(6, 6.0, usable=False, name="step-6")
    good = [CommittedStep(n, float(n), name=f"step-{n}") for n in (2, 4, 5)]
    # The broken newest step does not count and stays (newer than every usable one).
    assert gone([*good, bad], RetentionPolicy(keep_last=1)) == [2, 4]
    # Once a usable step as new exists (object stores keep both directories), it goes.
    redo = CommittedStep(6, 7.0, name="step-6-a1b2")
    assert [c.name for c in to_delete([*good, bad, redo], RetentionPolicy(keep_last=1))] == [
        "step-2", "step-4", "step-5", "step-6"]
    assert gone([bad], RetentionPolicy(keep_last=1)) == []   # nothing usable: keep it


def steps(*numbers: int) -> list[CommittedStep]:
    return [CommittedStep(n, float(n)) for n in numbers]


def test_retention_keeps_the_last_k() -> None:
    assert gone(steps(1, 2, 3, 4, 5), RetentionPolicy(keep_last=3)) == [1, 2]
    assert gone(steps(7), RetentionPolicy(keep_last=1)) == []
    with pytest.raises(ValueError, match="one committed step always stays"):
        RetentionPolicy(keep_last=0)


def test_retention_keeps_step_and_time_milestones_forever() -> None:
    policy = RetentionPolicy(keep_last=1, milestone_every_steps=100)
    assert gone(steps(50, 100, 150, 200, 250), policy) == [50, 150]
    timed = RetentionPolicy(keep_last=1, milestone_every_seconds=100)
    # commits at t=10, 20 (same window), 110, 120 (next window), 130: the first of each stays
    commits = [CommittedStep(s, t) for s, t in [(1, 10), (2, 20), (3, 110), (4, 120), (5, 130)]]
    assert gone(commits, timed) == [2, 4]


# --- manifest -----------------------------------------------------------------------------

def test_step_names_round_trip() -> None:
    assert step_dirname(1200) == "step-000000001200"
    assert parse_step("step-000000001200") == 1200
    assert parse_step("step-000000001200-0a1b2c3d") == 1200
    assert parse_step("gs://b/p/step-000000001200/") == 1200
    assert parse_step("step-12") is None and parse_step("notes.txt") is None
    with pytest.raises(ValueError):
        step_dirname(-1)


def test_manifest_and_marker_detect_tampering() -> None:
    m = Manifest(step=3, world_size=2, layout="replicated",
                 files={"shared.pt": FileEntry(10, "abcd1234")}, metadata={"lr": 0.1})
    data = m.to_bytes()
    again = Manifest.from_bytes(data, "x")
    assert again.files == m.files and again.metadata == {"lr": 0.1}
    marker = marker_bytes(data, 3)
    check_marker(marker, data, 3, "x")
    with pytest.raises(CorruptCheckpointError, match="does not match the manifest"):
        check_marker(marker, data.replace(b"abcd1234", b"abcd1235"), 3, "x")
    with pytest.raises(CorruptCheckpointError, match="does not match"):
        check_marker(marker, data, 4, "x")
    with pytest.raises(CorruptCheckpointError, match="unreadable"):
        Manifest.from_bytes(b"{not json", "x")


# --- the CLI ------------------------------------------------------------------------------

def saved_dir(tmp_path: Path, n_steps: int = 4) -> Path:
    directory = tmp_path / "ckpt"
    model = torch.nn.Linear(3, 2)
    with CheckpointManager(directory, options=CheckpointOptions(
            save_every_steps=1, async_save=False)) as mgr:
        mgr.track(model=model)
        for step in range(1, n_steps + 1):
            mgr.maybe_save(step)
    return directory


def test_cli_list_verify_and_prune(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = saved_dir(tmp_path)          # retention keeps the last 3: steps 2, 3, 4
    assert cli.main(["checkpoints", "list", str(directory), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in listed] == [2, 3, 4] and all(r["ok"] for r in listed)

    assert cli.main(["checkpoints", "verify", str(directory)]) == 0
    assert capsys.readouterr().out.count(" ok ") == 3

    shard = directory / step_dirname(3) / "shared.pt"
    os.truncate(shard, 100)          # list sees a truncated file without reading it
    assert cli.main(["checkpoints", "list", str(directory)]) == 0
    assert "is 100 bytes, the manifest says" in capsys.readouterr().out
    shutil.rmtree(directory / step_dirname(3))

    shard = directory / step_dirname(4) / "shared.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF                        # a flipped byte, same size
    shard.write_bytes(bytes(data))
    assert cli.main(["checkpoints", "verify", str(directory)]) == 1
    out = capsys.readouterr().out
    assert "CORRUPT" in out and "checksum mismatch" in out

    # The corrupt step 4 does not count as the one to keep: step 2 is kept with it.
    assert cli.main(["checkpoints", "prune", str(directory), "--keep-last", "1",
                     "--dry-run"]) == 0
    assert "would delete 0: nothing" in capsys.readouterr().out
    assert sorted(p.name for p in directory.iterdir()) == [step_dirname(s) for s in (2, 4)]
    assert cli.main(["checkpoints", "prune", str(directory), "--keep-last", "1"]) == 0
    assert sorted(p.name for p in directory.iterdir()) == [step_dirname(s) for s in (2, 4)]


def test_cli_finds_a_launcher_jobs_checkpoints_from_its_job_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job_dir = tmp_path / "rt-jobs" / "run-1"
    output = tmp_path / "elsewhere"          # --output-dir: not under the job directory
    (output / "checkpoints").parent.mkdir(parents=True)
    saved_dir(tmp_path).rename(output / "checkpoints")
    job_dir.mkdir(parents=True)
    (job_dir / "job.json").write_text(json.dumps(
        {"name": "run-1", "job_spec": {"base_output_directory": str(output)}}))
    assert cli.main(["checkpoints", "list", str(job_dir), "--json"]) == 0
    captured = capsys.readouterr()
    assert [r["step"] for r in json.loads(captured.out)] == [2, 3, 4]
    assert f"its checkpoints are in {output}/checkpoints" in captured.err


def test_cli_lists_and_verifies_a_jobs_node_local_tiers_too(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A launcher job with rt.NodeLocal: each replica's machine's disk is a tier of its own
    (a machine of several processes: one directory per rank), and a corrupt copy there,
    which a restore skips, fails verify, naming the replica."""
    job_dir = tmp_path / "job"
    (job_dir / "output").mkdir(parents=True)
    saved_dir(tmp_path / "persistent").rename(job_dir / "output" / "checkpoints")
    (job_dir / "job.json").write_text(json.dumps(
        {"name": "job", "job_spec": {"base_output_directory": str(job_dir / "output")}}))
    machines = job_dir / "machines"
    for where in ("workerpool0-0/vm/local/checkpoints",
                  "workerpool1-0/vm/local/checkpoints/rank00001"):
        (machines / where).parent.mkdir(parents=True, exist_ok=True)
        saved_dir(tmp_path / where.replace("/", "-")).rename(machines / where)
    (machines / "workerpool1-1" / "vm" / "local").mkdir(parents=True)   # wiped: nothing

    assert cli.main(["checkpoints", "list", str(job_dir), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["tier"], r["replica"], r["step"]) for r in rows] == [
        ("persistent", None, s) for s in (2, 3, 4)] + [
        ("node-local", "workerpool0-0", s) for s in (2, 3, 4)] + [
        ("node-local", "workerpool1-0 rank00001", s) for s in (2, 3, 4)]

    shard = machines / "workerpool0-0/vm/local/checkpoints" / step_dirname(4) / "shared.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert cli.main(["checkpoints", "verify", str(job_dir)]) == 1
    out = capsys.readouterr().out
    tiers = out.split("\nnode-local tier of ")
    assert len(tiers) == 3 and "CORRUPT" not in tiers[0] and "CORRUPT" not in tiers[2]
    assert tiers[1].startswith(f"workerpool0-0: {machines}/workerpool0-0/vm/local/checkpoints")
    assert "CORRUPT" in tiers[1] and "checksum mismatch" in tiers[1]
    # prune is the persistent tier's alone: the library keeps the node-local count.
    assert cli.main(["checkpoints", "prune", str(job_dir), "--keep-last", "1"]) == 0
    capsys.readouterr()
    assert len(list((machines / "workerpool0-0/vm/local/checkpoints").iterdir())) == 3


@pytest.mark.parametrize("action", ["list", "verify", "prune"])
def test_cli_on_a_path_that_is_not_there_is_an_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], action: str) -> None:
    # "no checkpoints" with exit 0 for a typo in the path would hide the mistake.
    assert cli.main(["checkpoints", action, str(tmp_path / "typo")]) == 2
    assert "typo does not exist" in capsys.readouterr().err


def test_cli_verify_of_a_missing_step_is_a_usage_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = saved_dir(tmp_path, 1)
    assert cli.main(["checkpoints", "verify", str(directory), "--step", "99"]) == 2
    assert "no step 99" in capsys.readouterr().err


def test_prune_removes_a_linked_step_and_never_deletes_through_a_link(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A step directory linked in from another run, and a file of a step linked to a copy
    elsewhere: retention (the same prune) removes the links, never what they point to."""
    other = saved_dir(tmp_path / "other", 1)                     # its step 1
    directory = saved_dir(tmp_path / "this")                     # steps 2, 3, 4
    os.symlink(f"../../other/ckpt/{step_dirname(1)}", directory / step_dirname(1))
    outside = tmp_path / "outside"
    outside.mkdir()
    shard = directory / step_dirname(2) / "shared.pt"
    data = shard.read_bytes()
    shard.rename(outside / "shared.pt")
    os.symlink(outside / "shared.pt", shard)
    assert cli.main(["checkpoints", "verify", str(directory)]) == 0   # through the links
    assert capsys.readouterr().out.count(" ok ") == 4

    assert cli.main(["checkpoints", "prune", str(directory), "--keep-last", "1"]) == 0
    assert "deleted 3:" in capsys.readouterr().out
    assert os.listdir(directory) == [step_dirname(4)]
    assert (other / step_dirname(1) / "COMMITTED").is_file()
    assert cli.main(["checkpoints", "verify", str(other)]) == 0       # still committed
    assert capsys.readouterr().out.count(" ok ") == 1
    assert (outside / "shared.pt").read_bytes() == data


def _commit(storage: Storage, step: int, token: str) -> str:
    committer = committer_for(storage, token)
    work = committer.work_dir(step)
    data = f"weights of step {step}".encode()
    storage.write_bytes(f"{work}/data.bin", data)
    return committer.commit(work, Manifest(step=step, world_size=1, layout="replicated",
                                           files={"data.bin": FileEntry(len(data),
                                                                        crc32c(data))}))


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_verify_names_debris_without_failing_and_prune_removes_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str) -> None:
    """Leftovers of deletes and saves that were interrupted are debris, not damage: verify
    exits 0 and says how to remove them; a committed step that does not verify still
    fails it."""
    url = str(tmp_path / "c") if kind == "local" else f"memory://rt-{tmp_path.name}/c"
    storage = Storage(url)
    names = {step: _commit(storage, step, "0a0a0a0a") for step in (3, 4, 5)}
    if kind == "local":
        debris = [
            f"{DEL_PREFIX}{step_dirname(2)}-0badf00d",          # renamed, then killed
            f"{TMP_PREFIX}{step_dirname(3)}-deadbeef",          # a save that crashed
            step_dirname(1),   # an older version's delete: the marker went first
        ]
        for name in debris:
            storage.write_bytes(f"{name}/data.bin", b"left behind")
    else:
        half = f"{step_dirname(1)}-0a0a0a0a"          # an interrupted delete: no marker
        storage.write_bytes(f"{half}/data.bin", b"left behind")
        storage.write_bytes(f"{DELETING_PREFIX}{half}", b"{}")
        gone = f"{DELETING_PREFIX}{step_dirname(2)}-0a0a0a0a"   # only its record left
        storage.write_bytes(gone, b"{}")
        crashed = f"{step_dirname(2)}-0b0b0b0b"       # a save that crashed, no record
        storage.write_bytes(f"{crashed}/data.bin", b"left behind")
        debris = [half, gone, crashed]

    assert cli.main(["checkpoints", "verify", url]) == 0
    out = capsys.readouterr().out
    for name in debris:
        (line,) = [line for line in out.splitlines() if line.endswith(name)]
        assert "debris" in line, out
    assert out.count(f"resilient-train checkpoints prune {url}") == len(debris), out
    assert cli.main(["checkpoints", "list", url, "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert {n for n, r in rows.items() if r["debris"]} == set(debris)

    storage.write_bytes(f"{names[5]}/data.bin", b"weights of step 9")   # same size
    assert cli.main(["checkpoints", "verify", url]) == 1               # real damage
    out = capsys.readouterr().out
    assert "CORRUPT" in out and "checksum mismatch" in out
    assert cli.main(["checkpoints", "prune", url, "--keep-last", "3"]) == 0
    assert capsys.readouterr().out.startswith(f"deleted {len(debris)}:")
    assert storage.listdir("") == sorted(names.values())


def test_a_blocking_save_of_a_meta_tensor_is_a_clear_error(tmp_path: Path) -> None:
    # Blocking saves of state off the CPU go through the host snapshot, which names the
    # tensor that cannot be saved (torch.save would write a meta tensor without data).
    model = torch.nn.Linear(2, 2, device="meta")
    with CheckpointManager(tmp_path, options=CheckpointOptions(async_save=False)) as mgr:
        mgr.track(model=model)
        with pytest.raises(TypeError, match=r"meta tensor .*materialise the module"):
            mgr.save(1)
    assert not list(tmp_path.glob("step-*"))


def test_a_compiled_model_checkpoint_loads_into_the_plain_model(tmp_path: Path) -> None:
    """track() keeps the module under torch.compile (and DDP): the file holds the model's
    own keys, so a run with compile off (or on) resumes from a run with it on (or off)."""
    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with CheckpointManager(tmp_path, options=CheckpointOptions(async_save=False)) as mgr:
        mgr.track(model=torch.compile(src))
        mgr.save(1)
    keys = set(torch.load(tmp_path / "step-000000000001" / "shared.pt",
                          weights_only=True)["model"])
    assert keys == {"0.weight", "0.bias", "2.weight", "2.bias"}
    dst = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with CheckpointManager(tmp_path, options=CheckpointOptions(async_save=False)) as mgr:
        mgr.track(model=dst)
        assert mgr.restore_latest() == 1
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k


def test_a_restore_leaves_no_gradient_behind(tmp_path: Path) -> None:
    """A restore puts back a step boundary, as a new process has it: no gradient. One left
    by a step that failed halfway would be added to the next step's where the loop zeroes
    gradients after opt.step() and the same model is trained on."""
    model = torch.nn.Linear(3, 2)
    extra = torch.nn.Parameter(torch.ones(2))   # in the optimizer, not in the model
    opt = torch.optim.SGD([*model.parameters(), extra], lr=0.1)
    with CheckpointManager(tmp_path, options=CheckpointOptions(async_save=False)) as mgr:
        mgr.track(model=model, optimizer=opt)
        assert mgr.restore_latest() is None
        (model(torch.ones(1, 3)).sum() + extra.sum()).backward()
        mgr.save(1)
        # Nothing restored, nothing dropped; restored, every gradient is gone.
        assert all(p.grad is not None for p in [*model.parameters(), extra])
        assert mgr.restore_latest() == 1
    assert all(p.grad is None for p in [*model.parameters(), extra])


def test_a_fresh_start_on_the_last_lifes_trained_objects_is_refused(tmp_path: Path) -> None:
    """A life after a peer's loss that finds nothing to restore while it trains the last
    life's model and optimizer on (built outside the training function) exits transient,
    naming them: a new process would start from new ones. Objects of the last life that
    are gone, or alive but not tracked again, or that had not trained, or a restore that
    finds a step: no exit."""
    import gc
    import weakref

    from resilient_train.checkpoint.tiers.peers import PeerMemory
    from resilient_train.errors import TransientError

    def life(memory: PeerMemory, model: torch.nn.Module, where: Path) -> int | None:
        opts = CheckpointOptions(async_save=False, peer_recovery=False)
        with CheckpointManager(where, options=opts, peer_memory=memory) as mgr:
            mgr.track(model=model)
            return mgr.restore_latest()

    kept = torch.nn.Linear(2, 2)
    memory = PeerMemory(owners=[weakref.ref(kept)], owners_trained=True)
    with pytest.raises(TransientError, match=r"rank 0: nothing to restore after a peer's "
                       r"loss \(.* has no checkpoint\), and this life trains the last "
                       r"life's Linear on \(built outside the training function\)"):
        life(memory, kept, tmp_path / "empty")
    assert life(memory, kept, tmp_path / "empty") is None   # said once per hand-over

    untrained = PeerMemory(owners=[weakref.ref(kept)], owners_trained=False)
    assert life(untrained, kept, tmp_path / "empty") is None
    elsewhere = PeerMemory(owners=[weakref.ref(kept)], owners_trained=True)
    assert life(elsewhere, torch.nn.Linear(2, 2), tmp_path / "empty") is None
    gone = torch.nn.Linear(2, 2)
    dead = PeerMemory(owners=[weakref.ref(gone)], owners_trained=True)
    del gone
    gc.collect()
    assert life(dead, torch.nn.Linear(2, 2), tmp_path / "empty") is None
    with CheckpointManager(tmp_path / "saved", options=CheckpointOptions(
            async_save=False)) as mgr:
        mgr.track(model=kept)
        mgr.save(3)
    restored = PeerMemory(owners=[weakref.ref(kept)], owners_trained=True)
    assert life(restored, kept, tmp_path / "saved") == 3


def test_a_restore_forgets_a_gradscaler_step_half_done(tmp_path: Path) -> None:
    """A step that failed after scaler.unscale_() (in the ring exchange before opt.step(),
    when a peer is lost there) left a GradScaler kept across lives refusing the next
    unscale_(): the job FAILED with torch's RuntimeError. A restore forgets the step."""
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    with CheckpointManager(tmp_path, options=CheckpointOptions(async_save=False)) as mgr:
        mgr.track(model=model, optimizer=opt, scaler=scaler)
        mgr.save(1)
        scaler.scale(model(torch.ones(2, 3)).sum()).backward()
        scaler.unscale_(opt)   # then the failure, before scaler.step() and update()
        with pytest.raises(RuntimeError, match="unscale_"):
            scaler.unscale_(opt)
        assert mgr.restore_latest() == 1
    before = model.weight.detach().clone()
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    scaler.unscale_(opt)   # the next life's step, as the script makes it
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(model.weight, before)   # the step ran


def test_a_sharded_model_kept_across_lives_exits_transient_before_the_code_runs(
        tmp_path: Path) -> None:
    """A model sharded with FSDP2 and kept across lives (built outside the training
    function) is bound to the process group a peer's loss ended; the next life's
    fully_shard() failed with torch's "can only be applied to a module once", exit 1, and
    the job FAILED. The life now exits transient as it begins, saying why (the job retry
    restores from the last checkpoint); a plain module kept alive is not refused."""
    import weakref

    from resilient_train.checkpoint.tiers.peers import PeerMemory
    from resilient_train.errors import TransientError

    class DTensor(torch.Tensor):   # stands in for torch.distributed.tensor.DTensor
        pass

    sharded = torch.nn.Linear(2, 2)
    sharded.weight = torch.nn.Parameter(torch.zeros(2, 2).as_subclass(DTensor))
    plain = torch.nn.Linear(2, 2)
    opts = CheckpointOptions(async_save=False, peer_recovery=False)
    for kept, refused in ((sharded, True), (plain, False)):
        memory = PeerMemory(owners=[weakref.ref(kept)], owners_trained=True)
        with CheckpointManager(tmp_path / "ckpt", options=opts, peer_memory=memory) as mgr:
            if refused:
                with pytest.raises(TransientError, match=r"rank 0: the last life's Linear is "
                                   r"sharded \(its parameters are DTensors: FSDP2\) over "
                                   r"the process group that a peer's loss ended"):
                    mgr.start_restore()
            else:
                mgr.start_restore()


def test_a_module_left_in_evaluation_mode_by_a_failure_is_put_back(tmp_path: Path) -> None:
    """A life that ends between model.eval() and model.train() (its evaluation's collective
    met a lost peer) leaves a model built outside the training function in evaluation
    mode: the next life, tracking it again, trains it in the mode of the step restored,
    by the module's own train() (which keeps a frozen part frozen). Found on a user's
    script: rank 0 trained on with dropout off, and the run ended on other weights."""
    from resilient_train.checkpoint.tiers.peers import PeerMemory

    class Frozen(torch.nn.Sequential):
        def train(self, mode: bool = True) -> Frozen:
            super().train(mode)
            self[0].eval()   # a part the script keeps frozen
            return self

    model = Frozen(torch.nn.BatchNorm1d(2), torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    model.train()
    other = torch.nn.Dropout(0.5)
    memory = PeerMemory()
    opts = CheckpointOptions(async_save=False, peer_recovery=False)
    with CheckpointManager(tmp_path, options=opts, peer_memory=memory) as mgr:
        mgr.track(model=model, other=other)
        mgr.save(1)
        mgr.maybe_save(1)          # the boundary: both in training mode
        model.eval()               # an evaluation begins,
        other.eval()
        mgr.hand_over(1)           # and its collective fails
    with CheckpointManager(tmp_path, options=opts, peer_memory=memory) as mgr:
        mgr.track(model=model, other=torch.nn.Dropout(0.5))   # `other` built anew
        assert mgr.restore_latest() == 1
    assert model.training and model[1].training and model[2].training
    assert not model[0].training   # its own train() kept it frozen
    assert not other.training      # not tracked again: not this restore's to change


def test_latest_step_lists_committed_steps_without_reading_them(tmp_path: Path) -> None:
    """What an evaluator polls: the newest committed step; a step without its marker (a
    save in progress, or one that crashed) does not count."""
    model = torch.nn.Linear(2, 2)
    with CheckpointManager(tmp_path, options=CheckpointOptions(async_save=False)) as mgr:
        assert mgr.latest_step() is None
        mgr.track(model=model)
        mgr.save(3)
        mgr.save(7)
        assert mgr.latest_step() == 7
    shutil.copytree(tmp_path / "step-000000000007", tmp_path / "step-000000000009")
    (tmp_path / "step-000000000009" / "COMMITTED").unlink()
    follower = CheckpointManager(tmp_path)
    follower.track(model=torch.nn.Linear(2, 2))
    assert follower.latest_step() == 7
    assert follower.restore_latest() == 7
    follower.close()
