"""``resilient-train``: argument parsing and printing only."""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from .launcher.chaos import ChaosSpecError, load_chaos, parse_duration
from .launcher.messages import STATUS_INTERNAL, JobState
from .launcher.policy import PolicyError, Strategy, default_policy, load_policy, without_retries
from .launcher.record import read_job
from .launcher.resources import memory_limit_for, parse_memory
from .launcher.runner import Launcher, LaunchError, LaunchOptions, launcher_alive

EXIT_USAGE = 2
_TERMINAL = {s.value for s in JobState if s.terminal}

EPILOG = """\
exit status: 0 when the job SUCCEEDED; otherwise the root cause's exit code (a worker's
status, 128+N for death by signal N), 137 out of memory, 69 stockout, 70 internal error,
124 timeout, 130 cancelled, 2 bad usage.
"""


def _duration_or_none(text: str) -> float | None:
    seconds = parse_duration(text)
    return None if seconds == 0 else seconds


def _pool(text: str) -> tuple[str, int]:
    name, sep, count = text.partition("=")
    if not sep or not name.startswith("workerpool") or not name[10:].isdigit() \
            or int(name[10:]) > 3 or not count.isdigit():
        raise argparse.ArgumentTypeError(
            f"expected POOL=COUNT with POOL one of workerpool0..workerpool3, e.g. "
            f"workerpool1=3; found {text!r}")
    return name, int(count)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="resilient-train",
                                description="Resilient PyTorch training: launcher and tools.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="cmd", required=True)

    lp = sub.add_parser("launch", help="run a command as a job with the platform's semantics",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                        usage="resilient-train launch [options] -- COMMAND [ARGS...]")
    lp.add_argument("--workers", type=int, help="replicas: the primary + N-1 workers (default 1)")
    lp.add_argument("--pool", action="append", type=_pool, default=[], metavar="POOL=COUNT",
                    help="explicit worker pool, e.g. --pool workerpool0=1 --pool workerpool1=3")
    lp.add_argument("--name", help="job name (default rt-DATE-TIME-XXXX)")
    lp.add_argument("--job-dir", type=Path, help="job directory (default ./rt-jobs/NAME)")
    lp.add_argument("--output-dir", help="base output directory for AIP_* (local or gs://; "
                    "default JOB_DIR/output)")
    lp.add_argument("--gpus-per-worker", type=int, default=0, metavar="K")
    lp.add_argument("--cpu-slots", type=int, default=0,
                    help="CPU slots this job takes from the machine-wide quota (default 0)")
    lp.add_argument("--memory-limit", type=parse_memory, metavar="SIZE",
                    help="per-worker memory limit, e.g. 2GiB; exceeding it is the OOM error")
    lp.add_argument("--machine-type", help="e.g. n1-standard-4: implies --memory-limit "
                    "(memory minus the platform's reserved share)")
    lp.add_argument("--start-jitter", type=parse_duration, default=0.0, metavar="DURATION",
                    help="random delay up to DURATION before each worker starts")
    lp.add_argument("--grace", type=parse_duration, default=10.0, metavar="DURATION",
                    help="SIGTERM-to-SIGKILL grace period (default 10s)")
    lp.add_argument("--chaos", default="", metavar="SPEC",
                    help="faults to inject: KIND[:REPLICA]@TIME[/GRACE] or KIND~MEAN[xCOUNT], "
                    "comma-separated, or @FILE; kinds: kill, maintenance, preempt, oom, "
                    "stockout, internal")
    lp.add_argument("--chaos-seed", type=int, default=0)
    lp.add_argument("--policy", type=Path, help="restart policy JSON file (default: the platform's)")
    lp.add_argument("--strategy", choices=[s.value for s in Strategy], default="standard")
    lp.add_argument("--max-wait", type=_duration_or_none, default=24 * 3600.0, metavar="DURATION",
                    help="flex-start: how long to wait for capacity (default 24h, 0 = forever)")
    lp.add_argument("--restart-job-on-worker-restart", action="store_true")
    lp.add_argument("--disable-retries", action="store_true")
    lp.add_argument("--timeout", type=_duration_or_none, default=7 * 24 * 3600.0,
                    metavar="DURATION", help="job timeout from RUNNING (default 168h, 0 = none)")
    lp.add_argument("--region", default="local", help="region named in stockout messages")
    lp.add_argument("--seed", type=int, default=0, help="seed for start jitter")
    lp.add_argument("--quiet", action="store_true", help="do not echo worker output")
    lp.add_argument("command", nargs=argparse.REMAINDER)

    cp = sub.add_parser("checkpoints", help="list, verify or prune a checkpoint directory")
    cp.add_argument("action", choices=["list", "verify", "prune"])
    cp.add_argument("directory", help="local path, gs://bucket/prefix, or any fsspec URL")
    cp.add_argument("--step", type=int, help="verify: only this step")
    cp.add_argument("--keep-last", type=int, default=3, help="prune: committed steps to keep")
    cp.add_argument("--milestone-every-steps", type=int, help="prune: also keep these steps")
    cp.add_argument("--dry-run", action="store_true", help="prune: only print what would go")
    cp.add_argument("--json", action="store_true", help="machine-readable output")

    sp = sub.add_parser("status", help="print a job's record for a person")
    sp.add_argument("job_dir", type=Path)
    sp.add_argument("--json", action="store_true", help="print job.json as is")
    sp.add_argument("--events", action="store_true", help="also print every event")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.cmd == "launch":
        return _launch(args, parser)
    if args.cmd == "checkpoints":
        from .checkpoint_cli import run_checkpoints  # imports torch: only when asked

        return run_checkpoints(args)
    return _status(args)


