"""``resilient-train``: argument parsing and printing only.

Each subcommand imports its modules in its handler, so that one never pays for another's:
``checkpoints`` loads only ``checkpoint_cli``, not the launcher.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import logging
import os
import re
import secrets
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

# The choices of --strategy: a leaf module of enums and dataclasses (stdlib only).
from ..platform.rules import Strategy

if TYPE_CHECKING:
    from ..launcher.runner import LaunchOptions
    from ..platform.export import PlatformJob
    from ..platform.jobspec import JobSpec

EXIT_USAGE = 2
# Defaults of the options a job spec can also set: those options default to None in the
# parser, so that one given explicitly (even with its default value) beats the spec.
_DEFAULT_TIMEOUT = 7 * 24 * 3600.0
_DEFAULT_MAX_WAIT = 24 * 3600.0

_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# The values of launcher.scalars.TensorBoardMode, here so that parsing imports nothing more.
TENSORBOARD_MODES = ("auto", "on", "off")
# launcher.export.FORMATS, for the same reason.
EXPORT_FORMATS = ("spec", "custom-job", "jobset")
# What still applies to `export --from-job` (the record says the rest).
_FROM_JOB_OPTIONS = frozenset({"cmd", "verbose", "from_job", "image", "accelerator_type",
                               "format", "output", "name", "output_dir", "machine_type"})
# `submit`'s own options, which apply with --from-job too.
_SUBMIT_OPTIONS = frozenset({"project", "region", "endpoint", "wait", "interval"})
# Where `submit` finds its project and region when --project or --region is not given: the
# variable Google's libraries read, gcloud's own, then the ones Vertex AI sets in a job.
PROJECT_ENV = ("GOOGLE_CLOUD_PROJECT", "CLOUDSDK_CORE_PROJECT", "CLOUD_ML_PROJECT_ID")
REGION_ENV = ("GOOGLE_CLOUD_REGION", "CLOUDSDK_AI_REGION", "CLOUD_ML_REGION")
EXIT_JOB_FAILED = 1   # a followed job that ended without succeeding
DEFAULT_INTERVAL_S = 30.0

SUBMIT_EPILOG = """\
exit status: 0 when the job was created (with --wait: when it SUCCEEDED); 1 with --wait
when it ended in any other state; 2 when the command line, the job or the service refused
it; 130 when you stopped following (the job goes on).
"""
STATUS_EPILOG = """\
exit status: 0 when it printed the job (with --follow, a remote job: when it SUCCEEDED);
1 with --follow when the job ended in any other state; 2 for an error.
"""

EPILOG = """\
exit status: 0 when the job SUCCEEDED; otherwise the root cause's exit code (a worker's
status, 128+N for death by signal N), 137 out of memory, 69 stockout, 70 internal error,
124 timeout, 130 cancelled, 2 bad usage; 78 when the job SUCCEEDED but a --chaos fault set
at a fixed time or step never fired (the test did not happen).
"""


def _pool(text: str) -> tuple[str, int]:
    name, sep, count = text.partition("=")
    if not sep or not name.startswith("workerpool") or not name[10:].isdigit() \
            or int(name[10:]) > 3 or not count.isdigit():
        raise argparse.ArgumentTypeError(
            f"expected POOL=COUNT with POOL one of workerpool0..workerpool3, e.g. "
            f"workerpool1=3; found {text!r}")
    return name, int(count)


_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _modules(text: str) -> tuple[str, ...]:
    """``torch,torch._dynamo``: module names to preload (an empty item is refused)."""
    names = tuple(name.strip() for name in text.split(","))
    bad = [name for name in names if not _MODULE.fullmatch(name)]
    if bad:
        raise argparse.ArgumentTypeError(
            f"expected module names separated by commas, e.g. torch,torch._dynamo; "
            f"{bad[0]!r} is not a module name")
    return names


def _argument(parse: Callable[[], Callable[[str], Any]], what: str) -> Callable[[str], Any]:
    """An argparse type from a parser that raises ValueError: argparse would print only
    "invalid parse_duration value"; this keeps the parser's message (what was expected).
    ``parse`` gives the parser, imported only when an option needs it."""
    def convert(text: str) -> Any:
        try:
            return parse()(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = what
    return convert


def _parse_duration() -> Callable[[str], float]:
    from ..launcher.chaos import parse_duration

    return parse_duration


def _positive_duration(name: str, what: str) -> Callable[[str], Any]:
    """An argparse type for a duration that must be more than 0 (and finite, as every
    duration): ``name`` for argparse, ``what`` for the message (``a grace period``)."""
    def parser() -> Callable[[str], float]:
        return functools.partial(_parse_duration(), positive=True, what=what)

    return _argument(parser, name)


def _parse_memory() -> Callable[[str], int]:
    from ..platform.resources import parse_memory

    return parse_memory


_duration = _argument(_parse_duration, "duration")
# A SIGTERM-to-SIGKILL time: 0 leaves a worker no time to save (its emergency save refuses
# a grace of 0 and exits 1), infinity never kills it.
_grace = _positive_duration("grace period", "a grace period")
# How often to ask the service: 0 would ask without a pause.
_interval = _positive_duration("interval", "an interval")
_memory = _argument(_parse_memory, "memory size")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="resilient-train",
                                description="Resilient PyTorch training: launcher and tools.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="cmd", required=True)

    lp = sub.add_parser("launch", help="run a command as a job with the platform's semantics",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                        usage="resilient-train launch [options] -- COMMAND [ARGS...]\n"
                              "       resilient-train launch --job-spec FILE [options] "
                              "[-- COMMAND [ARGS...]]")
    lp.add_argument("--job-spec", type=Path, metavar="FILE",
                    help="a Vertex AI CustomJob spec (YAML or JSON, as for gcloud ai "
                    "custom-jobs create --config): pools, command, env, machine type, "
                    "accelerators, scheduling and output directory from it; options given "
                    "here win, and a command after -- replaces the spec's")
    lp.add_argument("--workers", type=int, help="replicas: the primary + N-1 workers (default 1)")
    lp.add_argument("--pool", action="append", type=_pool, default=[], metavar="POOL=COUNT",
                    help="explicit worker pool, e.g. --pool workerpool0=1 --pool workerpool1=3; "
                    "with --job-spec it sets that pool's replicas (0 leaves the pool out)")
    lp.add_argument("--name", help="job name (default rt-DATE-TIME-XXXX)")
    lp.add_argument("--job-dir", type=Path, help="job directory (default ./rt-jobs/NAME)")
    lp.add_argument("--output-dir", help="base output directory for AIP_* (local or gs://; "
                    "default JOB_DIR/output)")
    lp.add_argument("--gpus-per-worker", type=int, metavar="K", help="(default 0)")
    lp.add_argument("--cpu-slots", type=int, default=0,
                    help="CPU slots this job takes from the machine-wide quota (default 0)")
    lp.add_argument("--memory-limit", type=_memory, metavar="SIZE",
                    help="per-worker memory limit, e.g. 2GiB; exceeding it is the OOM error")
    lp.add_argument("--machine-type", help="e.g. n1-standard-4: implies --memory-limit "
                    "(memory minus the platform's reserved share)")
    lp.add_argument("--start-jitter", type=_duration, default=0.0, metavar="DURATION",
                    help="random delay up to DURATION before each worker starts")
    lp.add_argument("--preload", type=_modules, metavar="MODULES",
                    help="fork each `python SCRIPT` worker from a process that imported "
                    "MODULES once (e.g. torch,torch._dynamo): restarts without their "
                    "imports, for fast local iterations; the platform starts new processes "
                    "(default: $RESILIENT_TRAIN_PRELOAD, else none)")
    lp.add_argument("--grace", type=_grace, default=10.0, metavar="DURATION",
                    help="SIGTERM-to-SIGKILL grace period (default 10s)")
    lp.add_argument("--chaos", default="", metavar="SPEC",
                    help="faults to inject: KIND[:REPLICA]@TIME[/GRACE] or KIND~MEAN[xCOUNT], "
                    "comma-separated, or @FILE; kinds: kill, maintenance, preempt, oom, "
                    "stockout, internal, hang (hang:1@step40+30s), slow (slow:1@20s+60s*0.25), "
                    "wipe and corrupt (the replica's node-local disk)")
    lp.add_argument("--chaos-seed", type=int, default=0)
    lp.add_argument("--policy", type=Path,
                    help="restart policy JSON file (default: the platform's)")
    lp.add_argument("--strategy", choices=[s.value for s in Strategy],
                    help="(default standard)")
    lp.add_argument("--max-wait", type=_duration, metavar="DURATION",
                    help="flex-start: how long to wait for capacity (default 24h, 0 = forever)")
    lp.add_argument("--restart-job-on-worker-restart", action="store_true", default=None)
    lp.add_argument("--disable-retries", action="store_true", default=None)
    lp.add_argument("--timeout", type=_duration, metavar="DURATION",
                    help="job timeout from RUNNING (default 168h, 0 = none)")
    lp.add_argument("--region", default="local", help="region named in stockout messages")
    lp.add_argument("--seed", type=int, default=0, help="seed for start jitter")
    lp.add_argument("--quiet", action="store_true", help="do not echo worker output")
    lp.add_argument("--shared-workdir", action="store_true",
                    help="run every replica in this working directory (default: each in a "
                    "view of its own, where what it writes is its own, as on its own VM)")
    lp.add_argument("--tensorboard", choices=TENSORBOARD_MODES, default="auto",
                    help="step time, goodput and recoveries as TensorBoard scalars in "
                    "AIP_TENSORBOARD_LOG_DIR: auto when it is local and the tensorboard "
                    "package is installed (default), on (gs:// too), off")
    lp.add_argument("command", nargs=argparse.REMAINDER)

    # Every launch option, so that `launch` becomes `export` on the same command line.
    ep = sub.add_parser("export", parents=[lp], conflict_handler="resolve",
                        help="write the tested job as a Vertex AI CustomJob spec or a "
                        "Kubernetes JobSet (docs/export.md)",
                        usage="resilient-train export --image URI [launch options] "
                              "[-- COMMAND [ARGS...]]\n"
                              "       resilient-train export --from-job JOB_DIR [--image URI] "
                              "[--format FORMAT] [-o FILE]")
    ep.add_argument("--image", metavar="URI",
                    help="the container image of every pool (of those that ran workerpool0's "
                    "image, with a job spec)")
    ep.add_argument("--accelerator-type", metavar="TYPE",
                    help="e.g. NVIDIA_TESLA_T4: the GPU type of pools with GPUs")
    ep.add_argument("--format", choices=EXPORT_FORMATS, default="spec",
                    help="spec: a CustomJobSpec for gcloud ai custom-jobs create --config "
                    "(default); custom-job: the whole CustomJob, with labels; jobset: a "
                    "Kubernetes JobSet manifest")
    ep.add_argument("-o", "--output", type=Path, metavar="FILE",
                    help="write it there (JSON when FILE ends in .json) instead of stdout")
    ep.add_argument("--from-job", type=Path, metavar="JOB_DIR",
                    help="the job as a launch recorded it in JOB_DIR/job.json; only --image, "
                    "--accelerator-type, --machine-type, --output-dir and --name apply with it")

    # Every export option, so that `export` becomes `submit` on the same command line. A
    # copy of export's parser: argparse shares a parent's actions with the child, and the
    # options submit redefines below (--region, --format, -o) would be taken from export
    # and launch too.
    up = sub.add_parser("submit", parents=[copy.deepcopy(ep)], conflict_handler="resolve",
                        epilog=SUBMIT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                        help="create the tested job on Vertex AI (the document export "
                        "--format custom-job writes) and print its name (docs/export.md)",
                        usage="resilient-train submit --region REGION [--project PROJECT] "
                              "--image URI [launch options] [-- COMMAND [ARGS...]]\n"
                              "       resilient-train submit --region REGION --from-job "
                              "JOB_DIR [--image URI] [--wait]")
    up.add_argument("--format", choices=("custom-job",), default="custom-job",
                    help="what is submitted: the whole CustomJob (the only choice)")
    up.add_argument("-o", "--output", type=Path, metavar="FILE",
                    help="also write the submitted CustomJob there (JSON when FILE ends in "
                    ".json)")
    up.add_argument("--project", metavar="PROJECT",
                    help=f"the Google Cloud project (default: ${', $'.join(PROJECT_ENV)})")
    up.add_argument("--region", metavar="REGION",
                    help=f"the region the job runs in, e.g. us-central1 (default: "
                    f"${', $'.join(REGION_ENV)})")
    up.add_argument("--endpoint", metavar="HOST:PORT",
                    help="the JobService to talk to instead of REGION-aiplatform.googleapis.com"
                    "; on 127.0.0.1 or localhost without TLS or credentials, for testing "
                    "against a local fake (default: $RESILIENT_TRAIN_VERTEX_ENDPOINT)")
    up.add_argument("--wait", action="store_true",
                    help="follow the job until it ends, as status --follow does")
    up.add_argument("--interval", type=_interval, metavar="SECONDS",
                    help="with --wait: how often to ask for its state (default 30s)")

    cp = sub.add_parser("checkpoints", help="list, verify or prune a checkpoint directory")
    cp.add_argument("action", choices=["list", "verify", "prune"])
    cp.add_argument("directory", help="local path, gs://bucket/prefix, any fsspec URL, or a "
                    "launcher job directory (JOB_DIR: its output/checkpoints)")
    cp.add_argument("--step", type=int, help="verify: only this step")
    cp.add_argument("--keep-last", type=int, default=3, help="prune: committed steps to keep")
    cp.add_argument("--milestone-every-steps", type=int, help="prune: also keep these steps")
    cp.add_argument("--dry-run", action="store_true", help="prune: only print what would go")
    cp.add_argument("--json", action="store_true", help="machine-readable output")

    sp = sub.add_parser("status", help="print a job's record for a person: a local job's "
                        "directory, or a Vertex AI job's name",
                        epilog=STATUS_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("job_dir", metavar="JOB_DIR|JOB_NAME",
                    help="a job directory, or a Vertex AI job's resource name "
                    "projects/PROJECT/locations/REGION/customJobs/ID (as submit prints it)")
    sp.add_argument("--json", action="store_true",
                    help="print job.json as is (a remote job: the API's JSON)")
    sp.add_argument("--events", action="store_true", help="also print every event")
    sp.add_argument("--follow", action="store_true",
                    help="a remote job: print a line per state change until it ends; the "
                    "exit status is 0 when it SUCCEEDED, 1 otherwise")
    sp.add_argument("--interval", type=_interval, metavar="SECONDS",
                    help="with --follow: how often to ask for its state (default 30s)")
    sp.add_argument("--endpoint", metavar="HOST:PORT",
                    help="a remote job: the JobService to ask (as for submit)")

    rp = sub.add_parser("report", help="write a job's timeline, goodput and faults as one "
                        "self-contained HTML page")
    rp.add_argument("job_dir", type=Path)
    rp.add_argument("-o", "--output", type=Path, metavar="FILE",
                    help="where to write it (default JOB_DIR/report.html)")

    wp = sub.add_parser(
        "spawn", help="run a replica's processes, one per GPU, in place of torchrun",
        usage="resilient-train spawn [--nproc-per-node N|gpu|auto] -- COMMAND [ARGS...]",
        description="Start this machine's training processes with torchrun's variables, "
        "computed from the replica's place in the job (CLUSTER_SPEC, or RANK and "
        "WORLD_SIZE), and no agent rendezvous: a restarted first machine rejoins the job, "
        "where torchrun's would wait for agents that never come back. Signals are passed "
        "on; when one process fails the others are stopped, and the exit status is the "
        "failed process's.")
    wp.add_argument("--nproc-per-node", "--nproc_per_node", default="auto", metavar="N",
                    help="processes on this machine: a number, 'gpu' (one per GPU) or "
                    "'auto' (one per GPU, else 1; the default)")
    wp.add_argument("--stop-grace", type=_grace, default=30.0, metavar="SECONDS",
                    help="after a process failed: how long the others have between SIGTERM "
                    "and SIGKILL (default 30s)")
    wp.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")

    pp = sub.add_parser(
        "preload-server", help="import torch once and fork the worker lives of every launch "
        "that names this server's socket (docs/launcher.md, Preloading)",
        description="Import MODULES once, then serve every `launch --preload` whose "
        "environment has RESILIENT_TRAIN_PRELOAD_SERVER=SOCKET: their worker lives are "
        "forked here instead of each a new interpreter importing them. Runs until stopped, "
        "or until the process that started it ends.")
    pp.add_argument("socket", type=Path, help="the Unix socket to listen on")
    pp.add_argument("--modules", type=_modules, default=("torch", "torch._dynamo"),
                    help="comma-separated (default torch,torch._dynamo)")
    pp.add_argument("--replicas", type=int, default=1, metavar="N",
                    help="the replicas of the launches it serves: their workers' "
                    "OMP_NUM_THREADS is this machine's cores divided by N, and a launch "
                    "whose workers' differs starts a server of its own (default 1)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return _dispatch(args, parser)
    except BrokenPipeError:   # `resilient-train status ... | head`: the reader has enough
        _drop_stdout()
        return 1


def _drop_stdout() -> None:
    """stdout's reader went away: what is printed from now on goes nowhere, instead of
    raising at each print and at exit (Python's recipe, in the docs of ``signal``)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


class _Output:
    """The launcher's output on stdout. An output that cannot be written any more (a
    pipe whose reader went away: ``| head``, a ``tee`` that was killed; a terminal that
    closed) does not stop the job: the workers train on, their logs and the job's record
    are written as before, and one line on stderr says so."""

    def __init__(self, job_dir: Path) -> None:
        self._job_dir = job_dir

    def line(self, text: str) -> None:
        try:
            print(text, flush=True)
        except OSError as exc:   # EPIPE; EIO from a terminal that hung up
            _drop_stdout()
            try:
                print(f"resilient-train launch: stdout cannot be written "
                      f"({exc.strerror or exc}); the job goes on, its logs and record in "
                      f"{self._job_dir}", file=sys.stderr, flush=True)
            except OSError:
                pass   # stderr went with it (2>&1)


def _dispatch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.cmd == "launch":
        return _launch(args, parser)
    if args.cmd == "export":
        return _export(args, parser)
    if args.cmd == "submit":
        return _submit(args, parser)
    if args.cmd == "checkpoints":
        from .checkpoints import run_checkpoints  # the directory library only

        return run_checkpoints(args)
    if args.cmd == "report":
        return _report(args)
    if args.cmd == "spawn":
        return _spawn(args)
    if args.cmd == "preload-server":
        return _preload_server(args)
    return _status(args)


def _command(args: argparse.Namespace) -> list[str]:
    """The command after ``--`` (argparse's REMAINDER keeps the ``--`` itself)."""
    command = list(args.command)
    return command[1:] if command and command[0] == "--" else command


def _spawn(args: argparse.Namespace) -> int:
    from ..spawn.agent import SpawnError, SpawnOptions, parse_nproc, spawn

    # One line per state change, named as the launcher names its own.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[spawn] %(message)s"))
    log = logging.getLogger("resilient_train.spawn.agent")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    command = _command(args)
    try:
        options = SpawnOptions(parse_nproc(args.nproc_per_node), args.stop_grace)
        return spawn(command, options)
    except SpawnError as exc:
        print(f"resilient-train spawn: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _preload_server(args: argparse.Namespace) -> int:
    """Become the fork server (exec: none of this library stays imported in it, so each
    life imports it afresh), with the start-up environment the launcher gives workers."""
    import socket

    from ..launcher import forkserver
    from ..launcher.workerenv import started_as_worker

    if args.replicas < 1:
        print(f"resilient-train preload-server: --replicas {args.replicas}: expected 1 or "
              "more", file=sys.stderr)
        return EXIT_USAGE
    path: Path = args.socket
    if path.exists():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(path))
            except OSError:   # an earlier server's, that ended: nothing listens there
                path.unlink()
            else:
                print(f"resilient-train preload-server: a server already listens at {path}",
                      file=sys.stderr)
                return EXIT_USAGE
    path.parent.mkdir(parents=True, exist_ok=True)
    env = started_as_worker(os.environ, args.replicas)
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, forkserver.__file__, "--listen", str(path),
                               *args.modules], env)


