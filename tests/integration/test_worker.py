"""Worker behaviour that needs a real Redis: its own pending entries, groups, advertisement."""

from __future__ import annotations

import json

import pytest
import redis

from protocol.keys import GROUP, Keys, Lane
from protocol.messages import FIELD, InferResult, Status
from tests.support import sim_body, sim_request, wait_until


def test_a_worker_first_serves_entries_it_was_handed_before_a_restart(stack, redis_url, namespace):
    """Entries delivered to a consumer whose process died (or whose read reply was lost) are
    in its pending list; the worker with that name runs them when it starts."""
    keys = Keys(namespace)
    stream = keys.stream("sim", Lane.NORMAL)
    with redis.Redis.from_url(redis_url) as r:
        now_ms = int(r.time()[0]) * 1000
        r.xgroup_create(stream, GROUP, id="0", mkstream=True)
        for i in range(3):
            r.xadd(stream, {FIELD: sim_request(keys, f"orphan-{i}", now_ms, value=2.0).encode()})
        r.xreadgroup(GROUP, "w-restarted", {stream: ">"}, count=10)  # delivered, never acked
        assert r.xpending(stream, GROUP)["pending"] == 3
        s = stack(workers=0)
        s.add_worker(("sim",), worker_id="w-restarted")
        wait_until(lambda: r.xpending(stream, GROUP)["pending"] == 0, what="the backlog acked")
        for i in range(3):
            result = InferResult.decode(r.get(keys.result(f"orphan-{i}")))
            assert result.status is Status.OK
            assert result.outputs[0].to_numpy().tolist() == [[8.0]]


def test_undecodable_entries_go_to_the_dead_letter_stream(stack, redis_url, namespace):
    keys = Keys(namespace)
    s = stack(models=("sim",))
    with redis.Redis.from_url(redis_url) as r:
        r.xadd(keys.stream("sim", Lane.NORMAL), {FIELD: b"\x93garbage"})
        wait_until(lambda: r.xlen(keys.dlq("sim")) == 1, what="a dead letter")
        entry = r.xrange(keys.dlq("sim"))[0][1]
        assert b"msgpack" in entry[b"reason"] or b"protocol" in entry[b"reason"]
        stream = keys.stream("sim", Lane.NORMAL)
        wait_until(lambda: r.xpending(stream, GROUP)["pending"] == 0, what="the entry acked")
    assert s.workers[0].stats.dead_lettered == 1


def test_workers_advertise_themselves_and_withdraw_on_exit(stack, redis_url, namespace):
    keys = Keys(namespace)
    s = stack(workers=2, models=("sim",))
    with redis.Redis.from_url(redis_url) as r:
        assert r.zcard(keys.workers) == 2
        assert json.dumps(sorted(r.hkeys(keys.models)), default=bytes.decode) == '["sim"]'
        s.workers[0].stop()
        assert r.zcard(keys.workers) == 1
        assert not r.exists(keys.worker(s.workers[0].worker.id))


@pytest.mark.serial  # watches a state that lasts one 300 ms batch
def test_stopping_a_worker_finishes_and_answers_what_it_holds(stack):
    from concurrent.futures import ThreadPoolExecutor

    from tests.support import sim_body

    s = stack(models=("slow",))
    worker = s.workers[0]
    with ThreadPoolExecutor(4) as pool:
        pending = [pool.submit(s.infer, "slow", sim_body(i)) for i in range(3)]
        # One batch runs, the other requests wait in the worker's queue: all three are held.
        wait_until(lambda: worker.worker.holding == 3, what="the worker to hold all three")
        worker.stop()  # returns once everything it held is answered and acknowledged
        assert [f.result().status_code for f in pending] == [200, 200, 200]


