"""The worker process: reads a consumer group, forms batches, runs models, publishes results.

Tasks, all owned here and started in ``start`` and cancelled in ``stop``:
- the reader: one ``XREADGROUP`` over every stream of every served model (high lane first);
- one dispatcher per model: asks the batch policy when to run, runs the batch on the model's
  own thread so the event loop keeps reading, and hands results to the writer;
- the writer: pipelines result writes, reply notifications and XACKs (``writer.py``);
- the advertiser: heartbeat and model metadata (``advertiser.py``).

Reads are aimed at batching: the reader asks each model's streams for just enough entries to fill
its next batch, keeps reading while the model runs (the next batch forms meanwhile), stops
reading a model whose next batch is full, and wakes from a blocking read with ``CLIENT UNBLOCK``
when a model that was full wants more.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, cast

import redis.asyncio as aioredis
import structlog
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from consumer.advertiser import Advertiser
from consumer.backends import BackendError
from consumer.batcher import BatchPolicy, BatchQueue, Queued
from consumer.control import ModelControl
from consumer.metrics import MetricsServer, WorkerMetrics
from consumer.model import ServedModel, batch_group, rows_of
from consumer.reclaimer import Reclaimer
from consumer.repository import ModelConfig, RepositoryError, list_models, load_config
from consumer.settings import WorkerSettings
from consumer.writer import JobUpdate, Outgoing, ResultWriter
from protocol import ProtocolError
from protocol.jobs import TRANSITION_SCRIPT, JobStatus, transition_args
from protocol.keys import GROUP, LANES_BY_PRIORITY, Keys, Lane
from protocol.messages import FIELD, InferRequest, InferResult, Kind, Status, Timings
from protocol.registry import WorkerInfo
from runtime import tracing
from runtime.aio import cancelling
from runtime.connections import RedisClock, blocking_client, command_client, redact

log = structlog.get_logger("inferq.worker")

_CONNECTION_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)
BACKGROUND_BATCH_DIVISOR = 8
MAX_BACKOFF_S = 1.0
"""Reconnect attempts are cheap; retrying at least every second brings service back fast."""


@dataclass(slots=True)
class Delivery:
    """A request read from a stream, not yet answered."""

    stream: str
    entry_id: bytes
    request: InferRequest
    read_ms: int
    """When it was read, on the Redis clock."""
    read_at: float
    """When it was read, monotonic."""


@dataclass
class WorkerStats:
    """Counters for tests, logs and (later) metrics; recent batch sizes are kept bounded."""

    batches: int = 0
    requests: int = 0
    expired: int = 0
    failed: int = 0
    dead_lettered: int = 0
    skipped_jobs: int = 0
    """Jobs read but not run: cancelled, expired or already finished."""
    batch_sizes: deque[int] = field(default_factory=lambda: deque(maxlen=10_000))
    executed: deque[str] = field(default_factory=lambda: deque(maxlen=100_000))
    """Ids of recently executed requests, newest last."""


class ModelSlot:
    """A served model with its queue, policy and the reader's knowledge of its streams."""

    def __init__(self, model: ServedModel, keys: Keys) -> None:
        self.model = model
        self.streams = keys.streams(model.name)
        self.lane_of = {s: i for i, s in enumerate(self.streams)}
        self.queue: BatchQueue[Delivery] = BatchQueue(
            lanes=len(LANES_BY_PRIORITY), background_from=LANES_BY_PRIORITY.index(Lane.LOW)
        )
        self.policy = BatchPolicy(model.max_batch, model.flush_s)
        self.read_ids = dict.fromkeys(self.streams, "0")
        """'0' first: drain entries this consumer already holds from an earlier life."""
        self.drained = False
        self.busy = False
        self.changed = asyncio.Event()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"model-{model.name}")
        self.service_s = 0.0
        """Moving average of recent model-call durations."""
        self.idle = asyncio.Event()
        """Set while nothing is queued or running: what a drain waits for."""
        self.idle.set()

    def wanted_count(self, lane: int | None = None) -> int:
        """Entries to ask for: enough to fill the next batch. Per lane, only what is queued in
        that lane and above counts, so a worker full of background jobs still reads the
        synchronous lanes."""
        rows = self.queue.rows if lane is None else self.queue.rows_through(lane)
        return max(0, self.model.max_batch - rows)

    def batch_limit(self) -> int:
        """Rows for the next batch. Background (job) batches are kept small: the event loop
        encodes and writes a batch's results before it can start the next one, so a synchronous
        request arriving meanwhile waits for at most one small job batch."""
        if self.queue.head_lane() == LANES_BY_PRIORITY.index(Lane.LOW):
            return max(1, self.model.max_batch // BACKGROUND_BATCH_DIVISOR)
        return self.model.max_batch

    def reading_backlog(self) -> bool:
        """Still paging through entries delivered to this consumer earlier (its pending list)."""
        return any(i != ">" for i in self.read_ids.values())

    def needs_prompt_read(self) -> bool:
        """Idle with a partial batch and more possibly queued: read without blocking."""
        return not self.busy and len(self.queue) > 0 and not self.drained


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
        self._metrics_server: MetricsServer | None = None
        self.clock = RedisClock()
        self.slots: dict[str, ModelSlot] = {}
        self.started = asyncio.Event()
        self._stopping = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reader_wake = asyncio.Event()
        self._blocking_on: frozenset[str] | None = None
        self._draining = False
        self._held: dict[tuple[str, bytes], float] = {}
        """(stream, entry id) of every entry read and not yet acknowledged."""
        self._reader_client_id: int | None = None
        self._redis: aioredis.Redis | None = None
        self._reader: aioredis.Redis | None = None
        self._control_reader: aioredis.Redis | None = None
        self.control: ModelControl | None = None
        self._started_ms = 0
        self.skipped: dict[str, str] = {}
        """Models of the repository not served, and why (serving the whole repository)."""
        self._writer: ResultWriter | None = None
        self._transition: AsyncScript | None = None
        self._advertiser: Advertiser | None = None

    @property
    def holding(self) -> int:
        """Entries read from Redis and not yet acknowledged (queued, running or being written)."""
        return len(self._held)

    # -- lifecycle -------------------------------------------------------------------------

    async def run(self) -> None:
        """Start, serve until ``request_stop`` (or a signal handled by the caller), stop."""
        await self.start()
        try:
            await self._stopping.wait()
        finally:
            await self.stop()

    def request_stop(self) -> None:
        self._stopping.set()

    async def start(self) -> None:
        s = self.settings
        names = list(s.models) or list_models(s.model_repository)
        if not names:
            raise RuntimeError(f"no models to serve in {s.model_repository}")
        # Check every config before touching Redis: a typo is reported as such, at once.
        configs: dict[str, ModelConfig] = {}
        for n in names:
            try:
                configs[n] = load_config(s.model_repository, n)
            except RepositoryError as e:
                self._skip(n, e)
        self._redis = command_client(s.redis, name=f"inferq-worker-{self.id}")
        self._reader = blocking_client(
            s.redis, name=f"inferq-worker-reader-{self.id}", block_s=s.block_ms / 1000
        )
        self._control_reader = blocking_client(
            s.redis, name=f"inferq-worker-control-{self.id}", block_s=s.block_ms / 1000
        )
        await self.clock.sync(self._redis)
        self.control = ModelControl(
            worker_id=self.id,
            redis=self._redis,
            reader=self._control_reader,
            keys=self.keys,
            repository=s.model_repository,
            slots=self.slots,
            now_ms=self.clock.now_ms,
            republish=self._republish,
            block_ms=s.block_ms,
            retire_after_s=s.retire_after_s,
        )
        # Before loading: a model an administrator changed is served as committed, not as the
        # repository config says.
        policies = await self.control.committed_policies()
        for n, config in configs.items():
            try:
                if n in policies:
                    config = load_config(s.model_repository, n, policies[n])
                model = ServedModel(
                    config, device=s.device, max_batch=s.max_batch, flush_ms=s.flush_ms
                )
                await asyncio.to_thread(model.load)
            except (RepositoryError, BackendError, ImportError) as e:
                self._skip(n, e)
                continue
            self.slots[model.name] = ModelSlot(model, self.keys)
        if not self.slots:
            raise RuntimeError(
                f"none of the models in {s.model_repository} could be loaded: "
                + "; ".join(f"{n}: {why}" for n, why in self.skipped.items())
            )
        self.metrics.set_info(self.id)
        self.metrics.track_held(lambda: self.holding)
        if s.metrics_port:
            self._metrics_server = MetricsServer(self.metrics.registry, s.metrics_port)
            try:
                self._metrics_server.start()
            except OSError as e:
                self._metrics_server = None
                raise MetricsPortError(
                    f"cannot serve metrics on port {s.metrics_port}: {e}; pick another with "
                    "--metrics-port, or 0 to turn them off"
                ) from e
        await self._ensure_groups()
        self._started_ms = self.clock.now_ms()
        info = self._info()
        self._transition = self._redis.register_script(TRANSITION_SCRIPT)
        self._writer = ResultWriter(
            self._redis,
            metrics=self.metrics,
            job_events=self.keys.job_events,
            transition=self._transition,
            on_written=self._release,
            tracer=self.tracer,
        )
        self._advertiser = Advertiser(
            self._redis,
            self.keys,
            info,
            self.clock,
            interval_s=s.heartbeat_s,
            ttl_s=s.worker_ttl_s,
        )
        # Advertise, then catch up on model changes, then read: a change being prepared counts
        # this worker from its advertisement on, and this worker has that change's versions
        # before it reads a request that might be routed to them.
        await self._advertiser.publish()
        await self.control.report_started()
        await self.control.catch_up()
        self._spawn(self._writer.run(), "writer")
        self._spawn(self._read_loop(), "reader")
        for slot in self.slots.values():
            self._spawn(self._dispatch_loop(slot), f"dispatch-{slot.model.name}")
        self._spawn(self._advertiser.run(), "heartbeat")
        self._spawn(self.control.run(), "control")
        self.reclaimer = Reclaimer(
            self._redis,
            self,
            claim_idle_ms=s.claim_idle_ms,
            interval_s=max(0.05, s.claim_idle_ms / 1000 / 4),
        )
        self._spawn(self.reclaimer.run(), "reclaimer")
        log.info(
            "worker started",
            worker=self.id,
            models=names,
            redis=redact(s.redis.url),
            max_batch={n: sl.model.max_batch for n, sl in self.slots.items()},
        )
        self.started.set()

    async def stop(self) -> None:
        """Stop reading, finish queued and running batches (up to the drain timeout), publish
        their results, withdraw, close."""
        log.info("worker stopping", worker=self.id)
        reader = [t for t in self._tasks if t.get_name() == "reader"]
        await _cancel(reader)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._drain(), self.settings.drain_timeout_s)
        await _cancel(list(self._tasks))
        if self.control is not None:
            await self.control.stop()
        if self._redis is not None:
            with contextlib.suppress(*_CONNECTION_ERRORS):
                if self._advertiser is not None:
                    await self._advertiser.withdraw()
            await self._redis.aclose()
        if self._reader is not None:
            await self._reader.aclose()
        if self._control_reader is not None:
            await self._control_reader.aclose()
        for slot in self.slots.values():
            slot.executor.shutdown(wait=True)
            slot.model.unload()
        if self._metrics_server is not None:
            await asyncio.to_thread(self._metrics_server.stop)
        log.info(
            "worker stopped",
            worker=self.id,
            batches=self.stats.batches,
            requests=self.stats.requests,
        )

    def _skip(self, name: str, error: Exception) -> None:
        """A model of the repository that cannot be served. Named with ``--models``, that is
        fatal; serving the whole repository, the worker serves the others and says why."""
        if self.settings.models:
            raise error
        self.skipped[name] = str(error)
        log.warning("model skipped: it cannot be loaded", model=name, error=str(error))

    def _info(self) -> WorkerInfo:
        return WorkerInfo(
            id=self.id,
            host=self.id.rsplit("-", 2)[0],
            pid=os.getpid(),
            started_ms=self._started_ms,
            models=tuple(slot.model.metadata() for slot in self.slots.values()),
        )

    async def _republish(self) -> None:
        """Advertise what the models serve now (after a version change)."""
        if self._advertiser is not None:
            self._advertiser.info = self._info()
            await self._advertiser.publish()

    async def _drain(self) -> None:
        self._draining = True
        for slot in self.slots.values():
            slot.changed.set()
        await asyncio.gather(*(slot.idle.wait() for slot in self.slots.values()))
        if self._writer is not None:
            await self._writer.wait_idle()

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("worker task crashed", task=task.get_name(), exc_info=task.exception())
            self.request_stop()

    async def _ensure_groups(self) -> None:
        assert self._redis is not None
        for slot in self.slots.values():
            for stream in slot.streams:
                try:
                    # From id 0: requests queued before any worker existed are served too.
                    await self._redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
                except ResponseError as e:
                    if "BUSYGROUP" not in str(e):
                        raise

    # -- reading ---------------------------------------------------------------------------

    def _wanted(self) -> tuple[dict[str, str], int, bool]:
        """Streams to read (with ids), entries per stream, and whether to block."""
        streams: dict[str, str] = {}
        count = 0
        prompt = False
        for slot in self.slots.values():
            wanted = {s: slot.wanted_count(lane) for s, lane in slot.lane_of.items()}
            included = [s for s, n in wanted.items() if n > 0]
            if not included:
                slot.drained = False  # not read: what is queued in Redis is unknown
                continue
            streams.update({s: slot.read_ids[s] for s in included})
            count = max(count, *(wanted[s] for s in included))
            prompt = prompt or slot.needs_prompt_read() or slot.reading_backlog()
        return streams, count, not prompt

    def _wake_reader(self) -> None:
        """A model's wants changed: make sure the reader is not blocked on the old ones."""
        self._reader_wake.set()
        if self._blocking_on is None or self._reader_client_id is None:
            return
        streams, _, _ = self._wanted()
        if not set(streams) <= self._blocking_on:
            self._blocking_on = None
            self._spawn(self._unblock_reader(self._reader_client_id), "unblock")

    async def _unblock_reader(self, client_id: int) -> None:
        assert self._redis is not None
        with contextlib.suppress(*_CONNECTION_ERRORS, ResponseError):
            await self._redis.client_unblock(client_id)

    async def _read_loop(self) -> None:
        assert self._reader is not None
        backoff = 0.05
        missing_groups = False
        while not cancelling():
            streams, count, block = self._wanted()
            if not streams:
                self._reader_wake.clear()
                await self._reader_wake.wait()
                continue
            try:
                if missing_groups:
                    await self._ensure_groups()
                    missing_groups = False
                if self._reader_client_id is None:
                    self._reader_client_id = int(await self._reader.client_id())
                if block:
                    self._blocking_on = frozenset(streams)
                    for slot in self.slots.values():
                        if slot.streams[0] in streams:
                            slot.drained = True
                reply: Any = await self._reader.xreadgroup(
                    GROUP,
                    self.id,
                    cast(Any, streams),
                    count=count,
                    block=self.settings.block_ms if block else None,
                )
                backoff = 0.05
            except ResponseError as e:
                if "NOGROUP" not in str(e):
                    raise
                log.warning("consumer group missing (Redis restarted empty?), recreating")
                missing_groups = True
                continue
            except _CONNECTION_ERRORS as e:
                log.warning("read failed, retrying", error=str(e), backoff_s=backoff)
                self._reader_client_id = None
                # Redis may have delivered entries whose reply never reached us: they sit in
                # this consumer's pending list. Read that list again (skipping what we hold).
                for slot in self.slots.values():
                    slot.read_ids = dict.fromkeys(slot.streams, "0")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                continue
            finally:
                self._blocking_on = None
            self._deliver(reply or [], streams, count)

    def _deliver(self, reply: list[Any], asked: dict[str, str], count: int) -> None:
        got: dict[str, int] = {}
        last_ids: dict[str, str] = {}
        for raw_stream, entries in reply:
            stream = _text(raw_stream)
            got[stream] = len(entries)
            if entries and asked.get(stream, ">") != ">":
                last_ids[stream] = _text(entries[-1][0])
            self.accept(stream, entries)
        for slot in self.slots.values():
            if slot.streams[0] not in asked:
                continue
            for stream in slot.streams:
                if stream in asked and asked[stream] != ">":
                    # Reading our own pending list: page through it, then switch to new entries.
                    done = got.get(stream, 0) < count
                    slot.read_ids[stream] = ">" if done else last_ids.get(stream, ">")
            slot.drained = all(s in asked and got.get(s, 0) < count for s in slot.streams)
            if slot.drained:
                slot.changed.set()

    def accept(
        self,
        stream: str,
        entries: list[Any],
        *,
        deliveries: Callable[[int], int] | None = None,
    ) -> None:
        """Queue entries read from (or claimed on) a stream for their model's next batches.

        ``deliveries(i)``, when given (reclaimed entries), is how often entry ``i`` has been
        delivered. Past ``max_deliveries`` it is not run again: it is dead-lettered and its
        caller answered with the reason. An entry delivered more than once runs in a batch of its
        own, so if it is what crashes workers it takes no other request down with it.
        """
        parsed = self.keys.parse_stream(stream)
        slot = self.slots.get(parsed[0]) if parsed else None
        if slot is None:
            return
        now = time.monotonic()
        now_ms = self.clock.now_ms()
        out: list[Outgoing] = []
        dlq = self.keys.dlq(slot.model.name)
        for i, (entry_id, fields) in enumerate(entries):
            if (stream, entry_id) in self._held:
                continue  # re-read from our pending list while we still hold it
            if fields is None:
                # Deleted while pending (a pending-list read reports it): nothing to run.
                out.append(Outgoing(stream, entry_id, None))
                continue
            self._held[(stream, entry_id)] = now
            payload = fields.get(FIELD)
            try:
                if payload is None:
                    raise ProtocolError(f"stream entry has no '{FIELD.decode()}' field")
                request = InferRequest.decode(payload)
            except ProtocolError as e:
                log.error(
                    "undecodable request moved to dead letters",
                    stream=stream,
                    entry=entry_id,
                    error=str(e),
                )
                self.stats.dead_lettered += 1
                self.metrics.observe_dead_letter(slot.model.name, "undecodable")
                out.append(
                    Outgoing(stream, entry_id, None, dead_letter=dlq, reason=str(e), raw=payload)
                )
                continue
            times = deliveries(i) if deliveries is not None else 1
            if times > self.settings.max_deliveries:
                reason = (
                    f"the request was delivered {times - 1} times without completing (it may "
                    "crash workers); it was moved to the dead-letter stream"
                )
                log.error(
                    "request moved to dead letters",
                    stream=stream,
                    entry=entry_id,
                    request_id=request.id,
                    model=request.model,
                    reason=reason,
                    traceparent=request.traceparent,
                )
                self.stats.dead_lettered += 1
                self.metrics.observe_dead_letter(slot.model.name, "poison")
                failed = InferResult(
                    request.id,
                    Status.FAILED,
                    request.model,
                    request.version,
                    error=reason,
                    worker=self.id,
                )
                delivery = Delivery(stream, entry_id, request, now_ms, now)
                poisoned = self._outgoing(delivery, failed)
                out.append(replace(poisoned, dead_letter=dlq, reason=reason, raw=payload))
                continue
            self.metrics.observe_dequeued(
                slot.model.name,
                LANES_BY_PRIORITY[slot.lane_of[stream]].value,
                (now_ms - request.enqueued_ms) / 1000,
            )
            delivery = Delivery(stream, entry_id, request, now_ms, now)
            slot.idle.clear()
            slot.queue.push(
                Queued(
                    delivery,
                    lane=slot.lane_of[stream],
                    rows=rows_of(request),
                    group=batch_group(request) if times == 1 else ("suspect", stream, entry_id),
                    arrived=now,
                    deadline=now + (request.deadline_ms - now_ms) / 1000,
                )
            )
        slot.changed.set()
        if out and self._writer is not None:
            self._writer.put(out)

    def room(self, model: str) -> int:
        """How many more entries this worker should take on for the model right now."""
        slot = self.slots.get(model)
        return 0 if slot is None or self._draining else slot.wanted_count()

    def held_since(self) -> dict[tuple[str, bytes], float]:
        """Every entry this worker holds, with when it was read (monotonic)."""
        return self._held

    def _release(self, written: list[Outgoing]) -> None:
        for out in written:
            self._held.pop((out.stream, out.entry_id), None)

    # -- running ---------------------------------------------------------------------------

    async def _dispatch_loop(self, slot: ModelSlot) -> None:
        while not cancelling():
            now = time.monotonic()
            expired = slot.queue.drop_expired(now)
            if expired:
                self._answer_expired(slot, [q.item for q in expired])
                self._wake_reader()
            if len(slot.queue):
                slot.idle.clear()
            else:
                slot.idle.set()
            wait = slot.policy.wait_s(
                slot.queue, now, drained=slot.drained or self._draining, service_s=slot.service_s
            )
            if wait != 0.0:
                slot.changed.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):  # no task per wait, unlike wait_for
                        await slot.changed.wait()
                continue
            slot.busy = True
            self._wake_reader()
            try:
                batch = await self._claim_jobs(slot, slot.queue.take(slot.batch_limit()))
                if batch:
                    await self._run_batch(slot, batch)
            finally:
                slot.busy = False
                self._wake_reader()

    async def _claim_jobs(self, slot: ModelSlot, batch: list[Queued[Delivery]]) -> list[Delivery]:
        """Mark the batch's async jobs running; drop those cancelled or expired meanwhile.

        The check and the change are one atomic script, so a job cancelled before this point is
        never run, and a job claimed here can no longer be cancelled.
        """
        jobs = [q for q in batch if q.item.request.kind is Kind.JOB]
        if not jobs:
            return [q.item for q in batch]
        assert self._transition is not None
        try:
            before = await self._transition(
                keys=[self.keys.job(q.item.request.id) for q in jobs],
                args=[
                    JobStatus.QUEUED.value,
                    *transition_args(JobStatus.RUNNING, started_ms=self.clock.now_ms()),
                ],
            )
        except _CONNECTION_ERRORS as e:
            log.warning("could not claim jobs, will retry", error=str(e))
            for q in jobs:
                slot.queue.push(q)
            return [q.item for q in batch if q.item.request.kind is not Kind.JOB]
        skipped: set[int] = set()
        for q, status in zip(jobs, before, strict=True):
            if status != JobStatus.QUEUED.value.encode():
                skipped.add(id(q))
                r = q.item.request
                log.info(
                    "job not run",
                    job_id=r.id,
                    model=r.model,
                    version=r.version,
                    status=status.decode() if status else "missing",
                    traceparent=r.traceparent,
                )
                self.stats.skipped_jobs += 1
        if skipped:
            assert self._writer is not None
            self._writer.put(
                [Outgoing(q.item.stream, q.item.entry_id, None) for q in jobs if id(q) in skipped]
            )
        return [q.item for q in batch if id(q) not in skipped]

    async def _run_batch(self, slot: ModelSlot, batch: list[Delivery]) -> None:
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        outcome = await loop.run_in_executor(
            slot.executor, slot.model.run, [d.request for d in batch], self.id
        )
        slot.service_s = (
            0.8 * slot.service_s + 0.2 * outcome.infer_s if slot.service_s else (outcome.infer_s)
        )
        self.stats.batches += 1
        self.stats.requests += len(batch)
        self.stats.batch_sizes.append(len(batch))
        finished_at = time.monotonic()
        rows = sum(rows_of(d.request) for d in batch)
        exemplar = None
        if self.tracer.enabled:
            exemplar = self.tracer.batch(
                model=slot.model.name,
                worker=self.id,
                requests=[(d.request.traceparent, d.read_at) for d in batch],
                started=started,
                finished=finished_at,
                rows=rows,
                failed=outcome.model_failed,
            )
        self.metrics.observe_batch(
            slot.model.name,
            requests=len(batch),
            rows=rows,
            batch_waits_s=[started - d.read_at for d in batch],
            inference_s=outcome.infer_s,
            exemplar=exemplar,
        )
        out = []
        for d, result in zip(batch, outcome.results, strict=True):
            self.metrics.observe_result(result.model, result.version, result.status.value)
            log.debug(
                "request done",
                component="worker",
                request_id=d.request.id,
                model=result.model,
                version=result.version,
                status=result.status.value,
                batch_size=len(batch),
                traceparent=d.request.traceparent,
            )
            if result.status is Status.OK:
                self.stats.executed.append(d.request.id)
            else:
                self.stats.failed += 1
                log.warning(
                    "request failed",
                    request_id=d.request.id,
                    model=result.model,
                    version=result.version,
                    error=result.error,
                    traceparent=d.request.traceparent,
                )
            timed = _with_timings(result, d, started, batch_size=len(batch))
            out.append(replace(self._outgoing(d, timed), finished_at=finished_at))
        assert self._writer is not None
        self._writer.put(out)

    def _outgoing(self, d: Delivery, result: InferResult) -> Outgoing:
        r = d.request
        payload = result.encode()
        if r.kind is Kind.JOB:
            return Outgoing(
                d.stream,
                d.entry_id,
                payload,
                job=self._job_update(r, result, payload),
                model=r.model,
                finished_at=time.monotonic(),
                traceparent=r.traceparent,
            )
        return Outgoing(
            d.stream,
            d.entry_id,
            payload,
            model=r.model,
            finished_at=time.monotonic(),
            traceparent=r.traceparent,
            # Only successes are stored: the result key doubles as the cache entry.
            result_key=r.result_key if result.status is Status.OK else None,
            ttl_ms=r.result_ttl_ms,
            reply_to=r.reply_to,
        )

    def _job_update(self, r: InferRequest, result: InferResult, payload: bytes) -> JobUpdate:
        now = self.clock.now_ms()
        if result.status is Status.OK:
            required, args = (
                JobStatus.RUNNING,
                transition_args(JobStatus.SUCCEEDED, finished_ms=now, result=payload),
            )
        elif result.status is Status.EXPIRED:
            required, args = (
                JobStatus.QUEUED,
                transition_args(
                    JobStatus.EXPIRED, finished_ms=now, error=result.error or "expired"
                ),
            )
        else:
            required, args = (
                JobStatus.RUNNING,
                transition_args(JobStatus.FAILED, finished_ms=now, error=result.error or "failed"),
            )
        return JobUpdate(self.keys.job(r.id), r.id, required, args, r.result_ttl_ms)

    def _answer_expired(self, slot: ModelSlot, deliveries: list[Delivery]) -> None:
        self.stats.expired += len(deliveries)
        self.metrics.observe_expired(slot.model.name, len(deliveries))
        out = []
        for d in deliveries:
            r = d.request
            log.info(
                "request expired before it ran",
                request_id=r.id,
                model=r.model,
                version=r.version,
                traceparent=r.traceparent,
            )
            result = InferResult(
                r.id,
                Status.EXPIRED,
                r.model,
                r.version,
                worker=self.id,
                error=f"deadline passed after {max(0, d.read_ms - r.enqueued_ms)} ms in the queue "
                "before a worker could run the request",
            )
            out.append(self._outgoing(d, result))
        assert self._writer is not None
        self._writer.put(out)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _with_timings(
    result: InferResult, d: Delivery, started: float, *, batch_size: int
) -> InferResult:
    timings = Timings(
        queued_ms=max(0.0, float(d.read_ms - d.request.enqueued_ms)),
        batch_wait_ms=max(0.0, (started - d.read_at) * 1000),
        infer_ms=result.timings.infer_ms,
        batch_size=batch_size,
    )
    return InferResult(
        result.id,
        result.status,
        result.model,
        result.version,
        result.outputs,
        result.error,
        result.worker,
        timings,
    )


async def _cancel(tasks: list[asyncio.Task[Any]]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
