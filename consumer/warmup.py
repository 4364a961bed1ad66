"""Warm-up: model calls made after a version loads and before it serves, so the first requests do
not pay for lazy initialisation (ONNX Runtime's memory arena and kernel choices, torch's first
dispatch, the tokenizer's caches).

Inputs come from the config's ``[warmup]`` table: one call per entry of ``batch_sizes``; BYTES
inputs take the sample ``texts`` (cycled to fill the batch), other inputs zeros. Calls go through
``backend.predict`` of the backend ``create_backend`` built, so a model with a pre-processing
stage is warmed through the whole path, and their outputs are checked against the config: a
version that returns the wrong shape or dtype never serves.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from consumer.backends.base import Arrays, Backend, BackendError, check_outputs, zeros_like_spec
from consumer.repository import ModelConfig
from protocol.tensor import BYTES, DTYPES


def warmup_inputs(config: ModelConfig, rows: int) -> Arrays | None:
    """One batch of ``rows`` rows for every input, or None when a BYTES input has no samples."""
    inputs: Arrays = {}
    for spec in config.inputs:
        dims = tuple(d if d > 0 else 1 for d in spec.shape[1:])
        if spec.datatype == BYTES:
            if not config.warmup.texts:
                return None
            count = rows * math.prod(dims)
            texts = itertools.islice(itertools.cycle(config.warmup.texts), count)
            column = np.empty(count, dtype=object)
            column[:] = [t.encode() for t in texts]
            inputs[spec.name] = column.reshape((rows, *dims))
        else:
            inputs[spec.name] = zeros_like_spec(spec.shape, rows, DTYPES[spec.datatype])
    return inputs


def warm_up(config: ModelConfig, version: str, backend: Backend) -> int:
    """Run the warm-up calls on a loaded backend; the number of calls made (0 when the model
    has a BYTES input and the config gives no sample texts). A failing call is a BackendError:
    a version that cannot run its warm-up should not serve."""
    calls = 0
    for rows in config.warmup.batch_sizes:
        inputs = warmup_inputs(config, rows)
        if inputs is None:
            return calls
        try:
            check_outputs(config.outputs, backend.predict(inputs), rows)
        except Exception as e:
            raise BackendError(
                f"model '{config.name}' version {version}: warm-up with {rows} rows failed: {e}"
            ) from e
        calls += 1
    return calls
