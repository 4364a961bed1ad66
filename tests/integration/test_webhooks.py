"""Webhooks against a real receiver on loopback (explicitly allowed): signed deliveries verified
with the Standard Webhooks library, retries until the receiver accepts, dead letters shown by
``inferq dlq``, the SSRF guard at submission and at delivery, and a gateway SIGKILLed mid-delivery
whose delivery another gateway makes."""

from __future__ import annotations

import base64
import json
import signal
from collections.abc import Iterator

import httpx
import pytest
import redis
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from inferq.cli import main
from inferq.redisserver import free_port
from protocol.keys import WEBHOOK_GROUP, Keys
from tests.integration.test_jobs import poll, submit
from tests.receiver import Receiver, receiver
from tests.support import gateway_process, sim_body, wait_until

pytestmark = pytest.mark.integration

SECRET = "whsec_" + base64.b64encode(b"inferq-webhook-test-secret-key!!").decode()
HOOKS = {
    "webhook_secret": SECRET,
    "webhook_allow": ("127.0.0.1",),
    "webhook_retry_s": 0.05,
    "webhook_reclaim_s": 1.0,
}


@pytest.fixture
def hooks() -> Iterator[Receiver]:
    with receiver() as r:
        yield r


def settled(redis_url: str, namespace: str) -> bool:
    """Every event the webhook group read is done with (nothing pending)."""
    with redis.Redis.from_url(redis_url) as r:
        groups = r.xinfo_groups(Keys(namespace).job_events)
    return all(g["pending"] == 0 for g in groups if g["name"].decode() == WEBHOOK_GROUP)


def counter(stack, name: str, **labels: str) -> float:
    registry = stack.gateway.gateway.metrics.registry
    return registry.get_sample_value(name, labels) or 0.0


def test_each_status_asked_for_is_delivered_signed_with_the_body_get_returns(stack, hooks):
    s = stack(models=("slow",), **HOOKS)
    events = "queued,running,succeeded"
    with s.client() as c:
        r = submit(c, "slow", sim_body(2, webhook=hooks.url, webhook_events=events))
        assert r.status_code == 202, r.text
        job = r.json()
        assert job["webhook"] == {"url": hooks.url, "events": ["queued", "running", "succeeded"]}
        assert poll(c, job["id"])["status"] == "succeeded"
        wait_until(lambda: len(hooks.accepted()) == 3, what="three deliveries")
        final = c.get(f"/v2/jobs/{job['id']}").json()
    got = {d.headers["inferq-event"]: d for d in hooks.received}
    assert set(got) == {"queued", "running", "succeeded"}
    for status, delivery in got.items():
        body = delivery.verified(SECRET)  # raises unless the signature is right
        assert body["status"] == status and body["id"] == job["id"]
        assert delivery.webhook_id == f"job:{job['id']}:{status}"
        assert delivery.headers["content-type"] == "application/json"
    assert got["succeeded"].verified(SECRET) == final
    assert got["queued"].json["started_at"] is None
    assert got["running"].json["started_at"] == final["started_at"]
    tampered = got["succeeded"].body.replace(b"succeeded", b"failed")
    with pytest.raises(WebhookVerificationError):
        Webhook(SECRET).verify(tampered, got["succeeded"].headers)
    assert counter(s, "inferq_webhook_deliveries_total", kind="job", event="succeeded") == 1


def test_the_header_form_tells_the_final_event_only_by_default(stack, hooks, redis_url):
    s = stack(models=("sim",), **HOOKS)
    with s.client() as c:
        job = submit(c, "sim", sim_body(1), **{"inferq-webhook": hooks.url}).json()
        assert poll(c, job["id"])["status"] == "succeeded"
        wait_until(lambda: len(hooks.accepted()) == 1, what="the delivery")
    wait_until(lambda: settled(redis_url, s.namespace), what="every event handled")
    assert [d.headers["inferq-event"] for d in hooks.received] == ["succeeded"]


