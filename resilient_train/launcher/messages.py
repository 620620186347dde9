"""The platform's job states, error messages (PLATFORM.md section 3) and our exit statuses."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


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
# is the root cause (documented in the README).
STATUS_OOM = 137
STATUS_STOCKOUT = 69   # EX_UNAVAILABLE
STATUS_INTERNAL = 70   # EX_SOFTWARE
STATUS_TIMEOUT = 124   # as timeout(1)
STATUS_CANCELLED = 130  # as a shell after Ctrl-C


@dataclass(frozen=True)
class JobError:
    """The job's ``error`` (a google.rpc status) plus the launcher's exit status."""

    code: int
    message: str
    exit_status: int

    def to_json(self) -> dict[str, object]:
        return {"code": self.code, "message": self.message}


def user_code_error(replica: str, exit_code: int, reason: str = "Error",
                    excerpt: str | None = None) -> JobError:
    message = (f"The replica {replica} exited with a non-zero status of {exit_code}. "
               f"Termination reason: {reason}.")
    if excerpt:
        message += "\n" + excerpt
    return JobError(CODE_INVALID_ARGUMENT, message, exit_code)


def infrastructure_error(replica: str, exit_code: int, reason: str) -> JobError:
    """Node loss, preemption or maintenance after the budgets ran out: the user-code template
    (the platform's wording for a replica's exit), but not the user's fault, so not code 3."""
    return JobError(
        CODE_UNAVAILABLE,
        f"The replica {replica} exited with a non-zero status of {exit_code}. "
        f"Termination reason: {reason}.",
        exit_code or 1,
    )


def oom_error(replica: str, exit_code: int, excerpt: str | None = None) -> JobError:
    message = (f"The replica {replica} ran out of memory and exited with a non-zero status "
               f"of {exit_code}.")
    if excerpt:  # an accelerator OOM: the worker's traceback says which device and how much
        message += "\n" + excerpt
    return JobError(CODE_INVALID_ARGUMENT, message, STATUS_OOM)


def stockout_error(region: str) -> JobError:
    return JobError(
        CODE_RESOURCE_EXHAUSTED,
        f"Resources are insufficient in region: {region}. "
        "Try a different region or use a different accelerator.",
        STATUS_STOCKOUT,
    )


def internal_error() -> JobError:
    return JobError(CODE_INTERNAL, "Internal error occurred for the current attempt.",
                    STATUS_INTERNAL)


def timeout_error(timeout_s: float) -> JobError:
    return JobError(CODE_DEADLINE_EXCEEDED,
                    f"The job ran longer than its timeout of {timeout_s:g} s and was stopped.",
                    STATUS_TIMEOUT)


def cancelled_error() -> JobError:
    return JobError(CODE_CANCELLED, "The job was cancelled.", STATUS_CANCELLED)
