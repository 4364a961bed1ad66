"""Load inferq (or any Open Inference Protocol server) with Locust, for those who already do.

    pip install 'inferq[locust]'
    locust -f loadgen/locustfile.py --host http://127.0.0.1:8000 --model digits \
        --web-host 127.0.0.1                    # web UI on http://127.0.0.1:8089 (the default here)
    locust -f loadgen/locustfile.py --host http://127.0.0.1:8000 --model digits \\
        --headless -u 32 -r 8 -t 30s --binary InferUser                   # sync, binary tensors
    locust -f loadgen/locustfile.py --host http://127.0.0.1:8000 JobUser  # async jobs

Two user classes (both run unless one is named):

* ``InferUser`` — ``POST /v2/models/{m}[/versions/{v}]/infer``, one Locust request each;
* ``JobUser`` — ``POST .../jobs`` (202), then ``GET /v2/jobs/{id}?wait=S`` until the job reaches
  a final status. Submits and polls are Locust requests of their own, and each job also counts
  as one ``JOB`` request timed from the submit to its final status (failed, expired or
  cancelled jobs count as failures).

Inputs are generated from the model's metadata as ``inferq loadgen`` does (``--rows``,
``--distinct``, ``--seed``), as JSON or with the binary tensor extension (``--binary``), and
sent with ``Cache-Control: no-cache`` unless ``--cache``. Each option also reads the
``INFERQ_LOADGEN_*`` variable of the same ``inferq loadgen`` flag. Locust's own flags (users,
spawn rate, run time, ``--host``) work as usual; ``inferq loadgen`` stays the tool for open-loop
(Poisson) load and coordinated-omission-free latency, which Locust's closed user loop does not
measure.

The request-building helpers below import without Locust (the tests use them); the user classes
exist only when Locust is installed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any, cast
from urllib.parse import urlsplit

from loadgen.inputs import ModelRef, generated_bodies
from loadgen.jobs import FINAL_STATUSES, PENDING_STATUSES, JobError, job_document

try:
    import locust
except ImportError:  # the helpers stay usable; no user classes without Locust
    locust = None  # type: ignore[assignment]

__all__ = ["Workload", "job_poll_path", "job_state", "model_path", "workload"]

#: Options added to Locust's command line: (flag, INFERQ_LOADGEN_* variable, type, default, help).
OPTIONS: tuple[tuple[str, str, type, Any, str], ...] = (
    ("--model", "MODEL", str, "digits", "model to load"),
    ("--model-version", "MODEL_VERSION", str, "", "model version (default: the model's own)"),
    ("--rows", "ROWS", int, 1, "rows per request: the size of each input's first -1 dimension"),
    ("--distinct", "DISTINCT", int, 8, "distinct random requests to cycle through"),
    ("--seed", "SEED", int, 0, "seed of the random inputs"),
    ("--job-wait", "JOB_WAIT", int, 10, "jobs: seconds each poll asks the server to wait"),
)


def model_path(model: str, version: str | None = None, suffix: str = "") -> str:
    """``/v2/models/{m}[/versions/{v}]{suffix}``."""
    return ModelRef("http://server", model, version or None).path(suffix)


class Workload:
    """The requests a user cycles through: their path and (body, headers) pairs."""

    def __init__(self, path: str, bodies: list[tuple[bytes, dict[str, str]]]) -> None:
        self.path = path
        self.bodies = bodies
        self._next = 0

    def next(self) -> tuple[bytes, dict[str, str]]:
        body = self.bodies[self._next % len(self.bodies)]
        self._next += 1
        return body


def workload(
    metadata: Mapping[str, Any],
    *,
    model: str,
    version: str | None = None,
    jobs: bool = False,
    binary: bool = False,
    cache: bool = False,
    rows: int = 1,
    distinct: int = 8,
    seed: int = 0,
) -> Workload:
    """Inference (or job submit) requests for the model that ``metadata`` describes."""
    bodies = generated_bodies(metadata, count=distinct, rows=rows, seed=seed, binary=binary)
    if not cache:
        for _, headers in bodies:
            headers["cache-control"] = "no-cache"
    return Workload(model_path(model, version, "/jobs" if jobs else "/infer"), bodies)


def job_poll_path(location: str | None, job_id: str, wait_s: int) -> str:
    """Where to poll a job: its ``Location`` (path only: the host is Locust's ``--host``), else
    ``/v2/jobs/{id}``, asking the server to wait up to ``wait_s`` seconds."""
    path = urlsplit(location).path if location else ""
    return f"{path or f'/v2/jobs/{job_id}'}?wait={wait_s}"


def job_state(body: bytes, headers: Mapping[str, str]) -> tuple[str, str]:
    """(id, status) of a jobs response, JSON or binary; raises ``ValueError`` when it breaks
    the jobs contract."""
    try:
        doc = job_document(body, {k.lower(): v for k, v in headers.items()})
    except JobError as exc:
        raise ValueError(str(exc)) from exc
    job_id, status = doc.get("id"), doc.get("status")
    if not isinstance(job_id, str) or status not in FINAL_STATUSES | PENDING_STATUSES:
        raise ValueError(f"not a job: {json.dumps(doc)[:200]}")
    return job_id, status


if locust is not None:
    from locust import FastHttpUser, events, task
    from locust.exception import StopUser

    @events.init_command_line_parser.add_listener  # type: ignore[untyped-decorator]
    def _add_options(parser: Any) -> None:
        # The web UI on this machine only, unless --web-host or LOCUST_WEB_HOST say otherwise
        # (Locust's own default is every interface, where anyone could start a load).
        parser.set_defaults(web_host="127.0.0.1")
        for flag, env, kind, default, text in OPTIONS:
            parser.add_argument(
                flag, type=kind, default=default, env_var=f"INFERQ_LOADGEN_{env}", help=text
            )
        parser.add_argument(
            "--binary",
            action="store_true",
            env_var="INFERQ_LOADGEN_BINARY",
            help="send tensors with the binary tensor extension",
        )
        parser.add_argument(
            "--cache",
            action="store_true",
            env_var="INFERQ_LOADGEN_CACHE",
            help="allow answers from the result cache (default: Cache-Control: no-cache)",
        )

    def _headers(resp: Any) -> dict[str, str]:
        return {k.lower(): v for k, v in (resp.headers or {}).items()}

    class _V2User(FastHttpUser):
        abstract = True
        jobs = False

        def on_start(self) -> None:
            o = self.environment.parsed_options
            with self.client.get(
                model_path(o.model, o.model_version), name="metadata", catch_response=True
            ) as resp:
                if resp.status_code != 200:
                    resp.failure(f"model metadata answered {resp.status_code}")
                    raise StopUser()
                self.workload = workload(
                    json.loads(resp.content),
                    model=o.model,
                    version=o.model_version,
                    jobs=self.jobs,
                    binary=o.binary,
                    cache=o.cache,
                    rows=o.rows,
                    distinct=o.distinct,
                    seed=o.seed,
                )

    class InferUser(_V2User):
        """Synchronous inference, back to back."""

        @task
        def infer(self) -> None:
            body, headers = self.workload.next()
            # Bytes go out as they are (Locust's type hint says str).
            self.client.post(
                self.workload.path, data=cast(Any, body), headers=headers, name="infer"
            )

    class JobUser(_V2User):
        """Async jobs: submit, then long-poll until the job is final."""

        jobs = True

        @task
        def job(self) -> None:
            body, headers = self.workload.next()
            started = time.perf_counter()
            submit = self.client.post(
                self.workload.path, data=cast(Any, body), headers=headers, name="submit"
            )
            if submit.status_code != 202:
                return  # already a failed "submit" request in Locust's table
            failure: Exception | None = None
            try:
                submitted = _headers(submit)
                job_id, status = job_state(submit.content, submitted)
                poll = job_poll_path(
                    submitted.get("location"), job_id, self.environment.parsed_options.job_wait
                )
                while status in PENDING_STATUSES:
                    resp = self.client.get(poll, name="poll /v2/jobs/{id}")
                    if resp.status_code != 200:
                        raise ValueError(f"poll answered {resp.status_code}")
                    _, status = job_state(resp.content, _headers(resp))
                if status != "succeeded":
                    failure = RuntimeError(f"job {job_id} ended {status}")
            except ValueError as exc:
                failure = exc
            self.environment.events.request.fire(
                request_type="JOB",
                name=self.workload.path,
                response_time=(time.perf_counter() - started) * 1e3,
                response_length=0,
                exception=failure,
                context={},
            )
