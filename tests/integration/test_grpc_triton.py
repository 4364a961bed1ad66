"""tritonclient.grpc, unmodified, against a real ``inferq up`` (a gateway and a worker process)
on the suite's private redis-server: what existing Triton gRPC code does, it can do here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from inferq.redisserver import RedisServer, free_port
from protocol.keys import Keys, Lane
from tests.support import checkout_env, wait_until

pytestmark = pytest.mark.integration

SAMPLES = json.loads((Path(__file__).parents[2] / "models/digits/samples.json").read_text())
TOKEN = "grpc-test-token"


@dataclass
class Up:
    process: subprocess.Popen[str]
    namespace: str
    http: str
    grpc: str
    redis_url: str

    def client(self) -> triton.InferenceServerClient:
        return triton.InferenceServerClient(self.grpc)

    def worker_pids(self) -> list[int]:
        """The worker processes this ``inferq up`` started (their argv names the namespace)."""
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"worker" in argv and self.namespace.encode() in argv:
                found.append(int(pid))
        return found


@pytest.fixture(scope="module")
def up(redis_server: RedisServer, model_repo: Path, tmp_path_factory) -> Iterator[Up]:
    namespace = f"test-{uuid.uuid4().hex[:8]}"
    http_port, grpc_port = free_port(), free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "inferq",
            "up",
            "--redis",
            redis_server.url,
            "--namespace",
            namespace,
            "--port",
            str(http_port),
            "--grpc-port",
            str(grpc_port),
            "--metrics-port",
            "0",
            "--model-repository",
            str(model_repo),
            "--models",
            "digits,sim,slow",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=checkout_env(PYTHONUNBUFFERED="1", INFERQ_ADMIN_TOKEN=TOKEN),
        cwd=tmp_path_factory.mktemp("up"),  # nothing it writes lands in the checkout
    )
    output: list[str] = []
    serving = threading.Event()

    def read() -> None:  # keeps the pipe drained for the whole module
        assert process.stdout is not None
        for line in process.stdout:
            output.append(line)
            if "inferq is serving at" in line:
                serving.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_until(lambda: serving.is_set() or process.poll() is not None, 45, "inferq up to serve")
        assert serving.is_set(), "".join(output)
        assert f"gRPC at 127.0.0.1:{grpc_port}" in "".join(output)
        yield Up(
            process,
            namespace,
            f"http://127.0.0.1:{http_port}",
            f"127.0.0.1:{grpc_port}",
            redis_server.url,
        )
    finally:
        process.send_signal(signal.SIGINT)
        try:
            code = process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()  # never leave it running (a ResourceWarning in a later test)
            code = process.wait(10)
        finally:
            reader.join(5)
            if process.stdout is not None:
                process.stdout.close()
        assert code == 0, "".join(output)


def digits_input(rows: np.ndarray) -> triton.InferInput:
    x = triton.InferInput("input", list(rows.shape), "FP32")
    x.set_data_from_numpy(rows.astype(np.float32))
    return x


def status_of(call) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as error:
        call()
    return error.value.status(), error.value.message()


def test_live_ready_and_metadata(up):
    client = up.client()
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("digits")
    assert client.is_model_ready("digits", "1")
    assert not client.is_model_ready("no-such-model")
    server = client.get_server_metadata(as_json=True)
    assert server["name"] == "inferq"
    assert "schedule_policy" in server["extensions"]
    meta = client.get_model_metadata("digits", as_json=True)
    assert meta["name"] == "digits" and meta["versions"] == ["1"]
    assert meta["platform"] == "onnxruntime_onnx"
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": ["-1", "64"]}]
    assert [o["name"] for o in meta["outputs"]] == ["logits", "label"]
    client.close()


def test_batched_digits_are_classified_like_the_held_out_labels(up):
    """All ten held-out samples in one request, four requests at once (async_infer), each
    answer checked row by row against its own request's labels."""
    client = up.client()
    rows = np.array(SAMPLES["inputs"], dtype=np.float32)
    labels = np.array(SAMPLES["labels"])
    answers: dict[int, object] = {}
    done = threading.Event()
    orders = [np.random.default_rng(seed).permutation(len(rows)) for seed in range(4)]

    def callback(index: int):
        def record(result, error) -> None:
            answers[index] = error if error is not None else result
            if len(answers) == len(orders):
                done.set()

        return record

    for index, order in enumerate(orders):
        client.async_infer(
            "digits",
            [digits_input(rows[order])],
            callback(index),
            request_id=f"batch-{index}",
            client_timeout=20,
        )
    assert done.wait(30)
    correct = 0
    for index, order in enumerate(orders):
        result = answers[index]
        assert not isinstance(result, Exception), result
        assert result.get_response().id == f"batch-{index}"
        got = result.as_numpy("label")
        assert result.as_numpy("logits").shape == (len(rows), 10)
        correct += int((got == labels[order]).sum())
    assert correct == len(orders) * len(rows)
    client.close()


def test_errors_have_the_http_errors_status_and_message(up):
    client = up.client()
    code, message = status_of(lambda: client.infer("digits", [digits_input(np.zeros((1, 63)))]))
    assert code == "StatusCode.INVALID_ARGUMENT"
    assert message == "input 'input' has shape [1, 63] but model 'digits' expects [-1, 64]"
    code, message = status_of(lambda: client.infer("nope", [digits_input(np.zeros((1, 64)))]))
    assert code == "StatusCode.NOT_FOUND"
    assert message.startswith("unknown model 'nope' (models served: ")
    code, _ = status_of(lambda: client.get_model_metadata("digits", "7"))
    assert code == "StatusCode.NOT_FOUND"
    client.close()


