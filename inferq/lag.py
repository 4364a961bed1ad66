"""``inferq lag``: the backlog of every model's request streams, like
``kafka-consumer-groups --describe``. ``runtime.lag.collect`` reads it; this module is the one
that formats it (the table, the JSON document, the notes and warnings) and runs the command.

One row per model and lane (``{ns}:stream:{model}:{high|normal|low}``, consumer group
``workers``), and per partition with a total row where a model has several:

- LENGTH: ``XLEN``, every entry still in the stream, read or not (workers trim what was
  delivered and acknowledged).
- LAG: entries no worker has read yet (``XINFO GROUPS``); ``~`` marks a figure Redis could not
  give and that was worked out another way (``runtime.lag.LagSource``).
- PENDING: entries read by a worker and not yet acknowledged: queued in a worker's batcher,
  running, being written, or held by a worker that died.
- BACKLOG: LAG + PENDING, the work still to do. ``--fail-above N`` exits with ``EXIT_BACKLOG`` (3)
  when any model's backlog, summed over its lanes, is above N.
- CONSUMERS: live workers in the group (heartbeat current; the JSON output also counts the
  consumers of gone workers, ``consumers_registered``).
- OLDEST-PENDING: how long ago the oldest pending entry was enqueued (Redis clock).
- DRAIN/s and ETA: from two samples (``DrainEstimator``): entries the group read per second, and
  the backlog divided by how fast it shrinks (reads minus arrivals).

Below the table, the batches in flight (not yet final) and their lines not yet answered
(``protocol.batches``), when there are any; the JSON output carries them under ``batches``.

Above the table, a warning when Redis's ``maxmemory-policy`` may evict inferq's keys (any
``allkeys-*`` or ``volatile-*``: accepted requests, job records and results can vanish); the JSON
output carries the policy under ``redis``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TextIO

from redis.exceptions import RedisError

from protocol.argtypes import non_negative_float, non_negative_int, positive_float
from protocol.exits import EXIT_BACKLOG, EXIT_OK, EXIT_REDIS, EXIT_USAGE
from protocol.keys import GROUP, Keys, Lane
from runtime.eviction import is_evicting, read_policy, warning
from runtime.lag import Backlog, Drain, DrainEstimator, LagError, LaneLag, collect
from runtime.settings import connection_flags

DEFAULT_SAMPLE_S = 1.0


@dataclass(frozen=True, slots=True)
class BatchBacklog:
    """Batches not yet final, and their input lines not yet answered."""

    in_flight: int = 0
    lines_pending: int = 0


async def batch_backlog(redis: Any, keys: Keys) -> BatchBacklog:
    """One SMEMBERS and one pipeline: each active batch's total and answers so far."""
    active = [m.decode() for m in await redis.smembers(keys.batches_active)]
    if not active:
        return BatchBacklog()
    pipe = redis.pipeline(transaction=False)
    for batch_id in active:
        pipe.hget(keys.batch(batch_id), "total")
        pipe.hlen(keys.batch(batch_id, "output"))
        pipe.hlen(keys.batch(batch_id, "errors"))
    replies = await pipe.execute()
    pending = 0
    for i in range(0, len(replies), 3):
        total, completed, failed = replies[i : i + 3]
        pending += max(0, int(total or 0) - int(completed) - int(failed))
    return BatchBacklog(len(active), pending)


def format_duration(ms: float | None) -> str:
    if ms is None:
        return "-"
    if ms < 1000:
        return f"{ms:.0f}ms"
    s = ms / 1000
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def _eta(lane: LaneLag, drain: Drain | None) -> str:
    if drain is None or lane.backlog == 0:
        return "-"
    if drain.eta_s is not None:
        return format_duration(drain.eta_s * 1000)
    return "stalled" if drain.read_per_s == 0 else "growing"


COLUMNS = (
    "MODEL",
    "LANE",
    "LENGTH",
    "LAG",
    "PENDING",
    "BACKLOG",
    "CONSUMERS",
    "OLDEST-PENDING",
    "DRAIN/s",
    "ETA",
)


