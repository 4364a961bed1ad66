"""``inferq up`` supervises what it starts: a killed worker or gateway is replaced and counted,
several gateways serve one port, and only SIGTERM or Ctrl-C stops the stack.

Each test runs the real command against the suite's Redis (its own namespace) with the
simulated model ``sim``, and reads the JSON log lines ``inferq up`` writes about its children.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from inferq.redisserver import free_port
from protocol.jobs import JobStatus
from protocol.keys import Keys, hash_tag
from tests.support import advertisements, free_port_pair, sim_body, wait_until
from tests.upstack import UpProcess, up_processes

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def up(redis_url: str, namespace: str, model_repo: Path) -> Iterator[Callable[..., UpProcess]]:
    with up_processes(redis_url, namespace, model_repo, "--models", "sim") as start:
        yield start


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _correct(i: int, r: httpx.Response) -> bool:
    return r.status_code == 200 and r.json()["outputs"][0]["data"] == [4.0 * i]


def _fresh_connections(url: str, n: int, offset: int = 0) -> list[bool]:
    """``n`` requests, each on a new connection (so the kernel picks a gateway for each)."""
    limits = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(base_url=url, timeout=30, limits=limits) as c:
        return [
            _correct(i, c.post("/v2/models/sim/infer", json=sim_body(i)))
            for i in range(offset, offset + n)
        ]


def _replies_per_gateway(redis_url: str, namespace: str) -> dict[str, int]:
    """Entries ever added to each gateway's reply stream (results and a few keepalives)."""
    keys = Keys(namespace)
    with redis.Redis.from_url(redis_url) as r:
        return {
            hash_tag(key.decode()): int(r.xinfo_stream(key)["entries-added"])
            for key in r.scan_iter(match=keys.replies_pattern, _type="stream")
        }


def _until_every_gateway_serves(url: str, in_a_row: int = 20, timeout_s: float = 30) -> None:
    """Until ``in_a_row`` requests in a row, each on a new connection, are answered right.
    ``inferq up`` says it serves once one gateway is ready on the shared port; a gateway that
    started before the worker advertised itself refuses until its next registry refresh (a
    second at most), and each connection lands on a gateway at random."""
    deadline, streak, i = time.monotonic() + timeout_s, 0, 1000
    while streak < in_a_row:
        assert time.monotonic() < deadline, f"not {in_a_row} right answers in a row"
        streak = streak + 1 if _fresh_connections(url, 1, offset=i)[0] else 0
        i += 1


def _infer_200s(metrics_port: int) -> int:
    """``inferq_gateway_requests_total`` of sim's 200s, read from one gateway's metrics port."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("inferq_gateway_requests_total{")
        and 'model="sim"' in line
        and 'endpoint="infer"' in line
        and 'status="200"' in line
    )


def test_each_of_several_gateways_serves_its_own_metrics_port_so_all_are_scraped(up):
    base = free_port_pair()
    u = up("--workers", "1", "--gateways", "2", "--gateway-metrics-port", str(base))
    u.wait_ready()
    _until_every_gateway_serves(u.url)
    before = [_infer_200s(base + i) for i in range(2)]
    # The kernel spreads new connections over both gateways; their own ports count them apart.
    assert all(_fresh_connections(u.url, 60))
    answered = [_infer_200s(base + i) - before[i] for i in range(2)]
    assert sum(answered) == 60 and all(n >= 5 for n in answered), answered
    listening = u.events("metrics listening")
    assert sorted(e["address"] for e in listening) == [f"127.0.0.1:{base + i}" for i in range(2)]
    assert u.stop() == 0


def test_a_gateway_metrics_port_in_use_stops_the_stack_with_the_reason(up):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        u = up("--workers", "1", "--gateway-metrics-port", str(port))
        assert u.proc.wait(60) == 1
        u.join()
    assert any(f"cannot serve metrics on 127.0.0.1:{port}" in line for line in u.lines), u.lines


def _advertised_restarts(redis_url: str, namespace: str) -> list[int]:
    """What the live workers advertise as their slots' restart counts (INFERQ_RESTARTS)."""
    return [w.restarts for w in advertisements(redis_url, namespace)]


