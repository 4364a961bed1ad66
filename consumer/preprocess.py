"""Pre-processing on the worker: a backend behind a stage that turns request tensors into the
tensors the model takes. ``[preprocess] kind = "tokenize"`` is the one stage so far.

The stage wraps the version's backend (``create_backend`` returns the pair as one ``Backend``), so
it loads, swaps and unloads with its version: the tokenizer file lives in the version folder. It
runs on the model's worker thread, between the concatenation of a batch and the model call.

Tokenising: each row of the BYTES input is one UTF-8 text. A row that is not valid UTF-8 raises
``InvalidInput`` naming the row, and only the request that holds it is answered as invalid (a 400
at the gateway). Texts are truncated to ``max_length`` tokens, and a batch is padded to its own
longest text, never to a fixed length. With ``bucket_rows`` set, a batch of more rows runs as
length-sorted sub-batches of that many rows, so short texts are not padded to a long one's
length; outputs come back in request order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from consumer.backends.base import Arrays, Backend, BackendError, InvalidInput
from consumer.repository import ModelConfig, TokenizeStage


class Tokenizer:
    """A ``tokenizers`` tokenizer from a version folder, set for batches padded per call."""

    def __init__(self, config: ModelConfig, version: str, stage: TokenizeStage) -> None:
        self.path = config.version_path(version) / stage.tokenizer
        self.stage = stage
        self._tokenizer: Any = None

    def load(self) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            tokenizer = HFTokenizer.from_file(str(self.path))
        except Exception as e:  # tokenizers raises its own exception type for a bad file
            raise BackendError(f"cannot load tokenizer {self.path}: {e}") from e
        # The file may carry its own padding (all-MiniLM's pads to a fixed 128): padding is done
        # here, per batch or sub-batch, to the longest row.
        tokenizer.no_padding()
        tokenizer.enable_truncation(self.stage.max_length)
        self._tokenizer = tokenizer

    def encode(self, column: npt.NDArray[Any]) -> list[Any]:
        """Encodings of one text per row; ``InvalidInput`` for a row that is not UTF-8."""
        texts = []
        for row, value in enumerate(column.reshape(-1)):
            if isinstance(value, str):
                texts.append(value)
                continue
            try:
                texts.append(bytes(value).decode("utf-8"))
            except UnicodeDecodeError as e:
                raise InvalidInput(
                    f"input '{self.stage.input}' is not valid UTF-8 text "
                    f"({e.reason} at byte {e.start})",
                    row,
                ) from None
        return list(self._tokenizer.encode_batch_fast(texts))

    def pad(self, encodings: Sequence[Any]) -> Arrays:
        """The stage's outputs for some encodings, padded to the longest of them."""
        width = max(len(e.ids) for e in encodings)
        shape = (len(encodings), width)
        arrays = {name: np.zeros(shape, dtype=np.int64) for name in self.stage.outputs}
        for i, e in enumerate(encodings):
            n = len(e.ids)
            for name, values in (
                ("input_ids", e.ids),
                ("attention_mask", e.attention_mask),
                ("token_type_ids", e.type_ids),
            ):
                if name in arrays:
                    arrays[name][i, :n] = values
        return arrays

    def unload(self) -> None:
        self._tokenizer = None


class Preprocessed:
    """A backend behind its tokenising stage: BYTES text in, the model's outputs out."""

    def __init__(self, config: ModelConfig, version: str, backend: Backend) -> None:
        assert config.preprocess is not None
        self.may_run_inline = backend.may_run_inline
        self.config = config
        self.version = version
        self.backend = backend
        self.stage = config.preprocess
        self.tokenizer = Tokenizer(config, version, self.stage)

    def load(self) -> None:
        try:
            self.tokenizer.load()
        except BackendError as e:
            raise BackendError(f"model '{self.config.name}' version {self.version}: {e}") from e
        self.backend.load()

    def predict(self, inputs: Arrays, deadline: float | None = None) -> Arrays:
        encodings = self.tokenizer.encode(inputs[self.stage.input])
        rows = len(encodings)
        size = self.stage.bucket_rows
        if not size or rows <= size:
            return self.backend.predict(self.tokenizer.pad(encodings), deadline)
        order = np.argsort([len(e.ids) for e in encodings], kind="stable")
        merged: Arrays = {}
        for start in range(0, rows, size):
            picked = order[start : start + size]
            part = self.backend.predict(
                self.tokenizer.pad([encodings[i] for i in picked]), deadline
            )
            for name, values in part.items():
                if name not in merged:
                    merged[name] = np.empty((rows, *values.shape[1:]), dtype=values.dtype)
                merged[name][picked] = values
        return merged

    def unload(self) -> None:
        self.backend.unload()
        self.tokenizer.unload()
