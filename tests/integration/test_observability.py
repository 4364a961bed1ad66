"""What operators watch: the backlog through ``inferq lag``, and one request across processes
through its traceparent."""

from __future__ import annotations

import io
import json

import structlog

from inferq.cli import main
from runtime.logging import configure
from tests.support import sim_body, wait_until


def _lag(redis_url: str, namespace: str, capsys) -> dict:
    code = main(
        ["lag", "--redis", redis_url, "--namespace", namespace, "--json", "--sample-s", "0"],
        environ={},
    )
    assert code == 0
    return json.loads(capsys.readouterr().out)


def _backlog(doc: dict, model: str) -> int:
    lanes = [lane for lane in doc["lanes"] if lane["model"] == model]
    return sum(lane["lag"] + lane["pending"] for lane in lanes)


def test_lag_shows_the_backlog_while_workers_are_away_and_zero_once_drained(
    stack, redis_url, namespace, capsys
):
    # Keep the worker's and gateway's log lines out of the captured stdout `lag` prints to.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=io.StringIO()))
    s = stack(models=("sim",))
    s.workers[0].stop()
    with s.client() as c:
        for i in range(100):
            assert c.post("/v2/models/sim/jobs", json=sim_body(i)).status_code == 202
    assert _backlog(_lag(redis_url, namespace, capsys), "sim") >= 100
    s.add_worker(("sim",))
    wait_until(
        lambda: _backlog(_lag(redis_url, namespace, capsys), "sim") == 0, 30, "the backlog drained"
    )


def test_one_traceparent_follows_a_request_through_gateway_and_worker_logs(stack):
    out = io.StringIO()
    configure("debug", json=True)
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=out))
    s = stack(models=("sim",))
    trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    r = s.infer("sim", sim_body(3), traceparent=trace)
    assert r.status_code == 200 and r.headers["traceparent"] == trace

    def lines_with_trace() -> list[dict]:
        return [
            d for d in map(json.loads, out.getvalue().splitlines()) if d.get("traceparent") == trace
        ]

    wait_until(
        lambda: {d["component"] for d in lines_with_trace()} >= {"gateway", "worker"},
        what="log lines from both processes",
    )
    for line in lines_with_trace():
        assert line["model"] == "sim" and line["version"] == "1" and line["request_id"]
