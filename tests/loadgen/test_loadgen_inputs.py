"""Request bodies generated from model metadata (JSON and binary tensors) or read from a file."""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pytest

from loadgen.inputs import (
    InputSpec,
    ModelRef,
    bodies_from_file,
    build_requests,
    concrete_shape,
    encode_body,
    generate_tensors,
    input_specs,
    parse_model_url,
    random_tensor,
)

METADATA = {
    "name": "multi",
    "versions": ["1"],
    "inputs": [
        {"name": "pixels", "datatype": "FP32", "shape": [-1, 3, 2]},
        {"name": "ids", "datatype": "INT64", "shape": [-1, -1]},
        {"name": "mask", "datatype": "BOOL", "shape": [-1, 2]},
        {"name": "text", "datatype": "BYTES", "shape": [-1]},
        {"name": "half", "datatype": "FP16", "shape": [2]},
        {"name": "brain", "datatype": "BF16", "shape": [-1, 2]},
    ],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 1]}],
}


def split_binary(body: bytes, header_length: int) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Decode a binary-extension body: its JSON header and each input's raw bytes."""
    header = json.loads(body[:header_length])
    raw: dict[str, bytes] = {}
    pos = header_length
    for item in header["inputs"]:
        size = item["parameters"]["binary_data_size"]
        raw[item["name"]] = body[pos : pos + size]
        pos += size
    assert pos == len(body)
    return header, raw


@pytest.mark.parametrize(
    ("url", "server", "model", "version"),
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000", None, None),
        ("http://127.0.0.1:8000/", "http://127.0.0.1:8000", None, None),
        ("http://h:1/v2/models/digits", "http://h:1", "digits", None),
        ("http://h:1/v2/models/digits/infer", "http://h:1", "digits", None),
        ("http://h:1/v2/models/d/versions/3/jobs", "http://h:1", "d", "3"),
        ("http://h:1/proxy/v2/models/d/infer?x=1", "http://h:1/proxy", "d", None),
        ("http://h:1/proxy/", "http://h:1/proxy", None, None),
    ],
)
def test_model_urls(url: str, server: str, model: str | None, version: str | None) -> None:
    assert parse_model_url(url) == ModelRef(server, model, version)


def test_model_ref_paths() -> None:
    ref = ModelRef("http://h:1/proxy", "d", "2")
    assert ref.path() == "/proxy/v2/models/d/versions/2"
    assert ref.path("/infer") == "/proxy/v2/models/d/versions/2/infer"
    assert ref.url("/jobs") == "http://h:1/proxy/v2/models/d/versions/2/jobs"
    with pytest.raises(ValueError, match="no model"):
        ModelRef("http://h:1").path()


def test_shapes_from_metadata() -> None:
    specs = input_specs(METADATA)
    assert [s.name for s in specs] == ["pixels", "ids", "mask", "text", "half", "brain"]
    by = {s.name: s for s in specs}
    assert concrete_shape(by["pixels"]) == (1, 3, 2)
    assert concrete_shape(by["pixels"], rows=4) == (4, 3, 2)
    assert concrete_shape(by["ids"], rows=4) == (4, 1)  # only the first -1 is the batch
    assert concrete_shape(by["half"], rows=4) == (2,)  # fixed shapes stay as they are
    assert concrete_shape(by["ids"], rows=4, overrides={"ids": (4, 128)}) == (4, 128)


