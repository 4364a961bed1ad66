"""Explicit model control and introspection against a real ``inferq up`` (a gateway and two
worker processes), with unmodified ``tritonclient.http`` and ``tritonclient.grpc``: a model folder
copied into the running repository is loaded, served and unloaded; the model configuration,
the repository index and the statistics read as Triton's, and the counts equal the requests
sent."""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from inferq.redisserver import RedisServer, free_port
from tests.conftest import DIGITS
from tests.support import wait_until, write_simulated_model
from tests.upstack import UpProcess, up_processes

pytestmark = pytest.mark.integration

SAMPLES = json.loads((DIGITS / "samples.json").read_text())
TOKEN = "repository-test-token"
ADMIN = {"authorization": f"Bearer {TOKEN}"}


@dataclass
class Up:
    process: UpProcess
    repo: Path
    http: str
    grpc: str

    def http_client(self) -> triton_http.InferenceServerClient:
        return triton_http.InferenceServerClient(self.http.removeprefix("http://"))

    def grpc_client(self) -> triton_grpc.InferenceServerClient:
        return triton_grpc.InferenceServerClient(self.grpc)

    def add_folder(self, name: str) -> None:
        """A new model: a copy of the digits model under another name, in the running repo."""
        shutil.copytree(self.repo / "digits", self.repo / name)


@pytest.fixture(scope="module")
def up(redis_server: RedisServer, tmp_path_factory) -> Iterator[Up]:
    repo = tmp_path_factory.mktemp("repository")
    shutil.copytree(DIGITS, repo / "digits", ignore=shutil.ignore_patterns("train.py"))
    write_simulated_model(repo, "counted", base_ms=1, per_row_ms=0, max_batch=8)
    grpc_port = free_port()
    with up_processes(redis_server.url, f"test-{uuid.uuid4().hex[:8]}", repo) as start:
        process = start(
            "--workers",
            "2",
            "--heartbeat-s",
            "0.5",
            "--grpc-port",
            str(grpc_port),
            "--admin-token",
            TOKEN,
            "--log-level",
            "warning",
        )
        process.wait_ready()
        yield Up(process, repo, process.url, f"127.0.0.1:{grpc_port}")
        assert process.stop() == 0, "\n".join(process.lines)


def digits_rows(start: int, n: int) -> np.ndarray:
    return np.array(SAMPLES["inputs"][start : start + n], dtype=np.float32)


def labels(start: int, n: int) -> list[int]:
    return list(SAMPLES["labels"][start : start + n])


def infer_http(client: triton_http.InferenceServerClient, model: str, rows: np.ndarray) -> Any:
    x = triton_http.InferInput("input", list(rows.shape), "FP32")
    x.set_data_from_numpy(rows)
    return client.infer(model, [x]).as_numpy("label").tolist()


def infer_grpc(client: triton_grpc.InferenceServerClient, model: str, rows: np.ndarray) -> Any:
    x = triton_grpc.InferInput("input", list(rows.shape), "FP32")
    x.set_data_from_numpy(rows)
    return client.infer(model, [x]).as_numpy("label").tolist()


# -- explicit control -------------------------------------------------------------------------


