"""Shared fixtures: a private redis-server per test session, and factories that start real
gateways and workers (each in its own thread and event loop) and always stop what they started.

Every test gets its own key namespace, so tests never see each other's streams and the suite
never flushes anything.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import structlog

from consumer.settings import DEFAULT_METRICS_PORT
from inferq.redisserver import RedisServer
from producer.settings import DEFAULT_GATEWAY_METRICS_PORT, GatewaySettings
from tests.kinds import RedisUnderTest
from tests.localcluster import LocalCluster
from tests.support import Stack, stacks, write_simulated_model

REPO_ROOT = Path(__file__).resolve().parent.parent
DIGITS = REPO_ROOT / "models" / "digits"


@pytest.fixture(autouse=True)
def _default_logging() -> Iterator[None]:
    """Entry points configure logging globally; tests that call them must not leak it."""
    yield
    structlog.reset_defaults()


DEFAULT_PORTS = (
    GatewaySettings().port,
    GatewaySettings().grpc_port,
    *range(DEFAULT_METRICS_PORT, DEFAULT_METRICS_PORT + 4),  # `inferq up`'s worker i: base + i
    # `--gateways N`'s gateway i: base + i
    *range(DEFAULT_GATEWAY_METRICS_PORT, DEFAULT_GATEWAY_METRICS_PORT + 4),
)


@pytest.fixture(scope="session", autouse=True)
def _default_ports_taken() -> Iterator[None]:
    """Hold the default HTTP, gRPC and metrics ports for the whole session, as another service
    on the machine may: a test that binds a default instead of a free port fails here, at once,
    not only on the machine where something else listens on 8000. A port already held by
    someone else is left to them (it is taken either way)."""
    with contextlib.ExitStack() as held:
        for port in DEFAULT_PORTS:
            sock = held.enter_context(socket.socket())
            with contextlib.suppress(OSError):
                # Bound, not listening: another bind of it fails, a connect is refused.
                sock.bind(("0.0.0.0", port))
        yield


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.fail(
            "redis-server is not on PATH: the integration suite needs Redis 7 "
            "(Debian: apt-get install redis-server); .ci/run installs it"
        )
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalCluster]:
    """3 masters without replicas, shared by the whole session (each test has its own
    namespace, so its keys, and with them its hash tags, are its own)."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.fail("the cluster tests need redis-server and redis-cli 7 on PATH")
    with LocalCluster(masters=3) as cluster:
        yield cluster


@pytest.fixture(params=["standalone", "cluster"])
def either_redis(request: pytest.FixtureRequest) -> RedisUnderTest:
    """One Redis, then a Redis Cluster: for what must hold on both."""
    if request.param == "standalone":
        server: RedisServer = request.getfixturevalue("redis_server")
        return RedisUnderTest("standalone", server.url, (server.port,))
    cluster: LocalCluster = request.getfixturevalue("redis_cluster")
    return RedisUnderTest("cluster", cluster.url, tuple(cluster.ports))


@pytest.fixture
def namespace() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def model_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository with the real digits model and simulated models for timing-driven tests."""
    repo = tmp_path_factory.mktemp("models")
    shutil.copytree(DIGITS, repo / "digits", ignore=shutil.ignore_patterns("train.py"))
    write_simulated_model(repo, "sim", base_ms=1, per_row_ms=0, max_batch=32)
    write_simulated_model(repo, "slow", base_ms=300, per_row_ms=0, max_batch=64)
    write_simulated_model(repo, "serial", base_ms=200, per_row_ms=0, max_batch=1)
    write_simulated_model(repo, "hold", base_ms=3000, per_row_ms=0, max_batch=4096)
    write_simulated_model(repo, "broken", base_ms=0, per_row_ms=0, max_batch=1, failure_rate=1.0)
    return repo


@pytest.fixture(scope="session")
def minilm_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository with the minilm example built from the weights package (about 3 s: the
    90 MB graph is written once per session, never into the source tree)."""
    from inferq.examples import minilm

    repo = tmp_path_factory.mktemp("minilm-repo")
    (repo / "minilm").mkdir()
    shutil.copy(REPO_ROOT / "models" / "minilm" / "config.toml", repo / "minilm" / "config.toml")
    minilm.build(repo)
    return repo


@pytest.fixture
def stack(redis_url: str, namespace: str, model_repo: Path) -> Iterator[Callable[..., Stack]]:
    """``stack(workers=2, **gateway_options)`` starts a gateway and workers; all stop at the end."""
    make, stop = stacks(redis_url, namespace, model_repo)
    yield make
    stop()
