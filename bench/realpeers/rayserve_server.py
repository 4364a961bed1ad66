"""Ray Serve: one deployment per model, its ``__call__`` the V2 route (Ray Serve has no V2
protocol: the deployment parses and answers the body itself, JSON or binary tensors, with the
helpers every peer here shares), rows batched with ``@serve.batch``.

Configured as Ray Serve's batching guide shows: ``@serve.batch(max_batch_size=32,
batch_wait_timeout_s=window)``, with ``max_ongoing_requests`` raised from its default (5, which
would cap every batch at 5) as the guide asks. It is 256, above any concurrency the benchmark
drives: at the guide's minimum (``max_batch_size``, or 2x that) the requests beyond it bounce
between the proxy and the full replica, and tiny at c=128 fell from 151 to 21 req/s here.
One replica per model; a local Ray with the dashboard and usage reporting off (neither serves
requests) and no access log. Ray's HTTP proxy takes each request and hands it to the replica
over Ray's RPC.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import numpy as np

from bench.realpeers.serving import answer, options, parse, session

MAX_ONGOING = 256
QUIET = {"enable_access_log": False}
"""No access log line per request (Ray Serve writes one to its log files by default)."""


def deployment(name: str, path: str, max_batch: int, window_s: float) -> Any:
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import Response

    @serve.deployment(name=name, max_ongoing_requests=MAX_ONGOING, logging_config=QUIET)
    class OnnxDeployment:
        def __init__(self) -> None:
            self.session = session(path)
            self.input = self.session.get_inputs()[0].name
            self.outputs = [o.name for o in self.session.get_outputs()]

        @serve.batch(max_batch_size=max_batch, batch_wait_timeout_s=window_s)  # type: ignore[untyped-decorator]
        async def predict(self, xs: list[np.ndarray]) -> list[dict[str, np.ndarray]]:
            x = np.concatenate(xs) if len(xs) > 1 else xs[0]
            results = dict(
                zip(self.outputs, self.session.run(self.outputs, {self.input: x}), strict=True)
            )
            parts, offset = [], 0
            for part in xs:
                parts.append({k: v[offset : offset + len(part)] for k, v in results.items()})
                offset += len(part)
            return parts

        async def __call__(self, request: Request) -> Response:
            x, binary = parse(
                await request.body(), request.headers.get("inference-header-content-length")
            )
            body, header_length = answer(name, await self.predict(x), binary)
            if header_length is None:
                return Response(body, media_type="application/json")
            return Response(
                body,
                media_type="application/octet-stream",
                headers={"inference-header-content-length": str(header_length)},
            )

    return OnnxDeployment.bind()  # type: ignore[attr-defined]


def main() -> None:
    opts = options("Ray Serve serving ONNX models on the V2 infer path")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": opts.port}, logging_config=QUIET)
    for name, path in opts.models.items():
        serve.run(
            deployment(name, path, opts.max_batch, opts.window_ms / 1000),
            name=name,
            route_prefix=f"/v2/models/{name}",
        )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
