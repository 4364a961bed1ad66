"""The worker process: reads its models' request streams in a consumer group, forms batches,
runs the models, stores the results, and only then acknowledges.

``Worker`` owns every part (started in ``start``, stopped in ``stop``); the parts share one
``WorkerContext``. How they fit together: ARCHITECTURE.md, "The worker". Every loop survives
Redis errors with backoff; one that ends any other way is a bug, so the worker stops and ``run``
raises ``LoopCrashed`` for the process to exit non-zero and its supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import replace
from typing import Any, cast

import redis.asyncio as aioredis
import structlog

from consumer.advertiser import Advertiser
from consumer.backends import BackendError
from consumer.context import WorkerContext
from consumer.control import ModelControl
from consumer.dispatcher import Dispatcher
from consumer.leases import JobLeases, lease_ms
from consumer.ledger import Ledger
from consumer.metrics import WorkerMetrics
from consumer.model import ServedModel
from consumer.ondemand import Loaded, OnDemand, resident_bytes
from consumer.outgoing import Outcomes
from consumer.reader import Reader, ReadGroup
from consumer.reclaimer import Reclaimer
from consumer.repository import (
    CONFIG_FILE,
    ModelConfig,
    RepositoryError,
    RepositoryScan,
    list_models,
    load_config,
)
from consumer.settings import WorkerSettings
from consumer.slots import ModelSlot, ModelSlots
from consumer.stats import WorkerStats
from consumer.writer import ResultWriter
from protocol.control import VersionPolicy
from protocol.jobs import CLAIM_SCRIPT, RENEW_SCRIPT, TRANSITION_SCRIPT
from protocol.keys import GROUP, Keys, hash_tag, is_valid_name
from protocol.registry import RepositoryModel, WorkerInfo
from runtime import tracing
from runtime.broker import Broker, Script, connect
from runtime.connections import RedisClock, redact
from runtime.eviction import EvictionCheck
from runtime.faults import RETRYABLE
from runtime.loops import LoopCrashed, Loops
from runtime.metrics import MetricsServer
from runtime.readconn import BlockingReads
from runtime.wedge import NAME as WEDGE_WATCH
from runtime.wedge import WedgeWatch

log = structlog.get_logger("inferq.worker")

# Re-exported: tests and the CLI import these from here.
__all__ = ["LoopCrashed", "MetricsPortError", "ModelSlot", "Worker", "WorkerStats"]


class MetricsPortError(RuntimeError):
    """The worker's metrics port cannot be bound."""


