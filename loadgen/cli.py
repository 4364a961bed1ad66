"""``inferq loadgen``: load any Open Inference Protocol (KServe V2) endpoint and report.

``inferq`` registers this module's :func:`add_parser` and :func:`run`; ``python -m loadgen``
runs the same command on its own (:func:`main`).  The flags, their defaults and their
``INFERQ_LOADGEN_*`` variables are declared in :mod:`loadgen.flags`.

Only the URL given on the command line may point at another host: a URL from the environment
or the default must be loopback, so nothing is ever sent off the machine without being asked
for in the command itself.  Nothing is scanned or discovered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from loadgen.closed import run_closed_loop
from loadgen.flags import (
    DEFAULT_CONCURRENCY,
    DEFAULT_DURATION_S,
    DEFAULT_GRPC_URL,
    DEFAULT_MODEL,
    DEFAULT_URL,
    EXAMPLES,
    METADATA_TIMEOUT_S,
    add_arguments,
)
from loadgen.grpc_client import GrpcConnection, GrpcTargetError, grpc_operation, grpc_requests
from loadgen.http import HTTPClientError, HTTPConnection, parse_url
from loadgen.http import run as run_loop
from loadgen.inputs import (
    ModelRef,
    bodies_from_file,
    build_requests,
    generated_bodies,
    parse_model_url,
)
from loadgen.jobs import JobStats, jobs_operation
from loadgen.loop import LoadOptions
from loadgen.open import run_open_loop
from loadgen.progress import Progress
from loadgen.recorder import Recorder
from loadgen.result import LoadResult
from loadgen.schedule import RateSchedule
from protocol.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, StopSignals

__all__ = ["add_arguments", "add_parser", "main", "run"]


def add_parser(subparsers: Any, environ: Mapping[str, str]) -> None:
    """Add the ``loadgen`` subcommand (all its flags) to an ``add_subparsers()`` object."""
    parser = subparsers.add_parser(
        "loadgen",
        help="load a V2 inference endpoint (closed or open loop, jobs) and report latency",
        description="Load any Open Inference Protocol (KServe V2) endpoint: closed loop "
        "(--concurrency) or open loop with Poisson arrivals (--rate), inputs generated from "
        "the model's metadata or read from a file, JSON or binary tensors, or async jobs. "
        "Prints throughput, counts by status and HDR latency percentiles; writes JSON, HTML "
        "and PNG reports.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser, environ)
    parser.set_defaults(func=run)


class UsageError(Exception):
    """A problem with what was asked for, reported without a traceback (exit 2)."""


class TargetError(Exception):
    """The target could not be prepared for (its metadata unreachable...): exit 1."""


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback IP literal (no name resolution)."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def resolve_url(args: argparse.Namespace) -> str:
    """The URL to load: ``--url`` (any host), else the environment's or the default (loopback
    only)."""
    if args.url:
        parse_url(args.url)
        return str(args.url)
    default = DEFAULT_GRPC_URL if getattr(args, "protocol", "http") == "grpc" else DEFAULT_URL
    url = getattr(args, "env_url", None) or default
    host = parse_url(url).host
    if not is_loopback(host):
        raise UsageError(
            f"refusing to send load to {host} from INFERQ_LOADGEN_URL: only loopback hosts are "
            "taken from the environment; pass --url to load another host"
        )
    return url


def _mode(args: argparse.Namespace) -> tuple[RateSchedule | None, int]:
    """(open-loop schedule or None, closed-loop concurrency): the command line wins over the
    environment, and --rate over --concurrency within each."""
    if args.rate is not None:
        return args.rate, 0
    if args.concurrency is not None:
        return None, args.concurrency
    if getattr(args, "env_rate", None) is not None:
        return args.env_rate, 0
    return None, getattr(args, "env_concurrency", None) or DEFAULT_CONCURRENCY


async def fetch_metadata(ref: ModelRef, timeout_s: float = METADATA_TIMEOUT_S) -> Any:
    """``GET /v2/models/{m}[/versions/{v}]`` as parsed JSON."""
    target = parse_url(ref.url())
    async with HTTPConnection(
        target.host, target.port, host_header=target.host_header, timeout=timeout_s
    ) as conn:
        try:
            resp = await conn.request("GET", ref.path())
        except HTTPClientError as exc:
            raise TargetError(f"cannot fetch model metadata from {ref.url()}: {exc}") from exc
    if resp.status != 200:
        detail = resp.body[:300].decode("utf-8", "replace")
        raise TargetError(f"GET {ref.url()} answered {resp.status}: {detail}")
    try:
        return json.loads(resp.body)
    except ValueError:
        raise TargetError(f"GET {ref.url()} did not answer JSON") from None


def read_input_file(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read --input-file {path}: {exc}") from None


async def _bodies(
    args: argparse.Namespace, ref: ModelRef, document: Any
) -> list[tuple[bytes, dict[str, str]]]:
    params = dict(args.param)
    if document is not None:
        return bodies_from_file(document, binary=args.binary, parameters=params)
    return generated_bodies(
        await fetch_metadata(ref),
        count=args.distinct,
        rows=args.rows,
        seed=args.seed,
        binary=args.binary,
        parameters=params,
        overrides=dict(args.shape),
    )


async def _grpc_workload(
    args: argparse.Namespace, ref: ModelRef, document: Any, headers: Mapping[str, str]
) -> tuple[None, Any, Callable[[], Any]]:
    """The gRPC run's operation and connection factory (it sends no HTTP requests)."""
    if args.jobs:
        raise UsageError("--jobs needs --protocol http: async jobs are an HTTP API")
    url = parse_url(ref.url())
    target = f"{url.host}:{url.port}"
    try:
        requests = await grpc_requests(
            target,
            ref.model or DEFAULT_MODEL,
            ref.version,
            document=document,
            parameters=dict(args.param),
            rows=args.rows,
            distinct=args.distinct,
            seed=args.seed,
            shapes=dict(args.shape),
            timeout_s=METADATA_TIMEOUT_S,
        )
    except GrpcTargetError as exc:
        raise TargetError(str(exc)) from None
    metadata = [(k.lower(), v) for k, v in headers.items()]
    return (
        None,
        grpc_operation(requests),
        lambda: GrpcConnection(target, connect_timeout=5.0, metadata=metadata),
    )


