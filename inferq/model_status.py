"""``inferq models list|status``: each model's versions, traffic split, and which workers serve
which version (with the last load error, if any), read from Redis.

What it shows is what the gateways route by: the committed policy (``POST
/v2/repository/models/{m}/load``) where there is one, else the live workers' own advertisement
of their repository config. A committed policy the workers could not serve (a version it names
has no folder) is shown with the fallback: the model serves its repository config until a new
load or ``inferq models reset`` (``inferq.models_cli``). Only live workers are listed; a status
line left by a worker that has gone is not shown.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO, cast

import redis
import redis.asyncio as aioredis

from producer.registry import ModelEntry, merge, parse_snapshot, queue_snapshot, status_lines
from protocol.control import LoadReport
from protocol.exits import EXIT_NOT_FOUND, EXIT_OK, EXIT_REDIS
from protocol.keys import Keys
from runtime.broker import connect
from runtime.connections import RedisSettings, redact
from runtime.settings import connection_flags


@dataclass(frozen=True)
class ModelView:
    name: str
    entry: ModelEntry
    workers: list[LoadReport]
    """One line per live worker serving the model."""

    @property
    def state(self) -> str:
        if self.entry.unloaded:
            return "UNLOADED"
        if not self.entry.workers:
            return "UNAVAILABLE"
        if self.entry.fallback:
            return "READY (config fallback)"
        if any(not w.ok for w in self.workers):
            return "READY (last load failed)"
        return "READY"

    def to_json(self) -> dict[str, Any]:
        policy = self.entry.policy
        return {
            "name": self.name,
            "state": self.state,
            "versions": list(self.entry.metadata.versions),
            "traffic": self.entry.traffic,
            "policy_generation": policy.generation if policy else 0,
            "policy": "admin" if policy else "repository config",
            "fallback": self.entry.fallback,
            "workers": [
                {
                    "worker": w.worker,
                    "versions": list(w.versions),
                    "ok": w.ok,
                    "error": w.error,
                    "generation": w.generation,
                    "updated_ms": w.updated_ms,
                    "fallback": w.fallback,
                }
                for w in self.workers
            ],
        }


async def snapshot(r: aioredis.Redis, keys: Keys, now_ms: int | None = None) -> list[ModelView]:
    """Every known model as the gateways see it (the same reads and merge as their registry),
    with its live workers' status lines."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    ids = cast(list[bytes], await r.zrangebyscore(keys.workers, now_ms, "+inf"))
    pipe = r.pipeline(transaction=False)
    queue_snapshot(pipe, keys, ids)
    workers, known, policies = parse_snapshot(ids, await pipe.execute())
    entries = merge(workers, known, policies)
    names = sorted(entries)
    pipe = r.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(keys.model_status(name))
    return [
        ModelView(name, entries[name], status_lines(raw, name, workers))
        for name, raw in zip(names, await pipe.execute(), strict=True)
    ]


def _traffic(entry: ModelEntry) -> str:
    if entry.unloaded:
        return "-"
    return ", ".join(f"{v}: {share:.0%}" for v, share in entry.traffic.items()) or "-"


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def render_list(views: Sequence[ModelView]) -> str:
    rows = [("MODEL", "VERSIONS", "TRAFFIC", "WORKERS", "POLICY", "STATE")]
    for v in views:
        rows.append(
            (
                v.name,
                ",".join(v.entry.metadata.versions) or "-",
                _traffic(v.entry),
                str(v.entry.workers),
                _policy(v.entry),
                v.state,
            )
        )
    return _table(rows) + "\n"


def _policy(entry: ModelEntry) -> str:
    if entry.policy is None:
        return "config"
    return f"admin (gen {entry.policy.generation}){', fallback' if entry.fallback else ''}"


def render_status(views: Sequence[ModelView]) -> str:
    out = []
    for v in views:
        policy = v.entry.policy
        source = f"admin policy, generation {policy.generation}" if policy else "repository config"
        if policy is not None and v.entry.fallback:
            source = (
                f"the admin policy, generation {policy.generation}, cannot be served: the model "
                "falls back to its repository config; `inferq models reset "
                f"{v.name}` or a new load clears it"
            )
        out.append(
            f"{v.name}: {v.state}; versions {', '.join(v.entry.metadata.versions) or 'none'}; "
            f"traffic {_traffic(v.entry)} ({source})"
        )
        if not v.workers:
            out.append("  no live worker serves it")
            continue
        rows = [("  WORKER", "VERSIONS", "LAST CHANGE", "UPDATED", "ERROR")]
        for w in v.workers:
            updated = time.strftime("%H:%M:%S", time.localtime(w.updated_ms / 1000))
            rows.append(
                (
                    f"  {w.worker}",
                    ",".join(w.versions) or "-",
                    f"gen {w.generation} {'ok' if w.ok else 'FAILED'}",
                    updated,
                    w.error,
                )
            )
        out.append(_table(rows))
        for w in v.workers:
            if w.fallback:
                out.append(f"  {w.worker} falls back to its repository config: {w.fallback}")
    return "\n".join(out) + "\n"


def add_actions(actions: Any, environ: Mapping[str, str]) -> None:
    """``list`` and ``status`` under ``inferq models`` (``actions`` from its add_subparsers)."""
    ls = actions.add_parser(
        "list",
        help="each model: versions, traffic split, live workers",
        description="Each model as the gateways route it: its versions, the traffic split, "
        "whether an administrator's policy or the repository config set it, live workers.",
    )
    st = actions.add_parser(
        "status",
        help="per model, which workers serve which versions, and load errors",
        description="Per model: each live worker's versions, the last change it applied and "
        "the error if that change failed.",
    )
    st.add_argument("models", nargs="*", help="only these models (default: all)")
    ls.set_defaults(models_view="list")
    st.set_defaults(models_view="status")
    for parser in (ls, st):
        connection_flags(parser, environ)
        parser.add_argument("--json", action="store_true", help="machine-readable output")
        parser.set_defaults(models_run=run)


async def _read(settings: RedisSettings, keys: Keys) -> list[ModelView]:
    broker = await connect(settings, name="inferq-models")
    try:
        r = broker.commands
        return await snapshot(r, keys, int((await r.time())[0]) * 1000)
    finally:
        await broker.aclose()


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``inferq models list`` or ``inferq models status``; returns the exit status."""
    out = sys.stdout if out is None else out
    keys = Keys(args.namespace)
    try:
        views = asyncio.run(_read(RedisSettings(url=args.redis_url), keys))
    except (redis.RedisError, OSError) as e:
        print(f"inferq models: Redis at {redact(args.redis_url)} failed: {e}", file=sys.stderr)
        return EXIT_REDIS
    wanted = getattr(args, "models", None) or []
    if wanted:
        missing = sorted(set(wanted) - {v.name for v in views})
        if missing:
            known = ", ".join(v.name for v in views) or "none"
            print(f"inferq models: unknown model {missing[0]!r} (known: {known})", file=sys.stderr)
            return EXIT_NOT_FOUND
        views = [v for v in views if v.name in wanted]
    if args.json:
        out.write(json.dumps([v.to_json() for v in views], indent=2) + "\n")
    elif not views:
        print(f"inferq models: no models known in namespace '{args.namespace}'", file=sys.stderr)
    else:
        out.write(render_list(views) if args.models_view == "list" else render_status(views))
    return EXIT_OK
