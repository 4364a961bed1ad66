"""Batches: the record kept in Redis for each batch, its input lines and its answers.

A batch is a hash under ``Keys.batch(id)`` (``BatchRecord`` is its one codec) with, under the same
hash tag, the valid input lines (a list of ``BatchLine``), the job each line became (hash: line
number -> job id), and one answer per line: ``output`` (line number -> an output line) and
``errors`` (line number -> an error line). An answer is written with HSETNX, so a line run twice
(at-least-once redelivery, a gateway that died after the job ended but before it moved on) is
answered once, and ``request_counts`` are the two hashes' lengths: counted, never incremented.

A batch moves ``in_progress -> finalizing -> completed``; ``in_progress -> cancelling ->
cancelled``; ``in_progress -> expired`` (its completion window passed); or straight to ``failed``
when no line is valid. ``validating`` lasts only while the gateway reads and checks the body: the
record is written once every line is checked and stored, so a gateway that dies while validating
leaves no batch (the client got no 202) and nothing else to clean up but keys with a TTL.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from protocol.errors import ProtocolError

BATCH_EVENT_FIELD = b"batch"
"""The events-stream field of a batch's announcements (``producer.events``)."""

BATCH_PARTS = ("lines", "jobs", "output", "errors", "lease")
"""The keys of a batch besides its record (``Keys.batch(id, part)``)."""

_BATCH_ID = re.compile(r"^batch_[0-9a-f]{12}[0-9a-f]{32}$")
BATCH_RANDOM_BYTES = 16
"""128 random bits: like a job id, a batch id is its own access token."""

DEFAULT_WINDOW_S = 24 * 3600
"""The completion window when the batch names none (OpenAI's only window, ``24h``)."""

_WINDOW = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_INFER_URL = re.compile(r"^/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?/infer$")


class BatchStatus(StrEnum):
    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def final(self) -> bool:
        return self in (
            BatchStatus.COMPLETED,
            BatchStatus.FAILED,
            BatchStatus.EXPIRED,
            BatchStatus.CANCELLED,
        )


BATCH_FINAL_STATUSES = frozenset(s.value for s in BatchStatus if s.final)
BATCH_WEBHOOK_EVENTS = frozenset(s.value for s in BatchStatus)


def new_batch_id(now_ms: int, random: bytes) -> str:
    """``batch_``, the time of issue (12 hex digits of Redis-clock ms) and 128 random bits: ids
    sort by creation, so the index lists them in order without a second key."""
    if len(random) != BATCH_RANDOM_BYTES:
        raise ValueError(f"a batch id needs {BATCH_RANDOM_BYTES} random bytes")
    return f"batch_{now_ms:012x}{random.hex()}"


def is_batch_id(text: str) -> bool:
    return bool(_BATCH_ID.match(text))


def parse_window(raw: object) -> int:
    """A completion window: seconds as a number, or ``"90s"``, ``"30m"``, ``"24h"``, ``"2d"``."""
    if isinstance(raw, bool):
        raise ProtocolError(f"'completion_window' must be a duration such as '24h', got {raw!r}")
    if isinstance(raw, int | float):
        seconds = float(raw)
    else:
        match = _WINDOW.match(raw) if isinstance(raw, str) else None
        if match is None:
            raise ProtocolError(
                f"'completion_window' must be a duration such as '24h', '30m' or 3600, got {raw!r}"
            )
        seconds = float(match[1]) * _UNIT_S[match[2]]
    if not seconds > 0:
        raise ProtocolError("'completion_window' must be positive")
    return max(1, round(seconds))


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """One batch as stored. Times are milliseconds on the Redis clock; 0 means not (yet)."""

    id: str
    status: BatchStatus
    model: str
    """The default model of bare lines ("" for none)."""
    version: str
    created_ms: int
    deadline_ms: int
    """The end of the completion window: lines not answered by then are not run."""
    total: int
    """Every input line, the malformed ones included."""
    valid: int
    """The lines stored to run (the others are error lines from the start)."""
    ingested: int = 0
    """How many of the valid lines have been queued as jobs: where ingesting resumes."""
    stamps: dict[str, int] = field(default_factory=dict)
    """When the batch entered each status (name -> ms)."""
    metadata: dict[str, str] = field(default_factory=dict)
    webhook: str = ""
    webhook_events: tuple[str, ...] = ()

    def to_fields(self) -> dict[str, str | int]:
        out: dict[str, str | int] = {
            "id": self.id,
            "status": self.status.value,
            "model": self.model,
            "version": self.version,
            "created_ms": self.created_ms,
            "deadline_ms": self.deadline_ms,
            "total": self.total,
            "valid": self.valid,
            "ingested": self.ingested,
            "metadata": json.dumps(self.metadata, separators=(",", ":")),
        }
        out.update({f"{name}_ms": ms for name, ms in self.stamps.items()})
        if self.webhook:
            out["webhook"] = self.webhook
            out["webhook_events"] = ",".join(self.webhook_events)
        return out

    @classmethod
    def from_fields(cls, raw: dict[bytes, bytes]) -> BatchRecord:
        try:
            f = {k.decode(): v.decode() for k, v in raw.items()}
            stamps = {s.value: int(f[f"{s.value}_ms"]) for s in BatchStatus if f"{s.value}_ms" in f}
            metadata = json.loads(f.get("metadata") or "{}")
            return cls(
                id=f["id"],
                status=BatchStatus(f["status"]),
                model=f.get("model", ""),
                version=f.get("version", ""),
                created_ms=int(f["created_ms"]),
                deadline_ms=int(f["deadline_ms"]),
                total=int(f["total"]),
                valid=int(f["valid"]),
                ingested=int(f.get("ingested", 0)),
                stamps=stamps,
                metadata=metadata,
                webhook=f.get("webhook", ""),
                webhook_events=tuple(e for e in f.get("webhook_events", "").split(",") if e),
            )
        except (KeyError, ValueError, UnicodeDecodeError, AttributeError) as e:
            raise ProtocolError(f"batch record is malformed: {e!r}") from e


