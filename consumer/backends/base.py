"""The contract every model backend fulfils (MLServer's ``MLModel`` idea, synchronous).

``predict`` runs on a worker thread, or on the event loop for a model measured to be quick
(``consumer.inline``) when the backend allows it, so a backend may block; it must be safe to call
from one thread at a time (the worker never runs two batches of one model version at once).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from protocol.registry import TensorSpec
from protocol.tensor import BYTES, DTYPES

Arrays = dict[str, npt.NDArray[Any]]


class BackendError(Exception):
    """A model that cannot be loaded or run."""


class InvalidInput(BackendError):
    """One row of a batch is input the model cannot take (a client error, answered as such to
    the request that holds the row, not to its whole batch)."""

    def __init__(self, message: str, row: int) -> None:
        super().__init__(message)
        self.row = row
        """The row's index in the batch the backend was given."""


class BadOutput(BackendError):
    """What a model returned does not match the outputs its config declares."""


class Overran(BackendError):
    """A call ran past its deadline, this batch's or an earlier one that is still running: the
    batch fails whole, without bisection (its halves could not finish in time either)."""


class Backend(Protocol):
    may_run_inline: bool
    """False: never call ``predict`` on the event loop, however quick it was seen to be."""

    def load(self) -> None:
        """Load weights; raise BackendError if the model cannot serve. (Warm-up calls through the
        whole path come after, from ``consumer.warmup``.)"""

    def predict(self, inputs: Arrays, deadline: float | None = None) -> Arrays:
        """Run one batch: every input has the batch dimension first; so must every output.
        ``deadline`` (monotonic seconds): when the batch's callers stop waiting; a backend that
        can give up on a call then (the Python backend) raises ``Overran``, others ignore it."""

    def unload(self) -> None:
        """Release the model's memory."""


def zeros_like_spec(shape: tuple[int, ...], rows: int, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """An array for a declared shape with the batch dimension set and variable dims as 1."""
    return np.zeros((rows, *(d if d > 0 else 1 for d in shape[1:])), dtype=dtype)


def check_outputs(specs: Sequence[TensorSpec], outputs: Mapping[Any, Any], rows: int) -> None:
    """Raise ``BadOutput`` unless ``outputs`` holds exactly the declared outputs, each a numpy
    array of its declared datatype and shape with ``rows`` rows (the message names the output;
    the caller names the model)."""
    declared = {s.name: s for s in specs}
    extra = [n for n in outputs if n not in declared]
    if extra:
        raise BadOutput(
            f"returned output {extra[0]!r}, which config.toml does not declare "
            f"(it declares {', '.join(declared)})"
        )
    for spec in specs:
        name = spec.name
        if name not in outputs:
            raise BadOutput(f"returned no output '{name}'")
        arr = outputs[name]
        if not isinstance(arr, np.ndarray):
            raise BadOutput(f"returned a {type(arr).__name__} for output '{name}', not an array")
        if arr.ndim == 0 or arr.shape[0] != rows:
            got = "a scalar" if arr.ndim == 0 else f"{arr.shape[0]} rows"
            raise BadOutput(f"returned {got} for output '{name}' given {rows} rows")
        if arr.ndim != len(spec.shape) or any(
            want > 0 and want != have
            for want, have in zip(spec.shape[1:], arr.shape[1:], strict=True)
        ):
            raise BadOutput(
                f"returned shape {list(arr.shape)} for output '{name}'; config.toml declares "
                f"{list(spec.shape)}"
            )
        if not _holds(arr, spec.datatype):
            raise BadOutput(
                f"returned dtype {arr.dtype} for output '{name}'; config.toml declares "
                f"{spec.datatype}"
                + (f" ({DTYPES[spec.datatype]})" if spec.datatype in DTYPES else "")
            )


def _holds(arr: npt.NDArray[Any], datatype: str) -> bool:
    """Whether ``arr`` is of ``datatype``: BYTES is bytes or str, as a numpy string array or an
    object array of them."""
    if datatype != BYTES:
        return bool(arr.dtype == DTYPES[datatype])
    if arr.dtype.kind in "SU":
        return True
    return arr.dtype.kind == "O" and all(isinstance(e, bytes | str) for e in arr.flat)
