"""Model backends behind one interface: arrays in, arrays out; no Redis, no msgpack."""

from __future__ import annotations

from consumer.backends.base import Backend, BackendError, BadOutput, InvalidInput, Overran
from consumer.repository import ModelConfig


def create_backend(config: ModelConfig, version: str, *, device: str = "cpu") -> Backend:
    """The backend named by the model's config, behind its pre-processing stage if it has one;
    not yet loaded."""
    backend = _create(config, version, device=device)
    if config.preprocess is None:
        return backend
    from consumer.preprocess import Preprocessed

    return Preprocessed(config, version, backend)


def _create(config: ModelConfig, version: str, *, device: str) -> Backend:
    if config.backend == "onnx":
        from consumer.backends.onnx import OnnxBackend

        return OnnxBackend(config, version, device=device)
    if config.backend == "pytorch":
        from consumer.backends.pytorch import TorchBackend

        return TorchBackend(config, version, device=device)
    if config.backend == "simulated":
        from consumer.backends.simulated import SimulatedBackend

        return SimulatedBackend(config, version)
    if config.backend == "python":
        from consumer.backends.python import PythonBackend

        return PythonBackend(config, version, device=device)
    raise BackendError(f"model '{config.name}': unknown backend {config.backend!r}")


__all__ = ["Backend", "BackendError", "BadOutput", "InvalidInput", "Overran", "create_backend"]