def test_a_stopping_worker_runs_what_redis_handed_its_last_blocking_read(
    stack, redis_url, namespace
):
    """Redis serves a blocked XREADGROUP the moment an entry arrives, whatever the worker is
    doing: the entry is then this consumer's. A worker told to stop just then must run it, not
    drop the read (the entry would wait for another worker's --claim-idle-ms, its caller for
    its deadline). Here the worker's event loop is frozen while the entry is handed to its
    blocked read and the stop is requested, so the stop is seen before the read's reply."""
    keys = Keys(namespace)
    stream = keys.stream("sim", Lane.NORMAL)
    s = stack(workers=0)
    worker = s.add_worker(("sim",), worker_id="w-stopping", block_ms=5_000)
    loop = worker._loop
    assert loop is not None
    with redis.Redis.from_url(redis_url) as r:

        def blocked() -> bool:
            return any(
                c["cmd"] == "xreadgroup" and "b" in c["flags"]
                for c in r.client_list()
                if c["name"].startswith("inferq-worker")
            )

        wait_until(blocked, what="the worker blocked in XREADGROUP")
        with worker.paused():
            now_ms = int(r.time()[0]) * 1000
            r.xadd(stream, {FIELD: sim_request(keys, "last", now_ms, value=1.0).encode()})
            assert r.xpending(stream, GROUP)["pending"] == 1  # handed to the blocked read
            # Queued while frozen: it runs before the loop next polls the read's socket.
            loop.call_soon_threadsafe(worker.worker.request_stop)
        worker.stop()
        assert r.xpending(stream, GROUP)["pending"] == 0
        result = InferResult.decode(r.get(keys.result("last")))
        assert result.status is Status.OK and result.worker == "w-stopping"


def test_serving_the_whole_repository_skips_a_model_that_cannot_load(
    redis_url, namespace, tmp_path
):
    """An example model not built yet (no version folder) must not keep the others down; a
    model named with --models that cannot load is still fatal."""
    import asyncio
    import shutil

    from consumer.repository import RepositoryError
    from consumer.settings import WorkerSettings
    from consumer.worker import Worker
    from runtime.connections import RedisSettings
    from tests.conftest import DIGITS
    from tests.support import Stack

    repo = tmp_path / "repo"
    shutil.copytree(DIGITS, repo / "digits")
    (repo / "unbuilt").mkdir()
    shutil.copy(DIGITS / "config.toml", repo / "unbuilt" / "config.toml")
    started: list = []
    s = Stack(redis_url, namespace, repo, started)
    try:
        worker = s.add_worker()
        assert list(worker.worker.slots) == ["digits"]
        assert "no version folders" in worker.worker.skipped["unbuilt"]
        named = Worker(
            WorkerSettings(
                redis=RedisSettings(redis_url),
                namespace=namespace,
                model_repository=repo,
                models=("unbuilt",),
            )
        )
        with pytest.raises(RepositoryError, match="no version folders"):
            asyncio.run(named.start())
    finally:
        for thing in reversed(started):
            thing.stop()


def test_acknowledged_entries_leave_the_stream_within_the_trim_interval(
    stack, redis_url, namespace
):
    """Payloads of answered requests do not sit in Redis until the next periodic trim: they
    leave with their ack, or at most ``TRIM_INTERVAL_S`` (0.5 s) after it."""
    s = stack(models=("sim",))
    for i in range(5):
        assert s.infer("sim", sim_body(i, cache=False)).status_code == 200
    stream = Keys(namespace).stream("sim", Lane.NORMAL)
    with redis.Redis.from_url(redis_url) as r:
        wait_until(lambda: r.xlen(stream) == 0, timeout_s=3, what="answered entries trimmed")
        (group,) = r.xinfo_groups(stream)
    assert group["pending"] == 0 and group["lag"] == 0


def test_the_prompt_trim_never_takes_an_unacknowledged_entry_and_keeps_lag_exact(
    stack, redis_url, namespace
):
    keys = Keys(namespace)
    stream = keys.stream("sim", Lane.NORMAL)
    with redis.Redis.from_url(redis_url) as r:
        now_ms = int(r.time()[0]) * 1000
        r.xgroup_create(stream, GROUP, id="0", mkstream=True)
        held = r.xadd(stream, {FIELD: sim_request(keys, "held", now_ms).encode()})
        r.xreadgroup(GROUP, "slow-worker", {stream: ">"}, count=1)  # running elsewhere, long
        s = stack(models=("sim",))
        for i in range(3):
            assert s.infer("sim", sim_body(i, cache=False)).status_code == 200
        wait_until(lambda: r.xpending(stream, GROUP)["pending"] == 1, what="the three acked")
        assert r.xrange(stream, count=1)[0][0] == held  # the running entry stays
        assert r.xinfo_groups(stream)[0]["lag"] == 0  # known: only a prefix is ever trimmed
        r.xack(stream, GROUP, held)
        s.infer("sim", sim_body(9, cache=False))
        wait_until(lambda: r.xlen(stream) == 0, timeout_s=3, what="the stream trimmed")
