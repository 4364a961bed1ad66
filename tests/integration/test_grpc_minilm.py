"""Text over gRPC: BYTES inputs, raw (tritonclient.grpc) and typed (bytes_contents), to minilm."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton

from inferq.redisserver import free_port
from protocol.grpc import inferq_v2_pb2 as pb
from protocol.grpc.service import Stub
from tests.support import GatewayThread, Stack, WorkerThread

pytestmark = pytest.mark.integration

TEXTS = [b"A man is eating food.", b"A man is eating a piece of bread.", b"The sky is blue."]


@pytest.fixture
def minilm_grpc(redis_url: str, namespace: str, minilm_repo: Path) -> Iterator[Stack]:
    started: list[GatewayThread | WorkerThread] = []
    stack = Stack(redis_url, namespace, minilm_repo, started)
    try:
        stack.add_worker()
        stack.start_gateway(grpc_port=free_port())
        stack.wait_ready("minilm")
        yield stack
    finally:
        for thing in reversed(started):
            thing.stop()


def test_bytes_inputs_raw_and_typed_give_the_same_embeddings(minilm_grpc):
    client = triton.InferenceServerClient(minilm_grpc.gateway.grpc_target)
    text = triton.InferInput("text", [3], "BYTES")
    text.set_data_from_numpy(np.array(TEXTS, dtype=object))
    raw = client.infer("minilm", [text], client_timeout=30).as_numpy("embedding")
    client.close()

    request = pb.ModelInferRequest(model_name="minilm")
    request.inputs.add(name="text", datatype="BYTES", shape=[3]).contents.bytes_contents.extend(
        TEXTS
    )
    with grpc.insecure_channel(minilm_grpc.gateway.grpc_target) as channel:
        answer = Stub(channel).ModelInfer(request, timeout=30)
    (output,) = answer.outputs
    assert (output.name, output.datatype, list(output.shape)) == ("embedding", "FP32", [3, 384])
    typed = np.array(output.contents.fp32_contents, dtype=np.float32).reshape(3, 384)

    assert raw.shape == (3, 384) and raw.dtype == np.float32
    assert np.allclose(np.linalg.norm(raw, axis=1), 1.0, atol=1e-5)
    assert float(raw[0] @ raw[1]) > float(raw[0] @ raw[2])  # paraphrases beat unrelated
    assert np.abs(raw - typed).max() < 1e-6
