"""loadgen/locustfile.py: its request-building helpers (no Locust needed), and a short headless
Locust run against a tiny V2 server (skipped where Locust is not installed)."""

from __future__ import annotations

import csv
import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.loadgen.test_loadgen_cli import METADATA, ServerThread, v2_handler

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def locustfile(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The module as it imports where Locust is not installed."""
    monkeypatch.setitem(sys.modules, "locust", None)
    sys.modules.pop("loadgen.locustfile", None)
    module = importlib.import_module("loadgen.locustfile")
    yield module
    sys.modules.pop("loadgen.locustfile", None)


def test_without_locust_the_helpers_import_and_no_user_class_exists(locustfile: Any) -> None:
    assert locustfile.locust is None
    assert not hasattr(locustfile, "InferUser") and not hasattr(locustfile, "JobUser")


def test_json_inference_requests_from_the_metadata(locustfile: Any) -> None:
    w = locustfile.workload(METADATA, model="m", rows=3, distinct=4, seed=1)
    assert w.path == "/v2/models/m/infer"
    bodies = [w.next() for _ in range(8)]
    assert len({b for b, _ in bodies}) == 4  # four distinct bodies, cycled
    body, headers = bodies[0]
    assert headers == {"content-type": "application/json", "cache-control": "no-cache"}
    tensor = json.loads(body)["inputs"][0]
    assert tensor["name"] == "x" and tensor["shape"] == [3, 4] and len(tensor["data"]) == 12


def test_binary_job_submits_for_a_version(locustfile: Any) -> None:
    w = locustfile.workload(
        METADATA, model="m", version="2", jobs=True, binary=True, cache=True, distinct=1
    )
    assert w.path == "/v2/models/m/versions/2/jobs"
    body, headers = w.next()
    assert "cache-control" not in headers
    assert headers["content-type"] == "application/octet-stream"
    length = int(headers["inference-header-content-length"])
    head = json.loads(body[:length])
    assert head["inputs"][0]["parameters"]["binary_data_size"] == len(body) - length == 16
    assert head["parameters"]["binary_data_output"] is True


def test_job_responses_and_poll_paths(locustfile: Any) -> None:
    assert locustfile.job_state(b'{"id": "j1", "status": "queued"}', {}) == ("j1", "queued")
    head = b'{"id": "j1", "status": "succeeded"}'
    binary = {"Inference-Header-Content-Length": str(len(head))}
    assert locustfile.job_state(head + b"\x00\x01", binary) == ("j1", "succeeded")
    with pytest.raises(ValueError):
        locustfile.job_state(b'{"id": "j1", "status": "lost"}', {})
    with pytest.raises(ValueError):
        locustfile.job_state(b"<html>", {})
    assert locustfile.job_poll_path("/v2/jobs/j1", "j1", 5) == "/v2/jobs/j1?wait=5"
    # A Location naming a host is followed on Locust's own --host only.
    assert (
        locustfile.job_poll_path("http://elsewhere:1/v2/jobs/j1", "j1", 0) == "/v2/jobs/j1?wait=0"
    )
    assert locustfile.job_poll_path(None, "j2", 10) == "/v2/jobs/j2?wait=10"


@pytest.mark.skipif(
    importlib.util.find_spec("locust") is None, reason="locust (inferq[locust]) is not installed"
)
def locust(*args: str) -> list[str]:
    """A ``locust`` command line on loadgen/locustfile.py."""
    return [sys.executable, "-m", "locust", "-f", str(ROOT / "loadgen" / "locustfile.py"), *args]


def locust_env(home: Path) -> dict[str, str]:
    return {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(home)}


def test_a_headless_locust_run_sends_binary_inferences_and_jobs(
    tiny_server: Any, response_bytes: Any, tmp_path: Path
) -> None:
    with ServerThread(tiny_server, v2_handler(response_bytes)) as srv:
        done = subprocess.run(
            locust(
                "--host",
                srv.url,
                "--model",
                "m",
                "--binary",
                "--headless",
                "-u",
                "2",
                # Both users (one of each class) at once, and long enough for each to send on a
                # loaded 2-core machine: the assertions count what was sent, not how fast.
                "-r",
                "100",
                "-t",
                "4s",
                "--csv",
                str(tmp_path / "run"),
                "--only-summary",
            ),
            cwd=ROOT,
            env=locust_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=50,
        )
        requests = list(srv.requests)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(tmp_path / "run_stats.csv") as f:
        stats = {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}
    for key in [("POST", "infer"), ("POST", "submit"), ("JOB", "/v2/models/m/jobs")]:
        assert int(stats[key]["Request Count"]) > 0, key
        assert int(stats[key]["Failure Count"]) == 0, key
    posts = [r for r in requests if r.method == "POST"]
    infers = [r for r in posts if r.path == "/v2/models/m/infer"]
    submits = [r for r in posts if r.path == "/v2/models/m/jobs"]
    # Locust's table may miss the last requests cut off by the stop; none is invented.
    assert len(infers) >= int(stats[("POST", "infer")]["Request Count"])
    assert len(submits) >= int(stats[("POST", "submit")]["Request Count"])
    for r in posts:  # every body is a valid binary V2 request for input x, shape [1, 4]
        length = int(r.headers["inference-header-content-length"])
        head = json.loads(r.body[:length])
        assert head["inputs"][0]["shape"] == [1, 4]
        assert len(r.body) - length == head["inputs"][0]["parameters"]["binary_data_size"] == 16
        assert r.headers["cache-control"] == "no-cache"


def test_the_web_ui_listens_on_this_machine_only_by_default(tmp_path: Path) -> None:
    # Locust's own default is every interface: anyone who reaches the host could start a load.
    import socket

    from inferq.redisserver import free_port
    from tests.support import wait_until

    port = free_port()
    proc = subprocess.Popen(
        locust("--host", "http://127.0.0.1:9", "--web-port", str(port)),
        cwd=ROOT,
        env=locust_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def answers(host: str) -> bool:
        with socket.socket() as s:
            s.settimeout(1)
            return s.connect_ex((host, port)) == 0

    try:
        wait_until(lambda: answers("127.0.0.1") or proc.poll() is not None, 30, "the web UI")
        assert proc.poll() is None
        assert not answers("127.0.0.2")  # loopback too, but not the address it bound
    finally:
        proc.terminate()
        proc.wait(30)
