"""BentoML, the way its adaptive-batching guide composes services: a V2 API service (one
``@bentoml.api`` per model on ``/v2/models/{model}/infer``, BentoML parsing the JSON body into
the API's typed arguments) that calls, per model, a model service whose ``predict`` is
``@bentoml.api(batchable=True, max_batch_size=32)``; BentoML's dispatcher in the model service
forms the batches. A batchable API cannot be the V2 route itself: it takes exactly one argument
(a V2 body has ``inputs`` and ``parameters``) and answers each request a slice of the batch
output (a list, not a V2 object), so the guide's two-service composition is the adapter.

``max_latency_ms`` is BentoML's default (60 s): its dispatcher sizes the window itself from the
recent batch latencies, and answers 503 once it estimates a request would miss that latency
(a 10 ms setting answers nearly everything 503 here). One worker per service (the default),
access logs off. JSON only: the typed API arguments come from a JSON body.

``bentoml serve`` imports this module by name in every worker, so the models come through the
environment (``REALPEER_MODELS``, JSON ``{name: onnx_path}``, and ``REALPEER_MAX_BATCH``).

    python -m bench.realpeers.bentoml_server --port P --model NAME=ONNX ...   (execs bentoml serve)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import bentoml
import numpy as np

from bench.peer_servers import DATATYPES
from bench.realpeers.serving import options, session

MODELS_ENV = "REALPEER_MODELS"
MAX_BATCH_ENV = "REALPEER_MAX_BATCH"
ROOT = Path(__file__).resolve().parents[2]
QUIET = {"access": {"enabled": False}}
KEEP_SESSIONS = {"max_requests": 2**31 - 1, "max_age": 86400.0}
"""The API service's client of a model service replaces its HTTP session every
``runner_connection.max_requests`` requests (default 100) and closes the old one with requests
still in flight on it, which fails those ("Connector is closed", "Server disconnected") at any
concurrency above 1 (and likewise every ``max_age``, 300 s): the setting, on the model
service, keeps one session."""


def model_service(name: str, path: str, max_batch: int) -> Any:
    """The service that owns ``name``'s ONNX session and batches its rows."""

    class Model:
        def __init__(self) -> None:
            self.session = session(path)
            self.input = self.session.get_inputs()[0].name
            self.outputs = [o.name for o in self.session.get_outputs()]

        @bentoml.api(batchable=True, max_batch_size=max_batch)  # type: ignore[untyped-decorator]
        def predict(self, x: np.ndarray) -> list[dict[str, np.ndarray]]:
            results = self.session.run(self.outputs, {self.input: x})
            # One entry per row: BentoML splits a batch output along its first axis.
            return [dict(zip(self.outputs, row, strict=True)) for row in zip(*results, strict=True)]

    Model.__name__ = Model.__qualname__ = f"{name}_model"
    return bentoml.service(name=f"{name}_model", logging=QUIET, runner_connection=KEEP_SESSIONS)(
        Model
    )


def infer_api(name: str) -> Any:
    """The V2 route of ``name``: parse, call the model service, answer every output."""

    async def infer(
        self: Any, inputs: list[dict[str, Any]], parameters: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        tensor = inputs[0]
        x = np.asarray(tensor["data"], dtype=np.float32).reshape(tensor["shape"])
        rows = await getattr(self, name).to_async.predict(x)
        outputs = []
        for key in rows[0]:
            arr = np.stack([r[key] for r in rows])
            outputs.append(
                {
                    "name": key,
                    "datatype": DATATYPES[arr.dtype],
                    "shape": list(arr.shape),
                    "data": arr.ravel().tolist(),
                }
            )
        return {"model_name": name, "model_version": "1", "outputs": outputs}

    infer.__name__ = f"infer_{name}"
    return bentoml.api(route=f"/v2/models/{name}/infer")(infer)


def api_service(models: dict[str, str], max_batch: int) -> Any:
    attrs: dict[str, Any] = {}
    for name, path in models.items():
        attrs[name] = bentoml.depends(model_service(name, path, max_batch))
        attrs[f"infer_{name}"] = infer_api(name)
    return bentoml.service(name="v2", logging=QUIET)(type("V2", (), attrs))


if MODELS_ENV in os.environ:
    V2 = api_service(json.loads(os.environ[MODELS_ENV]), int(os.environ[MAX_BATCH_ENV]))


def main() -> None:
    opts = options("BentoML serving ONNX models on the V2 infer path")
    os.environ[MODELS_ENV] = json.dumps(opts.models)
    os.environ[MAX_BATCH_ENV] = str(opts.max_batch)
    bentoml_cli = str(Path(sys.executable).with_name("bentoml"))
    os.execv(
        bentoml_cli,
        [
            bentoml_cli,
            "serve",
            f"{__spec__.name}:V2",
            "--host",
            "127.0.0.1",
            "--port",
            str(opts.port),
            "--working-dir",
            str(ROOT),
        ],
    )


if __name__ == "__main__":
    main()
