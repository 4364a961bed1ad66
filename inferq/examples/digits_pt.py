"""``digits-pt``: the digits example model as a PyTorch module, built from the ONNX graph's own
weights (``models/digits/1/model.onnx``), so both backends serve the same network.

The ONNX graph is ``Mul(scale) -> Gemm -> Relu -> ... -> Gemm -> ArgMax``; each ``Gemm`` becomes
an ``nn.Linear`` (ONNX keeps ``W`` as ``[in, out]``, torch as ``[out, in]``). The module returns
``(logits, label)`` in the order the config declares its outputs.

``1/model.pt2`` is committed; ``build`` writes it reproducibly (the same bytes on any checkout,
with the same torch release), so ``inferq models build-examples`` never leaves it changed.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch import nn

MODEL = "digits-pt"
SOURCE = "digits"


class DigitsMLP(nn.Module):
    def __init__(self, scale: np.ndarray, layers: list[tuple[np.ndarray, np.ndarray]]) -> None:
        super().__init__()
        self.scale: torch.Tensor
        self.register_buffer("scale", torch.tensor(scale, dtype=torch.float32))
        self.layers = nn.ModuleList()
        for w, b in layers:
            linear = nn.Linear(w.shape[0], w.shape[1])
            with torch.no_grad():
                linear.weight.copy_(torch.tensor(w.T))
                linear.bias.copy_(torch.tensor(b))
            self.layers.append(linear)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x * self.scale
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i < len(self.layers) - 1:
                h = torch.relu(h)
        return h, h.argmax(dim=1)


def from_onnx(path: Path) -> DigitsMLP:
    """The torch twin of the digits ONNX graph; refuses a graph of any other shape."""
    graph = onnx.load(str(path)).graph
    weights = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    ops = [n.op_type for n in graph.node]
    hidden = (len(ops) - 3) // 2
    if ops != ["Mul", *(["Gemm", "Relu"] * hidden), "Gemm", "ArgMax"]:
        raise ValueError(f"{path}: expected Mul, (Gemm, Relu)*, Gemm, ArgMax; got {ops}")
    for node in graph.node:
        if node.op_type == "Gemm" and any(
            a.name in ("transA", "transB") and a.i for a in node.attribute
        ):
            raise ValueError(f"{path}: transposed Gemm is not supported")
    scale = weights[graph.node[0].input[1]]
    gemms = [n for n in graph.node if n.op_type == "Gemm"]
    layers = [(weights[n.input[1]], weights[n.input[2]]) for n in gemms]
    return DigitsMLP(scale, layers).eval()


def build(repo: Path, *, fmt: str = "pt2") -> Path:
    """Write ``{repo}/digits-pt/1/model.{fmt}`` (``pt2``: torch.export; ``ts``: TorchScript)
    from ``{repo}/digits/1/model.onnx``."""
    module = from_onnx(repo / SOURCE / "1" / "model.onnx")
    out = repo / MODEL / "1" / f"model.{fmt}"
    out.parent.mkdir(parents=True, exist_ok=True)
    example = torch.zeros(2, 64)
    if fmt == "pt2":
        batch = torch.export.Dim("batch", min=1)
        program = torch.export.export(module, (example,), dynamic_shapes=({0: batch},))
        for node in program.graph.nodes:
            # Each node's stack trace names this file's absolute path and line numbers: the
            # archive would differ per checkout and per edit. Without them the bytes depend
            # only on the weights and the torch release (pinned in the dev extra), so
            # rebuilding the committed file rewrites it with the same bytes.
            node.meta.pop("stack_trace", None)
        torch.export.save(program, out)
    elif fmt == "ts":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript is deprecated
            torch.jit.script(module).save(str(out))  # type: ignore[no-untyped-call]
    else:
        raise ValueError(f"unknown format {fmt!r}: pt2 or ts")
    return out
