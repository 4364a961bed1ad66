"""Jobs mode (submit, then long-poll) against a tiny fake of the jobs API."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from loadgen.closed import run_closed_loop
from loadgen.http import PreparedRequest
from loadgen.jobs import JobStats, jobs_operation, jobs_path
from loadgen.loop import LoadOptions
from loadgen.open import run_open_loop

SUBMIT = PreparedRequest(
    "POST", "/v2/models/m/jobs", b'{"inputs": []}', {"content-type": "application/json"}
)


class FakeJobs:
    """``POST /v2/models/m/jobs`` -> 202 + Location; ``GET /v2/jobs/{id}`` -> ``running`` for
    ``pending_polls`` polls, then the next of ``finals`` (cycled)."""

    def __init__(
        self,
        response_bytes: Callable[..., bytes],
        *,
        finals: tuple[str, ...] = ("succeeded",),
        pending_polls: int = 1,
        location: Callable[[str], str] = lambda job_id: f"/v2/jobs/{job_id}",
        submit_status: int = 202,
        binary: bool = False,
    ) -> None:
        self.binary = binary
        self.response = response_bytes
        self.finals = finals
        self.pending_polls = pending_polls
        self.location = location
        self.submit_status = submit_status
        self.jobs: dict[str, dict[str, Any]] = {}
        self.poll_paths: list[str] = []

    def _json(self, status: int, doc: dict[str, Any], **headers: str) -> bytes:
        headers["content-type"] = "application/json"
        return self.response(json.dumps(doc).encode(), status=status, headers=headers)

    def __call__(self, req: Any) -> bytes:
        if req.method == "POST" and req.path == "/v2/models/m/jobs":
            if self.submit_status != 202:
                return self._json(self.submit_status, {"error": "backlog full"})
            job_id = f"job-{len(self.jobs)}"
            final = self.finals[len(self.jobs) % len(self.finals)]
            self.jobs[job_id] = {"polls": 0, "final": final}
            doc = {"id": job_id, "status": "queued", "model_name": "m"}
            return self._json(202, doc, location=self.location(job_id))
        if req.method == "GET" and req.path.startswith("/v2/jobs/"):
            self.poll_paths.append(req.path)
            job_id = req.path.split("?")[0].rsplit("/", 1)[1]
            job = self.jobs.get(job_id)
            if job is None:
                return self._json(404, {"error": "unknown job"})
            job["polls"] += 1
            status = "running" if job["polls"] <= self.pending_polls else job["final"]
            doc = {"id": job_id, "status": status, "model_name": "m"}
            if status == "succeeded" and self.binary:  # the result's tensors follow the JSON
                head = json.dumps(doc).encode()
                return self.response(
                    head + b"\x00\x01\x02\x03",
                    headers={
                        "content-type": "application/octet-stream",
                        "inference-header-content-length": str(len(head)),
                    },
                )
            return self._json(200, doc)
        return self._json(404, {"error": "no route"})


def _closed(url: str, stats: JobStats, concurrency: int = 2, **kwargs: Any) -> Any:
    options: dict[str, Any] = {
        "duration_s": 30,
        "warmup_s": 0,
        "max_requests": 10,
        "requests": SUBMIT,
        "operation": jobs_operation(stats, wait_s=10, poll_interval_s=0.001),
    }
    return run_closed_loop(LoadOptions(url, **(options | kwargs)), concurrency)


@pytest.mark.parametrize("binary", [False, True])
def test_jobs_are_submitted_then_polled_until_final(tiny_server, response_bytes, binary) -> None:
    # binary: the finished job carries its result with the binary tensor extension
    fake = FakeJobs(response_bytes, pending_polls=1, binary=binary)

    async def main() -> None:
        stats = JobStats()
        async with tiny_server(fake) as srv:
            res = await _closed(srv.url, stats)
        assert res.requests == res.ok == 10
        assert res.status_counts == {200: 10}  # the final poll's status
        assert stats.submitted == 10 and stats.polls == 20
        assert stats.to_dict() == {
            "submitted": 10,
            "polls": 20,
            "polls_per_job": 2.0,
            "final_status": {"succeeded": 10},
        }
        assert all(p.endswith("?wait=10") for p in fake.poll_paths)
        assert all(j["polls"] == 2 for j in fake.jobs.values())

    asyncio.run(main())


def test_jobs_that_end_without_a_result_are_errors(tiny_server, response_bytes) -> None:
    fake = FakeJobs(response_bytes, finals=("succeeded", "failed", "expired", "cancelled"))

    async def main() -> None:
        stats = JobStats()
        async with tiny_server(fake) as srv:
            res = await _closed(srv.url, stats, concurrency=1, max_requests=8)
        assert res.ok == 2
        assert res.errors == {"JobCancelled": 2, "JobExpired": 2, "JobFailed": 2}
        assert stats.final_status == {"succeeded": 2, "failed": 2, "expired": 2, "cancelled": 2}

    asyncio.run(main())


def test_a_refused_submit_counts_as_its_status(tiny_server, response_bytes) -> None:
    fake = FakeJobs(response_bytes, submit_status=429)

    async def main() -> None:
        stats = JobStats()
        async with tiny_server(fake) as srv:
            res = await _closed(srv.url, stats)
        assert res.ok == 0 and res.errors == {"429": 10}
        assert stats.submitted == 0 and stats.polls == 0

    asyncio.run(main())


@pytest.mark.parametrize(
    ("location", "ok"),
    [
        (lambda port: lambda j: f"http://127.0.0.1:{port}/v2/jobs/{j}", True),
        (lambda port: lambda j: f"http://10.1.2.3:{port}/v2/jobs/{j}", False),
        (lambda port: lambda j: "", True),  # no Location: /v2/jobs/{id}
    ],
)
def test_polls_only_go_to_the_same_server(tiny_server, response_bytes, location, ok) -> None:
    async def main() -> None:
        fake = FakeJobs(response_bytes)
        stats = JobStats()
        async with tiny_server(fake) as srv:
            fake.location = location(srv.port)
            res = await _closed(srv.url, stats, concurrency=1, max_requests=3)
        if ok:
            assert res.ok == 3
        else:
            assert res.errors == {"JobProtocolError": 3}
            assert fake.poll_paths == []

    asyncio.run(main())


@pytest.mark.serial  # counts polls in a fraction of a second
def test_a_job_that_never_finishes_times_out(tiny_server, response_bytes) -> None:
    fake = FakeJobs(response_bytes, pending_polls=10**9)

    async def main() -> None:
        stats = JobStats()
        async with tiny_server(fake) as srv:
            res = await _closed(
                srv.url,
                stats,
                concurrency=1,
                max_requests=1,
                timeout_s=0.1,
                operation=jobs_operation(stats, wait_s=10, poll_interval_s=0.02),
            )
        assert res.errors == {"RequestTimeout": 1}
        # the server ignores ?wait, so the client paced itself: about 0.1 / 0.02 polls
        assert 2 <= stats.polls <= 8
        assert fake.poll_paths[0].endswith("?wait=0")  # less than a second of budget left

    asyncio.run(main())


def test_jobs_in_an_open_loop(tiny_server, response_bytes) -> None:
    fake = FakeJobs(response_bytes, pending_polls=0)

    async def main() -> None:
        stats = JobStats()
        async with tiny_server(fake) as srv:
            res = await run_open_loop(
                LoadOptions(
                    srv.url,
                    duration_s=0.05,
                    warmup_s=0,
                    requests=SUBMIT,
                    operation=jobs_operation(stats),
                ),
                400,
                seed=4,
            )
        assert res.requests == res.ok > 0
        assert stats.polls == stats.submitted == res.requests

    asyncio.run(main())


def test_jobs_path() -> None:
    assert jobs_path("m") == "/v2/models/m/jobs"
    assert jobs_path("m", "2") == "/v2/models/m/versions/2/jobs"
    with pytest.raises(ValueError):
        jobs_operation(JobStats(), poll_interval_s=0)
