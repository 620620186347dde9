"""The platform's job states, its error messages and our exit statuses.

:func:`error_for` is the one place where a cause becomes the job's error: one table
(:data:`ERROR_TABLE`, cause -> termination reason and wording) in the platform's words
(docs/platform.md, "Error messages").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..platform.rules import Cause, Strategy


class JobState(str, Enum):
    QUEUED = "JOB_STATE_QUEUED"
    PENDING = "JOB_STATE_PENDING"
    RUNNING = "JOB_STATE_RUNNING"
    SUCCEEDED = "JOB_STATE_SUCCEEDED"
    FAILED = "JOB_STATE_FAILED"
    CANCELLING = "JOB_STATE_CANCELLING"
    CANCELLED = "JOB_STATE_CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


# google.rpc.Code values used in the job's `error`.
CODE_CANCELLED = 1
CODE_INVALID_ARGUMENT = 3  # user code failures, as the platform reports them
CODE_DEADLINE_EXCEEDED = 4
CODE_RESOURCE_EXHAUSTED = 8
CODE_INTERNAL = 13
CODE_UNAVAILABLE = 14  # infrastructure faults that outlasted the restart budgets

# The launcher's own exit status when the job did not succeed and no worker exit code
# is the root cause (docs/platform.md, "The launcher's exit status").
STATUS_OOM = 137
STATUS_STOCKOUT = 69   # EX_UNAVAILABLE
STATUS_INTERNAL = 70   # EX_SOFTWARE
STATUS_TIMEOUT = 124   # as timeout(1)
STATUS_CANCELLED = 130  # as a shell after Ctrl-C
# The job SUCCEEDED, but a --chaos fault set at a fixed time or step never fired: the
# resilience test did not happen, and a CI job must not pass for it (EX_CONFIG: the test's
# configuration does not fit the script or its length).
STATUS_FAULT_NOT_FIRED = 78

# Termination reasons of the causes that the error's message does not name.
REASON_OOM = "OutOfMemory"
REASON_STOCKOUT = "Stockout"
REASON_INTERNAL = "Internal"

# error.details[].reason of the ErrorInfo that names a lost peer as the likely cause.
REASON_PEER_LOST = "PEER_LOST"
ERROR_DOMAIN = "resilient-train.local"


@dataclass(frozen=True)
class JobError:
    """The job's ``error`` (a google.rpc status) plus the launcher's exit status."""

    code: int
    message: str
    exit_status: int
    # google.rpc.Status details: typed entries (here google.rpc.ErrorInfo) for a machine.
    details: tuple[Mapping[str, Any], ...] = ()
    # Why it ended, in one word (ERROR_TABLE's); a replica's exit names it in ``message``
    # ("Termination reason: NodeLost."). Not in the record: the platform's error has none.
    reason: str = ""

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"code": self.code, "message": self.message}
        if self.details:
            out["details"] = [dict(d) for d in self.details]
        return out


@dataclass(frozen=True)
class PeerLoss:
    """A replica's exit that likely followed from a peer's loss: the peer was lost
    ``seconds`` before, and the replica's log shows a failed peer connection."""

    peer: str
    peer_cause: str      # a Cause value, or "exit N" for a crash
    seconds: float
    connection_error: str
    restart_job_on_worker_restart: bool = False

    def line(self, exit_code: int) -> str:
        fixes = ["train under @rt.main (the survivors re-form in-process)",
                 "wrap main in @rt.record (a lost peer then exits 134 and the job is retried)"]
        if not self.restart_job_on_worker_restart:
            fixes.append("set scheduling.restartJobOnWorkerRestart "
                         "(--restart-job-on-worker-restart)")
        return (f"Likely cause: {self.peer} was lost {self.seconds:.1f} s earlier "
                f"({self.peer_cause}) and this replica's collective failed on its connection; "
                f"the platform fails a job for this exit {exit_code}. To recover instead: "
                + ", or ".join(fixes) + ".")

    def detail(self, replica: str) -> dict[str, Any]:
        # ErrorInfo's metadata is a map of strings.
        return {"@type": "type.googleapis.com/google.rpc.ErrorInfo",
                "reason": REASON_PEER_LOST, "domain": ERROR_DOMAIN,
                "metadata": {"replica": replica, "peer": self.peer,
                             "peer_cause": self.peer_cause,
                             "seconds_after_peer_loss": f"{self.seconds:.3f}",
                             "connection_error": self.connection_error}}


def user_code_error(replica: str, exit_code: int, reason: str = "Error",
                    excerpt: str | None = None, peer_loss: PeerLoss | None = None) -> JobError:
    message = (f"The replica {replica} exited with a non-zero status of {exit_code}. "
               f"Termination reason: {reason}.")
    if peer_loss is not None:   # right after the template, before the traceback
        message += "\n" + peer_loss.line(exit_code)
    if excerpt:
        message += "\n" + excerpt
    details = (peer_loss.detail(replica),) if peer_loss is not None else ()
    return JobError(CODE_INVALID_ARGUMENT, message, exit_code, details, reason)


