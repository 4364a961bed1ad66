"""Models loaded on demand: the first request to a model no worker holds (it waits for the load)
against warm requests, and the memory each loaded model adds to its worker.

    python bench/on_demand.py [--rounds 10] [--warm 20]

Starts `inferq up` with one worker, `--load on-demand --max-loaded-models 1`, over a repository
of digits (ONNX), digits-b (a copy of it) and digits-png (the Python backend). Each round sends
one request to digits, then ``--warm`` more, then the same to digits-b: with room for one model,
every first request of a round finds its model unloaded (the other one evicted it), so it waits
for the worker to notice it (the backlog snapshot and the on-demand poll) and load it. Prints
the P50/P99 of first and warm requests side by side, the load time the worker measured
(`inferq_worker_model_load_seconds`), and each model's resident bytes at load
(`inferq_worker_model_resident_bytes`), read from the worker's metrics port. Real models;
loopback only; every loop bounded by count.
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prometheus_client.parser import text_string_to_metric_families

from bench.common import DIGITS_SAMPLES, ROOT, Service, digits_body, markdown_table, save
from inferq.redisserver import free_port

PNG = ROOT / "models" / "digits-png" / "1" / "samples" / "3.png"


def prepare(repo: Path, *, minilm: bool) -> None:
    if minilm:
        from bench.minilm import build

        build(repo)
    ignore = shutil.ignore_patterns("train.py", "__pycache__", "*.py[co]")
    copies = {"digits": "digits", "digits-b": "digits", "digits-png": "digits-png"}
    for name, source in copies.items():
        shutil.copytree(ROOT / "models" / source, repo / name, ignore=ignore)


def infer(url: str, model: str, body: dict[str, Any]) -> float:
    """One request (bypassing the cache); its latency in ms. Fails on anything but 200."""
    request = urllib.request.Request(
        f"{url}/v2/models/{model}/infer",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "cache-control": "no-cache"},
        method="POST",
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=60) as r:
        r.read()
        assert r.status == 200
    return (time.perf_counter() - started) * 1000


def text_body() -> dict[str, Any]:
    text = "Models load on their first request."
    return {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [text]}]}


def png_body() -> dict[str, Any]:
    image = base64.b64encode(PNG.read_bytes()).decode()
    return {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "data": [image]}]}


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("inferq_worker_model") or s.name == "inferq_worker_loaded_models"
    }


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warm", type=int, default=20)
    parser.add_argument(
        "--no-minilm", action="store_true", help="leave out minilm (built from its weights package)"
    )
    args = parser.parse_args()
    repo = Path(tempfile.mkdtemp(prefix="inferq-ondemand-"))
    metrics_port = free_port()
    row = DIGITS_SAMPLES["inputs"][0]
    first: dict[str, list[float]] = {"digits": [], "digits-b": []}
    warm: dict[str, list[float]] = {"digits": [], "digits-b": []}
    try:
        prepare(repo, minilm=not args.no_minilm)
        extra = ("--model-repository", str(repo), "--load", "on-demand")
        extra += ("--max-loaded-models", "1", "--metrics-port", str(metrics_port))
        with Service(*extra) as service:
            # Each model's first load, in this order (the first one also pays for importing
            # its runtime): its first request, the load the worker measured, its memory.
            resident: dict[str, float] = {}
            first_load: dict[str, dict[str, float]] = {}
            order = [
                ("digits-png", png_body()),
                ("digits", digits_body(row)),
                ("digits-b", digits_body(row)),
            ]
            if not args.no_minilm:
                order.append(("minilm", text_body()))
            for model, body in order:
                latency = infer(service.url, model, body)
                warm_ms = statistics.median(infer(service.url, model, body) for _ in range(10))
                seen = scrape(metrics_port)
                labels = (("model", model),)
                resident[model] = seen.get(("inferq_worker_model_resident_bytes", labels), 0.0)
                first_load[model] = {
                    "first_request_ms": latency,
                    "warm_p50_ms": warm_ms,
                    "worker_load_ms": 1000
                    * seen.get(("inferq_worker_model_load_seconds_sum", labels), 0.0),
                    "resident_mib": resident[model] / 2**20,
                }
            for _ in range(args.rounds):
                for model in ("digits", "digits-b"):
                    first[model].append(infer(service.url, model, digits_body(row)))
                    for _ in range(args.warm):
                        warm[model].append(infer(service.url, model, digits_body(row)))
            final = scrape(metrics_port)
    finally:
        shutil.rmtree(repo, ignore_errors=True)

    def metric(name: str, **labels: str) -> float:
        return final.get((name, tuple(sorted(labels.items()))), 0.0)

    loads = {m: metric("inferq_worker_model_loads_total", model=m) for m in first}
    load_ms = {
        m: 1000
        * metric("inferq_worker_model_load_seconds_sum", model=m)
        / max(1.0, metric("inferq_worker_model_load_seconds_count", model=m))
        for m in first
    }
    cold = first["digits"] + first["digits-b"]
    hot = warm["digits"] + warm["digits-b"]
    result = {
        "rounds": args.rounds,
        "warm_per_round": args.warm,
        "first_ms": {"p50": pct(cold, 0.5), "p99": pct(cold, 0.99), "n": len(cold)},
        "warm_ms": {"p50": pct(hot, 0.5), "p99": pct(hot, 0.99), "n": len(hot)},
        "first_over_warm_p50": pct(cold, 0.5) / pct(hot, 0.5),
        "worker_load_ms_mean": load_ms,
        "loads": loads,
        "unloads_budget": {
            m: metric("inferq_worker_model_unloads_total", model=m, reason="budget") for m in first
        },
        "first_loads": first_load,
        "first_ms_mean": statistics.mean(cold),
    }
    print(
        markdown_table(
            ["requests", "n", "P50 ms", "P99 ms"],
            [
                ["first (model loaded on demand)", len(cold), pct(cold, 0.5), pct(cold, 0.99)],
                ["warm", len(hot), pct(hot, 0.5), pct(hot, 0.99)],
            ],
        )
    )
    print(
        markdown_table(
            ["model (first load, in order)", "first request ms", "warm P50 ms", "load ms", "MiB"],
            [
                [m, v["first_request_ms"], v["warm_p50_ms"], v["worker_load_ms"], v["resident_mib"]]
                for m, v in first_load.items()
            ],
        )
    )
    print(json.dumps(result, indent=2))
    print("saved", save("on_demand", result))


if __name__ == "__main__":
    main()
