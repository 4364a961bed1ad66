"""loadgen/locustfile.py: its request-building helpers (no Locust needed), and a short headless
Locust run against a tiny V2 server (skipped where Locust is not installed)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.loadgen.test_loadgen_cli import METADATA, ServerThread, v2_handler
from tests.support import wait_until

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


def locust(*args: str) -> list[str]:
    """A ``locust`` command line on loadgen/locustfile.py."""
    return [sys.executable, "-m", "locust", "-f", str(ROOT / "loadgen" / "locustfile.py"), *args]


def locust_env(home: Path) -> dict[str, str]:
    return {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(home)}


def sent(requests: list[Any], path: str) -> int:
    return sum(r.method == "POST" and r.path == path for r in requests)


@pytest.mark.skipif(
    importlib.util.find_spec("locust") is None, reason="locust (inferq[locust]) is not installed"
)
def stopped(proc: subprocess.Popen[Any]) -> tuple[Any, Any]:
    """SIGTERM, then its output; a Locust that has not exited 30 s later is killed, so the
    test fails (its return code is not 0) instead of leaving the process behind."""
    proc.terminate()
    try:
        return proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()


def test_a_headless_locust_run_sends_binary_inferences_and_jobs(
    tiny_server: Any, response_bytes: Any, tmp_path: Path
) -> None:
    """One user of each class runs until the server has seen two inferences and two job
    submits, then Locust is stopped (SIGTERM, as a scheduler stops it). Each user sends in
    turn, so a second request means Locust has recorded the first (a second submit: the first
    job's whole life): its final stats (``--json``) count at least one of each, not a count
    that depends on how fast a loaded machine starts Locust. ``-t`` only bounds the run."""
    with ServerThread(tiny_server, v2_handler(response_bytes)) as srv:
        run = subprocess.Popen(
            locust(
                "--host",
                srv.url,
                "--model",
                "m",
                "--binary",
                "--headless",
                "-u",
                "2",
                "-r",
                "100",
                "-t",
                "60s",
                "--json",
                "--only-summary",
            ),
            cwd=ROOT,
            env=locust_env(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_until(
                lambda: (
                    (
                        sent(srv.requests, "/v2/models/m/infer") >= 2
                        and sent(srv.requests, "/v2/models/m/jobs") >= 2
                    )
                    or run.poll() is not None
                ),
                timeout_s=50,
                poll_s=0.05,
                what="two inferences and two job submits",
            )
        finally:
            out, err = stopped(run)
        requests = list(srv.requests)
    assert run.returncode == 0, err[-2000:]
    stats = {(e["method"], e["name"]): e for e in json.loads(out)}
    for key in [("POST", "infer"), ("POST", "submit"), ("JOB", "/v2/models/m/jobs")]:
        assert stats[key]["num_requests"] > 0, (key, err[-2000:])
        assert stats[key]["num_failures"] == 0, key
    posts = [r for r in requests if r.method == "POST"]
    # Locust's stats may miss the last requests cut off by the stop; none is invented.
    assert sent(requests, "/v2/models/m/infer") >= stats[("POST", "infer")]["num_requests"]
    assert sent(requests, "/v2/models/m/jobs") >= stats[("POST", "submit")]["num_requests"]
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
        stopped(proc)