def test_a_deadline_passing_while_the_workers_are_paused_is_deadline_exceeded(up):
    client = up.client()
    workers = up.worker_pids()
    assert len(workers) == 1
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        # The gRPC deadline, and the V2 timeout parameter on its own: both become the request's.
        code, message = status_of(
            lambda: client.infer("digits", [digits_input(np.zeros((1, 64)))], client_timeout=0.4)
        )
        assert code == "StatusCode.DEADLINE_EXCEEDED"
        code, message = status_of(
            lambda: client.infer(
                "digits", [digits_input(np.ones((1, 64)))], timeout=300_000, client_timeout=20
            )
        )
        assert code == "StatusCode.DEADLINE_EXCEEDED"
        assert "did not answer within the request's deadline of 300 ms" in message
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGCONT)
    assert client.infer("digits", [digits_input(np.zeros((1, 64)))]).as_numpy("label").shape == (1,)
    client.close()


def test_priority_picks_the_lane_and_timeout_bounds_the_wait(up):
    client = up.client()
    keys = Keys(up.namespace)
    r = redis.Redis.from_url(up.redis_url)

    def added(lane: Lane) -> int:
        """Entries ever added to the lane's stream (workers delete what they have answered)."""
        try:
            return int(r.xinfo_stream(keys.stream("sim", lane))["entries-added"])
        except redis.ResponseError:  # no such stream yet
            return 0

    lanes = {lane: added(lane) for lane in (Lane.HIGH, Lane.NORMAL, Lane.LOW)}
    x = triton.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(np.full((1, 4), 2.0, np.float32))
    assert client.infer("sim", [x], priority=1).as_numpy("sum").tolist() == [[8.0]]
    assert client.infer("sim", [x], priority=2).as_numpy("sum").tolist() == [[8.0]]
    assert {lane: added(lane) - n for lane, n in lanes.items()} == {
        Lane.HIGH: 1,
        Lane.NORMAL: 0,
        Lane.LOW: 1,
    }
    r.close()
    # slow takes 300 ms a batch: a 100 ms timeout cannot be met, a 5 s one can.
    y = triton.InferInput("x", [1, 4], "FP32")
    y.set_data_from_numpy(np.ones((1, 4), np.float32))
    code, _ = status_of(lambda: client.infer("slow", [y], timeout=100_000))
    assert code in ("StatusCode.DEADLINE_EXCEEDED", "StatusCode.RESOURCE_EXHAUSTED")
    assert client.infer("slow", [y], timeout=5_000_000).as_numpy("sum").tolist() == [[4.0]]
    client.close()


def test_the_stream_answers_every_request_by_id(up):
    client = up.client()
    answers: dict[str, object] = {}
    done = threading.Event()

    def record(result, error) -> None:
        if error is not None:
            answers[f"error-{len(answers)}"] = error
        else:
            answers[result.get_response().id] = result
        if len(answers) == 11:
            done.set()

    client.start_stream(record)
    rows = np.array(SAMPLES["inputs"], dtype=np.float32)
    for i, row in enumerate(rows):
        client.async_stream_infer("digits", [digits_input(row[None, :])], request_id=f"s{i}")
    client.async_stream_infer("digits", [digits_input(np.zeros((1, 3)))], request_id="bad")
    assert done.wait(30)
    client.stop_stream()
    errors = [v for k, v in answers.items() if k.startswith("error-")]
    assert len(errors) == 1 and "has shape [1, 3]" in str(errors[0])
    for i, label in enumerate(SAMPLES["labels"]):
        assert answers[f"s{i}"].as_numpy("label").tolist() == [label]
    client.close()


def test_repository_calls_need_the_admin_token(up):
    client = up.client()
    code, message = status_of(lambda: client.get_model_repository_index())
    assert code == "StatusCode.UNAUTHENTICATED"
    assert "needs the admin token" in message
    code, _ = status_of(
        lambda: client.unload_model("digits", headers={"authorization": "Bearer wrong"})
    )
    assert code == "StatusCode.PERMISSION_DENIED"
    assert client.is_model_ready("digits")

    admin = {"authorization": f"Bearer {TOKEN}"}
    index = client.get_model_repository_index(headers=admin, as_json=True)["models"]
    assert {"name": "digits", "version": "1", "state": "READY"} in [
        {k: m.get(k) for k in ("name", "version", "state")} for m in index
    ]
    client.unload_model("digits", headers=admin)
    assert not client.is_model_ready("digits")
    code, message = status_of(lambda: client.infer("digits", [digits_input(np.zeros((1, 64)))]))
    assert code == "StatusCode.UNAVAILABLE" and "is unloaded" in message
    client.load_model("digits", headers=admin)
    assert client.is_model_ready("digits")
    result = client.infer("digits", [digits_input(np.array(SAMPLES["inputs"][3:4]))])
    assert result.as_numpy("label").tolist() == SAMPLES["labels"][3:4]
    code, _ = status_of(lambda: client.load_model("digits", headers=admin, config="{}"))
    assert code == "StatusCode.INVALID_ARGUMENT"
    client.close()


def test_grpc_calls_are_counted_with_their_protocol(up):
    client = up.client()
    client.infer("digits", [digits_input(np.zeros((1, 64)))])
    client.close()
    text = httpx.get(f"{up.http}/metrics", timeout=10).text
    line = next(
        line
        for line in text.splitlines()
        if line.startswith("inferq_gateway_requests_total{")
        and 'endpoint="infer"' in line
        and 'protocol="grpc"' in line
        and 'status="200"' in line
    )
    assert float(line.rsplit(" ", 1)[1]) >= 1
