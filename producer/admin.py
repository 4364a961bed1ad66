"""Model control, the Triton model-repository API: index, load (with versions and traffic
weights), unload, and inferq's reset (back to the repository config). Every call needs the
admin bearer token.

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
from producer.registry import ModelEntry, ModelRegistry, RepositoryEntry, status_lines
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

READY, UNAVAILABLE = "READY", "UNAVAILABLE"
"""The states of the repository index (Triton's names); ``index_rows`` says when each holds."""
NEW_FOLDER_WAIT_S = 3.0
"""How long a change naming a model no live worker knows looks for it: workers rescan their
repositories with every heartbeat (2 s by default), so a folder copied just before the call is
found."""
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
        """Every model the workers serve or their repositories hold, one row per served version
        (Triton's shape: name, version, state, reason; see ``index_rows`` for the states)."""
        await self.registry.refresh()
        served, held = self.registry.models, self.registry.repository
        names = sorted(set(served) | set(held))
        statuses = await self.statuses(names)
        rows: list[dict[str, Any]] = []
        for name in names:
            rows += index_rows(name, served.get(name), held.get(name), statuses.get(name, []))
        return [r for r in rows if r["state"] == READY] if ready_only else rows

    async def statuses(self, names: list[str]) -> dict[str, list[LoadReport]]:
        """Each model's status lines, from the live workers that serve it or may load it."""
        workers = self.registry.live_worker_infos()
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(self.keys.model_status(name))
        replies = await pipe.execute()
        return {
            name: status_lines(raw, name, workers) for name, raw in zip(names, replies, strict=True)
        }

    # -- load / unload / reset ---------------------------------------------------------------

    async def load(self, model: str, params: Any) -> dict[str, Any]:
        """Serve the versions ``params`` name (or those the repository config names) on every
        live worker that serves the model, or, when none does, whose repository holds it: a
        model folder added after the workers started is loaded this way."""
        request = parse_load(params)
        entry, workers = await self._targets(model)
        return await self._change(model, entry, workers, request.versions, request.weights)

    async def reset(self, model: str) -> dict[str, Any]:
        """Return the model to its repository config's policy: the workers load what the
        config names (two-phase, as a load), and the committed admin policy is deleted, so
        workers that start later follow the config too."""
        entry, workers = await self._targets(model)
        return await self._change(model, entry, workers, (), {}, admin=False)

    async def _change(
        self,
        model: str,
        entry: ModelEntry | None,
        workers: list[str],
        versions: tuple[str, ...],
        weights: dict[str, float],
        *,
        admin: bool = True,
    ) -> dict[str, Any]:
        """The two-phase change: prepare everywhere, then commit (``admin``: as the model's
        policy; else back to its config) or abort with every worker's reason."""
        async with self._locked(model):
            generation = int(await self.redis.incr(self.keys.policy_generation))
            wanted = VersionPolicy(versions, weights, generation)
            reports, left = await self._prepare(model, wanted, workers)
            failed = [r for r in reports.values() if not r.ok]
            missing = sorted(set(workers) - set(reports) - left)
            if failed or missing or not reports:
                await self._send(Command(Op.ABORT, model, wanted))
                problems = [f"worker {r.worker}: {r.error}" for r in failed]
                problems += [
                    f"worker {w}: did not answer within {self.settings.admin_load_timeout_s:g} s"
                    for w in missing
                ]
                problems = problems or ["every worker that could load it has gone"]
                log.error("model load failed", model=model, errors=problems)
                served = entry.metadata.versions if entry is not None else ()
                raise BadRequest(
                    f"failed to load model '{model}' ({_describe(wanted)}): "
                    f"{'; '.join(problems)}. Nothing changed: it still serves "
                    f"{', '.join(served) or 'nothing'}"
                )
            try:
                policy = self._final(wanted, reports)
            except Conflict:
                await self._send(Command(Op.ABORT, model, wanted))
                raise
            await self._commit(model, policy, admin=admin)
            if not admin:
                await self._until_served(model, policy.versions)
            elif entry is None or not entry.workers:
                await self._until_served(model)
        log.info(
            "model loaded" if admin else "model reset to its repository config",
            model=model,
            versions=policy.versions,
            weights=policy.weights,
        )
        return self._answer(model, policy, reports, admin=admin)

    async def unload(self, model: str, params: Any) -> dict[str, Any]:
        """Unload the model (every version), or with ``{"version": v}`` drop one version from
        its policy. Requests already routed finish; the versions are unloaded after the
        workers' retirement grace."""
        if params is None:
            params = {}
        if not isinstance(params, dict) or set(params) - {"version", "unload_dependents"}:
            raise BadRequest("unload takes no parameters other than 'version'")
        entry, _ = await self._targets(model, need_workers=False)
        served = entry.metadata.versions if entry is not None else ()
        async with self._locked(model):
            generation = int(await self.redis.incr(self.keys.policy_generation))
            versions: tuple[str, ...] = ()
            weights: dict[str, float] = {}
            if "version" in params:
                version = str(params["version"])
                if version not in served:
                    raise NotFound(
                        f"model '{model}' does not serve version '{version}' (versions: "
                        f"{', '.join(served) or 'none'})"
                    )
                assert entry is not None
                versions = tuple(v for v in served if v != version)
                weights = {v: w for v, w in entry.traffic.items() if v != version}
                if not any(weights.values()):
                    weights = {}
            policy = VersionPolicy(versions, weights, generation)
            await self._commit(model, policy)
        log.info("model unloaded", model=model, versions_left=versions)
        return self._answer(model, policy, {})

    # -- steps -----------------------------------------------------------------------------

    async def _targets(
        self, model: str, *, need_workers: bool = True
    ) -> tuple[ModelEntry | None, list[str]]:
        """The model's entry (None for one never served) and the live workers a change of it
        goes to (``_candidates``). A name no worker
        knows is looked for again until the workers' next heartbeats (they rescan their
        repositories with each), so a folder copied just now is found."""
        if not is_valid_name(model):
            raise BadRequest(
                f"invalid model name {model!r}: model names are folder names inside the model "
                "repository (letters, digits, '_', '-', '.'; no paths)"
            )
        await self.registry.refresh()
        deadline = time.monotonic() + NEW_FOLDER_WAIT_S
        while (
            model not in self.registry.models
            and model not in self.registry.repository
            and self.registry.live_worker_infos()
            and time.monotonic() < deadline
        ):
            await asyncio.sleep(_POLL_S * 10)
            await self.registry.refresh()
        entry = self.registry.models.get(model)
        if entry is None and model not in self.registry.repository:
            known = ", ".join(sorted({*self.registry.models, *self.registry.repository}))
            raise NotFound(
                f"unknown model '{model}': no live worker serves it or holds it in its model "
                f"repository (models known: {known or 'none'})"
            )
        workers = sorted(self._candidates(model))
        if need_workers and not workers:
            raise ServiceUnavailable(
                f"no live worker serves model '{model}' or holds it in its repository to load "
                f"it; start one with `inferq worker --models {model}`",
                retry_after_s=5,
            )
        return entry, workers

    async def _until_served(self, model: str, versions: tuple[str, ...] | None = None) -> None:
        """Until the workers advertise what was just committed (they do as soon as they apply
        the commit): a model no live worker served before (so a request sent right after the
        load is routed, as after a Triton load), or, after a reset, exactly ``versions`` (with
        no policy stored, the gateways route by the advertisements)."""
        deadline = time.monotonic() + self.settings.admin_load_timeout_s
        while time.monotonic() < deadline:
            await self.registry.refresh()
            entry = self.registry.models.get(model)
            # On-demand workers load it when a request comes: that is served too.
            if entry is not None and entry.state in ("ready", "loadable"):
                if versions is None or entry.metadata.versions == versions:
                    return
            await asyncio.sleep(_POLL_S)

    def _locked(self, model: str) -> _ModelLock:
        ttl_s = self.settings.admin_load_timeout_s + 30
        return _ModelLock(self.redis, self.keys.model_lock(model), model, ttl_s)

    async def _commit(self, model: str, policy: VersionPolicy, *, admin: bool = True) -> None:
        """Store the policy (``admin``; else delete it: the config decides again) and tell every
        worker, atomically; route by it here at once."""
        pipe = self.redis.pipeline(transaction=True)
        if admin:
            pipe.hset(self.keys.policies, model, policy.encode())
        else:
            pipe.hdel(self.keys.policies, model)
        pipe.xadd(
            self.keys.control,
            {COMMAND_FIELD: Command(Op.COMMIT, model, policy).encode()},
            maxlen=CONTROL_MAXLEN,
            approximate=True,
        )
        await pipe.execute()
        await self.registry.apply_policy(model, policy if admin else None)

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
                expected = self._candidates(model) | (expected & set(reports))
                next_look = time.monotonic() + 1.0
                if not expected - set(reports):
                    break
            await asyncio.sleep(_POLL_S)
        await self.redis.delete(reply_to)
        # A worker that holds the model without serving it may answer too (it cannot know that
        # others serve it): only the workers the change is for count.
        reports = {w: r for w, r in reports.items() if w in expected}
        return reports, set(workers) - expected - set(reports)

    def _candidates(self, model: str) -> set[str]:
        """The live workers a change of the model goes to, as of the last registry refresh:
        those that serve it; when none does, those whose repository holds it. (A worker that
        holds a served model without serving it, one whose load failed at start, is not asked:
        its failure must not block a change of what serves. It loads the model at the commit.)"""
        workers = self.registry.live_worker_infos()
        serving = {w.id for w in workers if any(m.name == model for m in w.models)}
        return serving or {w.id for w in workers if w.holds(model)}

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
        self,
        model: str,
        policy: VersionPolicy,
        reports: dict[str, LoadReport],
        *,
        admin: bool = True,
    ) -> dict[str, Any]:
        return {
            "name": model,
            "versions": list(policy.versions),
            "traffic": {v: w for v, w in policy.traffic().items()},
            "generation": policy.generation,
            "policy": "admin" if admin else "repository config",
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


def index_rows(
    name: str,
    entry: ModelEntry | None,
    held: RepositoryEntry | None,
    lines: list[LoadReport],
) -> list[dict[str, Any]]:
    """A model's rows of the repository index. The states, for a person reading them:

    - ``READY``, one row per served version (with its share of ``traffic``): a live worker
      serves it. ``reason`` names the last failed change, or a fallback: the committed policy
      names a version the workers could not serve, so they serve the repository config's.
    - ``UNAVAILABLE``, reason ``unloaded``: an administrator unloaded every version; a load
      brings it back.
    - ``UNAVAILABLE`` without a version: a worker's repository holds it, unloaded (a folder
      added after the workers started, or one whose config failed at start: the reason says
      which); a load serves it.
    - ``UNAVAILABLE`` per version, ``no live worker serves it``: known from earlier, but no live
      worker serves it or holds it.
    """
    failures = "; ".join(f"worker {r.worker}: {r.error}" for r in lines if not r.ok)
    if entry is not None and entry.ready:
        reason = failures
        if entry.fallback:
            why = "; ".join(f"worker {r.worker}: {r.fallback}" for r in lines if r.fallback)
            generation = entry.policy.generation if entry.policy else 0
            reason = "; ".join(
                x
                for x in (
                    f"serving the repository config: the committed policy (generation "
                    f"{generation}) cannot be served ({why or 'a version it names is missing'})",
                    failures,
                )
                if x
            )
        return [
            {
                "name": name,
                "version": version,
                "state": READY,
                "reason": reason,
                "traffic": entry.traffic.get(version, 0.0),
            }
            for version in entry.metadata.versions
        ]
    if entry is not None and entry.unloaded and (entry.workers or held is not None):
        return [{"name": name, "state": UNAVAILABLE, "reason": "unloaded"}]
    if held is not None:
        errors = "; ".join(f"worker {w}: {e}" for w, e in sorted(held.errors.items()))
        reason = errors or failures or "not loaded"
        return [{"name": name, "state": UNAVAILABLE, "reason": reason}]
    assert entry is not None
    gone = failures or "no live worker serves it"
    rows = [
        {"name": name, "version": v, "state": UNAVAILABLE, "reason": gone}
        for v in entry.metadata.versions
    ]
    return rows or [{"name": name, "state": UNAVAILABLE, "reason": gone}]


def _describe(policy: VersionPolicy) -> str:
    if not policy.versions:
        return "versions as its repository config says"
    if policy.weights:
        return "weights " + ", ".join(f"{v}: {w:g}" for v, w in policy.weights.items())
    return f"version {', '.join(policy.versions)}"
