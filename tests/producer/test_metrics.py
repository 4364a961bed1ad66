"""The gateway's metrics: declared once with help text and fixed labels, named by the
Prometheus conventions, exposed at /metrics, and the stream gauges refreshed from Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from inferq.redisserver import free_port
from producer.metrics import GatewayMetrics, StreamGauges, metrics_response
from protocol.keys import GROUP, Keys, Lane
from runtime.metrics import BYTES_BUCKETS, LATENCY_BUCKETS

EXPECTED: dict[str, tuple[str, tuple[str, ...]]] = {
    "inferq_gateway_requests_total": (
        "counter",
        ("model", "version", "endpoint", "status", "protocol"),
    ),
    "inferq_gateway_request_duration_seconds": (
        "histogram",
        ("model", "version", "endpoint", "status_class", "protocol"),
    ),
    "inferq_gateway_request_body_bytes": ("histogram", ("model",)),
    "inferq_gateway_cache_hits_total": ("counter", ("model",)),
    "inferq_gateway_cache_misses_total": ("counter", ("model",)),
    "inferq_gateway_rejected_total": ("counter", ("model", "reason")),
    "inferq_gateway_waiting_requests": ("gauge", ()),
    "inferq_gateway_batches_in_flight": ("gauge", ()),
    "inferq_gateway_batch_lines_pending": ("gauge", ()),
    "inferq_gateway_batch_paced_total": ("counter", ()),
    "inferq_gateway_batch_lines_total": ("counter", ("outcome",)),
    "inferq_stream_length": ("gauge", ("model", "lane")),
    "inferq_stream_lag": ("gauge", ("model", "lane")),
    "inferq_stream_pending": ("gauge", ("model", "lane")),
    "inferq_stream_consumers": ("gauge", ("model", "lane")),
    "inferq_stream_oldest_pending_age_seconds": ("gauge", ("model", "lane")),
    "inferq_dlq_length": ("gauge", ("model",)),
    "inferq_model_backlog": ("gauge", ("model",)),
    "inferq_stream_partition_backlog": ("gauge", ("model", "partition")),
    "inferq_stream_gauges_last_refresh_timestamp_seconds": ("gauge", ()),
    "inferq_stream_gauges_refresh_failures_total": ("counter", ()),
    "inferq_webhook_deliveries_total": ("counter", ("kind", "event")),
    "inferq_webhook_failures_total": ("counter", ("kind", "reason")),
    "inferq_webhook_retries_total": ("counter", ("kind",)),
    "inferq_webhook_dead_letters_total": ("counter", ("kind",)),
    "inferq_webhook_delivery_lag_seconds": ("histogram", ("kind",)),
    "inferq_webhook_held": ("gauge", ()),
    "inferq_webhook_backlog": ("gauge", ()),
    "inferq_webhook_pending": ("gauge", ()),
    # Declared once in runtime.metrics.RuntimeGauges, exported by workers too.
    "inferq_loop_healthy": ("gauge", ("loop",)),
    "inferq_redis_evicting": ("gauge", ("policy",)),
    "inferq_redis_pool_connections": ("gauge", ("state",)),
}


def exposed_name(family_name: str, kind: str) -> str:
    """prometheus_client reports counters without ``_total``; the exposed name has it."""
    return f"{family_name}_total" if kind == "counter" else family_name


def inferq_families(metrics: GatewayMetrics) -> dict[str, Metric]:
    return {
        exposed_name(f.name, f.type): f
        for f in metrics.registry.collect()
        if f.name.startswith("inferq_")
    }


def sample(metrics: GatewayMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_the_gateway_declares_exactly_the_documented_metrics_with_help_text():
    families = inferq_families(GatewayMetrics())
    assert {name: f.type for name, f in families.items()} == {
        name: kind for name, (kind, _) in EXPECTED.items()
    }
    for name, family in families.items():
        help_text = family.documentation
        assert len(help_text) > 30 and help_text.endswith("."), name


def test_names_follow_the_prometheus_conventions():
    for name, (kind, _) in EXPECTED.items():
        assert name.startswith("inferq_") and name == name.lower()
        assert name.endswith("_total") == (kind == "counter"), name
        if "duration" in name or "age" in name or "timestamp" in name:
            assert name.endswith("_seconds"), name
    assert "inferq_gateway_request_body_bytes" in EXPECTED


def test_every_metric_takes_exactly_its_fixed_labels():
    m = GatewayMetrics()
    for attr in vars(m).values():
        if not hasattr(attr, "labels") or attr is m.registry:
            continue
        declared = attr.describe()[0]
        name = exposed_name(declared.name, declared.type)
        labels = EXPECTED[name][1]
        if labels:
            with pytest.raises(ValueError):
                attr.labels(**{label: "x" for label in (*labels, "extra")})
            child = attr.labels(**{label: "x" for label in labels})
        else:
            child = attr
        getattr(child, "observe", getattr(child, "inc", None))(1)
    for family in m.registry.collect():
        if family.name.startswith("inferq_"):
            kind_labels = EXPECTED[exposed_name(family.name, family.type)][1]
            for s in family.samples:
                assert set(s.labels) - {"le"} == set(kind_labels), s


def test_latency_buckets_run_from_half_a_millisecond_to_a_minute():
    assert LATENCY_BUCKETS[0] == 0.0005 and LATENCY_BUCKETS[-1] == 60.0
    assert list(LATENCY_BUCKETS) == sorted(LATENCY_BUCKETS)
    m = GatewayMetrics()
    m.observe_request("digits", "1", "infer", 200, 0.0003)
    buckets = [
        s.labels["le"]
        for f in m.registry.collect()
        if f.name == "inferq_gateway_request_duration_seconds"
        for s in f.samples
        if s.name.endswith("_bucket")
    ]
    assert buckets == [*(str(b) for b in LATENCY_BUCKETS), "+Inf"]
    assert BYTES_BUCKETS[-1] == 64 * 1024 * 1024


def test_a_request_is_counted_by_model_version_endpoint_status_and_protocol():
    m = GatewayMetrics()
    m.observe_request("digits", "1", "infer", 200, 0.004, body_bytes=300)
    m.observe_request("digits", "1", "infer", 200, 0.006)
    m.observe_request("digits", "1", "infer", 200, 0.002, body_bytes=100, protocol="grpc")
    m.observe_request(None, None, "infer", 404, 0.001)
    m.observe_request(None, None, "/made/up", 404, 0.001)

    def count(protocol: str = "http", **labels: str) -> float | None:
        return sample(m, "inferq_gateway_requests_total", protocol=protocol, **labels)

    assert count(model="digits", version="1", endpoint="infer", status="200") == 2
    assert count("grpc", model="digits", version="1", endpoint="infer", status="200") == 1
    assert count(model="", version="", endpoint="infer", status="404") == 1
    assert count(model="", version="", endpoint="other", status="404") == 1
    duration = "inferq_gateway_request_duration_seconds_count"
    http = {"model": "digits", "version": "1", "endpoint": "infer", "status_class": "2xx"}
    assert sample(m, duration, protocol="http", **http) == 2
    assert sample(m, duration, protocol="grpc", **http) == 1
    assert (
        sample(
            m,
            duration,
            model="",
            version="",
            endpoint="infer",
            status_class="4xx",
            protocol="http",
        )
        == 1
    )
    assert sample(m, "inferq_gateway_request_body_bytes_sum", model="digits") == 400


def test_cache_lookups_rejections_and_waiters():
    m = GatewayMetrics()
    m.observe_cache("digits", hit=True)
    m.observe_cache("digits", hit=False)
    m.observe_cache("digits", hit=False)
    m.observe_rejected("digits", "no_workers")
    m.observe_rejected("digits", "something new")
    waiting = [3]
    m.track_waiters(lambda: waiting[0])

    assert sample(m, "inferq_gateway_cache_hits_total", model="digits") == 1
    assert sample(m, "inferq_gateway_cache_misses_total", model="digits") == 2
    assert sample(m, "inferq_gateway_rejected_total", model="digits", reason="no_workers") == 1
    assert sample(m, "inferq_gateway_rejected_total", model="digits", reason="other") == 1
    assert sample(m, "inferq_gateway_waiting_requests") == 3
    waiting[0] = 7
    assert sample(m, "inferq_gateway_waiting_requests") == 7


def test_each_gateway_metrics_object_has_its_own_registry():
    a, b = GatewayMetrics(), GatewayMetrics()
    a.observe_cache("digits", hit=True)
    assert sample(b, "inferq_gateway_cache_hits_total", model="digits") is None


def test_the_metrics_endpoint_serves_prometheus_text_or_openmetrics():
    m = GatewayMetrics()
    m.observe_request("digits", "1", "infer", 200, 0.01)

    async def metrics(request: Request) -> Response:
        return metrics_response(m.registry, request.headers.get("accept"))

    async def scrape() -> tuple[httpx.Response, httpx.Response]:
        app = Starlette(routes=[Route("/metrics", metrics)])
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            accept = {"accept": "application/openmetrics-text; version=1.0.0"}
            return await client.get("/metrics"), await client.get("/metrics", headers=accept)

    plain, openmetrics = asyncio.run(scrape())
    assert plain.status_code == 200
    assert plain.headers["content-type"].startswith("text/plain; version=0.0.4")
    names = {f.name for f in text_string_to_metric_families(plain.text)}
    assert {"inferq_gateway_requests", "process_cpu_seconds"} <= names
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    assert openmetrics.text.rstrip().endswith("# EOF")


# -- stream gauges from a real Redis -----------------------------------------------------------


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def refresh(redis_url: str, gauges_of: GatewayMetrics, keys: Keys, **options: Any) -> None:
    async def go() -> None:
        client = aioredis.Redis.from_url(redis_url)
        try:
            await StreamGauges(gauges_of, client, keys, **options).refresh()
        finally:
            await client.aclose()

    asyncio.run(go())


@pytest.mark.integration
def test_stream_gauges_show_length_lag_pending_consumers_age_and_dead_letters(
    r, redis_url, namespace
):
    keys = Keys(namespace)
    stream = keys.stream("digits", Lane.NORMAL)
    r.hset(keys.models, "digits", b"metadata")
    r.xgroup_create(stream, GROUP, id="0", mkstream=True)
    for ms in (1_000_000, 1_000_500, 1_001_000, 1_002_000):
        r.xadd(stream, {b"m": b"x"}, id=f"{ms}-0")
    r.xreadgroup(GROUP, "w1", {stream: ">"}, count=1)
    r.zadd(keys.workers, {"w1": 10**15})
    r.xadd(keys.dlq("digits"), {b"reason": b"undecodable"})
    m = GatewayMetrics()

    before = time.time()
    refresh(redis_url, m, keys, clock_now_ms=lambda: 1_003_000)

    def gauge(name: str) -> float | None:
        return sample(m, name, model="digits", lane="normal")

    assert gauge("inferq_stream_length") == 4
    assert gauge("inferq_stream_lag") == 3
    assert gauge("inferq_stream_pending") == 1
    assert gauge("inferq_stream_consumers") == 1
    assert gauge("inferq_stream_oldest_pending_age_seconds") == 3.0
    assert sample(m, "inferq_stream_lag", model="digits", lane="high") == 0
    assert sample(m, "inferq_dlq_length", model="digits") == 1
    assert sample(m, "inferq_stream_gauges_last_refresh_timestamp_seconds") >= before


@pytest.mark.integration
def test_stream_gauges_of_a_model_that_disappeared_are_removed(r, redis_url, namespace):
    keys = Keys(namespace)
    r.hset(keys.models, "old", b"metadata")
    m = GatewayMetrics()

    async def go() -> None:
        client = aioredis.Redis.from_url(redis_url)
        try:
            gauges = StreamGauges(m, client, keys)
            await gauges.refresh()
            assert sample(m, "inferq_stream_lag", model="old", lane="normal") == 0
            r.hdel(keys.models, "old")
            await gauges.refresh()
        finally:
            await client.aclose()

    asyncio.run(go())
    assert sample(m, "inferq_stream_lag", model="old", lane="normal") is None
    assert sample(m, "inferq_dlq_length", model="old") is None


def test_a_failed_refresh_is_counted_and_the_refresher_keeps_going():
    m = GatewayMetrics()

    async def go() -> None:
        client = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0")
        gauges = StreamGauges(m, client, Keys("nowhere"), interval_s=0.01)
        task = asyncio.create_task(gauges.run())  # the gateway's Loops own it in service
        try:
            for _ in range(1000):  # up to 10 s
                if (sample(m, "inferq_stream_gauges_refresh_failures_total") or 0) >= 3:
                    break
                await asyncio.sleep(0.01)
            else:
                pytest.fail("no failed refresh was counted")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.aclose()

    asyncio.run(go())
    assert sample(m, "inferq_stream_gauges_last_refresh_timestamp_seconds") == 0