def render_table(
    namespace: str,
    backlog: Backlog,
    drains: Mapping[tuple[str, Lane, int], Drain],
    *,
    threshold: int | None = None,
    policy: str | None = None,
    batches: BatchBacklog | None = None,
) -> str:
    """The terminal view: one row per model and lane (per partition, with a PART column and a
    total row per model, when a model has several), then notes (and a warning first when
    Redis's ``maxmemory-policy`` may evict inferq's keys)."""
    alarm = f"WARNING: {warning(policy)}\n" if policy and is_evicting(policy) else ""
    lanes = backlog.lanes
    batch_note = (
        f"batches: {batches.in_flight} in flight, {batches.lines_pending} lines pending\n"
        if batches is not None and batches.in_flight
        else ""
    )
    if not lanes:
        return (
            alarm
            + batch_note
            + (
                f"no models in namespace '{namespace}' (no {namespace}:models hash and no "
                f"{namespace}:stream:* keys): check --namespace and --redis\n"
            )
        )
    partitioned = {lane.model for lane in lanes if lane.partition > 0}
    columns: tuple[str, ...] = COLUMNS if not partitioned else (COLUMNS[0], "PART", *COLUMNS[1:])
    rows: list[tuple[str, ...]] = [columns]
    totals = backlog.by_model()
    for i, lane in enumerate(lanes):
        drain = drains.get((lane.model, lane.lane, lane.partition))
        row: tuple[str, ...] = (
            lane.model,
            lane.lane.value,
            str(lane.length),
            ("" if lane.lag_exact else "~") + str(lane.lag),
            str(lane.pending),
            str(lane.backlog),
            str(lane.consumers),
            format_duration(lane.oldest_pending_ms),
            "-" if drain is None else f"{drain.read_per_s:.1f}",
            _eta(lane, drain),
        )
        if partitioned:
            row = (row[0], str(lane.partition), *row[1:])
        rows.append(row)
        last_of_model = i + 1 == len(lanes) or lanes[i + 1].model != lane.model
        if last_of_model and lane.model in partitioned:
            m = totals[lane.model]
            rows.append(
                (
                    lane.model,
                    "all",
                    "total",
                    str(m.length),
                    ("" if m.lag_exact else "~") + str(m.lag),
                    str(m.pending),
                    str(m.backlog),
                    str(m.consumers),
                    format_duration(m.oldest_pending_ms),
                    "",
                    "",
                )
            )
    left = 3 if partitioned else 2
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    lines = [
        "  ".join(
            cell.ljust(w) if i < left else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]
    sampled = datetime.fromtimestamp(lanes[0].sampled_ms / 1000, UTC)
    head = f"namespace {namespace}  group {GROUP}  at {sampled:%Y-%m-%d %H:%M:%S} UTC (Redis clock)"
    notes = []
    estimated = sorted(
        {
            f"{r.model}/{r.lane.value}{f'/{r.partition}' if r.partition else ''} ({r.lag_source})"
            for r in lanes
            if not r.lag_exact
        }
    )
    if estimated:
        notes.append(
            "~ lag estimated (Redis gave none: entries were deleted mid-stream): "
            + ", ".join(estimated)
        )
    letters = {m: n for m, n in backlog.dead_letters.items() if n}
    if letters:
        notes.append(
            "dead letters: "
            + ", ".join(f"{m} {n} ({Keys(namespace).dlq(m)})" for m, n in letters.items())
        )
    for model in backlog.above(threshold):
        m = totals[model]
        notes.append(
            f"backlog above {threshold}: {model} has {m.backlog} "
            f"(lag {m.lag} + pending {m.pending})"
        )
    return alarm + "\n".join([head, *lines, *notes]) + "\n" + batch_note


def to_json(
    namespace: str,
    backlog: Backlog,
    drains: Mapping[tuple[str, Lane, int], Drain],
    *,
    threshold: int | None = None,
    policy: str | None = None,
    batches: BatchBacklog | None = None,
) -> dict[str, Any]:
    """The ``--json`` document (one per refresh, one line each with ``--watch``)."""
    out_lanes = []
    for lane in backlog.lanes:
        drain = drains.get((lane.model, lane.lane, lane.partition))
        out_lanes.append(
            {
                "model": lane.model,
                "lane": lane.lane.value,
                "partition": lane.partition,
                "stream": lane.stream,
                "length": lane.length,
                "lag": lane.lag,
                "lag_exact": lane.lag_exact,
                "lag_source": lane.lag_source.value,
                "pending": lane.pending,
                "backlog": lane.backlog,
                "consumers": lane.consumers,
                "consumers_registered": lane.consumers_registered,
                "oldest_pending_ms": lane.oldest_pending_ms,
                "entries_read": lane.entries_read,
                "drain_per_s": None if drain is None else drain.read_per_s,
                "arrival_per_s": None if drain is None else drain.arrival_per_s,
                "eta_s": None if drain is None else drain.eta_s,
            }
        )
    return {
        "namespace": namespace,
        "group": GROUP,
        "redis_time_ms": backlog.sampled_ms,
        "lanes": out_lanes,
        "models": [
            {
                "model": model,
                "length": m.length,
                "lag": m.lag,
                "lag_exact": m.lag_exact,
                "pending": m.pending,
                "backlog": m.backlog,
                "consumers": m.consumers,
                "oldest_pending_ms": m.oldest_pending_ms,
                "dead_letters": backlog.dead_letters.get(model, 0),
            }
            for model, m in backlog.by_model().items()
        ],
        "batches": {
            "in_flight": batches.in_flight if batches else 0,
            "lines_pending": batches.lines_pending if batches else 0,
        },
        "fail_above": threshold,
        "above": backlog.above(threshold),
        "redis": {
            "maxmemory_policy": policy,
            "evicting": bool(policy and is_evicting(policy)),
            "warning": warning(policy) if policy and is_evicting(policy) else None,
        },
    }


# -- the subcommand --------------------------------------------------------------------------


def add_parser(subparsers: Any, environ: Mapping[str, str]) -> None:
    """Add ``lag`` to ``inferq``'s subcommands (``subparsers`` from ``add_subparsers``)."""
    parser = subparsers.add_parser(
        "lag",
        help="show each model's queue backlog (lag, pending, consumers, drain rate)",
        description="Per model and priority lane: stream length, consumer-group lag (entries "
        "no worker has read), pending (read, not yet acknowledged), live consumers, age of the "
        "oldest pending entry, drain rate and estimated time to drain. Exit status: 0 ok, "
        f"{EXIT_USAGE} usage, {EXIT_BACKLOG} a backlog above --fail-above, {EXIT_REDIS} Redis "
        "unreachable.",
    )
    connection_flags(parser, environ)
    parser.add_argument(
        "--watch",
        type=positive_float,
        metavar="SECONDS",
        help="refresh every SECONDS until Ctrl-C (drain rates come from consecutive refreshes)",
    )
    parser.add_argument(
        "--count",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="with --watch: stop after N refreshes (default: 0, until Ctrl-C)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print JSON (one document per line with --watch) instead of a table",
    )
    parser.add_argument(
        "--fail-above",
        type=non_negative_int,
        metavar="N",
        help=f"exit {EXIT_BACKLOG} if any model's backlog (lag + pending, summed over its "
        "lanes) is above N; not with --watch",
    )
    parser.add_argument(
        "--sample-s",
        type=non_negative_float,
        default=DEFAULT_SAMPLE_S,
        metavar="SECONDS",
        help="without --watch: seconds between the two samples that measure the drain rate "
        f"(default: {DEFAULT_SAMPLE_S}; 0 takes one sample and shows no rate)",
    )


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run ``inferq lag`` with parsed arguments; returns the exit status."""
    out = sys.stdout if out is None else out
    if args.fail_above is not None and args.watch:
        print("inferq lag: --fail-above is a one-shot check; drop --watch", file=sys.stderr)
        return EXIT_USAGE
    try:
        return asyncio.run(_main(args, out))
    except KeyboardInterrupt:
        return EXIT_OK


async def _main(args: argparse.Namespace, out: TextIO) -> int:
    from runtime.broker import connect
    from runtime.connections import RedisSettings, redact

    keys = Keys(args.namespace)
    broker = await connect(RedisSettings(url=args.redis_url), name="inferq-lag")
    client = broker.commands
    estimator = DrainEstimator()
    interactive = bool(args.watch) and not args.json and out.isatty()
    refreshes = 0
    status = EXIT_OK
    try:
        while True:
            backlog = await collect(client, keys)
            drains = estimator.update(backlog.lanes)
            if not args.watch and args.sample_s > 0 and backlog.lanes:
                await asyncio.sleep(args.sample_s)
                backlog = await collect(client, keys, models=backlog.partitions)
                drains = estimator.update(backlog.lanes)
            policy = await read_policy(client)
            batches = await batch_backlog(client, keys)
            view = {"threshold": args.fail_above, "policy": policy, "batches": batches}
            if args.json:
                doc = to_json(args.namespace, backlog, drains, **view)
                out.write(json.dumps(doc, separators=(",", ":")) + "\n")
            else:
                table = render_table(args.namespace, backlog, drains, **view)
                out.write(("\x1b[H\x1b[2J" if interactive else "") + table)
                if args.watch and not interactive:
                    out.write("\n")
            out.flush()
            if not backlog.lanes:
                print(
                    f"inferq lag: no models found in namespace '{args.namespace}'",
                    file=sys.stderr,
                )
            if backlog.above(args.fail_above):
                status = EXIT_BACKLOG
            refreshes += 1
            if not args.watch or (args.count and refreshes >= args.count):
                return status
            await asyncio.sleep(args.watch)
    except (RedisError, OSError) as e:
        print(f"inferq lag: Redis at {redact(args.redis_url)} failed: {e}", file=sys.stderr)
        return EXIT_REDIS
    except LagError as e:
        print(f"inferq lag: {e}", file=sys.stderr)
        return EXIT_REDIS
    finally:
        await broker.aclose()
