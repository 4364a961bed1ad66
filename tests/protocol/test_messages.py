"""Request, result and registry messages: round trips, versioning, and decoding garbage.

The decoders' contract is that anything malformed raises ``ProtocolError`` and nothing else, so a
consumer can catch one type and dead-letter the entry. The fuzz tests below feed several thousand
deterministic pseudo-random inputs to each decoder and check exactly that.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import pytest

from protocol import PROTOCOL_VERSION, ProtocolError, VersionMismatch
from protocol.messages import InferRequest, InferResult, Kind, Status, Timings
from protocol.registry import ModelMetadata, RepositoryModel, TensorSpec, WorkerInfo
from protocol.tensor import DATATYPES, Tensor, pack_bytes_elements

INT64_MAX = 2**63 - 1

# --------------------------------------------------------------------------------------------
# Valid messages


def _fp32() -> Tensor:
    return Tensor.from_numpy("input", np.arange(6, dtype=np.float32).reshape(2, 3))


def _text() -> Tensor:
    return Tensor.checked(
        "text", "BYTES", (3,), pack_bytes_elements([b"", b"hello", "h\u00e9".encode()])
    )


def _empty() -> Tensor:
    return Tensor.from_numpy("none", np.zeros((0, 4), dtype=np.int64))


def _scalar() -> Tensor:
    return Tensor.from_numpy("flag", np.array(True))


def _request_full() -> InferRequest:
    return InferRequest(
        id="9f86d081884c7d659a2feaa0c55ad015",
        model="digits",
        version="1",
        inputs=[_fp32()],
        outputs=["logits", "label"],
        deadline_ms=1_700_000_010_000,
        enqueued_ms=1_700_000_000_000,
        result_key="inferq:result:9f86d081884c7d659a2feaa0c55ad015",
        result_ttl_ms=60_000,
        reply_to="inferq:replies:gw-1",
        kind=Kind.JOB,
        priority=2,
        client_id="client-42",
        traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    )


def _request_minimal() -> InferRequest:
    return InferRequest(
        id="r1",
        model="echo",
        version="3",
        inputs=[_text()],
        outputs=None,
        deadline_ms=5,
        enqueued_ms=0,
        result_key="inferq:result:r1",
        result_ttl_ms=1,
    )


def _request_many() -> InferRequest:
    return InferRequest(
        id="r2",
        model="mixed",
        version="10",
        inputs=[_fp32(), _text(), _empty(), _scalar()],
        outputs=[],
        deadline_ms=-1,
        enqueued_ms=2**63 - 1,
        result_key="k",
        result_ttl_ms=0,
        reply_to=None,
        kind=Kind.INFER,
        priority=1,
        client_id=None,
        traceparent=None,
    )


def _request_no_inputs() -> InferRequest:
    return InferRequest(
        id="",
        model="m",
        version="v",
        inputs=[],
        outputs=None,
        deadline_ms=0,
        enqueued_ms=0,
        result_key="",
        result_ttl_ms=0,
    )


REQUESTS = [_request_full(), _request_minimal(), _request_many(), _request_no_inputs()]

RESULTS = [
    InferResult(
        id="r1",
        status=Status.OK,
        model="digits",
        version="1",
        outputs=[
            Tensor.from_numpy("logits", np.linspace(-1, 1, 20, dtype=np.float32).reshape(2, 10)),
            Tensor.from_numpy("label", np.array([3, 7], dtype=np.int64)),
        ],
        error=None,
        worker="host-123-abcd",
        timings=Timings(queued_ms=1.25, batch_wait_ms=0.5, infer_ms=3.0, batch_size=2),
    ),
    InferResult(id="r2", status=Status.EXPIRED, model="m", version="2", error="deadline passed"),
    InferResult(
        id="r3",
        status=Status.INVALID,
        model="echo",
        version="1",
        outputs=[_text(), _empty()],
        error="bad input",
        worker="w",
    ),
    InferResult(id="r4", status=Status.FAILED, model="m", version="1", error=None),
]


def _metadata(name: str = "digits", cache: bool = True) -> ModelMetadata:
    return ModelMetadata(
        name=name,
        versions=("1", "2", "10"),
        default_version="10",
        platform="onnxruntime_onnx",
        inputs=(TensorSpec("input", "FP32", (-1, 64)),),
        outputs=(TensorSpec("logits", "FP32", (-1, 10)), TensorSpec("label", "INT64", (-1,))),
        max_batch=64,
        default_timeout_ms=10_000,
        cache_enabled=cache,
        cache_ttl_s=300,
        weights={"2": 90.0, "10": 10.0} if cache else {},
    )


def _metadata_bytes() -> ModelMetadata:
    return ModelMetadata(
        name="echo",
        versions=(),
        default_version="",
        platform="simulated",
        inputs=(TensorSpec("text", "BYTES", (-1,)), TensorSpec("n", "INT32", (-1, 0, 3))),
        outputs=(),
        max_batch=1,
        default_timeout_ms=0,
        cache_enabled=False,
        cache_ttl_s=0,
    )


METADATA = [_metadata(), _metadata_bytes()]

WORKERS = [
    WorkerInfo(id="host-1-ab", host="host", pid=1234, started_ms=1_700_000_000_000, models=()),
    WorkerInfo(id="w", host="h", pid=1, started_ms=0, models=(_metadata(),)),
    WorkerInfo(
        id="w2",
        host="h2",
        pid=2**31,
        started_ms=2**62,
        models=(_metadata("a"), _metadata("b", cache=False), _metadata_bytes()),
    ),
    WorkerInfo(
        id="w3",
        host="h3",
        pid=3,
        started_ms=3,
        models=(_metadata("a"),),
        repository=(
            RepositoryModel("a", ("1", "2", "10"), _metadata("a")),
            RepositoryModel("new", ("1",), _metadata("new")),
            RepositoryModel("broken", (), None, "models/broken/config.toml: not valid TOML"),
        ),
        fallbacks={"a": 7},
    ),
    WorkerInfo(
        id="w4", host="h4", pid=4, started_ms=4, models=(), resident_bytes=2**40, restarts=7
    ),
]


# --------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: r.model)
def test_infer_request_decodes_to_exactly_what_was_encoded(request_: InferRequest) -> None:
    decoded = InferRequest.decode(request_.encode())
    assert decoded == request_
    assert decoded.encode() == request_.encode()


def test_infer_request_keeps_none_and_empty_outputs_apart() -> None:
    none = InferRequest.decode(_request_minimal().encode())
    empty = InferRequest.decode(_request_many().encode())
    assert none.outputs is None
    assert empty.outputs == []


def test_infer_request_optional_fields_come_back_as_none() -> None:
    decoded = InferRequest.decode(_request_minimal().encode())
    assert decoded.reply_to is None
    assert decoded.client_id is None
    assert decoded.traceparent is None
    assert decoded.kind is Kind.INFER
    assert decoded.priority == 0


def test_infer_request_carries_bytes_and_multiple_tensors_intact() -> None:
    decoded = InferRequest.decode(_request_many().encode())
    assert [t.name for t in decoded.inputs] == ["input", "text", "none", "flag"]
    assert decoded.inputs[1].to_numpy().tolist() == [b"", b"hello", "h\u00e9".encode()]
    np.testing.assert_array_equal(
        decoded.inputs[0].to_numpy(), np.arange(6, dtype=np.float32).reshape(2, 3)
    )
    assert decoded.inputs[2].to_numpy().shape == (0, 4)
    assert decoded.inputs[3].to_numpy().shape == ()


@pytest.mark.parametrize("result", RESULTS, ids=lambda r: r.status.value)
def test_infer_result_decodes_to_exactly_what_was_encoded(result: InferResult) -> None:
    decoded = InferResult.decode(result.encode())
    assert decoded == result
    assert decoded.encode() == result.encode()


def test_infer_result_timings_come_back_typed() -> None:
    timings = InferResult.decode(RESULTS[0].encode()).timings
    assert timings == Timings(1.25, 0.5, 3.0, 2)
    assert isinstance(timings.batch_size, int)
    assert all(isinstance(x, float) for x in (timings.queued_ms, timings.infer_ms))


@pytest.mark.parametrize("metadata", METADATA, ids=lambda m: m.name)
def test_model_metadata_decodes_to_exactly_what_was_encoded(metadata: ModelMetadata) -> None:
    assert ModelMetadata.decode(metadata.encode()) == metadata
    assert ModelMetadata.from_wire(metadata.wire()) == metadata


@pytest.mark.parametrize("worker", WORKERS, ids=lambda w: w.id)
def test_worker_info_decodes_to_exactly_what_was_encoded(worker: WorkerInfo) -> None:
    decoded = WorkerInfo.decode(worker.encode())
    assert decoded == worker
    assert decoded.encode() == worker.encode()


def test_an_older_workers_advertisement_without_memory_and_restarts_still_decodes() -> None:
    items = unpack(WORKERS[3].encode())[:-2]  # what a worker of the release before sent
    decoded = WorkerInfo.decode(pack(items))
    assert decoded.resident_bytes == 0 and decoded.restarts == 0
    assert decoded == WORKERS[3]


@pytest.mark.parametrize("fields", [7, 11], ids=["one short of the older form", "one too many"])
def test_worker_info_with_fields_missing_or_extra_is_rejected(fields: int) -> None:
    items = unpack(WORKERS[4].encode())
    items = items[: fields + 1] if fields < len(items) - 1 else [*items, 0]
    with pytest.raises(ProtocolError, match="expected 8 to 10"):
        WorkerInfo.decode(pack(items))


# --------------------------------------------------------------------------------------------
# Protocol versions

ENCODED: list[tuple[str, Callable[[bytes], object], bytes]] = [
    ("request", InferRequest.decode, _request_full().encode()),
    ("result", InferResult.decode, RESULTS[0].encode()),
    ("metadata", ModelMetadata.decode, _metadata().encode()),
    ("worker", WorkerInfo.decode, WORKERS[1].encode()),
]
DECODERS = [(name, decode) for name, decode, _ in ENCODED]


def _with_version(raw: bytes, version: object) -> bytes:
    items = msgpack.unpackb(raw, raw=False)
    items[0] = version
    return msgpack.packb(items, use_bin_type=True)


@pytest.mark.parametrize(("what", "decode", "raw"), ENCODED, ids=[e[0] for e in ENCODED])
@pytest.mark.parametrize("version", [PROTOCOL_VERSION + 1, 0, 99, "1", None])
def test_a_message_from_another_protocol_version_is_a_version_mismatch(
    what: str, decode: Callable[[bytes], object], raw: bytes, version: object
) -> None:
    with pytest.raises(VersionMismatch) as info:
        decode(_with_version(raw, version))
    assert isinstance(info.value, ProtocolError)
    assert info.value.got == version
    assert info.value.expected == PROTOCOL_VERSION
    assert "upgrade" in str(info.value)
    assert repr(version) in str(info.value)


@pytest.mark.parametrize(("what", "decode", "raw"), ENCODED, ids=[e[0] for e in ENCODED])
@pytest.mark.parametrize("version", [True, float(PROTOCOL_VERSION)])
def test_a_version_that_only_compares_equal_is_not_the_protocol_version(
    what: str, decode: Callable[[bytes], object], raw: bytes, version: object
) -> None:
    with pytest.raises(VersionMismatch):
        decode(_with_version(raw, version))


def test_version_mismatch_is_caught_as_a_protocol_error() -> None:
    raw = _with_version(_request_full().encode(), PROTOCOL_VERSION + 1)
    with pytest.raises(ProtocolError, match="upgrade the gateway and the workers"):
        InferRequest.decode(raw)


@pytest.mark.parametrize(("what", "decode"), DECODERS, ids=[d[0] for d in DECODERS])
def test_a_deeply_nested_version_is_reported_without_overflowing_the_stack(
    what: str, decode: Callable[[bytes], object]
) -> None:
    # msgpack accepts ~1000 levels of nesting, deeper than repr() can recurse.
    raw = b"\x92" + b"\x91" * 1020 + b"\xc0" + b"\xc0"
    with pytest.raises(VersionMismatch):
        decode(raw)


# --------------------------------------------------------------------------------------------
# Decoding garbage: ProtocolError and nothing else
#
# A schema describes every position in a valid message; a mutation replaces one position with a
# value that position cannot legally hold (another type, an unknown enum value, a negative or
# out-of-range dimension), or changes the arity of a fixed-size list, or makes a tensor's data
# disagree with its shape. Every such mutant must be rejected with ProtocolError.


@dataclass(frozen=True)
class Node:
    kind: str
    children: tuple[Node, ...] = ()
    values: frozenset[str] = frozenset()


STR = Node("str")
OPT_STR = Node("opt_str")
INT = Node("int")
NUM = Node("num")
BOOL = Node("bool")
BYTES_ = Node("bytes")
VERSION = Node("version")
DIM = Node("dim")
SPEC_DIM = Node("spec_dim")


def fixed(*children: Node) -> Node:
    return Node("fixed", children)


def list_of(child: Node) -> Node:
    return Node("list", (child,))


def opt_list_of(child: Node) -> Node:
    return Node("opt_list", (child,))


def enum(values: frozenset[str] | set[str]) -> Node:
    return Node("enum", values=frozenset(values))


TENSOR = Node("tensor", (STR, enum(DATATYPES), list_of(DIM), BYTES_))
SPEC = fixed(STR, enum(DATATYPES), list_of(SPEC_DIM))
WEIGHTS = Node("weights")
METADATA_WIRE = fixed(
    STR, list_of(STR), STR, STR, list_of(SPEC), list_of(SPEC), INT, INT, BOOL, INT, WEIGHTS
)
REQUEST_SCHEMA = fixed(
    VERSION,
    STR,
    STR,
    STR,
    list_of(TENSOR),
    opt_list_of(STR),
    INT,
    INT,
    STR,
    INT,
    OPT_STR,
    enum({k.value for k in Kind}),
    INT,
    OPT_STR,
    OPT_STR,
)
RESULT_SCHEMA = fixed(
    VERSION,
    STR,
    enum({s.value for s in Status}),
    STR,
    STR,
    list_of(TENSOR),
    OPT_STR,
    STR,
    fixed(NUM, NUM, NUM, INT),
)
METADATA_SCHEMA = fixed(VERSION, METADATA_WIRE)
WORKER_SCHEMA = fixed(VERSION, STR, STR, INT, INT, list_of(METADATA_WIRE))

HUGE_INTS = [2**63 - 1, 2**63, 2**64 - 1, -(2**63), 2**32, -(2**31)]
JUNK: dict[str, list[Any]] = {
    "str": ["", "x", "1", "ok", "infer", "FP32", "h\u00e9", "\x00"],
    "int": [0, 1, -1, 2, 7, *HUGE_INTS],
    "bool": [True, False],
    "float": [0.0, 1.0, -1.5, 1e308, math.inf, -math.inf, math.nan],
    "bytes": [b"", b"\x00\xff", b"abc", b"\x01\x00\x00\x00x"],
    "none": [None],
    "list": [[], [1], ["a", b"b"], [[[]]], [None, [True, {"k": [1.5]}]], [[1, "x", b"", 2]]],
    "dict": [{}, {"a": 1}, {"m": [1, 2]}, {"x": {"y": {"z": None}}}],
}
UNKNOWN_NAMES = ["", "fp32", "FP8", "BF16", "STRING", "OK", "Infer", "cancelled", " ok", "ok\x00"]


def class_of(value: Any) -> str:
    if value is None:
        return "none"
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if isinstance(value, kind):
            return name
    if isinstance(value, bytes):
        return "bytes"
    if isinstance(value, list):
        return "list"
    return "dict"


ALLOWED = {
    "str": {"str"},
    "opt_str": {"str", "none"},
    "int": {"int"},
    "num": {"int", "float"},
    "bool": {"bool"},
    "bytes": {"bytes"},
    "enum": {"str"},
    "list": {"list"},
    "opt_list": {"list", "none"},
    "fixed": {"list"},
    "tensor": {"list"},
    "dim": {"int"},
    "spec_dim": {"int"},
    "version": {"int"},
    "weights": {"dict"},
}


def junk_not_in(rng: random.Random, allowed: set[str]) -> Any:
    classes = sorted(set(JUNK) - allowed)
    return copy.deepcopy(rng.choice(JUNK[rng.choice(classes)]))


def positions(value: Any, node: Node, path: tuple[int, ...] = ()) -> Iterator[tuple[Any, Node]]:
    """Every (path, node) in a valid value, outermost first."""
    yield path, node
    if node.kind in ("fixed", "tensor"):
        for i, child in enumerate(node.children):
            yield from positions(value[i], child, (*path, i))
    elif node.kind in ("list", "opt_list") and value is not None:
        for i, item in enumerate(value):
            yield from positions(item, node.children[0], (*path, i))


def invalid_value(rng: random.Random, value: Any, node: Node) -> Any:
    """A value that the position described by ``node`` (now holding ``value``) cannot hold."""
    choice = rng.random()
    if node.kind == "version":
        # Anything but the integer PROTOCOL_VERSION, including values that compare equal to it.
        if choice < 0.3:
            return rng.choice([True, float(PROTOCOL_VERSION), PROTOCOL_VERSION + 1, 0, -1])
        return rng.choice([v for vs in JUNK.values() for v in vs if v != PROTOCOL_VERSION])
    if node.kind == "enum" and choice < 0.5:
        return rng.choice(UNKNOWN_NAMES)
    if node.kind == "dim" and choice < 0.5:
        return rng.choice([-1, -2, -(2**63), 2**63, 2**64 - 1])
    if node.kind == "spec_dim" and choice < 0.5:
        return rng.choice([-2, -3, -(2**63)])
    if node.kind == "fixed" and choice < 0.5:
        items = list(value)
        if rng.random() < 0.5 and items:
            del items[rng.randrange(len(items))]
        else:
            items.insert(rng.randrange(len(items) + 1), junk_not_in(rng, set()))
        return items
    if node.kind == "tensor" and choice < 0.6:
        return mismatched_tensor(rng, value)
    return junk_not_in(rng, ALLOWED[node.kind])


def mismatched_tensor(rng: random.Random, wire: list[Any]) -> list[Any]:
    """A tensor whose data no longer fits its shape (or whose datatype is unknown)."""
    name, datatype, shape, data = copy.deepcopy(wire)
    count = math.prod(shape)
    how = rng.randrange(5)
    if how == 0:
        data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 9)))
    elif how == 1 and data:
        data = data[: rng.randrange(len(data))]
    elif how == 2 and count:
        shape.insert(rng.randrange(len(shape) + 1), rng.choice([2, 3, INT64_MAX]))
    elif how == 3:
        datatype = rng.choice(UNKNOWN_NAMES)
    elif count == 0:
        shape = [rng.choice([1, 5, INT64_MAX])]
    elif not shape:  # a scalar: one element
        shape = [rng.choice([0, 2, INT64_MAX])]
    else:
        i = rng.randrange(len(shape))  # every dimension is non-zero: count > 0
        shape[i] = shape[i] + rng.choice([1, 2, INT64_MAX - shape[i]])
    return [name, datatype, shape, data]


def set_at(value: Any, path: tuple[int, ...], new: Any) -> Any:
    if not path:
        return new
    out = copy.deepcopy(value)
    target = out
    for i in path[:-1]:
        target = target[i]
    target[path[-1]] = new
    return out


def mutants(rng: random.Random, wire: Any, schema: Node, n: int) -> Iterator[Any]:
    spots = list(positions(wire, schema))
    for _ in range(n):
        path, node = rng.choice(spots)
        target: Any = wire
        for i in path:
            target = target[i]
        yield set_at(wire, path, invalid_value(rng, target, node))


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def unpack(raw: bytes) -> Any:
    return msgpack.unpackb(raw, raw=False)


@dataclass(frozen=True)
class Decoder:
    name: str
    decode: Callable[[bytes], Any]
    schema: Node
    samples: tuple[bytes, ...]


DECODER_CASES = [
    Decoder(
        "InferRequest", InferRequest.decode, REQUEST_SCHEMA, tuple(r.encode() for r in REQUESTS)
    ),
    Decoder("InferResult", InferResult.decode, RESULT_SCHEMA, tuple(r.encode() for r in RESULTS)),
    Decoder("WorkerInfo", WorkerInfo.decode, WORKER_SCHEMA, tuple(w.encode() for w in WORKERS)),
    Decoder(
        "ModelMetadata", ModelMetadata.decode, METADATA_SCHEMA, tuple(m.encode() for m in METADATA)
    ),
]


class Leaks:
    """Collects inputs that a decoder did not reject with ProtocolError."""

    def __init__(self) -> None:
        self.found: list[str] = []

    def expect_rejected(self, decode: Callable[[Any], Any], raw: Any) -> None:
        try:
            decode(raw)
        except ProtocolError:
            return
        except Exception as e:
            self.found.append(f"{type(e).__name__}: {e!s:.200} <- {raw!r:.300}")
        else:
            self.found.append(f"accepted <- {raw!r:.300}")

    def expect_rejected_or_canonical(self, decode: Callable[[bytes], Any], raw: bytes) -> bool:
        """Garbage that happens to be valid must re-encode to something that decodes again."""
        try:
            decoded = decode(raw)
        except ProtocolError:
            return True
        except Exception as e:
            self.found.append(f"{type(e).__name__}: {e!s:.200} <- {raw!r:.300}")
            return True
        again = decoded.encode()
        if decode(again).encode() != again:
            self.found.append(f"accepted but does not round-trip <- {raw!r:.300}")
        return False

    def check(self) -> None:
        assert not self.found, f"{len(self.found)} leaks, e.g.:\n" + "\n".join(self.found[:10])


def _ids(cases: list[Decoder]) -> list[str]:
    return [c.name for c in cases]


def _seed(name: str, salt: int) -> int:
    return sum(name.encode()) * 1_000_003 + salt


@pytest.mark.parametrize("case", DECODER_CASES, ids=_ids(DECODER_CASES))
def test_random_bytes_are_rejected_with_protocol_error_only(case: Decoder) -> None:
    rng = random.Random(_seed(case.name, 1))
    leaks = Leaks()
    for i in range(1500):
        n = rng.randint(0, 80)
        body = bytes(rng.randrange(256) for _ in range(n))
        # Half start like a real message (an array whose first item is the version) so the
        # garbage reaches the field decoders rather than failing the first check.
        if i % 2:
            body = bytes([0x90 | rng.randint(1, 15), PROTOCOL_VERSION]) + body
        leaks.expect_rejected(case.decode, body)
    leaks.check()


@pytest.mark.parametrize("case", DECODER_CASES, ids=_ids(DECODER_CASES))
def test_every_truncation_of_a_valid_message_is_rejected(case: Decoder) -> None:
    leaks = Leaks()
    for raw in case.samples:
        for cut in range(len(raw)):
            leaks.expect_rejected(case.decode, raw[:cut])
    leaks.check()


@pytest.mark.parametrize("case", DECODER_CASES, ids=_ids(DECODER_CASES))
def test_well_formed_msgpack_of_the_wrong_shape_is_rejected(case: Decoder) -> None:
    rng = random.Random(_seed(case.name, 2))
    leaks = Leaks()
    for raw in case.samples:
        for mutant in mutants(rng, unpack(raw), case.schema, 1200 // len(case.samples)):
            leaks.expect_rejected(case.decode, pack(mutant))
    # Values that are not messages at all.
    for junk in [v for vs in JUNK.values() for v in vs]:
        leaks.expect_rejected(case.decode, pack(junk))
    leaks.check()


@pytest.mark.parametrize("case", DECODER_CASES, ids=_ids(DECODER_CASES))
def test_bit_flipped_messages_are_rejected_or_decode_to_a_canonical_message(
    case: Decoder,
) -> None:
    rng = random.Random(_seed(case.name, 3))
    leaks = Leaks()
    rejected = 0
    total = 0
    for raw in case.samples:
        for _ in range(800 // len(case.samples)):
            flipped = bytearray(raw)
            for _ in range(rng.randint(1, 3)):
                flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
            rejected += leaks.expect_rejected_or_canonical(case.decode, bytes(flipped))
            total += 1
    leaks.check()
    assert rejected > total // 10  # the flips do reach the validation, not just string bytes


def test_map_keys_that_are_not_strings_are_rejected() -> None:
    raw = pack([PROTOCOL_VERSION, "id", {1: 2}])
    for decode in (InferRequest.decode, WorkerInfo.decode, ModelMetadata.decode):
        with pytest.raises(ProtocolError):
            decode(raw)


# Specific wrong types, one per field kind, so a regression names the case.

WRONG_REQUEST_FIELDS = [
    (1, 42, "id is an int"),
    (2, None, "model is None"),
    (3, 1, "version is an int"),
    (4, {"input": []}, "inputs is a map"),
    (5, "logits", "outputs is a string"),
    (5, ["logits", 3], "outputs holds an int"),
    (6, True, "deadline_ms is a bool"),
    (6, 1.5, "deadline_ms is a float"),
    (7, "0", "enqueued_ms is a string"),
    (8, b"key", "result_key is bytes"),
    (9, None, "result_ttl_ms is None"),
    (10, 7, "reply_to is an int"),
    (11, "batch", "kind is unknown"),
    (11, ["infer"], "kind is a list"),
    (12, False, "priority is a bool"),
    (13, [], "client_id is a list"),
    (14, 1.0, "traceparent is a float"),
]


@pytest.mark.parametrize(
    ("index", "value", "why"), WRONG_REQUEST_FIELDS, ids=[w[2] for w in WRONG_REQUEST_FIELDS]
)
def test_infer_request_with_a_wrongly_typed_field_is_rejected(
    index: int, value: Any, why: str
) -> None:
    items = unpack(_request_full().encode())
    items[index] = value
    with pytest.raises(ProtocolError):
        InferRequest.decode(pack(items))


WRONG_RESULT_FIELDS = [
    (2, "done", "status is unknown"),
    (2, 0, "status is an int"),
    (5, [["x", "FP32", [-1], b""]], "an output has a negative dimension"),
    (5, [["x", "FP32", [2], b"\0\0\0\0"]], "an output's data is short"),
    (5, [["x", "COMPLEX", [1], b"\0"]], "an output has an unknown datatype"),
    (8, [1.0, 2.0, 3.0], "timings has three numbers"),
    (8, [1.0, 2.0, 3.0, True], "batch_size is a bool"),
    (8, [1.0, 2.0, 3.0, 2.5], "batch_size is a fraction"),
    (8, [1.0, 2.0, 3.0, math.inf], "batch_size is infinite"),
    (8, [1.0, 2.0, 3.0, math.nan], "batch_size is nan"),
    (8, ["1", 2.0, 3.0, 4], "a timing is a string"),
]


@pytest.mark.parametrize(
    ("index", "value", "why"), WRONG_RESULT_FIELDS, ids=[w[2] for w in WRONG_RESULT_FIELDS]
)
def test_infer_result_with_a_wrongly_typed_field_is_rejected(
    index: int, value: Any, why: str
) -> None:
    items = unpack(RESULTS[0].encode())
    items[index] = value
    with pytest.raises(ProtocolError):
        InferResult.decode(pack(items))


WRONG_WORKER_FIELDS = [
    (1, 5, "id is an int"),
    (2, 5, "host is an int"),
    (2, None, "host is None"),
    (3, "1234", "pid is a string"),
    (3, "abc", "pid is not a number"),
    (3, None, "pid is None"),
    (3, math.inf, "pid is infinite"),
    (3, math.nan, "pid is nan"),
    (3, 1.5, "pid is a float"),
    (3, True, "pid is a bool"),
    (4, [1], "started_ms is a list"),
    (5, {}, "models is a map"),
    (5, [[1, 2]], "a model is a short list"),
    (9, -1, "resident_bytes is negative"),
    (9, 1.5, "resident_bytes is a float"),
    (10, True, "restarts is a bool"),
    (10, "3", "restarts is a string"),
]


@pytest.mark.parametrize(
    ("index", "value", "why"), WRONG_WORKER_FIELDS, ids=[w[2] for w in WRONG_WORKER_FIELDS]
)
def test_worker_info_with_a_wrongly_typed_field_is_rejected(
    index: int, value: Any, why: str
) -> None:
    items = unpack(WORKERS[1].encode())
    items[index] = value
    with pytest.raises(ProtocolError):
        WorkerInfo.decode(pack(items))


WRONG_METADATA_FIELDS = [
    (0, 1, "name is an int"),
    (1, "1", "versions is a string"),
    (1, [1], "a version is an int"),
    (2, None, "default_version is None"),
    (3, 7, "platform is an int"),
    (3, None, "platform is None"),
    (4, [["x", ["FP32"], [-1]]], "an input datatype is a list"),
    (4, [["x", {"FP32": 1}, [-1]]], "an input datatype is a map"),
    (4, [["x", "FP33", [-1]]], "an input datatype is unknown"),
    (4, [["x", "FP32", [-2]]], "an input dimension is below -1"),
    (4, [["x", "FP32", [True]]], "an input dimension is a bool"),
    (4, [["x", "FP32"]], "an input spec is short"),
    (5, [[3, "FP32", [-1]]], "an output name is an int"),
    (6, True, "max_batch is a bool"),
    (6, 64.0, "max_batch is a float"),
    (7, "10000", "default_timeout_ms is a string"),
    (8, 1, "cache_enabled is an int"),
    (9, False, "cache_ttl_s is a bool"),
]


@pytest.mark.parametrize(
    ("index", "value", "why"), WRONG_METADATA_FIELDS, ids=[w[2] for w in WRONG_METADATA_FIELDS]
)
def test_model_metadata_with_a_wrongly_typed_field_is_rejected(
    index: int, value: Any, why: str
) -> None:
    wire = _metadata().wire()
    wire[index] = value
    with pytest.raises(ProtocolError):
        ModelMetadata.decode(pack([PROTOCOL_VERSION, wire]))
    with pytest.raises(ProtocolError):
        WorkerInfo.decode(pack([PROTOCOL_VERSION, "w", "h", 1, 0, [wire]]))


# Tensor.from_wire takes an already-unpacked value.

TENSORS = [_fp32(), _text(), _empty(), _scalar()]


def test_tensor_from_wire_inverts_wire() -> None:
    for tensor in TENSORS:
        assert Tensor.from_wire(tensor.wire()) == tensor


def test_tensor_from_wire_rejects_garbage_with_protocol_error_only() -> None:
    rng = random.Random(4)
    leaks = Leaks()
    for junk in [v for vs in JUNK.values() for v in vs]:
        leaks.expect_rejected(Tensor.from_wire, junk)
    for tensor in TENSORS:
        for mutant in mutants(rng, tensor.wire(), TENSOR, 800):
            leaks.expect_rejected(Tensor.from_wire, mutant)
    for _ in range(1000):
        leaks.expect_rejected(
            Tensor.from_wire, [junk_not_in(rng, set()) for _ in range(rng.choice([3, 4, 4, 5]))]
        )
    leaks.check()


@pytest.mark.parametrize(
    "wire",
    [
        ("x", "FP32", [1], b"\0\0\0\0"),
        ["x", "FP32", (1,), b"\0\0\0\0"],
        ["x", "FP32", [1], bytearray(4)],
        ["x", "FP32", [1.0], b"\0\0\0\0"],
        ["x", "FP32", [True], b"\0\0\0\0"],
        ["x", "FP32", [-1, -1], b"\0\0\0\0"],
        ["x", "FP32", [2**63, 0], b""],
        ["x", "FP32", [10**5000, 0], b""],
        ["x", "FP32", [0, -(10**5000)], b""],
        ["x", b"FP32", [1], b"\0\0\0\0"],
        [b"x", "FP32", [1], b"\0\0\0\0"],
        ["x", "BYTES", [1], b"\x05\0\0\0abc"],
        ["x", "BYTES", [2], b"\x01\0\0\0a"],
    ],
)
def test_tensor_from_wire_rejects_a_malformed_tensor(wire: Any) -> None:
    with pytest.raises(ProtocolError):
        Tensor.from_wire(wire)


def test_tensor_dimensions_fit_in_int64_like_the_v2_protocol_says() -> None:
    assert Tensor.from_wire(["x", "FP32", [INT64_MAX, 0], b""]).shape == (INT64_MAX, 0)
    with pytest.raises(ProtocolError, match="int64"):
        Tensor.from_wire(["x", "FP32", [INT64_MAX + 1, 0], b""])
