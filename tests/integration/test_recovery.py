"""Nothing accepted is lost: entries of a dead worker are taken over, a slow worker keeps its
entries, and an entry that keeps crashing workers is dead-lettered with its caller answered."""

from __future__ import annotations

import pytest
import redis

from protocol.keys import GROUP, Keys, Lane
from protocol.messages import FIELD, InferResult, Status
from protocol.registry import ModelMetadata, WorkerInfo
from tests.support import sim_request, wait_until


def _queue_and_strand(r, keys: Keys, ids: list[str], reply_to: str | None = None) -> str:
    """Queue requests and hand them to a consumer that then 'dies' without acknowledging."""
    stream = keys.stream("sim", Lane.NORMAL)
    now_ms = int(r.time()[0]) * 1000
    r.xgroup_create(stream, GROUP, id="0", mkstream=True)
    for request_id in ids:
        r.xadd(stream, {FIELD: sim_request(keys, request_id, now_ms, reply_to=reply_to).encode()})
    r.xreadgroup(GROUP, "dead-worker", {stream: ">"}, count=100)
    return stream


def test_a_live_worker_takes_over_what_a_dead_worker_held(stack, redis_url, namespace):
    keys = Keys(namespace)
    with redis.Redis.from_url(redis_url) as r:
        stream = _queue_and_strand(r, keys, ["a", "b", "c"])
        s = stack(workers=0)
        worker = s.add_worker(("sim",), claim_idle_ms=200)
        wait_until(lambda: r.xpending(stream, GROUP)["pending"] == 0, what="the entries acked")
        for request_id in ("a", "b", "c"):
            result = InferResult.decode(r.get(keys.result(request_id)))
            assert result.status is Status.OK and result.worker == worker.worker.id
    assert worker.worker.reclaimer.reclaimed == 3


@pytest.mark.serial  # renewal must win each 100 ms window
def test_a_worker_renews_entries_it_is_still_running(stack, redis_url, namespace, capsys):
    """A batch that runs longer than claim_idle_ms is not taken over by another worker."""
    keys = Keys(namespace)
    s = stack(workers=0)
    busy = s.add_worker(("slow",), claim_idle_ms=100)  # the batch runs three times as long
    other = s.add_worker(("slow",), claim_idle_ms=100)
    s.wait_ready("slow")
    from concurrent.futures import ThreadPoolExecutor

    from tests.support import sim_body

    with ThreadPoolExecutor(1) as pool:
        response = pool.submit(s.infer, "slow", sim_body(1)).result()  # its batch takes 300 ms
    with redis.Redis.from_url(redis_url) as r:
        stream = keys.stream("slow", Lane.NORMAL)
        wait_until(lambda: r.xpending(stream, GROUP)["pending"] == 0, what="the entry acked")
    correct = int(response.status_code == 200 and response.json()["outputs"][0]["data"] == [4.0])
    reclaimed = busy.worker.reclaimer.reclaimed + other.worker.reclaimer.reclaimed
    calls = busy.backend("slow").calls + other.backend("slow").calls
    renewed = busy.worker.reclaimer.renewed + other.worker.reclaimer.renewed
    with capsys.disabled():
        print(
            f"\nchaos[4 batch 3x claim_idle]: sent=1 correct={correct} executions={calls} "
            f"reclaimed={reclaimed} renewed={renewed}"
        )
    assert correct == 1 and calls == 1 and reclaimed == 0
    assert renewed >= 1


def test_an_entry_delivered_too_often_is_dead_lettered_and_its_caller_answered(
    stack, redis_url, namespace
):
    keys = Keys(namespace)
    reply_to = Keys(namespace).replies("test")
    with redis.Redis.from_url(redis_url) as r:
        r.xadd(reply_to, {b"keepalive": b"1"})
        stream = _queue_and_strand(r, keys, ["poison"], reply_to=reply_to)
        entry_id = r.xpending_range(stream, GROUP, "-", "+", 1)[0]["message_id"]
        # As if it had crashed five workers already.
        r.xclaim(stream, GROUP, "dead-worker", 0, [entry_id], retrycount=5, justid=True)
        s = stack(workers=0)
        worker = s.add_worker(("sim",), claim_idle_ms=100, max_deliveries=5)
        wait_until(lambda: r.xlen(keys.dlq("sim")) == 1, what="a dead letter")
        wait_until(lambda: r.xpending(stream, GROUP)["pending"] == 0, what="the entry acked")
        reply = InferResult.decode(r.xrange(reply_to)[-1][1][FIELD])
        assert reply.id == "poison" and reply.status is Status.FAILED
        assert "delivered 6 times" not in reply.error and "dead-letter" in reply.error
        assert b"dead-letter" in r.xrange(keys.dlq("sim"))[0][1][b"reason"]
    assert worker.backend("sim").calls == 0


