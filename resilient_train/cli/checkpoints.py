"""``resilient-train checkpoints list|verify|prune DIR``: printing only."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path
from typing import Any

from ..checkpoint.commit.directory import (
    DEL_PREFIX,
    TMP_PREFIX,
    StepInfo,
    debris_note,
    is_held,
    prune,
    scan,
    structural_problems,
    verify_step,
)
from ..checkpoint.commit.retention import RetentionPolicy
from ..checkpoint.storage.base import Storage, StorageError
from ..observe.jobdir import JOB_FILE, read_job

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2
# Out of the readers' namespace: a save in progress or a step being deleted, never damage.
_IN_PROGRESS = (TMP_PREFIX, DEL_PREFIX)


def _when(t: float | None) -> str:
    return "-" if t is None else datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


@dataclasses.dataclass(frozen=True)
class Tier:
    """One directory of checkpoints to list: the persistent one, or a replica's node-local
    disk (``replica`` set)."""

    storage: Storage
    replica: str | None = None

    def describe(self) -> str:
        return f"node-local tier of {self.replica}: {self.storage.url}"


def _row(info: StepInfo, tier: Tier) -> dict[str, Any]:
    return {"step": info.step, "name": info.name, "committed": info.committed, "ok": info.ok,
            "created": info.created, "world_size": info.world_size,
            "size_bytes": info.size_bytes, "problems": list(info.problems),
            "debris": info.debris or None,
            "tier": "persistent" if tier.replica is None else "node-local",
            "replica": tier.replica, "directory": tier.storage.url}


def _print(listed: list[tuple[Tier, list[StepInfo]]], as_json: bool) -> None:
    if as_json:
        print(json.dumps([_row(i, tier) for tier, infos in listed for i in infos], indent=2))
        return
    for tier, infos in listed:
        if tier.replica is not None:
            print(f"\n{tier.describe()}")
        _print_table(infos)


def _print_table(infos: list[StepInfo]) -> None:
    if not infos:
        print("no checkpoints")
        return
    print(f"{'step':>12}  {'state':11}  {'created':19}  {'ranks':>5}  {'size':>10}  name")
    for i in infos:
        state = "ok" if i.ok else ("CORRUPT" if i.committed else
                                   "debris" if i.debris else "uncommitted")
        print(f"{i.step:>12}  {state:11}  {_when(i.created):19}  {i.world_size or '-':>5}  "
              f"{_size(i.size_bytes):>10}  {i.name}")
        for p in i.problems:
            print(f"{'':>14}- {p}")


def _live(storage: Storage, infos: list[StepInfo]) -> list[StepInfo]:
    """A leftover directory that a live process holds (local disk: another job's save in
    flight, a delete under way) is not debris: prune leaves it; it is listed in progress."""
    return [dataclasses.replace(i, debris="")
            if i.debris and i.name.startswith(_IN_PROGRESS) and is_held(storage, i.name)
            else i for i in infos]


def _structurally_checked(storage: Storage, info: StepInfo) -> StepInfo:
    if info.debris:
        return dataclasses.replace(info, problems=(debris_note(storage, info),))
    if not info.ok:
        return info
    problems = structural_problems(storage, info)
    return dataclasses.replace(info, problems=tuple(problems)) if problems else info


def _checkpoint_dir(directory: str) -> str:
    """A launcher job's directory (it holds job.json) stands for its checkpoints: the
    AIP_CHECKPOINT_DIR its replicas were given, BASE_OUTPUT_DIRECTORY/checkpoints."""
    if "://" in directory:
        return directory
    if not (Path(directory) / JOB_FILE).is_file():
        return directory
    # A record that is no record is the command's error (JobRecordError, a ValueError);
    # one without the field (written by hand) leaves the directory as given.
    job = read_job(directory)
    try:
        base = job["job_spec"]["base_output_directory"]
    except (KeyError, TypeError):
        return directory
    found = f"{str(base).rstrip('/')}/checkpoints"
    print(f"job {directory}: its checkpoints are in {found}", file=sys.stderr)
    return found


def _node_local_tiers(directory: str) -> list[tuple[Tier, list[StepInfo]]]:
    """A launcher job's node-local tiers that hold a step, each with its steps: each
    replica's machine's disk (``machines/REPLICA/vm/local/checkpoints``, as
    ``rt.NodeLocal()`` puts it, and its ``rankNNNNN`` directories where several processes
    share the machine). A NodeLocal given a directory of its own is not found here: list
    that directory."""
    if "://" in directory or not (Path(directory) / JOB_FILE).is_file():
        return []
    tiers = []
    for root in sorted(Path(directory).glob("machines/*/vm/local/checkpoints")):
        replica = root.parts[-4]
        for path in [root, *sorted(root.glob("rank[0-9]*"))]:
            storage = Storage(str(path))
            infos = _live(storage, scan(storage))
            if infos:
                name = replica if path == root else f"{replica} {path.name}"
                tiers.append((Tier(storage, name), infos))
    return tiers


def run_checkpoints(args: argparse.Namespace) -> int:
    try:
        storage = Storage(_checkpoint_dir(args.directory))
        storage.check_readable()   # "no checkpoints" must mean that, not a typo in the path
        tiers = [(Tier(storage), _live(storage, scan(storage)))]
        if args.action != "prune":   # the library keeps the node-local tier's own count
            tiers += _node_local_tiers(args.directory)
        if args.action == "list":
            # The cheap checks (files present, sizes as the manifest says); verify reads
            # every byte for the checksums.
            _print([(t, [_structurally_checked(t.storage, i) for i in infos])
                    for t, infos in tiers], args.json)
            return EXIT_OK
        if args.action == "verify":
            chosen = [(t, [i for i in infos if args.step is None or i.step == args.step])
                      for t, infos in tiers]
            if args.step is not None and not any(infos for _, infos in chosen):
                print(f"resilient-train checkpoints: error: no step {args.step} in "
                      f"{storage.url}", file=sys.stderr)
                return EXIT_USAGE
            # Uncommitted steps too: a step whose marker is gone is skipped by restore, and
            # a verify that passes over it in silence would report a healthy directory.
            # Temporary directories (a save in progress) and debris (what an interrupted
            # delete or save left, which prune removes) are listed, not failed.
            checked = [(t, [verify_step(t.storage, i) for i in infos]) for t, infos in chosen]
            _print(checked, args.json)
            failed = [i for _, infos in checked for i in infos
                      if not i.ok and not i.debris and not i.name.startswith(_IN_PROGRESS)]
            return EXIT_PROBLEMS if failed else EXIT_OK
        retention = RetentionPolicy(keep_last=args.keep_last,
                                    milestone_every_steps=args.milestone_every_steps)
        # deep: every checksum of the newest steps, so a corrupt one is never counted
        # as a step to keep while the good ones behind it are deleted.
        removed = prune(storage, retention, deep=True, dry_run=args.dry_run)
        verb = "would delete" if args.dry_run else "deleted"
        if args.json:
            print(json.dumps({"dry_run": args.dry_run, "deleted": removed}))
        else:
            print(f"{verb} {len(removed)}: {', '.join(removed) or 'nothing'}")
        return EXIT_OK
    except (StorageError, ValueError) as exc:
        print(f"resilient-train checkpoints: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
