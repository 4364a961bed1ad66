"""The V2 JSON request parse alone (``producer.v2_request.parse_infer_request``), in-process.

    python bench/v2_parse.py [--seconds 2] [--other CHECKOUT]

Microseconds per call on the digits request bench/peers.py sends (one row of 64 FP32 values,
cache off), JSON and binary. With ``--other`` the same is timed on another checkout's module in a
child process, alternately, three times each, so both meet the same machine (issue #27's A/B).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def time_parse(seconds: float, root: Path) -> dict[str, float]:
    """µs per parse of the module in checkout ``root``."""
    sys.path.insert(0, str(root))
    from bench.peers import request
    from producer.v2_request import parse_infer_request
    from protocol.registry import ModelMetadata, TensorSpec

    model = ModelMetadata(
        name="digits",
        versions=("1",),
        default_version="1",
        platform="onnxruntime_onnx",
        inputs=(TensorSpec("input", "FP32", (-1, 64)),),
        outputs=(TensorSpec("logits", "FP32", (-1, 10)), TensorSpec("label", "INT64", (-1,))),
        max_batch=64,
        default_timeout_ms=1000,
        cache_enabled=False,
        cache_ttl_s=0,
    )
    out = {}
    for kind, binary in (("json", False), ("binary", True)):
        body, headers = request("digits", binary)
        length = headers.get("inference-header-content-length")
        n_length = int(length) if length else None
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            for _ in range(1000):
                parse_infer_request(body, n_length, model)
            n += 1000
        out[kind] = round((time.perf_counter() - start) / n * 1e6, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--other", type=Path, help="another checkout, timed alternately")
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.other is None:
        print(json.dumps(time_parse(args.seconds, args.root)))
        return
    runs: dict[str, list[dict[str, float]]] = {"this": [], "other": []}
    for i in range(6):
        which = ("this", "other")[(i + i // 2) % 2]  # this, other; other, this; this, other
        root = ROOT if which == "this" else args.other.resolve()
        argv = [sys.executable, __file__, "--root", str(root), "--seconds", str(args.seconds)]
        done = subprocess.run(argv, cwd=root, capture_output=True, text=True, check=True)
        runs[which].append(json.loads(done.stdout))
    for which, rows in runs.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"{which}: µs per parse (median of 3) {med}; runs {rows}")


if __name__ == "__main__":
    main()
