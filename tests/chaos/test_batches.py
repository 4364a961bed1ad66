"""Batches under chaos: SIGKILL the gateway driving a batch and a worker running its lines; the
batch completes on a gateway started afterwards, and counted per custom_id nothing is lost and
nothing is answered twice. A line left 'running' by the SIGKILLed worker is run again once its
job lease lapses (``consumer.leases``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import httpx
import pytest

from inferq.redisserver import free_port
from tests.support import gateway_process, sim_body, wait_until

# serial: kills processes under load and bounds the recovery.
pytestmark = pytest.mark.serial

LINES = 2000


def _up(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _counts(c: httpx.Client, batch_id: str) -> dict:
    return c.get(f"/v2/batches/{batch_id}").json()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kill_worker", [False, True], ids=["gateway", "gateway-and-worker"])
def test_sigkill_of_the_gateway_and_a_worker_mid_batch_loses_and_doubles_nothing(
    workers, redis_url, namespace, capsys, kill_worker
):
    procs: list[subprocess.Popen[bytes]] = []
    first = workers.start("chaos", "--claim-idle-ms", "2000")
    workers.start("chaos", "--claim-idle-ms", "2000")
    port = free_port()
    procs.append(gateway_process(redis_url, namespace, port))
    try:
        wait_until(lambda: _up(port), timeout_s=60, what="the first gateway")
        body = b"".join(
            json.dumps(
                {
                    "custom_id": f"c{i}",
                    "url": "/v2/models/chaos/infer",
                    "body": sim_body(float(i), rows=1),
                }
            ).encode()
            + b"\n"
            for i in range(LINES)
        )
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            wait_until(
                lambda: c.get("/v2/models/chaos/ready").status_code == 200,
                timeout_s=60,
                what="the chaos model",
            )
            r = c.post("/v2/batches", content=body)
            assert r.status_code == 202, r.text
            batch_id = r.json()["id"]
            wait_until(
                lambda: _counts(c, batch_id)["request_counts"]["completed"] > LINES // 10,
                timeout_s=60,
                what="a tenth of the lines answered",
                poll_s=0.2,
            )
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].wait(10)
        if kill_worker:
            os.kill(first.pid, signal.SIGKILL)
            first.wait(10)
        # A gateway started afterwards, on another port, takes the batch over.
        port = free_port()
        procs.append(gateway_process(redis_url, namespace, port))
        wait_until(lambda: _up(port), timeout_s=60, what="the second gateway")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            seen: list[dict] = []
            try:
                wait_until(
                    lambda: seen.append(_counts(c, batch_id)) or seen[-1]["status"] == "completed",
                    timeout_s=90 if kill_worker else 150,
                    what="the batch to complete",
                    poll_s=0.5,
                )
            except AssertionError as e:
                raise AssertionError(f"{e}; last seen: {seen[-1]}") from None
            done = _counts(c, batch_id)
            out = [json.loads(x) for x in c.get(f"/v2/batches/{batch_id}/output").text.split()]
            errors = c.get(f"/v2/batches/{batch_id}/errors").text
        ids = [o["custom_id"] for o in out]
        assert done["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
        assert errors == ""
        assert len(ids) == len(set(ids)) == LINES
        assert set(ids) == {f"c{i}" for i in range(LINES)}
        for o in out:
            i = int(o["custom_id"][1:])
            assert o["response"]["body"]["outputs"][0]["data"] == [4.0 * i]
        with capsys.disabled():
            killed = "gateway + worker" if kill_worker else "gateway"
            print(f"\nbatch chaos: {LINES} lines, {killed} SIGKILLed, each answered once")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
