"""``inferq dlq``: list, show, replay and purge dead letters against a real Redis."""

from __future__ import annotations

import json

import numpy as np
import redis

from inferq.cli import main
from protocol.keys import Keys, Lane
from protocol.messages import FIELD, InferRequest
from protocol.tensor import Tensor


def _dead_letter(r: redis.Redis, keys: Keys, request_id: str, deadline_ms: int) -> bytes:
    x = Tensor.from_numpy("x", np.ones((1, 4), dtype=np.float32))
    request = InferRequest(
        id=request_id,
        model="sim",
        version="1",
        inputs=[x],
        outputs=None,
        deadline_ms=deadline_ms,
        enqueued_ms=0,
        result_key="r",
        result_ttl_ms=1000,
    )
    return r.xadd(
        keys.dlq("sim"),
        {
            b"stream": keys.stream("sim", Lane.NORMAL),
            b"id": b"1-0",
            b"reason": b"crashed 5 workers",
            FIELD: request.encode(),
        },
    )


def _cli(redis_url: str, namespace: str, *args: str) -> int:
    return main(["dlq", "--redis", redis_url, "--namespace", namespace, *args], environ={})


def test_list_show_retry_and_purge(redis_url, namespace, capsys):
    keys = Keys(namespace)
    with redis.Redis.from_url(redis_url) as r:
        first = _dead_letter(r, keys, "req-1", deadline_ms=1).decode()
        second = _dead_letter(r, keys, "req-2", deadline_ms=1).decode()
        r.xadd(keys.dlq("sim"), {b"stream": b"x", b"reason": b"garbage", FIELD: b"\x93"})

        assert _cli(redis_url, namespace, "list", "--json") == 0
        listing = json.loads(capsys.readouterr().out)
        assert listing["sim"]["total"] == 3
        assert [
            e["request"]["id"] if e["request"] else None for e in listing["sim"]["entries"]
        ] == ["req-1", "req-2", None]

        assert _cli(redis_url, namespace, "show", "--model", "sim", first) == 0
        shown = json.loads(capsys.readouterr().out)
        assert shown["reason"] == "crashed 5 workers"
        assert shown["request"]["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [1, 4]}]

        assert (
            _cli(
                redis_url, namespace, "retry", "--model", "sim", "--extend-deadline-s", "60", first
            )
            == 0
        )
        replayed = r.xrange(keys.stream("sim", Lane.NORMAL))
        assert len(replayed) == 1
        request = InferRequest.decode(replayed[0][1][FIELD])
        assert request.id == "req-1" and request.deadline_ms > 1
        assert r.xlen(keys.dlq("sim")) == 2

        assert _cli(redis_url, namespace, "purge", "--model", "sim", second) == 0
        assert _cli(redis_url, namespace, "purge", "--model", "sim", "--all") == 0
        assert r.xlen(keys.dlq("sim")) == 0
    assert "purged 1" in capsys.readouterr().out


def test_show_of_an_unknown_id_is_an_error(redis_url, namespace, capsys):
    assert _cli(redis_url, namespace, "show", "--model", "sim", "1-1") == 1
    assert "no dead letter" in capsys.readouterr().err


def test_an_unreachable_redis_is_reported_not_raised(capsys):
    assert main(["dlq", "--redis", "redis://127.0.0.1:1/0", "list"], environ={}) == 4
    assert "cannot reach Redis" in capsys.readouterr().err


def test_the_connection_flags_work_after_the_action_too(redis_url, namespace, capsys):
    # As a newcomer types it: `inferq dlq list --redis URL`. Given at both places, the
    # action's wins; given before it only, it stands.
    keys = Keys(namespace)
    with redis.Redis.from_url(redis_url) as r:
        _dead_letter(r, keys, "req-1", deadline_ms=1)
    for argv in (
        ["dlq", "list", "--model", "sim", "--redis", redis_url, "--namespace", namespace],
        ["dlq", "--redis", "redis://127.0.0.1:1/0", "list", "--redis", redis_url,
         "--namespace", namespace, "--json"],
        ["dlq", "--redis", redis_url, "--namespace", namespace, "list", "--json"],
    ):  # fmt: skip
        assert main(argv, environ={}) == 0, argv
        assert "req-1" in capsys.readouterr().out
