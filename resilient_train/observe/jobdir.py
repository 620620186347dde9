"""The job directory: ``job.json`` (rewritten atomically), per-attempt log paths, and the
record's ``recoveries`` (from the workers' restore events, :func:`job_recoveries`)."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shlex
import tempfile
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..text import first_line
from .events import Event, EventKind, epoch, iso
from .telemetry import RESTORE_SOURCES, RESTORE_TIERS, LifeTelemetry, Restore, read_life

JOB_FILE = "job.json"
SECRET_MASK = "***"


def write_json_atomic(path: Path, data: Any) -> None:
    """Write-to-temp, fsync, rename: a reader sees the old record or the new one, never half."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


# Bounds of what a job record can be. A real one is small: the README's demo writes 11 KB,
# and each fault adds about 1.5 KB of events and 1 KB of recovery (a job with 300
# maintenance events: 420 KB). 64 MiB is some 25,000 faults, more than a chaos stream's
# cap; a record larger is not one, and parsing it would cost gigabytes (317 MB: 5.8 GB,
# 61 s). It nests 6 levels deep (job_spec.platform.pools[].env); far deeper is no record,
# and deeper still ends Python's parser in a RecursionError.
MAX_RECORD_BYTES = 64 * 1024 * 1024
MAX_RECORD_DEPTH = 32


class JobRecordError(ValueError):
    """A ``job.json`` that is no job record this version can read (malformed, too large,
    nested too deep, unreadable): the message names the file, the problem and the fix."""