def test_a_folder_added_while_running_is_loaded_served_and_unloaded_over_plain_http(up):
    up.add_folder("added-curl")
    with httpx.Client(base_url=up.http, timeout=60) as c:
        r = c.post("/v2/repository/models/added-curl/load", headers=ADMIN)
        assert r.status_code == 200, r.text
        assert r.json()["versions"] == ["1"] and r.json()["workers"]
        assert c.get("/v2/models/added-curl/ready").status_code == 200
        # A worker whose heartbeat had not listed the folder yet loads it at the commit.
        wait_until(
            lambda: c.get("/v2/models/added-curl").json()["parameters"]["workers"] == 2,
            what="both workers serving it",
        )
        body = {
            "inputs": [
                {
                    "name": "input",
                    "datatype": "FP32",
                    "shape": [2, 64],
                    "data": SAMPLES["inputs"][:2],
                }
            ]
        }
        answer = c.post("/v2/models/added-curl/infer", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"][1]["data"] == labels(0, 2)
        assert c.post("/v2/repository/models/added-curl/unload", headers=ADMIN).status_code == 200
        assert c.get("/v2/models/added-curl/ready").status_code == 503
        assert c.post("/v2/models/added-curl/infer", json=body).status_code == 503


def test_a_folder_added_while_running_is_loaded_and_unloaded_by_tritonclient_http(up):
    up.add_folder("added-http")
    client = up.http_client()
    assert not client.is_model_ready("added-http")
    client.load_model("added-http", headers=ADMIN)
    assert client.is_model_ready("added-http")
    assert infer_http(client, "added-http", digits_rows(3, 4)) == labels(3, 4)
    client.unload_model("added-http", headers=ADMIN)
    assert not client.is_model_ready("added-http")
    with pytest.raises(InferenceServerException, match="is unloaded"):
        infer_http(client, "added-http", digits_rows(0, 1))
    client.close()


def test_a_folder_added_while_running_is_loaded_and_unloaded_by_tritonclient_grpc(up):
    up.add_folder("added-grpc")
    client = up.grpc_client()
    client.load_model("added-grpc", headers=ADMIN)
    assert client.is_model_ready("added-grpc")
    assert infer_grpc(client, "added-grpc", digits_rows(5, 3)) == labels(5, 3)
    client.unload_model("added-grpc", headers=ADMIN)
    assert not client.is_model_ready("added-grpc")
    client.close()


# -- introspection ----------------------------------------------------------------------------


def test_get_model_config_over_http_and_grpc(up):
    http = up.http_client().get_model_config("digits")
    grpc = up.grpc_client().get_model_config("digits", as_json=True)["config"]
    for config in (http, grpc):
        assert config["name"] == "digits"
        assert config["platform"] == "onnxruntime_onnx" and config["backend"] == "onnx"
        assert int(config["max_batch_size"]) == 64
        assert [
            (i["name"], i["data_type"], [int(d) for d in i["dims"]]) for i in config["input"]
        ] == [("input", "TYPE_FP32", [64])]
        assert {o["name"] for o in config["output"]} == {"logits", "label"}
        assert int(config["dynamic_batching"]["max_queue_delay_microseconds"]) == 2000
    proto = up.grpc_client().get_model_config("counted").config
    assert proto.backend == "simulated" and proto.max_batch_size == 8
    assert [d for d in proto.input[0].dims] == [4]


def test_get_model_repository_index_over_http_and_grpc(up):
    up.add_folder("listed")
    expected = {"name": "listed", "state": "UNAVAILABLE", "reason": "not loaded"}

    def listed() -> bool:
        rows = up.http_client().get_model_repository_index(headers=ADMIN)
        return expected in rows

    wait_until(listed, what="the new folder in the index")
    rows = up.http_client().get_model_repository_index(headers=ADMIN)
    assert {"name": "digits", "version": "1", "state": "READY"} in [
        {k: r.get(k) for k in ("name", "version", "state")} for r in rows
    ]
    grpc = up.grpc_client().get_model_repository_index(headers=ADMIN, as_json=True)["models"]
    assert {"name": "listed", "state": "UNAVAILABLE", "reason": "not loaded"} in grpc
    assert {"name": "digits", "version": "1", "state": "READY"} in [
        {k: r.get(k) for k in ("name", "version", "state")} for r in grpc
    ]


def test_get_inference_statistics_counts_every_request_sent(up, capsys):
    http, grpc = up.http_client(), up.grpc_client()
    sent = rows = 0
    for i in range(30):
        n = 1 + i % 4
        x = np.full((n, 4), float(i), dtype=np.float32)
        if i % 2:
            t = triton_grpc.InferInput("x", [n, 4], "FP32")
            t.set_data_from_numpy(x)
            grpc.infer("counted", [t])
        else:
            t = triton_http.InferInput("x", [n, 4], "FP32")
            t.set_data_from_numpy(x)
            http.infer("counted", [t])
        sent, rows = sent + 1, rows + n

    def stats() -> dict[str, Any]:
        [row] = http.get_inference_statistics("counted")["model_stats"]
        return row

    wait_until(
        lambda: stats()["inference_stats"]["success"]["count"] == sent,
        timeout_s=20,
        what="both workers' counts published",
    )
    row = stats()
    with capsys.disabled():
        print(f"\ntriton-stats[{sent} requests, {rows} rows, 2 worker processes]: {row}")
    assert (row["name"], row["version"]) == ("counted", "1")
    assert row["inference_count"] == rows
    assert row["inference_stats"]["fail"]["count"] == 0
    assert row["inference_stats"]["queue"]["count"] == sent
    assert 1 <= row["execution_count"] <= sent
    assert sum(b["compute_infer"]["count"] for b in row["batch_stats"]) == row["execution_count"]
    by_grpc = grpc.get_inference_statistics("counted", "1").model_stats
    assert [(s.name, s.version, s.inference_count) for s in by_grpc] == [("counted", "1", rows)]
    assert by_grpc[0].inference_stats.success.count == sent
    everything = grpc.get_inference_statistics(as_json=True)["model_stats"]
    assert {"digits", "counted"} <= {s["name"] for s in everything}
    with pytest.raises(InferenceServerException):
        http.get_inference_statistics("nosuch")
