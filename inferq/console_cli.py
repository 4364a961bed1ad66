"""``inferq console``: the URL of the operator console (``/console`` on a gateway), printed,
or opened in a browser with ``--open``. The console asks for its token itself: the URL carries
no secret, so printing it (or a browser's history keeping it) gives nothing away."""

from __future__ import annotations

import argparse
import sys
import webbrowser
from collections.abc import Mapping
from typing import Any

from protocol.exits import EXIT_OK

DEFAULT_URL = "http://127.0.0.1:8000"


def add_parser(subparsers: Any, environ: Mapping[str, str]) -> None:
    parser = subparsers.add_parser(
        "console",
        help="print (or --open) the URL of the gateway's operator console",
        description="The operator console is served by every gateway at /console: queues, "
        "workers, models, jobs and dead letters on one page. It asks for the console token "
        "(--console-token, read-only) or the admin token.",
    )
    parser.add_argument(
        "--url",
        dest="gateway_url",
        default=DEFAULT_URL,
        metavar="URL",
        help=f"the gateway's base URL (default: {DEFAULT_URL}, where `inferq up` serves)",
    )
    parser.add_argument(
        "--open", action="store_true", help="open it in the default web browser too"
    )


def console_url(gateway_url: str) -> str:
    return gateway_url.rstrip("/") + "/console"


def run(args: argparse.Namespace) -> int:
    url = console_url(args.gateway_url)
    print(url)
    if args.open and not webbrowser.open(url):
        print("inferq console: no web browser found here; open the URL above", file=sys.stderr)
    return EXIT_OK
