"""Train the ``digits`` example model and export it to ONNX by hand.

What it does:

1. Loads scikit-learn's bundled digits data set (``sklearn.datasets.load_digits``;
   offline, 1797 images of 8x8 pixels with values 0..16, classes 0..9).
2. Makes a stratified held-out split (25% test, ``random_state=0``).
3. Trains a small ``MLPClassifier`` (one hidden layer of 64 ReLU units,
   ``random_state=0``) on the pixels scaled by 1/16.
4. Writes the network to ONNX with ``onnx.helper`` (no skl2onnx, no torch):

   - input ``input``: FP32 ``[batch, 64]``, raw pixel values 0..16; the 1/16
     scaling is the first node of the graph (``Mul``), so clients send raw pixels;
   - ``Gemm`` + ``Relu`` for each hidden layer, then a final ``Gemm``;
   - output ``logits``: FP32 ``[batch, 10]``, pre-softmax scores;
   - output ``label``: INT64 ``[batch]``, ``ArgMax(logits, axis=1, keepdims=0)``.

   ``batch`` is a symbolic dimension, so any batch size works. Opset 17, IR
   version 8. The model is checked with ``onnx.checker.check_model``.
5. Runs the ONNX model with onnxruntime on the held-out set and asserts that its
   logits match the scikit-learn network's (max abs diff < 1e-4) and that its
   labels equal ``MLPClassifier.predict``; prints the held-out accuracy.
6. Writes ``samples.json`` next to this script: 10 held-out examples, one per
   class 0..9 (the first correctly classified held-out example of each class),
   as ``{"inputs": [[64 raw 0..16 values], ...], "labels": [0, ..., 9]}``.
   README examples and tests use it.

Run it from anywhere (paths are relative to this script's folder)::

    python models/digits/train.py                # writes models/digits/1/model.onnx
    python models/digits/train.py --out /tmp/digits.onnx --samples /tmp/s.json

It needs the ``train`` extra (scikit-learn, onnx): ``pip install -e ".[train]"``;
onnxruntime, used for the check, is a base dependency of inferq.
Everything is seeded, so reruns on the same software stack give the same model.

No pickle is used anywhere: the model is stored only as an ONNX protobuf and the
samples as JSON; the scikit-learn estimator is never saved.
"""

from __future__ import annotations

import argparse
import json
import random
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from sklearn.datasets import load_digits
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "1" / "model.onnx"
DEFAULT_SAMPLES = HERE / "samples.json"

SEED = 0
OPSET = 17
IR_VERSION = 8  # the IR version that goes with opset 17; onnxruntime >= 1.11 loads it
PIXEL_SCALE = 1.0 / 16.0  # digits pixels are 0..16; exact in float32
N_FEATURES = 64
N_CLASSES = 10


def train(x_train: np.ndarray, y_train: np.ndarray) -> MLPClassifier:
    clf = MLPClassifier(
        hidden_layer_sizes=(64,),
        activation="relu",
        solver="adam",
        max_iter=2000,
        random_state=SEED,
    )
    with warnings.catch_warnings():
        # Fail loudly instead of shipping a model that did not converge.
        warnings.simplefilter("error", ConvergenceWarning)
        clf.fit(x_train * PIXEL_SCALE, y_train)
    return clf


def reference_logits(clf: MLPClassifier, x_raw: np.ndarray) -> np.ndarray:
    """The network's pre-softmax scores, in float64, computed from its weights."""
    h = np.asarray(x_raw, dtype=np.float64) * PIXEL_SCALE
    last = len(clf.coefs_) - 1
    for i, (w, b) in enumerate(zip(clf.coefs_, clf.intercepts_, strict=True)):
        h = h @ w + b
        if i < last:
            h = np.maximum(h, 0.0)
    return h


