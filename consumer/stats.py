"""In-process counters of one worker: for tests and log lines (``WorkerStats``; Prometheus has
its own), and the Triton-style statistics it publishes with its heartbeat (``InferenceStats``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from protocol.messages import InferResult, Status
from protocol.modelstats import BatchStats, WorkerStatistics

EXECUTED_KEPT = 100_000


class InferenceStats:
    """Per model version: requests, rows, batches and where their time went, in Triton's terms
    (``protocol.modelstats``). Counted on the event loop once per batch (never per request in
    Redis); the advertiser publishes ``encode()`` with every heartbeat."""

    def __init__(self) -> None:
        self.totals = WorkerStatistics()

    def batch(
        self,
        results: Sequence[InferResult],
        rows: Sequence[int],
        *,
        input_s: float,
        infer_s: float,
        output_s: float,
        ended_ms: int,
    ) -> None:
        """One batch's results (one version), each request's rows, the batch's durations."""
        if not results:
            return
        first = results[0]
        stats = self.totals.version(first.model, first.version)
        compute_s = input_s + infer_s + output_s
        succeeded = 0
        for result, n in zip(results, rows, strict=True):
            waited_s = (result.timings.queued_ms + result.timings.batch_wait_ms) / 1000
            if result.status is not Status.OK:
                stats.fail.record(waited_s + compute_s)
                continue
            succeeded += 1
            stats.inference_count += n
            stats.success.record(waited_s + compute_s)
            stats.queue.record(waited_s)
        if not succeeded:
            return
        # The batch's compute durations count once per successful request (Triton's terms).
        stats.compute_input.record_each(input_s, succeeded)
        stats.compute_infer.record_each(infer_s, succeeded)
        stats.compute_output.record_each(output_s, succeeded)
        stats.execution_count += 1
        stats.last_inference_ms = max(stats.last_inference_ms, ended_ms)
        size = stats.batches.setdefault(sum(rows), BatchStats())
        size.compute_input.record(input_s)
        size.compute_infer.record(infer_s)
        size.compute_output.record(output_s)

    def expired(self, model: str, version: str, waited_s: float) -> None:
        """A request dropped unrun at its deadline: a failure, after ``waited_s`` queued."""
        self.totals.version(model, version).fail.record(waited_s)

    def encode(self) -> bytes:
        return self.totals.encode()


@dataclass
class WorkerStats:
    """Counters for tests and logs; recent batch sizes and executed ids are kept bounded."""

    batches: int = 0
    inline_batches: int = 0
    """Batches run on the event loop instead of the model's thread (``consumer.inline``)."""
    requests: int = 0
    expired: int = 0
    failed: int = 0
    dead_lettered: int = 0
    skipped_jobs: int = 0
    """Jobs read but not run: cancelled, expired or already finished."""
    jobs_run_again: int = 0
    """Jobs found running under a lapsed lease, or under this worker's own lost claim, and run
    again (``consumer.leases``)."""
    cancelled: int = 0
    """Requests dropped unrun because their callers had gone (``protocol.cancellation``)."""
    recreated: int = 0
    """Times a request stream or the consumer group had vanished and was created again."""
    batch_sizes: deque[int] = field(default_factory=lambda: deque(maxlen=10_000))
    executed: deque[str] = field(default_factory=lambda: deque(maxlen=EXECUTED_KEPT))
    """Ids of recently executed requests, newest last."""
    inference: InferenceStats = field(default_factory=InferenceStats)
    """What ``GET /v2/models/{m}/stats`` sums over the workers."""
