"""The job's capacity: its lease of the machine-wide quota (``quota.py``), asked for, waited
for and given back, and the GPUs each replica gets from it.

The job machine asks for capacity (``RequestCapacity``) and gives it back
(``ReleaseCapacity``); :class:`CapacityLease` holds the lease in between. While the request
waits, the supervision loop calls :meth:`CapacityLease.poll` (and :meth:`CapacityLease.wake`
says how soon); a job that waits says why, once per wait.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..platform.rules import Strategy
from .job import Command, JobMachine
from .messages import JobState
from .quota import Lease, LocalQuota, Request

__all__ = ["CapacityLease"]

# How often a waiting request is tried again.
_RETRY_S = 0.25


class CapacityLease:
    """One job's request of the quota and the lease it holds.

    ``echo(line)`` prints a launcher line; ``execute(commands)`` carries out the job
    machine's commands (the first attempt, once the quota is granted)."""

    def __init__(self, quota: LocalQuota, request: Request, job_id: str, machine: JobMachine,
                 echo: Callable[[str], None],
                 execute: Callable[[Sequence[Command]], None]) -> None:
        self.quota = quota
        self.request = request
        self._job_id = job_id
        self._machine = machine
        self._echo = echo
        self._execute = execute
        self.lease: Lease | None = None
        self.wanted = False          # a request waits for the quota
        self._note_shown = False     # this wait has said why it waits

    def ask(self, now: float) -> list[Command]:
        """The machine asks for capacity: try at once; the commands that follow a grant
        (or a stockout) are returned for the caller's queue."""
        self.wanted = True
        return self._try(now)

    def poll(self, now: float) -> None:
        """Try a waiting request again."""
        if self.wanted:
            self._execute(self._try(now))

    def wake(self, now: float) -> float | None:
        return _RETRY_S if self.wanted else None

    def release(self) -> None:
        """The job is over (or the launcher is): give the lease back."""
        self.wanted = False
        if self.lease is not None:
            self.quota.release(self.lease)
            self.lease = None

    def gpu_ids(self, first: int, count: int) -> tuple[int, ...] | None:
        """The GPUs of a replica that needs ``count`` and whose GPUs follow the ``first``
        that the replicas before it (in rank order) have; None: the replicas see whatever
        the machine has (no GPUs are managed here)."""
        if self.lease is not None and count:
            return self.lease.gpu_ids[first:first + count]
        if self.quota.capacity.gpu_ids:
            return ()   # a replica without accelerators sees none, as on the platform
        return None

    def _try(self, now: float) -> list[Command]:
        cmds: list[Command] = []
        quota, request, m = self.quota, self.request, self._machine
        if self.lease is None and request != Request():
            if not quota.fits_ever(request):
                cmds = m.no_capacity(now)
                # Only a job that waits (flex-start) says so; the others fail as a stockout.
                if m.state is JobState.QUEUED and not self._note_shown \
                        and m.config.strategy is Strategy.FLEX_START:
                    self._note_shown = True
                    self._echo(f"[launcher] waiting for capacity: the job asks for "
                               f"{request.gpus} GPUs / {request.cpu_slots} CPU slots, "
                               f"this machine has {len(quota.capacity.gpu_ids)} / "
                               f"{quota.capacity.cpu_slots}")
            else:
                self.lease = quota.try_acquire(self._job_id, request)
                if self.lease is None and not self._note_shown:
                    self._note_shown = True
                    held = ", ".join(f"{lease.job_id} ({len(lease.gpu_ids)} GPUs, "
                                     f"{lease.cpu_slots} slots)" for lease in quota.usage())
                    self._echo(f"[launcher] queued: the quota is in use by "
                               f"{held or 'other jobs'}")
        if self.lease is not None or request == Request():
            self.wanted = False
            self._note_shown = False
            cmds = m.quota_granted(now)
        return cmds
