"""The Python backend's cost beside the ONNX backend, serving the same graph.

    python bench/python_backend.py [--duration 5] [--repeats 3] [--iterations 3000]

Two models serve the digits network (``models/digits/1/model.onnx``, 7 us a row): ``digits``
with the ONNX backend, and ``digits-py`` with the Python backend, whose ``model.py`` calls an
ONNX Runtime session on the same file with the same options directly (no decoding, nothing but
the call), so every difference is the Python backend's own cost. Two measurements, in one run,
alternating the two models (``--repeats`` rounds; medians reported):

1. **The batch path in-process**: ``ServedModel.run`` (concatenate the requests, the model call,
   the output checks, split the results) for batches of 1 and of 32 one-row requests, called as
   the worker calls it: the ONNX model inline on an event loop (the worker runs a model this
   quick there, ``consumer/inline.py``) and through the model's executor thread; the Python
   model through the executor thread (it never runs inline), which hands the call on to the
   version's own thread. CPU per request from ``time.process_time`` over ``--iterations``
   batches: every thread of the process counted, nothing else.
2. **Through ``inferq up``** (1 gateway, 1 worker, a private redis-server; real HTTP): a closed
   loop at c=1 with ``--max-batch 1`` and at c=64 with ``--max-batch 32``, cache bypassed; the
   worker's CPU per request from /proc over the worker's own request count (its metrics), and
   the mean batch it formed.

Prints tables and the ratios, writes bench/results/python_backend.json (and the summary).
Loopback only; bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from bench.common import (
    DIGITS_SAMPLES,
    ROOT,
    Service,
    closed_loop,
    cpu_seconds,
    digits_body,
    fmt,
    infer_request,
    markdown_table,
    save,
    wait_for_quiet,
)
from consumer.model import ServedModel
from consumer.repository import load_config
from inferq.redisserver import free_port
from protocol.messages import InferRequest
from protocol.tensor import Tensor

MODELS = ("digits", "digits-py")
BATCHES = (1, 32)
MODEL_PY = '''
import onnxruntime as ort


class DigitsDirect:
    """The digits graph, called directly: what the ONNX backend does, as user code."""

    def load(self, config, device):
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        path = str(config.folder / "model.onnx")
        cpu = ["CPUExecutionProvider"]
        self.session = ort.InferenceSession(path, sess_options=options, providers=cpu)

    def predict(self, inputs):
        logits, label = self.session.run(["logits", "label"], inputs)
        return {"logits": logits, "label": label}
'''


@contextmanager
def repository() -> Iterator[Path]:
    """``digits`` as shipped, and ``digits-py``: the same graph behind the Python backend."""
    repo = Path(tempfile.mkdtemp(prefix="inferq-bench-python-"))
    try:
        digits = ROOT / "models" / "digits"
        shutil.copytree(digits, repo / "digits", ignore=shutil.ignore_patterns("train.py"))
        (repo / "digits-py" / "1").mkdir(parents=True)
        shutil.copy(digits / "1" / "model.onnx", repo / "digits-py" / "1" / "model.onnx")
        (repo / "digits-py" / "1" / "model.py").write_text(MODEL_PY)
        config = (digits / "config.toml").read_text()
        config = config.replace('backend = "onnx"\nplatform = "onnxruntime_onnx"\n', "")
        (repo / "digits-py" / "config.toml").write_text('backend = "python"\n' + config)
        yield repo
    finally:
        shutil.rmtree(repo, ignore_errors=True)


def requests(model: str, n: int) -> list[InferRequest]:
    rows = DIGITS_SAMPLES["inputs"]
    return [
        InferRequest(
            id=f"r{i}",
            model=model,
            version="1",
            inputs=[Tensor.from_numpy("input", np.array([rows[i % len(rows)]], np.float32))],
            outputs=None,
            deadline_ms=10**15,
            enqueued_ms=0,
            result_key="",
            result_ttl_ms=1,
        )
        for i in range(n)
    ]


def call_path_us(model: ServedModel, batch: int, inline: bool, iterations: int) -> float:
    """CPU (all threads) per request of ``iterations`` batches of ``batch`` requests, run as
    the worker's dispatcher runs them: inline, or through a one-thread executor."""
    reqs = requests(model.name, batch)
    executor = ThreadPoolExecutor(1)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for _ in range(iterations):
            deadline = time.monotonic() + 10
            if inline:
                outcome = model.run(reqs, "bench", None, deadline)
            else:
                outcome = await loop.run_in_executor(
                    executor, model.run, reqs, "bench", None, deadline
                )
            assert not outcome.failures, outcome.results[0].error

    asyncio.run(run())  # warm
    started = time.process_time()
    asyncio.run(run())
    used = time.process_time() - started
    executor.shutdown()
    return used / (iterations * batch) * 1e6


