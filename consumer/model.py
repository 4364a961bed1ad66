"""One served model: its loaded versions and how a batch of requests becomes one model call.

Rows of all requests are concatenated along the batch axis, the model runs once, and each output
is split back per request. A model that returns a different number of rows than it was given
fails the whole batch with a clear error instead of handing rows to the wrong callers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from consumer.backends import Backend, create_backend
from consumer.repository import ModelConfig
from protocol.messages import InferRequest, InferResult, Status, Timings
from protocol.registry import ModelMetadata
from protocol.tensor import Tensor


class BatchFailed(Exception):
    """The model call for a batch failed; every request of the batch gets the message."""


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    results: list[InferResult]
    infer_s: float
    model_failed: bool = False
    """The model call itself failed (raised, or returned the wrong number of rows)."""


class ServedModel:
    """A model config with one loaded backend per version."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        device: str = "cpu",
        max_batch: int | None = None,
        flush_ms: float | None = None,
    ) -> None:
        self.config = config
        self.device = device
        self.max_batch = max_batch or config.max_batch
        self.flush_s = (config.flush_ms if flush_ms is None else flush_ms) / 1000
        self.backends: dict[str, Backend] = {}
        self.bisections = 0
        self._output_types = {o.name: o.datatype for o in config.outputs}

    @property
    def name(self) -> str:
        return self.config.name

    def metadata(self) -> ModelMetadata:
        return self.config.metadata(max_batch=self.max_batch)

    def load(self) -> None:
        for version in self.config.versions:
            backend = create_backend(self.config, version, device=self.device)
            backend.load()
            self.backends[version] = backend

    def unload(self) -> None:
        for backend in self.backends.values():
            backend.unload()
        self.backends.clear()

    def run(self, requests: Sequence[InferRequest], worker: str) -> BatchOutcome:
        """Run one batch (all of one version) as a single model call. Called off the event loop.

        When the call fails for a batch of several requests, the batch is split in halves and
        each half retried (bisection), so one poison input fails alone and the rest of its batch
        still succeeds, at the cost of about 2·log2(n) extra calls in that rare case.
        """
        outcome = self._run_once(requests, worker)
        if not outcome.model_failed or len(requests) == 1:
            return outcome
        self.bisections += 1
        middle = len(requests) // 2
        left = self.run(requests[:middle], worker)
        right = self.run(requests[middle:], worker)
        return BatchOutcome(
            left.results + right.results, outcome.infer_s + left.infer_s + right.infer_s
        )

    def _run_once(self, requests: Sequence[InferRequest], worker: str) -> BatchOutcome:
        version = requests[0].version
        backend = self.backends.get(version)
        if backend is None:
            return self._fail_all(requests, worker, f"version {version} is not loaded here", 0.0)
        counts = [rows_of(r) for r in requests]
        total = sum(counts)
        try:
            inputs = _concatenate(requests)
        except ValueError as e:
            return self._fail_all(requests, worker, f"inputs do not batch together: {e}", 0.0)
        started = time.perf_counter()
        try:
            outputs = backend.predict(inputs)
        except Exception as e:  # a model can raise anything; the batch must still be answered
            elapsed = time.perf_counter() - started
            failed = self._fail_all(requests, worker, f"model '{self.name}' failed: {e}", elapsed)
            return BatchOutcome(failed.results, elapsed, model_failed=True)
        elapsed = time.perf_counter() - started
        for name, arr in outputs.items():
            if arr.ndim == 0 or arr.shape[0] != total:
                got = "a scalar" if arr.ndim == 0 else f"{arr.shape[0]} rows"
                failed = self._fail_all(
                    requests,
                    worker,
                    f"model '{self.name}' returned {got} for output '{name}' given {total} rows",
                    elapsed,
                )
                return BatchOutcome(failed.results, elapsed, model_failed=True)
        timings = Timings(infer_ms=elapsed * 1000, batch_size=len(requests))
        results = []
        offset = 0
        for request, n in zip(requests, counts, strict=True):
            wanted = request.outputs or list(self._output_types)
            tensors = [
                Tensor.from_numpy(
                    name, outputs[name][offset : offset + n], self._output_types[name]
                )
                for name in wanted
            ]
            offset += n
            results.append(
                InferResult(
                    request.id,
                    Status.OK,
                    self.name,
                    version,
                    tensors,
                    worker=worker,
                    timings=timings,
                )
            )
        return BatchOutcome(results, elapsed)

    def _fail_all(
        self, requests: Sequence[InferRequest], worker: str, message: str, elapsed: float
    ) -> BatchOutcome:
        timings = Timings(infer_ms=elapsed * 1000, batch_size=len(requests))
        return BatchOutcome(
            [
                InferResult(
                    r.id,
                    Status.FAILED,
                    self.name,
                    r.version,
                    error=message,
                    worker=worker,
                    timings=timings,
                )
                for r in requests
            ],
            elapsed,
        )


def rows_of(request: InferRequest) -> int:
    return request.inputs[0].shape[0] if request.inputs and request.inputs[0].shape else 1


def batch_group(request: InferRequest) -> tuple[Any, ...]:
    """Requests batch together only with the same version and the same non-batch dimensions."""
    return (request.version, *((t.name, t.datatype, t.shape[1:]) for t in request.inputs))


def _concatenate(requests: Sequence[InferRequest]) -> dict[str, npt.NDArray[Any]]:
    if len(requests) == 1:
        return {t.name: t.to_numpy() for t in requests[0].inputs}
    columns: dict[str, list[npt.NDArray[Any]]] = {}
    for r in requests:
        for t in r.inputs:
            columns.setdefault(t.name, []).append(t.to_numpy())
    return {name: np.concatenate(parts, axis=0) for name, parts in columns.items()}
