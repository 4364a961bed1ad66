"""Model control through the Triton repository API: hot swap under load, a failed load that
changes nothing, canary splits, unload, and who may do any of it."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from protocol.control import LoadReport, VersionPolicy
from protocol.keys import Keys
from tests.conftest import DIGITS
from tests.support import GatewayThread, Stack, WorkerThread, sim_body, wait_until

TOKEN = "s3cret-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
SAMPLES = json.loads((DIGITS / "samples.json").read_text())["inputs"]


def digits_body(i: int) -> dict[str, Any]:
    return {
        "inputs": [
            {
                "name": "input",
                "datatype": "FP32",
                "shape": [1, 64],
                "data": SAMPLES[i % len(SAMPLES)],
            }
        ]
    }


def make_repo(root: Path, versions: list[str], policy: str = 'specific = ["1"]') -> Path:
    """A repository holding the real digits model as ``digits`` under several versions."""
    repo = root / "repo"
    folder = repo / "digits"
    folder.mkdir(parents=True)
    config = (DIGITS / "config.toml").read_text()
    config = config.replace("[version_policy]\nlatest = 1", f"[version_policy]\n{policy}")
    (folder / "config.toml").write_text(config)
    for v in versions:
        (folder / v).mkdir()
        shutil.copy(DIGITS / "1" / "model.onnx", folder / v / "model.onnx")
    return repo


@pytest.fixture
def control_stack(redis_url: str, namespace: str, tmp_path: Path) -> Iterator[Callable[..., Stack]]:
    started: list[GatewayThread | WorkerThread] = []

    def make(
        versions: list[str] | None = None,
        *,
        workers: int = 2,
        policy: str = 'specific = ["1"]',
        repo: Path | None = None,
        **gateway: Any,
    ) -> Stack:
        """Digits under ``versions`` (or the given ``repo``), ``workers`` workers serving all
        of it, and a gateway with the admin token."""
        repo = repo or make_repo(tmp_path, versions or ["1"], policy)
        s = Stack(redis_url, namespace, repo, started)
        for _ in range(workers):
            s.add_worker(retire_after_s=1.0)
        s.start_gateway(**{"admin_token": TOKEN, **gateway})
        return s

    yield make
    for thing in reversed(started):
        thing.stop()


@dataclass
class Outcome:
    sent: float
    done: float
    status: int
    version: str | None


def run_load(
    s: Stack, total: int, concurrency: int, on_progress: Callable[[int], None] | None = None
) -> list[Outcome]:
    """``total`` digits requests from ``concurrency`` threads; results in completion order."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    counter = iter(range(total))

    def client_loop() -> None:
        with s.client(headers={"cache-control": "no-cache"}) as c:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                sent = time.monotonic()
                r = c.post("/v2/models/digits/infer", json=digits_body(i))
                version = r.json().get("model_version") if r.status_code == 200 else None
                with lock:
                    outcomes.append(Outcome(sent, time.monotonic(), r.status_code, version))
                    done = len(outcomes)
                if on_progress is not None:
                    on_progress(done)

    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(client_loop) for _ in range(concurrency)]:
            f.result()
    return outcomes


