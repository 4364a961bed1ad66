"""A plain gRPC client generated from the KServe V2 proto, and bad input over gRPC.

The client is what a KServe user has: ``grpc_tools.protoc`` run on the proto (package
``inference``, as KServe publishes it) and the generated ``GRPCInferenceServiceStub``, in a
process of its own. The bad-input tests send what no well-behaved client would, through
inferq's own stub, and expect a clean status with the HTTP API's message, never INTERNAL.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import numpy as np
import pytest
import redis

from inferq.redisserver import free_port
from protocol.cancellation import CHECK_AFTER_MS
from protocol.grpc import inferq_v2_pb2 as pb
from protocol.grpc.service import SERVICE, Stub
from protocol.keys import Keys
from tests.support import wait_until

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).parents[2]
SAMPLES = json.loads((REPO_ROOT / "models/digits/samples.json").read_text())
TOKEN = "kserve-test-token"

KSERVE_CLIENT = textwrap.dedent(
    """
    import json, sys
    import grpc
    import numpy as np
    import inference_pb2 as pb
    import inference_pb2_grpc as rpc

    target, token = sys.argv[1], sys.argv[2]
    rows = np.array(json.loads(sys.argv[3]), dtype=np.float32)
    stub = rpc.GRPCInferenceServiceStub(grpc.insecure_channel(target))
    out = {}

    def status(call):
        try:
            call()
        except grpc.RpcError as e:
            return [e.code().name, e.details()]
        return ["OK", ""]

    out["live"] = stub.ServerLive(pb.ServerLiveRequest()).live
    out["ready"] = stub.ServerReady(pb.ServerReadyRequest()).ready
    out["model_ready"] = stub.ModelReady(pb.ModelReadyRequest(name="digits")).ready
    meta = stub.ModelMetadata(pb.ModelMetadataRequest(name="digits"))
    out["inputs"] = [[t.name, t.datatype, list(t.shape)] for t in meta.inputs]

    def infer(typed, **parameters):
        request = pb.ModelInferRequest(model_name="digits", id="k1")
        tensor = request.inputs.add(name="input", datatype="FP32", shape=list(rows.shape))
        if typed:
            tensor.contents.fp32_contents.extend(rows.ravel().tolist())
        else:
            request.raw_input_contents.append(rows.tobytes())
        request.outputs.add(name="label")
        for key, value in parameters.items():
            if isinstance(value, str):
                request.parameters[key].string_param = value
            else:
                request.parameters[key].int64_param = value
        return stub.ModelInfer(request, timeout=20)

    raw = infer(False, priority=1, timeout=10_000_000)
    out["raw"] = [raw.id, [o.name for o in raw.outputs],
                  np.frombuffer(raw.raw_output_contents[0], "<i8").tolist()]
    typed = infer(True)
    out["typed"] = [len(typed.raw_output_contents), list(typed.outputs[0].contents.int64_contents)]
    out["bad_priority"] = status(lambda: infer(False, priority="high"))
    request = pb.ModelInferRequest(model_name="digits")
    request.inputs.add(name="input", datatype="FP32", shape=[1, 3]).contents.fp32_contents.extend(
        [0.0, 0.0, 0.0])
    out["bad_shape"] = status(lambda: stub.ModelInfer(request))
    out["unknown_model"] = status(
        lambda: stub.ModelMetadata(pb.ModelMetadataRequest(name="nope")))
    out["index_without_token"] = status(
        lambda: stub.RepositoryIndex(pb.RepositoryIndexRequest()))
    index = stub.RepositoryIndex(
        pb.RepositoryIndexRequest(ready=True), metadata=[("authorization", "Bearer " + token)])
    out["index"] = sorted(m.name for m in index.models)
    print(json.dumps(out))
    """
)


@pytest.fixture
def grpc_stack(stack):
    return stack(grpc_port=free_port(), admin_token=TOKEN, max_body_bytes=64 * 1024)


def test_a_client_generated_from_the_kserve_proto_works(grpc_stack, tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{REPO_ROOT / 'protocol/grpc'}",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            "inference.proto",
        ],
        check=True,
    )
    assert "package inference;" in (REPO_ROOT / "protocol/grpc/inference.proto").read_text()
    (tmp_path / "client.py").write_text(KSERVE_CLIENT)
    result = subprocess.run(
        [
            sys.executable,
            "client.py",
            grpc_stack.gateway.grpc_target,
            TOKEN,
            json.dumps(SAMPLES["inputs"]),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=45,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["live"] and out["ready"] and out["model_ready"]
    assert out["inputs"] == [["input", "FP32", [-1, 64]]]
    assert out["raw"] == ["k1", ["label"], SAMPLES["labels"]]
    assert out["typed"] == [0, SAMPLES["labels"]]  # typed in, typed out
    assert out["bad_priority"] == [
        "INVALID_ARGUMENT",
        "parameter 'priority' must be a non-negative integer (1 is highest)",
    ]
    assert out["bad_shape"] == [
        "INVALID_ARGUMENT",
        "input 'input' has shape [1, 3] but model 'digits' expects [-1, 64]",
    ]
    assert out["unknown_model"][0] == "NOT_FOUND"
    assert out["index_without_token"][0] == "UNAUTHENTICATED"
    assert "digits" in out["index"]


def infer_request(
    shape: list[int], *, datatype: str = "FP32", model: str = "digits"
) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="input" if model == "digits" else "x", datatype=datatype, shape=shape)
    return request


def raw(shape: list[int], data: bytes, **kwargs: str) -> pb.ModelInferRequest:
    request = infer_request(shape, **kwargs)
    request.raw_input_contents.append(data)
    return request


def typed(shape: list[int], field: str, values: list, **kwargs: str) -> pb.ModelInferRequest:
    request = infer_request(shape, **kwargs)
    getattr(request.inputs[0].contents, field).extend(values)
    return request


def bad_inputs() -> dict[str, tuple[pb.ModelInferRequest, str]]:
    """Each bad request, and the message it must get."""
    both = raw([1, 64], bytes(256))
    both.inputs[0].contents.fp32_contents.extend([0.0] * 64)
    extra = raw([1, 64], bytes(256))
    extra.raw_input_contents.append(b"")
    return {
        "huge declared shape, raw": (
            raw([2**40, 64], bytes(256)),
            "input 'input': raw_input_contents[0] does not fit: tensor 'input': shape "
            f"[{2**40}, 64] of FP32 needs {2**40 * 256} bytes, the data holds 256",
        ),
        "huge declared shape, typed": (
            typed([2**62, 4], "fp32_contents", [1.0] * 4, model="sim"),
            f"input 'x': shape [{2**62}, 4] needs {2**64} elements, got 4",
        ),
        "raw contents shorter than the shape": (
            raw([2, 64], bytes(511)),
            "input 'input': raw_input_contents[0] does not fit: tensor 'input': shape [2, 64] "
            "of FP32 needs 512 bytes, the data holds 511",
        ),
        "more raw entries than inputs": (
            extra,
            "raw_input_contents has 2 entries but the request has 1 inputs: send one entry per "
            "input, in the order of 'inputs'",
        ),
        "raw and typed at once": (
            both,
            "the request has both raw_input_contents and typed 'contents': send every input "
            "one way or the other",
        ),
        "unknown datatype": (
            raw([1, 64], bytes(256), datatype="FP128"),
            "input 'input' has unknown datatype 'FP128' (V2 datatypes are BOOL, BYTES, FP16, "
            "FP32, FP64, INT16, INT32, INT64, INT8, UINT16, UINT32, UINT64, UINT8); model "
            "'digits' expects FP32",
        ),
        "values in the wrong typed field": (
            typed([1, 64], "int_contents", [1] * 64),
            "input 'input' is FP32: its values go in contents.fp32_contents, found "
            "contents.int_contents",
        ),
        "no inputs": (
            pb.ModelInferRequest(model_name="digits"),
            "request needs 'inputs', a non-empty list of input tensors (model 'digits' takes "
            "'input' (FP32 [-1, 64]))",
        ),
        "negative dimension": (
            raw([-1, 64], bytes(256)),
            "input 'input': 'shape' must be a list of non-negative integers, got [-1, 64]",
        ),
    }


def test_bad_input_gets_invalid_argument_with_the_http_message(grpc_stack):
    with grpc.insecure_channel(grpc_stack.gateway.grpc_target) as channel:
        stub = Stub(channel)
        for what, (request, message) in bad_inputs().items():
            with pytest.raises(grpc.RpcError) as error:
                stub.ModelInfer(request, timeout=10)
            assert (error.value.code(), error.value.details()) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                message,
            ), what
        # Still serving, and the same request done right is answered.
        good = raw([1, 64], np.array(SAMPLES["inputs"][:1], np.float32).tobytes())
        answer = stub.ModelInfer(good, timeout=10)
        assert np.frombuffer(answer.raw_output_contents[1], "<i8").tolist() == SAMPLES["labels"][:1]


def test_undecodable_and_oversized_messages_get_clean_statuses(grpc_stack):
    with grpc.insecure_channel(grpc_stack.gateway.grpc_target) as channel:
        garbage = channel.unary_unary(f"/{SERVICE}/ModelInfer")
        with pytest.raises(grpc.RpcError) as error:
            garbage(b"\xff\xff\xff\xff\x0f", timeout=10)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid inference.ModelInferRequest message" in error.value.details()
        # 64 KiB is this gateway's --max-body-bytes; 100 KB is refused before it is parsed.
        with pytest.raises(grpc.RpcError) as error:
            Stub(channel).ModelInfer(raw([400, 64], bytes(400 * 256)), timeout=10)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        unknown = channel.unary_unary(f"/{SERVICE}/TraceSetting")
        with pytest.raises(grpc.RpcError) as error:
            unknown(b"", timeout=10)
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert Stub(channel).ServerLive(pb.ServerLiveRequest(), timeout=10).live


def test_a_cancelled_call_is_abandoned_like_a_disconnected_http_client(grpc_stack, redis_url):
    """The gateway stops waiting at once, and the worker, which had not started the request,
    drops it unrun."""
    gateway = grpc_stack.gateway.gateway
    worker = grpc_stack.workers[0]
    request = pb.ModelInferRequest(model_name="sim")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    request.raw_input_contents.append(bytes(16))
    with grpc.insecure_channel(grpc_stack.gateway.grpc_target) as channel:
        stub = Stub(channel)
        assert stub.ModelInfer(request, timeout=10).model_name == "sim"  # warm and known
        ran_before = worker.stats.requests
        with worker.paused(), redis.Redis.from_url(redis_url) as r:
            call = stub.ModelInfer.future(request, timeout=30)
            wait_until(lambda: gateway.service.waiters.count("sim") == 1, what="the call queued")
            assert call.cancel()
            wait_until(
                lambda: gateway.service.waiters.count("sim") == 0 and gateway.replies.waiting == 0,
                what="the gateway to stop waiting for the cancelled call",
            )
            marks = Keys(grpc_stack.namespace).cancelled("sim")
            wait_until(lambda: r.zcard(marks) == 1, what="the request marked cancelled")
            queued_at = redis_ms(r)
            wait_until(
                lambda: redis_ms(r) >= queued_at + CHECK_AFTER_MS,
                what="the request to have waited long enough for workers to look it up",
            )
        wait_until(lambda: worker.stats.cancelled == 1, what="the worker to drop it")
    assert call.cancelled() and worker.stats.requests == ran_before
    cancelled = gateway.metrics.registry.get_sample_value(
        "inferq_gateway_requests_total",
        {"model": "sim", "version": "1", "endpoint": "infer", "status": "499", "protocol": "grpc"},
    )
    assert cancelled == 1


def redis_ms(r: redis.Redis) -> int:
    seconds, micros = r.time()
    return seconds * 1000 + micros // 1000


def test_two_gateways_on_one_host_share_the_grpc_port(stack):
    """As `inferq up --gateways N` runs them: both listen (SO_REUSEPORT); when one stops, new
    connections reach the other."""
    port = free_port()
    s = stack(grpc_port=port)
    first = s.gateway
    second = s.start_gateway(grpc_port=port)
    assert second.server.started
    first.stop()
    s.wait_ready("digits")  # over HTTP, on the second gateway
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = raw([1, 64], np.array(SAMPLES["inputs"][4:5], np.float32).tobytes())
        answer = Stub(channel).ModelInfer(request, timeout=10)
    assert np.frombuffer(answer.raw_output_contents[1], "<i8").tolist() == SAMPLES["labels"][4:5]


def test_no_live_worker_is_unavailable_with_retry_after(grpc_stack):
    grpc_stack.workers[0].stop()
    with grpc.insecure_channel(grpc_stack.gateway.grpc_target) as channel:
        stub = Stub(channel)
        wait_until(
            lambda: not stub.ModelReady(pb.ModelReadyRequest(name="digits"), timeout=10).ready,
            what="the model to be reported not ready",
        )
        with pytest.raises(grpc.RpcError) as error:
            stub.ModelInfer(raw([1, 64], bytes(256)), timeout=10)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert error.value.details().startswith("no live worker serves model 'digits'")
    assert ("retry-after", "5") in error.value.trailing_metadata()


def test_a_message_past_the_inflight_byte_cap_is_refused_as_over_http(stack):
    s = stack(grpc_port=free_port(), max_inflight_bytes=8192)
    with grpc.insecure_channel(s.gateway.grpc_target) as channel:
        stub = Stub(channel)
        small = stub.ModelInfer(raw([20, 64], bytes(20 * 256)), timeout=10)  # ~5 KB: admitted
        assert len(small.raw_output_contents[1]) == 20 * 8
        with pytest.raises(grpc.RpcError) as error:
            stub.ModelInfer(raw([40, 64], bytes(40 * 256)), timeout=10)  # ~10 KB: never
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than this gateway admits at once" in error.value.details()
    assert s.gateway.gateway.service.inflight.held == 0  # every hold given back
