"""KServe's Python model server (``kserve.ModelServer``): its own V2 REST endpoints, JSON and
the binary tensor extension natively, serving ONNX Runtime through a custom ``kserve.Model``
the way KServe's custom-model docs write one (``load`` sets ``ready``; ``predict`` takes an
``InferRequest`` and returns an ``InferResponse``).

KServe's model server has no batching of its own (in a cluster, batching is the sidecar
agent's job): each request is one ``predict`` call, run inline on the event loop. One uvicorn
worker (its default); the per-request latency log line and KServe's logging set-up are off, so
no peer pays for logging every request.
"""

from __future__ import annotations

import sys

from bench.realpeers.serving import free_port, options, session

DATATYPES = {"tensor(float)": "FP32", "tensor(int64)": "INT64"}


def main() -> None:
    opts = options("KServe's model server serving ONNX models over V2 REST")
    # kserve.model_server parses sys.argv when imported; ours are not its flags.
    sys.argv = [sys.argv[0], "--configure_logging", "false"]
    import kserve
    from kserve import InferOutput, InferRequest, InferResponse
    from kserve.utils.utils import generate_uuid

    class OnnxModel(kserve.Model):  # type: ignore[misc]
        def __init__(self, name: str, path: str) -> None:
            super().__init__(name)
            self.path = path

        def load(self) -> bool:
            self.session = session(self.path)
            self.input = self.session.get_inputs()[0].name
            self.outputs = [(o.name, DATATYPES[o.type]) for o in self.session.get_outputs()]
            self.ready = True
            return True

        def predict(
            self, payload: InferRequest, headers: object = None, response_headers: object = None
        ) -> InferResponse:
            x = payload.inputs[0].as_numpy()
            results = self.session.run([n for n, _ in self.outputs], {self.input: x})
            binary = payload.use_binary_outputs
            outputs = []
            for (name, datatype), r in zip(self.outputs, results, strict=True):
                out = InferOutput(name=name, shape=list(r.shape), datatype=datatype)
                out.set_data_from_numpy(r, binary_data=binary)
                outputs.append(out)
            return InferResponse(
                response_id=payload.id or generate_uuid(),  # as KServe's examples do
                model_name=self.name,
                infer_outputs=outputs,
                use_binary_outputs=binary,
            )

    models = []
    for name, path in opts.models.items():
        model = OnnxModel(name, path)
        model.load()
        models.append(model)
    kserve.ModelServer(
        http_port=opts.port, grpc_port=free_port(), enable_latency_logging=False
    ).start(models)


if __name__ == "__main__":
    main()