def admin(s: Stack, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    with s.client() as c:
        return c.post(path, json=body or {}, headers=AUTH)


class BackgroundAdmin(threading.Thread):
    """An admin call made from another thread once ``go`` is set (at once if not given):
    when it started and ended, its status and body."""

    def __init__(
        self, s: Stack, path: str, body: dict[str, Any], go: threading.Event | None = None
    ) -> None:
        super().__init__()
        self.s, self.path, self.body = s, path, body
        self.go = go or threading.Event()
        if go is None:
            self.go.set()
        self.started_at = self.ended_at = 0.0
        self.status = 0
        self.answer: dict[str, Any] = {}

    def run(self) -> None:
        self.go.wait(60)
        self.started_at = time.monotonic()
        r = admin(self.s, self.path, self.body)
        self.ended_at = time.monotonic()
        self.status, self.answer = r.status_code, r.json()

    def result(self) -> tuple[int, dict[str, Any]]:
        self.join(60)
        return self.status, self.answer


def prepare_sent(redis_url: str, namespace: str) -> None:
    with redis.Redis.from_url(redis_url) as rc:
        wait_until(lambda: rc.xlen(Keys(namespace).control) >= 1, what="the prepare sent")


@pytest.mark.serial  # counts requests sent in a time window
def test_hot_swap_under_load_fails_no_request_and_switches_at_the_commit(control_stack, capsys):
    s = control_stack(["1", "2"])
    s.wait_ready("digits")
    half = threading.Event()
    swap = BackgroundAdmin(
        s, "/v2/repository/models/digits/load", {"parameters": {"version": "2"}}, half
    )
    swap.start()
    outcomes = run_load(s, 2000, 32, on_progress=lambda n: n == 600 and half.set())
    status, answer = swap.result()

    start, end = swap.started_at, swap.ended_at
    with capsys.disabled():
        by = Counter((o.status, o.version) for o in outcomes)
        print(
            f"\nmodel-control[hot swap 1->2, 2000 req c=32, 2 workers]: {dict(by)}; load call "
            f"{(end - start) * 1000:.0f} ms; sent after it: {sum(o.sent > end for o in outcomes)}"
        )
    assert status == 200, answer
    assert answer["versions"] == ["2"]
    assert len(answer["workers"]) == 2
    assert Counter(o.status for o in outcomes) == {200: 2000}
    # Routed before the load began: v1. Sent after it returned: v2. v2 only from the commit on.
    assert {o.version for o in outcomes if o.sent < start} == {"1"}
    assert {o.version for o in outcomes if o.sent > end} == {"2"}
    assert all(o.done > start for o in outcomes if o.version == "2")
    assert sum(o.sent > end for o in outcomes) > 100  # the load ran on after the switch
    # Workers advertise v2 only, and the dropped v1 is unloaded after its grace.
    wait_until(
        lambda: (
            all(list(w.worker.slots["digits"].model.backends) == ["2"] for w in s.workers)
            and all(not w.worker.slots["digits"].model.retiring for w in s.workers)
        ),
        what="v1 retired on every worker",
    )
    with s.client() as c:
        assert c.get("/v2/models/digits").json()["versions"] == ["2"]


def test_a_corrupt_version_is_refused_and_the_old_one_keeps_serving(control_stack, capsys):
    s = control_stack(["1", "2", "3"], policy='specific = ["2"]')
    (s.repo / "digits" / "3" / "model.onnx").write_bytes(b"this is not an ONNX model")
    s.wait_ready("digits")
    started = threading.Event()
    loader = BackgroundAdmin(
        s, "/v2/repository/models/digits/load", {"parameters": {"version": "3"}}, started
    )
    loader.start()
    outcomes = run_load(s, 600, 8, on_progress=lambda n: n == 100 and started.set())
    status, answer = loader.result()

    with capsys.disabled():
        by = Counter((o.status, o.version) for o in outcomes)
        print(f"\nmodel-control[corrupt v3 under load, 600 req c=8]: load -> {status}; {dict(by)}")
    assert status == 400
    error = answer["error"]
    assert "failed to load model 'digits'" in error and "version 3" in error
    assert "still serves 2" in error
    assert all(w.worker.id in error for w in s.workers)  # every worker's reason is named
    assert Counter((o.status, o.version) for o in outcomes) == {(200, "2"): 600}
    # Nothing staged is left behind, and the index says why version 3 is not there.
    for w in s.workers:
        model = w.worker.slots["digits"].model
        assert list(model.backends) == ["2"] and not model.standby
    rows = admin(s, "/v2/repository/index").json()
    assert [(r["name"], r["version"], r["state"]) for r in rows] == [("digits", "2", "READY")]
    assert "3" in rows[0]["reason"] or "ONNX" in rows[0]["reason"] or "load" in rows[0]["reason"]
    assert s.infer("digits", digits_body(0)).json()["model_version"] == "2"


def test_a_90_10_split_sends_each_version_its_share(control_stack, capsys):
    s = control_stack(["1", "2"])
    s.wait_ready("digits")
    r = admin(
        s, "/v2/repository/models/digits/load", {"parameters": {"weights": {"1": 90, "2": 10}}}
    )
    assert r.status_code == 200, r.text
    assert r.json()["traffic"] == {"1": 0.9, "2": 0.1}
    outcomes = run_load(s, 2000, 16)
    counts = Counter(o.version for o in outcomes)
    assert sum(counts.values()) == 2000 and Counter(o.status for o in outcomes) == {200: 2000}
    share = counts["2"] / 2000
    with capsys.disabled():
        print(f"\nmodel-control[90/10 split, 2000 req c=16]: {dict(counts)}")
    assert abs(share - 0.10) <= 0.03, counts
    # A request may still name a version; per-version metrics tell the two apart.
    with s.client() as c:
        assert c.post("/v2/models/digits/versions/2/infer", json=digits_body(1)).status_code == 200
        text = c.get("/metrics").text
    for version in ("1", "2"):
        assert (
            f'inferq_gateway_requests_total{{endpoint="infer",model="digits",protocol="http",status="200",version="{version}"}}'
            in text
        )


def test_a_worker_started_later_serves_the_committed_policy(control_stack, redis_url, namespace):
    s = control_stack(["1", "2"], workers=1)
    s.wait_ready("digits")
    r = admin(s, "/v2/repository/models/digits/load", {"parameters": {"weights": {"1": 1, "2": 3}}})
    assert r.status_code == 200, r.text
    late = s.add_worker(("digits",))
    assert sorted(late.worker.slots["digits"].model.backends) == ["1", "2"]
    keys = Keys(namespace)
    with redis.Redis.from_url(redis_url) as rc:
        policy = VersionPolicy.decode(rc.hget(keys.policies, "digits"))
        assert policy.versions == ("1", "2") and policy.weights == {"1": 1.0, "2": 3.0}
        line = LoadReport.decode(rc.hget(keys.model_status("digits"), late.worker.id))
        assert line.ok and line.versions == ("1", "2")


def test_unload_then_load_from_the_repository_config(control_stack):
    s = control_stack(["1", "2"], workers=1, policy="latest = 1")
    s.wait_ready("digits")
    assert s.infer("digits", digits_body(0)).json()["model_version"] == "2"
    r = admin(s, "/v2/repository/models/digits/unload")
    assert r.status_code == 200 and r.json()["versions"] == []
    refused = s.infer("digits", digits_body(0))
    assert refused.status_code == 503
    assert "unloaded" in refused.json()["error"] and "/load" in refused.json()["error"]
    with s.client() as c:
        assert c.get("/v2/models/digits/ready").status_code == 503
    # A new version folder appears; a load with no parameters follows the config (latest = 1).
    shutil.copytree(s.repo / "digits" / "2", s.repo / "digits" / "7")
    r = admin(s, "/v2/repository/models/digits/load")
    assert r.status_code == 200, r.text
    assert r.json()["versions"] == ["7"]
    assert s.infer("digits", digits_body(0)).json()["model_version"] == "7"


def test_unloading_one_version_keeps_the_others(control_stack):
    s = control_stack(["1", "2"], workers=1)
    s.wait_ready("digits")
    assert (
        admin(
            s, "/v2/repository/models/digits/load", {"parameters": {"weights": {"1": 1, "2": 1}}}
        ).status_code
        == 200
    )
    r = admin(s, "/v2/repository/models/digits/unload", {"parameters": {"version": "1"}})
    assert r.status_code == 200 and r.json()["versions"] == ["2"]
    assert {s.infer("digits", digits_body(i)).json()["model_version"] for i in range(6)} == {"2"}
    with s.client() as c:
        assert c.post("/v2/models/digits/versions/1/infer", json=digits_body(0)).status_code == 404


# -- who may, and what may be loaded --------------------------------------------------------


def test_the_admin_api_needs_the_token(control_stack):
    s = control_stack(["1"], workers=1)
    with s.client() as c:
        missing = c.post("/v2/repository/index")
        assert missing.status_code == 401
        assert missing.headers["www-authenticate"].startswith("Bearer")
        assert "Authorization: Bearer" in missing.json()["error"]
        wrong = c.post("/v2/repository/index", headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 403
        basic = c.post("/v2/repository/models/digits/load", headers={"authorization": "Basic eDp5"})
        assert basic.status_code == 401
        assert c.post("/v2/repository/models/digits/unload").status_code == 401
        ok = c.post("/v2/repository/index", headers=AUTH)
        assert ok.status_code == 200
        assert [(r["name"], r["version"], r["state"]) for r in ok.json()] == [
            ("digits", "1", "READY")
        ]


def test_without_a_configured_token_the_admin_api_is_off(control_stack):
    s = control_stack(["1"], workers=1, admin_token=None)
    with s.client() as c:
        r = c.post("/v2/repository/index", headers=AUTH)
        assert r.status_code == 403 and "--admin-token" in r.json()["error"]


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("/v2/repository/models/%2E%2E/load", {}, 400, "invalid model name"),
        ("/v2/repository/models/digits/load", {"parameters": {"version": "../2"}}, 400, "no paths"),
        ("/v2/repository/models/digits/load", {"parameters": {"version": "/etc"}}, 400, "no paths"),
        ("/v2/repository/models/digits/load", {"parameters": {"config": "{}"}}, 400, "only from"),
        (
            "/v2/repository/models/digits/load",
            {"parameters": {"file:1/model.onnx": "AAAA"}},
            400,
            "only from",
        ),
        (
            "/v2/repository/models/digits/load",
            {"parameters": {"weights": {"1": -1}}},
            400,
            "not negative",
        ),
        ("/v2/repository/models/digits/load", {"parameters": {"weights": {}}}, 400, "weights must"),
        (
            "/v2/repository/models/digits/load",
            {"parameters": {"version": "9"}},
            400,
            "no version folder",
        ),
        ("/v2/repository/models/nosuch/load", {}, 404, "unknown model"),
    ],
)
def test_bad_load_requests_are_refused_with_a_reason(control_stack, path, body, status, words):
    s = control_stack(["1"], workers=1)
    s.wait_ready("digits")
    with s.client() as c:
        r = c.post(path, json=body, headers=AUTH)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]
    assert s.infer("digits", digits_body(0)).json()["model_version"] == "1"


