"""Model control, the Triton model-repository API: index, load (with versions and traffic
weights), unload. Every call needs the admin bearer token.

A load is the two-phase change described in ``protocol.control``: this gateway sends PREPARE,
waits until every live worker serving the model has loaded and warmed the new versions (or one
failed, or the load timeout passed), then commits the policy (or aborts it). Traffic switches at
the commit, never before the last worker is ready; a failure changes nothing that serves.
One change per model at a time (a Redis lock), so two administrators cannot interleave.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis
import structlog

from producer.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    NotFound,
    ServiceUnavailable,
    Unauthorized,
)
from producer.registry import ModelEntry, ModelRegistry, status_lines
from producer.settings import GatewaySettings
from protocol import ProtocolError
from protocol.control import (
    COMMAND_FIELD,
    Command,
    LoadReport,
    Op,
    VersionPolicy,
    check_weights,
    version_order,
)
from protocol.keys import Keys, is_valid_name

log = structlog.get_logger("inferq.gateway")

CONTROL_MAXLEN = 1_000
"""Control-stream entries kept (approximate trim): commands are applied within seconds."""
_POLL_S = 0.02
"""How often a load reads its reply list. Polling, not BLPOP: a blocking pop would hold a Redis
connection per admin call, and the gateway keeps O(1) connections; loads are rare and take
seconds, so 20 ms polls cost nothing that matters."""


def check_token(configured: str | None, authorization: str | None) -> None:
    """401 without credentials, 403 with wrong ones or when no token is configured."""
    if not configured:
        raise Forbidden(
            "the model-control API is disabled: start the gateway with --admin-token "
            "(or INFERQ_ADMIN_TOKEN) to enable it"
        )
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise Unauthorized(
            "the model-control API needs the admin token: send 'Authorization: Bearer <token>'"
        )
    if not hmac.compare_digest(given.strip().encode(), configured.encode()):
        raise Forbidden("the admin token is not valid")


@dataclass(frozen=True, slots=True)
class LoadRequest:
    """What a load call asks for: ``versions`` empty means as the repository config says."""

    versions: tuple[str, ...]
    weights: dict[str, float]


def parse_load(params: Any) -> LoadRequest:
    """The ``parameters`` of a load body: ``version`` ("2") or ``weights`` ({"1": 90, "2": 10});
    neither reloads the model as its repository config says."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise BadRequest("'parameters' must be a JSON object")
    overrides = [k for k in params if k == "config" or str(k).startswith("file:")]
    if overrides:
        raise BadRequest(
            f"parameter '{overrides[0]}' is not supported: inferq loads models only from its "
            "model repository; put the files there and load by version"
        )
    unknown = sorted(set(params) - {"version", "weights"})
    if unknown:
        raise BadRequest(
            f"unknown parameter '{unknown[0]}' (expected 'version' or 'weights', e.g. "
            '{"parameters": {"weights": {"1": 90, "2": 10}}})'
        )
    if "version" in params and "weights" in params:
        raise BadRequest("give either 'version' or 'weights', not both")
    if "version" in params:
        version = params["version"]
        if isinstance(version, int) and not isinstance(version, bool):
            version = str(version)
        if not isinstance(version, str) or not is_valid_name(version):
            raise BadRequest(
                f"invalid version {version!r}: versions are folder names inside the model's "
                "repository folder (letters, digits, '_', '-', '.'; no paths)"
            )
        return LoadRequest((version,), {})
    if "weights" in params:
        try:
            weights = check_weights(params["weights"])
        except ProtocolError as e:
            raise BadRequest(str(e)) from None
        return LoadRequest(tuple(sorted(weights, key=version_order)), weights)
    return LoadRequest((), {})