def in_process(repo: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    served = {}
    for name in MODELS:
        served[name] = ServedModel(load_config(repo, name))
        served[name].load()
    paths = [("digits", True), ("digits", False), ("digits-py", False)]
    samples: dict[tuple[str, bool, int], list[float]] = {}
    for _ in range(args.repeats):
        for batch in BATCHES:
            for name, inline in paths:
                iterations = max(50, args.iterations // batch)
                us = call_path_us(served[name], batch, inline, iterations)
                samples.setdefault((name, inline, batch), []).append(us)
    for model in served.values():
        model.unload()
    rows = []
    for (name, inline, batch), values in samples.items():
        rows.append(
            {
                "model": name,
                "path": "inline" if inline else "executor thread",
                "batch": batch,
                "cpu_us_per_request": statistics.median(values),
                "samples": values,
            }
        )
        print(
            f"in-process {name:<9} {rows[-1]['path']:<15} batch {batch:>2}: "
            f"{rows[-1]['cpu_us_per_request']:7.1f} us CPU/request",
            flush=True,
        )
    return rows


def scrape(port: int) -> dict[str, float]:
    """The worker's request count and batch-size sum and count, summed over labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for name in (
        "inferq_worker_requests_total",
        "inferq_worker_batch_requests_sum",
        "inferq_worker_batch_requests_count",
    ):
        out[name] = sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))
    return out


def through_up(repo: Path, model: str, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    concurrency = 1 if batch == 1 else 2 * batch
    port = free_port()
    extra = (
        "--model-repository",
        str(repo),
        "--models",
        model,
        "--max-batch",
        str(batch),
        "--metrics-port",
        str(port),
    )
    idle = wait_for_quiet()
    with Service(*extra) as svc:
        svc.wait_for_workers(model, 1)
        (worker,) = [pid for pid, role in svc.processes().items() if role == "worker"]
        before, cpu_before = scrape(port), cpu_seconds(worker)
        result = closed_loop(
            svc,
            infer_request(model, digits_body()),
            concurrency=concurrency,
            duration_s=args.duration,
            warmup_s=args.warmup,
        )
        after, cpu_after = scrape(port), cpu_seconds(worker)
    served = after["inferq_worker_requests_total"] - before["inferq_worker_requests_total"]
    batches = (
        after["inferq_worker_batch_requests_count"] - before["inferq_worker_batch_requests_count"]
    )
    in_batches = (
        after["inferq_worker_batch_requests_sum"] - before["inferq_worker_batch_requests_sum"]
    )
    row = {
        "model": model,
        "max_batch": batch,
        "concurrency": concurrency,
        "rps": result.ok_rps,
        "p50_ms": result.latency_ms["p50"],
        "errors": result.errors,
        "worker_requests": served,
        "mean_batch": in_batches / batches if batches else None,
        "worker_cpu_us_per_request": (cpu_after - cpu_before) / served * 1e6 if served else None,
        "machine_idle_before": idle,
    }
    print(
        f"inferq up   {model:<9} c={concurrency:<3} max_batch {batch:>2}: {result.ok_rps:7,.0f} "
        f"req/s, mean batch {fmt(row['mean_batch'], 1)}, worker "
        f"{fmt(row['worker_cpu_us_per_request'], 1)} us CPU/request, errors {result.errors or 0}",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds measured per run")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3, help="rounds, models alternating")
    parser.add_argument("--iterations", type=int, default=3000, help="in-process batches of 1")
    parser.add_argument("--skip-up", action="store_true", help="the in-process part only")
    args = parser.parse_args()
    with repository() as repo:
        calls = in_process(repo, args)
        served: list[dict[str, Any]] = []
        if not args.skip_up:
            for i in range(args.repeats):
                order = MODELS if i % 2 == 0 else MODELS[::-1]
                for batch in BATCHES:
                    served += [through_up(repo, model, batch, args) for model in order]

    def median(rows: list[dict[str, Any]], key: str, **match: Any) -> float | None:
        values = [r[key] for r in rows if all(r[k] == v for k, v in match.items()) and r[key]]
        return statistics.median(values) if values else None

    table1 = []
    for batch in BATCHES:
        onnx = median(calls, "cpu_us_per_request", model="digits", path="inline", batch=batch)
        hop = median(
            calls, "cpu_us_per_request", model="digits", path="executor thread", batch=batch
        )
        py = median(calls, "cpu_us_per_request", model="digits-py", batch=batch)
        assert onnx and hop and py
        table1.append(
            [batch, fmt(onnx, 1), fmt(hop, 1), fmt(py, 1), f"+{py - onnx:.1f}", f"{py / onnx:.2f}x"]
        )
    print()
    print("The batch path in-process (CPU per request, all threads, median of rounds):\n")
    print(
        markdown_table(
            [
                "batch (requests)",
                "ONNX inline, µs",
                "ONNX on the executor thread, µs",
                "Python backend, µs",
                "Python - ONNX inline",
                "ratio",
            ],
            table1,
        )
    )
    summary: dict[str, Any] = {"in_process": calls, "through_up": served}
    if served:
        table2 = []
        for batch in BATCHES:
            onnx = median(served, "worker_cpu_us_per_request", model="digits", max_batch=batch)
            py = median(served, "worker_cpu_us_per_request", model="digits-py", max_batch=batch)
            table2.append(
                [
                    batch,
                    fmt(median(served, "mean_batch", model="digits", max_batch=batch), 1),
                    fmt(median(served, "mean_batch", model="digits-py", max_batch=batch), 1),
                    fmt(onnx, 1),
                    fmt(py, 1),
                    f"+{py - onnx:.1f}" if onnx and py else "-",
                    f"{py / onnx:.2f}x" if onnx and py else "-",
                ]
            )
        print("\nThrough inferq up (worker CPU per request, median of rounds):\n")
        print(
            markdown_table(
                [
                    "max_batch",
                    "mean batch, ONNX",
                    "mean batch, Python",
                    "ONNX worker, µs",
                    "Python worker, µs",
                    "Python - ONNX",
                    "ratio",
                ],
                table2,
            )
        )
    path = save("python_backend", summary)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