def test_a_version_folder_that_links_out_of_the_repository_is_refused(control_stack, tmp_path):
    s = control_stack(["1"], workers=1)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(DIGITS / "1" / "model.onnx", outside / "model.onnx")
    (s.repo / "digits" / "5").symlink_to(outside, target_is_directory=True)
    s.wait_ready("digits")
    r = admin(s, "/v2/repository/models/digits/load", {"parameters": {"version": "5"}})
    assert r.status_code == 400
    assert "outside the repository" in r.json()["error"]
    assert s.infer("digits", digits_body(0)).json()["model_version"] == "1"


def test_a_second_change_while_one_is_in_flight_is_a_conflict(control_stack, redis_url, namespace):
    s = control_stack(["1", "2"], workers=1)
    s.wait_ready("digits")
    with redis.Redis.from_url(redis_url) as rc:
        rc.set(Keys(namespace).model_lock("digits"), "someone-else", px=60_000)
        r = admin(s, "/v2/repository/models/digits/load", {"parameters": {"version": "2"}})
        assert r.status_code == 409 and "in progress" in r.json()["error"]
        rc.delete(Keys(namespace).model_lock("digits"))
    assert (
        admin(s, "/v2/repository/models/digits/load", {"parameters": {"version": "2"}}).status_code
        == 200
    )