@pytest.mark.parametrize(
    "metadata",
    [
        {},
        {"inputs": []},
        {"inputs": [{"name": "x"}]},
        {"inputs": [{"name": "x", "datatype": "X", "shape": [1]}]},
    ],
)
def test_bad_metadata(metadata: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        input_specs(metadata)


def test_random_data_per_datatype_is_seeded_and_in_range() -> None:
    specs = input_specs(METADATA)
    a = generate_tensors(specs, rows=3, rng=np.random.default_rng(9))
    b = generate_tensors(specs, rows=3, rng=np.random.default_rng(9))
    c = generate_tensors(specs, rows=3, rng=np.random.default_rng(10))
    assert [t.raw() for t in a] == [t.raw() for t in b]
    assert [t.raw() for t in a] != [t.raw() for t in c]
    by = {t.name: t for t in a}
    pixels = by["pixels"].data
    assert isinstance(pixels, np.ndarray)
    assert pixels.dtype == np.float32 and pixels.shape == (3, 3, 2)
    assert ((pixels >= 0) & (pixels < 1)).all()
    ids = by["ids"].data
    assert isinstance(ids, np.ndarray) and ids.dtype == np.int64 and ids.shape == (3, 1)
    assert ((ids >= 0) & (ids < 100)).all()
    assert isinstance(by["mask"].data, np.ndarray) and by["mask"].data.dtype == np.bool_
    text = by["text"].data
    assert isinstance(text, list) and len(text) == 3
    assert all(len(s) == 8 and s.isalpha() and s.islower() for s in text)
    assert by["half"].shape == (2,)
    with pytest.raises(ValueError, match="does not have"):
        generate_tensors(specs, rng=np.random.default_rng(), overrides={"nope": (1,)})


def test_json_body() -> None:
    tensors = generate_tensors(input_specs(METADATA), rows=2, rng=np.random.default_rng(1))
    body, headers = encode_body(tensors, parameters={"priority": 1})
    assert headers == {"content-type": "application/json"}
    doc = json.loads(body)
    assert doc["parameters"] == {"priority": 1}
    by = {i["name"]: i for i in doc["inputs"]}
    assert by["pixels"]["shape"] == [2, 3, 2] and len(by["pixels"]["data"]) == 12
    assert by["ids"]["datatype"] == "INT64" and all(isinstance(v, int) for v in by["ids"]["data"])
    assert all(isinstance(v, bool) for v in by["mask"]["data"])
    assert all(isinstance(v, str) for v in by["text"]["data"])
    # BF16 values travel as the numbers they stand for: the top half of a float32
    for v in by["brain"]["data"]:
        bits = struct.unpack("<I", struct.pack("<f", v))[0]
        assert bits & 0xFFFF == 0 and 0 <= v < 1


def test_binary_body_round_trips() -> None:
    tensors = generate_tensors(input_specs(METADATA), rows=2, rng=np.random.default_rng(2))
    body, headers = encode_body(tensors, binary=True)
    assert headers["content-type"] == "application/octet-stream"
    header, raw = split_binary(body, int(headers["inference-header-content-length"]))
    assert header["parameters"] == {"binary_data_output": True}
    assert all("data" not in item for item in header["inputs"])
    by = {t.name: t for t in tensors}
    pixels = np.frombuffer(raw["pixels"], dtype="<f4").reshape(2, 3, 2)
    assert np.array_equal(pixels, by["pixels"].data)
    assert np.array_equal(np.frombuffer(raw["ids"], dtype="<i8").reshape(2, 1), by["ids"].data)
    assert raw["mask"] == np.asarray(by["mask"].data, dtype=np.uint8).tobytes()
    assert len(raw["half"]) == 4 and len(raw["brain"]) == 8
    # BYTES: 4-byte little-endian length, then the bytes, per element
    elements, pos = [], 0
    while pos < len(raw["text"]):
        (n,) = struct.unpack_from("<I", raw["text"], pos)
        elements.append(raw["text"][pos + 4 : pos + 4 + n])
        pos += 4 + n
    assert elements == by["text"].data


def test_bodies_from_a_file() -> None:
    doc = {
        "id": "r1",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [[1.5, 2.5]]}],
        "outputs": [{"name": "y"}],
        "parameters": {"priority": 2},
    }
    [(body, headers)] = bodies_from_file(doc, binary=False, parameters={"timeout": 5})
    sent = json.loads(body)
    assert headers == {"content-type": "application/json"}
    assert sent["inputs"] == doc["inputs"] and sent["outputs"] == doc["outputs"]
    assert sent["parameters"] == {"priority": 2, "timeout": 5} and sent["id"] == "r1"

    [(body, headers)] = bodies_from_file([doc], binary=True)
    header, raw = split_binary(body, int(headers["inference-header-content-length"]))
    assert np.frombuffer(raw["x"], dtype="<f4").tolist() == [1.5, 2.5]
    assert header["outputs"] == [{"name": "y"}] and header["id"] == "r1"
    assert len(bodies_from_file([doc, doc], binary=False)) == 2
    with pytest.raises(ValueError):
        bodies_from_file([], binary=False)
    with pytest.raises(ValueError, match="inputs"):
        bodies_from_file({"nothing": 1}, binary=False)
    with pytest.raises(ValueError, match="binary"):
        bodies_from_file({"inputs": [{"name": "x"}]}, binary=True)


def test_requests_carry_the_body_headers_and_the_users() -> None:
    tensor = random_tensor("x", "FP32", (1, 4), np.random.default_rng(0))
    body, own = encode_body([tensor], binary=True)
    [req] = build_requests("/v2/models/m/infer", [(body, own)], {"Cache-Control": "no-cache"})
    assert req.method == "POST" and req.path == "/v2/models/m/infer" and req.body == body
    assert req.headers["cache-control"] == "no-cache"
    assert req.headers["inference-header-content-length"] == own["inference-header-content-length"]
    assert b"Content-Length: " in req.encode()


def test_input_spec_is_a_value() -> None:
    assert (
        InputSpec("x", "FP32", (-1, 4))
        == input_specs({"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]})[0]
    )
