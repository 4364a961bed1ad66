"""``inferq models reset MODEL``: return a model to its repository config's policy, through the
gateway's model-control API (``POST /v2/repository/models/{m}/reset``, the call the console and
any script make too), with the admin token (``--admin-token`` / ``INFERQ_ADMIN_TOKEN``).

The way out when a committed admin policy no longer fits the repository (a version it names was
removed: the model falls back to its config, and ``inferq models status`` says so), or simply to
undo a load: every worker loads what ``config.toml`` names, traffic switches once all have, and
the stored policy is deleted, so workers that start later follow the config too.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from producer.settings import GatewaySettings
from protocol.exits import EXIT_FAILED, EXIT_NOT_FOUND, EXIT_OK, EXIT_USAGE
from protocol.options import add_flags

DEFAULT_URL = "http://127.0.0.1:8000"
TIMEOUT_S = 180.0
"""Longer than the gateway's --admin-load-timeout-s (120 s): the call waits for every load."""


def add_action(actions: Any, environ: Mapping[str, str]) -> None:
    """``reset`` under ``inferq models`` (``actions`` from its add_subparsers)."""
    parser = actions.add_parser(
        "reset",
        help="return a model to its repository config's version policy",
        description="Load the versions the model's config.toml names on every worker, switch "
        "traffic once all have, and delete the administrator's policy (through the gateway's "
        "model-control API).",
    )
    parser.add_argument("model", help="the model to reset")
    parser.add_argument(
        "--url", default=DEFAULT_URL, help=f"the gateway's HTTP address (default {DEFAULT_URL})"
    )
    add_flags(parser, environ, GatewaySettings, only=("admin_token",))
    parser.set_defaults(models_run=run)


def run(args: argparse.Namespace) -> int:
    if not args.admin_token:
        print(
            "inferq models reset: the model-control API needs the admin token: set "
            "INFERQ_ADMIN_TOKEN (or pass --admin-token)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    url = f"{args.url.rstrip('/')}/v2/repository/models/{quote(args.model, safe='')}/reset"
    request = urllib.request.Request(
        url,
        data=b"{}",
        method="POST",
        headers={"authorization": f"Bearer {args.admin_token}", "content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as r:
            answer = json.loads(r.read())
    except urllib.error.HTTPError as e:
        print(f"inferq models reset: {e.code}: {_error(e.read())}", file=sys.stderr)
        return EXIT_NOT_FOUND if e.code == 404 else EXIT_FAILED
    except (urllib.error.URLError, OSError) as e:
        print(f"inferq models reset: no answer from {args.url}: {e}", file=sys.stderr)
        return EXIT_FAILED
    traffic = ", ".join(f"{v}: {share:.0%}" for v, share in answer["traffic"].items())
    print(
        f"{answer['name']}: back to its repository config; serves "
        f"{', '.join(answer['versions']) or 'nothing'} (traffic {traffic or '-'}, generation "
        f"{answer['generation']})"
    )
    return EXIT_OK


def _error(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")
