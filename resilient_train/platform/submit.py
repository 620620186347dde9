"""Submit a CustomJob to Vertex AI's JobService and follow its state.

One job: talk to the service. ``submit`` creates the job from the exported document
(``export.custom_job``, read through ``platform_types.custom_job_message``), ``get`` reads
a job back, ``follow`` polls it until a terminal state. Every failure is a
:class:`VertexError` whose message is one line naming the problem and the fix.

The client talks to the regional endpoint with Application Default Credentials. An
``endpoint`` on this machine (127.0.0.1, localhost) gets an insecure channel and
anonymous credentials instead: that is how the tests reach a fake service
(tests/fake_jobservice.py). Google's packages are imported inside the functions, so the
CLI pays for them only when it talks to the service.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..text import first_line
from . import aiplatform_types as platform_types

if TYPE_CHECKING:   # the cloud extra's types, for annotations only
    from google.cloud.aiplatform_v1 import CustomJob, JobServiceClient

__all__ = ["ENDPOINT_ENV", "TERMINAL_STATES", "JobName", "Target", "VertexError",
           "console_url", "follow", "get", "is_job_name", "parse_job_name", "state_of",
           "submit", "to_json"]

log = logging.getLogger(__name__)

ENDPOINT_ENV = "RESILIENT_TRAIN_VERTEX_ENDPOINT"
SUCCEEDED = "JOB_STATE_SUCCEEDED"
TERMINAL_STATES = frozenset({SUCCEEDED, "JOB_STATE_FAILED", "JOB_STATE_CANCELLED",
                             "JOB_STATE_EXPIRED", "JOB_STATE_PARTIALLY_SUCCEEDED"})
# A create that has not answered in a minute is not coming; a read is quicker.
CREATE_TIMEOUT_S = 60.0
GET_TIMEOUT_S = 30.0
# While following, an unreachable service is retried for this long before giving up: a
# network blip should not end a day-long follow.
FOLLOW_PATIENCE_S = 300.0
_SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)
_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
_NAME = re.compile(r"projects/([^/\s]+)/locations/([^/\s]+)/customJobs/([^/\s]+)")
_REGION = re.compile(r"[a-z]+(?:-[a-z0-9]+)+")
_CONSOLE = ("https://console.cloud.google.com/vertex-ai/locations/{region}/training/"
            "{job_id}/cpu?project={project}")
_ADC_FIX = ("run gcloud auth application-default login, or set GOOGLE_APPLICATION_CREDENTIALS "
            "to a service account's key file")


class VertexError(RuntimeError):
    """Talking to the service failed; the message is one line: the problem and the fix."""


@dataclass(frozen=True)
class Target:
    """Where jobs are created: a project and region, and an ``endpoint`` (HOST:PORT) that
    replaces the regional one (None: ``{region}-aiplatform.googleapis.com``)."""

    project: str
    region: str
    endpoint: str | None = None

    @property
    def parent(self) -> str:
        return f"projects/{self.project}/locations/{self.region}"


@dataclass(frozen=True)
class JobName:
    """A job's resource name, ``projects/P/locations/R/customJobs/ID``, in its parts."""

    project: str
    region: str
    job_id: str

    def __str__(self) -> str:
        return f"projects/{self.project}/locations/{self.region}/customJobs/{self.job_id}"


def is_job_name(text: str) -> bool:
    """Whether ``text`` is meant as a job's resource name (well formed or not)."""
    return text.startswith("projects/")


def parse_job_name(text: str) -> JobName:
    m = _NAME.fullmatch(text.strip())
    if m is None:
        raise VertexError(f"{text!r} is not a job's resource name: expected "
                          f"projects/PROJECT/locations/REGION/customJobs/ID, as submit prints it")
    return JobName(*m.groups())


def console_url(name: JobName) -> str:
    """The job's page in the Google Cloud console."""
    return _CONSOLE.format(region=name.region, job_id=name.job_id, project=name.project)


