"""The "medium" benchmark model: an MLP 1024→2048→2048→2048→1000 (12.5 M parameters) with
random weights, written as ONNX with ``onnx.helper`` into a model repository.

It is not a trained model: its weights are seeded noise, so its answers mean nothing; what it
stands for is the cost of a mid-sized dense network (about 25 MFLOP per row), big enough that
the model, not the serving layer, is most of the work. The benchmark labels it "medium
(random weights)" wherever it reports it.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

NAME = "medium"
LAYERS = (1024, 2048, 2048, 2048, 1000)
MAX_BATCH = 32
SEED = 14

CONFIG = f"""# Benchmark model: random weights (bench/medium_model.py), not a trained network.
backend = "onnx"
platform = "onnxruntime_onnx"
max_batch = {MAX_BATCH}
flush_ms = 2.0
default_timeout_ms = 10000
intra_op_threads = 1

[cache]
enabled = false

[version_policy]
latest = 1

[[inputs]]
name = "input"
datatype = "FP32"
shape = [-1, {LAYERS[0]}]

[[outputs]]
name = "logits"
datatype = "FP32"
shape = [-1, {LAYERS[-1]}]
"""


def parameters(layers: tuple[int, ...] = LAYERS) -> int:
    """Weights and biases of the network (12,540,904 for ``LAYERS``)."""
    return sum(a * b + b for a, b in itertools.pairwise(layers))


def write(repository: Path, layers: tuple[int, ...] = LAYERS) -> Path:
    """Write ``medium/config.toml`` and ``medium/1/model.onnx`` under ``repository``; return
    the ONNX file's path. (``layers`` other than ``LAYERS`` are for tests.)"""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(SEED)
    nodes = []
    initializers = []
    x = "input"
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(layers)):
        # He-scaled so activations stay finite through the stack.
        w = (rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)).astype(np.float32)
        b = np.zeros(fan_out, dtype=np.float32)
        initializers += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        last = i == len(layers) - 2
        y = "logits" if last else f"h{i}"
        nodes.append(helper.make_node("Gemm", [x, f"w{i}", f"b{i}"], [y if last else f"g{i}"]))
        if not last:
            nodes.append(helper.make_node("Relu", [f"g{i}"], [y]))
        x = y
    graph = helper.make_graph(
        nodes,
        NAME,
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", layers[0]])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", layers[-1]])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # readable by every onnxruntime this project supports
    onnx.checker.check_model(model)
    folder = repository / NAME
    (folder / "1").mkdir(parents=True, exist_ok=True)
    config = CONFIG.replace(f"[-1, {LAYERS[0]}]", f"[-1, {layers[0]}]")
    (folder / "config.toml").write_text(
        config.replace(f"[-1, {LAYERS[-1]}]", f"[-1, {layers[-1]}]")
    )
    path = folder / "1" / "model.onnx"
    onnx.save(model, str(path))
    return path
