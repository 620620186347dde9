"""A fake Vertex AI JobService on 127.0.0.1: a real gRPC server that records each request
and plays back a scripted list of states per job.

It serves the two methods ``resilient-train submit`` and ``status`` call, CreateCustomJob
and GetCustomJob of ``google.cloud.aiplatform.v1.JobService``, with aiplatform_v1's own
request and response classes on the wire, so the real client (pointed at it with
``--endpoint 127.0.0.1:PORT``) cannot tell it from the service. Each GetCustomJob of a job
moves it one step along its script; the last state stays. A job whose script ends in
JOB_STATE_FAILED carries the script's ``error`` (a google.rpc Status).
"""

from __future__ import annotations

import datetime as _dt
import itertools
import threading
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.cloud import aiplatform_v1
from google.rpc import status_pb2

SERVICE = "google.cloud.aiplatform.v1.JobService"
SUCCEEDS = ("JOB_STATE_QUEUED", "JOB_STATE_PENDING", "JOB_STATE_RUNNING",
            "JOB_STATE_SUCCEEDED")
FAILS = ("JOB_STATE_QUEUED", "JOB_STATE_PENDING", "JOB_STATE_RUNNING", "JOB_STATE_FAILED")
_TERMINAL = {"JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED", "JOB_STATE_CANCELLED",
             "JOB_STATE_EXPIRED", "JOB_STATE_PARTIALLY_SUCCEEDED"}


@dataclass
class FakeJob:
    """One job the fake holds: its message, its script and how far along it is."""

    job: aiplatform_v1.CustomJob
    states: tuple[str, ...]
    error: tuple[int, str] | None = None
    step: int = 0
    gets: int = 0           # GetCustomJob calls answered for it


@dataclass
class Call:
    """A request the fake received: the method, the request message, its metadata."""

    method: str
    request: Any
    metadata: dict[str, str] = field(default_factory=dict)


class FakeJobService:
    """The fake service. ``script`` and ``error`` decide the states of the jobs created
    next; ``add_job`` holds a job without a create; ``fail_next`` answers the next call
    with a gRPC error instead."""

    def __init__(self, script: Sequence[str] = SUCCEEDS,
                 error: tuple[int, str] | None = None) -> None:
        self.script = tuple(script)
        self.error = error
        self.calls: list[Call] = []
        self.jobs: dict[str, FakeJob] = {}
        self.fail_next: tuple[grpc.StatusCode, str] | None = None
        self._ids = itertools.count(1000)
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None
        self.port = 0

    # --- the server -----------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> FakeJobService:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        handlers = {
            "CreateCustomJob": grpc.unary_unary_rpc_method_handler(
                self._create,
                request_deserializer=aiplatform_v1.CreateCustomJobRequest.deserialize,
                response_serializer=aiplatform_v1.CustomJob.serialize),
            "GetCustomJob": grpc.unary_unary_rpc_method_handler(
                self._get,
                request_deserializer=aiplatform_v1.GetCustomJobRequest.deserialize,
                response_serializer=aiplatform_v1.CustomJob.serialize),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE,
                                                                              handlers),))
        self.port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait(5)
            self._server = None

    # --- what the tests read and set --------------------------------------------------

    def requests(self, method: str) -> list[Any]:
        with self._lock:
            return [c.request for c in self.calls if c.method == method]

    def add_job(self, name: str, states: Sequence[str],
                error: tuple[int, str] | None = None) -> str:
        """A job the service already has (as if created elsewhere), at its first state."""
        job = aiplatform_v1.CustomJob(name=name, display_name=name.rsplit("/", 1)[-1])
        job.create_time = _now()
        with self._lock:
            self.jobs[name] = FakeJob(job, tuple(states), error)
            self._apply(self.jobs[name])
        return name

    # --- the methods ------------------------------------------------------------------

    def _record(self, method: str, request: Any, context: grpc.ServicerContext) -> None:
        metadata = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        self.calls.append(Call(method, request, metadata))
        if self.fail_next is not None:
            code, message = self.fail_next
            self.fail_next = None
            context.abort(code, message)

    def _create(self, request: aiplatform_v1.CreateCustomJobRequest,
                context: grpc.ServicerContext) -> aiplatform_v1.CustomJob:
        with self._lock:
            self._record("CreateCustomJob", request, context)
            name = f"{request.parent}/customJobs/{next(self._ids)}"
            job = aiplatform_v1.CustomJob(request.custom_job)
            job.name = name
            job.create_time = _now()
            self.jobs[name] = FakeJob(job, self.script, self.error)
            self._apply(self.jobs[name])
            return job

    def _get(self, request: aiplatform_v1.GetCustomJobRequest,
             context: grpc.ServicerContext) -> aiplatform_v1.CustomJob:
        with self._lock:
            self._record("GetCustomJob", request, context)
            held = self.jobs.get(request.name)
            if held is None:
                context.abort(grpc.StatusCode.NOT_FOUND, f"CustomJob {request.name} not found")
            # The first get sees the state the create returned; each later one the next.
            if held.gets:
                held.step = min(held.step + 1, len(held.states) - 1)
                self._apply(held)
            held.gets += 1
            return held.job

    def _apply(self, held: FakeJob) -> None:
        state = held.states[held.step]
        job = held.job
        job.state = aiplatform_v1.JobState[state]
        job.update_time = _now()
        if state == "JOB_STATE_RUNNING" and not job.start_time:
            job.start_time = _now()
        if state in _TERMINAL:
            job.end_time = _now()
            if state == "JOB_STATE_FAILED" and held.error is not None:
                job.error = status_pb2.Status(code=held.error[0], message=held.error[1])


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)
