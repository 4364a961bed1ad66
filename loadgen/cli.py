"""``inferq loadgen``: load any Open Inference Protocol (KServe V2) endpoint and report.

``inferq`` registers this module's :func:`add_parser` and :func:`run`; ``python -m loadgen``
runs the same command on its own (:func:`main`). The flags, their defaults and their
``INFERQ_LOADGEN_*`` variables are declared once, in :class:`loadgen.settings.LoadgenSettings`;
:func:`run` builds that frozen object from the parsed arguments and passes it down.

Only the URL given on the command line may point at another host: a URL from the environment
or the default must be loopback, so nothing is ever sent off the machine without being asked
for in the command itself. Nothing is scanned or discovered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadgen.closed import run_closed_loop
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
from loadgen.settings import (
    DEFAULT_CONCURRENCY,
    DEFAULT_DURATION_S,
    DEFAULT_GRPC_URL,
    DEFAULT_MODEL,
    DEFAULT_URL,
    LoadgenSettings,
)
from protocol.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, StopSignals
from protocol.options import add_flags, from_args

__all__ = ["add_arguments", "add_parser", "main", "run"]

METADATA_TIMEOUT_S = 10.0

EXAMPLES = """\
examples:
  inferq loadgen --model digits -c 64 -d 10s               closed loop, 64 connections
  inferq loadgen --model digits --rate 500 --binary         open loop, Poisson 500 req/s
  inferq loadgen --rate 100:1000:10s -d 20s --report r.html ramp 100 -> 1000 req/s, hold
  inferq loadgen --model digits --jobs --rate 50            async jobs: submit, then poll
  inferq loadgen --url http://10.0.0.5:8000/v2/models/m --input-file body.json --json -

--rate takes RATE, RATE:DURATION or FROM:TO:DURATION segments separated by commas; after the
last segment the rate holds at its final value. `--rate 100:1000:10s` ramps linearly from 100
to 1,000 req/s over the first 10 s of measurement, then holds 1,000 req/s until --duration ends
(--duration defaults to the schedule's length, else 10 s). Warm-up runs at the first rate.
Open-loop latency counts from each request's intended send time (coordinated omission).
"""


def add_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Every flag of the command, on ``parser``: derived from ``LoadgenSettings``."""
    add_flags(parser, environ, LoadgenSettings)


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


def resolve_url(settings: LoadgenSettings) -> str:
    """The URL to load: ``--url`` (or a loopback one from the environment), else the default."""
    if settings.url:
        parse_url(settings.url)
        return settings.url
    return DEFAULT_GRPC_URL if settings.protocol == "grpc" else DEFAULT_URL


def _mode(settings: LoadgenSettings) -> tuple[RateSchedule | None, int]:
    """(open-loop schedule or None, closed-loop concurrency); --rate over --concurrency when
    both come from the environment (on the command line they exclude each other)."""
    if settings.rate is not None:
        return settings.rate, 0
    return None, settings.concurrency or DEFAULT_CONCURRENCY


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
    settings: LoadgenSettings, ref: ModelRef, document: Any
) -> list[tuple[bytes, dict[str, str]]]:
    params = dict(settings.param)
    if document is not None:
        return bodies_from_file(document, binary=settings.binary, parameters=params)
    return generated_bodies(
        await fetch_metadata(ref),
        count=settings.distinct,
        rows=settings.rows,
        seed=settings.seed,
        binary=settings.binary,
        parameters=params,
        overrides=dict(settings.shape),
    )


