"""``inferq loadgen --protocol grpc``: closed and open loops of ModelInfer calls against a real
gateway and worker; every answer is counted by the HTTP status its gRPC code stands for."""

from __future__ import annotations

import json

import pytest

from inferq.redisserver import free_port
from loadgen.cli import main
from protocol.exits import EXIT_FAILED, EXIT_OK

pytestmark = pytest.mark.integration


def run(tmp_path, target: str, *flags: str) -> dict:
    out = tmp_path / "result.json"
    code = main(
        [
            "--protocol",
            "grpc",
            "--url",
            f"http://{target}",
            "--warmup",
            "0",
            "--json",
            str(out),
            "--no-progress",
            *flags,
        ],
        environ={},
    )
    return {"exit": code, **json.loads(out.read_text())}


def test_closed_and_open_loops_over_grpc_count_every_answer(stack, tmp_path):
    s = stack(grpc_port=free_port())
    gateway = s.gateway.gateway
    target = s.gateway.grpc_target

    closed = run(tmp_path, target, "-m", "sim", "-c", "4", "-d", "5s", "--max-requests", "300")
    assert closed["exit"] == EXIT_OK and closed["config"]["protocol"] == "grpc"
    assert closed["requests"] == 300 and closed["status_counts"] == {"200": 300}

    opened = run(tmp_path, target, "-m", "digits", "--rate", "200", "-d", "1s", "--rows", "4")
    assert opened["exit"] == EXIT_OK and opened["mode"] == "open"
    assert opened["status_counts"] == {"200": opened["requests"]} and opened["requests"] > 100

    def answered(model: str) -> float:
        labels = {"model": model, "version": "1", "endpoint": "infer", "status": "200"}
        value = gateway.metrics.registry.get_sample_value(
            "inferq_gateway_requests_total", {**labels, "protocol": "grpc"}
        )
        return value or 0.0

    # The gateway answered at least every request the load generator counted (warm-up and
    # the last in flight are not measured).
    assert answered("sim") >= 300 and answered("digits") >= opened["requests"]


def test_an_unknown_model_fails_the_run_with_the_servers_message(stack, tmp_path, capsys):
    s = stack(grpc_port=free_port())
    out = tmp_path / "result.json"
    code = main(
        ["--protocol", "grpc", "--url", f"http://{s.gateway.grpc_target}", "-m", "nope"],
        environ={},
    )
    assert code == EXIT_FAILED and not out.exists()
    assert "cannot fetch model metadata" in capsys.readouterr().err
