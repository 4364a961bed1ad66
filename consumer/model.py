"""One served model: its loaded versions and how a batch of requests becomes one model call.

Rows of all requests are concatenated along the batch axis, the model runs once, and each output
is split back per request. A single request with more rows than ``max_batch`` runs as several
calls of at most ``max_batch`` rows, its outputs concatenated. Outputs are checked against the
config (``check_outputs``): a model that returns a different number of rows than it was given,
or an output of another shape or dtype, fails the whole batch with a clear error instead of
handing rows to the wrong callers. A row the backend rejects as invalid input (``InvalidInput``,
e.g. text that is not UTF-8) fails only its own request, as a client error, and the rest of the
batch runs again without it. A call that overran the batch's deadline (``Overran``) fails the
batch without bisection.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from consumer.backends import Backend, BadOutput, InvalidInput, Overran, create_backend
from consumer.backends.base import check_outputs
from consumer.repository import ModelConfig
from consumer.warmup import warm_up
from protocol.messages import InferRequest, InferResult, Status, Timings
from protocol.registry import ModelMetadata, TensorSpec
from protocol.tensor import Tensor

Waited = tuple[float, float]
"""Where a request's time went before its model call, in ms: (queued, waiting for its batch)."""


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    results: list[InferResult]
    infer_s: float
    model_failed: bool = False
    """The model call itself failed (raised, or returned the wrong number of rows)."""
    input_s: float = 0.0
    """Gathering the requests' inputs into the batch's arrays."""
    output_s: float = 0.0
    """Splitting the outputs back into each request's tensors."""

    @property
    def failures(self) -> bool:
        """Some request of the batch did not succeed (the model failed, or its input was
        invalid)."""
        return any(r.status is not Status.OK for r in self.results)


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
        self.device = config.device or device
        """The config's device if it names one, else the worker's."""
        self._max_batch_override = max_batch
        self._flush_ms_override = flush_ms
        self.max_batch, self.flush_s = self._batching(config)
        self.backends: dict[str, Backend] = {}
        """The versions served and advertised."""
        self.standby: dict[str, Backend] = {}
        """Loaded and warmed for a change not yet committed."""
        self.retiring: dict[str, Backend] = {}
        """Dropped by the last change; still answering requests routed to them before it."""
        self._output_types = {o.name: o.datatype for o in config.outputs}

    def _batching(self, config: ModelConfig) -> tuple[int, float]:
        """(max_batch, flush window in s): the config's, unless the worker's --max-batch /
        --flush-ms override them (a reload may change the config's; the overrides still win)."""
        flush_ms = config.flush_ms if self._flush_ms_override is None else self._flush_ms_override
        return self._max_batch_override or config.max_batch, flush_ms / 1000

    @property
    def name(self) -> str:
        return self.config.name

    def metadata(self) -> ModelMetadata:
        return self.config.metadata(max_batch=self.max_batch, flush_ms=self.flush_s * 1000)

    def load(self) -> None:
        """Load every version of the config (at start; later changes go through ``install``)."""
        backends: dict[str, Backend] = {}
        try:
            for version in self.config.versions:
                backends[version] = self.load_version(self.config, version)
        except Exception:
            for backend in backends.values():
                backend.unload()
            raise
        self.backends = backends

    def load_version(self, config: ModelConfig, version: str) -> Backend:
        """Load and warm one version without serving it yet. Called off the event loop, while
        the versions already installed keep serving."""
        backend = create_backend(config, version, device=self.device)
        backend.load()
        try:
            warm_up(config, version, backend)
        except Exception:
            backend.unload()
            raise
        return backend

    def stage(self, version: str, backend: Backend) -> None:
        """Hold a loaded, warmed version on standby: not advertised, but able to answer a
        request routed to it before this worker has seen the commit that installs it."""
        old = self.standby.pop(version, None)
        if old is not None and old is not backend:
            old.unload()
        self.standby[version] = backend

    def install(self, config: ModelConfig) -> None:
        """Serve ``config.versions`` from now on, from the versions loaded or on standby.
        Versions the new config drops keep answering what was already routed to them (the
        caller retires them later with ``take_retiring``)."""
        available = {**self.retiring, **self.backends, **self.standby}
        missing = [v for v in config.versions if v not in available]
        if missing:
            raise ValueError(f"model '{self.name}': versions {missing} are not loaded")
        backends = {v: available[v] for v in config.versions}
        for v in config.versions:
            self.standby.pop(v, None)
            self.retiring.pop(v, None)
        self.retiring.update({v: b for v, b in self.backends.items() if v not in backends})
        # Whole-dict assignments: a batch on the model's thread sees the old set or the new one.
        self.config = config
        self._output_types = {o.name: o.datatype for o in config.outputs}
        self.max_batch, self.flush_s = self._batching(config)
        self.backends = backends

    def discard_standby(self, keep: set[str] | None = None) -> list[Backend]:
        """Versions staged for a change that was aborted (all but ``keep``): the caller
        unloads them."""
        dropped = [v for v in self.standby if v not in (keep or set())]
        return [self.standby.pop(v) for v in dropped]

    def take_retiring(self, versions: set[str]) -> list[Backend]:
        return [self.retiring.pop(v) for v in list(self.retiring) if v in versions]

    def backend_for(self, version: str) -> Backend | None:
        return self.backends.get(version) or self.standby.get(version) or self.retiring.get(version)

    def may_run_inline(self, version: str) -> bool:
        """Whether a batch of ``version`` may run on the event loop when quick enough (one of
        a version not loaded here may: it fails at once)."""
        backend = self.backend_for(version)
        return backend is None or backend.may_run_inline

    def unload(self) -> None:
        for backend in (*self.backends.values(), *self.standby.values(), *self.retiring.values()):
            backend.unload()
        self.backends, self.standby, self.retiring = {}, {}, {}

    def run(
        self,
        requests: Sequence[InferRequest],
        worker: str,
        waited: Sequence[Waited] | None = None,
        deadline: float | None = None,
    ) -> BatchOutcome:
        """Run one batch (all of one version) as a single model call. Called off the event loop.
        ``deadline`` (monotonic): when the last of the batch's callers stops waiting.

        Each result is built once, complete: its timings are the request's ``waited`` (zeros
        when not given), the model call and the batch's size. When the call fails for a batch
        of several requests, the batch is split in halves and each half retried (bisection), so
        one poison input fails alone and the rest of its batch still succeeds, at the cost of
        about 2·log2(n) extra calls in that rare case.
        """
        waits = list(waited) if waited is not None else [(0.0, 0.0)] * len(requests)
        return self._bisect(requests, waits, _Stamp(self.name, worker, len(requests), deadline))

    def _bisect(
        self, requests: Sequence[InferRequest], waits: Sequence[Waited], stamp: _Stamp
    ) -> BatchOutcome:
        outcome = self._run_once(requests, waits, stamp)
        if not outcome.model_failed or len(requests) == 1:
            return outcome
        middle = len(requests) // 2
        left = self._bisect(requests[:middle], waits[:middle], stamp)
        right = self._bisect(requests[middle:], waits[middle:], stamp)
        return BatchOutcome(
            left.results + right.results,
            outcome.infer_s + left.infer_s + right.infer_s,
            input_s=outcome.input_s + left.input_s + right.input_s,
            output_s=left.output_s + right.output_s,
        )

    def _run_once(
        self, requests: Sequence[InferRequest], waits: Sequence[Waited], stamp: _Stamp
    ) -> BatchOutcome:
        version = requests[0].version
        backend = self.backend_for(version)
        if backend is None:
            return _fail_all(requests, waits, stamp, f"version {version} is not loaded here", 0.0)
        counts = [rows_of(r) for r in requests]
        total = sum(counts)
        gathering = time.perf_counter()
        try:
            inputs = _concatenate(requests)
        except ValueError as e:
            return _fail_all(requests, waits, stamp, f"inputs do not batch together: {e}", 0.0)
        started = time.perf_counter()
        input_s = started - gathering
        try:
            outputs = _predict(backend, inputs, total, self.max_batch, self.config.outputs, stamp)
        except InvalidInput as e:
            elapsed = time.perf_counter() - started
            return self._reject_row(requests, waits, stamp, counts, e, elapsed)
        except Overran as e:  # not bisected: no half of the batch could finish in time either
            elapsed = time.perf_counter() - started
            message = f"model '{self.name}' version {version}: {e}"
            return _fail_all(requests, waits, stamp, message, elapsed)
        except Exception as e:  # a model can raise anything; the batch must still be answered
            elapsed = time.perf_counter() - started
            why = f"version {version} {e}" if isinstance(e, BadOutput) else f"failed: {e}"
            failed = _fail_all(requests, waits, stamp, f"model '{self.name}' {why}", elapsed)
            return BatchOutcome(failed.results, elapsed, model_failed=True, input_s=input_s)
        splitting = time.perf_counter()
        elapsed = splitting - started
        results = []
        offset = 0
        for request, waited, n in zip(requests, waits, counts, strict=True):
            wanted = request.outputs or list(self._output_types)
            tensors = [
                Tensor.from_numpy(
                    name, outputs[name][offset : offset + n], self._output_types[name]
                )
                for name in wanted
            ]
            offset += n
            results.append(stamp.result(request, waited, Status.OK, elapsed, outputs=tensors))
        output_s = time.perf_counter() - splitting
        return BatchOutcome(results, elapsed, input_s=input_s, output_s=output_s)

    def _reject_row(
        self,
        requests: Sequence[InferRequest],
        waits: Sequence[Waited],
        stamp: _Stamp,
        counts: Sequence[int],
        error: InvalidInput,
        elapsed: float,
    ) -> BatchOutcome:
        """Answer the request that holds the invalid row as invalid (a client error), and run
        the rest of the batch again without it."""
        k, row = 0, error.row
        while k < len(counts) - 1 and row >= counts[k]:
            row -= counts[k]
            k += 1
        invalid = stamp.result(
            requests[k], waits[k], Status.INVALID, elapsed, error=f"{error} (row {row})"
        )
        rest = [*requests[:k], *requests[k + 1 :]]
        if not rest:
            return BatchOutcome([invalid], elapsed)
        outcome = self._run_once(rest, [*waits[:k], *waits[k + 1 :]], stamp)
        results = outcome.results
        return BatchOutcome(
            [*results[:k], invalid, *results[k:]],
            elapsed + outcome.infer_s,
            outcome.model_failed,
            input_s=outcome.input_s,
            output_s=outcome.output_s,
        )


