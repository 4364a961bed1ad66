"""The model-control API's logic that needs no Redis: the token, the load parameters, how the
registry merges what workers advertise, and the repository index's states."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from producer.admin import check_token, index_rows, parse_load
from producer.errors import BadRequest, Forbidden, Unauthorized
from producer.registry import ModelRegistry, merge, repository_view
from protocol.control import LoadReport, VersionPolicy
from protocol.keys import Keys
from protocol.registry import ModelMetadata, RepositoryModel, TensorSpec, WorkerInfo
from runtime.connections import RedisClock


def test_no_configured_token_disables_the_api():
    with pytest.raises(Forbidden, match="--admin-token"):
        check_token(None, "Bearer anything")


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer   ", "Basic dXNlcjpwYXNz", "t0k"])
def test_missing_credentials_are_401(header):
    with pytest.raises(Unauthorized):
        check_token("t0k", header)


def test_a_wrong_token_is_403_and_the_right_one_passes():
    with pytest.raises(Forbidden):
        check_token("t0k", "Bearer t0kk")
    check_token("t0k", "Bearer t0k")
    check_token("t0k", "bearer  t0k ")


def test_load_parameters():
    assert parse_load(None).versions == ()
    assert parse_load({"version": "2"}).versions == ("2",)
    assert parse_load({"version": 2}).versions == ("2",)
    weighted = parse_load({"weights": {"10": 1, "2": 9}})
    assert weighted.versions == ("2", "10") and weighted.weights == {"10": 1.0, "2": 9.0}


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ("2", "must be a JSON object"),
        ({"version": "../../etc"}, "no paths"),
        ({"version": "/abs"}, "no paths"),
        ({"version": None}, "invalid version"),
        ({"version": "1", "weights": {"1": 1}}, "not both"),
        ({"config": "{}"}, "only from its model repository"),
        ({"file:1/model.onnx": "AA=="}, "only from its model repository"),
        ({"versions": ["1"]}, "unknown parameter 'versions'"),
        ({"weights": {"1": -5}}, "not negative"),
    ],
)
def test_bad_load_parameters_say_what_is_wrong(params, words):
    with pytest.raises(BadRequest, match=words):
        parse_load(params)


def _meta(versions: tuple[str, ...], weights: dict[str, float] | None = None) -> ModelMetadata:
    return ModelMetadata(
        "m",
        versions,
        versions[-1],
        "onnxruntime_onnx",
        (TensorSpec("x", "FP32", (-1, 1)),),
        (TensorSpec("y", "FP32", (-1, 1)),),
        8,
        1000,
        True,
        60,
        weights or {},
    )


def test_the_registry_routes_by_the_committed_policy_over_what_workers_advertise():
    worker = WorkerInfo("w", "h", 1, 0, (_meta(("1", "2")),))
    plain = merge([worker], {})["m"]
    assert plain.traffic == {"2": 1.0} and plain.metadata.default_version == "2"
    canary = merge([worker], {}, {"m": VersionPolicy(("1", "2"), {"1": 9, "2": 1}, 3)})["m"]
    assert canary.traffic == {"1": 0.9, "2": 0.1}
    assert canary.metadata.default_version == "1"
    unloaded = merge([worker], {}, {"m": VersionPolicy((), {}, 4)})["m"]
    assert unloaded.unloaded and unloaded.metadata.versions == ()


def test_a_repository_config_split_is_used_when_no_policy_is_committed():
    worker = WorkerInfo("w", "h", 1, 0, (_meta(("1", "2"), {"1": 3.0, "2": 1.0}),))
    assert merge([worker], {})["m"].traffic == {"1": 0.75, "2": 0.25}


def test_a_policy_every_worker_fell_back_from_routes_by_what_they_serve():
    stale = {"m": VersionPolicy(("2",), {}, 5)}
    fell_back = WorkerInfo("w", "h", 1, 0, (_meta(("1",)),), fallbacks={"m": 5})
    entry = merge([fell_back], {}, stale)["m"]
    assert entry.fallback and entry.ready and entry.policy == stale["m"]
    assert entry.metadata.versions == ("1",) and entry.traffic == {"1": 1.0}
    # One worker still serves the policy: route by it (the repositories differ; documented).
    serving = WorkerInfo("v", "h", 2, 0, (_meta(("2",)),))
    mixed = merge([fell_back, serving], {}, stale)["m"]
    assert not mixed.fallback and mixed.traffic == {"2": 1.0}
    # A newer policy than the one it fell back from is followed.
    newer = merge([fell_back], {}, {"m": VersionPolicy(("1",), {}, 6)})["m"]
    assert not newer.fallback


def test_the_repositories_merge_into_one_view_per_model():
    a = WorkerInfo("a", "h", 1, 10, (), repository=(RepositoryModel("new", ("1",), _meta(("1",))),))
    b = WorkerInfo(
        "b",
        "h",
        2,
        20,
        (),
        repository=(RepositoryModel("new", ("1", "2"), None, "bad config"),),
    )
    [(name, view)] = repository_view([a, b]).items()
    assert name == "new" and view.versions == ("1", "2") and view.workers == ("a", "b")
    assert view.metadata == _meta(("1",)) and view.errors == {"b": "bad config"}


def test_a_model_only_on_demand_workers_hold_is_loadable_not_ready():
    repo = (RepositoryModel("m", ("1",), _meta(("1",))),)
    loader = WorkerInfo("od", "h", 1, 0, (), repository=repo, on_demand=True)
    entry = merge([loader], {})["m"]
    assert (entry.ready, entry.loadable, entry.state) == (False, 1, "loadable")
    assert entry.metadata.inputs == _meta(("1",)).inputs  # described without a load
    # A worker that only lists the model (it loads at start, not on demand) makes it no more.
    lister = WorkerInfo("w", "h", 1, 0, (), repository=repo)
    assert "m" not in merge([lister], {})
    served = merge([loader, WorkerInfo("s", "h", 2, 0, (_meta(("1",)),))], {})["m"]
    assert (served.state, served.workers, served.loadable) == ("ready", 1, 1)
    unloaded = merge([loader], {}, {"m": VersionPolicy((), {}, 4)})["m"]
    assert unloaded.state == "unloaded"


def test_the_index_states():
    worker = WorkerInfo("w", "h", 1, 0, (_meta(("1", "2")),))
    served = merge([worker], {})["m"]
    failed = LoadReport("w", "m", 3, False, ("1", "2"), error="corrupt v3")
    why = "worker w: corrupt v3"
    assert index_rows("m", served, None, [failed]) == [
        {"name": "m", "version": v, "state": "READY", "reason": why, "traffic": t}
        for v, t in (("1", 0.0), ("2", 1.0))
    ]
    unloaded = merge([worker], {}, {"m": VersionPolicy((), {}, 4)})["m"]
    assert index_rows("m", unloaded, None, []) == [
        {"name": "m", "state": "UNAVAILABLE", "reason": "unloaded"}
    ]
    held = repository_view(
        [WorkerInfo("w", "h", 1, 0, (), repository=(RepositoryModel("m", ("1",), _meta(("1",))),))]
    )["m"]
    assert index_rows("m", None, held, []) == [
        {"name": "m", "state": "UNAVAILABLE", "reason": "not loaded"}
    ]
    gone = merge([], {"m": _meta(("1",))})["m"]
    assert index_rows("m", gone, None, []) == [
        {"name": "m", "version": "1", "state": "UNAVAILABLE", "reason": "no live worker serves it"}
    ]


def test_the_server_is_not_ready_when_every_served_model_is_unloaded():
    registry = ModelRegistry(None, Keys("t"), RedisClock(), refresh_s=1)  # type: ignore[arg-type]
    worker = WorkerInfo("w", "h", 1, 0, (_meta(("1",)),))
    registry.models = merge([worker], {})
    assert registry.not_serving() is None and registry.live_workers == 1
    registry.models = merge([worker], {}, {"m": VersionPolicy((), {}, 2)})
    assert registry.live_workers == 0
    problem = registry.not_serving()
    assert problem is not None and "unloaded (m)" in problem and "/load" in problem


class PausedRefresh:
    """A Redis whose registry snapshot, read before a commit, arrives only when let go: an
    advertisement of ``m`` version 1 and no policy stored."""

    def __init__(self, worker: WorkerInfo) -> None:
        self.worker = worker
        self.reading = asyncio.Event()
        self.let_go = asyncio.Event()

    async def zrangebyscore(self, *_: object) -> list[bytes]:
        return [b"w"]

    def pipeline(self, transaction: bool = False) -> PausedRefresh:
        return self

    def execute_command(self, *_: object) -> None:
        pass

    def hgetall(self, _: str) -> None:
        pass

    def get(self, _: str) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        raise RedisConnectionError(f"{name}: not part of this snapshot")  # the backlog look

    async def execute(self) -> list[Any]:
        self.reading.set()
        await self.let_go.wait()
        return [[self.worker.encode()], {}, {}, None]


def test_a_committed_policy_outlives_a_refresh_that_read_redis_before_the_commit():
    worker = WorkerInfo("w", "h", 1, 0, (_meta(("1",)),))
    redis = PausedRefresh(worker)
    unloaded = VersionPolicy((), {}, 2)

    async def scenario() -> ModelRegistry:
        registry = ModelRegistry(redis, Keys("t"), RedisClock(), refresh_s=1)  # type: ignore[arg-type]
        refresh = asyncio.create_task(registry.refresh())
        await redis.reading.wait()  # the refresh read the policies: none
        applied = asyncio.create_task(registry.apply_policy("m", unloaded))  # the unload
        await asyncio.sleep(0)
        redis.let_go.set()
        await asyncio.gather(refresh, applied)
        return registry

    registry = asyncio.run(scenario())
    assert registry.models["m"].metadata.versions == ()  # unloaded: nothing is routed to it
    assert registry.live_workers == 0
