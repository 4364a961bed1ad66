"""Demand hints: "a request for this model was just queued and no worker holds it".

A gateway that queues a request for a model only on-demand workers can serve (none holds it)
adds a hint to ``Keys.demand``; on-demand workers block on that stream between their looks at
the backlog (``consumer.ondemand``), so a model nobody holds is loaded as soon as its first
request is queued rather than at the next look. A hint is only a wake-up: losing one delays a
load until the next look (``demand_poll_s``), it never loses a request, which waits in its own
stream. The stream is capped (``MAXLEN ~``): nobody acknowledges hints.
"""

from __future__ import annotations

from protocol.errors import ProtocolError
from protocol.keys import is_valid_name, text

FIELD = b"model"
MAX_HINTS = 1000
"""Hints kept (approximately): enough for any reader that is a few polls behind."""


def encode_hint(model: str) -> dict[bytes, bytes]:
    return {FIELD: model.encode()}


def decode_hint(fields: dict[bytes, bytes]) -> str:
    raw = fields.get(FIELD)
    model = "" if raw is None else text(raw)
    if not is_valid_name(model):
        raise ProtocolError(f"demand hint names no valid model: {raw!r}")
    return model