async def _grpc_workload(
    settings: LoadgenSettings, ref: ModelRef, document: Any, headers: Mapping[str, str]
) -> tuple[None, Any, Callable[[], Any]]:
    """The gRPC run's operation and connection factory (it sends no HTTP requests)."""
    if settings.jobs:
        raise UsageError("--jobs needs --protocol http: async jobs are an HTTP API")
    url = parse_url(ref.url())
    target = f"{url.host}:{url.port}"
    try:
        requests = await grpc_requests(
            target,
            ref.model or DEFAULT_MODEL,
            ref.version,
            document=document,
            parameters=dict(settings.param),
            rows=settings.rows,
            distinct=settings.distinct,
            seed=settings.seed,
            shapes=dict(settings.shape),
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


def config_of(settings: LoadgenSettings, url: str, ref: ModelRef) -> dict[str, Any]:
    """What was run, for the JSON and HTML outputs."""
    schedule, concurrency = _mode(settings)
    return {
        "url": url,
        "model": ref.model,
        "model_version": ref.version,
        "mode": ("jobs " if settings.jobs else "") + ("open" if schedule else "closed"),
        "protocol": settings.protocol,
        "rate": schedule.describe() if schedule else None,
        "concurrency": concurrency or None,
        "duration_s": settings.duration,
        "warmup_s": settings.warmup,
        "binary": settings.binary,
        "rows": settings.rows,
        "input_file": str(settings.input_file) if settings.input_file else None,
        "seed": settings.seed,
        "timeout_s": settings.timeout,
        "max_requests": settings.max_requests,
        "max_connections": settings.max_connections if schedule else None,
        "cache": settings.cache,
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
    settings: LoadgenSettings, url: str, document: Any = None
) -> tuple[LoadResult, dict[str, Any]]:
    """Prepare the workload and run the load; return the result and the run's configuration."""
    ref = parse_model_url(url)
    ref = ModelRef(
        ref.server,
        settings.model or ref.model or DEFAULT_MODEL,
        settings.model_version or ref.version,
    )
    schedule, concurrency = _mode(settings)
    duration = settings.duration
    if duration is None and schedule is not None and schedule.length_s > 0:
        duration = schedule.length_s
    duration = duration or DEFAULT_DURATION_S
    settings = replace(settings, duration=duration)  # what ran, for config_of
    headers = dict(settings.header)
    if not settings.cache:
        headers.setdefault("Cache-Control", "no-cache")
    suffix = "/jobs" if settings.jobs else "/infer"
    job_stats = JobStats()
    transport = None
    if settings.protocol == "grpc":
        requests, operation, transport = await _grpc_workload(settings, ref, document, headers)
    else:
        bodies = await _bodies(settings, ref, document)
        requests = build_requests(ref.path(suffix), bodies, headers)
        operation = (
            jobs_operation(
                job_stats, wait_s=settings.job_wait, poll_interval_s=settings.poll_interval
            )
            if settings.jobs
            else None
        )
    recorder = Recorder()
    stop = asyncio.Event()
    show = settings.progress if settings.progress is not None else sys.stderr.isatty()
    progress = (
        Progress(recorder, sys.stderr, tty=sys.stderr.isatty())
        if show
        else contextlib.nullcontext()
    )
    options = LoadOptions(
        ref.url(suffix),
        duration_s=duration,
        requests=requests,
        warmup_s=settings.warmup,
        max_requests=settings.max_requests,
        timeout_s=settings.timeout,
        operation=operation,
        transport=transport,
    )
    with _interrupts(stop).installed_on(asyncio.get_running_loop()):
        async with progress:
            if schedule is not None:
                result = await run_open_loop(
                    options,
                    schedule,
                    max_connections=settings.max_connections,
                    seed=settings.seed,
                    recorder=recorder,
                    stop=stop,
                )
            else:
                result = await run_closed_loop(options, concurrency, recorder=recorder, stop=stop)
    if settings.jobs:
        result.mode = f"jobs/{result.mode}"
        result.extra["jobs"] = job_stats.to_dict()
    return result, config_of(settings, url, ref)


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
        settings: LoadgenSettings = from_args(LoadgenSettings, args)
        if settings.png and not charts.available():
            raise UsageError(f"--png: {charts.INSTALL_HINT}")
        url = resolve_url(settings)
        document = None if settings.input_file is None else read_input_file(settings.input_file)
        result, config = run_loop(
            run_async(settings, url, document), use_uvloop=not settings.no_uvloop
        )
    except (UsageError, ValueError) as exc:
        print(f"inferq loadgen: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TargetError as exc:
        print(f"inferq loadgen: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("inferq loadgen: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    summary_stream = sys.stderr if settings.json_path == "-" else sys.stdout
    print(result.summary(), file=summary_stream)
    if settings.json_path:
        text = json.dumps({"config": config, **result.to_dict()}, indent=2)
        if settings.json_path == "-":
            print(text)
        else:
            _write(settings.json_path, text + "\n")
    if settings.report:
        _write(settings.report, html_report(result, title="inferq loadgen", config=config))
        if not charts.available():
            print(
                f"inferq loadgen: the report has no charts: {charts.INSTALL_HINT}", file=sys.stderr
            )
    if settings.png:
        _write(settings.png, charts.png_report(result))
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
