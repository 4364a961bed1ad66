"""Content hashes for the shared result cache.

Two requests share a cache entry when they ask the same model version for the same outputs with
byte-identical inputs. The digest covers every input's name, datatype, shape and bytes and the
sorted requested outputs, so no two different requests can collide short of a BLAKE2b collision.
"""

from __future__ import annotations

import hashlib
import struct

from protocol.tensor import Tensor


def digest(inputs: list[Tensor], outputs: list[str] | None) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in sorted(inputs, key=lambda t: t.name):
        name = t.name.encode()
        h.update(struct.pack("<I", len(name)) + name)
        h.update(t.datatype.encode() + b"\0")
        h.update(struct.pack(f"<I{len(t.shape)}q", len(t.shape), *t.shape))
        h.update(struct.pack("<Q", len(t.data)))
        h.update(t.data)
    if outputs is None:
        h.update(b"outputs*")
    else:  # length-prefixed, so [], [""], ["*"] and ["a\0b"] vs ["a", "b"] all differ
        h.update(b"outputs" + struct.pack("<I", len(outputs)))
        for out in sorted(outputs):
            name = out.encode()
            h.update(struct.pack("<I", len(name)) + name)
    return h.hexdigest()
