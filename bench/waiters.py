"""Connections the gateway holds to Redis with 1, 100, 1,000 and 10,000 requests waiting at once.

    python bench/waiters.py [--levels 1,100,1000,10000]

A simulated model whose batch takes 3 s (no CPU) keeps the requests waiting. The script runs
`inferq up` (gateway and worker in their own processes), opens one HTTP connection per request,
sends them all, and samples the gateway's Redis connections with CLIENT LIST until every answer is
back. All requests are sent before the first can be answered (3 s), so they all wait at once.
Loopback only; bounded by the level and a timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Service, machine, save
from loadgen.http import HTTPConnection
from tests.support import sim_body, write_simulated_model


def gateway_connections(url: str) -> int:
    with redis.Redis.from_url(url) as r:
        return sum(1 for c in r.client_list() if c["name"].startswith("inferq-gateway"))


async def hold(port: int, n: int, redis_url: str) -> tuple[int, float, float]:
    body = json.dumps(sim_body(1)).encode()
    headers = {"content-type": "application/json"}
    conns = [HTTPConnection("127.0.0.1", port, timeout=120) for _ in range(n)]
    for i in range(0, n, 500):
        await asyncio.gather(*(c.connect() for c in conns[i : i + 500]))
    started = time.monotonic()
    tasks = [
        asyncio.create_task(c.request("POST", "/v2/models/hold/infer", body, headers))
        for c in conns
    ]
    await asyncio.sleep(0)
    sent = time.monotonic() - started
    peak = 0
    while not all(t.done() for t in tasks) and time.monotonic() - started < 120:
        peak = max(peak, await asyncio.to_thread(gateway_connections, redis_url))
        await asyncio.sleep(0.05)
    responses = await asyncio.gather(*tasks)
    elapsed = time.monotonic() - started
    await asyncio.gather(*(c.aclose() for c in conns))
    assert all(r.status == 200 for r in responses), {r.status for r in responses}
    return peak, sent, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,100,1000,10000")
    args = parser.parse_args()
    repo = Path(tempfile.mkdtemp(prefix="inferq-bench-"))
    write_simulated_model(repo, "hold", base_ms=3000, per_row_ms=0, max_batch=20_000)
    rows = []
    try:
        with Service("--model-repository", str(repo), "--max-timeout-ms", "120000") as svc:
            for n in (int(x) for x in args.levels.split(",")):
                peak, sent, elapsed = asyncio.run(hold(svc.port, n, svc.redis.url))
                rows.append(
                    {
                        "waiters": n,
                        "gateway_redis_connections": peak,
                        "send_s": sent,
                        "seconds": elapsed,
                    }
                )
                print(
                    f"{n:>6} requests waiting at once: at most {peak} gateway Redis "
                    f"connections; all answered in {elapsed:.1f} s",
                    flush=True,
                )
    finally:
        shutil.rmtree(repo)
    print(f"wrote {save('waiters', {'machine': machine(), 'levels': rows})}")


if __name__ == "__main__":
    main()
