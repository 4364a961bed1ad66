"""Does loadgen's own HTTP/1.1 client earn its keep? It against httpx and aiohttp, same server.

Each client runs a closed loop (C connections sending back-to-back, keep-alive) against one
trivial HTTP server in another process: a raw asyncio protocol on uvloop that answers every POST
with the same 200 and a ~200-byte JSON body, so the server's cost stays small and alike for all.
What matters on this project's 2-core machines is the client's CPU per request (the load
generator shares the cores with the server under test), measured with ``time.process_time``
over the measured window, next to requests/s and P50.

    .venv/bin/python bench/http_clients.py                 # C = 1 and 16, 3 s each
    .venv/bin/python bench/http_clients.py --levels 1,16,64 --duration 5

aiohttp is measured when it is installed (it is no dependency of inferq); httpx is a dev
dependency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import free_port, markdown_table, save
from loadgen.http import HTTPConnection, prepare
from loadgen.http import run as run_loop
from loadgen.stats import LatencyHistogram

BODY = json.dumps(
    {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
).encode()
PATH = "/v2/models/m/infer"
ANSWER = json.dumps(
    {
        "model_name": "m",
        "outputs": [
            {
                "name": "y",
                "datatype": "FP32",
                "shape": [1, 10],
                "data": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0],
            }
        ],
    }
).encode()
RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
    + f"content-length: {len(ANSWER)}\r\n\r\n".encode()
    + ANSWER
)


class TrivialServer(asyncio.Protocol):
    """Answers each request (head plus Content-Length body) with :data:`RESPONSE`."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            length = 0
            for line in self.buf[:end].split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            self.buf = self.buf[end + 4 + length :]
            self.transport.write(RESPONSE)


async def serve(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(TrivialServer, "127.0.0.1", port)
    print("ready", flush=True)
    await server.serve_forever()


#: One client's "send the request, await the whole response" on its own connection(s).
Send = Callable[[], Awaitable[int]]


async def lean_clients(url: str, n: int) -> tuple[list[Send], Callable[[], Awaitable[None]]]:
    conns = [HTTPConnection.from_url(url) for _ in range(n)]
    raw = prepare("POST", PATH, BODY, {"content-type": "application/json"}, host=url[7:])

    def sender(conn: HTTPConnection) -> Send:
        async def send() -> int:
            return (await conn.send(raw)).status

        return send

    async def close() -> None:
        await asyncio.gather(*(c.aclose() for c in conns))

    return [sender(c) for c in conns], close


async def httpx_clients(url: str, n: int) -> tuple[list[Send], Callable[[], Awaitable[None]]]:
    import httpx

    client = httpx.AsyncClient(
        base_url=url, limits=httpx.Limits(max_connections=n, max_keepalive_connections=n)
    )
    headers = {"content-type": "application/json"}

    async def send() -> int:
        return (await client.post(PATH, content=BODY, headers=headers)).status_code

    return [send] * n, client.aclose


async def aiohttp_clients(url: str, n: int) -> tuple[list[Send], Callable[[], Awaitable[None]]]:
    import aiohttp

    session = aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=n))
    headers = {"content-type": "application/json"}

    async def send() -> int:
        async with session.post(PATH, data=BODY, headers=headers) as resp:
            await resp.read()
            return resp.status

    return [send] * n, session.close


CLIENTS = {"loadgen.http": lean_clients, "httpx": httpx_clients, "aiohttp": aiohttp_clients}


async def measure(name: str, url: str, concurrency: int, duration_s: float) -> dict[str, Any]:
    senders, close = await CLIENTS[name](url, concurrency)
    hist = LatencyHistogram()
    errors = 0

    async def worker(send: Send, until: float, record: bool) -> None:
        nonlocal errors
        while (t := time.perf_counter()) < until:
            status = await send()
            if record:
                hist.record(time.perf_counter() - t)
                errors += status != 200

    try:
        # Warm-up: connections open, pools and caches warm.
        warm_until = time.perf_counter() + 0.5
        await asyncio.gather(*(worker(s, warm_until, False) for s in senders))
        cpu0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker(s, t0 + duration_s, True) for s in senders))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    finally:
        await close()
    return {
        "client": name,
        "concurrency": concurrency,
        "requests": hist.count,
        "errors": errors,
        "rps": hist.count / wall,
        "client_cpu_us_per_request": cpu / hist.count * 1e6,
        "client_cpu_share": cpu / wall,
        "p50_ms": hist.percentile(50) * 1e3,
        "p99_ms": hist.percentile(99) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="1,16", help="concurrencies, comma-separated")
    parser.add_argument("--duration", type=float, default=3.0, help="measured seconds per run")
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:  # the server process
        run_loop(serve(args.serve))
        return
    levels = [int(c) for c in args.levels.split(",")]
    clients = ["loadgen.http", "httpx"]
    try:
        import aiohttp  # noqa: F401

        clients.append("aiohttp")
    except ImportError:
        print("aiohttp is not installed: not measured", file=sys.stderr)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        url = f"http://127.0.0.1:{port}"
        rows = [run_loop(measure(name, url, c, args.duration)) for c in levels for name in clients]
    finally:
        server.terminate()
        server.wait(10)
    print(
        markdown_table(
            ["client", "C", "req/s", "client CPU µs/request", "client CPU share", "P50 ms"],
            [
                [
                    r["client"],
                    r["concurrency"],
                    f"{r['rps']:,.0f}",
                    f"{r['client_cpu_us_per_request']:.0f}",
                    f"{r['client_cpu_share']:.0%}",
                    f"{r['p50_ms']:.3f}",
                ]
                for r in rows
            ],
        )
    )
    path = save(
        "http_clients",
        {
            "duration_s": args.duration,
            "results": rows,
        },
    )
    print(f"\nsaved {path}")


if __name__ == "__main__":
    main()
