"""A batch on a real Redis Cluster: its keys share one hash tag (one slot), its lines' jobs still
spread over the partitions of the model, and every line is answered once, correctly."""

from __future__ import annotations

import json

import pytest
from redis.crc import key_slot

from protocol.batches import BATCH_PARTS
from protocol.keys import Keys, Lane
from tests.cluster.conftest import PARTITIONS
from tests.cluster.test_cluster import cluster_client, entries_read
from tests.support import sim_body, wait_until

# serial: its cluster fails a node over when it is starved for 2 s.
pytestmark = pytest.mark.serial

LINES = 300


def test_a_batch_keeps_its_keys_in_one_slot_and_spreads_its_lines_over_partitions(
    cluster_stack, redis_cluster
):
    s = cluster_stack(workers=2, models=("wide",))
    keys = Keys(s.namespace)
    body = "".join(
        json.dumps(
            {"custom_id": f"c{i}", "url": "/v2/models/wide/infer", "body": sim_body(float(i))}
        )
        + "\n"
        for i in range(LINES)
    )
    with s.client() as c:
        r = c.post("/v2/batches", content=body)
        assert r.status_code == 202, r.text
        batch_id = r.json()["id"]
        wait_until(
            lambda: c.get(f"/v2/batches/{batch_id}").json()["status"] == "completed",
            timeout_s=90,
            what="the batch to complete",
            poll_s=0.2,
        )
        done = c.get(f"/v2/batches/{batch_id}").json()
        out = [json.loads(x) for x in c.get(f"/v2/batches/{batch_id}/output").text.split()]
    assert done["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
    assert [o["custom_id"] for o in out] == [f"c{i}" for i in range(LINES)]
    assert all(o["response"]["body"]["outputs"][0]["data"] == [4.0 * i] for i, o in enumerate(out))
    slots = {key_slot(keys.batch(batch_id, part).encode()) for part in ("", *BATCH_PARTS)}
    assert len(slots) == 1
    streams = [keys.stream("wide", Lane.LOW, p) for p in range(PARTITIONS)]
    with cluster_client(redis_cluster) as r:
        read = [entries_read(r, st) for st in streams]
    assert sum(read) == LINES
    assert sum(1 for n in read if n) >= 2, f"the lines went to one partition: {read}"