# -- inferq models list|status ---------------------------------------------------------------


def test_inferq_models_shows_versions_traffic_and_each_workers_state(
    control_stack, redis_url, namespace, capsys
):
    from inferq.cli import main

    s = control_stack(["1", "2", "3"], workers=2)
    (s.repo / "digits" / "3" / "model.onnx").write_bytes(b"corrupt")
    s.wait_ready("digits")
    load = {"parameters": {"weights": {"1": 90, "2": 10}}}
    assert admin(s, "/v2/repository/models/digits/load", load).status_code == 200
    assert (
        admin(s, "/v2/repository/models/digits/load", {"parameters": {"version": "3"}}).status_code
        == 400
    )
    flags = ["--redis", redis_url, "--namespace", namespace]

    assert main(["models", "list", *flags], environ={}) == 0
    lines = capsys.readouterr().out.splitlines()  # worker threads log to stdout too
    header = next(i for i, line in enumerate(lines) if line.startswith("MODEL"))
    assert lines[header].split() == ["MODEL", "VERSIONS", "TRAFFIC", "WORKERS", "POLICY", "STATE"]
    row = lines[header + 1]
    assert row.startswith("digits") and "1,2" in row and "1: 90%, 2: 10%" in row
    assert "READY (last load failed)" in row

    assert main(["models", "status", "digits", *flags], environ={}) == 0
    status = capsys.readouterr().out
    for w in s.workers:
        line = next(x for x in status.splitlines() if w.worker.id in x)
        assert "1,2" in line and "FAILED" in line
    assert main(["models", "status", "--json", *flags], environ={}) == 0
    out = capsys.readouterr().out
    [doc] = json.loads(out[out.index("[\n") :])
    assert doc["traffic"] == {"1": 0.9, "2": 0.1} and doc["policy"] == "admin"
    assert {w["worker"] for w in doc["workers"]} == {w.worker.id for w in s.workers}
    assert all(not w["ok"] and w["error"] for w in doc["workers"])

    assert main(["models", "status", "nosuch", *flags], environ={}) == 1
    assert "unknown model 'nosuch'" in capsys.readouterr().err


