"""The rules a request is taken on, stated once per kind: submit-and-wait and async jobs
differ in their default timeout and its cap, their lane without a priority, and the cache."""

from __future__ import annotations

from typing import Any

import pytest

from producer.errors import BadRequest
from producer.jobs import job_terms
from producer.service import Schedule, infer_terms, schedule
from producer.settings import GatewaySettings
from producer.v2_request import InferRequestBody
from protocol.keys import Lane
from protocol.registry import ModelMetadata

SETTINGS = GatewaySettings(max_timeout_ms=30_000, job_timeout_s=600, job_ttl_s=3_600)
MODEL = ModelMetadata(
    name="m",
    versions=("1",),
    default_version="1",
    platform="onnxruntime_onnx",
    inputs=(),
    outputs=(),
    max_batch=8,
    default_timeout_ms=2_000,
    cache_enabled=True,
    cache_ttl_s=60,
)


def scheduled(job: bool, no_cache: bool = False, **parameters: Any) -> Schedule:
    body = InferRequestBody(None, [], None, frozenset(), False, parameters)
    terms = job_terms(SETTINGS) if job else infer_terms(SETTINGS)
    return schedule(MODEL, body, terms, no_cache=no_cache)


def test_without_parameters_a_request_takes_its_model_default_and_a_job_the_job_timeout():
    assert scheduled(job=False) == Schedule(2_000, 0, Lane.NORMAL, use_cache=True)
    assert scheduled(job=True) == Schedule(600_000, 0, Lane.LOW, use_cache=False)


def test_a_named_timeout_is_capped_by_max_timeout_for_requests_and_retention_for_jobs():
    assert scheduled(job=False, timeout=5_000_000).timeout_ms == 5_000
    assert scheduled(job=False, timeout=10**12).timeout_ms == 30_000
    assert scheduled(job=True, timeout=10**12).timeout_ms == 3_600_000
    assert scheduled(job=True, timeout=500).timeout_ms == 1  # under a millisecond: the least


def test_a_named_priority_picks_the_lane_for_both_kinds():
    for job in (False, True):
        assert scheduled(job, priority=1).lane is Lane.HIGH
        assert scheduled(job, priority=0).lane is Lane.NORMAL
        assert scheduled(job, priority=2).lane is Lane.LOW


def test_the_cache_answers_requests_unless_the_caller_or_the_request_says_no():
    assert scheduled(job=False, no_cache=True).use_cache is False
    assert scheduled(job=False, cache=False).use_cache is False
    assert scheduled(job=True, cache=True).use_cache is False


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"timeout": -1}, "'timeout' must be a non-negative integer"),
        ({"timeout": True}, "'timeout' must be a non-negative integer"),
        ({"priority": "high"}, "'priority' must be a non-negative integer"),
        ({"cache": "no"}, "'cache' must be true or false"),
    ],
)
def test_bad_schedule_parameters_are_refused_alike_for_both_kinds(parameters, message):
    for job in (False, True):
        with pytest.raises(BadRequest, match=message):
            scheduled(job, **parameters)
