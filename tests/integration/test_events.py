"""Event streams (``GET /v2/jobs/{id}/events``): every state in order and then the end; a
reconnect with ``Last-Event-ID`` to another gateway resumes without gaps; heartbeats on an idle
stream; a client that leaves costs the gateway nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.integration.test_jobs import submit
from tests.support import Stack, sim_body, wait_until

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class Event:
    id: str
    data: dict[str, Any]

    @property
    def status(self) -> str:
        return str(self.data["status"])


def parse(lines: Iterator[str], comments: list[str] | None = None) -> Iterator[Event]:
    """Server-sent events from a response's lines (comments collected in ``comments``)."""
    fields: dict[str, str] = {}
    for line in lines:
        if not line:
            if "data" in fields:
                yield Event(fields.get("id", ""), json.loads(fields["data"]))
            fields = {}
        elif line.startswith(":"):
            if comments is not None:
                comments.append(line)
        else:
            name, _, value = line.partition(":")
            fields[name] = value.removeprefix(" ")


def stream(c: httpx.Client, job_id: str, last_id: str | None = None) -> Any:
    headers = {"last-event-id": last_id} if last_id else {}
    return c.stream("GET", f"/v2/jobs/{job_id}/events", headers=headers)


def without_workers(stack: Any, **gateway: object) -> Stack:
    s: Stack = stack(models=("slow",), **gateway)
    s.workers[0].stop()
    with s.client() as c:
        wait_until(lambda: c.get("/v2/models/slow/ready").status_code == 503, what="no worker")
    return s


def ordered(ids: list[str]) -> bool:
    keys = [tuple(int(p) for p in i.split("-")) for i in ids]
    return keys == sorted(keys)


def test_a_jobs_events_come_in_order_and_the_stream_ends_after_the_final_one(stack):
    s = without_workers(stack)
    with s.client() as c:
        job = submit(c, "slow", sim_body(2)).json()
        with stream(c, job["id"]) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = parse(r.iter_lines())
            seen = [next(events)]
            assert seen[0].status == "queued" and seen[0].data == job
            s.add_worker(("slow",))
            seen += list(events)  # until the gateway ends the stream
        final = c.get(f"/v2/jobs/{job['id']}").json()
    assert [e.status for e in seen] == ["queued", "running", "succeeded"]
    assert seen[-1].data == final
    assert seen[1].data["started_at"] == final["started_at"] and "result" not in seen[1].data
    assert ordered([e.id for e in seen])


def test_a_finished_job_tells_its_whole_history_at_once(stack):
    s = stack(models=("sim",))
    with s.client() as c:
        job = submit(c, "sim", sim_body(1)).json()
        wait_until(
            lambda: c.get(f"/v2/jobs/{job['id']}").json()["status"] == "succeeded",
            what="the job to finish",
        )
        with stream(c, job["id"]) as r:
            events = list(parse(r.iter_lines()))
    assert [e.status for e in events] == ["queued", "running", "succeeded"]


def test_a_reconnect_with_last_event_id_to_another_gateway_resumes_without_gaps(stack):
    s = without_workers(stack)
    first = s.gateway
    assert first is not None
    with s.client() as a:
        job = submit(a, "slow", sim_body(2)).json()
        with stream(a, job["id"]) as r:
            events = parse(r.iter_lines())
            queued = next(events)
            s.add_worker(("slow",))
            running = next(events)  # then the client goes away, mid-job
        assert running.status == "running"
    second = s.start_gateway()
    with httpx.Client(base_url=second.url, timeout=30) as b:
        with stream(b, job["id"], running.id) as r:
            rest = list(parse(r.iter_lines()))
        assert [e.status for e in rest] == ["succeeded"]
        # From the first event on, the other gateway tells the rest, in order.
        with stream(b, job["id"], queued.id) as r:
            assert [e.status for e in parse(r.iter_lines())] == ["running", "succeeded"]
    with httpx.Client(base_url=first.url, timeout=30) as a:
        # Resumed after the final event: nothing more (204 stops an EventSource).
        with stream(a, job["id"], rest[-1].id) as r:
            assert r.status_code == 204
        assert (
            a.get(f"/v2/jobs/{job['id']}/events", headers={"last-event-id": "soon"}).status_code
            == 400
        )


def test_heartbeats_keep_an_idle_stream_open_and_a_client_that_left_costs_nothing(stack):
    s = without_workers(stack, sse_heartbeat_s=0.1)
    assert s.gateway is not None
    fanout = s.gateway.gateway.replies.events
    comments: list[str] = []
    with s.client() as c:
        job = submit(c, "slow", sim_body(2)).json()
        with stream(c, job["id"]) as r:
            lines = r.iter_lines()
            events = parse(lines, comments)
            assert next(events).status == "queued"
            assert fanout.watching == 1
            for line in lines:
                if line.startswith(":"):
                    break
        # The client has gone: at its next heartbeat the stream notices and ends.
        wait_until(lambda: fanout.watching == 0, what="the stream to end")


def test_an_unknown_job_or_kind_is_404(stack):
    s = stack(models=("sim",))
    with s.client() as c:
        r = c.get("/v2/jobs/AAAAAAAAAAAAAAAAAAAAAA/events")
        assert r.status_code == 404 and "no job" in r.json()["error"]
        r = c.get("/v2/batches/b1/events")
        assert r.status_code == 404 and "no batch 'b1'" in r.json()["error"]


def test_a_cancelled_job_tells_queued_then_cancelled(stack):
    s = without_workers(stack)
    with s.client() as c:
        job = submit(c, "slow", sim_body(2)).json()
        with stream(c, job["id"]) as r:
            events = parse(r.iter_lines())
            assert next(events).status == "queued"
            assert c.delete(f"/v2/jobs/{job['id']}").status_code == 200
            rest = list(events)
    assert [e.status for e in rest] == ["cancelled"]