def test_a_receiver_that_fails_three_times_then_accepts_gets_the_delivery(stack, hooks):
    s = stack(models=("sim",), **HOOKS)
    hooks.answers = [500, 503, 429]
    with s.client() as c:
        job = submit(c, "sim", sim_body(1, webhook=hooks.url)).json()
        wait_until(lambda: len(hooks.accepted()) == 1, what="the fourth attempt accepted")
    attempts = hooks.received
    assert [a.answered for a in attempts] == [500, 503, 429, 200]
    assert {a.webhook_id for a in attempts} == {f"job:{job['id']}:succeeded"}
    assert attempts[-1].verified(SECRET)["status"] == "succeeded"
    assert counter(s, "inferq_webhook_retries_total", kind="job") == 3
    assert counter(s, "inferq_webhook_failures_total", kind="job", reason="http_5xx") == 2
    assert counter(s, "inferq_webhook_failures_total", kind="job", reason="http_4xx") == 1


def test_a_receiver_that_never_accepts_ends_in_the_dead_letter_stream(
    stack, hooks, redis_url, capsys
):
    s = stack(models=("sim",), **HOOKS, webhook_max_attempts=3)
    keys = Keys(s.namespace)
    hooks.answers = [500] * 3
    with s.client() as c, redis.Redis.from_url(redis_url) as r:
        job = submit(c, "sim", sim_body(1, webhook=hooks.url)).json()
        wait_until(lambda: r.xlen(keys.webhook_dlq) == 1, what="the dead letter")
        assert len(hooks.received) == 3
        dlq = ["dlq", "--redis", redis_url, "--namespace", s.namespace]
        assert main([*dlq, "list"], environ={}) == 0
        shown = capsys.readouterr().out
        assert "webhooks: 1 dead letter(s)" in shown and job["id"] in shown
        assert main([*dlq, "list", "--webhooks", "--json"], environ={}) == 0
        (letter,) = json.loads(capsys.readouterr().out)["entries"]
        assert (letter["object"], letter["event"], letter["attempts"]) == (
            job["id"],
            "succeeded",
            3,
        )
        assert "HTTP 500" in letter["error"] and letter["url"] == hooks.url
        # The receiver is fixed: replaying the dead letter delivers it, same webhook-id.
        assert main([*dlq, "retry", "--webhooks", "--all"], environ={}) == 0
        wait_until(lambda: len(hooks.accepted()) == 1, what="the replayed delivery")
        assert r.xlen(keys.webhook_dlq) == 0
    assert hooks.accepted()[0].webhook_id == f"job:{job['id']}:succeeded"
    assert counter(s, "inferq_webhook_dead_letters_total", kind="job") == 1


def test_a_private_address_is_refused_at_submission_and_at_delivery(stack, hooks, redis_url):
    s = stack(models=("sim",), webhook_secret=SECRET)  # no --webhook-allow
    keys = Keys(s.namespace)
    s.workers[0].stop()
    with s.client() as c:
        wait_until(lambda: c.get("/v2/models/sim/ready").status_code == 503, what="no worker")
        for asked in ({"webhook": hooks.url}, {"webhook": "http://localhost:1/x"}):
            r = submit(c, "sim", sim_body(1, **asked))
            assert r.status_code == 400 and "SSRF" in r.json()["error"], r.text
        r = submit(c, "sim", sim_body(1), **{"inferq-webhook": "http://10.0.0.1/hook"})
        assert r.status_code == 400 and "private" in r.json()["error"]
        # A job whose record names a loopback URL anyway (written by a gateway with a looser
        # --webhook-allow, or a name that now resolves elsewhere) is refused at the connection.
        job = submit(c, "sim", sim_body(1)).json()
        with redis.Redis.from_url(redis_url) as r:
            r.hset(
                keys.job(job["id"]), mapping={"webhook": hooks.url, "webhook_events": "succeeded"}
            )
            s.add_worker(("sim",))
            assert poll(c, job["id"])["status"] == "succeeded"
            wait_until(lambda: r.xlen(keys.webhook_dlq) == 1, what="the refused delivery")
            (_, letter), *_ = r.xrange(keys.webhook_dlq)
    assert b"loopback" in letter[b"error"] and letter[b"attempts"] == b"1"
    assert hooks.received == []
    assert counter(s, "inferq_webhook_failures_total", kind="job", reason="refused") == 1


