"""A worker's side of the model control plane (see ``protocol.control``).

Owned by the worker: ``start`` records where the control stream ends before the worker reads
the committed policies (so no command between the two is missed), ``run`` follows the stream on
its own blocking connection (``runtime.readconn``), and ``stop`` cancels it and any pending
retirements.

Loading happens on a thread while the model keeps serving its current versions; a version
loaded for a PREPARE waits on standby (it can already answer a request routed to it, which
closes the window between a gateway's commit and this worker seeing it) until COMMIT installs
it or ABORT unloads it. Versions a commit drops keep answering for ``retire_after_s`` so that
requests routed to them before the switch finish on them, then they are unloaded.

A model this worker does not serve yet, but may load (``ModelHost.may_load``: a folder of its
repository, added after the start too, or one its ``--models`` names), is loaded whole for a
PREPARE and held aside; COMMIT hands it to the worker (``ModelHost.add_model``), which serves it
from then on; ABORT unloads it. That is how a load call brings in a new model without a restart.

A committed policy this worker could not serve at start (``fell_back``: a version it names has
no folder, or does not load) is recorded: the model is served as the repository config says,
the status line and the advertisement say so, and the next commit for the model clears it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Protocol

import redis.asyncio as aioredis
import structlog

from consumer.backends import Backend, BackendError
from consumer.context import WorkerContext
from consumer.model import ServedModel
from consumer.repository import ModelConfig, RepositoryError, load_config
from protocol import ProtocolError
from protocol.control import COMMAND_FIELD, Command, LoadReport, Op, VersionPolicy
from protocol.envelope import decode_hash
from runtime.aio import cancelling
from runtime.faults import RETRYABLE
from runtime.readconn import BlockingReads, recover

log = structlog.get_logger("inferq.worker")


class ModelHost(Protocol):
    """What model control needs of its worker (``consumer.worker.Worker``)."""

    def may_load(self, name: str) -> bool:
        """Whether a load of this model, not served here yet, is this worker's to do."""

    async def load_model(self, config: ModelConfig) -> ServedModel:
        """The model with every version of ``config`` loaded and warmed, not served yet."""

    async def add_model(self, model: ServedModel) -> None:
        """Serve a model loaded while running (streams, dispatcher, advertisement)."""

    async def republish(self) -> None:
        """Advertise what the models serve now."""

    @property
    def loads_on_demand(self) -> bool:
        """Models not served here load when requests wait (``consumer.ondemand``), not for a
        PREPARE: a change to one is checked against the repository and left to that load."""

    async def unload_model(self, name: str, reason: str) -> None:
        """Stop serving the model and unload it (an on-demand worker's unload)."""


RECENT_COMMANDS = 200
"""How far back a starting worker looks for a change in progress (commands are few)."""
REPLY_TTL_S = 600
"""How long a load command's answers stay readable (the admin call reads them sooner)."""


