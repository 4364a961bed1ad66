"""The worker's metrics: declared once with help text and fixed labels, named by the Prometheus
conventions, recorded per batch and per request, and served on their own port."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

import runtime
from consumer.metrics import LOAD_BUCKETS, WorkerMetrics
from runtime.metrics import COUNT_BUCKETS, LATENCY_BUCKETS, MetricsServer

EXPECTED: dict[str, tuple[str, tuple[str, ...]]] = {
    "inferq_worker_requests_total": ("counter", ("model", "version", "status")),
    "inferq_worker_expired_total": ("counter", ("model",)),
    "inferq_worker_cancelled_total": ("counter", ("model",)),
    "inferq_worker_dead_lettered_total": ("counter", ("model", "reason")),
    "inferq_worker_retried_total": ("counter", ("model",)),
    "inferq_worker_reclaimed_total": ("counter", ("model",)),
    "inferq_worker_jobs_run_again_total": ("counter", ("model",)),
    "inferq_worker_rows_total": ("counter", ("model",)),
    "inferq_worker_queue_wait_seconds": ("histogram", ("model", "lane")),
    "inferq_worker_batch_wait_seconds": ("histogram", ("model",)),
    "inferq_worker_inference_seconds": ("histogram", ("model",)),
    "inferq_worker_reply_seconds": ("histogram", ("model",)),
    "inferq_worker_batch_requests": ("histogram", ("model",)),
    "inferq_worker_batch_rows": ("histogram", ("model",)),
    "inferq_worker_held_entries": ("gauge", ()),
    "inferq_worker_info": ("info", ("worker", "version")),
    "inferq_worker_write_failures_total": ("counter", ("model", "reason")),
    "inferq_worker_policy_fallbacks_total": ("counter", ("model",)),
    "inferq_worker_model_loads_total": ("counter", ("model",)),
    "inferq_worker_model_unloads_total": ("counter", ("model", "reason")),
    "inferq_worker_model_load_seconds": ("histogram", ("model",)),
    "inferq_worker_loaded_models": ("gauge", ()),
    "inferq_worker_model_resident_bytes": ("gauge", ("model",)),
}
RUNTIME = {
    "inferq_loop_healthy": "gauge",
    "inferq_redis_evicting": "gauge",
    "inferq_redis_pool_connections": "gauge",
}
RUNTIME_LABELS = {
    "inferq_loop_healthy": ("loop",),
    "inferq_redis_evicting": ("policy",),
    "inferq_redis_pool_connections": ("state",),
}
"""Declared once in ``runtime.metrics.RuntimeGauges``, exported by gateways and workers alike."""
LOADS = "inferq_worker_model_load_seconds"
"""Model loads take milliseconds to minutes: buckets of their own (``LOAD_BUCKETS``)."""
LATENCY = {name for name in EXPECTED if name.endswith("_seconds") and name != LOADS}
COUNTS = {"inferq_worker_batch_requests", "inferq_worker_batch_rows"}


def exposed_name(family: Metric) -> str:
    suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
    return family.name + suffix


def families(metrics: WorkerMetrics) -> dict[str, Metric]:
    return {exposed_name(f): f for f in metrics.registry.collect() if f.name.startswith("inferq_")}


def sample(metrics: WorkerMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def exercise(m: WorkerMetrics) -> None:
    m.set_info("host-1-abc")
    m.track_held(lambda: 5)
    m.observe_dequeued("digits", "high", 0.002)
    m.observe_batch(
        "digits", requests=3, rows=7, batch_waits_s=[0.001, 0.002, 0.0], inference_s=0.01
    )
    m.observe_results({("digits", "1", "ok"): 1})
    m.observe_expired("digits", 2)
    m.observe_cancelled("digits", 3)
    m.observe_dead_letter("digits", "undecodable")
    m.observe_retry("digits")
    m.observe_reclaimed("digits", 4)
    m.observe_job_run_again("digits")
    m.observe_replies("digits", [0.0007])
    m.observe_write_failure("digits", "oom")
    m.observe_policy_fallback("digits")
    m.runtime.set_policy("noeviction", False)
    m.runtime.track_loops(lambda: {"reader": True})
    m.runtime.track_pool(lambda: {"in_use": 1, "idle": 7})
    m.track_loaded(lambda: 2)
    m.observe_load("digits", 0.2, 40 << 20)
    m.observe_unload("sim", "budget")


def test_the_worker_declares_exactly_the_documented_metrics_with_help_text():
    found = families(WorkerMetrics())
    assert {name: f.type for name, f in found.items()} == {
        **{name: kind for name, (kind, _) in EXPECTED.items()},
        **RUNTIME,
    }
    for name, family in found.items():
        assert len(family.documentation) > 30 and family.documentation.endswith("."), name


def test_names_follow_the_prometheus_conventions():
    for name, (kind, _) in EXPECTED.items():
        assert name.startswith("inferq_worker_") and name == name.lower()
        assert name.endswith("_total") == (kind == "counter"), name
    assert LATENCY == {
        "inferq_worker_queue_wait_seconds",
        "inferq_worker_batch_wait_seconds",
        "inferq_worker_inference_seconds",
        "inferq_worker_reply_seconds",
    }


def test_every_metric_carries_exactly_its_fixed_labels():
    m = WorkerMetrics()
    exercise(m)
    for name, family in families(m).items():
        assert family.samples, f"{name} was not exercised"
        for s in family.samples:
            labels = EXPECTED[name][1] if name in EXPECTED else RUNTIME_LABELS[name]
            assert set(s.labels) - {"le"} == set(labels), s


def test_latency_histograms_use_the_inference_buckets_and_batch_sizes_powers_of_two():
    m = WorkerMetrics()
    exercise(m)
    for name, family in families(m).items():
        if family.type != "histogram":
            continue
        bounds = [s.labels["le"] for s in family.samples if s.name.endswith("_bucket")]
        expected = (
            LOAD_BUCKETS if name == LOADS else LATENCY_BUCKETS if name in LATENCY else COUNT_BUCKETS
        )
        assert bounds == [*(str(float(b)) for b in expected), "+Inf"], name


def test_a_batch_records_its_size_rows_inference_time_and_each_requests_wait():
    m = WorkerMetrics()
    exercise(m)
    exercise(m)
    assert sample(m, "inferq_worker_rows_total", model="digits") == 14
    assert sample(m, "inferq_worker_batch_rows_count", model="digits") == 2
    assert sample(m, "inferq_worker_batch_rows_sum", model="digits") == 14
    assert sample(m, "inferq_worker_batch_requests_sum", model="digits") == 6
    assert sample(m, "inferq_worker_batch_wait_seconds_count", model="digits") == 6
    assert sample(m, "inferq_worker_inference_seconds_sum", model="digits") == pytest.approx(0.02)
    assert sample(m, "inferq_worker_queue_wait_seconds_count", model="digits", lane="high") == 2
    assert sample(m, "inferq_worker_expired_total", model="digits") == 4
    assert sample(m, "inferq_worker_reclaimed_total", model="digits") == 8
    assert sample(m, "inferq_worker_held_entries") == 5
    assert sample(m, "inferq_worker_info", worker="host-1-abc", version=runtime.__version__) == 1


def test_loads_and_unloads_are_counted_with_their_time_reason_and_memory():
    m = WorkerMetrics()
    exercise(m)
    m.observe_unload("digits", "a reason nobody declared")
    assert sample(m, "inferq_worker_model_loads_total", model="digits") == 1
    assert sample(m, "inferq_worker_model_load_seconds_sum", model="digits") == pytest.approx(0.2)
    assert sample(m, "inferq_worker_model_unloads_total", model="sim", reason="budget") == 1
    assert sample(m, "inferq_worker_model_unloads_total", model="digits", reason="other") == 1
    assert sample(m, "inferq_worker_loaded_models") == 2
    # An unloaded model holds nothing: its resident figure goes with it.
    assert sample(m, "inferq_worker_model_resident_bytes", model="digits") is None
    m.observe_unload("never-loaded", "idle")  # loaded at start: never measured


def test_label_values_stay_in_their_fixed_sets():
    m = WorkerMetrics()
    m.observe_results({("digits", "1", "expired"): 1, ("digits", "1", "failed"): 2})
    m.observe_dead_letter("digits", "a reason with the error text in it")
    m.observe_dequeued("digits", "normal", -0.004)  # clock estimate error: never negative
    requests = "inferq_worker_requests_total"
    assert sample(m, requests, model="digits", version="1", status="other") == 1
    assert sample(m, requests, model="digits", version="1", status="failed") == 2
    assert sample(m, "inferq_worker_dead_lettered_total", model="digits", reason="other") == 1
    assert sample(m, "inferq_worker_queue_wait_seconds_sum", model="digits", lane="normal") == 0


def test_requests_read_together_still_get_one_queue_wait_value_each():
    m = WorkerMetrics()
    m.observe_dequeued_many("digits", "high", [0.002, -0.001, 0.5])
    m.observe_dequeued_many("digits", "high", [])
    m.observe_dequeued("digits", "high", 0.25)
    wait = "inferq_worker_queue_wait_seconds"
    assert sample(m, f"{wait}_count", model="digits", lane="high") == 4
    assert sample(m, f"{wait}_sum", model="digits", lane="high") == pytest.approx(0.752)
    assert sample(m, f"{wait}_bucket", model="digits", lane="high", le="0.001") == 1


def test_each_worker_metrics_object_has_its_own_registry():
    a, b = WorkerMetrics(), WorkerMetrics()
    a.observe_expired("digits")
    assert sample(b, "inferq_worker_expired_total", model="digits") is None


def test_the_metrics_server_serves_the_registry_on_its_port_until_stopped():
    m = WorkerMetrics()
    exercise(m)
    server = MetricsServer(m.registry, port=0, host="127.0.0.1")
    port = server.start()
    try:
        reply = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
    finally:
        server.stop()
    assert reply.status_code == 200
    names = {f.name for f in text_string_to_metric_families(reply.text)}
    assert {"inferq_worker_rows", "inferq_worker_batch_rows", "process_cpu_seconds"} <= names
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1)
