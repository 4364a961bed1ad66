"""Helpers for the integration suite: real gateways and workers in background threads."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

import httpx
import numpy as np
import pytest
import redis
import uvicorn

from consumer.settings import WorkerSettings
from consumer.worker import Worker
from inferq.redisserver import free_port
from producer.app import create_app
from producer.gateway import Gateway
from producer.registry import parse_snapshot, queue_snapshot
from producer.server import server_config
from producer.settings import GatewaySettings
from protocol.keys import Keys
from protocol.messages import InferRequest
from protocol.registry import WorkerInfo
from protocol.tensor import Tensor
from runtime.connections import RedisSettings

START_TIMEOUT_S = 20.0
CHECKOUT = Path(__file__).resolve().parent.parent


def checkout_env(**extra: str) -> dict[str, str]:
    """This process's environment, plus ``extra``, for a subprocess that must run this
    checkout's code whatever its working directory: the checkout comes first on
    ``PYTHONPATH`` (the editable install may point at another worktree)."""
    path = os.pathsep.join(p for p in (str(CHECKOUT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def free_port_pair() -> int:
    """A port p with p + 1 also free: the metrics ports of two workers or gateways (base + i)."""
    for _ in range(50):
        base = free_port()
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", base + 1))
            except OSError:
                continue
        return base
    raise RuntimeError("no two consecutive free ports")


def missing(what: str, *, module: bool = False) -> NoReturn:
    """A tool or package a test needs is absent: skip with the reason here, but fail in CI
    (``CI=true``), where `make test` installs everything, so a broken install cannot turn
    checks into silent skips."""
    if os.environ.get("CI", "").strip().lower() in ("true", "1"):
        pytest.fail(f"{what} is missing in CI; `make test` should have installed it")
    pytest.skip(f"{what} is not installed", allow_module_level=module)


def wait_until(
    condition: Callable[[], bool], timeout_s: float = 10.0, what: str = "", poll_s: float = 0.005
) -> None:
    """Poll a condition until it holds; fail the test with ``what`` if it never does.
    ``poll_s``: longer for conditions that cost a server real work (a Prometheus query)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout_s} s waiting for {what or condition}"
            ) from None
        time.sleep(poll_s)


async def until(condition: Callable[[], object], timeout_s: float = 10.0, what: str = "") -> None:
    """``wait_until`` inside an event loop: poll a condition on state that has no event of its
    own to wait on (Redis, a counter), failing with ``what`` after ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            while not condition():  # noqa: ASYNC110
                await asyncio.sleep(0.005)
    except TimeoutError:
        raise AssertionError(
            f"timed out after {timeout_s} s waiting for {what or condition}"
        ) from None


def write_simulated_model(
    repo: Path,
    name: str,
    *,
    base_ms: float,
    per_row_ms: float,
    max_batch: int,
    flush_ms: float = 2.0,
    cache: bool = False,
    failure_rate: float = 0.0,
    partitions: int = 1,
    executions_dir: Path | None = None,
) -> None:
    """A simulated model (``consumer/backends/simulated.py``): input ``x`` [-1, 4], output
    ``sum`` [-1, 1], each row's sum. ``executions_dir`` records every row it runs."""
    folder = repo / name
    record = f"executions_dir = {json.dumps(str(executions_dir))}\n" if executions_dir else ""
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.toml").write_text(
        f"""backend = "simulated"
max_batch = {max_batch}
flush_ms = {flush_ms}
default_timeout_ms = 10000
partitions = {partitions}

[cache]
enabled = {"true" if cache else "false"}

[simulated]
base_ms = {base_ms}
per_row_ms = {per_row_ms}
failure_rate = {failure_rate}
{record}
[[inputs]]
name = "x"
datatype = "FP32"
shape = [-1, 4]

[[outputs]]
name = "sum"
datatype = "FP32"
shape = [-1, 1]
"""
    )


def sim_request(
    keys: Keys, request_id: str, now_ms: int, *, value: float = 1.0, reply_to: str | None = None
) -> InferRequest:
    """A request for the simulated model ``sim`` as a gateway would queue it (for tests that
    write streams by hand)."""
    x = Tensor.from_numpy("x", np.full((1, 4), value, dtype=np.float32))
    return InferRequest(
        id=request_id,
        model="sim",
        version="1",
        inputs=[x],
        outputs=None,
        deadline_ms=now_ms + 60_000,
        enqueued_ms=now_ms,
        result_key=keys.result(request_id),
        result_ttl_ms=60_000,
        reply_to=reply_to,
    )


