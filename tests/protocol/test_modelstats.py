"""The workers' inference statistics: one codec, summed across workers, in Triton's JSON shape."""

from __future__ import annotations

import pytest

from protocol.envelope import pack
from protocol.errors import ProtocolError
from protocol.modelstats import STAGES, BatchStats, Duration, WorkerStatistics, summed


def _worker(rows: int, batches: int, *, last_ms: int = 1_000) -> WorkerStatistics:
    w = WorkerStatistics()
    v = w.version("digits", "1")
    v.inference_count, v.execution_count, v.last_inference_ms = rows, batches, last_ms
    v.success = Duration(rows, rows * 2_000_000)
    v.queue.record(0.001 * rows, count=rows)
    v.compute_infer = Duration(rows, rows * 500_000)
    v.batches[rows] = BatchStats(Duration(1, 10), Duration(batches, 500_000), Duration(1, 20))
    w.version("digits", "2").fail.record(0.25)
    return w


def test_statistics_decode_to_exactly_what_was_encoded() -> None:
    w = _worker(5, 2)
    assert WorkerStatistics.decode(w.encode()) == w
    assert WorkerStatistics.decode(WorkerStatistics().encode()) == WorkerStatistics()


def test_the_gateway_sums_the_workers_and_skips_what_does_not_decode() -> None:
    total = summed([_worker(5, 2).encode(), None, b"garbage", _worker(3, 1, last_ms=9).encode()])
    v1 = total.models["digits"]["1"]
    assert (v1.inference_count, v1.execution_count, v1.last_inference_ms) == (8, 3, 1_000)
    assert v1.success == Duration(8, 8 * 2_000_000)
    assert sorted(v1.batches) == [3, 5]
    assert total.models["digits"]["2"].fail == Duration(2, 500_000_000)


def test_the_json_is_tritons_model_statistics() -> None:
    doc = _worker(5, 2).models["digits"]["1"].json("digits", "1")
    assert set(doc) == {
        "name",
        "version",
        "last_inference",
        "inference_count",
        "execution_count",
        "inference_stats",
        "batch_stats",
    }
    assert set(doc["inference_stats"]) == {*STAGES, "cache_hit", "cache_miss"}
    assert doc["inference_stats"]["queue"] == {"count": 5, "ns": 5_000_000}
    assert doc["batch_stats"] == [
        {
            "batch_size": 5,
            "compute_input": {"count": 1, "ns": 10},
            "compute_infer": {"count": 2, "ns": 500_000},
            "compute_output": {"count": 1, "ns": 20},
        }
    ]


@pytest.mark.parametrize(
    "models",
    [
        [],
        {"m": []},
        {"m": {"1": [0, 0, 0, [], []]}},
        {"m": {"1": [-1, 0, 0, [[0, 0]] * 6, []]}},
        {"m": {"1": [0, 0, 0, [[0, 0]] * 6, [[1, [[0, 0], [0, 0]]]]]}},
        {"m": {"1": [True, 0, 0, [[0, 0]] * 6, []]}},
    ],
)
def test_malformed_statistics_are_refused(models) -> None:
    with pytest.raises(ProtocolError):
        WorkerStatistics.decode(pack([models]))