def test_a_quick_rollback_reuses_the_retiring_version(control_stack):
    s = control_stack(["1", "2"], workers=1)
    s.add_worker(("digits",), retire_after_s=60.0)  # one worker that keeps v1 retiring a while
    s.wait_ready("digits")
    slow = s.workers[-1].worker.slots["digits"].model
    v1 = slow.backends["1"]
    assert (
        admin(s, "/v2/repository/models/digits/load", {"parameters": {"version": "2"}}).status_code
        == 200
    )
    wait_until(lambda: "1" in slow.retiring, what="v1 retiring")
    back = admin(s, "/v2/repository/models/digits/load", {"parameters": {"version": "1"}})
    assert back.status_code == 200, back.text
    wait_until(lambda: list(slow.backends) == ["1"], what="v1 served again")
    assert slow.backends["1"] is v1  # not loaded a second time
    assert s.infer("digits", digits_body(0)).json()["model_version"] == "1"


def test_a_reload_applies_the_configs_new_batching(control_stack):
    s = control_stack(["1"], workers=1, policy="latest = 1")
    s.wait_ready("digits")
    config = s.repo / "digits" / "config.toml"
    config.write_text(config.read_text().replace("max_batch = 64", "max_batch = 16"))
    assert admin(s, "/v2/repository/models/digits/load").status_code == 200
    slot = s.workers[0].worker.slots["digits"]
    # The load answers once the commit is sent; each worker applies it when it reads it.
    wait_until(
        lambda: slot.model.max_batch == 16 and slot.policy.max_batch == 16,
        what="the worker batching by the new max_batch",
    )
    with s.client() as c:
        wait_until(
            lambda: c.get("/v2/models/digits").json()["parameters"]["max_batch_size"] == 16,
            what="the new max_batch advertised",
        )