def _launch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ..launcher.chaos import ChaosSpecError, bare_time_hints
    from ..launcher.messages import STATUS_FAULT_NOT_FIRED, STATUS_INTERNAL
    from ..launcher.runner import Launcher, LaunchError
    from ..launcher.workerenv import fuse_path_note
    from ..platform.jobspec import JobSpecError, load_job_spec
    from ..platform.rules import PolicyError

    command = _command(args)
    if not command and args.job_spec is None:
        parser.error("launch needs a command after --, e.g. "
                     "resilient-train launch -- python train.py")
    try:
        spec = load_job_spec(args.job_spec) if args.job_spec is not None else None
        options, notes = _options(args, tuple(command), spec)
        out = _Output(options.job_dir)
        launcher = Launcher(options, echo=out.line, echo_workers=not args.quiet)
    except (LaunchError, ChaosSpecError, PolicyError, JobSpecError, ValueError) as exc:
        print(f"resilient-train launch: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for note in notes:
        out.line(f"job spec: {note}")
    for hint in bare_time_hints(options.chaos):
        out.line(hint)
    fuse = fuse_path_note(options.output_dir)
    if fuse is not None:
        out.line(fuse)
    out.line(f"job {options.job_name}: directory {options.job_dir}")
    if launcher.scalars is not None:
        out.line(launcher.scalars.describe())
    try:
        status = launcher.run()
    except Exception as exc:  # noqa: BLE001 - the launcher failed; it logged the traceback
        print(f"resilient-train launch: internal error: {exc!r}; its workers were stopped "
              f"and the job record says FAILED", file=sys.stderr)
        status = STATUS_INTERNAL
    record = launcher.machine
    # The final state is the last event line above; the error's whole message (the
    # events show its first line) follows it once.
    if record.error is not None:
        out.line(f"error {record.error.code}: {record.error.message}")
    unfired = launcher.unfired_faults()
    for fault in unfired:
        out.line(f"chaos: {fault.spec} never fired: {fault.why}"
                 + (f" ({fault.fired} of {fault.count} fired)" if fault.random and fault.count
                    else ""))
    cancelled = launcher.cancel_note()
    if cancelled is not None:
        out.line(cancelled)
    if status == STATUS_FAULT_NOT_FIRED:
        out.line(f"the job succeeded, but {sum(not f.random for f in unfired)} of its faults "
                 f"never fired: the resilience test did not happen (exit status "
                 f"{STATUS_FAULT_NOT_FIRED})")
    out.line(f"job record: {options.job_dir / 'job.json'} (exit status {status})")
    return status


def _options(args: argparse.Namespace, command: tuple[str, ...],
             spec: JobSpec | None = None) -> tuple[LaunchOptions, list[str]]:
    """The launch options, and the notes to print about what the job spec decided.

    An option given on the command line beats the job spec, which beats the default; a
    command after -- replaces the spec's (programs.plan_pools has the details)."""
    from ..launcher.chaos import load_chaos
    from ..launcher.runner import LaunchError, LaunchOptions
    from ..observe.scalars import TensorBoardMode
    from ..platform.export import tested_job
    from ..platform.programs import PoolProgram, plan_pools
    from ..platform.resources import detect_gpus, memory_limit_for
    from ..platform.rules import (
        default_policy,
        load_policy,
        with_platform_defaults,
        without_retries,
    )

    notes: list[str] = []
    if spec is not None:
        notes += spec.notes_for("fields")
    if args.workers is not None and args.pool:
        raise LaunchError("give either --workers or --pool, not both")
    if len({p for p, _ in args.pool}) != len(args.pool):
        raise LaunchError("each --pool may be given once")
    if args.workers is not None and args.workers < 1:
        raise LaunchError(f"--workers must be at least 1, found {args.workers}")
    pools: tuple[tuple[str, int], ...] = ()   # with a spec: its plan's, below
    if spec is None and args.pool:
        pools = tuple(args.pool)
    elif spec is None:
        workers = 1 if args.workers is None else args.workers
        pools = (("workerpool0", 1),) + ((("workerpool1", workers - 1),) if workers > 1 else ())
    name = args.name or _job_name(spec.display_name if spec is not None else None)
    if not _JOB_NAME.fullmatch(name):
        raise LaunchError(f"--name {name!r}: a job name is letters, digits, '.', '_' and '-' "
                          "(it names a directory and the job id), e.g. --name run-7")
    memory = args.memory_limit
    if memory is not None and memory <= 0:
        raise LaunchError(f"--memory-limit must be more than 0 bytes, found {memory}; "
                          "leave it out for no limit")
    if args.machine_type:
        if memory is not None:
            raise LaunchError("give either --memory-limit or --machine-type, not both")
        memory = memory_limit_for(args.machine_type)
    gpus = args.gpus_per_worker
    programs: tuple[PoolProgram, ...] = ()
    listed_only: tuple[tuple[str, int], ...] = ()
    if spec is not None:
        if memory is None:
            notes += spec.notes_for("memory")
        plan = plan_pools(spec, source=str(args.job_spec), command=command or None,
                          counts=dict(args.pool), workers=args.workers, memory_limit=memory,
                          gpus_per_replica=gpus, gpus_available=len(detect_gpus(os.environ)))
        pools, listed_only, programs = plan.pools, plan.listed_only, plan.programs
        notes += spec.notes_for("command", "env") + list(plan.notes)
        primary = plan.programs[0]
        command, memory, gpus = primary.command, primary.memory_limit, primary.gpus_per_replica
    elif gpus is None:
        gpus = 0
    strategy = Strategy(args.strategy) if args.strategy else (
        spec.strategy if spec is not None and spec.strategy is not None else Strategy.STANDARD)
    disable_retries = _given(args.disable_retries,
                             spec.disable_retries if spec is not None else None, False)
    restart_job = _given(args.restart_job_on_worker_restart,
                         spec.restart_job_on_worker_restart if spec is not None else None, False)
    timeout = _given(args.timeout, spec.timeout if spec is not None else None, _DEFAULT_TIMEOUT)
    max_wait = _given(args.max_wait, spec.max_wait if spec is not None else None,
                      _DEFAULT_MAX_WAIT)
    if args.max_wait is not None and strategy is not Strategy.FLEX_START:
        raise LaunchError(f"--max-wait applies to --strategy flex-start only (this job's "
                          f"strategy is {strategy.value}); add --strategy flex-start or drop it")
    output_dir = args.output_dir
    env = dict(os.environ)
    if spec is not None and output_dir is None and spec.output_dir is not None:
        output_dir = spec.output_dir
        notes += spec.notes_for("output")
    policy = (with_platform_defaults(load_policy(args.policy), strategy) if args.policy
              else default_policy(strategy))
    if disable_retries:
        policy = without_retries(policy)
    options = LaunchOptions(
        command=command,
        job_dir=args.job_dir or Path("rt-jobs") / name,
        job_name=name,
        pools=pools,
        output_dir=output_dir,
        gpus_per_worker=gpus,
        cpu_slots=args.cpu_slots,
        memory_limit=memory,
        start_jitter=args.start_jitter,
        grace=args.grace,
        chaos=load_chaos(args.chaos, seed=args.chaos_seed),
        policy=policy,
        strategy=strategy,
        # The platform: disable_retries overrides restart_job_on_worker_restart to false.
        restart_job_on_worker_restart=restart_job and not disable_retries,
        timeout=None if timeout == 0 else timeout,
        max_wait=None if max_wait == 0 else max_wait,
        region=args.region,
        seed=args.seed,
        env=env,
        programs=programs,
        listed_only=listed_only,
        shared_workdir=args.shared_workdir,
        tensorboard=TensorBoardMode(args.tensorboard),
        preload=_preload(args.preload, env),
    )
    platform = tested_job(options, spec, machine_type=args.machine_type,
                          gpus=args.gpus_per_worker, disable_retries=disable_retries)
    return replace(options, platform_job=platform), notes


def _preload(given: tuple[str, ...] | None, env: Mapping[str, str]) -> tuple[str, ...]:
    """--preload, else the environment's default (a shell profile's, a test suite's)."""
    from ..launcher.preload import PRELOAD_ENV
    from ..launcher.runner import LaunchError

    if given is not None:
        return given
    text = env.get(PRELOAD_ENV, "").strip()
    try:
        return _modules(text) if text else ()
    except argparse.ArgumentTypeError as exc:
        raise LaunchError(f"{PRELOAD_ENV}={text!r}: {exc}") from None


def _export_errors() -> tuple[type[Exception], ...]:
    """What building an exported job raises for a bad command line, spec or record."""
    from ..launcher.chaos import ChaosSpecError
    from ..launcher.runner import LaunchError
    from ..platform.export import ExportError
    from ..platform.jobspec import JobSpecError
    from ..platform.rules import PolicyError

    return (ExportError, LaunchError, ChaosSpecError, PolicyError, JobSpecError, OSError,
            ValueError)


def _exported_job(args: argparse.Namespace, parser: argparse.ArgumentParser) -> PlatformJob:
    """The job that `export` writes and `submit` creates: from the launch's options (the
    command line over a job spec) or from a job's record (--from-job), completed with the
    image and accelerator type. Raises one of :func:`_export_errors`."""
    from ..launcher.runner import LaunchError
    from ..observe.jobdir import JOB_FILE, read_job
    from ..platform.export import complete, job_from_record, with_overrides
    from ..platform.jobspec import load_job_spec

    command = _command(args)
    if args.from_job is None and not command and args.job_spec is None:
        parser.error(f"{args.cmd} needs the launch's options and command, e.g. resilient-train "
                     f"{args.cmd} --image URI -- python train.py, or --from-job JOB_DIR")
    if args.from_job is None and len(command) == 1 and (Path(command[0]) / JOB_FILE).is_file():
        # `export rt-jobs/NAME`: a job's directory, not a command to put in a container.
        parser.error(f"{command[0]} is a job's directory, not a command: resilient-train "
                     f"{args.cmd} --from-job {command[0]}")
    if args.from_job is not None:
        defaults = vars(_parser().parse_args([args.cmd]))
        allowed = _FROM_JOB_OPTIONS | (_SUBMIT_OPTIONS if args.cmd == "submit" else set())
        extra = sorted("a command after --" if key == "command" else
                       "--" + key.replace("_", "-") for key, value in vars(args).items()
                       if key not in allowed and value != defaults.get(key))
        if extra:
            raise LaunchError(
                f"--from-job {args.cmd}s the job as its record says; drop {', '.join(extra)} "
                f"(with it only --image, --accelerator-type, --machine-type, --output-dir "
                f"and --name apply)")
        job = with_overrides(job_from_record(read_job(args.from_job)), name=args.name,
                             output_dir=args.output_dir, machine_type=args.machine_type)
    else:
        launch_args = args
        if args.cmd == "submit":
            # submit's --region is the platform's; a launch's only names a region in its
            # stockout messages, and the exported job does not carry it.
            launch_args = argparse.Namespace(**{**vars(args), "region": "local"})
        spec = load_job_spec(args.job_spec) if args.job_spec is not None else None
        recorded = _options(launch_args, tuple(command), spec)[0].platform_job
        assert recorded is not None   # _options records it for every launch
        job = recorded
    return complete(job, image=args.image, accelerator_type=args.accelerator_type)


def _export(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ..platform.export import render

    try:
        job = _exported_job(args, parser)
        as_json = args.output is not None and args.output.suffix.lower() == ".json"
        text = render(job, args.format, as_json=as_json and args.format != "jobset")
        if args.output is not None:
            args.output.write_text(text, encoding="utf-8")
    except _export_errors() as exc:
        print(f"resilient-train export: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.output is None:
        sys.stdout.write(text)
    # On stderr: stdout may be the document itself.
    _print_export_notes(job, "export")
    if args.output is not None:
        print(f"export: wrote {args.format} to {args.output}", file=sys.stderr)
    return 0


def _print_export_notes(job: PlatformJob, cmd: str) -> None:
    for item in job.left_out:
        print(f"{cmd}: left out {item.text}", file=sys.stderr)
    for note in job.notes:
        print(f"{cmd}: {note}", file=sys.stderr)


def _submit(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ..platform import submit as vertex
    from ..platform.aiplatform_types import CloudExtraMissing, require
    from ..platform.export import custom_job, render

    def fail(exc: BaseException | str) -> int:
        print(f"resilient-train submit: error: {exc}", file=sys.stderr)
        return EXIT_USAGE

    project = args.project or _first_env(PROJECT_ENV)
    region = args.region or _first_env(REGION_ENV)
    if not project:
        return fail(f"no project: give --project PROJECT_ID, or set {PROJECT_ENV[0]}")
    if not region:
        return fail(f"no region: give --region REGION (e.g. us-central1), or set "
                    f"{REGION_ENV[0]}")
    if args.interval is not None and not args.wait:
        return fail("--interval applies with --wait")
    target = vertex.Target(project, region, args.endpoint)
    try:
        require("resilient-train submit")   # before any work: the job would go nowhere
        vertex.check_target(target)
    except (CloudExtraMissing, vertex.VertexError) as exc:
        return fail(exc)
    try:
        job = _exported_job(args, parser)
        # The document `export --format custom-job` writes for the same options.
        doc = custom_job(job)
        if args.output is not None:
            as_json = args.output.suffix.lower() == ".json"
            args.output.write_text(render(job, "custom-job", as_json=as_json), encoding="utf-8")
    except _export_errors() as exc:
        return fail(exc)
    _print_export_notes(job, "submit")
    if args.output is not None:
        print(f"submit: wrote custom-job to {args.output}", file=sys.stderr)
    try:
        created = vertex.submit(target, doc)
        name = vertex.parse_job_name(created.name)
    except (CloudExtraMissing, vertex.VertexError) as exc:
        return fail(exc)
    print(f"submitted {name}", flush=True)
    print(f"console   {vertex.console_url(name)}", flush=True)
    if not args.wait:
        return 0
    return _follow_remote(str(name), args, "submit")


def _first_env(names: Sequence[str]) -> str | None:
    return next((os.environ[n] for n in names if os.environ.get(n)), None)


def _given(explicit: Any, from_spec: Any, default: Any) -> Any:
    """The command line's value, else the spec's, else the default."""
    if explicit is not None:
        return explicit
    return from_spec if from_spec is not None else default


def _job_name(display_name: str | None) -> str:
    prefix = "rt"
    if display_name:
        prefix = re.sub(r"[^A-Za-z0-9._-]+", "-", display_name).strip("-.") or "rt"
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def _status(args: argparse.Namespace) -> int:
    # A Vertex AI job's resource name (or a malformed one), unless a directory has that path.
    remote = args.job_dir.startswith("projects/") or "/customJobs/" in args.job_dir
    if remote and not Path(args.job_dir).exists():
        return _remote_status(args)
    remote_only = [o for o, given in (("--follow", args.follow), ("--endpoint", args.endpoint),
                                      ("--interval", args.interval is not None)) if given]
    if remote_only:
        print(f"resilient-train status: error: {', '.join(remote_only)} applies to a Vertex AI "
              f"job's name (projects/PROJECT/locations/REGION/customJobs/ID), not to a job "
              f"directory: a local launch prints its own progress", file=sys.stderr)
        return EXIT_USAGE
    args.job_dir = Path(args.job_dir)
    return _local_status(args)


def _local_status(args: argparse.Namespace) -> int:
    from ..launcher.jobrecord import launcher_alive
    from ..launcher.messages import JobState
    from ..observe.events import Event
    from ..observe.jobdir import JobRecordError, describe_recovery, read_job, read_recoveries

    try:
        job = read_job(args.job_dir)
    except (FileNotFoundError, JobRecordError) as exc:
        print(f"resilient-train status: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(job, indent=2))
        return 0
    print(f"job       {job['name']}")
    stale = ""
    terminal = {s.value for s in JobState if s.terminal}
    if job["state"] not in terminal and launcher_alive(job) is False:
        stale = "  (stale: its launcher is no longer running; the job was not finished)"
    print(f"state     {job['state']}{stale}")
    print(f"created   {job['create_time']}")
    print(f"started   {job.get('start_time') or '-'}")
    print(f"ended     {job.get('end_time') or '-'}")
    if job.get("error"):
        print(f"error     code {job['error']['code']}: {job['error']['message']}")
    budgets = ", ".join(f"{n} {b['used']}/{b['limit']}" for n, b in job.get("budgets", {}).items())
    print(f"budgets   {budgets}")
    if job.get("exit_status") is not None:
        print(f"exit      {job['exit_status']}")
    for fault in job.get("unfired_faults") or []:
        print(f"chaos     {fault['spec']} never fired: {fault['why']}")
    g = job.get("goodput")
    if g:
        print(f"goodput   {g['goodput']:.1%} of {g['wall_s']:.1f} s: productive "
              f"{g['productive_s']:.1f} s, lost {g['lost_s']:.1f} s ({g['steps_lost']} steps), "
              f"recovery {g['recovery_s']:.1f} s (training stopped, fault to training again), "
              f"checkpoint {g['checkpoint_s']:.1f} s, "
              f"startup {g['startup_s']:.1f} s, other {g['other_s']:.1f} s")
    for att in job.get("attempts", []):
        print(f"attempt {att['attempt']}: {att['start_time']} .. {att['end_time'] or 'now'}"
              f"  {att['result'] or 'running'}")
        for replica, r in att["replicas"].items():
            codes = ",".join(str(c) for c in r["exit_codes"]) or "-"
            if "peer_restarts" in r:
                free = (f"(+{r['peer_restarts']} with a peer, "
                        f"+{r['maintenance_restarts']} maintenance)")
            else:   # a record from before the split
                free = f"(+{r['uncounted_restarts']} maintenance or with a peer)"
            print(f"  {replica:16} {r['status']:9} restarts {r['restarts']} {free}"
                  f"  exit codes {codes}")
    # One line per recovery: what it restored, from where, and what it cost. A record
    # written before job.json had them: read from the workers' telemetry.
    recoveries = job.get("recoveries")
    if recoveries is None:
        job_dir = args.job_dir.parent if args.job_dir.is_file() else args.job_dir
        try:
            recoveries = read_recoveries(job_dir, job)
        except (OSError, KeyError, TypeError, ValueError):
            recoveries = []   # the rest of the record is still worth printing
    for n, rec in enumerate(recoveries, 1):
        print(describe_recovery(n, rec, job.get("create_time")))
    if args.events:
        for e in map(Event.from_json, job.get("events", [])):
            print(f"  +{e.elapsed_s:9.3f}s  {e.message}")
    return 0


def _remote_status(args: argparse.Namespace) -> int:
    """`status` of a Vertex AI job: its record as the service has it, or followed."""
    from ..platform import submit as vertex
    from ..platform.aiplatform_types import CloudExtraMissing

    if args.events:
        print("resilient-train status: error: --events reads a job directory's record; a "
              "Vertex AI job's events are in its logs (the console link)", file=sys.stderr)
        return EXIT_USAGE
    if args.interval is not None and not args.follow:
        print("resilient-train status: error: --interval applies with --follow",
              file=sys.stderr)
        return EXIT_USAGE
    if args.follow:
        return _follow_remote(args.job_dir, args, "status")
    try:
        job = vertex.get(args.job_dir, endpoint=args.endpoint)
    except (CloudExtraMissing, vertex.VertexError) as exc:
        print(f"resilient-train status: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    doc = vertex.to_json(job)
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    name = vertex.parse_job_name(job.name or args.job_dir)
    print(f"job       {name}")
    print(f"display   {doc.get('displayName') or '-'}")
    print(f"state     {vertex.state_of(job)}")
    print(f"created   {doc.get('createTime') or '-'}")
    print(f"started   {doc.get('startTime') or '-'}")
    print(f"ended     {doc.get('endTime') or '-'}")
    if job.error.code or job.error.message:
        print(f"error     code {job.error.code}: {job.error.message}")
    print(f"console   {vertex.console_url(name)}")
    return 0


def _follow_remote(name: str, args: argparse.Namespace, cmd: str) -> int:
    """Print a line per state change of the Vertex AI job ``name`` until it ends (on
    stderr with --json, which prints the ended job on stdout); 0 if it SUCCEEDED."""
    from ..platform import submit as vertex
    from ..platform.aiplatform_types import CloudExtraMissing

    out = sys.stderr if getattr(args, "json", False) else sys.stdout

    def on_change(job: Any) -> None:
        print(f"{time.strftime('%H:%M:%S')} {vertex.state_of(job)}", file=out, flush=True)
        if job.error.code or job.error.message:
            print(f"error     code {job.error.code}: {job.error.message}", file=out, flush=True)

    interval = DEFAULT_INTERVAL_S if args.interval is None else args.interval
    try:
        job = vertex.follow(name, interval, on_change, endpoint=args.endpoint)
    except (CloudExtraMissing, vertex.VertexError) as exc:
        print(f"resilient-train {cmd}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"resilient-train {cmd}: stopped following; the job goes on: resilient-train "
              f"status {name}", file=sys.stderr)
        return 130
    if getattr(args, "json", False):
        print(json.dumps(vertex.to_json(job), indent=2))
    return 0 if vertex.state_of(job) == vertex.SUCCEEDED else EXIT_JOB_FAILED


def _report(args: argparse.Namespace) -> int:
    from ..observe.report import ReportError, write_report

    try:
        path = write_report(args.job_dir, args.output)
    except (ReportError, OSError) as exc:
        print(f"resilient-train report: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