def read_job(job_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The job record in ``job_dir`` (or the ``job.json`` given itself): the one reader
    for ``status``, ``report``, ``export --from-job`` and ``checkpoints``. Raises
    FileNotFoundError when there is none, JobRecordError when it is not a record."""
    path = Path(job_dir)
    if path.is_dir():
        path = path / JOB_FILE
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            # Read at most one byte past the bound: a file whose size stat cannot tell
            # (a pipe, /proc) is bounded too.
            data = b"" if size > MAX_RECORD_BYTES else f.read(MAX_RECORD_BYTES + 1)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no job record at {path}; pass the job directory that 'resilient-train launch' "
            f"printed (it holds job.json){_jobs_below(path.parent)}") from None
    except OSError as exc:
        raise JobRecordError(f"{path}: cannot be read ({exc.strerror or exc}); check that "
                             f"it is a file you may read") from None
    if size > MAX_RECORD_BYTES or len(data) > MAX_RECORD_BYTES:
        raise _not_a_record(path, f"{format_bytes(max(size, len(data)))}, larger than any "
                            f"job record ({format_bytes(MAX_RECORD_BYTES)} at most)")
    try:
        job = json.loads(data)
    except RecursionError:
        raise _not_a_record(path, f"nested deeper than {MAX_RECORD_DEPTH} levels") from None
    except ValueError as exc:   # JSONDecodeError, UnicodeDecodeError
        raise _not_a_record(path, f"not valid JSON ({first_line(str(exc))[:200]})") from None
    if not isinstance(job, dict):
        raise _not_a_record(path, f"not a JSON object (a JSON {type(job).__name__})")
    if _deeper_than(job, MAX_RECORD_DEPTH):
        raise _not_a_record(path, f"nested deeper than {MAX_RECORD_DEPTH} levels")
    return job


def _not_a_record(path: Path, problem: str) -> JobRecordError:
    return JobRecordError(
        f"{path} is not a job record: {problem}. It was not written by 'resilient-train "
        f"launch', or was damaged since: pass the directory of a job that launch wrote (its "
        f"first line names it), or launch the job again")


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether JSON ``value`` nests more than ``limit`` lists and objects deep; without
    recursion, so that any depth the parser returned is measured."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        for child in children:
            if isinstance(child, (dict, list)):
                if depth >= limit:
                    return True
                stack.append((child, depth + 1))
    return False


def _jobs_below(parent: Path) -> str:
    """``rt-jobs`` given for a job: the newest job directories in it, to pick from."""
    try:
        jobs = sorted((d for d in parent.iterdir() if (d / JOB_FILE).is_file()),
                      key=lambda d: (d / JOB_FILE).stat().st_mtime, reverse=True)
    except OSError:
        return ""
    if not jobs:
        return ""
    more = f" and {len(jobs) - 3} older" if len(jobs) > 3 else ""
    return (f"; {parent} holds job directories: "
            f"{', '.join(str(d) for d in jobs[:3])}{more} (newest first)")


def log_path(job_dir: Path, attempt: int, replica: str) -> Path:
    return job_dir / "logs" / f"attempt-{attempt}" / f"{replica}.log"


def report_path(job_dir: Path, attempt: int, replica: str, restart: int) -> Path:
    return job_dir / "reports" / f"attempt-{attempt}" / f"{replica}.restart-{restart}.json"


def telemetry_prefix(job_dir: Path, attempt: int, replica: str, restart: int) -> Path:
    """Where one worker life reports its training progress (telemetry.py)."""
    return job_dir / "telemetry" / f"attempt-{attempt}" / f"{replica}.restart-{restart}"


def failures_path(job_dir: Path) -> Path:
    """The job's failure log, for the auto checkpoint interval (telemetry.ObservedMtbf)."""
    return job_dir / "telemetry" / "failures.json"


def telemetry_prefixes(job_dir: Path, replica: str) -> list[Path]:
    """Every life of ``replica`` that reported, in no particular order."""
    lives = (job_dir / "telemetry").glob(f"attempt-*/{replica}.restart-*.*")
    found = {p.with_suffix("") for p in lives if p.suffix in (".progress", ".jsonl")}
    return sorted(found)


@dataclass(frozen=True)
class TelemetryLife:
    """One worker life's telemetry files, as their path names it."""

    attempt: int
    replica: str
    restart: int
    prefix: Path


_ATTEMPT_DIR = re.compile(r"attempt-([0-9]+)")
_LIFE_FILE = re.compile(r"(.+)\.restart-([0-9]+)\.(?:jsonl|progress)")


def telemetry_lives(job_dir: Path) -> list[TelemetryLife]:
    """Every life of every replica that reported, by attempt, replica and restart."""
    found: dict[Path, TelemetryLife] = {}
    try:
        attempts = list(os.scandir(job_dir / "telemetry"))
    except FileNotFoundError:
        return []
    for att in attempts:
        m = _ATTEMPT_DIR.fullmatch(att.name)
        if m is None or not att.is_dir():
            continue
        for entry in os.scandir(att.path):
            f = _LIFE_FILE.fullmatch(entry.name)
            if f is not None:
                prefix = Path(att.path) / f"{f.group(1)}.restart-{f.group(2)}"
                found[prefix] = TelemetryLife(int(m.group(1)), f.group(1), int(f.group(2)),
                                              prefix)
    return sorted(found.values(), key=lambda life: (life.attempt, life.replica, life.restart))


def processes_path(job_dir: Path) -> Path:
    """The worker processes the launcher has seen, one line each (watchdog.py reads it)."""
    return job_dir / "processes.log"


# --- secrets in what is recorded ---------------------------------------------------------
#
# A name is secret when one of its words is, or ends in, token, key, secret, password,
# passwd or auth. Words: split at every non-alphanumeric and at camelCase, so API_KEY,
# api-key, apiKey, HFToken, AWS_SECRET_ACCESS_KEY and basic-auth are secret; keep_last,
# tokenizer, max_tokens, keyword, author are not. A compound ending in a secret word is
# secret too (apikey, authtoken, oauth), and so monkey is: masking too much costs only a
# less readable record.
_SECRET_WORDS = ("token", "key", "secret", "password", "passwd", "auth")
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
_OPTION = re.compile(r"(-{1,2})([A-Za-z0-9][\w.-]*)(=.*)?", re.DOTALL)    # --name[=value]
_ASSIGNMENT = re.compile(r"([+~]*[A-Za-z_][\w.-]*)=.*", re.DOTALL)        # NAME=value
# A URL's password (scheme://user:PASSWORD@host), and a query parameter (?NAME=VALUE).
# The scheme starts where no scheme character precedes it: a search is linear in the text.
_URL_PASSWORD = re.compile(
    r"(?<![A-Za-z0-9+.-])([A-Za-z][A-Za-z0-9+.-]*://[^\s/:@]*):[^\s/@]*@")
_QUERY_PARAMETER = re.compile(r"(?<=[?&])([A-Za-z_][\w.-]*)=([^&#\s'\"]*)")
# The short option that is the password, for the programs where it is one: elsewhere -p
# is mkdir's parents, ssh's port, a training script's print frequency.
_PASSWORD_FLAGS = {
    **dict.fromkeys(("mysql", "mysqldump", "mysqladmin", "mysqlimport", "mysqlshow",
                     "mysqlcheck", "mariadb", "mariadb-dump", "mongo", "mongosh", "sshpass",
                     "7z", "7za"), "-p"),
    "redis-cli": "-a", "zip": "-P", "unzip": "-P",
}
# A word of a shell string: unquoted characters, '...', "..." and \x, run together; the
# operators between words (; & | < > ( ) and newlines) end a command.
_SHELL_WORD = re.compile(r"""(?:[^\s'"\\;&|<>()]+|'[^']*'|"(?:[^"\\]|\\.)*"|\\.)+""",
                         re.DOTALL)
_SHELL_PART = re.compile(r"""'([^']*)'|"((?:[^"\\]|\\.)*)"|\\(.)|([^'"\\]+)""", re.DOTALL)
_COMMAND_END = re.compile(r"[;&|()\n]")


def is_secret_name(name: str) -> bool:
    """Whether a variable or option called ``name`` holds a secret (see the rule above)."""
    return any(word.lower().endswith(_SECRET_WORDS) for word in _WORD.findall(name))


def mask_command(argv: Iterable[str]) -> list[str]:
    """``argv`` with its secrets replaced by ``***``: the values of secret options and
    assignments (``--token=V``, ``--api-key V``, ``-password V``, ``API_KEY=V``, ``env
    API_KEY=V cmd``, Hydra's ``db.password=V``), a URL's password (``https://user:***@host``)
    and secret query parameters, the password flag of the programs that have one
    (``mysql -p***``, ``sshpass -p ***``), and all of these inside a shell string (an
    argument with spaces: ``bash -c "... --token=V"``), whose other words are kept as
    written. After a secret option without ``=``, the next argument is its value unless it
    is another long option (``--...``).

    The one function for every place that records or shows a job's command (job.json,
    the report, the platform's job in the record); applying it twice changes nothing."""
    out: list[str] = []
    value_next = False
    password_flag: str | None = None   # the -p of a program named earlier
    for arg in map(str, argv):
        if value_next:
            value_next = False
            if not arg.startswith("--"):
                out.append(SECRET_MASK)
                continue
        password_flag = _PASSWORD_FLAGS.get(os.path.basename(arg), password_flag)
        if password_flag is not None and arg.startswith(password_flag):
            if arg == password_flag:
                value_next = True
                out.append(arg)
            else:   # attached: mysql -pPASSWORD
                out.append(password_flag + SECRET_MASK)
            continue
        option = _OPTION.fullmatch(arg)
        if option is not None and is_secret_name(option.group(2)):
            if option.group(3) is None:
                value_next = True
                out.append(arg)
            else:
                out.append(f"{option.group(1)}{option.group(2)}={SECRET_MASK}")
            continue
        assignment = _ASSIGNMENT.fullmatch(arg) if option is None else None
        if assignment is not None and is_secret_name(assignment.group(1)):
            out.append(f"{assignment.group(1)}={SECRET_MASK}")
            continue
        if any(c.isspace() for c in arg):
            arg = _mask_shell(arg)
        out.append(_mask_url(arg))
    return out


def mask_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` as recorded: the value of a secret name is ``***``, a URL's password in any
    other value too (``DATABASE_URL=postgres://me:***@host/db``)."""
    return {name: SECRET_MASK if is_secret_name(name) else mask_command([value])[0]
            for name, value in env.items()}


def holds_mask(values: Iterable[str]) -> bool:
    """Whether what :func:`mask_command` or :func:`mask_env` recorded lost a secret."""
    return any(SECRET_MASK in str(v) for v in values)


def _mask_url(text: str) -> str:
    text = _URL_PASSWORD.sub(rf"\1:{SECRET_MASK}@", text)
    return _QUERY_PARAMETER.sub(lambda m: f"{m.group(1)}={SECRET_MASK}"
                                if is_secret_name(m.group(1)) else m.group(0), text)


def _mask_shell(text: str) -> str:
    """A shell string with :func:`mask_command` applied to each command's words; a word
    that changes is written unquoted (quoted again where it holds spaces: a string in the
    string), every other character as it was."""
    words = list(_SHELL_WORD.finditer(text))
    commands: list[list[re.Match[str]]] = []
    previous = 0
    for word in words:
        if not commands or _COMMAND_END.search(text, previous, word.start()):
            commands.append([])
        commands[-1].append(word)
        previous = word.end()
    out, done = [], 0
    for command in commands:
        values = [_unquote(w.group()) for w in command]
        for word, value, masked in zip(command, values, mask_command(values)):
            if masked != value:
                out += [text[done:word.start()],
                        shlex.quote(masked) if any(c.isspace() for c in masked) else masked]
                done = word.end()
    return "".join(out) + text[done:]


def _unquote(word: str) -> str:
    """A shell word's value: its quotes and backslashes removed."""
    out = []
    for part in _SHELL_PART.finditer(word):
        single, double, escaped, plain = part.groups()
        if double is not None:
            out.append(re.sub(r"\\(.)", r"\1", double, flags=re.DOTALL))
        else:
            out.append(next(g for g in (single, escaped, plain) if g is not None))
    return "".join(out)


# --- recoveries: what each one restored, from where, and what it cost ---------------------
#
# Every rank writes one restore event per life, or per in-process re-forming of the group
# (telemetry.Restore). The events of one recovery share (attempt, generation, round): the
# survivors re-form at the next generation and a restarted worker joins it (round 0), and a
# job retry starts again at generation 0 of the next attempt. Lives that all start afresh
# within one attempt (the only worker restarted, or every worker under
# restartJobOnWorkerRestart) each begin at generation 0 again: the round, a replica's
# n-th life in the attempt, tells those restarts apart.

# Decisions after which the job goes on: each is followed by a restore somewhere.
_ENDING_ACTIONS = frozenset({"succeed_job", "worker_done", "fail_job"})
_FAULT_KINDS = (EventKind.FAULT, EventKind.STOCKOUT, EventKind.TIMEOUT)


def job_recoveries(lives: Iterable[tuple[TelemetryLife, LifeTelemetry]],
                   events: Sequence[Event], replicas: Sequence[str],
                   first_attempt: int = 1) -> list[dict[str, Any]]:
    """The record's ``recoveries``: one entry per (attempt, generation, round) with restores,
    in time order, except the job's first start (the first restores of ``first_attempt``,
    every rank starting afresh: generation 0, or a later one where forming the group failed
    first and the ranks formed the next). Pure: the telemetry and the events in, JSON out."""
    # Per recovery, per (replica, rank): the processes of a replica (torchrun on a
    # multi-GPU machine) share its telemetry, and each says where its own state came from.
    groups: dict[tuple[int, int, int], dict[tuple[str, int | None], Restore]] = {}
    reached: list[tuple[float, int]] = []   # (when a segment reached its last step, step)
    lives = sorted(lives, key=lambda lt: (lt[0].attempt, lt[0].replica, lt[0].restart))
    rounds = {life: n for _, same in itertools.groupby(
        (life for life, _ in lives), key=lambda life: (life.attempt, life.replica))
        for n, life in enumerate(same)}
    for life, tel in lives:
        for r in tel.restores:
            key = (life.attempt, r.generation, rounds[life] if r.generation == 0 else 0)
            group = groups.setdefault(key, {})
            old = group.get((life.replica, r.rank))
            # A replica restarted twice within one generation: the later restore is the
            # one it trained from.
            if old is None or r.t >= old.t:
                group[life.replica, r.rank] = r
        reached += [(s.t_last if s.t_last is not None else s.t_start, s.last_step)
                    for s in tel.segments]
    order = {name: i for i, name in enumerate(replicas)}
    at_of = {key: min(r.t for r in by_rank.values()) for key, by_rank in groups.items()}
    causes = _decisions_by_recovery(events, groups, at_of)
    out: list[dict[str, Any]] = []
    used: set[int] = set()   # faults already put down to a recovery
    prev_at = -math.inf
    for key in sorted(groups, key=lambda k: (at_of[k], k)):
        attempt, generation, round_ = key
        by_rank, at = groups[key], at_of[key]
        if attempt == first_attempt and prev_at == -math.inf and round_ == 0 and all(
                r.source == "none" for r in by_rank.values()):
            prev_at = at   # the job's first start: no recovery, but a bound for the next
            continue
        found = causes.get(key) or _fault_noted(events, at, prev_at, used)
        step = min(r.step for r in by_rank.values())
        # The steps lost: the furthest any rank got between the previous restore and this
        # one (a SIGKILLed life's last step is in its progress record), less the step
        # restored. Earlier stretches do not count: they were lost or kept before.
        before = [s for t, s in reached if prev_at < t <= at]
        seconds = [r.seconds for r in by_rank.values() if r.seconds is not None]
        ranks = [{"replica": name, "rank": r.rank, "source": r.source,
                  "from_rank": r.from_rank, "step": r.step, "bytes_read": r.read,
                  "seconds": None if r.seconds is None else round(r.seconds, 3),
                  "reason": r.reason}
                 for (name, _), r in sorted(by_rank.items(), key=lambda kv: (
                     order.get(kv[0][0], len(order)), kv[0][0], kv[1].rank or 0))]
        total: Counter[str] = Counter(dict.fromkeys(RESTORE_TIERS, 0))
        for r in by_rank.values():
            total.update(r.read)
        faults = [_fault_json(events, i) for i in found]
        out.append({
            "attempt": attempt, "generation": generation, "at": iso(at),
            "fault": faults[0] if faults else None, "faults": faults,
            "step": step,
            "steps_lost": max(0, max(before) - step) if before else None,
            "seconds": round(max(seconds), 3) if seconds else None,
            "ranks": ranks, "bytes_read": dict(total),
        })
        prev_at = at
    return out


def _decisions_by_recovery(events: Sequence[Event],
                           groups: Mapping[tuple[int, int, int], Mapping[tuple[str, int | None],
                                                                        Restore]],
                           at_of: Mapping[tuple[int, int, int], float],
                           ) -> dict[tuple[int, int, int], list[int]]:
    """Each decision to go on (restart a worker, retry the job), as indexes into ``events``,
    under the recovery it caused: a restarted replica's next restore is in that recovery
    (two workers lost together both join the next generation, and a second fault before
    the first one's restore can be a recovery of its own); any other decision, the first
    recovery after it."""
    restores = sorted((r.t, name, key) for key, by_rank in groups.items()
                      for (name, _), r in by_rank.items())
    by_time = sorted((t, key) for key, t in at_of.items())
    out: dict[tuple[int, int, int], list[int]] = {}
    for i, e in enumerate(events):
        if e.kind is not EventKind.DECISION or e.action is None or e.action in _ENDING_ACTIONS:
            continue
        key = next((k for t, name, k in restores
                    if t > e.time and name == e.replica and e.action == "restart_worker"
                    and e.attempt in (None, k[0])), None)
        if key is None:
            # A job retry's recovery is the next attempt's (a survivor may still re-form
            # in the old attempt before the retry stops it).
            after = e.attempt if e.action == "retry_job" and e.attempt is not None else -1
            key = next((k for t, k in by_time if t > e.time and k[0] > after), None)
        if key is not None:
            out.setdefault(key, []).append(i)
    return out


def _fault_noted(events: Sequence[Event], at: float, prev_at: float,
                 used: set[int]) -> list[int]:
    """A recovery that no decision caused (the group re-formed on its own): the first fault
    noted since the previous recovery, if any."""
    for i, e in enumerate(events):
        if e.kind in _FAULT_KINDS and prev_at < e.time <= at and i not in used:
            used.add(i)
            return [i]
    return []


def _fault_json(events: Sequence[Event], i: int) -> dict[str, Any]:
    """The cause as the record's ``fault``: the replica (None: the whole job), its cause
    and exit status, the action taken, and the launcher's line for it."""
    e = events[i]
    shown = e
    exit_code: int | None = None
    if e.kind is EventKind.DECISION and e.replica is not None:
        # The exit this decision answers was recorded just before it.
        for prev in reversed(events[:i]):
            if prev.kind is EventKind.DECISION:
                break
            if prev.kind is EventKind.EXITED and prev.replica == e.replica:
                shown, exit_code = prev, prev.exit_code
                break
    return {"time": iso(shown.time), "replica": e.replica, "cause": e.cause or e.fault,
            "exit_code": exit_code,
            "action": e.action if e.kind is EventKind.DECISION else None,
            "message": shown.message}


def read_recoveries(job_dir: Path, job: Mapping[str, Any]) -> list[dict[str, Any]]:
    """:func:`job_recoveries` of a job directory, for a record written without them."""
    events = [Event.from_json(e) for e in job.get("events") or []]
    attempts = job.get("attempts") or []
    first = int(attempts[0].get("attempt", 1)) if attempts else 1
    return job_recoveries(((life, read_life(life.prefix)) for life in telemetry_lives(job_dir)),
                          events, [str(r) for r in job.get("replicas") or []], first)


def format_bytes(n: float) -> str:
    """A byte count for a person: 0 B, 512 B, 5.0 MiB, 1.2 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def fault_words(fault: Mapping[str, Any] | None) -> str:
    """A recovery's cause for a person: ``workerpool1-0 node_loss (exit 137)``,
    ``workerpool1-0 exit 134``, ``internal (whole job)``."""
    if not fault:
        return "no fault recorded"
    cause, code, replica = fault.get("cause"), fault.get("exit_code"), fault.get("replica")
    if not replica:
        return f"{cause or 'a fault'} (whole job)"
    what = str(replica)
    if cause and cause != "exit":
        what += f" {cause}"
    if code is not None:
        what += f" (exit {code})" if cause and cause != "exit" else f" exit {code}"
    return what


def causes_words(rec: Mapping[str, Any]) -> str:
    """A recovery's causes for a person: each fault (two workers lost together are one
    recovery), as :func:`fault_words` says it. A record an older version wrote has only
    ``fault``."""
    faults = rec.get("faults") or [rec.get("fault")]
    words = [fault_words(f) for f in faults]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def rank_names(rec: Mapping[str, Any]) -> list[str]:
    """A name for each of a recovery's ``ranks``: its replica's, and its rank where the
    replica runs several processes (``workerpool1-0 rank 1``)."""
    ranks = rec.get("ranks") or []
    several = len(ranks) > len({r.get("replica") for r in ranks})
    return [f"{r.get('replica')} rank {r['rank']}"
            if several and r.get("rank") is not None else str(r.get("replica"))
            for r in ranks]


def source_counts(rec: Mapping[str, Any]) -> str:
    """Where the ranks' states came from: ``peer x2, persistent x1``."""
    counts = Counter(str(r.get("source")) for r in rec.get("ranks") or [])
    order = [s for s in RESTORE_SOURCES if s in counts] + sorted(set(counts) - set(RESTORE_SOURCES))
    return ", ".join(f"{s} x{counts[s]}" for s in order)


def describe_recovery(n: int, rec: Mapping[str, Any], created: str | None = None) -> str:
    """One line for a person about the record's ``recoveries`` entry number ``n``."""
    when = ""
    t, t0 = epoch(rec.get("at")), epoch(created)
    if t is not None and t0 is not None:
        when = f" at +{t - t0:.1f} s"
    lost = rec.get("steps_lost")
    line = (f"recovery {n}: attempt {rec.get('attempt')} gen {rec.get('generation')}{when} "
            f"after {causes_words(rec)}: step {rec.get('step')}")
    if lost is not None:
        line += f" (lost {lost} step{'' if lost == 1 else 's'})"
    if rec.get("seconds") is not None:
        # The ranks' restore alone: training stood still longer (the fault noticed, the
        # restart, the group re-formed), which the goodput's recovery time counts.
        line += f", restore {rec['seconds']:.2f} s (slowest rank's transfer/read)"
    line += f"; ranks from {source_counts(rec) or 'nowhere'}"
    read = rec.get("bytes_read") or {}
    if read:
        line += "; read " + ", ".join(f"{tier} {format_bytes(float(b or 0))}"
                                      for tier, b in read.items())
    reasons = list(dict.fromkeys(first_line(r.get("reason")) for r in rec.get("ranks") or []
                                 if r.get("reason")))
    if reasons:
        line += "; why not faster: " + " / ".join(reasons[:3])
        if len(reasons) > 3:
            line += f" / +{len(reasons) - 3} more"
    return line
