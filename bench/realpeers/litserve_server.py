"""LitServe: one ``LitAPI`` per model on the V2 path (LitServe has no V2 protocol: the API's
``decode_request``/``encode_response`` are the adapter), with LitServe's batching.

Configured as LitServe's docs show for batching: ``LitAPI(max_batch_size=32,
batch_timeout=window)``, with ``batch``/``unbatch`` overridden to concatenate rows and split
them back (the default stacks inputs on a new axis), and ``fast_queue=True`` (ZeroMQ between
the processes, as LitServe's production example sets: at tiny c=128 it gave 1,117 / 918 req/s
against 966 / 818 without, and 10-20 % less CPU per answer). LitServe's defaults otherwise: one
API server process parses the JSON and hands each request to one inference worker process per
API (per model), where the batch runs. JSON only: LitServe's request path reads
the body with ``request.json()``, so the binary tensor extension cannot pass through it.
Uvicorn at log level ``warning`` (no access log) and no generated ``client.py``.
"""

from __future__ import annotations

from typing import Any

import litserve as ls
import numpy as np
from fastapi import Response

from bench.realpeers.serving import answer, options, session


class OnnxAPI(ls.LitAPI):  # type: ignore[misc]
    def __init__(self, model: str, path: str, **kwargs: Any) -> None:
        super().__init__(api_path=f"/v2/models/{model}/infer", **kwargs)
        self.model = model
        self.path = path

    def setup(self, device: str) -> None:
        self.session = session(self.path)
        self.input = self.session.get_inputs()[0].name
        self.outputs = [o.name for o in self.session.get_outputs()]

    # Unannotated: LitServe then hands over the body as `request.json()` gives it.
    def decode_request(self, request) -> np.ndarray:  # type: ignore[no-untyped-def]
        tensor = request["inputs"][0]
        return np.asarray(tensor["data"], dtype=np.float32).reshape(tensor["shape"])

    def batch(self, inputs: list[np.ndarray]) -> np.ndarray:
        self._rows = [len(x) for x in inputs]
        return np.concatenate(inputs) if len(inputs) > 1 else inputs[0]

    def predict(self, x: np.ndarray) -> dict[str, np.ndarray]:
        return dict(zip(self.outputs, self.session.run(self.outputs, {self.input: x}), strict=True))

    def unbatch(self, output: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        parts, offset = [], 0
        for n in self._rows:
            parts.append({k: v[offset : offset + n] for k, v in output.items()})
            offset += n
        return parts

    def encode_response(self, output: dict[str, np.ndarray]) -> Response:
        body, _ = answer(self.model, output, False)
        return Response(body, media_type="application/json")


def main() -> None:
    opts = options("LitServe serving ONNX models on the V2 infer path")
    apis = [
        OnnxAPI(name, path, max_batch_size=opts.max_batch, batch_timeout=opts.window_ms / 1000)
        for name, path in opts.models.items()
    ]
    server = ls.LitServer(apis, accelerator="cpu", fast_queue=True)
    server.run(host="127.0.0.1", port=opts.port, log_level="warning", generate_client_file=False)


if __name__ == "__main__":
    main()