def check_target(target: Target) -> None:
    """Refuse a project or region the service would refuse less clearly."""
    if not target.project or "/" in target.project:
        raise VertexError(f"project {target.project!r}: give --project PROJECT_ID (or set "
                          f"GOOGLE_CLOUD_PROJECT)")
    if not _REGION.fullmatch(target.region):
        raise VertexError(f"region {target.region!r}: give the region the job runs in, e.g. "
                          f"--region us-central1")


# --- the client -------------------------------------------------------------------------


def _endpoint(target: Target) -> str | None:
    return target.endpoint or os.environ.get(ENDPOINT_ENV) or None


def _is_local(endpoint: str) -> bool:
    host = endpoint.rsplit(":", 1)[0] if ":" in endpoint else endpoint
    return host.strip("[]") in _LOOPBACK


def client(target: Target) -> JobServiceClient:
    """A JobService client for ``target``: the regional endpoint (or ``target.endpoint``)
    over TLS with Application Default Credentials, or, for an endpoint on this machine,
    an insecure channel with anonymous credentials."""
    platform_types.require("talking to Vertex AI")
    import google.auth
    import grpc
    from google.api_core.client_options import ClientOptions
    from google.auth.credentials import AnonymousCredentials
    from google.auth.exceptions import DefaultCredentialsError
    from google.cloud.aiplatform_v1 import JobServiceClient
    from google.cloud.aiplatform_v1.services.job_service.transports.grpc import (
        JobServiceGrpcTransport,
    )

    endpoint = _endpoint(target)
    if endpoint is not None and _is_local(endpoint):
        log.debug("JobService at %s: insecure channel, anonymous credentials", endpoint)
        # A channel given to the transport carries no credentials: nothing to leak to a
        # fake, and no ADC needed to test.
        transport = JobServiceGrpcTransport(host=endpoint, credentials=AnonymousCredentials(),
                                            channel=grpc.insecure_channel(endpoint))
        return JobServiceClient(transport=transport)
    host = endpoint or f"{target.region}-aiplatform.googleapis.com"
    try:
        credentials, _ = google.auth.default(scopes=_SCOPES)
    except DefaultCredentialsError as exc:
        raise VertexError(f"no Google Cloud credentials ({first_line(exc)}): "
                          f"{_ADC_FIX}") from None
    log.debug("JobService at %s with Application Default Credentials", host)
    return JobServiceClient(credentials=credentials,
                            client_options=ClientOptions(api_endpoint=host))


# --- the calls --------------------------------------------------------------------------