def sim_body(value: float, rows: int = 1, **parameters: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [rows, 4], "data": [value] * 4 * rows}
        ]
    }
    if parameters:
        body["parameters"] = parameters
    return body


class WorkerThread:
    """A real ``Worker`` running in its own thread and event loop."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.worker = Worker(settings)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=f"worker-{settings.worker_id}")

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        task = asyncio.create_task(self.worker.run())
        started = asyncio.create_task(self.worker.started.wait())
        await asyncio.wait([task, started], return_when=asyncio.FIRST_COMPLETED)
        self._ready.set()
        try:
            await task
        except BaseException as e:
            self._error = e
            raise
        finally:
            started.cancel()

    def start(self) -> WorkerThread:
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S) or not self.worker.started.is_set():
            raise RuntimeError(f"worker did not start: {self._error!r}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self.worker.request_stop)
        self._thread.join(START_TIMEOUT_S)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Freeze the worker's event loop, as SIGSTOP freezes a worker process: it reads nothing,
        runs nothing and sends no heartbeat until the block ends."""
        assert self._loop is not None
        gate, frozen = threading.Event(), threading.Event()

        def freeze() -> None:
            frozen.set()
            gate.wait(START_TIMEOUT_S * 3)

        self._loop.call_soon_threadsafe(freeze)
        if not frozen.wait(START_TIMEOUT_S):
            raise RuntimeError("the worker's event loop did not pause")
        try:
            yield
        finally:
            gate.set()

    @property
    def running(self) -> bool:
        """Started and not ended (a crashed worker task stops the worker, ending the thread)."""
        return self.worker.started.is_set() and self._thread.is_alive()

    @property
    def stats(self) -> Any:
        return self.worker.stats

    def backend(self, model: str) -> Any:
        slot = self.worker.slots[model]
        return next(iter(slot.model.backends.values()))


class GatewayThread:
    """A real gateway served by uvicorn on a free loopback port, in its own thread."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.app = create_app(settings)
        self.server = uvicorn.Server(server_config(self.app, replace(settings, host="127.0.0.1")))
        self._loop: asyncio.AbstractEventLoop | None = None
        # A daemon: a gateway that failed to stop (``stop`` says so) must not keep pytest from
        # exiting once the session is over.
        self._thread = threading.Thread(target=self._main, name="gateway", daemon=True)

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.server.serve()

    def call(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on the gateway's event loop (from the test's thread)."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(fn)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.settings.port}"

    @property
    def grpc_target(self) -> str:
        """host:port of the gateway's gRPC service (started with ``grpc_port=free_port()``)."""
        assert self.settings.grpc_port, "this gateway was started without gRPC"
        return f"127.0.0.1:{self.settings.grpc_port}"

    @property
    def gateway(self) -> Gateway:
        gateway: Gateway = self.app.state.gateway
        return gateway

    def start(self) -> GatewayThread:
        self._thread.start()
        wait_until(
            lambda: self.server.started or not self._thread.is_alive(),
            START_TIMEOUT_S,
            "the gateway to start",
        )
        if not self.server.started:
            raise RuntimeError("gateway did not start")
        return self

    def stop(self) -> None:
        """Stop the server as SIGTERM would; fail, naming what its event loop still runs, if it
        has not stopped within ``START_TIMEOUT_S``."""
        self.server.should_exit = True
        self._thread.join(START_TIMEOUT_S)
        if self._thread.is_alive():
            raise AssertionError(
                f"the gateway did not stop within {START_TIMEOUT_S:g} s; its tasks:\n"
                + "\n".join(_task_stacks(self._loop))
            )


def _task_stacks(loop: asyncio.AbstractEventLoop | None) -> list[str]:
    """What each task of ``loop`` (running in another thread) is awaiting, innermost last."""
    if loop is None:
        return ["(no event loop)"]
    out = []
    for task in list(asyncio.all_tasks(loop)):
        frames = task.get_stack()
        where = " <- ".join(
            f"{f.f_code.co_name} ({f.f_code.co_filename}:{f.f_lineno})" for f in frames
        )
        out.append(f"{task.get_name()}: {where or task!r}")
    return out


def stacks(
    redis_url: str, namespace: str, repo: Path
) -> tuple[Callable[..., Stack], Callable[[], None]]:
    """``(make, stop)`` for the ``stack`` fixtures: ``make(workers=1, models=(), url=None,
    **gateway_options)`` starts a gateway and workers (on ``url``, else ``redis_url``);
    ``stop()`` stops everything made, last first."""
    started: list[GatewayThread | WorkerThread] = []

    def make(
        workers: int = 1, models: tuple[str, ...] = (), url: str | None = None, **gateway: object
    ) -> Stack:
        s = Stack(url or redis_url, namespace, repo, started)
        for _ in range(workers):
            s.add_worker(models)
        s.start_gateway(**gateway)
        return s

    def stop() -> None:
        for thing in reversed(started):
            thing.stop()

    return make, stop