class ModelControl:
    def __init__(
        self,
        context: WorkerContext,
        *,
        redis: aioredis.Redis,
        reader: BlockingReads,
        host: ModelHost,
    ) -> None:
        s = context.settings
        self.worker_id = context.worker_id
        self._redis = redis
        self._reader = reader
        self._keys = context.keys
        self._repository = s.model_repository
        self._models = context.slots
        self._backoff = context.loops.backoff("control", critical=False)
        self._now_ms = context.clock.now_ms
        self._host = host
        self._metrics = context.metrics
        self._block_ms = s.block_ms
        self._retire_after_s = s.retire_after_s
        self._last_id = "0-0"
        self._prepared: dict[str, tuple[int, ModelConfig]] = {}
        self._generation: dict[str, int] = {}
        self._retirements: set[asyncio.Task[None]] = set()
        self._in_flight: dict[str, Command] = {}
        self._incoming: dict[str, tuple[int, ServedModel]] = {}
        """Models not served here, loaded for a PREPARE of that generation: served at COMMIT."""
        self.fallbacks: dict[str, tuple[int, str]] = {}
        """Model -> (generation, why) of a committed policy this worker could not serve at
        start: it serves the repository config's versions instead."""
        self.withdrawn: set[str] = set()
        """Models whose committed policy, as last seen here, unloads them: an on-demand worker
        does not load them for requests that wait (its next load call makes them loadable)."""

    async def committed_policies(self) -> dict[str, VersionPolicy]:
        """Mark the end of the control stream, then read the committed policies: every change
        committed after this read arrives as a command. Changes being prepared right now (a
        model whose newest command is a PREPARE) are remembered for ``catch_up``."""
        recent: Any = await self._redis.xrevrange(self._keys.control, count=RECENT_COMMANDS)
        self._last_id = recent[0][0].decode() if recent else "0-0"
        raw: Any = await self._redis.hgetall(self._keys.policies)
        policies = decode_hash(raw, VersionPolicy.decode, _ignored_policy)
        for name, policy in policies.items():
            self._generation[name] = policy.generation
            self._withdraw(name, policy)
        newest: dict[str, Command] = {}
        for _, fields in recent:  # newest first
            with contextlib.suppress(ProtocolError):
                command = Command.decode(fields.get(COMMAND_FIELD, b""))
                newest.setdefault(command.model, command)
        self._in_flight = {
            model: c
            for model, c in newest.items()
            if c.op is Op.PREPARE and c.policy.generation > self._generation.get(model, 0)
        }
        return policies

    async def catch_up(self) -> None:
        """Before this worker reads a single request (and after it advertises itself, so a
        gateway preparing a change counts it from now on): take part in the change that was
        being prepared when it started, and apply every command sent while it loaded. Otherwise
        a worker starting mid-change could be handed requests for a version it lacks."""
        for command in self._in_flight.values():
            await self._handle(command)
        self._in_flight = {}
        while True:
            reply = await self._reader.xread({self._keys.control: self._last_id}, count=16)
            entries = [e for _, stream_entries in reply or [] for e in stream_entries]
            for entry_id, fields in entries:
                self._last_id = entry_id.decode()
                await self._handle_entry(fields)
            if len(entries) < 16:
                return

    async def report_started(self) -> None:
        """The model-status line of every model at start, so ``inferq models status`` shows it."""
        for model in self._models.models():
            await self._report(self._line(model, self._generation.get(model.name, 0)), "")

    async def run(self) -> None:
        while not cancelling():
            try:
                reply = await self._reader.xread(
                    {self._keys.control: self._last_id}, count=16, block_ms=self._block_ms
                )
            except RETRYABLE as e:
                await recover(self._reader, e, self._backoff)
                continue
            self._backoff.succeeded()
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    self._last_id = entry_id.decode()
                    await self._handle_entry(fields)

    async def stop(self) -> None:
        for task in self._retirements:
            task.cancel()
        await asyncio.gather(*self._retirements, return_exceptions=True)
        for _, model in self._incoming.values():
            await asyncio.to_thread(model.unload)
        self._incoming = {}

    def fell_back(self, name: str, policy: VersionPolicy, why: str) -> None:
        """At start, the committed ``policy`` could not be served (``why``): the worker serves
        the repository config's versions instead. Counted, logged, and said in the model's
        status line and this worker's advertisement until a commit for the model."""
        self.fallbacks[name] = (policy.generation, why)
        self._metrics.observe_policy_fallback(name)
        log.warning(
            "the committed policy cannot be served; serving the repository config instead "
            "(`inferq models reset` or a new load clears the policy)",
            model=name,
            policy_versions=list(policy.versions),
            generation=policy.generation,
            error=why,
        )

    def fallback_generations(self) -> dict[str, int]:
        return {name: generation for name, (generation, _) in self.fallbacks.items()}

    async def _handle_entry(self, fields: dict[bytes, bytes]) -> None:
        try:
            command = Command.decode(fields.get(COMMAND_FIELD, b""))
        except ProtocolError as e:
            log.warning("ignoring a control command", error=str(e))
            return
        await self._handle(command)

    async def _handle(self, command: Command) -> None:
        model = self._models.model(command.model)
        try:
            if model is None:
                if not self._host.may_load(command.model):
                    return
                if self._host.loads_on_demand:
                    await self._defer(command)
                else:
                    await self._handle_new(command)
            elif command.op is Op.COMMIT and self._unloads_here(command.policy):
                await self._unload_on_demand(model, command.policy)
            elif command.op is Op.PREPARE:
                await self._prepare(model, command)
            elif command.op is Op.COMMIT:
                await self._commit(model, command.policy)
            else:
                await self._abort(model, command.policy)
        except RETRYABLE as e:
            log.warning("control command not fully applied", op=command.op, error=str(e))

    # -- on demand ----------------------------------------------------------------------------

    async def committed_policy(self, name: str) -> VersionPolicy | None:
        """The model's committed policy now (None: its repository config decides)."""
        raw: Any = await self._redis.hget(self._keys.policies, name)
        if raw is None:
            return None
        try:
            return VersionPolicy.decode(raw)
        except ProtocolError as e:
            _ignored_policy(name, e)
            return None

    async def serving(self, model: ServedModel, generation: int) -> None:
        """A model loaded on demand, as of the policy of ``generation``. A change committed
        while it loaded is applied now (its COMMIT found the model not served yet)."""
        self._generation[model.name] = max(generation, self._generation.get(model.name, 0))
        self.withdrawn.discard(model.name)
        newer = await self.committed_policy(model.name)
        if newer is not None and newer.generation > generation:
            self._generation[model.name] = generation
            if newer.loaded:
                await self._commit(model, newer)
                return
            await self._unload_on_demand(model, newer)
            return
        await self._report(self._line(model, generation), "")

    def _withdraw(self, name: str, policy: VersionPolicy) -> None:
        """Record whether the committed ``policy`` unloads the model (``withdrawn``)."""
        if policy.loaded:
            self.withdrawn.discard(name)
        else:
            self.withdrawn.add(name)

    def _unloads_here(self, policy: VersionPolicy) -> bool:
        """An unload of a model this worker holds that it gives up (on demand) rather than
        keeping it loaded with nothing routed to it."""
        return self._host.loads_on_demand and not policy.loaded

    async def _defer(self, command: Command) -> None:
        """A change to a model this on-demand worker does not hold: a PREPARE is answered
        from the repository (the versions it names have folders and the config loads) without
        loading; the load that requests bring applies the committed policy."""
        name, policy = command.model, command.policy
        if command.op is Op.COMMIT:
            if policy.generation > self._generation.get(name, -1):
                self._withdraw(name, policy)
            self._generation[name] = max(policy.generation, self._generation.get(name, 0))
            return
        if command.op is not Op.PREPARE:
            return
        started = time.perf_counter()
        try:
            config = await asyncio.to_thread(
                load_config, self._repository, name, policy if policy.versions else None
            )
        except RepositoryError as e:
            await self._report_new_failure(name, policy, e, started, command.reply_to)
            return
        report = LoadReport(
            self.worker_id,
            name,
            policy.generation,
            True,
            config.versions,
            load_ms=0.0,
            updated_ms=self._now_ms(),
            weights=config.weights,
        )
        await self._report(report, command.reply_to)

    async def _unload_on_demand(self, model: ServedModel, policy: VersionPolicy) -> None:
        """An administrator's unload of a model this on-demand worker holds: it stops serving
        it (reason ``control``) rather than holding a model nothing may be routed to."""
        if policy.generation <= self._generation.get(model.name, -1):
            return
        self._generation[model.name] = policy.generation
        self._withdraw(model.name, policy)
        self._prepared.pop(model.name, None)
        await self._host.unload_model(model.name, "control")
        report = LoadReport(
            self.worker_id, model.name, policy.generation, True, (), updated_ms=self._now_ms()
        )
        await self._report(report, "")

    # -- a model not served here yet ---------------------------------------------------------

    async def _handle_new(self, command: Command) -> None:
        name, policy = command.model, command.policy
        if command.op is Op.ABORT:
            incoming = self._incoming.get(name)
            if incoming is not None and incoming[0] == policy.generation:
                del self._incoming[name]
                await asyncio.to_thread(incoming[1].unload)
            return
        if command.op is Op.COMMIT:
            await self._commit_new(name, policy)
            return
        started = time.perf_counter()
        try:
            model = await self._load_new(name, policy)
        except Exception as e:  # any load failure is reported, as for a served model
            await self._report_new_failure(name, policy, e, started, command.reply_to)
            return
        old = self._incoming.pop(name, None)
        if old is not None:
            await asyncio.to_thread(old[1].unload)
        self._incoming[name] = (policy.generation, model)
        elapsed_ms = (time.perf_counter() - started) * 1000
        log.info(
            "new model loaded, waiting for commit",
            model=name,
            versions=list(model.config.versions),
            load_ms=round(elapsed_ms, 1),
        )
        report = self._line(
            model,
            policy.generation,
            load_ms=elapsed_ms,
            versions=model.config.versions,
            weights=model.config.weights,
        )
        await self._report(report, command.reply_to)

    async def _load_new(self, name: str, policy: VersionPolicy) -> ServedModel:
        config = load_config(self._repository, name, policy if policy.versions else None)
        return await self._host.load_model(config)

    async def _commit_new(self, name: str, policy: VersionPolicy) -> None:
        if policy.generation <= self._generation.get(name, -1):
            return
        incoming = self._incoming.pop(name, None)
        if incoming is not None and incoming[0] != policy.generation:
            await asyncio.to_thread(incoming[1].unload)
            incoming = None
        if incoming is None:
            if not policy.versions:
                return  # unloaded: nothing to start serving
            try:  # a commit this worker did not prepare (it started meanwhile): load now
                model = await self._load_new(name, policy)
            except Exception as e:
                log.error("cannot serve the committed policy", model=name, error=str(e))
                await self._report_new_failure(name, policy, e, time.perf_counter(), "")
                return
        else:
            model = incoming[1]
        self._generation[name] = policy.generation
        await self._host.add_model(model)
        await self._report(self._line(model, policy.generation), "")
        log.info(
            "model loaded and serving",
            model=name,
            versions=list(model.backends),
            generation=policy.generation,
        )

    async def _report_new_failure(
        self, name: str, policy: VersionPolicy, error: Exception, started: float, reply_to: str
    ) -> None:
        known = isinstance(error, RepositoryError | BackendError)
        message = str(error) if known else f"{type(error).__name__}: {error}"
        log.error("model load failed", model=name, versions=policy.versions, error=message)
        report = LoadReport(
            self.worker_id,
            name,
            policy.generation,
            False,
            (),
            error=message,
            load_ms=(time.perf_counter() - started) * 1000,
            updated_ms=self._now_ms(),
        )
        await self._report(report, reply_to)

    # -- a served model ------------------------------------------------------------------------

    async def _prepare(self, model: ServedModel, command: Command) -> None:
        policy = command.policy
        started = time.perf_counter()
        try:
            # No versions: as the repository config says (it may name a new version now).
            config = load_config(self._repository, model.name, policy if policy.versions else None)
            # Standby versions of an earlier change that never finished (its gateway died) and
            # that this one does not want: unload them now rather than hold them forever.
            for stale in model.discard_standby(keep=set(config.versions)):
                await asyncio.to_thread(stale.unload)
            loaded = await self._load_missing(model, config)
        except Exception as e:  # a model file can fail to load in any way; report, keep serving
            known = isinstance(e, RepositoryError | BackendError)  # their messages say where
            error = str(e) if known else f"{type(e).__name__}: {e}"
            log.error(
                "model load failed; still serving the current versions",
                model=model.name,
                versions=policy.versions,
                error=error,
            )
            elapsed_ms = (time.perf_counter() - started) * 1000
            report = self._line(model, policy.generation, error=error, load_ms=elapsed_ms)
            await self._report(report, command.reply_to)
            return
        self._prepared[model.name] = (policy.generation, config)
        elapsed_ms = (time.perf_counter() - started) * 1000
        log.info(
            "model versions loaded, waiting for commit",
            model=model.name,
            loaded=sorted(loaded),
            load_ms=round(elapsed_ms, 1),
        )
        report = self._line(
            model,
            policy.generation,
            load_ms=elapsed_ms,
            versions=config.versions,
            weights=config.weights,
        )
        await self._report(report, command.reply_to)

    async def _load_missing(self, model: ServedModel, config: ModelConfig) -> list[str]:
        """Load and stage the config's versions this worker holds nowhere yet (a retiring
        version brought back by a quick rollback is reused, not loaded again). On failure the
        versions loaded for it are unloaded and the error raised."""
        loaded: dict[str, Backend] = {}
        try:
            for version in config.versions:
                if model.backend_for(version) is None:
                    loaded[version] = await asyncio.to_thread(model.load_version, config, version)
        except BaseException:
            for backend in loaded.values():
                await asyncio.to_thread(backend.unload)
            raise
        for version, backend in loaded.items():
            model.stage(version, backend)
        return list(loaded)

    async def _commit(self, model: ServedModel, policy: VersionPolicy) -> None:
        if policy.generation <= self._generation.get(model.name, -1):
            return
        generation, config = self._prepared.pop(model.name, (None, None))
        if generation != policy.generation or config is None:
            # This worker did not prepare this change (its prepare failed, or the commit came
            # without one it saw): load what is missing now.
            try:
                config = load_config(self._repository, model.name, policy)
                await self._load_missing(model, config)
            except Exception as e:
                log.error("cannot serve the committed policy", model=model.name, error=str(e))
                await self._report(self._line(model, policy.generation, error=str(e)), "")
                return
        self._models[model.name].install(config)
        self._generation[model.name] = policy.generation
        self.fallbacks.pop(model.name, None)
        await self._host.republish()
        await self._report(self._line(model, policy.generation), "")
        log.info(
            "model policy committed",
            model=model.name,
            versions=list(model.backends),
            retiring=sorted(model.retiring),
            generation=policy.generation,
        )
        if model.retiring:
            task = asyncio.create_task(self._retire(model, set(model.retiring)))
            self._retirements.add(task)
            task.add_done_callback(self._retirements.discard)

    async def _abort(self, model: ServedModel, policy: VersionPolicy) -> None:
        prepared = self._prepared.get(model.name)
        if prepared is not None and prepared[0] == policy.generation:
            del self._prepared[model.name]
        dropped = model.discard_standby()
        for backend in dropped:
            await asyncio.to_thread(backend.unload)
        if dropped:
            log.info("model change aborted; standby versions unloaded", model=model.name)

    async def _retire(self, model: ServedModel, versions: set[str]) -> None:
        """Unload dropped versions once requests routed to them before the switch are done:
        after the grace period and when none is still queued here."""
        await asyncio.sleep(self._retire_after_s)
        # A rare, one-off wait: polling the dispatcher's queue beats a new event it must set.
        while self._models[model.name].queued_versions() & versions:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        for backend in model.take_retiring(versions):
            await asyncio.to_thread(backend.unload)
        log.info("retired model versions unloaded", model=model.name, versions=sorted(versions))

    def _line(
        self,
        model: ServedModel,
        generation: int,
        *,
        error: str = "",
        load_ms: float = 0.0,
        versions: tuple[str, ...] | None = None,
        weights: dict[str, float] | None = None,
    ) -> LoadReport:
        """This worker's status line for the model: what it serves now (or, answering a
        prepare, the versions it has ready), and the error of the change it could not make."""
        return LoadReport(
            self.worker_id,
            model.name,
            generation,
            not error,
            tuple(model.backends) if versions is None else versions,
            error=error,
            load_ms=load_ms,
            updated_ms=self._now_ms(),
            weights=weights or {},
            fallback=self.fallbacks.get(model.name, (0, ""))[1],
        )

    async def _report(self, report: LoadReport, reply_to: str) -> None:
        payload = report.encode()
        pipe = self._redis.pipeline(transaction=False)
        if reply_to:
            pipe.rpush(reply_to, payload)
            pipe.expire(reply_to, REPLY_TTL_S)
        pipe.hset(self._keys.model_status(report.model), self.worker_id, payload)
        await pipe.execute()


def _ignored_policy(model: str, error: ProtocolError) -> None:
    log.warning("ignoring a version policy", model=model, error=str(error))