def config_of(args: argparse.Namespace, url: str, ref: ModelRef) -> dict[str, Any]:
    """What was run, for the JSON and HTML outputs."""
    schedule, concurrency = _mode(args)
    return {
        "url": url,
        "model": ref.model,
        "model_version": ref.version,
        "mode": ("jobs " if args.jobs else "") + ("open" if schedule else "closed"),
        "protocol": args.protocol,
        "rate": schedule.describe() if schedule else None,
        "concurrency": concurrency or None,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "binary": args.binary,
        "rows": args.rows,
        "input_file": str(args.input_file) if args.input_file else None,
        "seed": args.seed,
        "timeout_s": args.timeout,
        "max_requests": args.max_requests,
        "max_connections": args.max_connections if schedule else None,
        "cache": args.cache,
    }


def _interrupts(stop: asyncio.Event) -> StopSignals:
    """First Ctrl-C: stop sending and report; a second one interrupts at once."""

    def first() -> None:
        stop.set()
        print("\nstopping: finishing requests in flight (Ctrl-C again to abort)", file=sys.stderr)

    def second() -> None:
        raise KeyboardInterrupt

    return StopSignals(on_stop=first, on_force=second, signals=(signal.SIGINT,))


async def run_async(
    args: argparse.Namespace, url: str, document: Any = None
) -> tuple[LoadResult, dict[str, Any]]:
    """Prepare the workload and run the load; return the result and the run's configuration."""
    ref = parse_model_url(url)
    ref = ModelRef(
        ref.server, args.model or ref.model or DEFAULT_MODEL, args.model_version or ref.version
    )
    schedule, concurrency = _mode(args)
    if args.duration is None:
        args.duration = schedule.length_s if schedule and schedule.length_s > 0 else None
        args.duration = args.duration or DEFAULT_DURATION_S
    headers = dict(args.header)
    if not args.cache:
        headers.setdefault("Cache-Control", "no-cache")
    suffix = "/jobs" if args.jobs else "/infer"
    job_stats = JobStats()
    transport = None
    if args.protocol == "grpc":
        requests, operation, transport = await _grpc_workload(args, ref, document, headers)
    else:
        bodies = await _bodies(args, ref, document)
        requests = build_requests(ref.path(suffix), bodies, headers)
        operation = (
            jobs_operation(job_stats, wait_s=args.job_wait, poll_interval_s=args.poll_interval)
            if args.jobs
            else None
        )
    recorder = Recorder()
    stop = asyncio.Event()
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    progress = (
        Progress(recorder, sys.stderr, tty=sys.stderr.isatty())
        if show
        else contextlib.nullcontext()
    )
    options = LoadOptions(
        ref.url(suffix),
        duration_s=args.duration,
        requests=requests,
        warmup_s=args.warmup,
        max_requests=args.max_requests,
        timeout_s=args.timeout,
        operation=operation,
        transport=transport,
    )
    with _interrupts(stop).installed_on(asyncio.get_running_loop()):
        async with progress:
            if schedule is not None:
                result = await run_open_loop(
                    options,
                    schedule,
                    max_connections=args.max_connections,
                    seed=args.seed,
                    recorder=recorder,
                    stop=stop,
                )
            else:
                result = await run_closed_loop(options, concurrency, recorder=recorder, stop=stop)
    if args.jobs:
        result.mode = f"jobs/{result.mode}"
        result.extra["jobs"] = job_stats.to_dict()
    return result, config_of(args, url, ref)


