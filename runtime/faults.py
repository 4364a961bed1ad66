"""What a Redis error means to inferq: its kind, and a sentence about it that echoes nothing.

Every background loop and every 503 goes through here. ``RETRYABLE`` is what a loop survives
with backoff: any Redis error (refused connections, out of memory, READONLY, MOVED, TRYAGAIN, a
vanished key) and socket errors. Anything else that escapes a loop is a bug, and the loop's owner
ends the process (see ``runtime.loops``).

redis-py rewrites the message of an error raised by a pipeline to quote the command that failed,
arguments included: for an ``XADD`` of a request that is the request's bytes. ``describe`` keeps
only what Redis said, so neither a log line nor an HTTP answer ever repeats a payload.
"""

from __future__ import annotations

import ast
import re
from enum import StrEnum

from redis.exceptions import (
    AskError,
    BusyLoadingError,
    ClusterDownError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

RETRYABLE: tuple[type[BaseException], ...] = (RedisError, OSError)
"""What a background loop backs off from and retries; anything else is a bug."""

_PIPELINE_PREFIX = re.compile(r"^Command # \d+ \(.*?\) of pipeline caused error: (.*)$", re.S)


class Fault(StrEnum):
    """Kinds of Redis errors, as metric labels and in messages."""

    CONNECTION = "connection"
    """Refused, reset or timed out: Redis is down, restarting or unreachable."""
    LOADING = "loading"
    """Redis is loading its data set after a restart."""
    OOM = "oom"
    """maxmemory reached with ``noeviction``: writes are refused, reads answered."""
    READONLY = "readonly"
    """A replica (after a failover, say) refuses writes."""
    MOVED = "moved"
    """Redis Cluster: the slot lives on another node (MOVED/ASK)."""
    TRYAGAIN = "tryagain"
    """Redis Cluster: a slot is migrating or the cluster is down for a moment."""
    MISSING = "missing"
    """A stream or consumer group is gone (evicted, deleted, Redis restarted empty)."""
    DENIED = "denied"
    """ACL: the user may not run the command."""
    OTHER = "other"


TRANSIENT = frozenset(
    {
        Fault.CONNECTION,
        Fault.LOADING,
        Fault.OOM,
        Fault.READONLY,
        Fault.MOVED,
        Fault.TRYAGAIN,
        Fault.MISSING,
    }
)
"""Faults that go away on their own (or with an operator's fix): retry without limit."""


def classify(error: BaseException) -> Fault:
    if isinstance(error, BusyLoadingError):
        return Fault.LOADING
    if isinstance(error, RedisConnectionError | RedisTimeoutError | OSError):
        return Fault.CONNECTION
    if isinstance(error, OutOfMemoryError):
        return Fault.OOM
    if isinstance(error, ReadOnlyError):
        return Fault.READONLY
    if isinstance(error, AskError):  # MovedError is an AskError
        return Fault.MOVED
    if isinstance(error, TryAgainError | ClusterDownError):
        return Fault.TRYAGAIN
    if isinstance(error, NoPermissionError):
        return Fault.DENIED
    if isinstance(error, ResponseError):
        said = redis_said(error)
        if said.startswith(("NOGROUP", "UNBLOCKED")) or "no such key" in said.lower():
            return Fault.MISSING
        if said.startswith("OOM"):
            return Fault.OOM
        if said.startswith("READONLY"):
            return Fault.READONLY
        if said.startswith(("MOVED", "ASK")):
            return Fault.MOVED
        if said.startswith(("TRYAGAIN", "CLUSTERDOWN")):
            return Fault.TRYAGAIN
    return Fault.OTHER


_NOT_SENT = re.compile(
    r"no connection available|connecting|cannot connect|connection refused|connection is closed",
    re.I,
)
"""How redis-py and ``runtime.resp`` say a command never left: no pooled connection, a connect
that failed or timed out, a connection known closed before the write."""


def outcome_unknown(error: BaseException) -> bool:
    """Whether a write that failed with ``error`` may have been carried out all the same: the
    connection broke or timed out after the command was sent (a stall, a restart, a reply
    slower than the socket timeout). False when Redis answered with an error, and when the
    command never left (see ``_NOT_SENT``): those writes did not happen."""
    if classify(error) is not Fault.CONNECTION:
        return False
    return not _NOT_SENT.search(str(error))


def redis_said(error: BaseException) -> str:
    """The error's own message, without redis-py's quote of the pipeline command."""
    message = str(error.args[0]) if error.args else ""
    match = _PIPELINE_PREFIX.match(message)
    if match is None:
        return message
    original = match.group(1).strip()
    try:
        parsed = ast.literal_eval(original)  # redis-py appends the original args tuple
    except (ValueError, SyntaxError):
        return original
    if isinstance(parsed, tuple) and parsed:
        return str(parsed[0])
    return str(parsed)


_PREFIXES = {
    Fault.OOM: "OOM ",
    Fault.READONLY: "READONLY ",
}


def describe(error: BaseException) -> str:
    """One sentence for a person: what kind of trouble, and what Redis said (never which
    command or its arguments)."""
    fault = classify(error)
    said = redis_said(error).strip()
    # redis-py drops the error code from the messages of the classes it maps it to.
    prefix = _PREFIXES.get(fault, "")
    if prefix and not said.startswith(prefix.strip()):
        said = prefix + said
    if fault is Fault.OOM:
        return (
            f"Redis is out of memory and refuses writes ({said}); raise maxmemory or free "
            "memory in Redis"
        )
    if fault is Fault.READONLY:
        return f"Redis refuses writes: it is a read-only replica ({said})"
    if fault is Fault.CONNECTION:
        return f"Redis is unreachable ({said or type(error).__name__})"
    if fault is Fault.LOADING:
        return f"Redis is loading its data after a restart ({said})"
    if fault is Fault.MISSING:
        return f"a stream or consumer group is gone from Redis ({said})"
    return f"Redis refused the command ({said or type(error).__name__})"
