"""Issue #27, low load: where one request's time goes at c=1, hop by hop, against the floor.

    python bench/hops.py [--requests 2000] [--label NAME]

1. **The floor**, on a private redis-server on loopback, with redis-py's asyncio client (the
   library the gateway and the worker use): the P50 of a ``PING`` round trip, of an ``XADD``, and
   of the two wake-ups (a reader blocked in ``XREADGROUP ... BLOCK`` / ``XREAD ... BLOCK`` on one
   connection, an ``XADD`` sent on another: from the send to the reader's return), and of one
   digits model call (ONNX Runtime, batch 1, one intra-op thread, as the worker runs it). The
   floor of a request through a queue is four loopback round trips (HTTP in and out, the request
   to the worker and the result back) plus the model call.
2. **inferq's hops**: ``inferq up`` (1 gateway, 1 worker) with OpenTelemetry on, every request
   sampled and its spans written by the console exporter, and ``--requests`` digits JSON requests
   sent one after the other on one keep-alive connection (cache off). Per request, from the spans
   of its trace (``runtime/otel.py``; the times are the processes' monotonic clocks, system-wide
   on Linux, put on one epoch): receive and validate (gateway), enqueue → worker read (``XADD``
   and the worker's ``XREADGROUP`` wake-up), read → model call (decode, batching), the model call,
   the model done → the gateway wakes (the result's ``XADD`` and the reply listener's ``XREAD``
   wake-up), encode; and the client's latency. Tracing costs time itself (BENCHMARKS.md, tracing
   cost): the client's P50 here is above an untraced run's, the spans are the split.

Writes ``bench/results/hops-<label>.json`` and its summary (bench/common.save).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Service, git_revision, machine, model_repository, save
from bench.peers import request as v2_request
from inferq.redisserver import RedisServer


def p50_us(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e6, 1)


async def _redis_floor(url: str, n: int) -> dict[str, float]:
    import redis.asyncio as redis

    a = redis.Redis.from_url(url)
    b = redis.Redis.from_url(url)
    await a.ping()
    await b.ping()
    out: dict[str, list[float]] = {"ping": [], "xadd": [], "xreadgroup_wake": [], "xread_wake": []}
    for _ in range(n):
        t = time.perf_counter()
        await a.ping()
        out["ping"].append(time.perf_counter() - t)
    for _ in range(n):
        t = time.perf_counter()
        await a.xadd("floor:x", {"p": b"x" * 300}, maxlen=1000)
        out["xadd"].append(time.perf_counter() - t)
    await a.xgroup_create("floor:g", "g", id="$", mkstream=True)

    async def woken(stream: str, read: Any) -> float:
        reader = asyncio.create_task(read())
        await asyncio.sleep(0.001)  # the reader is blocked in Redis
        t = time.perf_counter()
        await a.xadd(stream, {"p": b"x" * 300}, maxlen=1000)
        await reader
        return reader.result() - t

    async def read_group() -> float:
        await b.xreadgroup("g", "c", {"floor:g": ">"}, count=1, block=5000)
        return time.perf_counter()

    async def read_plain() -> float:
        await b.xread({"floor:r": "$"}, count=1, block=5000)
        return time.perf_counter()

    for stream, read, key in (
        ("floor:g", read_group, "xreadgroup_wake"),
        ("floor:r", read_plain, "xread_wake"),
    ):
        for _ in range(min(n, 1000)):
            out[key].append(await woken(stream, read))
    await a.aclose()
    await b.aclose()
    return {k: p50_us(v) for k, v in out.items()}


def model_call_us(path: Path, n: int) -> float:
    from bench.peer_servers import session
    from bench.peers import sample

    sess = session(str(path))
    name = sess.get_inputs()[0].name
    outputs = [o.name for o in sess.get_outputs()]
    x = sample("digits")
    times = []
    for _ in range(n):
        t = time.perf_counter()
        sess.run(outputs, {name: x})
        times.append(time.perf_counter() - t)
    return p50_us(times)


def spans(path: Path) -> list[dict[str, Any]]:
    """The spans the console exporter wrote (pretty JSON objects, one after another)."""
    text = path.read_text(errors="replace")
    decoder = json.JSONDecoder()
    out, pos = [], 0
    while (start := text.find("{", pos)) >= 0:
        try:
            value, pos = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            pos = start + 1
            continue
        if isinstance(value, dict) and "context" in value and "start_time" in value:
            out.append(value)
    return out


def _t(value: str) -> float:
    """An exporter timestamp (ISO 8601, microseconds, UTC) as seconds."""
    from datetime import datetime

    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


HOPS = (
    "receive and validate",
    "enqueue → worker read (XADD, XREADGROUP wake-up)",
    "worker read → model call (decode, batch)",
    "model call",
    "result write (worker: XADD sent → its reply read)",
    "model done → gateway wakes (result XADD, XREAD wake-up)",
    "encode response",
    "server span (gateway, whole)",
)


def hops_of(all_spans: list[dict[str, Any]]) -> dict[str, list[float]]:
    traces: dict[str, dict[str, dict[str, Any]]] = {}
    for s in all_spans:
        traces.setdefault(s["context"]["trace_id"], {})[s["name"]] = s
    out: dict[str, list[float]] = {h: [] for h in HOPS}
    for t in traces.values():
        need = ("queue wait", "batch wait", "inference", "result write", "encode response")
        if not all(k in t for k in need):
            continue
        root = next((s for s in t.values() if s.get("parent_id") is None), None)

        def start(k: str, t: dict[str, dict[str, Any]] = t) -> float:
            return _t(t[k]["start_time"])

        def end(k: str, t: dict[str, dict[str, Any]] = t) -> float:
            return _t(t[k]["end_time"])

        if "receive and validate" in t:
            out[HOPS[0]].append(end("receive and validate") - start("receive and validate"))
        out[HOPS[1]].append(start("batch wait") - start("queue wait"))
        out[HOPS[2]].append(end("batch wait") - start("batch wait"))
        out[HOPS[3]].append(end("inference") - start("inference"))
        out[HOPS[4]].append(end("result write") - start("result write"))
        # The gateway wakes before the worker reads its XADD's reply: measured from the write's
        # start, the hop holds the result's XADD and the reply listener's wake-up.
        out[HOPS[5]].append(end("queue wait") - start("result write"))
        out[HOPS[6]].append(end("encode response") - start("encode response"))
        if root is not None:
            out[HOPS[7]].append(_t(root["end_time"]) - _t(root["start_time"]))
    return out


def inferq_hops(repo: Path, n: int, log: Path) -> dict[str, Any]:
    env = {
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_TRACES_SAMPLER": "always_on",
        # Exported as they come, in batches: holding them all for the shutdown lost them (the
        # processes exit before the console exporter has written 20,000 spans).
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "OTEL_BSP_MAX_QUEUE_SIZE": str(max(8 * n, 2048)),
    }
    body, headers = v2_request("digits", False)
    latencies = []
    with Service("--model-repository", str(repo), env=env, stdout=log) as svc:
        svc.wait_for_workers("digits", 1)
        conn = http.client.HTTPConnection("127.0.0.1", svc.port, timeout=10)
        for i in range(n + 200):
            t = time.perf_counter()
            conn.request("POST", "/v2/models/digits/infer", body, headers)
            reply = conn.getresponse()
            reply.read()
            if reply.status != 200:
                raise RuntimeError(f"status {reply.status}")
            if i >= 200:  # warm-up
                latencies.append(time.perf_counter() - t)
        conn.close()
        # The batch span processors export every 200 ms: until every request's trace is
        # written (30 s at most), while the processes still run.
        deadline = time.monotonic() + 30
        found = hops_of(spans(log))
        while len(found[HOPS[3]]) < n + 200 and time.monotonic() < deadline:
            time.sleep(0.5)
            found = hops_of(spans(log))
    return {
        "client_p50_us": p50_us(latencies),
        "traces": len(found[HOPS[3]]),
        "hops_p50_us": {k: p50_us(v) for k, v in found.items() if v},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    revision = git_revision()
    with RedisServer() as server:
        floor = asyncio.run(_redis_floor(server.url, args.requests))
    with model_repository(digits=True, medium=False) as repo:
        floor["model_call"] = model_call_us(repo / "digits" / "1" / "model.onnx", args.requests)
        with tempfile.TemporaryDirectory() as tmp:
            found = inferq_hops(repo, args.requests, Path(tmp) / "spans.txt")
    floor["four_round_trips_plus_model"] = round(4 * floor["ping"] + floor["model_call"], 1)
    hops = found["hops_p50_us"]
    # The chain from the request's arrival to its answer; the result write overlaps the
    # gateway's wake-up (the gateway wakes before the worker reads its XADD's reply).
    chain = [h for h in HOPS if not h.startswith(("server span", "result write"))]
    summed = round(sum(hops.get(h, 0.0) for h in chain), 1)
    print(f"floor (P50 µs): {floor}")
    print(f"inferq at c=1, {found['traces']} traced requests, P50 µs per hop:")
    for k, v in hops.items():
        print(f"  {v:8.1f}  {k}")
    print(f"  {summed:8.1f}  sum of the chain (all but the result write, which overlaps)")
    print(
        f"client P50 {found['client_p50_us']} µs; floor {floor['four_round_trips_plus_model']} µs"
    )
    data = {
        "benchmark": "bench/hops.py",
        "revision": revision,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
        "floor_p50_us": floor,
        "inferq": {**found, "hops_sum_p50_us": summed},
    }
    print(f"wrote {save(f'hops-{args.label or revision}', data)}")


if __name__ == "__main__":
    main()