class ModelAdmin:
    def __init__(
        self,
        settings: GatewaySettings,
        keys: Keys,
        redis: aioredis.Redis,
        registry: ModelRegistry,
    ) -> None:
        self.settings = settings
        self.keys = keys
        self.redis = redis
        self.registry = registry

    def authorize(self, authorization: str | None) -> None:
        check_token(self.settings.admin_token, authorization)

    # -- index -----------------------------------------------------------------------------

    async def index(self, *, ready_only: bool = False) -> list[dict[str, Any]]:
        """One row per model version (Triton's shape: name, version, state, reason)."""
        await self.registry.refresh()
        names = sorted(self.registry.models)
        statuses = await self.statuses(names)
        rows: list[dict[str, Any]] = []
        for name in names:
            entry = self.registry.models[name]
            failures = [r for r in statuses.get(name, []) if not r.ok]
            reason = "; ".join(f"worker {r.worker}: {r.error}" for r in failures)
            if entry.unloaded:
                rows.append({"name": name, "state": "UNAVAILABLE", "reason": "unloaded"})
                continue
            ready = entry.workers > 0
            for version in entry.metadata.versions:
                rows.append(
                    {
                        "name": name,
                        "version": version,
                        "state": "READY" if ready else "UNAVAILABLE",
                        "reason": reason if ready else reason or "no live worker serves it",
                        "traffic": entry.traffic.get(version, 0.0),
                    }
                )
        return [r for r in rows if r["state"] == "READY"] if ready_only else rows

    async def statuses(self, names: list[str]) -> dict[str, list[LoadReport]]:
        """Each model's status lines, from the live workers that serve it."""
        workers = self.registry.live_worker_infos()
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(self.keys.model_status(name))
        replies = await pipe.execute()
        return {
            name: status_lines(raw, name, workers) for name, raw in zip(names, replies, strict=True)
        }

    # -- load / unload ---------------------------------------------------------------------

    async def load(self, model: str, params: Any) -> dict[str, Any]:
        request = parse_load(params)
        entry, workers = await self._served(model)
        async with self._locked(model):
            generation = int(await self.redis.incr(self.keys.policy_generation))
            wanted = VersionPolicy(request.versions, request.weights, generation)
            reports, left = await self._prepare(model, wanted, workers)
            failed = [r for r in reports.values() if not r.ok]
            missing = sorted(set(workers) - set(reports) - left)
            if failed or missing:
                await self._send(Command(Op.ABORT, model, wanted))
                problems = [f"worker {r.worker}: {r.error}" for r in failed]
                problems += [
                    f"worker {w}: did not answer within {self.settings.admin_load_timeout_s:g} s"
                    for w in missing
                ]
                log.error("model load failed", model=model, errors=problems)
                serving = ", ".join(entry.metadata.versions) or "nothing"
                raise BadRequest(
                    f"failed to load model '{model}' ({_describe(wanted)}): "
                    f"{'; '.join(problems)}. Nothing changed: it still serves {serving}"
                )
            try:
                policy = self._final(wanted, reports)
            except Conflict:
                await self._send(Command(Op.ABORT, model, wanted))
                raise
            await self._commit(model, policy)
        log.info("model loaded", model=model, versions=policy.versions, weights=policy.weights)
        return self._answer(model, policy, reports)

    async def unload(self, model: str, params: Any) -> dict[str, Any]:
        """Unload the model (every version), or with ``{"version": v}`` drop one version from
        its policy. Requests already routed finish; the versions are unloaded after the
        workers' retirement grace."""
        if params is None:
            params = {}
        if not isinstance(params, dict) or set(params) - {"version", "unload_dependents"}:
            raise BadRequest("unload takes no parameters other than 'version'")
        entry, _ = await self._served(model, need_workers=False)
        async with self._locked(model):
            generation = int(await self.redis.incr(self.keys.policy_generation))
            versions: tuple[str, ...] = ()
            weights: dict[str, float] = {}
            if "version" in params:
                version = str(params["version"])
                if version not in entry.metadata.versions:
                    raise NotFound(
                        f"model '{model}' does not serve version '{version}' (versions: "
                        f"{', '.join(entry.metadata.versions) or 'none'})"
                    )
                versions = tuple(v for v in entry.metadata.versions if v != version)
                weights = {v: w for v, w in entry.traffic.items() if v != version}
                if not any(weights.values()):
                    weights = {}
            policy = VersionPolicy(versions, weights, generation)
            await self._commit(model, policy)
        log.info("model unloaded", model=model, versions_left=versions)
        return self._answer(model, policy, {})

    # -- steps -----------------------------------------------------------------------------

    async def _served(
        self, model: str, *, need_workers: bool = True
    ) -> tuple[ModelEntry, list[str]]:
        if not is_valid_name(model):
            raise BadRequest(
                f"invalid model name {model!r}: model names are folder names inside the model "
                "repository (letters, digits, '_', '-', '.'; no paths)"
            )
        await self.registry.refresh()
        entry = self.registry.models.get(model)
        if entry is None:
            known = ", ".join(sorted(self.registry.models)) or "none"
            raise NotFound(f"unknown model '{model}' (models known: {known})")
        workers = sorted(self._serving(model))
        if need_workers and not workers:
            raise ServiceUnavailable(
                f"no live worker serves model '{model}' to load it; start one with "
                f"`inferq worker --models {model}`",
                retry_after_s=5,
            )
        return entry, workers

    def _locked(self, model: str) -> _ModelLock:
        ttl_s = self.settings.admin_load_timeout_s + 30
        return _ModelLock(self.redis, self.keys.model_lock(model), model, ttl_s)

    async def _commit(self, model: str, policy: VersionPolicy) -> None:
        """Store the policy and tell every worker, atomically; route by it here at once."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.policies, model, policy.encode())
        pipe.xadd(
            self.keys.control,
            {COMMAND_FIELD: Command(Op.COMMIT, model, policy).encode()},
            maxlen=CONTROL_MAXLEN,
            approximate=True,
        )
        await pipe.execute()
        self.registry.apply_policy(model, policy)

    async def _send(self, command: Command) -> None:
        await self.redis.xadd(
            self.keys.control,
            {COMMAND_FIELD: command.encode()},
            maxlen=CONTROL_MAXLEN,
            approximate=True,
        )

    async def _prepare(
        self, model: str, policy: VersionPolicy, workers: list[str]
    ) -> tuple[dict[str, LoadReport], set[str]]:
        """Send PREPARE; collect a report from every worker that serves the model until all
        have answered or the load timeout. The set is re-read every second and once more
        before returning: a worker that stops meanwhile no longer counts, and one that starts
        meanwhile (it joins the change before it reads any request) is waited for too.
        Returns the reports and the workers that left."""
        reply_to = self.keys.control_reply(secrets.token_hex(8))
        await self._send(Command(Op.PREPARE, model, policy, reply_to))
        expected = set(workers)
        reports: dict[str, LoadReport] = {}
        deadline = time.monotonic() + self.settings.admin_load_timeout_s
        next_look = time.monotonic() + 1.0
        seen = 0
        while time.monotonic() < deadline:
            raw = cast(list[bytes], await self.redis.lrange(reply_to, seen, -1))
            seen += len(raw)
            for item in raw:
                try:
                    report = LoadReport.decode(item)
                except ProtocolError:
                    continue
                if report.generation == policy.generation:
                    reports[report.worker] = report
            answered = not expected - set(reports)
            if answered or time.monotonic() >= next_look:
                await self.registry.refresh()
                expected = self._serving(model) | (expected & set(reports))
                next_look = time.monotonic() + 1.0
                if not expected - set(reports):
                    break
            await asyncio.sleep(_POLL_S)
        await self.redis.delete(reply_to)
        return reports, set(workers) - expected - set(reports)

    def _serving(self, model: str) -> set[str]:
        """Live workers that advertise the model, as of the last registry refresh."""
        return {
            w.id
            for w in self.registry.live_worker_infos()
            if any(m.name == model for m in w.models)
        }

    def _final(self, wanted: VersionPolicy, reports: dict[str, LoadReport]) -> VersionPolicy:
        """The policy to commit. A load by the repository config takes the versions and weights
        the workers read from it (they must agree)."""
        if wanted.versions:
            return wanted
        answers = {(r.versions, tuple(sorted(r.weights.items()))) for r in reports.values()}
        if len(answers) != 1:
            raise Conflict(
                "the workers' model repositories disagree on the versions to load: "
                + "; ".join(f"{r.worker}: {', '.join(r.versions)}" for r in reports.values())
            )
        versions, weights = answers.pop()
        return VersionPolicy(versions, dict(weights), wanted.generation)

    def _answer(
        self, model: str, policy: VersionPolicy, reports: dict[str, LoadReport]
    ) -> dict[str, Any]:
        return {
            "name": model,
            "versions": list(policy.versions),
            "traffic": {v: w for v, w in policy.traffic().items()},
            "generation": policy.generation,
            "workers": {
                r.worker: {"versions": list(r.versions), "load_ms": round(r.load_ms, 1)}
                for r in reports.values()
            },
        }


class _ModelLock:
    """``SET NX`` with a TTL, released only by its holder (a crashed gateway's lock expires)."""

    def __init__(self, redis: aioredis.Redis, key: str, model: str, ttl_s: float) -> None:
        self._redis, self._key, self._model, self._ttl_s = redis, key, model, ttl_s
        self._token = secrets.token_hex(8)

    async def __aenter__(self) -> None:
        if not await self._redis.set(self._key, self._token, nx=True, px=int(self._ttl_s * 1000)):
            raise Conflict(
                f"another load or unload of model '{self._model}' is in progress; retry when it "
                "has finished"
            )

    async def __aexit__(self, *exc: object) -> None:
        await self._redis.eval(_RELEASE, 1, self._key, self._token)


_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def _describe(policy: VersionPolicy) -> str:
    if not policy.versions:
        return "versions as its repository config says"
    if policy.weights:
        return "weights " + ", ".join(f"{v}: {w:g}" for v, w in policy.weights.items())
    return f"version {', '.join(policy.versions)}"
