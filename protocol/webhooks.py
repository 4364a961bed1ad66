"""The wire contract of webhook deliveries: their ids, who delivers each, and their dead letters.

Gateways deliver webhooks from the consumer group ``WEBHOOK_GROUP`` of the events stream
(``producer.webhooks``). One delivery is one status of one job or batch; the events entry whose
handling first wants it claims it in ``Keys.webhook_sent`` (``CLAIM_SCRIPT``), so a status
announced twice, or read by two gateways, is delivered once, and the gateway that takes over a
dead one's pending entry finds the claims of that entry its own. A delivery that never got a 2xx
becomes a ``WebhookDeadLetter`` on ``Keys.webhook_dlq``, which ``inferq dlq`` shows and replays.
"""

from __future__ import annotations

from dataclasses import dataclass

CLAIM_SCRIPT = """#!lua
-- Claim webhook deliveries of one job or batch for one events entry. KEYS[1]: its claims hash
-- (status -> entry id). ARGV[1]: the entry id, ARGV[2]: TTL (ms) of the hash, ARGV[3..]: the
-- statuses wanted. Returns those this entry holds: claimed now, or earlier by this same entry
-- (a gateway took it over from one that died mid-delivery).
local mine = {}
for i = 3, #ARGV do
  local owner = redis.call('HGET', KEYS[1], ARGV[i])
  if not owner then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[1])
    owner = ARGV[1]
  end
  if owner == ARGV[1] then
    mine[#mine + 1] = ARGV[i]
  end
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return mine
"""


def webhook_id(kind: str, object_id: str, status: str) -> str:
    """The ``webhook-id`` of a delivery: the same for every attempt and every redelivery of it,
    so a receiver deduplicates on it (Standard Webhooks)."""
    return f"{kind}:{object_id}:{status}"


@dataclass(frozen=True, slots=True)
class WebhookDeadLetter:
    """A delivery given up on: what it was, where it went, and why it failed."""

    kind: str
    """``job`` or ``batch``: the events field that names the object."""
    object_id: str
    status: str
    url: str
    attempts: int
    error: str
    """The last attempt's failure, for a person."""
    entry_id: str = ""
    """The events entry that claimed it."""

    @property
    def webhook_id(self) -> str:
        return webhook_id(self.kind, self.object_id, self.status)

    def to_fields(self) -> dict[bytes, str | int]:
        return {
            b"kind": self.kind,
            b"object": self.object_id,
            b"status": self.status,
            b"url": self.url,
            b"attempts": self.attempts,
            b"error": self.error,
            b"entry": self.entry_id,
        }

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes]) -> WebhookDeadLetter:
        def get(name: bytes) -> str:
            return fields.get(name, b"").decode(errors="replace")

        attempts = get(b"attempts")
        return cls(
            kind=get(b"kind"),
            object_id=get(b"object"),
            status=get(b"status"),
            url=get(b"url"),
            attempts=int(attempts) if attempts.isdigit() else 0,
            error=get(b"error"),
            entry_id=get(b"entry"),
        )
