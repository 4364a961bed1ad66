"""Text in, embeddings out, through real HTTP, Redis, a gateway and a worker."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from consumer.backends import create_backend
from consumer.repository import load_config
from tests.support import GatewayThread, Stack, WorkerThread

TEXTS = ["a", "bb cc", "A longer sentence, so that the batch needs padding to its length."]


@pytest.fixture
def minilm_stack(redis_url: str, namespace: str, minilm_repo: Path) -> Iterator[Stack]:
    started: list[GatewayThread | WorkerThread] = []
    stack = Stack(redis_url, namespace, minilm_repo, started)
    try:
        stack.add_worker()
        stack.start_gateway()
        stack.wait_ready("minilm")
        yield stack
    finally:
        for thing in reversed(started):
            thing.stop()


def test_texts_sent_as_v2_bytes_come_back_as_their_embeddings(minilm_stack, minilm_repo):
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [3], "data": TEXTS}]}
    r = minilm_stack.infer("minilm", body)
    assert r.status_code == 200, r.text
    (output,) = r.json()["outputs"]
    assert output["name"] == "embedding" and output["datatype"] == "FP32"
    assert output["shape"] == [3, 384]
    got = np.array(output["data"], dtype=np.float32).reshape(3, 384)

    backend = create_backend(load_config(minilm_repo, "minilm"), "1")
    backend.load()
    alone = [backend.predict({"text": np.array([t.encode()], dtype=object)}) for t in TEXTS]
    backend.unload()
    assert np.abs(got - np.concatenate([a["embedding"] for a in alone])).max() < 1e-5

    # Text that is not UTF-8 can only arrive as binary data: the worker answers it as a client
    # error, which the gateway returns as 400.
    raw = b"caf\xe9"
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "text",
                    "datatype": "BYTES",
                    "shape": [1],
                    "parameters": {"binary_data_size": 4 + len(raw)},
                }
            ]
        }
    ).encode()
    with minilm_stack.client() as c:
        r = c.post(
            "/v2/models/minilm/infer",
            content=header + struct.pack("<I", len(raw)) + raw,
            headers={
                "content-type": "application/octet-stream",
                "inference-header-content-length": str(len(header)),
            },
        )
    assert r.status_code == 400, r.text
    assert "input 'text' is not valid UTF-8 text" in r.json()["error"]


def test_tritonclient_sends_text_unmodified_json_and_binary(minilm_stack):
    """Triton's own HTTP client, as existing code would call it: BYTES as binary data and as
    JSON, the embedding back as binary data."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(minilm_stack.url.removeprefix("http://"))
    try:
        texts = np.array([b"A man is eating food.", b"A man is eating a piece of bread."], object)
        results = []
        for binary in (True, False):
            text = httpclient.InferInput("text", [2], "BYTES")
            text.set_data_from_numpy(texts, binary_data=binary)
            out = httpclient.InferRequestedOutput("embedding", binary_data=True)
            results.append(client.infer("minilm", [text], outputs=[out]).as_numpy("embedding"))
    finally:
        client.close()
    for got in results:
        assert got.shape == (2, 384) and got.dtype == np.float32
        assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
        assert float(got[0] @ got[1]) > 0.5  # paraphrases
    assert np.abs(results[0] - results[1]).max() < 1e-6