def test_a_gateway_killed_mid_delivery_has_it_delivered_after_restart(stack, hooks, redis_url):
    s = stack(models=("sim",))  # its gateway has no secret: it delivers nothing
    port = free_port()
    killed = gateway_process(
        redis_url,
        s.namespace,
        port,
        *("--webhook-allow", "127.0.0.1", "--webhook-reclaim-s", "1"),
        env={"INFERQ_WEBHOOK_SECRET": SECRET},
    )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            wait_until(lambda: _ready(c), timeout_s=30, what="the gateway process to serve")
            hooks.hold = True  # the receiver takes the request and does not answer yet
            job = submit(c, "sim", sim_body(1, webhook=hooks.url)).json()
            wait_until(lambda: len(hooks.received) == 1, what="the delivery under way")
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        s.start_gateway(**HOOKS)  # the restart: a new gateway, a new consumer name
        wait_until(lambda: len(hooks.received) == 2, timeout_s=20, what="the delivery again")
        hooks.release()
        wait_until(lambda: settled(redis_url, s.namespace), what="the delivery done with")
    finally:
        if killed.poll() is None:
            killed.kill()
            killed.wait()
    first, second = hooks.received
    assert first.webhook_id == second.webhook_id == f"job:{job['id']}:succeeded"
    assert second.verified(SECRET)["status"] == "succeeded"
    with redis.Redis.from_url(redis_url) as r:
        assert r.xlen(Keys(s.namespace).webhook_dlq) == 0


def _ready(c: httpx.Client) -> bool:
    try:
        return c.get("/v2/health/ready").status_code == 200
    except httpx.TransportError:
        return False


RECLAIM_S = 15.0


def test_a_gateway_that_stops_hands_its_deliveries_to_another_at_once(stack, hooks, redis_url):
    s = stack(models=("sim",), **{**HOOKS, "webhook_reclaim_s": RECLAIM_S})
    first = s.gateway
    hooks.hold = True
    with s.client() as c:
        submit(c, "sim", sim_body(1, webhook=hooks.url))
        wait_until(lambda: len(hooks.received) == 1, what="the delivery under way")
    # The other gateway ticks every RECLAIM_S / 3 (5 s): a handed-over delivery goes at that
    # tick. One not handed over would wait until it had been idle for RECLAIM_S, at least
    # 10 s after the stop (its holder renewed it at most one tick before), past the wait here.
    s.start_gateway(**{**HOOKS, "webhook_reclaim_s": RECLAIM_S})
    assert first is not None
    first.stop()
    wait_until(lambda: len(hooks.received) == 2, timeout_s=9, what="the other gateway")
    hooks.release()
    wait_until(lambda: settled(redis_url, s.namespace), what="the delivery done with")


def test_webhooks_and_event_streams_hold_on_a_redis_cluster(stack, hooks, redis_cluster):
    """On a cluster the events stream, the claims, the dead letters and the job records live in
    different slots; every step names one key, so nothing changes."""
    from tests.integration.test_events import parse, stream

    s = stack(models=("sim",), url=redis_cluster.url, **HOOKS)
    with s.client() as c:
        job = submit(
            c,
            "sim",
            sim_body(1, webhook=hooks.url, webhook_events=["queued", "running", "succeeded"]),
        ).json()
        assert poll(c, job["id"])["status"] == "succeeded"
        wait_until(lambda: len(hooks.accepted()) == 3, what="three deliveries")
        with stream(c, job["id"]) as r:
            events = list(parse(r.iter_lines()))
        with stream(c, job["id"], events[-1].id) as r:
            assert r.status_code == 204  # it has seen the final state
    assert sorted(d.verified(SECRET)["status"] for d in hooks.received) == [
        "queued",
        "running",
        "succeeded",
    ]
    assert [e.data["status"] for e in events] == ["queued", "running", "succeeded"]


def test_a_deliverer_whose_events_stream_vanished_makes_its_group_again(stack, hooks, redis_url):
    """Redis restarted empty, or evicted the stream: the group is made again, and the next
    job's webhook is delivered."""
    s = stack(models=("sim",), **HOOKS)
    with s.client() as c, redis.Redis.from_url(redis_url) as r:
        first = submit(c, "sim", sim_body(1, webhook=hooks.url)).json()
        wait_until(lambda: len(hooks.accepted()) == 1, what="the first delivery")
        r.delete(Keys(s.namespace).job_events)
        second = submit(c, "sim", sim_body(2, webhook=hooks.url)).json()
        wait_until(lambda: len(hooks.accepted()) == 2, timeout_s=20, what="the second delivery")
    assert [d.json["id"] for d in hooks.accepted()] == [first["id"], second["id"]]
