"""Redis Cluster plumbing: seed lists, errors of a topology change, slots."""

from __future__ import annotations

import pytest
from redis.exceptions import ClusterDownError, RedisClusterException
from redis.exceptions import ConnectionError as RedisConnectionError

from runtime.cluster import (
    as_connection_error,
    group_by_slot,
    key_slot,
    node_connection,
    parse_seeds,
    seed_urls,
)
from runtime.connections import redact
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


def test_a_node_of_a_tls_cluster_is_reached_over_tls_with_the_seeds_credentials() -> None:
    kind, options = node_connection("rediss://u:pw@h1:7000,h2:7001/0?ssl_cert_reqs=none")
    assert kind.__name__ == "SSLConnection"
    assert (options["username"], options["password"], options["ssl_cert_reqs"]) == (
        "u",
        "pw",
        "none",
    )
    assert "db" not in options and "host" not in options


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