def _launch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        parser.error("launch needs a command after --, e.g. resilient-train launch -- python train.py")
    try:
        options = _options(args, tuple(command))
        launcher = Launcher(options, echo=lambda line: print(line, flush=True),
                            echo_workers=not args.quiet)
    except (LaunchError, ChaosSpecError, PolicyError, ValueError) as exc:
        print(f"resilient-train launch: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"job {options.job_name}: directory {options.job_dir}", flush=True)
    try:
        status = launcher.run()
    except Exception as exc:  # noqa: BLE001 - the launcher failed; it logged the traceback
        print(f"resilient-train launch: internal error: {exc!r}; its workers were stopped "
              f"and the job record says FAILED", file=sys.stderr)
        status = STATUS_INTERNAL
    record = launcher.machine
    line = f"job {options.job_name}: {record.state.value}"
    if record.error is not None:
        line += f": {record.error.message}"
    print(line, flush=True)
    print(f"job record: {options.job_dir / 'job.json'} (exit status {status})", flush=True)
    return status


def _options(args: argparse.Namespace, command: tuple[str, ...]) -> LaunchOptions:
    if args.workers is not None and args.pool:
        raise LaunchError("give either --workers or --pool, not both")
    if args.pool:
        pools = tuple(args.pool)
        if len({p for p, _ in pools}) != len(pools):
            raise LaunchError("each --pool may be given once")
    else:
        workers = 1 if args.workers is None else args.workers
        if workers < 1:
            raise LaunchError(f"--workers must be at least 1, found {workers}")
        pools = (("workerpool0", 1),) + ((("workerpool1", workers - 1),) if workers > 1 else ())
    name = args.name or f"rt-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    memory = args.memory_limit
    if args.machine_type:
        if memory is not None:
            raise LaunchError("give either --memory-limit or --machine-type, not both")
        memory = memory_limit_for(args.machine_type)
    strategy = Strategy(args.strategy)
    policy = load_policy(args.policy) if args.policy else default_policy(strategy)
    if args.disable_retries:
        policy = without_retries(policy)
    return LaunchOptions(
        command=command,
        job_dir=args.job_dir or Path("rt-jobs") / name,
        job_name=name,
        pools=pools,
        output_dir=args.output_dir,
        gpus_per_worker=args.gpus_per_worker,
        cpu_slots=args.cpu_slots,
        memory_limit=memory,
        start_jitter=args.start_jitter,
        grace=args.grace,
        chaos=load_chaos(args.chaos, seed=args.chaos_seed),
        policy=policy,
        strategy=strategy,
        # The platform: disable_retries overrides restart_job_on_worker_restart to false.
        restart_job_on_worker_restart=args.restart_job_on_worker_restart and not args.disable_retries,
        timeout=args.timeout,
        max_wait=args.max_wait,
        region=args.region,
        seed=args.seed,
        env=dict(os.environ),
    )


def _status(args: argparse.Namespace) -> int:
    try:
        job = read_job(args.job_dir)
    except (FileNotFoundError, json.JSONDecodeError) as exc:
        print(f"resilient-train status: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(job, indent=2))
        return 0
    print(f"job       {job['name']}")
    stale = ""
    if job["state"] not in _TERMINAL and launcher_alive(job) is False:
        stale = "  (stale: its launcher is no longer running; the job was not finished)"
    print(f"state     {job['state']}{stale}")
    print(f"created   {job['create_time']}")
    print(f"started   {job.get('start_time') or '-'}")
    print(f"ended     {job.get('end_time') or '-'}")
    if job.get("error"):
        print(f"error     code {job['error']['code']}: {job['error']['message']}")
    budgets = ", ".join(f"{n} {b['used']}/{b['limit']}" for n, b in job.get("budgets", {}).items())
    print(f"budgets   {budgets}")
    for att in job.get("attempts", []):
        print(f"attempt {att['attempt']}: {att['start_time']} .. {att['end_time'] or 'now'}"
              f"  {att['result'] or 'running'}")
        for replica, r in att["replicas"].items():
            codes = ",".join(str(c) for c in r["exit_codes"]) or "-"
            print(f"  {replica:16} {r['status']:9} restarts {r['restarts']}"
                  f"(+{r['uncounted_restarts']} maintenance)  exit codes {codes}")
    if args.events:
        for e in job.get("events", []):
            print(f"  +{e['elapsed_s']:9.3f}s  {e['message']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
