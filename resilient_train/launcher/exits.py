"""From a process's end to its cause: the one place where an exit is classified.

The process layer (``processes.Worker.exit``) records what it saw and did itself as one
:class:`ProcessExit`; :func:`classify_exit`, a pure function, turns it into a
:class:`Verdict` (the cause the restart policy matches on). The policy turns the cause into
an action (``policy.py``), and one table turns a cause into the job's error
(``messages.error_for``). The shapes are TorchElastic's ``RunResult`` (what ended, how) and
Kubernetes' podFailurePolicy (match on exit codes and conditions, in order).

The rules, first match wins (docs/platform.md, "Why a worker ended"):

1. the command could not be started (exec failed): ``start_error``, status 128;
   the launcher could not create the process at all: ``internal``;
2. the launcher ended it on purpose (a chaos fault, the memory limit): that cause;
3. its own error report says it ran out of memory (``torch.OutOfMemoryError``) and it
   exited non-zero: ``oom``;
4. it died of SIGKILL, SIGTERM, SIGHUP or SIGINT that the launcher did not send: the
   kernel's OOM killer when the kernel's count of OOM kills rose during its life (``oom``),
   else someone killed it from outside, which the platform sees as a lost node
   (``node_loss``);
5. anything else is the program's own exit (``exit``) with its status: a code, or 128+N
   for a signal it raised at itself (SIGABRT, SIGSEGV) or that the launcher's stop sent.

A wrapper shell (``bash -c "python train.py"``) whose child was SIGKILLed does not die of a
signal: it *exits* with status 137. We take that as what it is, an exit with a status, as
the platform does (it sees only the container's exit status, and its table of transient
codes is written in statuses: 134 and 139 are SIGABRT and SIGSEGV). The one exception is
the kernel's OOM killer, which leaves evidence of its own: status 137 while the kernel's
OOM-kill count rose is ``oom``, whoever reported it.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from ..errors import exit_code_for
from ..platform.rules import Cause
from .messages import STATUS_INTERNAL

__all__ = ["OUTSIDE_SIGNALS", "ProcessExit", "Verdict", "classify_exit"]

# Deaths by these signals, unless the launcher sent them, are kills from outside; SIGABRT
# and SIGSEGV are crashes (transient codes 134, 139), other signals the program's own.
OUTSIDE_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGHUP, signal.SIGINT})
# The shell's status for a process killed by SIGKILL (the OOM killer's signal).
_SIGKILL_STATUS = 128 + signal.SIGKILL


@dataclass(frozen=True)
class ProcessExit:
    """What the process layer knows about one replica process's end."""

    replica: str
    time: float
    # Popen's returncode: the exit code, or -N for death by signal N. None when no process
    # was created (then ``start_error`` or ``spawn_error`` says why).
    returncode: int | None
    # The cause the launcher gave it when it ended the process on purpose: a chaos fault
    # (node_loss, preemption, maintenance, oom, ...) or the memory limit (oom).
    injected: Cause | None = None
    # The launcher sent it a signal of its own (a stop's SIGTERM, a grace-period SIGKILL):
    # its death by that signal is no mystery.
    signalled: bool = False
    start_error: str | None = None    # exec failed: "cannot start 'x': No such file..."
    spawn_error: str | None = None    # the launcher could not create a process at all
    reported_oom: bool = False        # its error report says torch ran out of memory
    kernel_oom_kills_rose: bool = False  # /proc/vmstat's oom_kill grew during its life
    step: int | None = None           # the last step it reported, if any


@dataclass(frozen=True)
class Verdict:
    """The classification of one exit: the cause the policy matches, the status it goes
    by, and, for a fault the launcher observed rather than caused, a line saying so and the
    fault's kind (the FAULT event's ``fault``: "kill" or "oom")."""

    cause: Cause
    exit_code: int
    observed: str | None = None   # "killed by SIGKILL from outside the launcher: a node loss"
    fault: str | None = None


def classify_exit(e: ProcessExit) -> Verdict:
    """The cause of one process's end (the rules in the module's docstring)."""
    if e.returncode is None:
        if e.start_error is not None:
            return Verdict(Cause.START_ERROR, 128)
        return Verdict(Cause.INTERNAL, STATUS_INTERNAL)
    code = exit_code_for(e.returncode)
    if e.injected is not None:
        return Verdict(e.injected, code)
    if e.reported_oom and code != 0:
        return Verdict(Cause.OOM, code)
    died_of = -e.returncode if e.returncode < 0 else None
    if died_of in OUTSIDE_SIGNALS and not e.signalled:
        name = signal.Signals(died_of).name
        if died_of == signal.SIGKILL and e.kernel_oom_kills_rose:
            return Verdict(Cause.OOM, code, "killed by the kernel's out-of-memory killer "
                                            "(SIGKILL; the machine ran out of memory)", "oom")
        return Verdict(Cause.NODE_LOSS, code,
                       f"killed by {name} from outside the launcher: a node loss", "kill")
    if code == _SIGKILL_STATUS and e.kernel_oom_kills_rose and not e.signalled:
        return Verdict(Cause.OOM, code, "exited with status 137 while the kernel's "
                                        "out-of-memory killer killed a process: out of memory",
                       "oom")
    return Verdict(Cause.EXIT, code)
