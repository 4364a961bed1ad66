"""Webhooks: a job or batch that asked for one has each of its changes POSTed to a URL, signed.

At submission ``asked`` finds what the request asks for (``webhook`` and ``webhook_events`` in
its ``parameters``, else the ``Inferq-Webhook`` and ``Inferq-Webhook-Events`` headers) and
``WebhookPolicy.check`` refuses, with a 400, a gateway without a secret, a malformed URL, an
unknown event, or an address the SSRF guard refuses (``producer.egress``).

``WebhookDeliverer`` is one of the gateway's loops. It reads the events stream in the consumer
group ``WEBHOOK_GROUP`` (each entry handled by one gateway), woken by the reply listener's one
events reader (``EventFanout.tap``), so it holds no blocking connection of its own. For an entry
about a watched object with a webhook, it claims the deliveries the object's states call for
(``protocol.webhooks.CLAIM_SCRIPT``: a status announced twice is delivered once) and POSTs each,
in order, with httpx on the gateway's loop, at most ``--webhook-concurrency`` at once. The body
is the object's document as GET shows it (JSON only), signed the Standard Webhooks way with the
``standardwebhooks`` library; ``webhook-id`` is the same on every attempt. A failed attempt is
retried after ``--webhook-retry-s``, doubling up to ``RETRY_CAP_S``; after
``--webhook-max-attempts`` the delivery becomes a dead letter (``inferq dlq list``). The entry
is acknowledged once all its deliveries are done, so delivery is at least once: the entries of
a gateway that died are taken over (``XAUTOCLAIM``) once idle ``--webhook-reclaim-s``, and a
gateway that stops hands its own back at once. Docs: docs/webhooks.md.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import heapq
import itertools
import json
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
import structlog
from redis.exceptions import ResponseError
from standardwebhooks import Webhook as Signer

import runtime
from producer.egress import EgressPolicy, GuardedTransport, Refused, checked_url
from producer.errors import BadRequest
from producer.events import Fields, Watchers, Webhook
from producer.metrics import WebhookMetrics
from producer.settings import GatewaySettings
from protocol.keys import DLQ_MAXLEN, WEBHOOK_GROUP, Keys, text
from protocol.webhooks import CLAIM_SCRIPT, WebhookDeadLetter, webhook_id
from runtime.aio import cancelling
from runtime.backoff import Backoff
from runtime.broker import Broker
from runtime.connections import RedisClock
from runtime.faults import RETRYABLE, Fault, classify

log = structlog.get_logger("inferq.gateway")

RETRY_CAP_S = 300.0
"""The longest wait between two attempts of one delivery."""
READ_COUNT = 100
MAX_HELD = 2_000
"""Events one gateway holds (read, not done with) before it stops reading more."""
REDIS_RETRY_S = 1.0
"""A delivery whose Redis step failed is tried again this much later (not counted as an
attempt)."""
RESPONSE_READ_LIMIT = 64 * 1024
"""Bytes of a receiver's answer read (then the connection is dropped, not the gateway's
memory)."""
RESOLVE_TIMEOUT_S = 5.0
PRUNE_MS = 3_600_000
"""A consumer of the group (a gateway) that holds nothing and has not read for this long is
removed from it."""


@dataclass(frozen=True, slots=True)
class WebhookAsk:
    """What a submission asks for, as sent (``WebhookPolicy.check`` validates it)."""

    url: object
    events: object | None


def asked(parameters: Mapping[str, object], headers: Mapping[str, str]) -> WebhookAsk | None:
    """The webhook a submission asks for: its ``parameters`` first, else its headers."""
    if parameters.get("webhook") is not None:
        return WebhookAsk(parameters["webhook"], parameters.get("webhook_events"))
    url = headers.get("inferq-webhook")
    if url is not None:
        return WebhookAsk(url, headers.get("inferq-webhook-events"))
    if parameters.get("webhook_events") is not None or "inferq-webhook-events" in headers:
        raise BadRequest("'webhook_events' needs a 'webhook' (the URL to call)")
    return None


def parse_events(
    raw: object | None, allowed: Collection[str], default: frozenset[str]
) -> frozenset[str]:
    """``webhook_events``: a comma-separated string or a JSON list (as a list, or as its text in
    a header) of names in ``allowed``; ``default`` when absent."""
    if raw is None:
        return default
    names: object = raw
    if isinstance(raw, str):
        stripped = raw.strip()
        if stripped.startswith("["):
            try:
                names = json.loads(stripped)
            except ValueError:
                raise BadRequest(f"'webhook_events' is not a valid JSON list: {raw!r}") from None
        else:
            names = [n.strip() for n in stripped.split(",") if n.strip()]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise BadRequest("'webhook_events' must be a list of event names, or them comma-separated")
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        choices = ", ".join(sorted(allowed))
        raise BadRequest(f"unknown webhook event(s) {', '.join(unknown)}; choose from {choices}")
    if not names:
        raise BadRequest("'webhook_events' names no event")
    return frozenset(names)


class WebhookPolicy:
    """Whether a submission may have the webhook it asks for (``check``)."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.enabled = settings.webhook_secret is not None
        self.egress = EgressPolicy.of(settings.webhook_allow)
        self._resolve_timeout_s = min(settings.webhook_timeout_s, RESOLVE_TIMEOUT_S)

    async def check(
        self, ask: WebhookAsk, allowed: Collection[str], default: frozenset[str]
    ) -> Webhook:
        """The webhook, or BadRequest saying why not. ``allowed``: the event names of this kind
        of object; ``default``: the events told when the request names none."""
        if not self.enabled:
            raise BadRequest(
                "this gateway sends no webhooks: it was started without a signing secret "
                "(INFERQ_WEBHOOK_SECRET)"
            )
        if not isinstance(ask.url, str) or not ask.url.strip():
            raise BadRequest("'webhook' must be a URL (a string)")
        events = parse_events(ask.events, allowed, default)
        try:
            url = checked_url(ask.url.strip())
            host = url.raw_host.decode("ascii")
            await self.egress.resolve(
                host, url.port or (443 if url.scheme == "https" else 80), self._resolve_timeout_s
            )
        except Refused as e:
            raise BadRequest(str(e)) from None
        except (OSError, TimeoutError) as e:
            raise BadRequest(f"the webhook host {url.host} does not resolve ({e})") from None
        return Webhook(str(url), events)


