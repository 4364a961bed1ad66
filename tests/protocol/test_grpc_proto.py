"""The gRPC contract: the committed classes are generated from inference.proto, and every message
inferq defines is, field for field, the one KServe and Triton clients send."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tritonclient.grpc.model_config_pb2 as triton_config
import tritonclient.grpc.service_pb2 as triton
from google.protobuf import descriptor_pb2

from protocol.grpc import inferq_v2_pb2 as pb
from protocol.grpc.service import METHODS, SERVICE

PROTO = Path(__file__).parents[2] / "protocol" / "grpc" / "inference.proto"


def test_the_committed_classes_are_generated_from_the_proto(tmp_path):
    """What `make grpc-stubs` would generate now describes exactly the committed classes."""
    text = PROTO.read_text()
    assert "\npackage inference;\n" in text
    (tmp_path / "inferq_v2.proto").write_text(
        text.replace("\npackage inference;\n", "\npackage inferq.v2;\n")
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{tmp_path}",
            f"--descriptor_set_out={tmp_path / 'set.pb'}",
            "inferq_v2.proto",
        ],
        check=True,
    )
    fresh = descriptor_pb2.FileDescriptorSet.FromString((tmp_path / "set.pb").read_bytes())
    for message in fresh.file[0].message_type:
        _drop_json_names(message)  # protoc adds them to descriptor sets, not to Python code
    committed = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(committed)
    assert fresh.file[0] == committed


def _drop_json_names(message: descriptor_pb2.DescriptorProto) -> None:
    for field in message.field:
        field.ClearField("json_name")
    for nested in message.nested_type:
        _drop_json_names(nested)


def _fields(message) -> dict[str, tuple[int, int, bool, str]]:
    return {
        f.name: (
            f.number,
            f.type,
            f.is_repeated,
            f.message_type.name if f.message_type else "",
        )
        for f in message.fields
    }


PARTIAL = {"ModelConfig", "ModelInput", "ModelOutput", "ModelDynamicBatching"}
"""Messages of Triton's model_config.proto that inferq declares in part: the fields it fills."""


def _check_message(ours, theirs, *, partial: bool = False) -> None:
    assert ours.name == theirs.name
    mine, tritons = _fields(ours), _fields(theirs)
    if partial:
        assert {k: tritons.get(k) for k in mine} == mine, ours.full_name
    else:
        assert mine == tritons, ours.full_name
    for nested in ours.nested_types:
        _check_message(nested, theirs.nested_types_by_name[nested.name], partial=partial)


def _tritons(name: str):
    found = triton.DESCRIPTOR.message_types_by_name.get(name)
    return found or triton_config.DESCRIPTOR.message_types_by_name[name]


def test_every_message_matches_tritons_field_for_field():
    for name, message in pb.DESCRIPTOR.message_types_by_name.items():
        _check_message(message, _tritons(name), partial=name in PARTIAL)


def test_the_data_types_are_tritons():
    ours = {v.name: v.number for v in pb.DESCRIPTOR.enum_types_by_name["DataType"].values}
    theirs = triton_config.DESCRIPTOR.enum_types_by_name["DataType"].values
    assert ours == {v.name: v.number for v in theirs}


def test_every_method_is_tritons_method_of_the_same_name():
    theirs = triton.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert theirs.full_name == SERVICE
    for name, method in METHODS.items():
        other = theirs.methods_by_name[name]
        assert method.path == f"/inference.GRPCInferenceService/{name}"
        assert method.request.DESCRIPTOR.name == other.input_type.name
        assert method.response.DESCRIPTOR.name == other.output_type.name
        assert (method.client_streaming, method.server_streaming) == (
            other.client_streaming,
            other.server_streaming,
        )
    assert {
        "ServerLive",
        "ServerReady",
        "ModelReady",
        "ServerMetadata",
        "ModelMetadata",
        "ModelInfer",
        "ModelStreamInfer",
        "ModelConfig",
        "ModelStatistics",
        "RepositoryIndex",
        "RepositoryModelLoad",
        "RepositoryModelUnload",
    } == set(METHODS)
