"""What a submission may ask for as a webhook, the retry schedule, and the claims that make
each delivery one gateway's (against a real redis-server and a Redis Cluster)."""

from __future__ import annotations

import asyncio
import base64
from dataclasses import replace

import pytest

from producer.errors import BadRequest
from producer.jobs import DEFAULT_WEBHOOK_EVENTS, JOB_WEBHOOK_EVENTS
from producer.settings import GatewaySettings
from producer.webhooks import (
    RETRY_CAP_S,
    WebhookAsk,
    WebhookPolicy,
    asked,
    parse_events,
    retry_delay_s,
)
from protocol.keys import Keys
from protocol.webhooks import CLAIM_SCRIPT, WebhookDeadLetter, webhook_id
from tests.kinds import RedisUnderTest

SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()
FINAL = {"succeeded", "failed", "cancelled", "expired"}


def check(ask: WebhookAsk, **settings: object) -> object:
    policy = WebhookPolicy(replace(GatewaySettings(webhook_secret=SECRET), **settings))  # type: ignore[arg-type]
    return asyncio.run(policy.check(ask, JOB_WEBHOOK_EVENTS, DEFAULT_WEBHOOK_EVENTS))


def test_the_parameters_win_over_the_headers_and_events_alone_are_an_error():
    headers = {"inferq-webhook": "http://h/x", "inferq-webhook-events": "queued"}
    assert asked({"webhook": "http://p/x"}, headers) == WebhookAsk("http://p/x", None)
    assert asked({}, headers) == WebhookAsk("http://h/x", "queued")
    assert asked({}, {}) is None
    with pytest.raises(BadRequest, match="needs a 'webhook'"):
        asked({"webhook_events": ["failed"]}, {})


@pytest.mark.parametrize(
    ("raw", "events"),
    [
        (None, FINAL),
        ("succeeded, failed", {"succeeded", "failed"}),
        ('["queued","running"]', {"queued", "running"}),
        (["running"], {"running"}),
    ],
)
def test_webhook_events_are_a_list_or_comma_separated_and_default_to_the_final_ones(raw, events):
    assert parse_events(raw, JOB_WEBHOOK_EVENTS, DEFAULT_WEBHOOK_EVENTS) == events


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("finished", "unknown webhook event"),
        ([1, 2], "list of event names"),
        ("[oops", "not a valid JSON list"),
        ("", "names no event"),
    ],
)
def test_bad_webhook_events_are_a_clear_400(raw, message):
    with pytest.raises(BadRequest, match=message):
        parse_events(raw, JOB_WEBHOOK_EVENTS, DEFAULT_WEBHOOK_EVENTS)


def test_a_gateway_without_a_secret_refuses_webhooks():
    policy = WebhookPolicy(GatewaySettings())
    with pytest.raises(BadRequest, match="INFERQ_WEBHOOK_SECRET"):
        asyncio.run(policy.check(WebhookAsk("https://example.com", None), set(), frozenset()))


def test_a_private_or_loopback_webhook_is_refused_unless_allowed():
    for url in ("http://127.0.0.1:9/hook", "http://localhost/hook", "http://[::1]/x"):
        with pytest.raises(BadRequest, match="SSRF"):
            check(WebhookAsk(url, None))
    allowed = check(WebhookAsk("http://127.0.0.1:9/hook", "queued"), webhook_allow=("127.0.0.1",))
    assert allowed.url == "http://127.0.0.1:9/hook" and allowed.events == {"queued"}  # type: ignore[attr-defined]
    with pytest.raises(BadRequest, match="must be a URL"):
        check(WebhookAsk(42, None))


def test_retries_double_from_the_first_wait_up_to_the_cap():
    assert [retry_delay_s(n, 1.0) for n in range(1, 6)] == [1, 2, 4, 8, 16]
    assert retry_delay_s(30, 1.0) == RETRY_CAP_S
    assert retry_delay_s(10_000, 1.0) == RETRY_CAP_S


def test_a_dead_letter_keeps_what_replays_it():
    letter = WebhookDeadLetter("job", "abc", "failed", "https://h/x", 12, "HTTP 500", "1-0")
    back = WebhookDeadLetter.from_fields(
        {k: str(v).encode() for k, v in letter.to_fields().items()}
    )
    assert back == letter and back.webhook_id == webhook_id("job", "abc", "failed")


@pytest.mark.integration
def test_each_delivery_is_claimed_by_one_entry_and_that_entry_finds_it_again(
    either_redis: RedisUnderTest, namespace: str
):
    async def go() -> None:
        broker = await either_redis.broker()
        claim = broker.script(CLAIM_SCRIPT)
        key = Keys(namespace).webhook_sent("job", "j1")
        try:
            first = await claim(keys=[key], args=["1-0", 60_000, "queued", "running"])
            assert sorted(first) == [b"queued", b"running"]
            # A later announcement wants running and succeeded: it gets only succeeded.
            second = await claim(keys=[key], args=["2-0", 60_000, "running", "succeeded"])
            assert second == [b"succeeded"]
            # A gateway that takes over entry 1-0 from a dead one finds its claims its own.
            again = await claim(keys=[key], args=["1-0", 60_000, "queued", "running", "succeeded"])
            assert sorted(again) == [b"queued", b"running"]
            assert 0 < await broker.commands.pttl(key) <= 60_000
        finally:
            await broker.aclose()

    asyncio.run(go())


def test_a_malformed_secret_in_the_environment_is_refused_without_showing_it(capsys):
    from inferq.cli import parse

    with pytest.raises(SystemExit):
        parse(["gateway"], {"INFERQ_WEBHOOK_SECRET": "whsec_not-base64-but-private"})
    err = capsys.readouterr().err
    assert "INFERQ_WEBHOOK_SECRET" in err and "whsec_' then the base64" in err
    assert "not-base64-but-private" not in err
