"""Redis errors, classified and described for a person without echoing the command."""

from __future__ import annotations

import pytest
from redis.exceptions import (
    BusyLoadingError,
    MovedError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from runtime.faults import TRANSIENT, Fault, classify, describe, outcome_unknown, redis_said


def annotated(error: Exception, command: str) -> Exception:
    """What redis-py's pipeline does to an error: quote the command, arguments included."""
    error.args = (f"Command # 3 ({command}) of pipeline caused error: {error.args}",)
    return error


@pytest.mark.parametrize(
    ("error", "fault"),
    [
        (RedisConnectionError("Connection refused"), Fault.CONNECTION),
        (OSError("reset"), Fault.CONNECTION),
        (BusyLoadingError("Redis is loading the dataset in memory"), Fault.LOADING),
        (OutOfMemoryError("command not allowed when used memory > 'maxmemory'."), Fault.OOM),
        (ReadOnlyError("You can't write against a read only replica."), Fault.READONLY),
        (MovedError("3999 127.0.0.1:6381"), Fault.MOVED),
        (TryAgainError(), Fault.TRYAGAIN),
        (ResponseError("UNBLOCKED the stream key no longer exists"), Fault.MISSING),
        (ResponseError("NOGROUP No such key 's' or consumer group 'workers'"), Fault.MISSING),
        (ResponseError("OOM command not allowed ... script: abc"), Fault.OOM),
        (ResponseError("WRONGTYPE Operation against a key holding the wrong kind"), Fault.OTHER),
    ],
)
def test_errors_are_classified_by_what_redis_means(error, fault):
    assert classify(error) is fault


def test_transient_faults_are_the_ones_that_pass_by_themselves():
    assert Fault.OOM in TRANSIENT and Fault.CONNECTION in TRANSIENT
    assert Fault.OTHER not in TRANSIENT and Fault.DENIED not in TRANSIENT


def test_a_pipeline_error_is_described_without_the_command_or_its_arguments():
    error = annotated(
        OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
        "XADD ns:stream:m:normal * m \\x93\\xa7secret-request-bytes",
    )
    text = describe(error)
    assert redis_said(error) == "command not allowed when used memory > 'maxmemory'."
    assert "out of memory" in text and "OOM command not allowed" in text
    assert "secret" not in text and "XADD" not in text and "Command #" not in text


def test_descriptions_say_what_kind_of_trouble():
    assert describe(RedisConnectionError("Connection refused")).startswith("Redis is unreachable")
    assert "read-only" in describe(ReadOnlyError("You can't write against a read only replica."))
    assert "gone" in describe(ResponseError("UNBLOCKED the stream key no longer exists"))
    assert describe(ResponseError("ERR x")) == "Redis refused the command (ERR x)"


@pytest.mark.parametrize(
    ("message", "unknown"),
    [
        ("Timeout reading from 127.0.0.1:6379", True),
        ("Redis did not answer within 5 s", True),
        ("the connection to Redis was lost (closed)", True),
        ("Connection closed by server.", True),
        ("No connection available.", False),
        ("Error 111 connecting to 127.0.0.1:6379. Connection refused.", False),
        ("cannot connect to Redis at 127.0.0.1:6379: [Errno 111] Connection refused", False),
        ("timed out connecting to Redis at 127.0.0.1:6379", False),
        ("the Redis connection is closed", False),
    ],
)
def test_a_write_may_have_happened_only_when_its_connection_failed_after_sending(message, unknown):
    """A broken or timed-out connection after the write leaves its outcome unknown; a write
    that never left, or that Redis refused, did not happen (issue #21, defect 5)."""
    assert outcome_unknown(RedisConnectionError(message)) is unknown
    assert outcome_unknown(RedisTimeoutError(message)) is unknown
    assert not outcome_unknown(OutOfMemoryError("OOM command not allowed"))
