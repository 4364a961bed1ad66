"""The contract every model backend fulfils (MLServer's ``MLModel`` idea, synchronous).

``predict`` runs on a worker thread, never on the event loop, so a backend may block; it must be
safe to call from one thread at a time (the worker never runs two batches of one model version at
once).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

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


class Backend(Protocol):
    def load(self) -> None:
        """Load weights; raise BackendError if the model cannot serve. (Warm-up calls through the
        whole path come after, from ``consumer.warmup``.)"""

    def predict(self, inputs: Arrays) -> Arrays:
        """Run one batch: every input has the batch dimension first; so must every output."""

    def unload(self) -> None:
        """Release the model's memory."""


def zeros_like_spec(shape: tuple[int, ...], rows: int, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """An array for a declared shape with the batch dimension set and variable dims as 1."""
    return np.zeros((rows, *(d if d > 0 else 1 for d in shape[1:])), dtype=dtype)
