"""What every real-peer server module shares: its command line, and the ONNX sessions and V2
encoding of ``bench/peer_servers.py`` (imported from there, so every server does the same work).

Each server module runs under its peer's own venv (``bench/realpeers/envs.py``) with the
repository on ``PYTHONPATH``; this module and ``bench.peer_servers`` import only the standard
library, numpy and onnxruntime at load time, which every peer venv has.

    <peer venv>/bin/python -m bench.realpeers.<peer>_server --port P --model NAME=ONNX ...
                           [--max-batch 32] [--window-ms 5]
"""

from __future__ import annotations

import argparse
import socket
from dataclasses import dataclass

from bench.peer_servers import answer, parse, session

__all__ = ["Options", "answer", "free_port", "options", "parse", "session"]


@dataclass(frozen=True)
class Options:
    port: int
    models: dict[str, str]
    """Model name to ONNX file."""
    max_batch: int
    window_ms: float


def options(description: str) -> Options:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--port", type=int, required=True, help="the V2 HTTP port")
    parser.add_argument(
        "--model", action="append", required=True, help="NAME=ONNX_FILE (repeatable)"
    )
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument(
        "--window-ms", type=float, default=5.0, help="the batching window, where the peer has one"
    )
    args = parser.parse_args()
    return Options(
        args.port, dict(m.split("=", 1) for m in args.model), args.max_batch, args.window_ms
    )


def free_port() -> int:
    """A free loopback port, for the side ports a peer opens besides its HTTP one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