def retry_delay_s(attempts: int, first_s: float) -> float:
    """The wait after a delivery's ``attempts``-th failed attempt: ``first_s``, doubling, at
    most ``RETRY_CAP_S``."""
    return float(min(RETRY_CAP_S, first_s * 2 ** min(attempts - 1, 32)))


@dataclass(slots=True, eq=False)
class Delivery:
    """One status of one object, to one URL; the events entry that claimed it."""

    entry_id: str
    kind: str
    object_id: str
    status: str
    url: str
    body: bytes
    event_ms: int
    """When the change was announced (the entry's time, Redis clock): the lag's start."""
    attempts: int = 0
    given_up: str | None = None
    """Why it is being dead-lettered (the write is retried if Redis refuses it)."""

    @property
    def webhook_id(self) -> str:
        return webhook_id(self.kind, self.object_id, self.status)


@dataclass(frozen=True, slots=True)
class Opening:
    """An events entry to look at: which deliveries, if any, it calls for."""

    entry_id: str
    fields: Fields


@dataclass(slots=True)
class _Held:
    """An events entry this gateway holds: its deliveries still to do, in order."""

    deliveries: collections.deque[Delivery] = field(default_factory=collections.deque)


Work = Delivery | Opening


class WebhookDeliverer:
    def __init__(
        self,
        settings: GatewaySettings,
        broker: Broker,
        keys: Keys,
        watched: Watchers,
        clock: RedisClock,
        metrics: WebhookMetrics,
        backoff: Backoff,
        egress: EgressPolicy,
    ) -> None:
        assert settings.webhook_secret is not None, "webhooks need a signing secret"
        self._settings = settings
        self._signer = Signer(settings.webhook_secret)
        self._redis = broker.commands
        self._claim = broker.script(CLAIM_SCRIPT)
        self._keys = keys
        self._stream = keys.job_events
        self._watched = watched
        self._clock = clock
        self._metrics = metrics
        self._backoff = backoff
        self.consumer = settings.gateway_id
        self._egress = egress
        self._held: dict[str, _Held] = {}
        self._work: asyncio.Queue[Work] = asyncio.Queue()
        self._later: list[tuple[float, int, Work]] = []
        self._order = itertools.count()
        self._acks: list[str] = []
        self._wake = asyncio.Event()
        self._group_made = False
        self._group_lost = False
        self._cursor = "0-0"
        self._client: httpx.AsyncClient | None = None
        metrics.held.set_function(self._holding)

    def wake(self) -> None:
        """New events were read (``EventFanout.tap``): read the group now."""
        self._wake.set()

    def _holding(self) -> float:
        return float(sum(len(h.deliveries) for h in self._held.values()))

    # -- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        """Read, take over and acknowledge events; ``--webhook-concurrency`` senders deliver.
        Redis errors are retried with backoff; a bug ends it (and the gateway)."""
        s = self._settings
        limits = httpx.Limits(
            max_connections=s.webhook_concurrency, max_keepalive_connections=s.webhook_concurrency
        )
        transport = GuardedTransport(self._egress, limits)
        async with httpx.AsyncClient(
            transport=transport, timeout=s.webhook_timeout_s, follow_redirects=False
        ) as client:
            self._client = client
            async with asyncio.TaskGroup() as senders:
                for i in range(s.webhook_concurrency):
                    senders.create_task(self._send_loop(), name=f"webhook-sender-{i}")
                await self._read_loop()

    async def _read_loop(self) -> None:
        tick_s = self._settings.webhook_reclaim_s / 3
        next_tick = 0.0
        while not cancelling():
            now = time.monotonic()
            try:
                if not self._group_made:
                    await self._make_group()
                if now >= next_tick:
                    await self._tick()
                    next_tick = now + tick_s
                self._release(now)
                await self._acknowledge()
                self._wake.clear()
                read = await self._read() if len(self._held) < MAX_HELD else 0
            except RETRYABLE as e:
                if classify(e) is Fault.MISSING:
                    # The stream or the group vanished (Redis restarted empty, or evicted it):
                    # make it again, reading the new stream from its start.
                    self._group_made, self._group_lost = False, True
                await self._backoff.failed(e)
                continue
            self._backoff.succeeded()
            if read:
                continue
            due = min([next_tick, *(t for t, _, _ in self._later[:1])])
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, due - time.monotonic())):
                    await self._wake.wait()

    async def _make_group(self) -> None:
        start = "0" if self._group_lost else "$"
        try:
            await self._redis.xgroup_create(self._stream, WEBHOOK_GROUP, id=start, mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._group_made = True

    async def _read(self) -> int:
        """Read new entries for this gateway; how many."""
        reply: Any = await self._redis.xreadgroup(
            WEBHOOK_GROUP, self.consumer, {self._stream: ">"}, count=READ_COUNT
        )
        entries = [e for _, stream_entries in reply or [] for e in stream_entries]
        self._take(entries)
        return len(entries)

    def _take(self, entries: list[tuple[Any, Any]]) -> None:
        for raw_id, fields in entries:
            entry_id = text(raw_id)
            if entry_id in self._held:
                continue  # already ours (a takeover found our own entry idle)
            self._held[entry_id] = _Held()
            self._work.put_nowait(Opening(entry_id, fields or {}))

    def _release(self, now: float) -> None:
        """Hand the deliveries whose retry is due to the senders."""
        while self._later and self._later[0][0] <= now:
            self._work.put_nowait(heapq.heappop(self._later)[2])

    def _retry_at(self, delay_s: float, work: Work) -> None:
        heapq.heappush(self._later, (time.monotonic() + delay_s, next(self._order), work))
        self.wake()  # the loop recomputes when it next has something to do

    async def _acknowledge(self) -> None:
        if self._acks:
            acks = list(self._acks)
            await self._redis.xack(self._stream, WEBHOOK_GROUP, *acks)
            del self._acks[: len(acks)]

    async def _tick(self) -> None:
        """Renew what this gateway holds (so nobody takes it over), take over what a dead
        gateway held, read the group's lag for the gauges, and forget long-gone gateways."""
        held: list[Any] = list(self._held)
        for i in range(0, len(held), 1000):
            await self._redis.xclaim(
                self._stream,
                WEBHOOK_GROUP,
                self.consumer,
                0,
                held[i : i + 1000],
                justid=True,
            )
        idle_ms = int(self._settings.webhook_reclaim_s * 1000)
        reply = await self._redis.xautoclaim(
            self._stream, WEBHOOK_GROUP, self.consumer, idle_ms, self._cursor, count=READ_COUNT
        )
        cursor, entries = text(reply[0]), reply[1]
        deleted = [text(i) for i in reply[2]] if len(reply) > 2 else []
        self._cursor = cursor
        if entries:
            log.info("webhook events taken over from a gateway gone quiet", count=len(entries))
        self._take(entries)
        if deleted:
            # Trimmed from the events stream while a gateway that died held them: what they
            # announced is unknown now.
            log.warning("webhook events lost: trimmed while pending", count=len(deleted))
            self._acks.extend(deleted)
        for group in await self._redis.xinfo_groups(self._stream):
            if text(group["name"]) == WEBHOOK_GROUP:
                self._metrics.backlog.set(group.get("lag") or 0)
                self._metrics.pending.set(group.get("pending") or 0)
        for consumer in await self._redis.xinfo_consumers(self._stream, WEBHOOK_GROUP):
            # Gateways that died and whose entries were taken over: forget them.
            name = text(consumer["name"])
            if name != self.consumer and not consumer["pending"] and consumer["idle"] > PRUNE_MS:
                await self._redis.xgroup_delconsumer(self._stream, WEBHOOK_GROUP, name)

    async def release(self) -> None:
        """On stop: mark what this gateway holds as idle long enough for any gateway to take
        over at its next tick, instead of after ``--webhook-reclaim-s``; drop this consumer
        from the group when it holds nothing."""
        held: list[Any] = list(self._held)
        idle_ms = int(self._settings.webhook_reclaim_s * 1000)
        with contextlib.suppress(*RETRYABLE):
            if held:
                await self._redis.xclaim(
                    self._stream,
                    WEBHOOK_GROUP,
                    self.consumer,
                    0,
                    held,
                    idle=idle_ms,
                    justid=True,
                )
                log.info("webhook deliveries handed to the other gateways", count=len(held))
            else:
                await self._redis.xgroup_delconsumer(self._stream, WEBHOOK_GROUP, self.consumer)

    # -- the senders -----------------------------------------------------------------------

    async def _send_loop(self) -> None:
        while not cancelling():  # a cancellation mid-command can come back as a Redis error
            work = await self._work.get()
            try:
                if isinstance(work, Opening):
                    await self._open(work)
                else:
                    await self._attempt(work)
            except RETRYABLE as e:
                self._backoff.record(e)
                self._retry_at(REDIS_RETRY_S, work)

    async def _open(self, opening: Opening) -> None:
        """Claim the deliveries an entry calls for and start the first; or let it go."""
        entry_id = opening.entry_id
        found = self._watched.announced(opening.fields)
        state = await found[0].state(found[1]) if found is not None else None
        if found is None or state is None or state.webhook is None:
            self._done(entry_id)
            return
        watched, object_id = found
        kind, webhook = text(watched.field), state.webhook
        wanted = [s for s in state.chain if s.status in webhook.events]
        mine: set[str] = set()
        if wanted:
            claimed = await self._claim(
                keys=[self._keys.webhook_sent(kind, object_id)],
                args=[
                    entry_id,
                    self._settings.job_ttl_s * 1000,
                    *(s.status for s in wanted),
                ],
            )
            mine = {text(s) for s in claimed}
        held = self._held[entry_id]
        event_ms = int(entry_id.partition("-")[0])
        for s in wanted:
            if s.status in mine:
                body = json.dumps(s.body, separators=(",", ":")).encode()
                delivery = Delivery(
                    entry_id, kind, object_id, s.status, webhook.url, body, event_ms
                )
                held.deliveries.append(delivery)
        if held.deliveries:
            self._work.put_nowait(held.deliveries[0])
        else:
            self._done(entry_id)

    async def _attempt(self, d: Delivery) -> None:
        if d.given_up is None:
            d.attempts += 1
            if d.attempts > 1:
                self._metrics.retries.labels(d.kind).inc()
            failure = await self._post(d)
            if failure is None:
                lag_s = max(0.0, (self._clock.now_ms() - d.event_ms) / 1000)
                self._metrics.deliveries.labels(d.kind, d.status).inc()
                self._metrics.lag.labels(d.kind).observe(lag_s)
                self._finished(d)
                return
            reason, why = failure
            self._metrics.failed(d.kind, reason)
            if reason != "refused" and d.attempts < self._settings.webhook_max_attempts:
                delay = retry_delay_s(d.attempts, self._settings.webhook_retry_s)
                log.info(
                    "webhook attempt failed; retrying",
                    webhook_id=d.webhook_id,
                    attempt=d.attempts,
                    error=why,
                    retry_in_s=delay,
                )
                self._retry_at(delay, d)
                return
            d.given_up = why
        letter = WebhookDeadLetter(
            d.kind, d.object_id, d.status, d.url, d.attempts, d.given_up, d.entry_id
        )
        fields: Any = letter.to_fields()
        await self._redis.xadd(self._keys.webhook_dlq, fields, maxlen=DLQ_MAXLEN, approximate=True)
        self._metrics.dead_letters.labels(d.kind).inc()
        log.warning(
            "webhook given up: dead-lettered (inferq dlq list)",
            webhook_id=d.webhook_id,
            attempts=d.attempts,
            error=d.given_up,
        )
        self._finished(d)

    async def _post(self, d: Delivery) -> tuple[str, str] | None:
        """One attempt: None when the receiver answered 2xx, else (reason label, message)."""
        assert self._client is not None
        now = datetime.now(tz=UTC)
        headers = {
            "content-type": "application/json",
            "user-agent": f"inferq/{runtime.__version__}",
            "webhook-id": d.webhook_id,
            "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": self._signer.sign(d.webhook_id, now, d.body.decode()),
            "inferq-event": d.status,
        }
        try:
            async with self._client.stream("POST", d.url, content=d.body, headers=headers) as r:
                status = r.status_code
                read = 0
                async for chunk in r.aiter_raw():
                    read += len(chunk)
                    if read >= RESPONSE_READ_LIMIT:
                        break
        except Refused as e:
            return "refused", str(e)
        except httpx.TimeoutException as e:
            return "timeout", f"no answer within {self._settings.webhook_timeout_s} s ({e!r})"
        except httpx.HTTPError as e:
            return "connect", f"{type(e).__name__}: {e}"
        if 200 <= status < 300:
            return None
        reason = (
            "http_4xx" if 400 <= status < 500 else "http_5xx" if status >= 500 else "http_other"
        )
        return reason, f"the receiver answered HTTP {status}"

    def _finished(self, d: Delivery) -> None:
        """One delivery is done (delivered or dead-lettered): start the entry's next, or let
        the entry go."""
        held = self._held.get(d.entry_id)
        if held is None:
            return
        if held.deliveries and held.deliveries[0] is d:
            held.deliveries.popleft()
        if held.deliveries:
            self._work.put_nowait(held.deliveries[0])
        else:
            self._done(d.entry_id)

    def _done(self, entry_id: str) -> None:
        self._held.pop(entry_id, None)
        self._acks.append(entry_id)
        self.wake()
