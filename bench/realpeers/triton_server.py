"""Triton through PyTriton: the real ``tritonserver`` (its HTTP V2 endpoint, JSON and binary
tensors natively) with its dynamic batcher, handing each batch through its Python backend to
an inference callable in this process that calls ONNX Runtime.

There is no native ONNX Runtime backend in any wheel reachable here, so the model runs in a
PyTriton ``@batch`` callable: one instance per model (one model thread, like inferq's one
worker), ``max_batch_size`` 32 and ``max_queue_delay_microseconds`` = the window, as Triton's
model-configuration guide advises (dynamic batching on, a small queue delay). Its metrics
endpoint is off (the run that bench/summaries/realpeers-phase1.json records had it off).

The Python backend stub is linked against libpython: it needs the running interpreter's
``libpython3.X.so`` first on ``LD_LIBRARY_PATH``, which a pyenv or venv Python does not put
there.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import sysconfig
import tempfile
from typing import Any

import numpy as np

from bench.realpeers.serving import free_port, options, session


def infer_function(sess: Any) -> Any:
    """The model's ``@batch`` inference callable: Triton's batch in, all outputs out."""
    from pytriton.decorators import batch

    input_name = sess.get_inputs()[0].name
    outputs = [o.name for o in sess.get_outputs()]

    @batch  # type: ignore[untyped-decorator]
    def infer(**inputs: np.ndarray) -> dict[str, np.ndarray]:
        results = sess.run(outputs, {input_name: inputs[input_name]})
        # A batched Triton tensor has a dim besides the batch: `label` goes out as [n, 1].
        return {n: r.reshape(len(r), -1) for n, r in zip(outputs, results, strict=True)}

    return infer


def tensors(args: Any) -> list[Any]:
    """PyTriton's declarations of ONNX inputs or outputs (the batch dim left out)."""
    from pytriton.model_config import Tensor

    dtypes = {"tensor(float)": np.float32, "tensor(int64)": np.int64}
    return [
        Tensor(name=a.name, dtype=dtypes[a.type], shape=tuple(a.shape[1:]) or (1,)) for a in args
    ]


def main() -> None:
    opts = options("Triton (PyTriton) serving ONNX models over V2 HTTP")
    libdir = sysconfig.get_config_var("LIBDIR")
    os.environ["LD_LIBRARY_PATH"] = ":".join(
        p for p in (libdir, os.environ.get("LD_LIBRARY_PATH", "")) if p
    )
    from pytriton.triton import TritonConfig

    config = TritonConfig(
        http_address="127.0.0.1",
        http_port=opts.port,
        grpc_address="127.0.0.1",
        grpc_port=free_port(),
        allow_metrics=False,
    )
    # Its own workspace, removed after: PyTriton leaves ~/.cache/pytriton/workspace_* behind
    # when stopped by a signal.
    scratch = tempfile.mkdtemp(prefix="pytriton-")
    # SIGTERM as an exit, so that Triton's context stops the server and the scratch goes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        serve(opts, config, os.path.join(scratch, "workspace"))  # PyTriton creates it
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def serve(opts: Any, config: Any, workspace: str) -> None:
    from pytriton.model_config import DynamicBatcher, ModelConfig
    from pytriton.triton import Triton

    with Triton(config=config, workspace=workspace) as triton:
        for name, path in opts.models.items():
            sess = session(path)
            triton.bind(
                model_name=name,
                infer_func=infer_function(sess),
                inputs=tensors(sess.get_inputs()),
                outputs=tensors(sess.get_outputs()),
                config=ModelConfig(
                    max_batch_size=opts.max_batch,
                    batcher=DynamicBatcher(
                        max_queue_delay_microseconds=round(opts.window_ms * 1000)
                    ),
                ),
            )
        triton.serve()


if __name__ == "__main__":
    main()
