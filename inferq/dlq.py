"""``inferq dlq list|show|retry|purge``: inspect and replay dead letters.

Entries land in ``{ns}:dlq:{model}`` when a worker cannot decode them or when they were delivered
``--max-deliveries`` times without completing. Each dead letter keeps the original stream and
entry id, the reason, and the original payload, so it can be replayed unchanged (``retry``) after
the cause is fixed. A replayed request whose deadline has passed would only expire again:
``--extend-deadline-s`` gives it a fresh one.

Webhook deliveries that never got a 2xx land in ``{ns}:webhooks:dlq`` (``protocol.webhooks``);
``--webhooks`` instead of ``--model`` selects them. ``list`` shows both kinds. A webhook's
``retry`` frees its claim and announces its object again, so a gateway delivers it anew, with
the same ``webhook-id`` and the object as it is now.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Mapping
from typing import Any, cast

import redis
import redis.asyncio as aioredis

from protocol.exits import EXIT_NOT_FOUND, EXIT_OK, EXIT_REDIS
from protocol.keys import JOB_EVENTS_MAXLEN, Keys
from protocol.webhooks import WebhookDeadLetter
from runtime import deadletters
from runtime.broker import connect
from runtime.connections import RedisSettings, redact
from runtime.settings import connection_flags


def add_parser(subparsers: Any, environ: Mapping[str, str]) -> None:
    dlq = subparsers.add_parser(
        "dlq",
        help="inspect and replay dead-lettered requests",
        description="Dead letters are requests no worker could run (undecodable, or delivered "
        "too often). List them, show one, replay them on their original stream, or purge them.",
    )
    connection_flags(dlq, environ)
    actions = dlq.add_subparsers(dest="action", required=True, metavar="ACTION")
    ls = actions.add_parser("list", help="dead letters per model, and webhooks; newest last")
    only = ls.add_mutually_exclusive_group()
    only.add_argument("--model", help="only this model")
    only.add_argument("--webhooks", action="store_true", help="only webhook deliveries")
    ls.add_argument("--count", type=int, default=50, help="most entries shown per model")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    show = actions.add_parser("show", help="one dead letter in full")
    _which(show)
    show.add_argument("id", help="the dead letter's id (from list)")
    retry = actions.add_parser(
        "retry", help="replay dead letters on their original streams (webhooks: deliver again)"
    )
    _which(retry)
    retry.add_argument("ids", nargs="*", help="dead letter ids; none with --all")
    retry.add_argument("--all", action="store_true", help="replay every dead letter of the model")
    retry.add_argument(
        "--extend-deadline-s",
        type=float,
        default=0.0,
        help="give each replayed request a fresh deadline this far ahead",
    )
    purge = actions.add_parser("purge", help="delete dead letters")
    _which(purge)
    purge.add_argument("ids", nargs="*", help="dead letter ids; none with --all")
    purge.add_argument("--all", action="store_true", help="delete every dead letter of the model")
    for action in (ls, show, retry, purge):  # `inferq dlq list --redis URL` works too
        connection_flags(action, environ, if_given=True)


def _which(action: argparse.ArgumentParser) -> None:
    which = action.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="the model's dead letters")
    which.add_argument("--webhooks", action="store_true", help="webhook deliveries")


def _describe_webhook(entry_id: bytes, fields: dict[bytes, bytes]) -> dict[str, Any]:
    letter = WebhookDeadLetter.from_fields(fields)
    return {
        "id": entry_id.decode(),
        "kind": letter.kind,
        "object": letter.object_id,
        "event": letter.status,
        "url": letter.url,
        "webhook_id": letter.webhook_id,
        "attempts": letter.attempts,
        "error": letter.error,
    }


async def _models(r: aioredis.Redis, keys: Keys, only: str | None) -> list[str]:
    if only:
        return [only]
    found = [keys.parse_dlq(k.decode()) async for k in r.scan_iter(match=keys.dlq_pattern)]
    return sorted({m for m in found if m is not None})


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_connected(args))


async def _connected(args: argparse.Namespace) -> int:
    keys = Keys(args.namespace)
    settings = RedisSettings(url=args.redis_url, socket_timeout_s=10)
    try:
        broker = await connect(settings, name="inferq-dlq")
        try:
            return await _run(broker.commands, keys, args)
        finally:
            await broker.aclose()
    except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
        print(f"inferq dlq: cannot reach Redis at {redact(args.redis_url)}: {e}", file=sys.stderr)
        return EXIT_REDIS


def _of(args: argparse.Namespace) -> str:
    return "among the webhooks" if args.webhooks else f"for model {args.model}"


async def _selected(
    r: aioredis.Redis, stream: str, args: argparse.Namespace
) -> list[tuple[bytes, Any]]:
    if args.all:
        return cast(list[tuple[bytes, Any]], await r.xrange(stream))
    if not args.ids:
        raise SystemExit("inferq dlq: name dead letter ids, or pass --all")
    entries = []
    for entry_id in args.ids:
        found = cast(list[tuple[bytes, Any]], await r.xrange(stream, entry_id, entry_id))
        if not found:
            raise SystemExit(f"inferq dlq: no dead letter {entry_id} {_of(args)}")
        entries.extend(found)
    return entries


async def _list(r: aioredis.Redis, keys: Keys, args: argparse.Namespace) -> int:
    report: dict[str, dict[str, Any]] = {}
    for model in [] if args.webhooks else await _models(r, keys, args.model):
        stream = keys.dlq(model)
        entries = cast(list[tuple[bytes, Any]], await r.xrevrange(stream, count=args.count))
        report[model] = {
            "total": await r.xlen(stream),
            "entries": [deadletters.describe(i, f) for i, f in reversed(entries)],
        }
    hooks: dict[str, Any] = {"total": 0, "entries": []}
    if not args.model:
        found = cast(list[tuple[bytes, Any]], await r.xrevrange(keys.webhook_dlq, count=args.count))
        hooks = {
            "total": await r.xlen(keys.webhook_dlq),
            "entries": [_describe_webhook(i, f) for i, f in reversed(found)],
        }
    if args.json:  # models as before; the webhooks' with --webhooks
        print(json.dumps(hooks if args.webhooks else report, indent=2))
        return EXIT_OK
    if not report and not hooks["total"]:
        print("no dead letters")
    for model, data in report.items():
        print(f"{model}: {data['total']} dead letter(s)")
        for e in data["entries"]:
            rid = e["request"]["id"] if e["request"] else "(undecodable)"
            print(f"  {e['id']}  request {rid}  from {e['stream']}  {e['reason']}")
    if hooks["total"]:
        print(f"webhooks: {hooks['total']} dead letter(s) (inferq dlq retry --webhooks)")
        for e in hooks["entries"]:
            print(
                f"  {e['id']}  {e['kind']} {e['object']} {e['event']} -> {e['url']}  after "
                f"{e['attempts']} attempt(s): {e['error']}"
            )
    return EXIT_OK


async def _retry_webhooks(
    r: aioredis.Redis, keys: Keys, stream: str, entries: list[tuple[bytes, Any]]
) -> int:
    for entry_id, fields in entries:
        letter = WebhookDeadLetter.from_fields(fields)
        # Free the claim, then announce the object: the gateway that reads the announcement
        # claims the delivery afresh (protocol.webhooks). One key a step: on a cluster they
        # live in different slots.
        await r.hdel(keys.webhook_sent(letter.kind, letter.object_id), letter.status)
        await r.xadd(
            keys.job_events,
            {letter.kind: letter.object_id},
            maxlen=JOB_EVENTS_MAXLEN,
            approximate=True,
        )
        await r.xdel(stream, entry_id)
    print(f"queued {len(entries)} webhook delivery(ies) again")
    return EXIT_OK


async def _run(r: aioredis.Redis, keys: Keys, args: argparse.Namespace) -> int:
    if args.action == "list":
        return await _list(r, keys, args)
    stream = keys.webhook_dlq if args.webhooks else keys.dlq(args.model)
    if args.action == "show":
        found = cast(list[tuple[bytes, Any]], await r.xrange(stream, args.id, args.id))
        if not found:
            print(f"inferq dlq: no dead letter {args.id} {_of(args)}", file=sys.stderr)
            return EXIT_NOT_FOUND
        describe = _describe_webhook if args.webhooks else deadletters.describe
        print(json.dumps(describe(*found[0]), indent=2))
        return EXIT_OK
    entries = await _selected(r, stream, args)
    if args.action == "retry" and args.webhooks:
        return await _retry_webhooks(r, keys, stream, entries)
    if args.action == "retry":
        done = await deadletters.replay(
            r, keys, args.model, entries, extend_deadline_s=args.extend_deadline_s
        )
        for entry_id, why in done.skipped:
            print(f"  {entry_id}: {why}; skipped")
        print(f"replayed {done.replayed} of {len(entries)} dead letter(s) for model {args.model}")
        return EXIT_OK
    deleted = await deadletters.purge(r, stream, entries)
    print(f"purged {deleted} dead letter(s) {_of(args)}")
    return EXIT_OK