def to_onnx(clf: MLPClassifier) -> onnx.ModelProto:
    if clf.activation != "relu" or clf.out_activation_ != "softmax":
        raise ValueError("only ReLU hidden layers with a softmax output are supported")
    if clf.coefs_[0].shape[0] != N_FEATURES or clf.coefs_[-1].shape[1] != N_CLASSES:
        raise ValueError("unexpected layer shapes")

    initializers = [numpy_helper.from_array(np.array([PIXEL_SCALE], dtype=np.float32), "scale")]
    nodes = [helper.make_node("Mul", ["input", "scale"], ["scaled"], name="scale_pixels")]
    prev = "scaled"
    last = len(clf.coefs_) - 1
    for i, (w, b) in enumerate(zip(clf.coefs_, clf.intercepts_, strict=True)):
        initializers.append(numpy_helper.from_array(w.astype(np.float32), f"W{i}"))
        initializers.append(numpy_helper.from_array(b.astype(np.float32), f"B{i}"))
        out = "logits" if i == last else f"dense{i}"
        nodes.append(helper.make_node("Gemm", [prev, f"W{i}", f"B{i}"], [out], name=f"gemm{i}"))
        if i < last:
            nodes.append(helper.make_node("Relu", [out], [f"relu{i}"], name=f"relu{i}"))
            prev = f"relu{i}"
    nodes.append(
        helper.make_node("ArgMax", ["logits"], ["label"], name="argmax", axis=1, keepdims=0)
    )

    graph = helper.make_graph(
        nodes,
        "digits_mlp",
        inputs=[
            helper.make_tensor_value_info(
                "input",
                TensorProto.FLOAT,
                ["batch", N_FEATURES],
                "raw 8x8 digit pixels, row-major, values 0..16",
            )
        ],
        outputs=[
            helper.make_tensor_value_info(
                "logits", TensorProto.FLOAT, ["batch", N_CLASSES], "pre-softmax class scores"
            ),
            helper.make_tensor_value_info(
                "label", TensorProto.INT64, ["batch"], "predicted digit 0..9"
            ),
        ],
        initializer=initializers,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="inferq models/digits/train.py",
        doc_string="MLP over scikit-learn's 8x8 digits; input is raw pixels 0..16.",
    )
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    return model


def pick_samples(x_test, y_test, predicted) -> dict:
    inputs, labels = [], []
    for digit in range(N_CLASSES):
        idx = np.flatnonzero((y_test == digit) & (predicted == digit))[0]
        inputs.append([float(v) for v in x_test[idx]])
        labels.append(int(digit))
    return {"inputs": inputs, "labels": labels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="where to write the ONNX model"
    )
    parser.add_argument(
        "--samples", type=Path, default=DEFAULT_SAMPLES, help="where to write samples.json"
    )
    args = parser.parse_args()

    random.seed(SEED)
    np.random.seed(SEED)

    data = load_digits()
    x = data.data.astype(np.float32)  # raw pixels, 0..16
    y = data.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.25, stratify=y, random_state=SEED
    )

    clf = train(x_train, y_train)
    sk_pred = clf.predict(x_test * PIXEL_SCALE)
    ref = reference_logits(clf, x_test)
    assert np.array_equal(ref.argmax(axis=1), sk_pred), "weights do not reproduce predict()"

    model = to_onnx(clf)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(model.SerializeToString())

    # Verify the file as written, with onnxruntime.
    session = ort.InferenceSession(str(args.out), providers=["CPUExecutionProvider"])
    logits, label = session.run(["logits", "label"], {"input": x_test})
    max_diff = float(np.max(np.abs(logits.astype(np.float64) - ref)))
    assert max_diff < 1e-4, f"ONNX logits differ from scikit-learn by {max_diff}"
    assert label.dtype == np.int64 and label.shape == (len(x_test),)
    assert np.array_equal(label, sk_pred), "ONNX labels differ from scikit-learn predictions"

    accuracy = float(np.mean(label == y_test))
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
    print(f"max abs logit diff vs scikit-learn: {max_diff:.2e}")
    print(f"held-out accuracy: {accuracy:.4f} (n={len(y_test)})")

    samples = pick_samples(x_test, y_test, label)
    args.samples.parent.mkdir(parents=True, exist_ok=True)
    args.samples.write_text(json.dumps(samples) + "\n")
    print(f"wrote {args.samples} ({len(samples['labels'])} examples)")


if __name__ == "__main__":
    main()
