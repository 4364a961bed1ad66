"""Async jobs mode: submit, then long-poll until the job reaches a final status.

The contract (inferq's jobs API):

* ``POST /v2/models/{m}[/versions/{v}]/jobs`` with an inference body → ``202 Accepted``, body
  ``{"id": ..., "status": "queued", ...}``, header ``Location: /v2/jobs/{id}``;
* ``GET /v2/jobs/{id}?wait=S`` → ``200`` with ``{"id", "status", ...}``, answering as soon as the
  status is final or after at most ``S`` seconds; statuses ``queued``, ``running`` (not final)
  and ``succeeded``, ``failed``, ``expired``, ``cancelled`` (final).

One unit of work is one job: its latency runs from the submit's write to the response that
shows a final status, and it is counted as that response's HTTP status (200) when the job
succeeded.  A job that ends ``failed``/``expired``/``cancelled`` is counted as the error
``JobFailed``/``JobExpired``/``JobCancelled``; a submit or poll answered with an error status
(429 on a full backlog, 404...) counts as that status.  Submit and polls use the same
connection; a ``Location`` that names another server is refused (``JobProtocolError``).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from loadgen.http import HTTPClientError, HTTPConnection, RequestTimeout, Target, prepare
from loadgen.workload import EncodedRequest, Operation, OperationFactory

__all__ = [
    "FINAL_STATUSES",
    "JobCancelled",
    "JobError",
    "JobExpired",
    "JobFailed",
    "JobProtocolError",
    "JobStats",
    "job_document",
    "jobs_operation",
    "jobs_path",
]

FINAL_STATUSES = frozenset({"succeeded", "failed", "expired", "cancelled"})
PENDING_STATUSES = frozenset({"queued", "running"})
#: Extra seconds given to a long poll's HTTP timeout beyond the ``wait`` asked of the server.
POLL_SLACK_S = 5.0


class JobError(HTTPClientError):
    """A job ended without a result, or the server broke the jobs contract."""


class JobFailed(JobError):
    """The job ended ``failed``."""


class JobExpired(JobError):
    """The job ended ``expired`` (its deadline passed before it ran)."""


class JobCancelled(JobError):
    """The job ended ``cancelled``."""


class JobProtocolError(JobError):
    """A response that does not follow the jobs contract (no id, unknown status...)."""


_FINAL_ERRORS: dict[str, type[JobError]] = {
    "failed": JobFailed,
    "expired": JobExpired,
    "cancelled": JobCancelled,
}


def jobs_path(model: str, version: str | None = None) -> str:
    """The submit path of a model: ``/v2/models/{m}[/versions/{v}]/jobs``."""
    base = f"/v2/models/{model}"
    if version:
        base += f"/versions/{version}"
    return base + "/jobs"


class JobStats:
    """Counts across a run: jobs submitted (accepted), polls sent, final statuses seen."""

    def __init__(self) -> None:
        self.submitted = 0
        self.polls = 0
        self.final_status: Counter[str] = Counter()

    def to_dict(self) -> dict[str, Any]:
        done = sum(self.final_status.values())
        return {
            "submitted": self.submitted,
            "polls": self.polls,
            "polls_per_job": self.polls / done if done else 0.0,
            "final_status": dict(self.final_status),
        }


def job_document(body: bytes, headers: Mapping[str, str], what: str = "job") -> dict[str, Any]:
    """The JSON object of a jobs response: the whole body, or with the binary tensor extension
    (a succeeded job that asked for binary outputs) the first ``Inference-Header-Content-Length``
    bytes of it."""
    length = headers.get("inference-header-content-length")
    if length is not None:
        if not length.isdigit():
            raise JobProtocolError(f"{what}: bad Inference-Header-Content-Length {length!r}")
        body = body[: int(length)]
    try:
        data = json.loads(body)
    except ValueError:
        raise JobProtocolError(f"{what}: response body is not JSON") from None
    if not isinstance(data, dict):
        raise JobProtocolError(f"{what}: response body is not a JSON object")
    return data


def _poll_path(target: Target, location: str | None, job_id: str) -> str:
    if not location:
        return f"/v2/jobs/{job_id}"
    parts = urlsplit(location)
    if parts.scheme or parts.netloc:
        same = parts.scheme == "http" and parts.hostname == target.host
        if not same or (parts.port or 80) != target.port:
            raise JobProtocolError(
                f"Location {location!r} points at another server; polls go only to "
                f"{target.host}:{target.port}"
            )
    path = parts.path or f"/v2/jobs/{job_id}"
    return f"{path}?{parts.query}" if parts.query else path


def jobs_operation(
    stats: JobStats, *, wait_s: int = 10, poll_interval_s: float = 0.05
) -> OperationFactory:
    """An :data:`~loadgen.workload.OperationFactory` for jobs mode.

    The encoded requests must be submits (POSTs to a ``.../jobs`` path).  Each poll asks the
    server to wait up to ``wait_s`` whole seconds (less when the job's time is nearly up); a
    poll that comes back with a pending status sooner than ``poll_interval_s`` after it was sent
    is followed by a pause, so a server that ignores ``wait`` is not polled in a tight loop.
    """
    if wait_s < 0:
        raise ValueError("wait_s must not be negative")
    if not poll_interval_s > 0:
        raise ValueError("poll_interval_s must be positive")

    def factory(target: Target, requests: Sequence[EncodedRequest]) -> Operation:
        reqs = list(requests)
        n = len(reqs)
        host = target.host_header

        async def op(conn: HTTPConnection, k: int, budget_s: float | None) -> int:
            t0 = time.perf_counter()
            deadline = math.inf if budget_s is None else t0 + budget_s
            raw, _ = reqs[k % n]
            resp = await conn.send(raw, timeout=budget_s)
            if not 200 <= resp.status < 300:
                return resp.status
            job = job_document(resp.body, resp.headers, "job submit")
            job_id = job.get("id")
            if not isinstance(job_id, str) or not job_id:
                raise JobProtocolError("job submit: the response has no job id")
            stats.submitted += 1
            path = _poll_path(target, resp.headers.get("location"), job_id)
            sep = "&" if "?" in path else "?"
            status_code = resp.status
            while True:
                status = job.get("status")
                if status in FINAL_STATUSES:
                    stats.final_status[status] += 1
                    if status == "succeeded":
                        return status_code
                    raise _FINAL_ERRORS[status](f"job {job_id} ended {status}")
                if status not in PENDING_STATUSES:
                    raise JobProtocolError(f"job {job_id}: unknown status {status!r}")
                started = time.perf_counter()
                left = deadline - started
                if left <= 0:
                    raise RequestTimeout(f"job {job_id} still {status} when its time ran out")
                wait = min(wait_s, max(0, int(left - 1)))
                poll = prepare("GET", f"{path}{sep}wait={wait}", host=host)
                stats.polls += 1
                resp = await conn.send(poll, timeout=min(left, wait + POLL_SLACK_S))
                if resp.status != 200:
                    return resp.status
                job = job_document(resp.body, resp.headers, "job poll")
                status_code = resp.status
                if job.get("status") in PENDING_STATUSES:
                    pause = poll_interval_s - (time.perf_counter() - started)
                    if pause > 0:
                        await asyncio.sleep(min(pause, max(0.0, deadline - time.perf_counter())))

        return op

    return factory