def test_a_killed_worker_and_a_killed_gateway_are_replaced_and_the_restarts_counted(
    up, redis_url, namespace
):
    u = up("--workers", "1")
    u.wait_ready()
    assert all(_fresh_connections(u.url, 3))
    worker, gateway = u.pid("worker 0"), u.pid("gateway 0")
    for pid in (worker, gateway):
        subprocess.run(["kill", "-9", str(pid)], check=True)
    u.wait_for(lambda: len(u.events("child restarted")) == 2, "both restarted")
    restarted = u.events("child restarted")
    assert {e["child"]: e["restarts"] for e in restarted} == {"worker 0": 1, "gateway 0": 1}
    assert sorted(e["restarts_total"] for e in restarted) == [1, 2]
    exits = {e["child"]: e["exit"] for e in u.events("child exited")}
    assert exits == {"worker 0": "killed by SIGKILL", "gateway 0": "killed by SIGKILL"}
    # The stack serves again: the replacement gateway answers, the replacement worker runs.
    u.wait_for(lambda: _fresh_connections(u.url, 1) == [True], "a correct answer again")
    assert all(_fresh_connections(u.url, 5, offset=10))
    # The replacement was told it is its slot's first restart, and says so (the console shows it).
    u.wait_for(lambda: _advertised_restarts(redis_url, namespace) == [1], "restarts advertised")
    children = _children(u.proc.pid)
    assert u.stop() == 0
    assert "inferq up: stopped; 2 restart(s) (worker 0: 1, gateway 0: 1)" in u.lines
    assert not any(_alive(pid) for pid in children)


def test_only_sigterm_stops_the_stack_workers_first_then_gateways(up):
    u = up("--workers", "2")
    u.wait_ready()
    # Ready needs one worker; one still importing when stopped dies of the SIGTERM it has no
    # handler for yet, and never says "worker stopped".
    u.wait_for(lambda: len(u.events("worker started")) == 2, "both workers started")
    assert u.stop() == 0
    stopped = [
        doc["event"] for doc in u.log() if doc.get("event") in ("worker stopped", "gateway stopped")
    ]
    said = [line for line in u.lines if "stop" in line or "kill" in line or "exit" in line]
    assert stopped == ["worker stopped"] * 2 + ["gateway stopped"], said
    assert u.lines[-1] == "inferq up: stopped; no restarts"


def test_two_gateways_serve_one_port_and_a_killed_one_leaves_it_answering(up, redis_url, namespace):
    u = up("--workers", "1", "--gateways", "2")
    u.wait_ready()
    u.wait_for(lambda: len(_replies_per_gateway(redis_url, namespace)) == 2, "two reply streams")
    _until_every_gateway_serves(u.url)
    before = _replies_per_gateway(redis_url, namespace)
    assert all(_fresh_connections(u.url, 60))
    served = {gid: n - before[gid] for gid, n in _replies_per_gateway(redis_url, namespace).items()}
    # Two gateway ids, each with its own reply stream, and both answered requests on the port.
    assert len(served) == 2 and all(n >= 5 for n in served.values()), served
    subprocess.run(["kill", "-9", str(u.pid("gateway 0"))], check=True)
    # At once, while gateway 0 is being replaced: every request on the port is answered.
    assert all(_fresh_connections(u.url, 20, offset=100))
    u.wait_for(lambda: u.events("child restarted", child="gateway 0") != [], "the replacement")
    u.wait_for(lambda: len(_replies_per_gateway(redis_url, namespace)) == 3, "a third gateway id")
    assert all(_fresh_connections(u.url, 20, offset=200))
    assert u.stop() == 0


def test_a_worker_that_cannot_start_stops_the_stack_with_the_reason(up):
    u = up("--workers", "1", "--models", "nope")
    assert u.proc.wait(60) == 1
    u.join()
    assert any("worker 0 exit code 2" in line and "not restarting" in line for line in u.lines)
    assert u.events("child not restarted", child="worker 0")


def test_a_port_in_use_is_reported_before_anything_starts(up):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        u = up("--port", str(taken.getsockname()[1]))
        assert u.proc.wait(60) == 1
    u.join()
    assert any("cannot listen on 127.0.0.1" in line for line in u.lines)
    assert u.events("child started") == []


def test_a_grpc_port_in_use_stops_the_stack_at_once_instead_of_restarting(up):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        u = up("--grpc-port", str(port))
        assert u.proc.wait(60) == 1
    u.join()
    said = f"cannot listen for gRPC on 127.0.0.1:{port}: Address already in use"
    assert any(said in line for line in u.lines), u.lines
    assert any("gateway 0 exit code 2" in line and "not restarting" in line for line in u.lines)
    assert u.events("child restarted") == []
    assert not any("Traceback" in line for line in u.lines)


