"""A stand-in for an accelerator: batch latency ``base_ms + per_row_ms * rows``.

This backend computes nothing useful. It exists so tests and benchmarks can model a GPU-like cost
curve (a large fixed cost per call, a small cost per row) on CPU-only machines: it sleeps on its
worker thread, which costs no CPU, so several simulated workers on a 2-core machine behave like
several accelerators would (a model quicker than ``consumer.inline.INLINE_MAX_S`` runs on the
event loop instead, as any model does). Figures measured with it show what the queueing and
batching layers do, not what any real model achieves.

Each output row is filled with the sum of the first input's row (as float), so tests can check
that results are split back to the right requests. ``failure_rate`` makes a call raise;
``crash_value`` makes the whole worker process exit at once (like a segfault in a native
library) when any input element equals it, so the chaos tests can model a poison input.
``executions_dir`` makes every call append the first element of each row it ran to a file of
its own process in that folder (``{pid}.rows``), once the call has finished: the chaos tests
count from it how often each request really ran, across processes and crashes.
"""

from __future__ import annotations

import os
import random
import threading
import time

import numpy as np

from consumer.backends.base import Arrays, BackendError, zeros_like_spec
from consumer.repository import ModelConfig
from protocol.exits import EXIT_LOOP_FAILED
from protocol.tensor import DTYPES


class SimulatedBackend:
    may_run_inline = True

    def __init__(self, config: ModelConfig, version: str) -> None:
        self.config = config
        self.version = version
        self.calls = 0
        self._random = random.Random(config.simulated.seed)
        self._lock = threading.Lock()

    def load(self) -> None:
        if self.config.inputs[0].datatype == "BYTES":
            raise BackendError(f"model '{self.config.name}': simulated models need numeric inputs")
        time.sleep(self.config.simulated.load_ms / 1000)
        if self.config.simulated.executions_dir is not None:
            self.config.simulated.executions_dir.mkdir(parents=True, exist_ok=True)

    def latency_s(self, rows: int) -> float:
        sim = self.config.simulated
        jitter = self._random.uniform(-sim.jitter_ms, sim.jitter_ms) if sim.jitter_ms else 0.0
        return max(0.0, sim.base_ms + sim.per_row_ms * rows + jitter) / 1000

    def predict(self, inputs: Arrays, deadline: float | None = None) -> Arrays:
        first = inputs[self.config.inputs[0].name]
        rows = int(first.shape[0])
        crash = self.config.simulated.crash_value
        if crash is not None and bool((first == crash).any()):
            # No cleanup, no reply, no ack: exactly what a native crash leaves; the status the
            # supervisor restarts a process for.
            os._exit(EXIT_LOOP_FAILED)
        with self._lock:
            self.calls += 1
            fail = self._random.random() < self.config.simulated.failure_rate
            delay = self.latency_s(rows)
        time.sleep(delay)
        if fail:
            raise BackendError(f"model '{self.config.name}': simulated failure")
        self._record(first)
        sums = first.reshape(rows, -1).astype(np.float64).sum(axis=1)
        out: Arrays = {}
        for spec in self.config.outputs:
            arr = zeros_like_spec(spec.shape, rows, DTYPES.get(spec.datatype, np.dtype("<f4")))
            arr[...] = sums.reshape((rows,) + (1,) * (arr.ndim - 1)).astype(arr.dtype)
            out[spec.name] = arr
        return out

    def _record(self, first: np.ndarray) -> None:
        folder = self.config.simulated.executions_dir
        if folder is None or first.size == 0:
            return
        rows = first.reshape(first.shape[0], -1)[:, 0]
        text = "".join(f"{float(v)!r}\n" for v in rows).encode()
        # One O_APPEND write per call: a process killed mid-call leaves no half-written line.
        fd = os.open(folder / f"{os.getpid()}.rows", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, text)
        finally:
            os.close(fd)

    def unload(self) -> None:
        pass
