"""A worker's Triton-style statistics: counted per batch, in Triton's sense of each field."""

from __future__ import annotations

from consumer.stats import InferenceStats
from protocol.messages import InferResult, Status, Timings
from protocol.modelstats import Duration, WorkerStatistics


def result(status: Status, queued_ms: float, batch_wait_ms: float) -> InferResult:
    return InferResult("r", status, "m", "2", timings=Timings(queued_ms, batch_wait_ms, 1.0, 3))


def test_a_batch_counts_its_requests_rows_and_durations() -> None:
    stats = InferenceStats()
    ok, failed = Status.OK, Status.FAILED
    results = [result(ok, 4.0, 1.0), result(ok, 2.0, 0.0), result(failed, 1, 0)]
    stats.batch(results, [2, 1, 5], input_s=0.001, infer_s=0.004, output_s=0.002, ended_ms=77)
    v = stats.totals.models["m"]["2"]
    assert (v.inference_count, v.execution_count, v.last_inference_ms) == (3, 1, 77)
    assert v.queue == Duration(2, 7_000_000)  # 5 ms + 2 ms before the batch started
    assert v.compute_infer == Duration(2, 8_000_000)  # the batch's 4 ms, per successful request
    assert v.success == Duration(2, 7_000_000 + 2 * 7_000_000)
    assert v.fail == Duration(1, 1_000_000 + 7_000_000)
    assert list(v.batches) == [8]  # rows of the model call
    assert v.batches[8].compute_infer == Duration(1, 4_000_000)


def test_a_batch_that_failed_whole_is_no_execution_and_an_expiry_is_a_failure() -> None:
    stats = InferenceStats()
    failed = [result(Status.FAILED, 1.0, 0.0)]
    stats.batch(failed, [1], input_s=0, infer_s=0.01, output_s=0, ended_ms=5)
    stats.expired("m", "2", 0.5)
    v = stats.totals.models["m"]["2"]
    assert (v.execution_count, v.inference_count, v.batches) == (0, 0, {})
    assert v.fail.count == 2
    assert WorkerStatistics.decode(stats.encode()) == stats.totals


def test_a_batch_s_compute_durations_sum_as_one_record_per_successful_request() -> None:
    # Recorded once per batch (``Duration.record_each``), the sums are those of one
    # ``record`` per successful request, rounding included.
    stats = InferenceStats()
    ok, failed = Status.OK, Status.FAILED
    results = [result(ok, 1, 0), result(failed, 1, 0), result(ok, 1, 0), result(ok, 2, 0)]
    input_s, infer_s, output_s = 1.2345678e-4, 3.33333333e-3, 7.77777777e-7
    stats.batch(
        results, [1, 1, 1, 1], input_s=input_s, infer_s=infer_s, output_s=output_s, ended_ms=1
    )
    v = stats.totals.models["m"]["2"]
    for got, seconds in (
        (v.compute_input, input_s),
        (v.compute_infer, infer_s),
        (v.compute_output, output_s),
    ):
        expected = Duration()
        for _ in range(3):
            expected.record(seconds)
        assert got == expected
