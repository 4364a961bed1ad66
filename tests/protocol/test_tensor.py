"""Tensors on the wire: numpy round trips, byte order, shape checks and BYTES framing."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest

from protocol import ProtocolError
from protocol.tensor import (
    BYTES,
    DATATYPES,
    DTYPES,
    Tensor,
    datatype_of,
    pack_bytes_elements,
    unpack_bytes_elements,
)


def _sample(datatype: str, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    """Values spread over the datatype's range, including its extremes."""
    dtype = DTYPES[datatype]
    n = int(np.prod(shape))
    if dtype.kind == "b":
        values = np.arange(n) % 3 == 0
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        rng = np.random.default_rng(n)
        values = rng.integers(info.min, info.max, size=n, dtype=dtype, endpoint=True)
        if n >= 2:
            values[0], values[-1] = info.min, info.max
    else:
        values = np.linspace(-1000.5, 1000.25, n).astype(dtype)
        if n >= 3:
            values[0], values[1] = np.finfo(dtype).max, np.finfo(dtype).tiny
    return np.asarray(values, dtype=dtype).reshape(shape)


SHAPES = [(), (0,), (5,), (2, 3), (2, 0, 4), (1, 2, 3, 4)]


@pytest.mark.parametrize("datatype", sorted(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_fixed_size_datatype_round_trips_through_numpy(
    datatype: str, shape: tuple[int, ...]
) -> None:
    array = _sample(datatype, shape)
    tensor = Tensor.from_numpy("x", array)
    assert tensor.datatype == datatype
    assert tensor.shape == shape
    back = tensor.to_numpy()
    assert back.dtype == DTYPES[datatype]
    assert back.shape == shape
    np.testing.assert_array_equal(back, array)


@pytest.mark.parametrize("datatype", sorted(DTYPES))
def test_every_fixed_size_datatype_round_trips_through_the_wire_form(datatype: str) -> None:
    tensor = Tensor.from_numpy("x", _sample(datatype, (3, 4)))
    again = Tensor.from_wire(tensor.wire())
    assert again == tensor
    np.testing.assert_array_equal(again.to_numpy(), tensor.to_numpy())


@pytest.mark.parametrize("datatype", sorted(DTYPES))
def test_datatype_of_names_each_numpy_dtype_in_either_byte_order(datatype: str) -> None:
    dtype = DTYPES[datatype]
    assert datatype_of(dtype) == datatype
    assert datatype_of(dtype.newbyteorder(">")) == datatype


@pytest.mark.parametrize("dtype", [np.dtype(np.complex64), np.dtype("M8[s]"), np.dtype("V4")])
def test_datatype_of_refuses_a_dtype_with_no_v2_datatype(dtype: np.dtype[Any]) -> None:
    with pytest.raises(ProtocolError, match="has no V2 datatype"):
        datatype_of(dtype)


@pytest.mark.parametrize(
    ("datatype", "value", "wire"),
    [
        ("INT32", 1, b"\x01\x00\x00\x00"),
        ("UINT16", 0x0102, b"\x02\x01"),
        ("INT64", -2, b"\xfe" + b"\xff" * 7),
        ("FP32", 1.0, struct.pack("<f", 1.0)),
        ("FP64", -0.5, struct.pack("<d", -0.5)),
        ("FP16", 1.0, b"\x00\x3c"),
        ("BOOL", True, b"\x01"),
    ],
)
def test_data_is_little_endian_on_the_wire(datatype: str, value: Any, wire: bytes) -> None:
    native = np.array([value], dtype=DTYPES[datatype])
    big = native.astype(DTYPES[datatype].newbyteorder(">"))
    for array in (native, big):
        tensor = Tensor.from_numpy("x", array)
        assert tensor.datatype == datatype
        assert tensor.data == wire
        assert tensor.to_numpy().tolist() == [value]


def test_a_big_endian_array_is_stored_in_little_endian_order() -> None:
    big = np.array([[1, 256], [65536, -1]], dtype=">i4")
    tensor = Tensor.from_numpy("x", big)
    assert tensor.data == big.astype("<i4").tobytes()
    assert tensor.to_numpy().dtype.byteorder in ("<", "=")
    np.testing.assert_array_equal(tensor.to_numpy(), big)


def test_a_non_contiguous_array_is_stored_in_row_major_order() -> None:
    array = np.arange(6, dtype=np.int16).reshape(2, 3).T
    tensor = Tensor.from_numpy("x", array)
    assert tensor.shape == (3, 2)
    np.testing.assert_array_equal(tensor.to_numpy(), array)
    assert tensor.data == np.ascontiguousarray(array).astype("<i2").tobytes()


def test_from_numpy_converts_to_a_requested_datatype() -> None:
    tensor = Tensor.from_numpy("x", np.array([1, 2, 3]), datatype="FP32")
    assert tensor.datatype == "FP32"
    assert tensor.to_numpy().dtype == np.float32
    assert tensor.to_numpy().tolist() == [1.0, 2.0, 3.0]


def test_to_numpy_gives_a_read_only_view() -> None:
    array = Tensor.from_numpy("x", np.zeros(3, dtype=np.float32)).to_numpy()
    assert not array.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        array[0] = 1.0


# BYTES


@pytest.mark.parametrize(
    "elements",
    [[], [b""], [b"a"], [b"", b"hello", b"\x00\xff" * 300], [bytes(range(256))] * 3],
    ids=["none", "one-empty", "one", "mixed", "binary"],
)
def test_bytes_elements_round_trip(elements: list[bytes]) -> None:
    assert unpack_bytes_elements(pack_bytes_elements(elements)) == elements


def test_bytes_elements_are_framed_by_little_endian_4_byte_lengths() -> None:
    assert pack_bytes_elements([b"abc", b""]) == b"\x03\x00\x00\x00abc\x00\x00\x00\x00"
    assert pack_bytes_elements([b"x" * 258]) == b"\x02\x01\x00\x00" + b"x" * 258


def test_a_bytes_tensor_round_trips_through_numpy_as_an_object_array() -> None:
    array = np.array([[b"a", b""], [b"\x00", b"long" * 100]], dtype=object)
    tensor = Tensor.from_numpy("text", array)
    assert tensor.datatype == BYTES
    assert tensor.shape == (2, 2)
    back = tensor.to_numpy()
    assert back.dtype == object
    assert back.shape == (2, 2)
    assert back.tolist() == array.tolist()
    assert Tensor.from_wire(tensor.wire()) == tensor


def test_string_arrays_become_utf8_bytes_elements() -> None:
    tensor = Tensor.from_numpy("text", np.array(["h\u00e9", "", "ok"]))
    assert tensor.datatype == BYTES
    assert tensor.to_numpy().tolist() == ["h\u00e9".encode(), b"", b"ok"]
    fixed = Tensor.from_numpy("raw", np.array([b"ab", b"c"], dtype="S2"))
    assert fixed.to_numpy().tolist() == [b"ab", b"c"]


def test_an_empty_bytes_tensor_has_no_data() -> None:
    tensor = Tensor.from_numpy("text", np.empty((0, 3), dtype=object))
    assert tensor.data == b""
    assert tensor.to_numpy().shape == (0, 3)


def test_bytes_data_ending_inside_a_length_prefix_is_rejected() -> None:
    for cut in (1, 2, 3):
        with pytest.raises(ProtocolError, match="length prefix"):
            unpack_bytes_elements(b"\x00\x00\x00\x00"[:cut])
    with pytest.raises(ProtocolError, match="length prefix"):
        unpack_bytes_elements(pack_bytes_elements([b"ab"]) + b"\x01\x00")


def test_a_bytes_element_longer_than_the_data_is_rejected() -> None:
    with pytest.raises(ProtocolError, match="runs past the end"):
        unpack_bytes_elements(b"\x05\x00\x00\x00abcd")
    with pytest.raises(ProtocolError, match="runs past the end"):
        unpack_bytes_elements(b"\xff\xff\xff\xff")


def test_every_truncation_inside_an_element_is_rejected() -> None:
    data = pack_bytes_elements([b"first", b"", b"third element"])
    boundaries = {0, 9, 13, len(data)}  # where an element ends and the next prefix begins
    for cut in range(len(data) + 1):
        if cut in boundaries:
            assert len(unpack_bytes_elements(data[:cut])) == sorted(boundaries).index(cut)
        else:
            with pytest.raises(ProtocolError):
                unpack_bytes_elements(data[:cut])


# Tensor.checked


def test_checked_accepts_data_that_fits_the_shape() -> None:
    tensor = Tensor.checked("x", "FP32", (2, 3), bytes(24))
    assert tensor.to_numpy().shape == (2, 3)
    assert Tensor.checked("s", "INT8", (), b"\x07").to_numpy().item() == 7
    assert Tensor.checked("e", "FP64", (0, 5), b"").to_numpy().shape == (0, 5)
    assert Tensor.checked("b", BYTES, (2,), pack_bytes_elements([b"", b"x"])).shape == (2,)


@pytest.mark.parametrize("length", [0, 23, 25, 48])
def test_checked_rejects_fixed_size_data_that_does_not_fit_the_shape(length: int) -> None:
    with pytest.raises(ProtocolError) as info:
        Tensor.checked("input", "FP32", (2, 3), bytes(length))
    assert str(info.value) == (
        f"tensor 'input': shape [2, 3] of FP32 needs 24 bytes, the data holds {length}"
    )


@pytest.mark.parametrize("count", [0, 1, 3])
def test_checked_rejects_bytes_data_with_the_wrong_element_count(count: int) -> None:
    with pytest.raises(ProtocolError) as info:
        Tensor.checked("text", BYTES, (1, 2), pack_bytes_elements([b"x"] * count))
    assert str(info.value) == (
        f"tensor 'text': shape [1, 2] needs 2 BYTES elements, the data holds {count}"
    )


def test_checked_rejects_truncated_bytes_data() -> None:
    data = pack_bytes_elements([b"hello", b"world"])
    with pytest.raises(ProtocolError, match="runs past the end"):
        Tensor.checked("text", BYTES, (2,), data[:-1])


def test_checked_rejects_a_negative_dimension_naming_the_tensor_and_shape() -> None:
    with pytest.raises(ProtocolError, match=r"tensor 'x': shape \[-1, 4\] has a negative"):
        Tensor.checked("x", "FP32", (-1, 4), b"")


@pytest.mark.parametrize("datatype", ["fp32", "FP8", "BF16", "STRING", ""])
def test_checked_rejects_an_unknown_datatype_listing_the_known_ones(datatype: str) -> None:
    with pytest.raises(ProtocolError) as info:
        Tensor.checked("x", datatype, (1,), b"\x00")
    message = str(info.value)
    assert f"unknown datatype {datatype!r}" in message
    assert all(known in message for known in DATATYPES)


def test_every_supported_datatype_is_a_v2_datatype() -> None:
    assert set(DATATYPES) == {
        "BOOL",
        "UINT8",
        "UINT16",
        "UINT32",
        "UINT64",
        "INT8",
        "INT16",
        "INT32",
        "INT64",
        "FP16",
        "FP32",
        "FP64",
        "BYTES",
    }
    assert all(dtype == dtype.newbyteorder("<") for dtype in DTYPES.values())
