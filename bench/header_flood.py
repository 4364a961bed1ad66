"""The red team's header attack on a real gateway, before and after bounding headers (issue #21).

    python bench/header_flood.py [--connections 64] [--header-mib 32] [--root CHECKOUT]

Starts a private ``redis-server`` and one ``inferq gateway`` process (of ``--root``'s checkout:
another revision, for the before figure), then opens ``--connections`` connections that each
send a request line and up to ``--header-mib`` MiB of header lines, never the blank line nor the
body. Prints the gateway's resident memory before and after, and what the clients got: a status
(431 when bounded) or nothing (the gateway took every byte and kept them). No model is needed:
the headers never complete. Loopback only; each client sends a bounded number of bytes.
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, git_revision, save, wait_until
from inferq.redisserver import RedisServer, free_port

REQUEST_LINE = b"POST /v2/models/sim/infer HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n"
FLOOD_DEADLINE_S = 120.0


def header_lines(size: int) -> bytes:
    """``size`` bytes of complete header lines (no blank line: the block goes on)."""
    line = b"x-filler: " + b"a" * 1000 + b"\r\n"
    return (line * (size // len(line) + 1))[:size]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"process {pid} has no VmRSS")


def _read_until_closed(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def flood(port: int, connections: int, header_bytes: int) -> list[bytes | None]:
    """``connections`` clients that each send a request line and up to ``header_bytes`` of
    headers. Per client: what it got back before the gateway closed it (b"" when it was reset
    first), or None when the gateway took every byte without answering."""
    chunk = header_lines(64 * 1024)
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(connections)]
    sent = dict.fromkeys(socks, 0)
    got: dict[socket.socket, bytes] = {}
    for sock in socks:
        sock.sendall(REQUEST_LINE)
        sock.setblocking(False)
    try:
        deadline = time.monotonic() + FLOOD_DEADLINE_S
        while len(got) < len(socks) and time.monotonic() < deadline:
            pending = [s for s in socks if s not in got]
            sending = [s for s in pending if sent[s] < header_bytes]
            readable, writable, _ = select.select(pending, sending, [], 1.0)
            for sock in readable:
                sock.settimeout(10.0)
                try:
                    got[sock] = _read_until_closed(sock)
                except ConnectionResetError:
                    got[sock] = b""  # reset before its answer could be read
            for sock in writable:
                if sock in got:
                    continue
                try:
                    sent[sock] += sock.send(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    got[sock] = b""
            if not readable and not sending:
                break  # every byte taken and nothing answered: the gateway holds them all
    finally:
        for sock in socks:
            sock.close()
    return [got.get(sock) for sock in socks]


def gateway(root: Path, redis_url: str, port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "inferq", "gateway", "--redis", redis_url),
            *("--port", str(port), "--grpc-port", "0", "--log-level", "warning"),
        ],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--header-mib", type=int, default=32)
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to run")
    args = parser.parse_args()
    redis = RedisServer().start()
    port = free_port()
    proc = gateway(args.root.resolve(), redis.url, port)
    try:
        wait_until(
            lambda: socket.create_connection(("127.0.0.1", port)).close() is None,
            "the gateway to listen",
            timeout_s=60,
            proc=proc,
        )
        before = rss_bytes(proc.pid)
        started = time.monotonic()
        answers = flood(port, args.connections, args.header_mib * 1024 * 1024)
        seconds = time.monotonic() - started
        after = rss_bytes(proc.pid)
    finally:
        proc.terminate()
        proc.wait(15)
        redis.stop()
    outcomes = Counter(
        "kept every byte" if a is None else (a[9:12].decode() or "reset") for a in answers
    )
    result = {
        "checkout": git_revision(args.root.resolve()),
        "connections": args.connections,
        "header_mib": args.header_mib,
        "rss_before_mib": round(before / 2**20, 1),
        "rss_after_mib": round(after / 2**20, 1),
        "flood_s": round(seconds, 1),
        "clients": dict(outcomes),
    }
    print(result)
    save(f"header_flood-{result['checkout']}", result)


if __name__ == "__main__":
    main()
