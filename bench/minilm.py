"""minilm sentence embeddings: through `inferq up` (1 gateway, 1 worker) vs in-process.

    python bench/minilm.py [--duration 15] [--concurrency 32] [--batches 1,8,32,64,128]

In one run on this machine it measures:
1. the full system: closed-loop HTTP load at ``--concurrency``, one sentence per V2 request
   (BYTES, JSON), the cache bypassed, through the gateway, Redis and a worker that tokenises and
   batches (the model's config: ``max_batch`` 32, length-sorted groups of 8);
2. the ceiling: the same ONNX graph in one ONNX Runtime session configured as the worker's, fed
   pre-tokenised batches of each size in ``--batches``, each batch padded to its longest
   sentence (plain: no sorting), and again as the worker runs it (tokenising included, length-
   sorted groups of 8).

Sentences: bench/data/sentences.txt, 200 sentences of 4 to 51 words (mean 17) taken from the
Python language reference; every request and batch cycles through them in the same order. The
model is built from the weights package into a temporary repository first (a few seconds).
Prints sentences/s side by side and the ratio full system / best in-process; writes
bench/results/minilm.json. Loopback only; every loop is bounded in time and count.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, Service, closed_loop, rows_per_s, save, wait_for_quiet
from loadgen.http import PreparedRequest

SENTENCES = (ROOT / "bench" / "data" / "sentences.txt").read_text().splitlines()


def build(repo: Path) -> None:
    from inferq.examples import minilm

    (repo / "minilm").mkdir(parents=True)
    shutil.copy(ROOT / "models" / "minilm" / "config.toml", repo / "minilm")
    minilm.build(repo)


def requests() -> list[PreparedRequest]:
    """One request per sentence, cache bypassed."""
    return [
        PreparedRequest(
            "POST",
            "/v2/models/minilm/infer",
            json.dumps(
                {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [s]}]}
            ).encode(),
            {"content-type": "application/json", "cache-control": "no-cache"},
        )
        for s in SENTENCES
    ]


def column(start: int, rows: int) -> np.ndarray:
    out = np.empty(rows, dtype=object)
    out[:] = [SENTENCES[(start + i) % len(SENTENCES)].encode() for i in range(rows)]
    return out


def in_process(repo: Path, batches: list[int], seconds: float) -> dict[str, dict[int, float]]:
    """The ONNX session alone (pre-tokenised, padded to each batch's longest), and the
    worker's path (tokenising and length-sorted groups included), at each batch size."""
    from consumer.backends import create_backend
    from consumer.backends.onnx import OnnxBackend
    from consumer.preprocess import Tokenizer
    from consumer.repository import load_config

    config = load_config(repo, "minilm")
    assert config.preprocess is not None
    session = OnnxBackend(config, "1")
    session.load()
    tokenizer = Tokenizer(config, "1", config.preprocess)
    tokenizer.load()
    tokenised = {
        n: [tokenizer.pad(tokenizer.encode(column(i, n))) for i in range(0, len(SENTENCES), n)]
        for n in batches
    }

    worker = create_backend(config, "1")
    worker.load()
    out: dict[str, dict[int, float]] = {"session": {}, "worker_path": {}}
    for n in batches:
        batch = tokenised[n]

        def plain(done: int, n: int = n, batch: list[Any] = batch) -> object:
            return session.predict(batch[(done // n) % len(batch)])

        def worker_path(done: int, n: int = n) -> object:
            return worker.predict({"text": column(done, n)})

        out["session"][n] = rows_per_s(plain, n, seconds)
        out["worker_path"][n] = rows_per_s(worker_path, n, seconds)
        print(
            f"in-process batch {n:>3}: session {out['session'][n]:6.1f} sentences/s, "
            f"worker path {out['worker_path'][n]:6.1f}",
            flush=True,
        )
    worker.unload()
    session.unload()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of HTTP load")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--batches", default="1,8,32,64,128", help="in-process batch sizes")
    parser.add_argument("--seconds", type=float, default=5.0, help="per in-process batch size")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    repo = Path(tempfile.mkdtemp(prefix="inferq-bench-minilm-"))
    try:
        t0 = time.perf_counter()
        build(repo)
        print(f"built minilm in {time.perf_counter() - t0:.1f} s", flush=True)
        results: dict[str, Any] = {"sentences": len(SENTENCES)}
        wait_for_quiet()
        with Service("--model-repository", str(repo), "--models", "minilm") as svc:
            r = closed_loop(
                svc, requests(), concurrency=args.concurrency, duration_s=args.duration, warmup_s=3
            )
        results["system"] = {
            "concurrency": args.concurrency,
            "sentences_per_s": r.ok_rps,
            "errors": r.errors,
            **({k: r.latency_ms[k] for k in ("p50", "p90", "p99")} if r.latency_ms else {}),
        }
        print(
            f"inferq up, c={args.concurrency}: {r.ok_rps:.1f} sentences/s, "
            f"p50 {r.latency_ms['p50'] if r.latency_ms else float('nan'):.0f} ms, "
            f"errors {r.errors}",
            flush=True,
        )
        wait_for_quiet()
        ceiling = in_process(repo, batches, args.seconds)
        results["in_process"] = ceiling
    finally:
        shutil.rmtree(repo, ignore_errors=True)
    best_n = max(ceiling["session"], key=lambda n: ceiling["session"][n])
    best = ceiling["session"][best_n]
    system = results["system"]["sentences_per_s"]
    print("\nratios (measured side by side in this run):")
    print(
        f"  inferq up c={args.concurrency} / in-process session at its best batch ({best_n}): "
        f"{system / best:.2f}  ({system:.1f} vs {best:.1f} sentences/s)"
    )
    wp = max(ceiling["worker_path"].values())
    print(f"  inferq up / in-process worker path at its best batch: {system / wp:.2f}")
    results["ratio_system_to_best_session"] = system / best
    print(f"\nwrote {save('minilm', results)}")


if __name__ == "__main__":
    main()
