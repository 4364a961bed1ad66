"""Property-based: every decoder either round-trips or raises ProtocolError, whatever the bytes."""

from __future__ import annotations

import msgpack
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import ProtocolError
from protocol.messages import InferRequest, InferResult, Status
from protocol.registry import ModelMetadata, WorkerInfo
from protocol.tensor import DTYPES, Tensor

DECODERS = [InferRequest.decode, InferResult.decode, WorkerInfo.decode, ModelMetadata.decode]

# msgpack-shaped junk: what a peer speaking another dialect might send.
junk = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)  # what msgpack can carry
    | st.floats()
    | st.text()
    | st.binary(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=20,
)


def _only_protocol_errors(raw: bytes) -> None:
    for decode in DECODERS:
        try:
            decode(raw)
        except ProtocolError:
            pass


@settings(max_examples=300)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_decode_or_raise_protocol_error(raw: bytes) -> None:
    _only_protocol_errors(raw)


@settings(max_examples=300)
@given(junk)
def test_arbitrary_msgpack_decodes_or_raises_protocol_error(value: object) -> None:
    _only_protocol_errors(msgpack.packb([1, value], use_bin_type=True))
    _only_protocol_errors(msgpack.packb(value, use_bin_type=True))


@settings(max_examples=200)
@given(
    st.sampled_from(sorted(DTYPES)),
    st.lists(st.integers(min_value=0, max_value=4), min_size=1, max_size=3),
    st.text(min_size=1, max_size=8),
    st.integers(min_value=0, max_value=2**31),
)
def test_requests_round_trip(datatype: str, shape: list[int], name: str, deadline: int) -> None:
    arr = np.zeros(shape, dtype=DTYPES[datatype])
    tensor = Tensor.from_numpy(name, arr, datatype)
    request = InferRequest(
        id="r",
        model="m",
        version="1",
        inputs=[tensor],
        outputs=[name],
        deadline_ms=deadline,
        enqueued_ms=0,
        result_key="k",
        result_ttl_ms=1,
    )
    assert InferRequest.decode(request.encode()) == request
    result = InferResult("r", Status.OK, "m", "1", [tensor])
    assert InferResult.decode(result.encode()) == result