@dataclass(frozen=True, slots=True)
class BatchLine:
    """One valid input line, as stored to run: its 1-based line number in the input."""

    line: int
    custom_id: str
    model: str
    version: str
    """"" for the model's default (or traffic split)."""
    body: bytes
    """The V2 inference request, as JSON."""

    def encode(self) -> bytes:
        head = [self.line, self.custom_id, self.model, self.version]
        return json.dumps(head, separators=(",", ":")).encode() + b"\n" + self.body

    @classmethod
    def decode(cls, raw: bytes) -> BatchLine:
        try:
            head, _, body = raw.partition(b"\n")
            line, custom_id, model, version = json.loads(head)
            return cls(int(line), str(custom_id), str(model), str(version), body)
        except (ValueError, TypeError) as e:
            raise ProtocolError(f"stored batch line is malformed: {e}") from e


class LineError(ProtocolError):
    """Why one input line cannot run; the batch answers it with an error line."""

    def __init__(self, message: str, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.custom_id = custom_id


def parse_line(raw: bytes, line: int, default_model: str, default_version: str) -> BatchLine:
    """One input line: ``{"custom_id", "method": "POST", "url": "/v2/models/{m}[/versions/{v}]
    /infer", "body": {V2 request}}`` (OpenAI's batch shape), or a bare V2 request for the
    batch's default model (its ``id``, if any, is the custom id; else the line number). The V2
    body itself is checked against the model by the caller."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise LineError(f"line {line} is not valid JSON: {e}") from None
    except RecursionError:
        raise LineError(f"line {line} is not valid JSON: it is nested too deeply") from None
    if not isinstance(doc, dict):
        raise LineError(f"line {line} is not a JSON object")
    if "body" not in doc and "url" not in doc:
        if not default_model:
            raise LineError(
                f"line {line} is a bare V2 request, but the batch names no default 'model'"
            )
        custom_id = doc.get("id", str(line))
        if not isinstance(custom_id, str):
            raise LineError(f"line {line}: 'id' must be a string")
        return BatchLine(line, custom_id, default_model, default_version, _dump(doc))
    custom_id = doc.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError(f"line {line}: 'custom_id' must be a non-empty string")
    if doc.get("method", "POST") != "POST":
        raise LineError(f"line {line}: 'method' must be POST", custom_id)
    url = doc.get("url")
    match = _INFER_URL.match(url) if isinstance(url, str) else None
    if match is None:
        raise LineError(
            f"line {line}: 'url' must be /v2/models/{{model}}[/versions/{{version}}]/infer, "
            f"got {url!r}",
            custom_id,
        )
    body = doc.get("body")
    if not isinstance(body, dict):
        raise LineError(f"line {line}: 'body' must be a V2 inference request object", custom_id)
    return BatchLine(line, custom_id, match["model"], match["version"] or "", _dump(body))


def _dump(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def output_line(line: int, custom_id: str, body: dict[str, Any]) -> bytes:
    """The answer of a line the model answered: ``response {status_code, body}``."""
    doc = {
        "custom_id": custom_id,
        "line": line,
        "response": {"status_code": 200, "body": body},
        "error": None,
    }
    return _dump(doc)


def error_line(line: int, custom_id: str | None, code: str, message: str) -> bytes:
    """The answer of a line that was malformed, failed, or was never run: ``error {code,
    message}``."""
    doc = {
        "custom_id": custom_id,
        "line": line,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return _dump(doc)


LEASE_SCRIPT = """
-- Take or renew the lease on driving a batch. KEYS[1]: the lease; ARGV[1]: the gateway;
-- ARGV[2]: its TTL (ms). Returns 1 when the caller holds it now.
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] or not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
