"""``python -m loadgen``: a closed-loop run from the command line, for manual use.

    python -m loadgen --url http://127.0.0.1:8000/v2/models/digits/infer \\
        --body-file request.json --header content-type:application/json \\
        --concurrency 16 --duration 10 [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from loadgen.closed import run_closed_loop
from loadgen.http import run


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME:VALUE, got {text!r}")
    return name.strip(), value.strip()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadgen", description="Closed-loop HTTP/1.1 load against one URL."
    )
    p.add_argument("--url", required=True, help="http:// URL to send every request to")
    p.add_argument("--method", help="HTTP method (default: POST with a body, else GET)")
    body = p.add_mutually_exclusive_group()
    body.add_argument("--body-file", help="file whose bytes are the request body")
    body.add_argument("--body", help="request body as a string")
    p.add_argument(
        "--header", "-H", action="append", type=_header, default=[], metavar="NAME:VALUE"
    )
    p.add_argument("--concurrency", "-c", type=int, default=16, help="connections (default 16)")
    p.add_argument("--duration", "-d", type=float, default=10.0, help="seconds measured")
    p.add_argument("--warmup", type=float, default=1.0, help="unrecorded seconds first")
    p.add_argument("--max-requests", type=int, default=None, help="cap on measured requests")
    p.add_argument("--timeout", type=float, default=30.0, help="per-request timeout, seconds")
    p.add_argument("--no-uvloop", action="store_true", help="use the default asyncio loop")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.body_file is not None:
        with open(args.body_file, "rb") as f:
            body = f.read()
    elif args.body is not None:
        body = args.body.encode()
    else:
        body = b""
    has_body = args.body_file is not None or args.body is not None
    method = args.method or ("POST" if has_body else "GET")
    try:
        result = run(
            run_closed_loop(
                args.url,
                concurrency=args.concurrency,
                duration_s=args.duration,
                method=method,
                body=body,
                headers=dict(args.header),
                warmup_s=args.warmup,
                max_requests=args.max_requests,
                timeout_s=args.timeout,
            ),
            use_uvloop=not args.no_uvloop,
        )
    except ValueError as exc:
        print(f"loadgen: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.summary())
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