def _write(path: str, data: str | bytes) -> None:
    p = Path(path)
    if isinstance(data, bytes):
        p.write_bytes(data)
    else:
        p.write_text(data)


def run(args: argparse.Namespace) -> int:
    """Run the command parsed by :func:`add_arguments`; the process exit status.

    0: the run completed and at least one request succeeded; 1: none did (or the model's
    metadata could not be fetched); 2: bad usage; 130: interrupted twice."""
    from loadgen import charts
    from loadgen.report import html_report

    try:
        if args.png and not charts.available():
            raise UsageError(f"--png: {charts.INSTALL_HINT}")
        url = resolve_url(args)
        document = None if args.input_file is None else read_input_file(args.input_file)
        result, config = run_loop(run_async(args, url, document), use_uvloop=not args.no_uvloop)
    except (UsageError, ValueError) as exc:
        print(f"inferq loadgen: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TargetError as exc:
        print(f"inferq loadgen: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("inferq loadgen: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    summary_stream = sys.stderr if args.json == "-" else sys.stdout
    print(result.summary(), file=summary_stream)
    if args.json:
        text = json.dumps({"config": config, **result.to_dict()}, indent=2)
        if args.json == "-":
            print(text)
        else:
            _write(args.json, text + "\n")
    if args.report:
        _write(args.report, html_report(result, title="inferq loadgen", config=config))
        if not charts.available():
            print(
                f"inferq loadgen: the report has no charts: {charts.INSTALL_HINT}", file=sys.stderr
            )
    if args.png:
        _write(args.png, charts.png_report(result))
    return EXIT_OK if result.ok else EXIT_FAILED


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """``python -m loadgen ...``: the same command without the ``inferq`` front end."""
    import os

    parser = argparse.ArgumentParser(
        prog="python -m loadgen",
        description="Load a KServe V2 inference endpoint (same flags as `inferq loadgen`).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser, os.environ if environ is None else environ)
    return run(parser.parse_args(argv))
