"""Models loaded on their first request (``--load on-demand``), on real gateways, workers and
redis-server: a worker under ``--max-loaded-models 2`` serves three real models in turn and
unloads the least recently used; a loadable model is described and waited for, never refused;
two workers share four models, each model staying on the worker that holds it while that
worker keeps up, and a second worker loads a model whose backlog waits too long; canary, hot
swap and unload apply to a model loaded on demand; a model idle past the limit is unloaded."""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DIGITS
from tests.integration.test_model_control import TOKEN, admin, digits_body, make_repo
from tests.support import Stack, WorkerThread, sim_body, wait_until, write_simulated_model

MODELS = DIGITS.parent
LABELS: list[int] = json.loads((DIGITS / "samples.json").read_text())["labels"]
PNGS = MODELS / "digits-png" / "1" / "samples"
FRESH = {"cache-control": "no-cache"}
"""Every request runs on a worker (the result cache would answer repeats itself)."""


def png_body(digit: int) -> dict[str, Any]:
    image = base64.b64encode((PNGS / f"{digit}.png").read_bytes()).decode()
    return {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "data": [image]}]}


def label(response: Any) -> int:
    assert response.status_code == 200, response.text
    out = {o["name"]: o["data"] for o in response.json()["outputs"]}
    return int(out["label"][0])


def counter(worker: WorkerThread, name: str, **labels: str) -> float:
    value = worker.worker.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


@pytest.fixture
def real_repo(tmp_path: Path) -> Path:
    """digits (ONNX), digits-png (the Python backend) and a copy of digits as digits-b (PyTorch's
    digits-pt would do, but importing torch takes longer than a request's deadline here)."""
    repo = tmp_path / "models"
    ignore = shutil.ignore_patterns("*.py[co]", "__pycache__", "train.py")
    for name, source in (
        ("digits", "digits"),
        ("digits-png", "digits-png"),
        ("digits-b", "digits"),
    ):
        shutil.copytree(MODELS / source, repo / name, ignore=ignore)
    return repo


@pytest.fixture
def on_demand(redis_url: str, namespace: str) -> Iterator[Callable[..., Stack]]:
    started: list[Any] = []

    def make(repo: Path, *, workers: int = 1, **options: Any) -> Stack:
        s = Stack(redis_url, namespace, repo, started)
        for _ in range(workers):
            s.add_worker(load="on-demand", demand_poll_s=0.05, **options)
        s.start_gateway()
        return s

    yield make
    for thing in reversed(started):
        thing.stop()


def test_a_worker_under_a_budget_of_two_serves_three_models_unloading_the_least_recent(
    on_demand, real_repo
):
    s = on_demand(real_repo, max_loaded_models=2)
    (w,) = s.workers
    assert len(w.worker.slots) == 0  # nothing loaded at start

    def digits(i: int) -> int:
        return label(s.infer("digits", digits_body(i), **FRESH))

    def digits_b(i: int) -> int:
        return label(s.infer("digits-b", digits_body(i), **FRESH))

    def digits_png(digit: int) -> int:
        return label(s.infer("digits-png", png_body(digit), **FRESH))

    for i in range(3):
        assert digits(i) == LABELS[i]
    for d in (3, 7, 9):
        assert digits_png(d) == d
    assert set(w.worker.slots) == {"digits", "digits-png"}
    for i in range(3, 6):
        assert digits_b(i) == LABELS[i]
    # digits was used least recently: it made room for digits-b.
    assert set(w.worker.slots) == {"digits-png", "digits-b"}
    for i in range(6, 9):
        assert digits(i) == LABELS[i]
    assert set(w.worker.slots) == {"digits-b", "digits"}

    loads = "inferq_worker_model_loads_total"
    unloads = "inferq_worker_model_unloads_total"
    wait_until(  # a load is counted once measured, just after the model starts serving
        lambda: (
            counter(w, loads, model="digits") == 2
            and counter(w, "inferq_worker_model_load_seconds_count", model="digits") == 2
        ),
        what="the second load of digits to be counted",
    )
    assert counter(w, loads, model="digits-png") == 1
    assert counter(w, loads, model="digits-b") == 1
    assert counter(w, unloads, model="digits", reason="budget") == 1
    assert counter(w, unloads, model="digits-png", reason="budget") == 1
    assert counter(w, "inferq_worker_loaded_models") == 2
    assert counter(w, "inferq_worker_model_resident_bytes", model="digits-b") >= 0
    assert w.stats.requests == 12


