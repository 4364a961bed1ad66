"""The envelope of every msgpack message: an array whose first item is the protocol version.

One packer and one checked unpacker for all of them, so every decoder rejects garbage, another
protocol version and the wrong number of fields in the same words, with ``ProtocolError``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import msgpack

from protocol import PROTOCOL_VERSION
from protocol.errors import ProtocolError, VersionMismatch


def pack(fields: list[Any]) -> bytes:
    return cast(bytes, msgpack.packb([PROTOCOL_VERSION, *fields], use_bin_type=True))


def unpack(raw: bytes, what: str, n_fields: int, *, defaults: tuple[Any, ...] = ()) -> list[Any]:
    """The fields after the version, checked: valid msgpack, this protocol version, and exactly
    ``n_fields`` of them. Map keys must be strings (no hash-flooding with odd key types).

    ``defaults`` are the values of the last fields, which a writer of an older release, which
    had not added them yet, leaves out: a message up to ``len(defaults)`` fields short is
    completed with them (the caller still checks every field, those included)."""
    try:
        items = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises a zoo of types on garbage
        raise ProtocolError(f"{what} is not valid msgpack: {e}") from e
    if not isinstance(items, list) or not items:
        raise ProtocolError(f"{what} is not a msgpack array")
    if type(items[0]) is not int or items[0] != PROTOCOL_VERSION:  # not True, not 1.0
        raise VersionMismatch(items[0], PROTOCOL_VERSION)
    missing = n_fields + 1 - len(items)
    if not 0 <= missing <= len(defaults):
        expected = f"{n_fields - len(defaults)} to {n_fields}" if defaults else str(n_fields)
        raise ProtocolError(f"{what} has {len(items) - 1} fields, expected {expected}")
    return items[1:] + list(defaults[len(defaults) - missing :])


T = TypeVar("T")


def decode_hash(
    raw: dict[bytes, bytes],
    decode: Callable[[bytes], T],
    on_error: Callable[[str, ProtocolError], None] | None = None,
) -> dict[str, T]:
    """A Redis hash of encoded messages (HGETALL), decoded per field; a field that does not
    decode is left out (and passed to ``on_error``): one bad entry must not hide the rest."""
    out: dict[str, T] = {}
    for name, value in raw.items():
        key = name.decode(errors="replace")
        try:
            out[key] = decode(value)
        except ProtocolError as e:
            if on_error is not None:
                on_error(key, e)
    return out