def test_streams_are_trimmed_only_below_what_was_delivered_and_acknowledged(
    stack, redis_url, namespace
):
    from tests.support import sim_body

    keys = Keys(namespace)
    s = stack(workers=0)
    s.add_worker(("sim",), claim_idle_ms=100)  # housekeeping every 20 passes of 25 ms
    s.wait_ready("sim")
    for i in range(30):
        assert s.infer("sim", sim_body(i)).status_code == 200
    stream = keys.stream("sim", Lane.NORMAL)
    with redis.Redis.from_url(redis_url) as r:
        wait_until(lambda: r.xlen(stream) == 0, what="the acknowledged entries trimmed")
        group = r.xinfo_groups(stream)[0]
        assert group["entries-read"] == 30 and group["lag"] == 0  # lag still known


def test_consumers_of_gone_workers_are_removed_once_they_hold_nothing(stack, redis_url, namespace):
    keys = Keys(namespace)
    stream = keys.stream("sim", Lane.NORMAL)
    with redis.Redis.from_url(redis_url) as r:
        r.xgroup_create(stream, GROUP, id="$", mkstream=True)
        r.xgroup_createconsumer(stream, GROUP, "long-gone")
        s = stack(workers=0)
        worker = s.add_worker(("sim",), claim_idle_ms=100)

        def consumers() -> set[str]:
            return {c["name"].decode() for c in r.xinfo_consumers(stream, GROUP)}

        wait_until(lambda: "long-gone" not in consumers(), what="the gone consumer removed")
        assert worker.worker.id in consumers()


def test_pending_entries_trimmed_away_are_cleared_and_their_callers_fail_by_deadline(
    stack, redis_url, namespace, capsys
):
    """Trim pressure below the backlog (an operator's XTRIM, say): entries a dead worker held
    are gone. The reclaim pass clears them from the pending list; their waiting callers are
    answered 504 at their deadline, not left hanging."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.support import sim_body

    keys = Keys(namespace)
    stream = keys.stream("sim", Lane.NORMAL)
    s = stack(workers=0)
    first = s.add_worker(("sim",), claim_idle_ms=200)
    s.wait_ready("sim")
    first.stop()
    with redis.Redis.from_url(redis_url) as r:
        # A live-looking worker that reads and then dies (so the gateway accepts requests).
        meta = ModelMetadata.decode(r.hget(keys.models, "sim"))
        ghost = WorkerInfo(id="ghost", host="h", pid=1, started_ms=0, models=(meta,))
        r.set(keys.worker("ghost"), ghost.encode())
        r.zadd(keys.workers, {"ghost": 10**15})
        s.wait_ready("sim")
        with ThreadPoolExecutor(3) as pool:
            waiting = [
                pool.submit(s.infer, "sim", sim_body(i, timeout=1_500_000)) for i in range(3)
            ]
            wait_until(lambda: r.xlen(stream) >= 3, what="three queued requests")
            r.xreadgroup(GROUP, "ghost", {stream: ">"}, count=10)  # a worker that then died
            r.xtrim(stream, maxlen=0)  # trim pressure: the pending entries are gone
            s.add_worker(("sim",), claim_idle_ms=200)
            statuses = [f.result().status_code for f in waiting]
        wait_until(lambda: r.xpending(stream, GROUP)["pending"] == 0, what="a clean pending list")
        pending_after = r.xpending(stream, GROUP)["pending"]
    with capsys.disabled():
        print(
            f"\nchaos[9 trim pressure]: sent=3 refused_504={statuses.count(504)} "
            f"other={len(statuses) - statuses.count(504)} pending_after={pending_after}"
        )
    assert statuses == [504, 504, 504]
