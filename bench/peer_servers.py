"""The two peers `bench/peers.py` measures inferq against, as FastAPI apps on uvicorn:

- ``plain``: one ONNX Runtime session called inline in the request handler, no batching;
- ``batcher``: the tutorial design inferq replaces, an in-process asyncio micro-batcher:
  requests queue in the server process, a batch runs when it holds ``max_batch`` rows (32) or
  ``window_ms`` (5) after its first request arrived, on one executor thread, and each request's
  rows are split back to it.

Both speak the subset of the Open Inference Protocol the benchmark sends (so the same request
bytes go to every server): ``POST /v2/models/{model}/infer`` with one FP32 input as JSON
``data`` or with the binary tensor extension, all of the model's outputs in the answer, as JSON
``data`` or binary when ``binary_data_output`` is set. They are deliberately lean (no pydantic
models, the body parsed with ``json.loads``, the session configured as inferq's worker
configures it: one intra-op thread, no spinning), so they are strong baselines rather than
straw men.

    python -m bench.peer_servers {plain,batcher} --model NAME=PATH [--model ...] --port PORT
"""

import argparse
import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

Arrays = dict[str, npt.NDArray[Any]]
DATATYPES = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64"}


def session(path: str) -> ort.InferenceSession:
    """An ONNX Runtime session configured like inferq's worker (``consumer/backends/onnx``)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(path, sess_options=options, providers=["CPUExecutionProvider"])


class MicroBatcher:
    """An asyncio micro-batcher: one queue, one batch forming at a time, one model thread."""

    def __init__(self, sess: ort.InferenceSession, *, max_batch: int, window_s: float) -> None:
        self.session = sess
        self.input = sess.get_inputs()[0].name
        self.outputs = [o.name for o in sess.get_outputs()]
        self.max_batch = max_batch
        self.window_s = window_s
        self.queue: asyncio.Queue[tuple[npt.NDArray[Any], asyncio.Future[Arrays]]] = asyncio.Queue()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    async def submit(self, x: npt.NDArray[Any]) -> Arrays:
        future: asyncio.Future[Arrays] = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((x, future))
        return await future

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            rows = len(batch[0][0])
            deadline = loop.time() + self.window_s
            while rows < self.max_batch:
                try:
                    item = self.queue.get_nowait()
                except asyncio.QueueEmpty:
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        break
                    try:
                        async with asyncio.timeout(remaining):
                            item = await self.queue.get()
                    except TimeoutError:
                        break
                batch.append(item)
                rows += len(item[0])
            x = np.concatenate([b[0] for b in batch]) if len(batch) > 1 else batch[0][0]
            try:
                outputs = await loop.run_in_executor(self.executor, self._predict, x)
            except Exception as e:  # one failure answers every waiter of the batch
                for _, future in batch:
                    if not future.done():
                        future.set_exception(e)
                continue
            offset = 0
            for part, future in batch:
                n = len(part)
                if not future.done():
                    future.set_result({k: v[offset : offset + n] for k, v in outputs.items()})
                offset += n

    def _predict(self, x: npt.NDArray[Any]) -> Arrays:
        results = self.session.run(self.outputs, {self.input: x})
        return dict(zip(self.outputs, results, strict=True))


def parse(body: bytes, header_length: str | None) -> tuple[npt.NDArray[Any], bool]:
    """The request's one FP32 input as an array, and whether binary outputs were asked for."""
    n = int(header_length) if header_length is not None else len(body)
    request = json.loads(body[:n])
    tensor = request["inputs"][0]
    shape = tensor["shape"]
    if "data" in tensor:
        x = np.asarray(tensor["data"], dtype=np.float32).reshape(shape)
    else:
        x = np.frombuffer(body[n:], dtype=np.float32).reshape(shape)
    return x, bool(request.get("parameters", {}).get("binary_data_output", False))


def answer(model: str, outputs: Arrays, binary: bool) -> tuple[bytes, int | None]:
    """The V2 response body, and the JSON header's length when it carries binary outputs."""
    entries = []
    blobs = []
    for name, arr in outputs.items():
        entry: dict[str, Any] = {
            "name": name,
            "datatype": DATATYPES[arr.dtype],
            "shape": list(arr.shape),
        }
        if binary:
            blob = np.ascontiguousarray(arr).tobytes()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = arr.ravel().tolist()
        entries.append(entry)
    header = json.dumps(
        {"model_name": model, "model_version": "1", "outputs": entries}, separators=(",", ":")
    ).encode()
    if not binary:
        return header, None
    return b"".join([header, *blobs]), len(header)


def create_app(
    kind: str, models: dict[str, str], *, max_batch: int = 32, window_ms: float = 5.0
) -> Any:
    """The peer app serving ``models`` (name to ONNX file), one session (and, for the batcher,
    one batcher with its own model thread) per model."""
    # Imported here: the batcher and the V2 helpers above are unit-tested without FastAPI
    # (a `bench` extra, not a test dependency).
    from fastapi import FastAPI, Request, Response

    sessions = {name: session(path) for name, path in models.items()}
    io_names = {
        name: (s.get_inputs()[0].name, [o.name for o in s.get_outputs()])
        for name, s in sessions.items()
    }
    batchers = {
        name: MicroBatcher(sess, max_batch=max_batch, window_s=window_ms / 1000)
        for name, sess in sessions.items()
        if kind == "batcher"
    }

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(b.run()) for b in batchers.values()]
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    app = FastAPI(lifespan=lifespan)

    @app.get("/v2/health/ready")
    async def ready() -> dict[str, bool]:
        return {"ready": True}

    @app.post("/v2/models/{model}/infer")
    async def infer(model: str, request: Request) -> Response:
        sess = sessions.get(model)
        if sess is None:
            return Response(b'{"error":"unknown model"}', 404, media_type="application/json")
        x, binary = parse(
            await request.body(), request.headers.get("inference-header-content-length")
        )
        batcher = batchers.get(model)
        if batcher is not None:
            outputs = await batcher.submit(x)
        else:
            input_name, names = io_names[model]
            outputs = dict(zip(names, sess.run(names, {input_name: x}), strict=True))
        body, header_length = answer(model, outputs, binary)
        if header_length is None:
            return Response(body, media_type="application/json")
        return Response(
            body,
            media_type="application/octet-stream",
            headers={"inference-header-content-length": str(header_length)},
        )

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description="a FastAPI peer for bench/peers.py")
    parser.add_argument("kind", choices=["plain", "batcher"])
    parser.add_argument(
        "--model", action="append", required=True, help="NAME=ONNX_FILE (repeatable)"
    )
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--window-ms", type=float, default=5.0)
    args = parser.parse_args()
    import uvicorn

    uvicorn.run(
        create_app(
            args.kind,
            dict(m.split("=", 1) for m in args.model),
            max_batch=args.max_batch,
            window_ms=args.window_ms,
        ),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    main()
