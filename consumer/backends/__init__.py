"""Model backends behind one interface: arrays in, arrays out; no Redis, no msgpack."""

from __future__ import annotations

from consumer.backends.base import Backend, BackendError
from consumer.repository import ModelConfig


def create_backend(config: ModelConfig, version: str, *, device: str = "cpu") -> Backend:
    """The backend named by the model's config, not yet loaded."""
    if config.backend == "onnx":
        from consumer.backends.onnx import OnnxBackend

        return OnnxBackend(config, version, device=device)
    if config.backend == "simulated":
        from consumer.backends.simulated import SimulatedBackend

        return SimulatedBackend(config, version)
    raise BackendError(f"model '{config.name}': unknown backend {config.backend!r}")


__all__ = ["Backend", "BackendError", "create_backend"]
