"""Tensors on the wire: a name, a V2 datatype, a shape and raw little-endian bytes.

Fixed-size datatypes are stored as their numpy buffer in little-endian order; ``BYTES`` is stored
the way the V2 binary extension sends it: each element as a 4-byte little-endian length followed
by that many bytes. The same bytes therefore pass from an HTTP body to Redis to the model without
being re-encoded.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from protocol.errors import ProtocolError

DTYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype("?"),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}
"""V2 datatype name -> little-endian numpy dtype, for every fixed-size datatype."""

BYTES = "BYTES"
DATATYPES: frozenset[str] = frozenset([*DTYPES, BYTES])

_LEN = struct.Struct("<I")
_INT64_MAX = 2**63 - 1


def datatype_of(dtype: np.dtype[Any]) -> str:
    """The V2 datatype name of a numpy dtype (object and string arrays are BYTES)."""
    if dtype.kind in ("O", "S", "U"):
        return BYTES
    for name, candidate in DTYPES.items():
        if candidate == dtype.newbyteorder("<"):
            return name
    raise ProtocolError(f"numpy dtype {dtype} has no V2 datatype")


def element_count(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def pack_bytes_elements(elements: list[bytes]) -> bytes:
    """Serialise BYTES elements as 4-byte little-endian length prefixes plus contents."""
    return b"".join(_LEN.pack(len(e)) + e for e in elements)


def unpack_bytes_elements(data: bytes) -> list[bytes]:
    """Split length-prefixed BYTES data back into elements; malformed data is a ProtocolError."""
    out: list[bytes] = []
    view = memoryview(data)
    pos = 0
    while pos < len(view):
        if pos + 4 > len(view):
            raise ProtocolError("BYTES data ends inside an element's 4-byte length prefix")
        (n,) = _LEN.unpack_from(view, pos)
        pos += 4
        if pos + n > len(view):
            raise ProtocolError("BYTES element length runs past the end of the data")
        out.append(bytes(view[pos : pos + n]))
        pos += n
    return out


@dataclass(frozen=True, slots=True)
class Tensor:
    """One named tensor in wire form. Construct through ``from_numpy`` or ``checked``."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def checked(cls, name: str, datatype: str, shape: tuple[int, ...], data: bytes) -> Tensor:
        """Build a tensor, checking that the datatype is known and the data fits the shape."""
        if datatype not in DATATYPES:
            raise ProtocolError(
                f"tensor '{name}': unknown datatype {datatype!r} "
                f"(expected one of {', '.join(sorted(DATATYPES))})"
            )
        if any(d > _INT64_MAX or d < -_INT64_MAX for d in shape):
            raise ProtocolError(f"tensor '{name}': a dimension does not fit in int64")
        if any(d < 0 for d in shape):
            raise ProtocolError(f"tensor '{name}': shape {list(shape)} has a negative dimension")
        count = element_count(shape)
        if datatype == BYTES:
            got = len(unpack_bytes_elements(data))
            if got != count:
                raise ProtocolError(
                    f"tensor '{name}': shape {list(shape)} needs {count} BYTES elements, "
                    f"the data holds {got}"
                )
        else:
            need = count * DTYPES[datatype].itemsize
            if len(data) != need:
                raise ProtocolError(
                    f"tensor '{name}': shape {list(shape)} of {datatype} needs {need} bytes, "
                    f"the data holds {len(data)}"
                )
        return cls(name, datatype, shape, data)

    @classmethod
    def from_numpy(cls, name: str, array: npt.NDArray[Any], datatype: str | None = None) -> Tensor:
        datatype = datatype or datatype_of(array.dtype)
        shape = tuple(int(d) for d in array.shape)
        if datatype == BYTES:
            elements = [
                e if isinstance(e, bytes) else str(e).encode() for e in array.reshape(-1).tolist()
            ]
            return cls(name, BYTES, shape, pack_bytes_elements(elements))
        dtype = DTYPES[datatype]
        return cls(name, datatype, shape, np.ascontiguousarray(array, dtype=dtype).tobytes())

    def to_numpy(self) -> npt.NDArray[Any]:
        """A read-only array view of the data (BYTES gives an object array of ``bytes``)."""
        if self.datatype == BYTES:
            elements = unpack_bytes_elements(self.data)
            arr = np.empty(len(elements), dtype=object)
            arr[:] = elements
            return arr.reshape(self.shape)
        return np.frombuffer(self.data, dtype=DTYPES[self.datatype]).reshape(self.shape)

    def wire(self) -> list[Any]:
        """The msgpack-ready form: ``[name, datatype, shape, data]``."""
        return [self.name, self.datatype, list(self.shape), self.data]

    @classmethod
    def from_wire(cls, item: Any) -> Tensor:
        if not (isinstance(item, list) and len(item) == 4):
            raise ProtocolError("tensor is not a [name, datatype, shape, data] list")
        name, datatype, shape, data = item
        if not isinstance(name, str) or not isinstance(datatype, str):
            raise ProtocolError("tensor name and datatype must be strings")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in shape
        ):
            raise ProtocolError(f"tensor '{name}': shape must be a list of integers")
        if not isinstance(data, bytes):
            raise ProtocolError(f"tensor '{name}': data must be bytes")
        return cls.checked(name, datatype, tuple(shape), data)
