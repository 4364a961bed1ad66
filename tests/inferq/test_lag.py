"""``inferq lag``: the collector against a real redis-server (streams and groups built by hand
with XADD, XGROUP and XREADGROUP), the drain estimator, and the subcommand's output and exit
codes."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from inferq import lag
from inferq.redisserver import free_port
from protocol.exits import EXIT_BACKLOG, EXIT_OK, EXIT_REDIS, EXIT_USAGE
from protocol.keys import GROUP, Keys, Lane
from runtime.lag import Backlog, DrainEstimator, LagSource, LaneLag, collect, estimate

pytestmark = pytest.mark.integration


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def keys(namespace: str) -> Keys:
    return Keys(namespace)


def read_backlog(redis_url: str, keys: Keys, **options: Any) -> Backlog:
    async def go() -> Backlog:
        client = aioredis.Redis.from_url(redis_url)
        try:
            return await collect(client, keys, **options)
        finally:
            await client.aclose()

    return asyncio.run(go())


def run_collect(redis_url: str, keys: Keys, **options: Any) -> tuple[LaneLag, ...]:
    return read_backlog(redis_url, keys, **options).lanes


def lane_of(rows: tuple[LaneLag, ...], model: str, lane: Lane) -> LaneLag:
    return next(row for row in rows if row.model == model and row.lane is lane)


def queue(r: redis.Redis, keys: Keys, model: str, n: int, lane: Lane = Lane.NORMAL) -> list[bytes]:
    """A model known to the registry, its group (from id 0, as workers create it), n entries."""
    stream = keys.stream(model, lane)
    r.hset(keys.models, model, b"metadata")
    r.xgroup_create(stream, GROUP, id="0", mkstream=True)
    return [r.xadd(stream, {b"m": b"x"}) for _ in range(n)]


def read(r: redis.Redis, keys: Keys, model: str, consumer: str, n: int) -> None:
    stream = keys.stream(model, Lane.NORMAL)
    r.xreadgroup(GROUP, consumer, {stream: ">"}, count=n)


def heartbeat(r: redis.Redis, keys: Keys, worker: str, *, alive: bool) -> None:
    now_ms = int(r.time()[0]) * 1000
    r.zadd(keys.workers, {worker: now_ms + (60_000 if alive else -60_000)})


# -- the collector -----------------------------------------------------------------------------


def test_lag_counts_unread_entries_and_pending_counts_read_unacknowledged_ones(r, keys, redis_url):
    queue(r, keys, "m", 10)
    read(r, keys, "m", "w1", 3)
    r.xack(keys.stream("m", Lane.NORMAL), GROUP, r.xrange(keys.stream("m", Lane.NORMAL))[0][0])

    rows = run_collect(redis_url, keys)

    normal = lane_of(rows, "m", Lane.NORMAL)
    assert (normal.length, normal.lag, normal.pending, normal.backlog) == (10, 7, 2, 9)
    assert normal.lag_source is LagSource.XINFO and normal.lag_exact
    assert normal.entries_read == 3
    assert [row.lane for row in rows] == [Lane.HIGH, Lane.NORMAL, Lane.LOW]
    assert (lane_of(rows, "m", Lane.HIGH).length, lane_of(rows, "m", Lane.HIGH).lag) == (0, 0)


def test_oldest_pending_age_runs_from_enqueue_on_the_redis_clock(r, keys, redis_url):
    stream = keys.stream("m", Lane.HIGH)
    r.hset(keys.models, "m", b"metadata")
    r.xgroup_create(stream, GROUP, id="0", mkstream=True)
    for ms in (1_000_000, 1_002_000, 1_003_000):
        r.xadd(stream, {b"m": b"x"}, id=f"{ms}-0")
    r.xreadgroup(GROUP, "w1", {stream: ">"}, count=2)

    rows = run_collect(redis_url, keys, clock_now_ms=lambda: 1_005_000)

    high = lane_of(rows, "m", Lane.HIGH)
    assert high.oldest_pending_ms == 5_000
    assert high.sampled_ms == 1_005_000
    assert lane_of(rows, "m", Lane.NORMAL).oldest_pending_ms is None


def test_consumers_counts_only_group_members_with_a_current_heartbeat(r, keys, redis_url):
    queue(r, keys, "m", 6)
    for worker in ("alive", "dead", "unknown"):
        read(r, keys, "m", worker, 1)
    heartbeat(r, keys, "alive", alive=True)
    heartbeat(r, keys, "dead", alive=False)
    heartbeat(r, keys, "idle-elsewhere", alive=True)  # live, but not in this group

    normal = lane_of(run_collect(redis_url, keys), "m", Lane.NORMAL)

    assert (normal.consumers, normal.consumers_registered) == (1, 3)


def test_models_come_from_the_registry_hash_and_from_existing_streams(r, keys, redis_url):
    r.hset(keys.models, "known", b"metadata")
    r.xadd(keys.stream("queued-only", Lane.LOW), {b"m": b"x"})
    r.set(f"{keys.namespace}:stream:{{not-a-stream}}:normal", b"x")
    r.xadd(Keys(f"{keys.namespace}-other").stream("elsewhere", Lane.NORMAL), {b"m": b"x"})

    assert {row.model for row in run_collect(redis_url, keys)} == {"known", "queued-only"}
    assert {row.model for row in run_collect(redis_url, keys, scan=False)} == {"known"}


def test_a_stream_no_worker_ever_read_counts_every_entry_as_lag(r, keys, redis_url):
    stream = keys.stream("m", Lane.NORMAL)
    for _ in range(4):
        r.xadd(stream, {b"m": b"x"})

    normal = lane_of(run_collect(redis_url, keys), "m", Lane.NORMAL)

    assert (normal.lag, normal.pending, normal.consumers) == (4, 0, 0)
    assert normal.lag_source is LagSource.NO_GROUP and normal.lag_exact


def test_lag_redis_cannot_give_after_a_deletion_is_estimated_and_marked(r, keys, redis_url):
    ids = queue(r, keys, "m", 10)
    read(r, keys, "m", "w1", 3)
    r.xdel(keys.stream("m", Lane.NORMAL), ids[5])  # unread: Redis 7 now reports lag as nil

    normal = lane_of(run_collect(redis_url, keys), "m", Lane.NORMAL)

    # 6 unread remain; entries added (10) minus entries read (3) counts the deleted one too.
    assert not normal.lag_exact
    assert normal.lag_source in (LagSource.ENTRIES_READ, LagSource.XLEN)
    assert 6 <= normal.lag <= normal.length == 9


def test_a_group_that_has_read_nothing_has_every_entry_as_lag_even_after_deletions(
    r, keys, redis_url
):
    ids = queue(r, keys, "m", 3)
    r.xdel(keys.stream("m", Lane.NORMAL), ids[1])

    normal = lane_of(run_collect(redis_url, keys), "m", Lane.NORMAL)

    assert (normal.lag, normal.lag_source, normal.lag_exact) == (2, LagSource.UNREAD, True)


def test_a_group_that_has_read_everything_has_no_lag_even_after_deletions(r, keys, redis_url):
    ids = queue(r, keys, "m", 5)
    r.xdel(keys.stream("m", Lane.NORMAL), ids[2])
    read(r, keys, "m", "w1", 10)

    normal = lane_of(run_collect(redis_url, keys), "m", Lane.NORMAL)

    assert (normal.lag, normal.pending) == (0, 4)
    assert normal.lag_exact


def test_dead_letter_streams_are_counted_per_model_in_the_same_reading(r, keys, redis_url):
    for _ in range(3):
        r.xadd(keys.dlq("m"), {b"reason": b"undecodable"})
    models = {"m": 1, "clean": 1}
    assert read_backlog(redis_url, keys, models=models).dead_letters == {"clean": 0, "m": 3}
    assert read_backlog(redis_url, keys, models=models, detail=False).dead_letters == {}


def test_a_reading_sums_its_lanes_by_model_lane_or_partition() -> None:
    lanes = (
        sample(0, read=1, lag=3, pending=1),
        replace(sample(0, read=1, lag=2), lane=Lane.HIGH),
        replace(sample(0, read=1, lag=4), partition=1, oldest_pending_ms=250),
    )
    backlog = Backlog(lanes, {"m": 2})
    (m,) = backlog.by_model().values()
    assert (m.length, m.lag, m.pending, m.backlog, m.oldest_pending_ms) == (3000, 9, 1, 10, 250)
    assert backlog.by(lambda r: r.partition)[1].backlog == 4
    assert backlog.by(lambda r: (r.model, r.lane))[("m", Lane.NORMAL)].lag == 7
    assert backlog.partitions == {"m": 2} and backlog.sampled_ms == 0
    assert backlog.above(9) == ["m"] and backlog.above(10) == [] and backlog.above(None) == []


# -- the drain estimator (pure) ----------------------------------------------------------------


def sample(at_ms: int, *, read: int | None, lag: int, pending: int = 0) -> LaneLag:
    return LaneLag(
        model="m",
        lane=Lane.NORMAL,
        stream="ns:stream:m:normal",
        length=1000,
        lag=lag,
        lag_source=LagSource.XINFO,
        pending=pending,
        consumers=1,
        consumers_registered=1,
        oldest_pending_ms=None,
        entries_read=read,
        sampled_ms=at_ms,
    )


def test_drain_rate_is_entries_read_per_second_and_eta_divides_backlog_by_net_drain():
    drain = estimate(sample(0, read=100, lag=500), sample(2_000, read=300, lag=400, pending=50))
    assert drain is not None
    assert drain.read_per_s == 100.0  # 200 read in 2 s
    assert drain.arrival_per_s == 50.0  # (300 + 400) - (100 + 500) = 100 added in 2 s
    assert drain.eta_s == pytest.approx(450 / 50)


def test_a_growing_or_stalled_backlog_has_no_eta_and_an_empty_one_is_done():
    growing = estimate(sample(0, read=0, lag=10), sample(1_000, read=5, lag=20))
    assert growing is not None and growing.eta_s is None
    empty = estimate(sample(0, read=0, lag=10), sample(1_000, read=10, lag=0))
    assert empty is not None and empty.eta_s == 0.0


def test_no_drain_estimate_without_entries_read_or_after_a_counter_reset():
    assert estimate(sample(0, read=None, lag=3), sample(1_000, read=3, lag=0)) is None
    assert estimate(sample(0, read=50, lag=3), sample(1_000, read=2, lag=0)) is None
    assert estimate(sample(1_000, read=1, lag=3), sample(1_000, read=2, lag=0)) is None


def test_the_estimator_pairs_each_lane_with_its_previous_sample():
    estimator = DrainEstimator()
    assert estimator.update([sample(0, read=0, lag=40)]) == {}
    drains = estimator.update([sample(1_000, read=20, lag=20)])
    assert drains[("m", Lane.NORMAL, 0)].read_per_s == 20.0
    assert drains[("m", Lane.NORMAL, 0)].eta_s == 1.0


# -- the subcommand ----------------------------------------------------------------------------


@pytest.fixture
def cli() -> Callable[..., argparse.Namespace]:
    def parse(*argv: str, environ: dict[str, str] | None = None) -> argparse.Namespace:
        parser = argparse.ArgumentParser(prog="inferq")
        lag.add_parser(parser.add_subparsers(dest="command"), environ or {})
        return parser.parse_args(["lag", *argv])

    return parse


def test_json_output_reports_every_lane_and_a_rollup_per_model(r, keys, redis_url, cli, capsys):
    queue(r, keys, "m", 5)
    read(r, keys, "m", "w1", 2)
    r.xadd(keys.dlq("m"), {b"reason": b"undecodable"})

    code = lag.run(
        cli("--redis", redis_url, "--namespace", keys.namespace, "--json", "--sample-s", "0")
    )

    assert code == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert doc["namespace"] == keys.namespace and doc["group"] == GROUP
    normal = next(row for row in doc["lanes"] if row["lane"] == "normal")
    expected = {
        "model": "m",
        "stream": keys.stream("m", Lane.NORMAL),
        "length": 5,
        "lag": 3,
        "lag_exact": True,
        "lag_source": "xinfo",
        "pending": 2,
        "backlog": 5,
        "consumers": 0,
        "consumers_registered": 1,
        "entries_read": 2,
    }
    assert {k: normal[k] for k in expected} == expected
    assert normal["oldest_pending_ms"] >= 0
    assert doc["models"] == [
        {
            "model": "m",
            "length": 5,
            "lag": 3,
            "lag_exact": True,
            "pending": 2,
            "backlog": 5,
            "consumers": 0,
            "oldest_pending_ms": normal["oldest_pending_ms"],
            "dead_letters": 1,
        }
    ]


def test_a_two_sample_run_reports_the_drain_rate(r, keys, redis_url, cli, capsys):
    queue(r, keys, "m", 4)
    read(r, keys, "m", "w1", 1)
    code = lag.run(
        cli("--redis", redis_url, "--namespace", keys.namespace, "--json", "--sample-s", "0.05")
    )
    assert code == EXIT_OK
    normal = next(
        row for row in json.loads(capsys.readouterr().out)["lanes"] if row["lane"] == "normal"
    )
    assert (normal["drain_per_s"], normal["arrival_per_s"]) == (0.0, 0.0)
    assert normal["eta_s"] is None  # nothing reads it: no end in sight


def test_fail_above_exits_3_only_when_a_models_backlog_is_above_n(r, keys, redis_url, cli, capsys):
    queue(r, keys, "m", 6)
    read(r, keys, "m", "w1", 2)
    queue(r, keys, "m", 0, lane=Lane.HIGH)
    r.xadd(keys.stream("m", Lane.HIGH), {b"m": b"x"})  # 7 across lanes: lag 5 + pending 2
    base = ("--redis", redis_url, "--namespace", keys.namespace, "--sample-s", "0")

    assert lag.run(cli(*base, "--fail-above", "7")) == EXIT_OK
    assert lag.run(cli(*base, "--fail-above", "6")) == EXIT_BACKLOG == 3
    assert "backlog above 6: m has 7 (lag 5 + pending 2)" in capsys.readouterr().out
    assert lag.run(cli(*base, "--json", "--fail-above", "6")) == EXIT_BACKLOG
    assert json.loads(capsys.readouterr().out)["above"] == ["m"]


def test_the_table_reads_like_kafka_consumer_groups_describe(r, keys, redis_url, cli, capsys):
    ids = queue(r, keys, "m", 4)
    read(r, keys, "m", "w1", 1)
    r.xdel(keys.stream("m", Lane.NORMAL), ids[2])
    r.xadd(keys.dlq("m"), {b"reason": b"undecodable"})

    assert lag.run(cli("--redis", redis_url, "--namespace", keys.namespace, "--sample-s", "0")) == 0

    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"namespace {keys.namespace}  group workers  at ")
    assert out[1].split() == list(lag.COLUMNS)
    rows = [line.split() for line in out[2:5]]
    assert [row[:2] for row in rows] == [["m", "high"], ["m", "normal"], ["m", "low"]]
    assert rows[1][2:6] == ["3", "~3", "1", "4"]  # no lag from Redis after a deletion: marked
    assert any(line.startswith("~ lag estimated") for line in out)
    assert f"dead letters: m 1 ({keys.dlq('m')})" in out


def test_watch_prints_one_json_document_per_refresh(r, keys, redis_url, cli, capsys):
    queue(r, keys, "m", 2)
    read(r, keys, "m", "w1", 1)
    argv = ("--redis", redis_url, "--namespace", keys.namespace, "--json")
    assert lag.run(cli(*argv, "--watch", "0.05", "--count", "3")) == EXIT_OK
    docs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(docs) == 3
    assert docs[0]["lanes"][1]["drain_per_s"] is None  # one sample: no rate yet
    assert docs[-1]["lanes"][1]["drain_per_s"] == 0.0


def test_fail_above_is_a_one_shot_check(cli, capsys):
    assert lag.run(cli("--watch", "1", "--fail-above", "0")) == EXIT_USAGE
    assert "--fail-above" in capsys.readouterr().err


def test_an_unreachable_redis_exits_4_with_the_url_and_no_password(cli, capsys):
    url = f"redis://:secret@127.0.0.1:{free_port()}/0"
    assert lag.run(cli("--redis", url, "--sample-s", "0")) == EXIT_REDIS == 4
    err = capsys.readouterr().err
    assert "127.0.0.1" in err and "secret" not in err


def test_no_models_is_said_plainly(redis_url, namespace, cli, capsys):
    assert lag.run(cli("--redis", redis_url, "--namespace", namespace)) == EXIT_OK
    captured = capsys.readouterr()
    assert f"no models in namespace '{namespace}'" in captured.out
    assert "no models found" in captured.err


def test_redis_and_namespace_default_from_the_environment(cli):
    args = cli(environ={"INFERQ_REDIS_URL": "redis://elsewhere:6380/2", "INFERQ_NAMESPACE": "x"})
    assert (args.redis_url, args.namespace) == ("redis://elsewhere:6380/2", "x")
    assert (args.watch, args.json, args.fail_above) == (None, False, None)
    assert cli("--namespace", "y", environ={"INFERQ_NAMESPACE": "x"}).namespace == "y"
