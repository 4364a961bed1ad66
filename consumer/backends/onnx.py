"""ONNX Runtime backend: CPU by default, the CUDA execution provider with ``device="cuda"``."""

from __future__ import annotations

from typing import Any

import onnxruntime as ort

from consumer.backends.base import Arrays, BackendError
from consumer.repository import ModelConfig

_ORT_TYPES = {
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(float16)": "FP16",
    "tensor(int64)": "INT64",
    "tensor(int32)": "INT32",
    "tensor(int16)": "INT16",
    "tensor(int8)": "INT8",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(bool)": "BOOL",
    "tensor(string)": "BYTES",
}


class OnnxBackend:
    may_run_inline = True

    def __init__(self, config: ModelConfig, version: str, *, device: str = "cpu") -> None:
        self.config = config
        self.version = version
        self.device = device
        self._session: ort.InferenceSession | None = None
        self._output_names = [o.name for o in config.outputs]

    def providers(self) -> list[str]:
        available = ort.get_available_providers()
        if self.device == "cuda":
            if "CUDAExecutionProvider" not in available:
                raise BackendError(
                    f"model '{self.config.name}': --device cuda asked for, but this onnxruntime "
                    f"has no CUDAExecutionProvider (available: {', '.join(available)}); "
                    "install onnxruntime-gpu"
                )
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]
        return ["CPUExecutionProvider"]

    def load(self) -> None:
        path = self.config.model_file(self.version)
        assert path is not None
        options = ort.SessionOptions()
        # Small models on a shared host: a spinning thread pool steals CPU from the gateway and
        # the event loop; one thread per session without spinning is the better default.
        options.intra_op_num_threads = self.config.intra_op_threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            session = ort.InferenceSession(
                str(path), sess_options=options, providers=self.providers()
            )
        except Exception as e:  # onnxruntime raises its own untyped errors
            raise BackendError(f"model '{self.config.name}' version {self.version}: {e}") from e
        self._check_signature(session)
        self._session = session

    def _check_signature(self, session: ort.InferenceSession) -> None:
        """The graph against what it will be given: the public inputs, or the pre-processing
        stage's outputs when the model has one."""
        inputs = self.config.backend_inputs()
        declared = {s.name: s for s in (*inputs, *self.config.outputs)}
        for arg in (*session.get_inputs(), *session.get_outputs()):
            spec = declared.get(arg.name)
            if spec is None:
                continue
            actual = _ORT_TYPES.get(arg.type)
            if actual != spec.datatype:
                raise BackendError(
                    f"model '{self.config.name}' version {self.version}: config says "
                    f"'{arg.name}' is {spec.datatype}, the ONNX graph says {arg.type}"
                )
        graph_inputs = {i.name for i in session.get_inputs()}
        graph_outputs = {o.name for o in session.get_outputs()}
        missing = [s.name for s in inputs if s.name not in graph_inputs]
        missing += [s.name for s in self.config.outputs if s.name not in graph_outputs]
        if missing:
            raise BackendError(
                f"model '{self.config.name}' version {self.version}: the ONNX graph has no "
                f"tensor named {', '.join(missing)}"
            )
        unfed = sorted(graph_inputs - {s.name for s in inputs})
        if unfed:
            raise BackendError(
                f"model '{self.config.name}' version {self.version}: the ONNX graph takes "
                f"{', '.join(unfed)}, which the config does not provide"
            )

    def predict(self, inputs: Arrays, deadline: float | None = None) -> Arrays:
        if self._session is None:
            raise BackendError(f"model '{self.config.name}' version {self.version} is not loaded")
        outputs: list[Any] = self._session.run(self._output_names, inputs)
        return dict(zip(self._output_names, outputs, strict=True))

    def unload(self) -> None:
        self._session = None