class Worker:
    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.id = settings.worker_id
        self.keys = Keys(settings.namespace)
        self.stats = WorkerStats()
        self.metrics = WorkerMetrics()
        self.tracer = tracing.current()
        self.clock = RedisClock()
        self.slots = ModelSlots()
        self.ledger = Ledger()
        self.started = asyncio.Event()
        self.failure: str | None = None
        """Why the worker stopped on its own (a loop crashed); None otherwise."""
        self._stopping = asyncio.Event()
        self.loops = Loops(log, on_fatal=self._fatal)
        self.eviction = EvictionCheck(log, self.metrics.runtime.set_policy)
        self.skipped: dict[str, str] = {}
        """Models of the repository not served, and why (serving the whole repository)."""
        self.repository = RepositoryScan(
            settings.model_repository,
            settings.models,
            max_batch=settings.max_batch,
            flush_ms=settings.flush_ms,
        )
        """What this worker may be asked to load, advertised with every heartbeat."""
        self._reader_loops = ["reader"]
        self._serving = False
        """The loops run (until then, ``_start_loops`` starts a model added meanwhile)."""
        self._metrics_server: MetricsServer | None = None
        self._started_ms = 0
        self.broker: Broker | None = None
        self._redis: aioredis.Redis | None = None
        self._control_reader: BlockingReads | None = None
        self._demand_reader: BlockingReads | None = None
        self._unloading: set[str] = set()
        self.context: WorkerContext | None = None
        """What every part shares (built at start, once Redis is connected)."""
        self.control: ModelControl | None = None
        self._writer: ResultWriter | None = None
        self._reader: Reader | None = None
        self._advertiser: Advertiser | None = None
        self.reclaimer: Reclaimer | None = None
        self.on_demand: OnDemand | None = None
        """Loads models when requests for them wait (``--load on-demand``); None otherwise."""
        self._listing: tuple[RepositoryModel, ...] = ()
        """The repository as last scanned (each heartbeat): what may be loaded on demand."""

    @property
    def holding(self) -> int:
        """Entries read from Redis and not yet acknowledged (queued, running or being written)."""
        return len(self.ledger)

    @property
    def groups(self) -> list[ReadGroup]:
        """The reader's groups: what each blocking read covers, and where it reads."""
        return [] if self._reader is None else self._reader.groups

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    # -- lifecycle -------------------------------------------------------------------------

    async def run(self) -> None:
        """Start, serve until ``request_stop`` (or a signal handled by the caller), stop.
        Raises ``LoopCrashed`` when it stopped because a loop crashed."""
        await self.start()
        try:
            await self._stopping.wait()
        finally:
            await self.stop()
        if self.failure is not None:
            raise LoopCrashed(self.failure)

    def request_stop(self) -> None:
        self._stopping.set()

    async def start(self) -> None:
        configs = self._read_configs()
        redis = await self._connect()
        if not await self._until_redis_answers(redis):
            return  # asked to stop while waiting: nothing was started
        await self.clock.sync(redis)
        await self.eviction.refresh(redis)
        self.context = self._build_context(redis)
        self.control = self._model_control(redis)
        # Before loading: a model an administrator changed is served as committed, not as the
        # repository config says.
        await self._load_models(configs, await self.control.committed_policies())
        self._serve_metrics()
        self._build_parts(redis)
        assert self._reader is not None and self._advertiser is not None
        await self._reader.ensure_groups()
        self._started_ms = self.clock.now_ms()
        # Advertise, then catch up on model changes, then read: a change being prepared counts
        # this worker from its advertisement on, and this worker has that change's versions
        # before it reads a request that might be routed to them.
        await self._advertiser.publish()
        await self.control.report_started()
        await self.control.catch_up()
        self._start_loops()
        log.info(
            "worker started",
            worker=self.id,
            models=list(self.slots),
            redis=redact(self.settings.redis.url),
            topology=self.broker.kind if self.broker is not None else None,
            max_batch={n: sl.model.max_batch for n, sl in self.slots.items()},
        )
        self.started.set()

    def _read_configs(self) -> dict[str, ModelConfig]:
        """Check every config before touching Redis: a typo is reported as such, at once. On
        demand, none is loaded at start (each is checked when it loads)."""
        s = self.settings
        if s.on_demand:
            return {}
        names = list(s.models) or list_models(s.model_repository)
        if not names:
            raise RuntimeError(f"no models to serve in {s.model_repository}")
        configs: dict[str, ModelConfig] = {}
        for n in names:
            try:
                configs[n] = load_config(s.model_repository, n)
            except RepositoryError as e:
                self._skip(n, e)
        return configs

    async def _connect(self) -> aioredis.Redis:
        s = self.settings
        self.broker = await connect(s.redis, name=f"inferq-worker-{self.id}")
        self._redis = self.broker.commands
        self._control_reader = self.broker.blocking_reads(
            self.keys.control, name=f"inferq-worker-control-{self.id}", block_ms=s.block_ms
        )
        return self._redis

    async def _until_redis_answers(self, redis: aioredis.Redis) -> bool:
        """Wait for Redis, retrying with backoff (and a log line), as the gateway does: under
        Compose or Kubernetes a worker often starts before Redis answers, or while it still
        refuses (protected mode, loading). Until then the worker has not advertised itself, so
        no gateway counts it. False when asked to stop meanwhile."""
        backoff = self.loops.backoff("start")
        while not self._stopping.is_set():
            try:
                await redis.ping()
            except RETRYABLE as e:
                await backoff.failed(e)
            else:
                backoff.succeeded()
                return True
        return False

    def _read_groups(self, streams: list[str] | None = None, prefix: str = "") -> list[ReadGroup]:
        """The reader's groups (see ``ReadGroup``): the streams one ``XREADGROUP`` may read
        together (all of them on one Redis, those of one hash slot on a cluster), each on a
        connection of its own to where they live. By default, of every served stream."""
        assert self.broker is not None
        if streams is None:
            streams = sorted({st for slot in self.slots.values() for st in slot.streams})
        together = self.broker.colocated(streams)
        groups = []
        for members in together:
            if prefix:
                name = prefix
            elif len(together) == 1:
                name = "reader"
            else:
                name = f"reader-{hash_tag(members[0])}"
            reads = self.broker.blocking_reads(
                members[0], name=f"inferq-worker-reader-{self.id}", block_ms=self.settings.block_ms
            )
            groups.append(ReadGroup(name, frozenset(members), reads, self.loops.backoff(name)))
        return groups

    def _build_context(self, redis: aioredis.Redis) -> WorkerContext:
        """The writer, where every part's outcomes go, and the context every part takes."""
        assert self.broker is not None
        self._transition: Script = self.broker.script(TRANSITION_SCRIPT)
        self.leases = JobLeases(
            self.id,
            lease_ms(self.settings.heartbeat_s, self.settings.claim_idle_ms),
            claim=self.broker.script(CLAIM_SCRIPT),
            renew=self.broker.script(RENEW_SCRIPT),
        )
        self._writer = ResultWriter(
            self.broker,
            self.ledger,
            metrics=self.metrics,
            job_events=self.keys.job_events,
            transition=self._transition,
            backoff=self.loops.backoff("writer"),
            tracer=self.tracer,
        )
        return WorkerContext(
            settings=self.settings,
            keys=self.keys,
            clock=self.clock,
            slots=self.slots,
            ledger=self.ledger,
            outcomes=Outcomes(self.keys, self.clock.now_ms, self.id),
            put=self._writer.put,
            metrics=self.metrics,
            stats=self.stats,
            loops=self.loops,
            tracer=self.tracer if self.tracer.enabled else None,
        )

    def _model_control(self, redis: aioredis.Redis) -> ModelControl:
        assert self.context is not None and self._control_reader is not None
        return ModelControl(self.context, redis=redis, reader=self._control_reader, host=self)

    async def _load_models(
        self, configs: dict[str, ModelConfig], policies: dict[str, VersionPolicy]
    ) -> None:
        for n, config in configs.items():
            try:
                model = await self._start_model(config, policies.get(n))
            except (RepositoryError, BackendError, ImportError) as e:
                self._skip(n, e)
                continue
            self.slots.add(ModelSlot(model, self.keys))
        if not self.slots and not self.settings.on_demand:
            raise RuntimeError(
                f"none of the models in {self.settings.model_repository} could be loaded: "
                + "; ".join(f"{n}: {why}" for n, why in self.skipped.items())
            )

    async def _start_model(self, config: ModelConfig, policy: VersionPolicy | None) -> ServedModel:
        """The model loaded as its committed policy says; when that cannot be served (a version
        it names has no folder, or does not load), as its repository config says, and model
        control records the fallback: a stale policy must never leave a model with nothing
        served while the repository holds a servable version."""
        if policy is not None:
            try:
                committed = load_config(self.settings.model_repository, config.name, policy)
                return await self.load_model(committed)
            except (RepositoryError, BackendError, ImportError) as e:
                assert self.control is not None
                self.control.fell_back(config.name, policy, str(e))
        return await self.load_model(config)

    async def load_model(self, config: ModelConfig) -> ServedModel:
        """A model of this worker, its versions loaded and warmed (off the event loop)."""
        s = self.settings
        model = ServedModel(config, device=s.device, max_batch=s.max_batch, flush_ms=s.flush_ms)
        await asyncio.to_thread(model.load)
        return model

    def may_load(self, name: str) -> bool:
        """Whether a load call may name this model here: one ``--models`` names, or, serving
        the whole repository, any folder of it with a config (added since the start too)."""
        s = self.settings
        if s.models:
            return name in s.models
        return is_valid_name(name) and (s.model_repository / name / CONFIG_FILE).is_file()

    async def add_model(self, model: ServedModel) -> None:
        """Serve a model loaded while running: its streams and consumer group, read by the
        groups that may read them together (a group of its own on another cluster slot), its
        dispatcher, and the advertisement."""
        assert self._reader is not None and self.broker is not None
        slot = ModelSlot(model, self.keys)
        await self._reader.ensure_groups(slot.streams)
        self.slots.add(slot)
        for members in self.broker.colocated(slot.streams):
            group = next(
                (
                    g
                    for g in self._reader.groups
                    if len(self.broker.colocated([*g.streams, *members])) == 1
                ),
                None,
            )
            if group is not None:
                self._reader.extend(group, members)
                continue
            (group,) = self._read_groups(members, prefix=f"reader-{hash_tag(members[0])}")
            self._reader.groups.append(group)
            if self._serving:  # else the reader's own loop reads every group
                self._reader_loops.append(group.name)
                self.loops.spawn(group.name, self._reader.run_group(group))
        if self._serving:  # else _start_loops starts every slot's dispatcher
            self.loops.spawn(f"dispatch-{model.name}", self._dispatcher(slot).run())
        self.skipped.pop(model.name, None)
        self._reader.wake()
        await self.republish()

    def _serve_metrics(self) -> None:
        s = self.settings
        self.metrics.set_info(self.id)
        self.metrics.track_held(lambda: self.holding)
        self.metrics.track_loaded(lambda: len(self.slots))
        if not s.metrics_port:
            return
        self._metrics_server = MetricsServer(self.metrics.registry, s.metrics_port, s.metrics_host)
        try:
            self._metrics_server.start()
        except OSError as e:
            self._metrics_server = None
            raise MetricsPortError(
                f"cannot serve metrics on {s.metrics_host}:{s.metrics_port}: {e}; pick another "
                "with --metrics-port, or 0 to turn them off"
            ) from e

    def _build_parts(self, redis: aioredis.Redis) -> None:
        """The reader, advertiser and reclaimer, wired to each other's narrow faces."""
        assert self.context is not None
        self._reader = Reader(self.context, redis, self._read_groups())
        self._advertiser = Advertiser(
            self.context,
            redis,
            describe=self._describe,
            statistics=self.stats.inference.encode,
            eviction=self.eviction,
            leases=self.leases,
        )
        assert self.broker is not None
        self.reclaimer = Reclaimer(self.context, self.broker, self._reader)
        if self.settings.on_demand:
            self._demand_reader = self.broker.blocking_reads(
                self.keys.demand,
                name=f"inferq-worker-demand-{self.id}",
                block_ms=max(1, int(self.settings.demand_poll_s * 1000)),
            )
            self.on_demand = OnDemand(self.context, self.broker, self, self._demand_reader)

    def _dispatcher(self, slot: ModelSlot) -> Dispatcher:
        assert self.context is not None and self._reader is not None
        assert self._redis is not None and self.broker is not None
        return Dispatcher(
            self.context,
            slot,
            redis=self._redis,
            broker=self.broker,
            leases=self.leases,
            reader=self._reader,
        )

    def _start_loops(self) -> None:
        assert self._writer and self._reader and self._advertiser and self.control
        assert self.reclaimer is not None
        self.loops.spawn("writer", self._writer.run())
        if self._reader.groups:  # else each model loaded later brings its group and loop
            self.loops.spawn("reader", self._reader.run())
        for slot in self.slots.values():
            self.loops.spawn(f"dispatch-{slot.model.name}", self._dispatcher(slot).run())
        self.loops.spawn("heartbeat", self._advertiser.run())
        self.loops.spawn("control", self.control.run())
        self.loops.spawn("reclaimer", self.reclaimer.run())
        assert self.broker is not None
        self.wedge = WedgeWatch(
            self.broker,
            self.loops.backoff(WEDGE_WATCH),
            self.loops.backoffs,
            bound_s=self.settings.redis_wedge_s,
        )
        self.loops.spawn(WEDGE_WATCH, self.wedge.run())
        if self.on_demand is not None:
            self.loops.spawn("on-demand", self.on_demand.run())
        self.metrics.runtime.track_loops(self.loops.health)
        self.metrics.runtime.track_pool(self.broker.pool_counts)
        self._serving = True

    async def stop(self) -> None:
        """Stop reading, finish queued and running batches (up to the drain timeout), publish
        their results, withdraw, close."""
        log.info("worker stopping", worker=self.id)
        if self._reader is not None:
            # A blocking read in flight may already have been handed entries: take them.
            await self._reader.finish(self.settings.block_ms / 1000 + 1.0)
        await self.loops.cancel(self._reader_loops)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._drain(), self.settings.drain_timeout_s)
        await self.loops.cancel()
        if self.control is not None:
            await self.control.stop()
        if self.broker is not None:
            with contextlib.suppress(*RETRYABLE):
                if self._advertiser is not None:
                    await self._advertiser.withdraw()
            await self.broker.aclose()
        if self._reader is not None:
            for group in self._reader.groups:
                await group.reads.aclose()
        if self._control_reader is not None:
            await self._control_reader.aclose()
        if self._demand_reader is not None:
            await self._demand_reader.aclose()
        for slot in self.slots.values():
            slot.close()
        if self._metrics_server is not None:
            await asyncio.to_thread(self._metrics_server.stop)
        log.info(
            "worker stopped",
            worker=self.id,
            batches=self.stats.batches,
            requests=self.stats.requests,
        )

    def _fatal(self, reason: str) -> None:
        self.failure = reason
        self.request_stop()

    def _skip(self, name: str, error: Exception) -> None:
        """A model of the repository that cannot be served. Named with ``--models``, that is
        fatal; serving the whole repository, the worker serves the others and says why."""
        if self.settings.models:
            raise error
        self.skipped[name] = str(error)
        log.warning("model skipped: it cannot be loaded", model=name, error=str(error))

    async def _describe(self) -> WorkerInfo:
        """This worker's advertisement now: what it serves, and what its repository holds
        (rescanned; cheap when nothing changed, see ``RepositoryScan``)."""
        listing = self._listing = await asyncio.to_thread(self.repository.scan)
        # A model that failed at start says why (its config may be fine: a missing package).
        held = tuple(
            replace(m, error=self.skipped[m.name])
            if m.name in self.skipped and m.name not in self.slots and not m.error
            else m
            for m in listing
        )
        return WorkerInfo(
            id=self.id,
            host=self.id.rsplit("-", 2)[0],
            pid=os.getpid(),
            started_ms=self._started_ms,
            models=tuple(model.metadata() for model in self.slots.models()),
            repository=held,
            fallbacks=self.control.fallback_generations() if self.control is not None else {},
            on_demand=self.settings.on_demand,
            resident_bytes=resident_bytes(),
            restarts=self.settings.restarts,
        )

    # -- on demand (consumer.ondemand's host) ---------------------------------------------------

    @property
    def loads_on_demand(self) -> bool:
        return self.settings.on_demand

    def loadable(self) -> dict[str, int]:
        """Models of the repository (or of ``--models``) this worker may load and does not
        hold, but for those an administrator unloaded: name -> partitions."""
        withdrawn = self.control.withdrawn if self.control is not None else set()
        return {
            m.name: m.metadata.partitions
            for m in self._listing
            if m.metadata is not None and m.name not in self.slots and m.name not in withdrawn
        }

    def held(self) -> dict[str, tuple[float, bool]]:
        return {
            name: (slot.used_at, slot.idle)
            for name, slot in self.slots.items()
            if name not in self._unloading
        }

    async def load_on_demand(self, name: str) -> Loaded:
        """Load and serve the model as its committed policy says (else its config); not when
        an administrator unloaded it (``WITHDRAWN``) or its load failed (``FAILED``: logged,
        and said in the advertisement like a model skipped at start)."""
        assert self.control is not None
        policy = await self.control.committed_policy(name)
        if policy is not None and not policy.loaded:
            return Loaded.WITHDRAWN
        try:
            config = await asyncio.to_thread(load_config, self.settings.model_repository, name)
            model = await self._start_model(config, policy)
        except Exception as e:  # a model file can fail to load in any way: report, go on
            known = isinstance(e, RepositoryError | BackendError)
            self.skipped[name] = str(e) if known else f"{type(e).__name__}: {e}"
            log.error("model load on demand failed", model=name, error=self.skipped[name])
            return Loaded.FAILED
        await self.add_model(model)
        await self.control.serving(model, 0 if policy is None else policy.generation)
        return Loaded.SERVING

    async def unload_model(self, name: str, reason: str) -> None:
        """Stop serving a model: the reader asks for none of its entries from now on, what
        this worker holds of it runs and is acknowledged (up to the drain timeout), then its
        dispatcher stops and it is unloaded. Entries still queued in its streams stay there
        for the workers that hold it, or the next load."""
        assert self._reader is not None
        slot = self.slots.get(name)
        if slot is None or name in self._unloading:
            return  # not held, or already being unloaded (budget and control at once)
        self._unloading.add(name)
        try:
            await self._unload(name, slot, reason)
        finally:
            self._unloading.discard(name)

    async def _unload(self, name: str, slot: ModelSlot, reason: str) -> None:
        assert self._reader is not None
        slot.stop_reading()
        timeout_s = self.settings.drain_timeout_s
        await self._reader.release(slot.streams, timeout_s)
        mine = set(slot.streams)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                slot.notify()
                await slot.wait_idle()
                # Acknowledged, not just answered: a rare wait with no event of its own.
                while self.ledger.holds_any(mine):  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
        await self.loops.cancel([f"dispatch-{name}"])
        self.slots.remove(name)
        await self._hand_back(name, self.ledger.unfinished(mine))
        await asyncio.to_thread(slot.close)
        self.metrics.observe_unload(name, reason)
        await self.republish()
        log.info("model unloaded", model=name, reason=reason)

    async def _hand_back(self, name: str, left: dict[str, list[bytes]]) -> None:
        """Entries of a model just unloaded that did not finish within the drain timeout (its
        dispatcher is gone): held, the reclaimer would renew them forever and a later load
        of the model here would skip them as already held. So they are no longer held, and
        marked idle for ``claim_idle_ms`` (``XCLAIM ... IDLE``, no delivery counted): the next
        reclaimer pass of a worker that holds the model takes them, and a load here reads its
        own pending list first."""
        assert self._redis is not None
        idle_ms = self.settings.claim_idle_ms
        for stream, ids in left.items():
            for entry_id in ids:
                self.ledger.abandon((stream, entry_id))
            try:
                await self._redis.xclaim(
                    stream, GROUP, self.id, 0, cast(list[Any], ids), idle=idle_ms, justid=True
                )
            except RETRYABLE as e:  # they go idle on their own, claim_idle_ms later
                log.warning("could not hand entries back", model=name, error=str(e))
        if left:
            count = sum(len(ids) for ids in left.values())
            log.warning("unfinished entries handed back at unload", model=name, count=count)

    async def republish(self) -> None:
        """Advertise what the models serve now (after a version change)."""
        if self._advertiser is not None:
            await self._advertiser.publish()

    async def _drain(self) -> None:
        if self._reader is not None:
            self._reader.draining = True
        for slot in self.slots.values():
            slot.notify()
        await asyncio.gather(*(slot.wait_idle() for slot in self.slots.values()))
        if self._writer is not None:
            await self._writer.drain()
