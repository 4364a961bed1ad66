"""Model control that cannot wedge, models added while running, and Triton's introspection, on
real gateways and workers: readiness after the last model is unloaded, a committed policy whose
version folder was removed, a model folder copied into a running repository, reset, the
configuration and the statistics."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis

from inferq.cli import main
from protocol.keys import Keys
from tests.conftest import DIGITS
from tests.integration.test_model_control import SAMPLES, TOKEN, admin, digits_body, make_repo
from tests.support import (
    GatewayThread,
    Stack,
    WorkerThread,
    advertisements,
    sim_body,
    wait_until,
    write_simulated_model,
)

LABELS: list[int] = json.loads((DIGITS / "samples.json").read_text())["labels"]


@pytest.fixture
def repo_stack(redis_url: str, namespace: str, tmp_path: Path) -> Iterator[Callable[..., Stack]]:
    started: list[GatewayThread | WorkerThread] = []

    def make(versions: list[str], *, workers: int = 1, policy: str = 'specific = ["1"]') -> Stack:
        s = Stack(redis_url, namespace, make_repo(tmp_path, versions, policy), started)
        for _ in range(workers):
            s.add_worker(retire_after_s=1.0)
        s.start_gateway(admin_token=TOKEN)
        return s

    yield make
    for thing in reversed(started):
        thing.stop()


def ready(s: Stack) -> tuple[int, dict[str, Any]]:
    with s.client() as c:
        r = c.get("/v2/health/ready")
    return r.status_code, r.json()


def index(s: Stack) -> list[dict[str, Any]]:
    r = admin(s, "/v2/repository/index")
    assert r.status_code == 200, r.text
    rows: list[dict[str, Any]] = r.json()
    return rows


# -- the two wedges of issue #23 --------------------------------------------------------------


def test_unloading_the_only_model_makes_the_server_not_ready_until_it_is_loaded_again(repo_stack):
    s = repo_stack(["1"])
    s.wait_ready("digits")
    assert ready(s)[0] == 200
    assert admin(s, "/v2/repository/models/digits/unload").status_code == 200

    status, body = ready(s)
    assert status == 503, body
    assert any("unloaded" in p and "/load" in p for p in body["problems"]), body
    with s.client() as c:
        assert c.get("/v2/models/digits/ready").status_code == 503
    assert index(s) == [{"name": "digits", "state": "UNAVAILABLE", "reason": "unloaded"}]

    assert admin(s, "/v2/repository/models/digits/load").status_code == 200
    assert ready(s)[0] == 200
    assert s.infer("digits", digits_body(0)).status_code == 200


def test_a_policy_naming_a_removed_version_falls_back_to_the_config_and_loads_again(
    repo_stack, redis_url, namespace, capsys
):
    s = repo_stack(["1", "2"])  # the config serves version 1
    write_simulated_model(s.repo, "other", base_ms=1, per_row_ms=0, max_batch=4)
    s.wait_ready("digits")
    r = admin(s, "/v2/repository/models/digits/load", {"parameters": {"version": "2"}})
    assert r.status_code == 200 and r.json()["versions"] == ["2"], r.text
    (old,) = s.workers
    old.stop()
    shutil.rmtree(s.repo / "digits" / "2")  # the version the stored policy names is gone

    # Before the fix the worker skipped digits (it served only "other"), and every load was
    # refused: "no live worker serves model 'digits'".
    late = s.add_worker()
    assert "digits" in late.worker.slots, late.worker.skipped
    assert list(late.worker.slots["digits"].model.backends) == ["1"]
    s.wait_ready("digits")
    # Until the gateway's registry has seen the fallback (a refresh after the late worker's
    # advertisement), it routes by the stored policy, to version 2.
    with s.client() as c:
        wait_until(
            lambda: c.get("/v2/models/digits").json().get("versions") == ["1"],
            what="the gateway to route digits by the fallback",
        )
    assert s.infer("digits", digits_body(0)).json()["model_version"] == "1"
    counted = late.worker.metrics.registry.get_sample_value(
        "inferq_worker_policy_fallbacks_total", {"model": "digits"}
    )
    assert counted == 1
    [row] = [r for r in index(s) if r["name"] == "digits"]
    assert (row["version"], row["state"]) == ("1", "READY")
    assert "serving the repository config" in row["reason"]
    assert "no version folder for 2" in row["reason"]
    flags = ["--redis", redis_url, "--namespace", namespace]
    assert main(["models", "status", "digits", *flags], environ={}) == 0
    out = capsys.readouterr().out
    assert "falls back to its repository config" in out and "no version folder for 2" in out

    # No deadlock: a load is accepted (before the fix: "no live worker serves the model"),
    # and the committed policy is one the repository can serve again.
    r = admin(s, "/v2/repository/models/digits/load", {"parameters": {"version": "1"}})
    assert r.status_code == 200, r.text

    def cleared() -> bool:  # once the worker has applied the commit
        assert main(["models", "status", "digits", *flags], environ={}) == 0
        return "falls back" not in capsys.readouterr().out

    wait_until(cleared, what="the fallback cleared by the commit")
    assert all("serving the repository config" not in r["reason"] for r in index(s))


def test_reset_returns_a_model_to_its_config_policy_and_deletes_the_admin_one(
    repo_stack, redis_url, namespace
):
    s = repo_stack(["1", "2"])
    s.wait_ready("digits")
    weights = {"parameters": {"weights": {"1": 50, "2": 50}}}
    assert admin(s, "/v2/repository/models/digits/load", weights).status_code == 200
    with redis.Redis.from_url(redis_url) as rc:
        assert rc.hexists(Keys(namespace).policies, "digits")
        r = admin(s, "/v2/repository/models/digits/reset")
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["versions"] == ["1"] and answer["policy"] == "repository config"
        assert not rc.hexists(Keys(namespace).policies, "digits")
    assert {s.infer("digits", digits_body(i)).json()["model_version"] for i in range(6)} == {"1"}
    with s.client() as c:
        wait_until(
            lambda: c.get("/v2/models/digits").json()["versions"] == ["1"], what="v2 dropped"
        )
    late = s.add_worker()  # a worker that starts later follows the config, not the old policy
    assert list(late.worker.slots["digits"].model.backends) == ["1"]
    with s.client() as c:
        assert c.post("/v2/repository/models/digits/reset").status_code == 401


def test_inferq_models_reset_calls_the_api_with_the_token(repo_stack, capsys):
    s = repo_stack(["1", "2"])
    s.wait_ready("digits")
    assert (
        admin(s, "/v2/repository/models/digits/load", {"parameters": {"version": "2"}}).status_code
        == 200
    )
    assert main(["models", "reset", "digits", "--url", s.url], environ={}) == 2
    assert "INFERQ_ADMIN_TOKEN" in capsys.readouterr().err
    token = {"INFERQ_ADMIN_TOKEN": TOKEN}
    assert main(["models", "reset", "digits", "--url", s.url], environ=token) == 0
    assert "digits: back to its repository config; serves 1" in capsys.readouterr().out
    assert s.infer("digits", digits_body(0)).json()["model_version"] == "1"
    assert main(["models", "reset", "nosuch", "--url", s.url], environ=token) == 1
    assert "404: unknown model 'nosuch'" in capsys.readouterr().err


# -- a model folder added while running ---------------------------------------------------------


def test_a_model_folder_added_while_running_is_listed_loaded_served_and_unloaded(repo_stack):
    s = repo_stack(["1"], workers=2)
    s.wait_ready("digits")
    shutil.copytree(s.repo / "digits", s.repo / "digits-b")
    wait_until(
        lambda: {"name": "digits-b", "state": "UNAVAILABLE", "reason": "not loaded"} in index(s),
        what="the new folder in the index",
    )
    with s.client() as c:
        assert c.get("/v2/models/digits-b/config").json()["name"] == "digits-b"
    # The index lists a folder once one worker has rescanned; a load goes to those whose
    # advertisement holds it (one rescanning later still loads it at the commit, but answers
    # after the load has been decided), so the answer names both once both have rescanned.
    wait_until(
        lambda: (
            [w.holds("digits-b") for w in advertisements(s.redis_url, s.namespace)] == [True, True]
        ),
        what="both workers to advertise the new folder",
    )
    r = admin(s, "/v2/repository/models/digits-b/load")
    assert r.status_code == 200, r.text
    assert r.json()["versions"] == ["1"] and len(r.json()["workers"]) == 2
    for i in range(8):
        answer = s.infer("digits-b", digits_body(i))
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"][1]["data"] == [LABELS[i % len(LABELS)]]
    # Both workers read its streams: each has its slot.
    assert all("digits-b" in w.worker.slots for w in s.workers)

    r = admin(s, "/v2/repository/models/digits-b/unload")
    assert r.status_code == 200 and r.json()["versions"] == []
    assert s.infer("digits-b", digits_body(0)).status_code == 503
    assert s.infer("digits", digits_body(0)).status_code == 200  # the other model still serves


def test_a_folder_copied_just_before_the_load_is_found(repo_stack):
    s = repo_stack(["1"])
    s.wait_ready("digits")
    shutil.copytree(s.repo / "digits", s.repo / "fresh")
    r = admin(s, "/v2/repository/models/fresh/load")  # no heartbeat has listed it yet
    assert r.status_code == 200, r.text
    assert s.infer("fresh", digits_body(3)).json()["outputs"][1]["data"] == [LABELS[3]]


def test_a_broken_new_folder_is_refused_with_its_reason_and_listed_with_it(repo_stack):
    s = repo_stack(["1"])
    s.wait_ready("digits")
    (s.repo / "broken" / "1").mkdir(parents=True)
    (s.repo / "broken" / "config.toml").write_text('backend = "onnx"\n')
    r = admin(s, "/v2/repository/models/broken/load")
    assert r.status_code == 400
    assert "failed to load model 'broken'" in r.json()["error"] and "inputs" in r.json()["error"]
    wait_until(
        lambda: any(row["name"] == "broken" and "inputs" in row["reason"] for row in index(s)),
        what="the reason in the index",
    )
    assert ready(s)[0] == 200 and s.infer("digits", digits_body(0)).status_code == 200


def test_a_worker_whose_load_failed_at_start_does_not_block_a_change(repo_stack, tmp_path):
    s = repo_stack(["1", "2"])
    s.wait_ready("digits")
    other = tmp_path / "other"
    shutil.copytree(s.repo, other)
    for v in ("1", "2"):
        (other / "digits" / v / "model.onnx").write_bytes(b"not a model")
    write_simulated_model(other, "sim", base_ms=1, per_row_ms=0, max_batch=4)
    broken = s.add_worker(model_repository=other)  # serves sim; digits failed to load
    assert "digits" in broken.worker.skipped
    with s.client() as c:
        wait_until(lambda: c.get("/v2/models/sim/ready").status_code == 200, what="sim")
    r = admin(s, "/v2/repository/models/digits/load", {"parameters": {"version": "2"}})
    assert r.status_code == 200, r.text
    assert list(r.json()["workers"]) == [s.workers[0].worker.id]
    assert s.infer("digits", digits_body(0)).json()["model_version"] == "2"
    # It tried again at the commit, and says why it still cannot.
    wait_until(
        lambda: any(
            broken.worker.id in row["reason"] for row in index(s) if row["name"] == "digits"
        ),
        what="the broken worker's reason in the index",
    )
    assert "digits" not in broken.worker.slots


def test_a_model_no_worker_holds_is_unknown(repo_stack):
    s = repo_stack(["1"])
    s.wait_ready("digits")
    r = admin(s, "/v2/repository/models/nosuch/load")
    assert r.status_code == 404
    assert "unknown model 'nosuch'" in r.json()["error"] and "digits" in r.json()["error"]


# -- Triton's introspection ---------------------------------------------------------------------


def test_the_config_is_tritons_shape(repo_stack):
    s = repo_stack(["1"])
    s.wait_ready("digits")
    with s.client() as c:
        config = c.get("/v2/models/digits/config").json()
        assert c.get("/v2/models/digits/versions/1/config").json() == config
        assert c.get("/v2/models/digits/versions/9/config").status_code == 404
        assert c.get("/v2/models/nosuch/config").status_code == 404
    assert config["name"] == "digits"
    assert (config["platform"], config["backend"]) == ("onnxruntime_onnx", "onnx")
    assert config["max_batch_size"] == 64
    assert config["input"] == [{"name": "input", "data_type": "TYPE_FP32", "dims": [64]}]
    assert {o["name"]: (o["data_type"], o["dims"]) for o in config["output"]} == {
        "logits": ("TYPE_FP32", [10]),
        "label": ("TYPE_INT64", []),
    }
    assert config["dynamic_batching"] == {"max_queue_delay_microseconds": 2000}
    assert config["version_policy"] == {"specific": {"versions": [1]}}


def stats_of(s: Stack, path: str = "/v2/models/stats") -> list[dict[str, Any]]:
    with s.client() as c:
        r = c.get(path)
    assert r.status_code == 200, r.text
    rows: list[dict[str, Any]] = r.json()["model_stats"]
    return rows


def test_the_statistics_count_every_request_sent(repo_stack, capsys):
    s = repo_stack(["1"], workers=2)
    s.wait_ready("digits")
    [zero] = stats_of(s, "/v2/models/digits/stats")
    assert (zero["name"], zero["version"], zero["inference_count"]) == ("digits", "1", 0)
    sent, rows = 40, 0
    with s.client(headers={"cache-control": "no-cache"}) as c:
        for i in range(sent):
            n = 1 + i % 3
            data = SAMPLES[:n]
            body = {
                "inputs": [{"name": "input", "datatype": "FP32", "shape": [n, 64], "data": data}]
            }
            assert c.post("/v2/models/digits/infer", json=body).status_code == 200
            rows += n

    def counted() -> dict[str, Any]:
        [row] = stats_of(s, "/v2/models/digits/versions/1/stats")
        return row

    wait_until(lambda: counted()["inference_stats"]["success"]["count"] == sent, what="the counts")
    row = counted()
    stats = row["inference_stats"]
    with capsys.disabled():
        print(f"\nstatistics[{sent} requests, {rows} rows, 2 workers]: {row}")
    assert row["inference_count"] == rows
    assert stats["fail"]["count"] == 0
    assert stats["queue"]["count"] == stats["compute_infer"]["count"] == sent
    assert stats["success"]["ns"] >= stats["queue"]["ns"] + stats["compute_infer"]["ns"]
    assert 1 <= row["execution_count"] <= sent
    batches = row["batch_stats"]
    assert sum(b["compute_infer"]["count"] for b in batches) == row["execution_count"]
    assert sum(b["batch_size"] * b["compute_infer"]["count"] for b in batches) == rows
    assert row["last_inference"] > time.time() * 1000 - 60_000
    # Every model, and an unknown one.
    assert [r["name"] for r in stats_of(s)] == ["digits"]
    with s.client() as c:
        assert c.get("/v2/models/nosuch/stats").status_code == 404


@pytest.mark.serial  # sends within one 300 ms call
def test_expired_requests_count_as_failures(redis_url, namespace, tmp_path):
    repo = tmp_path / "repo"
    write_simulated_model(repo, "slow", base_ms=300, per_row_ms=0, max_batch=1)
    started: list[GatewayThread | WorkerThread] = []
    s = Stack(redis_url, namespace, repo, started)
    try:
        s.add_worker()
        s.start_gateway()
        s.wait_ready("slow")

        def send(i: int) -> int:
            # The first runs for 300 ms; the others wait behind it past their 100 ms timeout.
            body = sim_body(float(i)) if i == 0 else sim_body(float(i), timeout=100_000)
            if i:
                time.sleep(0.05)
            with s.client() as c:
                return c.post("/v2/models/slow/infer", json=body).status_code

        with ThreadPoolExecutor(4) as pool:
            statuses = list(pool.map(send, range(4)))
        assert statuses[0] == 200 and 504 in statuses[1:], statuses

        def failed() -> int:
            [row] = stats_of(s, "/v2/models/slow/stats")
            return int(row["inference_stats"]["fail"]["count"])

        wait_until(lambda: failed() >= 1, what="an expiry counted as a failure")
    finally:
        for thing in reversed(started):
            thing.stop()


def test_a_model_named_stats_answers_on_every_path_but_the_bare_one_which_stays_tritons(
    redis_url, namespace, tmp_path
):
    """``GET /v2/models/stats`` is the statistics of every model (Triton's, matched first, as
    Triton does); a model named ``stats`` has all its other paths, its metadata included, at
    ``/v2/models/stats/versions/{v}``."""
    from tests.support import stacks, write_simulated_model

    write_simulated_model(tmp_path, "stats", base_ms=1, per_row_ms=0, max_batch=8)
    make, stop = stacks(redis_url, namespace, tmp_path)
    try:
        s = make(models=("stats",))
        s.wait_ready("stats")
        with s.client() as c:
            assert c.post("/v2/models/stats/infer", json=sim_body(2)).status_code == 200
            job = c.post("/v2/models/stats/jobs", json=sim_body(1))
            assert job.status_code == 202, job.text
            every = c.get("/v2/models/stats")
            assert every.status_code == 200 and "model_stats" in every.json()
            assert {m["name"] for m in every.json()["model_stats"]} == {"stats"}
            meta = c.get("/v2/models/stats/versions/1")
            assert meta.status_code == 200 and meta.json()["name"] == "stats", meta.text
            assert c.get("/v2/models/stats/ready").status_code == 200
            assert c.get("/v2/models/stats/versions/1/ready").status_code == 200
            assert c.get("/v2/models/stats/config").json()["name"] == "stats"
            own = c.get("/v2/models/stats/stats").json()["model_stats"]
            assert [m["name"] for m in own] == ["stats"]
            assert c.get("/v2/models/stats/versions/1/stats").status_code == 200
    finally:
        stop()
