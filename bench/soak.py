"""Soak: steady load for a long time; stream length, pending, consumers and Redis memory stay flat.

    python bench/soak.py [--minutes 30] [--rate 50] [--sample-s 30]

`inferq up --workers 2` with the digits model on a private redis-server. An open-loop load at
``--rate`` requests/s (unique inputs, so every request misses the cache and goes through the
queue; one in ten is an async job) runs for ``--minutes``; every ``--sample-s`` the script
records stream lengths, pending entries, live consumers, Redis ``used_memory`` and the gateway's
RSS, and prints them. At the end it prints first vs last (after warm-up) so growth is visible.
Loopback only; bounded in time and count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import DIGITS_SAMPLES, Service, save
from loadgen.http import HTTPConnection
from protocol.keys import GROUP, Keys

SAMPLES = DIGITS_SAMPLES
HEADERS = {"content-type": "application/json"}


def body(i: int) -> bytes:
    row = [*SAMPLES["inputs"][i % 10][:-1], float(i)]  # unique: always a cache miss
    return json.dumps(
        {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": row}]}
    ).encode()


def gateway_rss_mb(redis_url: str) -> float:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            if "inferq gateway" in cmd and redis_url in cmd:
                for line in (entry / "status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            continue
    return 0.0


def sample(r: redis.Redis, keys: Keys, redis_url: str) -> dict[str, float]:
    length = pending = consumers = 0
    for stream in keys.streams("digits"):
        if not r.exists(stream):
            continue
        length += r.xlen(stream)
        pending += r.xpending(stream, GROUP)["pending"]
        consumers = max(consumers, len(r.xinfo_consumers(stream, GROUP)))
    return {
        "stream_length": length,
        "pending": pending,
        "consumers": consumers,
        "used_memory_mb": int(r.info("memory")["used_memory"]) / 2**20,
        "gateway_rss_mb": gateway_rss_mb(redis_url),
    }


async def load(url: str, rate: float, seconds: float, counts: dict[int, int]) -> None:
    host, port = url.removeprefix("http://").split(":")
    pool: asyncio.Queue[HTTPConnection] = asyncio.Queue()
    for _ in range(64):
        pool.put_nowait(HTTPConnection(host, int(port), timeout=30))

    async def one(i: int) -> None:
        conn = await pool.get()
        try:
            path = "/v2/models/digits/jobs" if i % 10 == 0 else "/v2/models/digits/infer"
            r = await conn.request("POST", path, body(i), HEADERS)
            counts[r.status] = counts.get(r.status, 0) + 1
        except Exception:
            counts[0] = counts.get(0, 0) + 1
        finally:
            pool.put_nowait(conn)

    start = time.monotonic()
    tasks: set[asyncio.Task[None]] = set()
    for i in range(int(rate * seconds)):
        delay = start + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(one(i))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)
    while not pool.empty():
        await pool.get_nowait().aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--rate", type=float, default=50)
    parser.add_argument("--sample-s", type=float, default=30)
    args = parser.parse_args()
    seconds = args.minutes * 60
    rows = []
    counts: dict[int, int] = {}
    # Short retention so a 30-minute run reaches steady state for result keys and jobs too.
    with Service("--workers", "2", "--result-ttl-s", "60", "--job-ttl", "300") as svc:
        keys = Keys("inferq")
        with redis.Redis.from_url(svc.redis.url) as r:

            async def run() -> None:
                task = asyncio.create_task(load(svc.url, args.rate, seconds, counts))
                started = time.monotonic()
                while not task.done():
                    row = {
                        "t_s": round(time.monotonic() - started),
                        **await asyncio.to_thread(sample, r, keys, svc.redis.url),
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    try:
                        await asyncio.wait_for(asyncio.shield(task), args.sample_s)
                    except TimeoutError:
                        pass
                await task

            asyncio.run(run())
            rows.append({"t_s": round(seconds), **sample(r, keys, svc.redis.url)})
    steady = [row for row in rows if row["t_s"] >= min(300, seconds / 3)] or rows
    first, last = steady[0], steady[-1]
    print(f"\nrequests by status: {dict(sorted(counts.items()))}")
    for key in ("stream_length", "pending", "consumers", "used_memory_mb", "gateway_rss_mb"):
        print(
            f"{key:>16}: {first[key]:10.1f} at {first['t_s']} s -> {last[key]:10.1f} at "
            f"{last['t_s']} s (max {max(r[key] for r in steady):.1f})"
        )
    result = {"args": vars(args), "counts": counts, "samples": rows}
    print(f"wrote {save('soak', result)}")


if __name__ == "__main__":
    main()