def test_inferq_gateway_with_two_gateways_serves_one_port(redis_url, namespace, stack):
    s = stack(workers=1, models=("sim",))  # a worker (and a gateway of its own) on this Redis
    s.wait_ready("sim")
    port, metrics_base = free_port(), free_port_pair()
    proc = subprocess.Popen(
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
            "--gateways",
            "2",
            "--gateway-metrics-port",
            str(metrics_base),
            "--log-level",
            "info",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                return httpx.get(f"{url}/v2/health/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, 60, "inferq gateway --gateways 2 to be ready")
        wait_until(
            lambda: len(_replies_per_gateway(redis_url, namespace)) == 3, 30, "two more gateways"
        )
        before = _replies_per_gateway(redis_url, namespace)
        assert all(_fresh_connections(url, 60))
        after = _replies_per_gateway(redis_url, namespace)
        ours = s.gateway.gateway.settings.gateway_id  # the in-process gateway: not on the port
        served = {g: after[g] - before[g] for g in after if g != ours}
        assert len(served) == 2 and all(n >= 5 for n in served.values()), served
        assert len(_children(proc.pid)) == 2
        # Each gateway's own metrics port counts what that gateway answered, and only that.
        answered = [_infer_200s(metrics_base + i) for i in range(2)]
        assert sum(answered) == 60 and all(n >= 5 for n in answered), answered
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert out.count('"event": "gateway stopped"') == 2


def _in_aof(folder: Path, *texts: str) -> bool:
    """Whether Redis has written every text to its append-only files (its page cache, which
    survives a SIGKILL of the process)."""
    written = b"".join(f.read_bytes() for f in folder.glob("appendonlydir/*.aof"))
    return all(t.encode() in written for t in texts)


def _final_job(c: httpx.Client, job: str, timeout_s: float = 60) -> dict[str, Any]:
    """The job once final, polled as a client does: a 503 (Redis just came back, a pooled
    connection still led to the old server) is retried after its Retry-After; any other
    answer that is not the job fails the test with its body."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = c.get(f"/v2/jobs/{job}", params={"wait": 10})
        if r.status_code == 503 and time.monotonic() < deadline:
            time.sleep(min(float(r.headers.get("retry-after", 1)), 1.0))
            continue
        assert r.status_code == 200, r.text
        doc: dict[str, Any] = r.json()
        if JobStatus(doc["status"]).final or time.monotonic() > deadline:
            return doc


def test_a_private_redis_that_dies_is_restarted_from_its_aof_and_the_queued_jobs_complete(
    namespace, model_repo
):
    with up_processes("redis://127.0.0.1:1/0", namespace, model_repo, "--models", "sim") as start:
        u = start("--workers", "1")
        u.wait_ready()
        (line,) = [x for x in u.lines if "started a private redis-server" in x]
        assert "restarted from it if it exits" in line
        folder = Path(line.split("AOF in ", 1)[1].split(";", 1)[0])
        worker = u.pid("worker 0")
        os.kill(worker, signal.SIGSTOP)  # nothing runs: the jobs stay queued in Redis
        try:
            with httpx.Client(base_url=u.url, timeout=30) as c:
                ids = []
                for i in range(5):
                    r = c.post("/v2/models/sim/jobs", json=sim_body(i))
                    assert r.status_code == 202
                    ids.append(r.json()["id"])
                u.wait_for(lambda: _in_aof(folder, *ids), "the jobs in the AOF")
                subprocess.run(["kill", "-9", str(u.pid("redis-server"))], check=True)
                u.wait_for(
                    lambda: u.events("child restarted", child="redis-server") != [],
                    "redis-server restarted",
                )
        finally:
            os.kill(worker, signal.SIGCONT)
        (exited,) = u.events("child exited", child="redis-server")
        assert exited["exit"] == "killed by SIGKILL"
        with httpx.Client(base_url=u.url, timeout=60) as c:
            for i, job in enumerate(ids):
                done = _final_job(c, job)
                assert done["status"] == "succeeded", done
                assert done["result"]["outputs"][0]["data"] == [4.0 * i]
            assert _correct(7, c.post("/v2/models/sim/infer", json=sim_body(7)))
        assert u.stop() == 0
        assert u.lines[-1] == "inferq up: stopped; 1 restart(s) (redis-server: 1)"
        assert not folder.exists()  # the private folder goes with the stack