def submit(target: Target, doc: Mapping[str, Any], *,
           timeout_s: float = CREATE_TIMEOUT_S) -> CustomJob:
    """Create the job ``doc`` (a whole CustomJob in the API's JSON) in ``target``; the
    created job, with its resource name."""
    from .jobspec import JobSpecError

    check_target(target)
    platform_types.require("resilient-train submit")
    try:
        message = platform_types.custom_job_message(doc)
    except JobSpecError as exc:
        raise VertexError(f"the job would be refused: {exc}") from None
    with client(target) as service:
        try:
            # No retry: a create retried after a lost answer would start a second job.
            job = service.create_custom_job(parent=target.parent, custom_job=message,
                                            retry=None, timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - google.api_core's errors, explained
            raise _explain(exc, target, f"creating the job in {target.parent}") from None
    log.info("created %s", job.name)
    return job


def get(name: str | JobName, *, endpoint: str | None = None,
        timeout_s: float = GET_TIMEOUT_S) -> CustomJob:
    """The job ``name`` as the service has it now."""
    job_name = name if isinstance(name, JobName) else parse_job_name(name)
    target = Target(job_name.project, job_name.region, endpoint)
    with client(target) as service:
        return _get(service, job_name, target, timeout_s)


def follow(name: str | JobName, interval_s: float, on_change: Callable[[CustomJob], None], *,
           endpoint: str | None = None, timeout_s: float = GET_TIMEOUT_S,
           patience_s: float = FOLLOW_PATIENCE_S,
           sleep: Callable[[float], None] = time.sleep) -> CustomJob:
    """Poll the job every ``interval_s`` seconds until it is in a terminal state, calling
    ``on_change`` with the job once per state it is seen in (the first included); the job
    in its terminal state."""
    from google.api_core import exceptions as api

    if interval_s <= 0:
        raise VertexError(f"--interval {interval_s:g}: give a number of seconds above 0")
    job_name = name if isinstance(name, JobName) else parse_job_name(name)
    target = Target(job_name.project, job_name.region, endpoint)
    seen: str | None = None
    with client(target) as service:
        unreachable_since: float | None = None
        while True:
            try:
                job = service.get_custom_job(name=str(job_name), retry=None, timeout=timeout_s)
                unreachable_since = None
            except (api.ServiceUnavailable, api.DeadlineExceeded) as exc:
                # Only once the job has been seen: a wrong endpoint fails at once.
                now = time.monotonic()
                unreachable_since = unreachable_since or now
                if seen is None or now - unreachable_since > patience_s:
                    raise _explain(exc, target, f"reading {job_name}") from None
                log.warning("JobService unreachable (%s); trying again in %g s",
                            first_line(exc), interval_s)
                sleep(interval_s)
                continue
            except Exception as exc:  # noqa: BLE001 - google.api_core's errors, explained
                raise _explain(exc, target, f"reading {job_name}") from None
            state = state_of(job)
            if state != seen:
                seen = state
                on_change(job)
            if state in TERMINAL_STATES:
                return job
            sleep(interval_s)


def _get(service: JobServiceClient, job_name: JobName, target: Target,
         timeout_s: float) -> CustomJob:
    try:
        return service.get_custom_job(name=str(job_name), retry=None, timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - google.api_core's errors, explained
        raise _explain(exc, target, f"reading {job_name}") from None


def state_of(job: CustomJob) -> str:
    """The job's state by its API name, ``JOB_STATE_RUNNING``."""
    return job.state.name


def to_json(job: CustomJob) -> dict[str, Any]:
    """The job as the API's JSON (camelCase names, RFC 3339 times)."""
    return platform_types.to_document(job)


# --- errors -----------------------------------------------------------------------------


def _explain(exc: BaseException, target: Target, doing: str) -> Exception:
    """One line for an error of the client: what failed, and what to do about it."""
    from google.api_core import exceptions as api
    from google.auth.exceptions import DefaultCredentialsError, RefreshError

    where = _endpoint(target) or f"{target.region}-aiplatform.googleapis.com"
    if isinstance(exc, api.RetryError) and exc.cause is not None:
        exc = exc.cause
    message = exc.message if isinstance(exc, api.GoogleAPICallError) else first_line(exc)
    message = " ".join(str(message).split())   # the service's text, on one line
    if isinstance(exc, (DefaultCredentialsError, RefreshError)):
        return VertexError(f"{doing}: the credentials do not work ({message}): {_ADC_FIX}")
    if isinstance(exc, api.ServiceUnavailable):
        return VertexError(f"{doing}: the Vertex AI JobService at {where} is unreachable "
                           f"({message}); check the network and --region (or --endpoint), "
                           f"then try again")
    if isinstance(exc, api.DeadlineExceeded):
        return VertexError(f"{doing}: the Vertex AI JobService at {where} did not answer in "
                           f"time; check the network and --region (or --endpoint), then try "
                           f"again")
    if isinstance(exc, api.Unauthenticated):
        return VertexError(f"{doing}: the service refused the credentials ({message}): "
                           f"{_ADC_FIX}")
    if isinstance(exc, api.PermissionDenied):
        return VertexError(f"{doing}: permission denied ({message}); the account needs the "
                           f"Vertex AI User role (roles/aiplatform.user) on project "
                           f"{target.project}, and the project needs the Vertex AI API "
                           f"(gcloud services enable aiplatform.googleapis.com)")
    if isinstance(exc, api.InvalidArgument):
        return VertexError(f"{doing}: the service refused the request: {message}")
    if isinstance(exc, api.NotFound):
        return VertexError(f"{doing}: not found ({message}); check the project, region and "
                           f"job id")
    if isinstance(exc, api.GoogleAPICallError):
        code = exc.grpc_status_code.name if exc.grpc_status_code is not None else exc.code
        return VertexError(f"{doing}: the service answered {code}: {message}")
    return VertexError(f"{doing}: {type(exc).__name__}: {message}")