def slow_loading_repo(root: Path) -> Path:
    """A simulated model whose versions take 1.5 s each to load, as a large model would."""
    from tests.support import write_simulated_model

    repo = root / "slowrepo"
    write_simulated_model(repo, "big", base_ms=2, per_row_ms=0, max_batch=16)
    config = repo / "big" / "config.toml"
    text = config.read_text().replace("[simulated]", "[simulated]\nload_ms = 1500")
    config.write_text(text.replace("[cache]", '[version_policy]\nspecific = ["1"]\n\n[cache]'))
    (repo / "big" / "2").mkdir()
    return repo


@pytest.mark.serial  # bounds the slowest request
def test_requests_keep_being_served_while_a_slow_version_loads(control_stack, tmp_path, capsys):
    s = control_stack(repo=slow_loading_repo(tmp_path))
    s.wait_ready("big")
    outcomes: list[tuple[float, int, str | None]] = []
    done = threading.Event()

    def traffic() -> None:
        with s.client() as c:
            while not done.is_set():
                t0 = time.monotonic()
                r = c.post("/v2/models/big/infer", json=sim_body(1.0))
                version = r.json().get("model_version") if r.status_code == 200 else None
                outcomes.append((time.monotonic() - t0, r.status_code, version))

    senders = [threading.Thread(target=traffic) for _ in range(4)]
    for t in senders:
        t.start()
    wait_until(lambda: len(outcomes) > 20, what="traffic flowing")
    load_started = time.monotonic()
    r = admin(s, "/v2/repository/models/big/load", {"parameters": {"version": "2"}})
    load_s = time.monotonic() - load_started
    during = len(outcomes)
    wait_until(lambda: len(outcomes) > during + 20, what="traffic after the switch")
    done.set()
    for t in senders:
        t.join(30)
    assert r.status_code == 200, r.text
    assert load_s >= 1.5  # the call waited for the workers' load
    statuses = Counter(status for _, status, _ in outcomes)
    slowest = max(latency for latency, _, _ in outcomes)
    with capsys.disabled():
        print(
            f"\nmodel-control[1.5 s load under traffic, 2 workers]: load call {load_s:.2f} s; "
            f"{sum(statuses.values())} requests, statuses {dict(statuses)}, "
            f"slowest {slowest * 1000:.0f} ms"
        )
    assert statuses == {200: len(outcomes)}
    assert slowest < 1.0  # nobody waited for the load
    assert outcomes[-1][2] == "2"


def test_a_worker_that_leaves_during_a_load_does_not_hold_it_up(
    control_stack, redis_url, namespace, tmp_path
):
    s = control_stack(repo=slow_loading_repo(tmp_path))
    stays, leaves = s.workers
    s.wait_ready("big")
    loader = BackgroundAdmin(s, "/v2/repository/models/big/load", {"parameters": {"version": "2"}})
    loader.start()
    prepare_sent(redis_url, namespace)
    leaves.stop()  # withdraws mid-load; its answer never comes
    status, answer = loader.result()
    assert status == 200, answer
    assert stays.worker.id in answer["workers"]
    assert s.infer("big", sim_body(2.0)).json()["model_version"] == "2"


def test_a_worker_that_starts_during_a_load_joins_it_before_serving(
    control_stack, redis_url, namespace, tmp_path
):
    """It takes part in the change while it starts (before it reads a request), so no request
    routed after the switch can reach a worker without the version."""
    s = control_stack(repo=slow_loading_repo(tmp_path), workers=1)
    (first,) = s.workers
    s.wait_ready("big")
    loader = BackgroundAdmin(s, "/v2/repository/models/big/load", {"parameters": {"version": "2"}})
    loader.start()
    prepare_sent(redis_url, namespace)
    late = s.add_worker(("big",))  # starts while the first worker loads version 2
    status, answer = loader.result()
    assert status == 200, answer
    # The gateway waited for the late worker if it was advertised by the last look;
    # either way the late worker had version 2 before it read a request.
    assert first.worker.id in answer["workers"]
    model = late.worker.slots["big"].model
    wait_until(lambda: list(model.backends) == ["2"], what="the late worker on version 2")
    for i in range(20):
        assert s.infer("big", sim_body(float(i))).json()["model_version"] == "2"
    assert late.stats.failed == 0 and first.stats.failed == 0
