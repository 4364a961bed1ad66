"""Models loaded when requests for them wait (``--load on-demand``), under a budget.

An on-demand worker starts holding no model. Its repository's models (or those ``--models``
names) are *loadable*: it advertises them (``WorkerInfo.on_demand``) and their metadata, so the
gateway queues requests for them instead of refusing them. Requests go to the consumer group of
their model's streams as always; only workers that hold the model read those streams. This loop
decides when this worker starts holding one more (design: docs/on-demand.md, ARCHITECTURE.md):

- as soon as a gateway hints that it queued a request for a model nobody holds
  (``protocol.demand``), and at the latest every ``demand_poll_s``, it reads which loadable
  models it does not hold have unread entries: one ``GET`` of the backlog snapshot the elected
  gateway publishes (``runtime.stats``) while it is fresh, else ``runtime.lag.collect`` of just
  those models; at idle the cost is one blocked read and one command a poll per worker,
  whatever the number of models;
- such a model that no live worker holds is loaded at once; one that another worker holds is
  loaded only when its oldest unread entry has waited ``load_after_ms`` (that worker is not
  keeping up), so a model's requests stay on the workers that hold it while they keep up;
- one worker at a time adds capacity for a model: the load is claimed (``Keys.load_claim``,
  ``SET NX PX``) for the load and then for ``load_after_ms``, the time the new holder gets to
  catch up before another worker may judge it too slow;
- before a load, the least recently used models are unloaded until one more fits the budget
  (``consumer.budget``); after it, again if the measured memory passed the budget. Unloading a
  model stops reading its streams and finishes what this worker holds of it; what is still
  queued stays in the stream, for the workers that hold it or for the next load;
- with ``unload_idle_s``, a model that ran no request for that long is unloaded.

Memory is measured at load: the process's resident set before and after (``resident_bytes``),
reported per model (``inferq_worker_model_resident_bytes``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Mapping
from enum import Enum
from typing import Any, Protocol

import structlog

from consumer.budget import MIB, Held, LoadBudget
from consumer.context import WorkerContext
from protocol import ProtocolError
from protocol.demand import decode_hint
from protocol.keys import GROUP, LANES_BY_PRIORITY, text
from protocol.registry import WorkerInfo
from runtime.aio import cancelling
from runtime.broker import Broker
from runtime.faults import RETRYABLE
from runtime.lag import LagError, collect
from runtime.readconn import BlockingReads, recover
from runtime.stats import read_snapshot

log = structlog.get_logger("inferq.worker")

LOAD_CLAIM_MS = 120_000
"""How long a load may take before another worker may start the same one (a worker that died
mid-load frees the claim after this)."""
SNAPSHOT_FRESH_MS = 5_000
"""A published backlog snapshot older than this is not used (its publisher is gone)."""
UNLOADED_RECHECK_S = 5.0
"""For this long after unloading a model, the worker reads that model's streams itself at each
look instead of trusting the snapshot: gateways still route to it from advertisements up to a
refresh old (so send no hint), and the snapshot is up to an interval old."""
RETRY_FAILED_S = 30.0
"""A model whose load failed is tried again after this long (its folder may be fixed)."""
CLAIM_SCRIPT = """
-- KEYS[1]: the model's load claim. ARGV[1]: this worker, ARGV[2]: TTL (ms), ARGV[3]: '1' when
-- no live worker holds the model. 1 when claimed, 0 when another worker's claim stands.
-- A claim is 'loading:{worker}' during a load, then '{worker}' for the load-after cool-down;
-- the cool-down gives a new holder time to catch up, so it does not apply when nobody holds
-- the model (an LRU unload right after a load must not leave the model's requests waiting).
local held = redis.call('GET', KEYS[1])
if held and (ARGV[3] ~= '1' or string.sub(held, 1, 8) == 'loading:') then
  return 0
end
redis.call('SET', KEYS[1], 'loading:' .. ARGV[1], 'PX', ARGV[2])
return 1
"""
UNREAD_SCRIPT = """
-- KEYS: request streams. ARGV[1]: their consumer group. One item per stream: the id of its
-- oldest entry the group has not read ('' when none; any entry when it has no such group).
local firsts = {}
for i, key in ipairs(KEYS) do
  local first = ''
  local groups = redis.pcall('XINFO', 'GROUPS', key)
  if type(groups) == 'table' and not groups.err then
    local start = '-'
    for _, g in ipairs(groups) do
      local info = {}
      for j = 1, #g, 2 do info[g[j]] = g[j + 1] end
      if info['name'] == ARGV[1] then start = '(' .. info['last-delivered-id'] end
    end
    local entries = redis.call('XRANGE', key, start, '+', 'COUNT', 1)
    if #entries > 0 then first = entries[1][1] end
  end
  firsts[i] = first
end
return firsts
"""
_ERRORS: tuple[type[BaseException], ...] = (*RETRYABLE, LagError)


def resident_bytes() -> int:
    """This process's resident set size now (Linux ``/proc``; 0 where it cannot be read, and
    then only ``--max-loaded-models`` bounds what is held)."""
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Loaded(Enum):
    """What a load on demand came to (``DemandHost.load_on_demand``)."""

    SERVING = "serving"
    WITHDRAWN = "withdrawn"
    """Not loaded: the committed policy says an administrator unloaded the model. Not a
    failure: its next load call makes it loadable again at once, not ``RETRY_FAILED_S`` later."""
    FAILED = "failed"
    """Its load failed (logged and advertised): tried again after ``RETRY_FAILED_S``."""


class DemandHost(Protocol):
    """What the on-demand loop needs of its worker (``consumer.worker.Worker``)."""

    def loadable(self) -> dict[str, int]:
        """Models this worker may load and does not hold: name -> partitions."""

    def held(self) -> dict[str, tuple[float, bool]]:
        """Models held: name -> (when a request for it was last read, whether it is idle)."""

    async def load_on_demand(self, name: str) -> Loaded:
        """Load the model (its committed policy, else its config) and serve it."""

    async def unload_model(self, name: str, reason: str) -> None:
        """Stop serving the model: stop reading its streams, finish what is held, unload;
        counted by ``reason`` (budget, idle, control)."""


class OnDemand:
    def __init__(
        self,
        context: WorkerContext,
        broker: Broker,
        host: DemandHost,
        hints: BlockingReads | None = None,
    ) -> None:
        """``hints``: a blocking connection for ``Keys.demand`` (None: poll only)."""
        s = context.settings
        self._ctx = context
        self._redis = broker.commands
        self._host = host
        self._keys = context.keys
        self._me = context.worker_id
        self._budget = LoadBudget.of(s.max_loaded_models, s.max_model_memory_mib)
        self._poll_s = s.demand_poll_s
        self._load_after_ms = s.load_after_ms
        self._idle_s = s.unload_idle_s
        self._backoff = context.loops.backoff("on-demand", critical=False)
        self.resident: dict[str, int] = {}
        """Model -> resident bytes its last load added (kept after an unload: the estimate for
        the next load of it)."""
        self._failed_at: dict[str, float] = {}
        self._unloaded_at: dict[str, float] = {}
        self._claim_script = broker.script(CLAIM_SCRIPT)
        self._unread_script = broker.script(UNREAD_SCRIPT)
        self._hints = hints
        self._hint_id = "$"
        self._hinted: set[str] = set()

    async def run(self) -> None:
        if self._hints is not None:
            await self._hints_from_now()
        while not cancelling():
            try:
                await self._wait_for_hints()
                await self.tick()
            except _ERRORS as e:
                await self._backoff.failed(e)
                continue
            self._backoff.succeeded()

    async def tick(self) -> None:
        """One look: unload what idled out, then load at most one model requests wait for."""
        await self._unload_idle()
        now = time.monotonic()
        candidates = {
            name: partitions
            for name, partitions in self._host.loadable().items()
            if now - self._failed_at.get(name, -RETRY_FAILED_S) >= RETRY_FAILED_S
        }
        if not candidates:
            return
        hinted, self._hinted = self._hinted & set(candidates), set()
        waiting = await self._waiting(candidates)
        for name in hinted:  # just queued: the snapshot may not count it yet
            waiting[name] = max(1, waiting.get(name, 0))
        if not waiting:
            return
        holders: set[str] | None = None
        for name in sorted(waiting, key=lambda n: -waiting[n]):
            if holders is None:
                holders = await self._holders()
            held = name in holders
            if held:
                waited = await self.oldest_unread_ms(name, candidates[name])
                if waited < self._load_after_ms:
                    continue
                reason = f"its oldest request waited {waited} ms on the workers that hold it"
            else:
                reason = "no live worker holds it"
            if await self._claim(name, nobody_holds=not held):
                await self.load(name, reason)
                return

    async def load(self, name: str, reason: str = "asked") -> bool:
        """Make room under the budget, load the model, measure it, and make room again if it
        turned out bigger than the budget left. True when it serves the model."""
        await self._make_room(self._budget.to_unload(self._held(), self.resident.get(name, 0)))
        before = resident_bytes()
        started = time.perf_counter()
        try:
            loaded = await self._host.load_on_demand(name)
        except BaseException:
            await self._release(name)
            raise
        seconds = time.perf_counter() - started
        if loaded is not Loaded.SERVING:
            if loaded is Loaded.FAILED:
                self._failed_at[name] = time.monotonic()
            await self._release(name)
            return False
        self._failed_at.pop(name, None)
        size = max(0, resident_bytes() - before)
        self.resident[name] = size
        self._ctx.metrics.observe_load(name, seconds, size)
        log.info(
            "model loaded on demand",
            model=name,
            why=reason,
            load_ms=round(seconds * 1000, 1),
            resident_mib=round(size / MIB, 1),
        )
        await self._make_room(self._budget.to_unload(self._held(), keep=name))
        await self._cool_down(name)
        return True

    async def unload(self, name: str, reason: str) -> None:
        await self._host.unload_model(name, reason)
        self._unloaded_at[name] = time.monotonic()

    # -- demand ---

    async def _hints_from_now(self) -> None:
        """Read hints added from now on (older ones were for loads done or decided)."""
        assert self._hints is not None
        while not cancelling():
            try:
                newest: Any = await self._redis.xrevrange(self._keys.demand, count=1)
            except RETRYABLE as e:
                await self._backoff.failed(e)
                continue
            self._hint_id = text(newest[0][0]) if newest else "0-0"
            return

    async def _wait_for_hints(self) -> None:
        """Until a hint arrives or ``demand_poll_s`` passes (no hints: just the wait)."""
        if self._hints is None:
            await asyncio.sleep(self._poll_s)
            return
        try:
            reply = await self._hints.xread(
                {self._keys.demand: self._hint_id},
                count=64,
                block_ms=max(1, int(self._poll_s * 1000)),
            )
        except RETRYABLE as e:
            await recover(self._hints, e, self._backoff)
            return
        for _, entries in reply or []:
            for entry_id, fields in entries:
                self._hint_id = text(entry_id)
                with contextlib.suppress(ProtocolError):
                    self._hinted.add(decode_hint(fields))

    async def _waiting(self, candidates: Mapping[str, int]) -> dict[str, int]:
        """Of ``candidates``, those with unread entries: name -> how many."""
        now = time.monotonic()
        self._unloaded_at = {
            n: t for n, t in self._unloaded_at.items() if now - t < UNLOADED_RECHECK_S
        }
        # Read directly: models unloaded here just now (requests routed to them since may not
        # be in the snapshot yet), and those the snapshot lacks (none fresh, or one taken
        # before the model was advertised).
        direct = set(self._unloaded_at) & set(candidates)
        unread: dict[str, int] = {}
        seen: set[str] = set()
        snapshot = await read_snapshot(self._redis, self._keys)
        if snapshot is not None and snapshot.fresh(self._ctx.clock.now_ms(), SNAPSHOT_FRESH_MS):
            for row in snapshot.lanes:
                if row.model in candidates and row.model not in direct:
                    unread[row.model] = unread.get(row.model, 0) + row.lag
                    seen.add(row.model)
        direct |= set(candidates) - seen
        if direct:
            backlog = await collect(
                self._redis,
                self._keys,
                self._ctx.clock.now_ms,
                models={n: candidates[n] for n in sorted(direct)},
                detail=False,
            )
            for name, totals in backlog.by_model().items():
                unread[name] = unread.get(name, 0) + totals.lag
        return {name: n for name, n in unread.items() if n > 0}

    async def _holders(self) -> set[str]:
        """Models some other live worker serves (from the advertisements)."""
        ids: Any = await self._redis.zrangebyscore(
            self._keys.workers, self._ctx.clock.now_ms(), "+inf"
        )
        others = [i.decode() for i in ids if i.decode() != self._me]
        if not others:
            return set()
        raw: Any = await self._redis.execute_command(
            "MGET", *(self._keys.worker(i) for i in others)
        )
        held: set[str] = set()
        for item in raw:
            if not item:
                continue
            try:
                info = WorkerInfo.decode(item)
            except ProtocolError:
                continue
            held.update(m.name for m in info.models if m.versions)
        return held

    async def oldest_unread_ms(self, name: str, partitions: int) -> int:
        """How long the model's oldest unread entry (one its group has not read) has waited, in
        Redis-clock ms; 0 when none is unread. One round trip: ``UNREAD_SCRIPT`` once per hash
        slot of its streams (a cluster's partitions may lie on several nodes)."""
        streams = [
            self._keys.stream(name, lane, p)
            for p in range(partitions)
            for lane in LANES_BY_PRIORITY
        ]
        firsts = await self._unread_script.per_key(streams, [GROUP])
        now_ms = self._ctx.clock.now_ms()
        waited = 0
        for first in firsts:
            if first:
                entry_ms = int(text(first).split("-")[0])
                waited = max(waited, now_ms - entry_ms)
        return waited

    # -- claims and the budget -----------------------------------------------------------------

    async def _claim(self, name: str, *, nobody_holds: bool) -> bool:
        args = [self._me, LOAD_CLAIM_MS, "1" if nobody_holds else "0"]
        return bool(await self._claim_script(keys=[self._keys.load_claim(name)], args=args))

    async def _cool_down(self, name: str) -> None:
        """Keep the claim for ``load_after_ms`` more: the time this worker gets to catch up on
        the model's backlog before another worker may add capacity for it."""
        if self._load_after_ms > 0:
            await self._redis.set(self._keys.load_claim(name), self._me, px=self._load_after_ms)
        else:
            await self._release(name)

    async def _release(self, name: str) -> None:
        try:
            await self._redis.delete(self._keys.load_claim(name))
        except RETRYABLE as e:  # it expires on its own
            log.debug("could not release a load claim", model=name, error=str(e))

    def _held(self) -> dict[str, Held]:
        return {
            name: Held(self.resident.get(name, 0), used_at)
            for name, (used_at, _) in self._host.held().items()
        }

    async def _make_room(self, names: list[str]) -> None:
        for name in names:
            await self.unload(name, "budget")

    async def _unload_idle(self) -> None:
        if self._idle_s <= 0:
            return
        now = time.monotonic()
        for name, (used_at, idle) in self._host.held().items():
            if idle and now - used_at >= self._idle_s:
                await self.unload(name, "idle")
