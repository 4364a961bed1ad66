"""Triton's model configuration from what the workers advertise, and its gRPC message from the
same document."""

from __future__ import annotations

from google.protobuf import json_format

from producer.introspection import config_document
from protocol.grpc import inferq_v2_pb2 as pb
from protocol.registry import ModelMetadata, TensorSpec


def meta(versions: tuple[str, ...]) -> ModelMetadata:
    return ModelMetadata(
        "topics",
        versions,
        versions[-1],
        "python",
        (TensorSpec("text", "BYTES", (-1,)),),
        (TensorSpec("labels", "BYTES", (-1, 3)), TensorSpec("scores", "FP32", (-1, 3))),
        32,
        10_000,
        True,
        300,
        backend="python",
        flush_ms=2.5,
    )


def test_the_config_speaks_tritons_names():
    doc = config_document(meta(("1", "3")))
    assert doc["input"] == [{"name": "text", "data_type": "TYPE_STRING", "dims": []}]
    assert doc["output"][1] == {"name": "scores", "data_type": "TYPE_FP32", "dims": [3]}
    assert doc["dynamic_batching"] == {"max_queue_delay_microseconds": 2500}
    assert doc["version_policy"] == {"specific": {"versions": [1, 3]}}
    assert doc["parameters"]["default_timeout_ms"] == {"string_value": "10000"}


def test_named_versions_have_no_triton_version_policy():
    assert "version_policy" not in config_document(meta(("1", "canary")))


def test_the_grpc_message_is_built_from_the_same_document():
    message = pb.ModelConfigResponse()
    json_format.ParseDict({"config": config_document(meta(("2",)))}, message)
    config = message.config
    assert (config.name, config.backend, config.max_batch_size) == ("topics", "python", 32)
    assert config.input[0].data_type == pb.TYPE_STRING and list(config.output[1].dims) == [3]
    assert list(config.version_policy.specific.versions) == [2]
    assert config.response_cache.enable
