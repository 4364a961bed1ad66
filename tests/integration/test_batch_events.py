"""A batch's webhook and its event stream: signed deliveries of the statuses asked for, with the
body GET returns; SSE in order, with progress, resumable by Last-Event-ID on another gateway."""

from __future__ import annotations

import json

import pytest

from inferq.client import Client
from tests.integration.test_batches import create, line, wait_final
from tests.integration.test_webhooks import HOOKS, SECRET, hooks  # noqa: F401 - a fixture
from tests.support import wait_until

pytestmark = pytest.mark.integration


def test_a_batch_webhook_tells_each_status_asked_for_signed(stack, hooks):  # noqa: F811
    s = stack(models=("sim",), **HOOKS)
    with s.client() as c:
        r = create(
            c,
            [line(i) for i in range(20)],
            webhook=hooks.url,
            webhook_events="in_progress,completed",
        )
        assert r.status_code == 202, r.text
        batch_id = r.json()["id"]
        assert r.json()["webhook"]["events"] == ["completed", "in_progress"]
        done = wait_final(c, batch_id)
        wait_until(lambda: len(hooks.accepted()) == 2, what="two deliveries")
    got = {d.headers["inferq-event"]: d for d in hooks.received}
    assert set(got) == {"in_progress", "completed"}
    assert got["completed"].verified(SECRET) == done
    assert got["completed"].webhook_id == f"batch:{batch_id}:completed"
    assert got["in_progress"].verified(SECRET)["status"] == "in_progress"


def test_a_batch_webhook_to_a_private_address_is_refused_without_the_allow_list(stack):
    s = stack(models=("sim",), webhook_secret=SECRET)
    with s.client() as c:
        r = create(c, [line(1)], webhook="http://127.0.0.1:9/hook")
        assert r.status_code == 400 and "127.0.0.1" in r.json()["error"]


@pytest.mark.serial  # reads progress events of a 1.5 s batch
def test_batch_events_come_in_order_with_progress_and_resume_on_another_gateway(stack):
    s = stack(models=("slow",))
    other = s.start_gateway()
    with s.client() as c:
        r = create(c, [line(i, model="slow") for i in range(300)])
        batch_id = r.json()["id"]
        seen: list[dict] = []
        with Client(s.url) as client:
            for event in client.events(f"/v2/batches/{batch_id}/events"):
                seen.append(event)
                if len(seen) == 3:
                    break
        last_id = seen[-1]["id"]
        with Client(other.url) as client:
            for event in client.events(f"/v2/batches/{batch_id}/events", last_id):
                seen.append(event)
    statuses = [e["data"]["status"] for e in seen]
    # The first entry announced in_progress; the stream tells the status before it too.
    assert statuses[:2] == ["validating", "in_progress"]
    assert statuses[-2:] == ["finalizing", "completed"]
    assert set(statuses[2:-2]) == {"in_progress"}, statuses
    answered = [
        e["data"]["request_counts"]["completed"]
        for e in seen
        if e["data"]["status"] == "in_progress"
    ]
    assert answered == sorted(answered) and len(set(answered)) >= 2, "no progress events"
    told = [(e["id"], e["data"]["status"], json.dumps(e["data"])) for e in seen]
    assert len(told) == len(set(told)), "an event was sent twice across the reconnect"
    assert seen[-1]["data"]["request_counts"]["completed"] == 300