def infrastructure_error(replica: str, exit_code: int, reason: str) -> JobError:
    """Node loss, preemption or maintenance after the budgets ran out: the user-code template
    (the platform's wording for a replica's exit), but not the user's fault, so not code 3."""
    return JobError(
        CODE_UNAVAILABLE,
        f"The replica {replica} exited with a non-zero status of {exit_code}. "
        f"Termination reason: {reason}.",
        exit_code or 1,
        reason=reason,
    )


def oom_error(replica: str, exit_code: int, excerpt: str | None = None) -> JobError:
    message = (f"The replica {replica} ran out of memory and exited with a non-zero status "
               f"of {exit_code}.")
    if excerpt:  # an accelerator OOM: the worker's traceback says which device and how much
        message += "\n" + excerpt
    return JobError(CODE_INVALID_ARGUMENT, message, STATUS_OOM, reason=REASON_OOM)


def stockout_error(region: str) -> JobError:
    return JobError(
        CODE_RESOURCE_EXHAUSTED,
        f"Resources are insufficient in region: {region}. "
        "Try a different region or use a different accelerator.",
        STATUS_STOCKOUT,
        reason=REASON_STOCKOUT,
    )


def internal_error() -> JobError:
    return JobError(CODE_INTERNAL, "Internal error occurred for the current attempt.",
                    STATUS_INTERNAL, reason=REASON_INTERNAL)


def timeout_error(timeout_s: float) -> JobError:
    return JobError(CODE_DEADLINE_EXCEEDED,
                    f"The job ran longer than its timeout of {timeout_s:g} s and was stopped.",
                    STATUS_TIMEOUT, reason="Timeout")


def cancelled_error() -> JobError:
    return JobError(CODE_CANCELLED, "The job was cancelled.", STATUS_CANCELLED,
                    reason="Cancelled")


# --- the one table: a cause -> the job's error ------------------------------------------

@dataclass(frozen=True)
class ErrorFacts:
    """What the wording of an error may name."""

    replica: str           # the replica whose end it was (the primary for a job-wide fault)
    exit_code: int
    excerpt: str | None    # the replica's traceback, when it left one
    peer_loss: PeerLoss | None
    region: str


@dataclass(frozen=True)
class ErrorWording:
    reason: str
    build: Callable[[ErrorFacts, str], JobError]   # (facts, reason) -> the error


def _replica_exit(f: ErrorFacts, reason: str) -> JobError:
    return user_code_error(f.replica, f.exit_code, reason, f.excerpt, f.peer_loss)


def _infrastructure(f: ErrorFacts, reason: str) -> JobError:
    # Not the user's code: the infrastructure's budgets ran out.
    return infrastructure_error(f.replica, f.exit_code, reason)


ERROR_TABLE: Mapping[Cause, ErrorWording] = {
    Cause.EXIT: ErrorWording("Error", _replica_exit),
    Cause.START_ERROR: ErrorWording("StartError", _replica_exit),
    Cause.OOM: ErrorWording(REASON_OOM, lambda f, _: oom_error(f.replica, f.exit_code,
                                                               f.excerpt)),
    Cause.STOCKOUT: ErrorWording(REASON_STOCKOUT, lambda f, _: stockout_error(f.region)),
    Cause.INTERNAL: ErrorWording(REASON_INTERNAL, lambda f, _: internal_error()),
    Cause.PREEMPTION: ErrorWording("Preempted", _infrastructure),
    Cause.NODE_LOSS: ErrorWording("NodeLost", _infrastructure),
    Cause.MAINTENANCE: ErrorWording("Maintenance", _infrastructure),
}

# A cause that the platform reports as another under a strategy: a Spot VM's preemption
# surfaces as a stockout (docs/platform.md, "Scheduling strategies").
SURFACES_AS: Mapping[tuple[Cause, Strategy], Cause] = {
    (Cause.PREEMPTION, Strategy.SPOT): Cause.STOCKOUT,
}


def error_for(cause: Cause, replica: str, exit_code: int | None = None,
              excerpt: str | None = None, peer_loss: PeerLoss | None = None,
              strategy: Strategy = Strategy.STANDARD, region: str = "local") -> JobError:
    """The job's error when ``cause`` ended it: ``exit_code`` None (a job-wide fault) reads
    as 1; ``peer_loss`` adds the "Likely cause" line to a replica's own exit."""
    cause = SURFACES_AS.get((cause, strategy), cause)
    wording = ERROR_TABLE[cause]
    facts = ErrorFacts(replica, 1 if exit_code is None else exit_code, excerpt, peer_loss,
                       region)
    return wording.build(facts, wording.reason)
