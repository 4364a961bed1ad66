"""A master of the cluster is SIGKILLed under load: its replica takes over and inferq follows.

3 masters + 3 replicas (``cluster-node-timeout`` 2 s), a gateway and two workers. Load: synchronous
requests with a 3 s deadline, each answer checked against its request id, and job submissions.
The master that holds the model's request stream is killed mid-load. Counted per request: 200
(correct), 503 (with Retry-After), 504, 500, hung (no answer by the deadline plus a margin). No
500, no hang, no inferq thread dies, and the service answers again within seconds of the
promotion. Jobs accepted with 202 that never finish are counted in both durability modes; under
``replicated`` there must be none. Each run prints one figure line (``pytest -s``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster.load import failover_run

# serial: kills a master under load and bounds the failover.
pytestmark = pytest.mark.serial


@pytest.mark.timeout(120)
@pytest.mark.parametrize("durability", ["async", "replicated"])
def test_killing_a_master_under_load_costs_no_500_no_hang_and_service_returns(
    durability: str, namespace: str, cluster_repo: Path
) -> None:
    run = failover_run(namespace, cluster_repo, durability)
    print(f"\n{run.line()}")
    assert run.tally.wrong == []
    assert run.tally.statuses["500"] == 0
    assert run.tally.statuses["hung"] == run.tally.statuses["job-hung"] == 0
    assert run.tally.retry_after_missing == 0
    assert set(run.tally.statuses) <= {"200", "503", "504"}
    assert run.back_s < 10.0
    assert run.processes_alive
    if durability == "replicated":
        assert run.lost == []