def binary_body(name: str, array: Any, **parameters: Any) -> tuple[bytes, dict[str, str]]:
    """A V2 request with one input as binary data (the binary tensor extension): (body,
    headers). ``parameters`` are the request's."""
    blob = np.ascontiguousarray(array, dtype="<f4").tobytes()
    tensor = {
        "name": name,
        "datatype": "FP32",
        "shape": list(np.shape(array)),
        "parameters": {"binary_data_size": len(blob)},
    }
    header = json.dumps(
        {"inputs": [tensor], **({"parameters": parameters} if parameters else {})}
    ).encode()
    return header + blob, {
        "content-type": "application/octet-stream",
        "inference-header-content-length": str(len(header)),
    }


def advertisements(redis_url: str, namespace: str) -> list[WorkerInfo]:
    """What the live workers advertise now, read as a gateway's registry reads it (the workers
    whose lease has not ended, ``producer.registry.queue_snapshot``)."""
    keys = Keys(namespace)
    with redis.Redis.from_url(redis_url) as r:
        seconds, micros = r.time()
        ids = r.zrangebyscore(keys.workers, seconds * 1000 + micros // 1000, "+inf")
        pipe = r.pipeline(transaction=False)
        queue_snapshot(pipe, keys, ids)
        workers, _, _ = parse_snapshot(ids, pipe.execute())
    return workers


class Stack:
    """A gateway and workers sharing one Redis and namespace."""

    def __init__(
        self,
        redis_url: str,
        namespace: str,
        repo: Path,
        registry: list[GatewayThread | WorkerThread],
    ) -> None:
        self.redis_url = redis_url
        self.namespace = namespace
        self.repo = repo
        self.workers: list[WorkerThread] = []
        self.gateway: GatewayThread | None = None
        self._registry = registry

    def add_worker(self, models: tuple[str, ...] = (), **options: Any) -> WorkerThread:
        settings = WorkerSettings(
            redis=RedisSettings(self.redis_url),
            namespace=self.namespace,
            model_repository=self.repo,
            models=models,
            heartbeat_s=0.5,
            block_ms=500,
        )
        worker = WorkerThread(replace(settings, **options))
        self._registry.append(worker)
        self.workers.append(worker.start())
        return worker

    def start_gateway(self, **options: Any) -> GatewayThread:
        settings = GatewaySettings(
            redis=RedisSettings(self.redis_url),
            namespace=self.namespace,
            port=free_port(),
            grpc_port=0,  # off unless a test asks for it: grpc_port=free_port()
            registry_refresh_s=0.2,
            reply_block_ms=500,
        )
        self.gateway = GatewayThread(replace(settings, **options))
        self._registry.append(self.gateway)
        self.gateway.start()
        return self.gateway

    @property
    def url(self) -> str:
        assert self.gateway is not None
        return self.gateway.url

    def wait_ready(self, model: str) -> None:
        """Until the gateway knows a live worker serves the model (workers added later)."""
        with self.client() as c:
            wait_until(
                lambda: c.get(f"/v2/models/{model}/ready").status_code == 200,
                what=f"model {model} to be ready",
            )

    def client(self, **options: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, **options)

    def infer(self, model: str, body: dict[str, Any], **options: Any) -> httpx.Response:
        with self.client() as c:
            return c.post(
                f"/v2/models/{model}/infer",
                content=json.dumps(body),
                headers={"content-type": "application/json", **options},
            )


def gateway_process(
    redis_url: str, namespace: str, port: int, *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """A real ``inferq gateway`` process (for scenarios that SIGKILL it, measure it or need its
    own file descriptors); ``env`` adds to this process's environment."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "inferq",
            "gateway",
            "--redis",
            redis_url,
            "--namespace",
            namespace,
            "--port",
            str(port),
            "--grpc-port",
            "0",
            "--log-level",
            "warning",
            *extra,
        ],
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


SOCKET_TIMEOUT_S = 10.0
"""How long a raw-socket test waits for the gateway to act: far beyond the timeouts under test."""


def connect(port: int) -> socket.socket:
    """A raw TCP connection to a local gateway, for tests that send bytes HTTP clients won't."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(SOCKET_TIMEOUT_S)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the gateway sends before it closes the connection."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)