@dataclass(frozen=True, slots=True)
class _Stamp:
    """What every result of one batch carries: its model, the worker, the batch's size; and
    what every model call for it shares: when its last caller stops waiting (monotonic)."""

    model: str
    worker: str
    batch_size: int
    deadline: float | None = None

    def result(
        self,
        request: InferRequest,
        waited: Waited,
        status: Status,
        infer_s: float,
        *,
        outputs: list[Tensor] | None = None,
        error: str | None = None,
    ) -> InferResult:
        return InferResult(
            request.id,
            status,
            self.model,
            request.version,
            [] if outputs is None else outputs,
            error,
            self.worker,
            Timings(waited[0], waited[1], infer_s * 1000, self.batch_size),
        )


def _fail_all(
    requests: Sequence[InferRequest],
    waits: Sequence[Waited],
    stamp: _Stamp,
    message: str,
    elapsed: float,
) -> BatchOutcome:
    return BatchOutcome(
        [
            stamp.result(r, waited, Status.FAILED, elapsed, error=message)
            for r, waited in zip(requests, waits, strict=True)
        ],
        elapsed,
    )


def _predict(
    backend: Backend,
    inputs: dict[str, npt.NDArray[Any]],
    rows: int,
    limit: int,
    specs: Sequence[TensorSpec],
    stamp: _Stamp,
) -> dict[str, npt.NDArray[Any]]:
    """One model call, its outputs checked against ``specs``; or, for more than ``limit``
    (``max_batch``) rows, which only a single request larger than ``max_batch`` brings, one call
    per ``limit`` rows with the outputs concatenated: the model never sees more rows than its
    ``max_batch`` allows, and the worker's peak memory stays that of one such call (a
    250,000-row request ran as one call before)."""
    if rows <= limit:
        out = backend.predict(inputs, stamp.deadline)
        check_outputs(specs, out, rows)
        return out
    parts: list[dict[str, npt.NDArray[Any]]] = []
    for start in range(0, rows, limit):
        chunk = {name: arr[start : start + limit] for name, arr in inputs.items()}
        try:
            out = backend.predict(chunk, stamp.deadline)
        except InvalidInput as e:
            raise InvalidInput(str(e), e.row + start) from e
        check_outputs(specs, out, min(limit, rows - start))
        parts.append(out)
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


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
