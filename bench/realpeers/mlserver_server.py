"""MLServer: its own V2 REST server (JSON only: MLServer's REST API has no binary tensor
extension) with adaptive batching, serving ONNX Runtime through a custom runtime (an
``MLModel`` with ``load``/``predict``, the way MLServer's docs write one).

Configured as the adaptive-batching docs show: ``max_batch_size`` 32 and ``max_batch_time`` =
the window, per model; the server's defaults otherwise (one parallel inference worker process,
so the model runs outside the HTTP process; metrics on), except ``debug`` off, which would log
every request.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from typing import Any

import numpy as np
from mlserver import MLModel, MLServer
from mlserver.codecs import NumpyCodec
from mlserver.settings import ModelParameters, ModelSettings, Settings
from mlserver.types import InferenceRequest, InferenceResponse
from mlserver.utils import install_uvloop_event_loop

from bench.realpeers.serving import free_port, options, session


class OnnxModel(MLModel):  # type: ignore[misc]
    """One ONNX Runtime session; a batch in, every output out."""

    async def load(self) -> bool:
        self._session = session(self.settings.parameters.uri)
        self._input = self._session.get_inputs()[0].name
        self._outputs = [o.name for o in self._session.get_outputs()]
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        x = NumpyCodec.decode_input(payload.inputs[0]).astype(np.float32, copy=False)
        results: list[Any] = self._session.run(self._outputs, {self._input: x})
        return InferenceResponse(
            model_name=self.name,
            outputs=[
                NumpyCodec.encode_output(n, r) for n, r in zip(self._outputs, results, strict=True)
            ],
        )


async def serve() -> None:
    """What ``mlserver start`` does with a settings.json and one model-settings.json per model."""
    opts = options("MLServer serving ONNX models with adaptive batching")
    metrics_dir = tempfile.mkdtemp(prefix="mlserver-metrics-")
    settings = Settings(
        host="127.0.0.1",
        http_port=opts.port,
        grpc_port=free_port(),
        metrics_port=free_port(),
        # Its default is ./.metrics, which would land in the checkout.
        metrics_dir=metrics_dir,
        debug=False,
    )
    models = [
        ModelSettings(
            name=name,
            implementation=OnnxModel,
            parameters=ModelParameters(uri=path),
            max_batch_size=opts.max_batch,
            max_batch_time=opts.window_ms / 1000,
        )
        for name, path in opts.models.items()
    ]
    try:
        await MLServer(settings).start(models)
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


def main() -> None:
    install_uvloop_event_loop()  # as `mlserver start` does
    asyncio.run(serve())


if __name__ == "__main__":
    main()