def test_a_loadable_model_is_described_waited_for_and_ready_once_loaded(on_demand, real_repo):
    s = on_demand(real_repo)
    with s.client() as c:
        wait_until(
            lambda: c.get("/v2/models/digits").status_code == 200, what="digits to be described"
        )
        meta = c.get("/v2/models/digits").json()
        assert [i["name"] for i in meta["inputs"]] == ["input"]
        ready = c.get("/v2/models/digits/ready")
        assert (ready.status_code, ready.json()["state"]) == (503, "loadable")
        assert c.get("/v2/health/ready").status_code == 200  # requests are taken
    assert len(s.workers[0].worker.slots) == 0  # describing it loaded nothing
    assert label(s.infer("digits", digits_body(0))) == LABELS[0]
    with s.client() as c:  # ready once the worker's next advertisement reaches the gateway
        wait_until(
            lambda: c.get("/v2/models/digits/ready").json()["state"] == "ready",
            what="digits to be ready",
        )
        assert c.get("/v2/models/digits/ready").status_code == 200


def answers(s: Stack, model: str, values: list[float]) -> list[float]:
    """Send one request per value, all at once; each answer's sum. A 30 s deadline: admission
    must not refuse the backlog these tests build on purpose, however slow the machine."""

    def one(v: float) -> float:
        r = s.infer(model, sim_body(v, timeout=30_000_000))
        assert r.status_code == 200, r.text
        return float(r.json()["outputs"][0]["data"][0])

    with ThreadPoolExecutor(len(values)) as pool:
        return list(pool.map(one, values))


def holders(s: Stack, model: str) -> int:
    return sum(model in w.worker.slots for w in s.workers)


def test_two_workers_four_models_each_stays_on_its_holder_until_its_backlog_waits(
    on_demand, tmp_path
):
    repo = tmp_path / "models"
    for name in ("a", "b", "c"):
        write_simulated_model(repo, name, base_ms=1, per_row_ms=0, max_batch=8)
    write_simulated_model(repo, "slow", base_ms=100, per_row_ms=0, max_batch=1)
    s = on_demand(repo, workers=2, load_after_ms=600)

    # Light traffic: each model is loaded by one worker and stays there.
    for round_ in range(3):
        for name in ("a", "b", "c"):
            assert answers(s, name, [round_ + 1.0] * 2) == [4.0 * (round_ + 1)] * 2
    for name in ("a", "b", "c"):
        assert holders(s, name) == 1, name

    def loads() -> float:
        return sum(
            counter(w, "inferq_worker_model_loads_total", model=name)
            for w in s.workers
            for name in ("a", "b", "c")
        )

    # Counted once measured, just after each model starts serving; none loaded twice.
    wait_until(lambda: loads() >= 3, what="the three loads to be counted")
    assert loads() == 3

    # A backlog on slow (one 100 ms call per request): its oldest request waits past
    # --load-after-ms on the one worker that holds it, so the other loads it too.
    values = [float(i) for i in range(40)]
    assert answers(s, "slow", values) == [4.0 * v for v in values]
    assert holders(s, "slow") == 2
    ran = [
        w.worker.metrics.registry.get_sample_value(
            "inferq_worker_requests_total", {"model": "slow", "version": "1", "status": "ok"}
        )
        or 0
        for w in s.workers
    ]
    assert sum(ran) == 40 and min(ran) > 0


@pytest.fixture
def policy_stack(redis_url: str, namespace: str, tmp_path: Path) -> Iterator[Stack]:
    """digits as versions 1 and 2 (the config serves 1), one on-demand worker, and a gateway
    with the admin token."""
    started: list[Any] = []
    s = Stack(redis_url, namespace, make_repo(tmp_path, ["1", "2"]), started)
    s.add_worker(load="on-demand", demand_poll_s=0.05, retire_after_s=0.5)
    s.start_gateway(admin_token=TOKEN)
    yield s
    for thing in reversed(started):
        thing.stop()


def versions_answering(s: Stack, n: int) -> set[str]:
    answers = [s.infer("digits", digits_body(i), **FRESH) for i in range(n)]
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
    return {r.json()["model_version"] for r in answers}


