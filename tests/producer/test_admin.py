"""The model-control API's checks that need no Redis: the token and the load parameters."""

from __future__ import annotations

import pytest

from producer.admin import check_token, parse_load
from producer.errors import BadRequest, Forbidden, Unauthorized
from producer.registry import merge
from protocol.control import VersionPolicy
from protocol.registry import ModelMetadata, TensorSpec, WorkerInfo


def test_no_configured_token_disables_the_api():
    with pytest.raises(Forbidden, match="--admin-token"):
        check_token(None, "Bearer anything")


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer   ", "Basic dXNlcjpwYXNz", "t0k"])
def test_missing_credentials_are_401(header):
    with pytest.raises(Unauthorized):
        check_token("t0k", header)


def test_a_wrong_token_is_403_and_the_right_one_passes():
    with pytest.raises(Forbidden):
        check_token("t0k", "Bearer t0kk")
    check_token("t0k", "Bearer t0k")
    check_token("t0k", "bearer  t0k ")


def test_load_parameters():
    assert parse_load(None).versions == ()
    assert parse_load({"version": "2"}).versions == ("2",)
    assert parse_load({"version": 2}).versions == ("2",)
    weighted = parse_load({"weights": {"10": 1, "2": 9}})
    assert weighted.versions == ("2", "10") and weighted.weights == {"10": 1.0, "2": 9.0}


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ("2", "must be a JSON object"),
        ({"version": "../../etc"}, "no paths"),
        ({"version": "/abs"}, "no paths"),
        ({"version": None}, "invalid version"),
        ({"version": "1", "weights": {"1": 1}}, "not both"),
        ({"config": "{}"}, "only from its model repository"),
        ({"file:1/model.onnx": "AA=="}, "only from its model repository"),
        ({"versions": ["1"]}, "unknown parameter 'versions'"),
        ({"weights": {"1": -5}}, "not negative"),
    ],
)
def test_bad_load_parameters_say_what_is_wrong(params, words):
    with pytest.raises(BadRequest, match=words):
        parse_load(params)


def _meta(versions: tuple[str, ...], weights: dict[str, float] | None = None) -> ModelMetadata:
    return ModelMetadata(
        "m",
        versions,
        versions[-1],
        "onnxruntime_onnx",
        (TensorSpec("x", "FP32", (-1, 1)),),
        (TensorSpec("y", "FP32", (-1, 1)),),
        8,
        1000,
        True,
        60,
        weights or {},
    )


def test_the_registry_routes_by_the_committed_policy_over_what_workers_advertise():
    worker = WorkerInfo("w", "h", 1, 0, (_meta(("1", "2")),))
    plain = merge([worker], {})["m"]
    assert plain.traffic == {"2": 1.0} and plain.metadata.default_version == "2"
    canary = merge([worker], {}, {"m": VersionPolicy(("1", "2"), {"1": 9, "2": 1}, 3)})["m"]
    assert canary.traffic == {"1": 0.9, "2": 0.1}
    assert canary.metadata.default_version == "1"
    unloaded = merge([worker], {}, {"m": VersionPolicy((), {}, 4)})["m"]
    assert unloaded.unloaded and unloaded.metadata.versions == ()


def test_a_repository_config_split_is_used_when_no_policy_is_committed():
    worker = WorkerInfo("w", "h", 1, 0, (_meta(("1", "2"), {"1": 3.0, "2": 1.0}),))
    assert merge([worker], {})["m"].traffic == {"1": 0.75, "2": 0.25}
