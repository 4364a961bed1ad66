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

from runtime.faults import TRANSIENT, Fault, classify, describe, redis_said


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