def test_canary_hot_swap_and_unload_apply_to_a_model_loaded_on_demand(policy_stack):
    s = policy_stack
    (w,) = s.workers
    with s.client() as c:
        wait_until(lambda: c.get("/v2/models/digits").status_code == 200, what="digits described")
    # A canary committed while no worker holds the model: checked against the repository, not
    # loaded; the load its first request brings serves it.
    r = admin(s, "/v2/repository/models/digits/load", {"parameters": {"weights": {"1": 1, "2": 1}}})
    assert r.status_code == 200, r.text
    assert "digits" not in w.worker.slots
    assert versions_answering(s, 40) == {"1", "2"}
    assert sorted(w.worker.slots["digits"].model.backends) == ["1", "2"]
    # A hot swap of the held model: the usual prepare and commit.
    r = admin(s, "/v2/repository/models/digits/load", {"parameters": {"version": "2"}})
    assert r.status_code == 200, r.text
    assert versions_answering(s, 10) == {"2"}
    # An administrator's unload gives the model up on this worker, counted as such.
    r = admin(s, "/v2/repository/models/digits/unload")
    assert r.status_code == 200, r.text
    wait_until(  # counted once the slot is closed, just after it leaves ``slots``
        lambda: (
            counter(w, "inferq_worker_model_unloads_total", model="digits", reason="control") == 1
        ),
        what="digits to be unloaded",
    )
    assert "digits" not in w.worker.slots
    assert s.infer("digits", digits_body(0)).status_code == 503
    # Loaded again: as its repository config says (version 1), on the next request.
    r = admin(s, "/v2/repository/models/digits/load")
    assert r.status_code == 200, r.text
    assert versions_answering(s, 5) == {"1"}
    wait_until(  # counted once measured, just after the model starts serving
        lambda: counter(w, "inferq_worker_model_loads_total", model="digits") == 2,
        what="the second load to be counted",
    )


def test_a_model_idle_past_the_limit_is_unloaded_and_loaded_again_when_asked(on_demand, real_repo):
    s = on_demand(real_repo, unload_idle_s=0.3)
    (w,) = s.workers
    assert label(s.infer("digits", digits_body(1))) == LABELS[1]
    wait_until(
        lambda: counter(w, "inferq_worker_model_unloads_total", model="digits", reason="idle") == 1,
        what="digits to idle out",
    )
    assert label(s.infer("digits", digits_body(2), **FRESH)) == LABELS[2]
    wait_until(  # counted once measured, which may be just after the first answer
        lambda: counter(w, "inferq_worker_model_loads_total", model="digits") == 2,
        what="the second load to be counted",
    )


def test_on_one_redis_and_on_a_cluster_two_models_take_turns_under_a_budget_of_one(
    either_redis, namespace, tmp_path
):
    repo = tmp_path / "models"
    write_simulated_model(repo, "a", base_ms=1, per_row_ms=0, max_batch=8)
    write_simulated_model(repo, "b", base_ms=1, per_row_ms=0, max_batch=8, partitions=2)
    started: list[Any] = []
    s = Stack(either_redis.url, namespace, repo, started)
    try:
        w = s.add_worker(load="on-demand", demand_poll_s=0.05, max_loaded_models=1)
        s.start_gateway()
        for round_ in range(3):
            for name in ("a", "b"):
                assert answers(s, name, [float(round_)] * 3) == [4.0 * round_] * 3
                assert set(w.worker.slots) == {name}
        wait_until(  # counted once measured, just after the model starts serving
            lambda: counter(w, "inferq_worker_model_loads_total", model="b") == 3,
            what="b's third load to be counted",
        )
    finally:
        for thing in reversed(started):
            thing.stop()


@pytest.mark.serial  # watches a state that lasts one 1.5 s call
def test_a_request_cut_off_by_an_unload_past_the_drain_timeout_is_handed_back_and_answered(
    redis_url, namespace, tmp_path
):
    """Unloaded while its 1.5 s call runs, under a drain timeout of 0.2 s: the worker stops
    holding the entry (else it would renew it forever and skip it as held when it loads the
    model again); loaded again, it reads its own pending list first and answers it."""
    repo = tmp_path / "models"
    write_simulated_model(repo, "slow", base_ms=1500, per_row_ms=0, max_batch=1)
    started: list[Any] = []
    s = Stack(redis_url, namespace, repo, started)
    try:
        w = s.add_worker(load="on-demand", demand_poll_s=0.05, drain_timeout_s=0.2)
        s.start_gateway(admin_token=TOKEN)
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(answers, s, "slow", [1.0])
            wait_until(lambda: w.worker.holding == 1, what="the first request to be read")
            r = admin(s, "/v2/repository/models/slow/unload")
            assert r.status_code == 200, r.text
            wait_until(
                lambda: (
                    counter(w, "inferq_worker_model_unloads_total", model="slow", reason="control")
                    == 1
                ),
                what="slow to be unloaded",
            )
            assert w.worker.holding == 0  # handed back, not held and renewed
            r = admin(s, "/v2/repository/models/slow/load")
            assert r.status_code == 200, r.text
            assert answers(s, "slow", [2.0]) == [8.0]  # its request brings the load
            assert first.result(timeout=30) == [4.0]
    finally:
        for thing in reversed(started):
            thing.stop()
