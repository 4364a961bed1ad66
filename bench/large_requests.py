"""Large requests and memory: peak RSS of the gateway and the worker, and Redis's peak memory,
while CONCURRENCY clients each send one ~63 MiB binary request at once.

    python bench/large_requests.py [--concurrency 8] [--rows 260000]

`inferq up` (one gateway, one worker, the digits model) on a private redis-server, the defaults
of the checkout under test (``--max-inflight-bytes`` where it exists). Each request is ROWS rows
of digits' 64 FP32 inputs as binary data (260,000 rows: 63.5 MiB, under the 64 MiB body limit),
cache off, a 300 s deadline. Reported: the status of every request, the peak RSS (``VmHWM``) of
each process, Redis's ``used_memory_peak``, and the stream's length afterwards (what is left of
answered requests in Redis). Writes bench/results/large_requests.json. Loopback only; one round.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Service, save


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def request_body(rows: int) -> tuple[bytes, int]:
    data = np.zeros((rows, 64), "<f4").tobytes()
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "datatype": "FP32",
                    "shape": [rows, 64],
                    "parameters": {"binary_data_size": len(data)},
                }
            ],
            "outputs": [{"name": "label"}],
            "parameters": {"timeout": 300_000_000, "cache": False},
        }
    ).encode()
    return header + data, len(header)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rows", type=int, default=260_000)
    args = parser.parse_args()
    body, header_length = request_body(args.rows)
    headers = {
        "content-type": "application/octet-stream",
        "inference-header-content-length": str(header_length),
    }
    answers: list[tuple[int, str]] = []
    with Service() as svc:
        url = f"{svc.url}/v2/models/digits/infer"

        def one() -> None:
            r = httpx.post(url, content=body, headers=headers, timeout=600)
            answers.append((r.status_code, "" if r.status_code == 200 else r.text[:200]))

        threads = [threading.Thread(target=one) for _ in range(args.concurrency)]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.monotonic() - started
        peaks = {role: peak_rss_mb(pid) for pid, role in svc.processes().items()}
        with redis.Redis.from_url(svc.redis.url) as r:
            redis_peak = r.info("memory")["used_memory_peak"] / 2**20
            left = r.xlen("inferq:stream:digits:normal")
    statuses = dict(sorted(Counter(code for code, _ in answers).items()))
    print(
        f"{args.concurrency} x {len(body) / 2**20:.1f} MiB requests in {seconds:.1f} s: {statuses}"
    )
    for code, text in sorted(set(answers)):
        if text:
            print(f"  {code}: {text}")
    print(
        f"peak RSS: gateway {peaks.get('gateway', 0):.0f} MB, worker {peaks.get('worker', 0):.0f} "
        f"MB; Redis used_memory_peak {redis_peak:.0f} MB; entries left in the stream: {left}"
    )
    save(
        "large_requests",
        {
            "concurrency": args.concurrency,
            "body_bytes": len(body),
            "seconds": seconds,
            "statuses": statuses,
            "errors": sorted({text for _, text in answers if text}),
            "peak_rss_mb": peaks,
            "redis_used_memory_peak_mb": redis_peak,
            "stream_entries_left": left,
        },
    )


if __name__ == "__main__":
    main()
