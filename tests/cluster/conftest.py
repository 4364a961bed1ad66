"""Fixtures for the Redis Cluster suite: a real local cluster the suite starts itself.

``redis_cluster`` (tests/conftest.py) is 3 masters without replicas, shared by the whole
session. The failover tests start their own 3 masters + 3 replicas, since they kill a master.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import DIGITS
from tests.localcluster import LocalCluster
from tests.support import Stack, stacks, write_simulated_model

PARTITIONS = 6
"""Partitions of the ``wide`` model: over 3 masters, more than one master holds its streams."""


@pytest.fixture(scope="session")
def cluster_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real digits model, simulated models, and a partitioned one."""
    repo = tmp_path_factory.mktemp("cluster-models")
    shutil.copytree(DIGITS, repo / "digits", ignore=shutil.ignore_patterns("train.py"))
    write_simulated_model(repo, "sim", base_ms=1, per_row_ms=0, max_batch=32)
    write_simulated_model(repo, "echo", base_ms=1, per_row_ms=0, max_batch=8)
    write_simulated_model(repo, "cached", base_ms=1, per_row_ms=0, max_batch=8, cache=True)
    write_simulated_model(
        repo, "wide", base_ms=1, per_row_ms=0, max_batch=16, partitions=PARTITIONS
    )
    return repo


@pytest.fixture
def cluster_stack(
    redis_cluster: LocalCluster, namespace: str, cluster_repo: Path
) -> Iterator[Callable[..., Stack]]:
    """``cluster_stack(workers=1, models=(), seeds=...)`` starts a gateway and workers on the
    cluster (through ``seeds``: every node by default); all stop at the end."""
    make, stop = stacks(redis_cluster.url, namespace, cluster_repo)
    yield make
    stop()
