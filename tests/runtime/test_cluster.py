"""Redis Cluster plumbing: seed lists, cluster detection, errors of a topology change, slots."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import ClusterDownError, RedisClusterException
from redis.exceptions import ConnectionError as RedisConnectionError

from inferq.redisserver import RedisServer
from runtime.cluster import (
    as_connection_error,
    detect_cluster,
    detect_cluster_sync,
    group_by_slot,
    key_slot,
    parse_seeds,
    seed_urls,
)
from runtime.connections import RedisSettings, redact, resolve
from runtime.faults import Fault, classify


def test_one_url_is_one_seed() -> None:
    assert seed_urls("redis://h:7000/0") == ["redis://h:7000/0"]


def test_several_hosts_share_the_credentials_database_and_options_of_the_url() -> None:
    url = "rediss://user:pw@h1:7000,h2:7001,h3:7002/0?ssl_ca_certs=/ca.pem"
    assert seed_urls(url) == [
        "rediss://user:pw@h1:7000/0?ssl_ca_certs=/ca.pem",
        "rediss://user:pw@h2:7001/0?ssl_ca_certs=/ca.pem",
        "rediss://user:pw@h3:7002/0?ssl_ca_certs=/ca.pem",
    ]
    seeds = parse_seeds(url)
    assert seeds.hosts == (("h1", 7000), ("h2", 7001), ("h3", 7002))
    assert seeds.options["username"] == "user" and seeds.options["password"] == "pw"
    assert seeds.options["ssl_ca_certs"] == "/ca.pem"


def test_several_full_urls_separated_by_commas_are_seeds_too() -> None:
    url = "redis://:pw@h1:7000/0,redis://:pw@h2:7001/0"
    assert seed_urls(url) == ["redis://:pw@h1:7000/0", "redis://:pw@h2:7001/0"]
    assert parse_seeds(url).hosts == (("h1", 7000), ("h2", 7001))


@pytest.mark.parametrize("url", ["", "h1:7000,h2:7000", "redis://:pw@/0"])
def test_a_url_without_scheme_or_host_is_refused(url: str) -> None:
    with pytest.raises(ValueError):
        parse_seeds(url)


def test_redact_hides_every_seeds_password() -> None:
    assert redact("redis://:pw@h1:1,h2:2/0") == "redis://***@h1:1,h2:2/0"
    assert "pw" not in redact("redis://u:pw@h1:1/0,redis://u:pw@h2:2/0")


def test_keys_are_grouped_by_slot_in_their_order() -> None:
    groups = group_by_slot(["a{x}1", "b", "a{x}2", "c"])
    assert groups[key_slot(b"x")] == ["a{x}1", "a{x}2"]
    assert sum(len(v) for v in groups.values()) == 4


def test_a_topology_change_reads_as_redis_being_unavailable_and_echoes_no_payload() -> None:
    quoted = ClusterDownError("The cluster is down")
    command = "XADD s * m SECRET-PAYLOAD"
    quoted.args = (f"Command # 1 ({command}) of pipeline caused error: ('The cluster is down',)",)
    for error in (quoted, RedisClusterException("All slots are not covered")):
        converted = as_connection_error(error)
        assert isinstance(converted, RedisConnectionError)
        assert classify(converted) is Fault.CONNECTION
        assert "SECRET" not in str(converted)
        assert converted.__cause__ is error


def test_a_plain_redis_is_not_a_cluster(redis_server: RedisServer) -> None:
    assert detect_cluster_sync(redis_server.url, timeout_s=1) is False
    assert asyncio.run(detect_cluster(redis_server.url, timeout_s=1)) is False
    resolved = asyncio.run(resolve(RedisSettings(redis_server.url)))
    assert resolved.cluster is False


def test_nothing_answering_is_undecided_and_several_seeds_then_mean_a_cluster() -> None:
    assert detect_cluster_sync("redis://127.0.0.1:1/0", timeout_s=0.2) is None
    one = asyncio.run(resolve(RedisSettings("redis://127.0.0.1:1/0", connect_timeout_s=0.2)))
    assert one.cluster is False
    many = RedisSettings("redis://127.0.0.1:1,127.0.0.1:2/0", connect_timeout_s=0.2)
    assert asyncio.run(resolve(many)).cluster is True


def _raised_in(filename: str, source: str) -> BaseException:
    try:
        exec(compile(source, filename, "exec"), {})
    except BaseException as e:
        return e
    raise AssertionError("nothing was raised")


def test_a_connection_redis_py_tore_down_under_a_caller_counts_as_lost():
    from runtime.cluster import torn_connection

    lost = _raised_in("/venv/site-packages/redis/asyncio/connection.py", "None.writelines([])")
    assert torn_connection(lost)
    ours = _raised_in("/work/producer/service.py", "None.writelines([])")
    assert not torn_connection(ours)
    other = _raised_in("/venv/site-packages/redis/asyncio/connection.py", "(1).nope")
    assert not torn_connection(other)
