"""W3C trace context: the caller's ``traceparent``, or a new one, so logs on every hop join up."""

from __future__ import annotations

import random
import re

_trace_ids = random.Random()
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


def traceparent(given: str | None) -> str:
    """``given`` when it is a valid traceparent (an HTTP header or gRPC metadata value), else a
    new sampled one."""
    if given and _TRACEPARENT.match(given):
        return given
    # Trace ids must be unique, not secret: a seeded PRNG avoids two urandom calls per request.
    return f"00-{_trace_ids.getrandbits(128):032x}-{_trace_ids.getrandbits(64):016x}-01"
