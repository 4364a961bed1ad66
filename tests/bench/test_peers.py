"""bench/peers.py's pieces: the peers' micro-batcher and V2 handling, the requests it sends,
the medium model it writes, and how it turns runs into figures and verdicts."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from bench import medium_model, peers
from bench.peer_servers import MicroBatcher, answer, parse


class _Arg:
    def __init__(self, name: str) -> None:
        self.name = name


class CountingSession:
    """An ONNX Runtime stand-in: doubles its input, records the rows of every call."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def get_inputs(self) -> list[_Arg]:
        return [_Arg("input")]

    def get_outputs(self) -> list[_Arg]:
        return [_Arg("y")]

    def run(self, names: list[str], feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        self.calls.append(len(feed["input"]))
        return [feed["input"] * 2]


def test_the_batcher_fills_batches_to_max_and_answers_each_request_its_own_rows() -> None:
    sess = CountingSession()

    async def main() -> list[dict[str, np.ndarray]]:
        batcher = MicroBatcher(sess, max_batch=32, window_s=0.005)  # type: ignore[arg-type]
        task = asyncio.create_task(batcher.run())
        try:
            return await asyncio.gather(
                *(batcher.submit(np.full((1, 2), i, np.float32)) for i in range(40))
            )
        finally:
            task.cancel()

    results = asyncio.run(main())
    assert sess.calls == [32, 8]  # all 40 queued at once: one full batch, then the rest
    assert [r["y"].tolist() for r in results] == [[[2.0 * i, 2.0 * i]] for i in range(40)]


def test_a_lone_request_waits_out_the_window() -> None:
    sess = CountingSession()

    async def main() -> float:
        loop = asyncio.get_running_loop()
        batcher = MicroBatcher(sess, max_batch=32, window_s=0.05)  # type: ignore[arg-type]
        task = asyncio.create_task(batcher.run())
        try:
            t0 = loop.time()
            await batcher.submit(np.zeros((1, 2), np.float32))
            return loop.time() - t0
        finally:
            task.cancel()

    assert asyncio.run(main()) >= 0.05  # the tutorial design's cost at low load
    assert sess.calls == [1]


@pytest.mark.parametrize("binary", [False, True])
def test_peer_requests_and_answers_round_trip(binary: bool) -> None:
    body, headers = peers.request("digits", binary)
    x, want_binary = parse(body, headers.get("inference-header-content-length"))
    assert want_binary is binary
    assert np.array_equal(x, peers.sample("digits"))
    assert (
        json.loads(body[: int(headers.get("inference-header-content-length", len(body)))])[
            "parameters"
        ]["cache"]
        is False
    )
    outputs = {"logits": np.arange(10, dtype=np.float32).reshape(1, 10), "label": np.array([3])}
    out, header_length = answer("digits", outputs, binary)
    assert (header_length is not None) is binary
    decoded = peers.decode(out, str(header_length) if header_length else None)
    assert decoded["logits"].tolist() == outputs["logits"].tolist()
    assert decoded["label"].tolist() == [3]


def test_the_medium_model_has_its_layers_and_runs(tmp_path: Path) -> None:
    assert medium_model.parameters() == 12_540_904
    path = medium_model.write(tmp_path, layers=(8, 16, 16, 4))
    assert medium_model.parameters((8, 16, 16, 4)) == 8 * 16 + 16 + 16 * 16 + 16 + 16 * 4 + 4
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (y,) = sess.run(["logits"], {"input": np.ones((3, 8), np.float32)})
    assert y.shape == (3, 4) and np.isfinite(y).all()
    config = (tmp_path / "medium" / "config.toml").read_text()
    assert "shape = [-1, 8]" in config and "shape = [-1, 4]" in config
    assert "random weights" in config


def _run(target: str, c: int, rps: float, **extra: Any) -> dict[str, Any]:
    return {
        "model": extra.pop("model", "digits"),
        "target": target,
        "concurrency": c,
        "rps": rps,
        "p50_ms": extra.pop("p50_ms", 1.0),
        "p90_ms": 1.0,
        "p99_ms": extra.pop("p99_ms", 2.0),
        "errors": 0,
        "cpu_us_per_request": extra.pop("cpu", {"server": 100.0}),
        **extra,
    }


def test_rounds_are_summarised_by_their_median() -> None:
    rows = peers.median_rows([_run("fastapi", 16, r) for r in (900.0, 1000.0, 3000.0)])
    assert len(rows) == 1
    assert rows[0]["rps"] == 1000.0 and rows[0]["rps_runs"] == [900, 1000, 3000]


def test_verdicts_compare_the_targets_measured_in_the_same_run() -> None:
    inferq = {"gateway": 140.0, "worker": 80.0, "redis": 30.0}
    rows = [
        _run("batcher", 64, 2000.0),
        _run("inferq-json", 64, 2700.0, cpu=inferq, redis_commands_per_request=2.5),
        _run("fastapi", 16, 2000.0),
        _run("inferq-json", 16, 1900.0, cpu=inferq, redis_commands_per_request=3.0),
        _run(
            "inferq-json",
            1,
            900.0,
            p50_ms=0.9,
            p99_ms=2.5,
            cpu=inferq,
            redis_commands_per_request=4.2,
        ),
        _run("inferq-binary", 16, 900.0, model="medium", cpu=inferq),
        _run("inferq-binary", 64, 1000.0, model="medium", cpu=inferq),
    ]
    got = {
        v["target"]: (v["value"], v["met"])
        for v in peers.verdicts(rows, {"medium": {"batch32_rows_per_s": 3000.0}})
    }
    assert got["digits JSON c=64: inferq / batcher"] == (1.35, True)
    assert got["digits JSON c=16: inferq / FastAPI"] == (0.95, False)
    assert got["digits JSON c=1: P50 ms"] == (0.9, True)
    assert got["digits JSON c=1: P99 ms"] == (2.5, False)
    assert got["gateway CPU µs/request (digits JSON c=64)"] == (140.0, True)
    assert got["Redis commands/request c=64"] == (2.5, True)
    assert got["Redis commands/request c=1"] == (4.2, False)
    assert got["medium binary / in-process ceiling at batch 32"] == (0.333, True)
