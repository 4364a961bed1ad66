"""``inferq loadgen``: load any Open Inference Protocol (KServe V2) endpoint and report.

``inferq`` registers this module's :func:`add_parser` and :func:`run`; ``python -m loadgen``
runs the same command on its own (:func:`main`).  Value flags also read ``INFERQ_LOADGEN_*``
environment variables (the flag's name in capitals, dashes as underscores: ``--max-connections``
is ``INFERQ_LOADGEN_MAX_CONNECTIONS``); a flag on the command line wins.

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

import numpy as np

from loadgen.closed import run_closed_loop
from loadgen.http import HTTPClientError, HTTPConnection, parse_url
from loadgen.http import run as run_loop
from loadgen.inputs import (
    ModelRef,
    bodies_from_file,
    build_requests,
    encode_body,
    generate_tensors,
    input_specs,
    parse_model_url,
)
from loadgen.jobs import JobStats, jobs_operation
from loadgen.open import DEFAULT_MAX_CONNECTIONS, run_open_loop
from loadgen.progress import Progress
from loadgen.recorder import Recorder
from loadgen.result import LoadResult
from loadgen.schedule import RateSchedule, parse_duration

__all__ = ["add_arguments", "add_parser", "main", "run"]

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_MODEL = "digits"
DEFAULT_CONCURRENCY = 16
DEFAULT_DURATION_S = 10.0
DEFAULT_MAX_REQUESTS = 10_000_000
DEFAULT_DISTINCT = 8
METADATA_TIMEOUT_S = 10.0
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum`` (loadgen is an outside client and
    imports none of the product, so not ``runtime.argtypes``)."""

    def parse(raw: str) -> int:
        value = int(raw)
        if value < minimum:
            raise ValueError(raw)
        return value

    return parse


positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)

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


# --------------------------------------------------------------------------------------------
# Argument types
# --------------------------------------------------------------------------------------------


def duration(raw: str) -> float:
    value = parse_duration(raw)
    if not value > 0:
        raise ValueError(raw)
    return value


def non_negative_duration(raw: str) -> float:
    return parse_duration(raw)


def rate_schedule(raw: str) -> RateSchedule:
    return RateSchedule.parse(raw)


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME:VALUE, got {text!r}")
    return name.strip(), value.strip()


def _param(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return key.strip(), value


def _shape(text: str) -> tuple[str, tuple[int, ...]]:
    name, sep, dims = text.partition("=")
    try:
        shape = tuple(int(d) for d in dims.split(",") if d.strip())
    except ValueError:
        shape = ()
    if not sep or not name.strip() or not shape or any(d < 0 for d in shape):
        raise argparse.ArgumentTypeError(
            f"expected INPUT=D1,D2,... (e.g. input=1,64), got {text!r}"
        )
    return name.strip(), shape


class _Env:
    """Adds flags whose defaults come from ``INFERQ_LOADGEN_*`` variables, and says so."""

    def __init__(self, parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
        self.parser = parser
        self.environ = environ
        #: Where :meth:`add` puts flags: the parser or one of its argument groups.
        self.into: argparse._ActionsContainer = parser

    def value(self, env: str, type: Callable[[str], Any], flag: str) -> Any:
        raw = self.environ.get(env)
        if raw is None:
            return None
        try:
            return type(raw)
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            self.parser.error(f"environment variable {env}={raw!r} is not a valid {flag}")

    def add(
        self,
        *flags: str,
        env: str,
        type: Callable[[str], Any] = str,
        default: Any = None,
        help: str,
        shown: str | None = None,
        **kwargs: Any,
    ) -> None:
        value = self.value(env, type, flags[-1])
        shown = f" (default: {default})" if shown is None and default is not None else shown or ""
        self.into.add_argument(
            *flags,
            type=type,
            default=default if value is None else value,
            help=f"{help}{shown} [env {env}]",
            **kwargs,
        )


# --------------------------------------------------------------------------------------------
# The parser
# --------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Every flag of the command, on ``parser``."""
    e = _Env(parser, environ)
    target = parser.add_argument_group("target")
    target.add_argument(
        "--url",
        help="server (http://HOST:PORT) or model URL (.../v2/models/NAME[/versions/V][/infer]); "
        f"only a URL given here may be non-loopback (default: {DEFAULT_URL}) "
        "[env INFERQ_LOADGEN_URL, loopback only]",
    )
    parser.set_defaults(env_url=environ.get("INFERQ_LOADGEN_URL"))
    e.into = target
    e.add(
        "--model",
        "-m",
        env="INFERQ_LOADGEN_MODEL",
        help=f"model name (default: from the URL, else {DEFAULT_MODEL})",
    )
    e.add("--model-version", env="INFERQ_LOADGEN_MODEL_VERSION", help="model version")

    work = parser.add_argument_group("workload")
    e.into = work
    work.add_argument(
        "--input-file",
        type=Path,
        help="JSON V2 inference request (or a list of them, cycled) to send instead of "
        "inputs generated from the model's metadata",
    )
    work.add_argument(
        "--binary", action="store_true", help="send tensors with the binary tensor extension"
    )
    e.add(
        "--rows",
        env="INFERQ_LOADGEN_ROWS",
        type=positive_int,
        default=1,
        help="rows per request: the size of each input's first -1 dimension",
    )
    work.add_argument(
        "--shape",
        action="append",
        type=_shape,
        default=[],
        metavar="INPUT=D1,D2",
        help="exact shape of one input (overrides the metadata and --rows); repeatable",
    )
    e.add(
        "--distinct",
        env="INFERQ_LOADGEN_DISTINCT",
        type=positive_int,
        default=DEFAULT_DISTINCT,
        help="distinct random requests to cycle through",
    )
    e.add(
        "--seed",
        env="INFERQ_LOADGEN_SEED",
        type=int,
        default=0,
        help="seed of the random inputs and of the open loop's arrivals",
    )
    work.add_argument(
        "--param",
        action="append",
        type=_param,
        default=[],
        metavar="KEY=VALUE",
        help="request parameter (VALUE parsed as JSON when it can be, e.g. priority=1, "
        "timeout=500000); repeatable",
    )
    work.add_argument(
        "--header",
        "-H",
        action="append",
        type=_header,
        default=[],
        metavar="NAME:VALUE",
        help="extra HTTP header; repeatable",
    )
    work.add_argument(
        "--cache",
        action="store_true",
        help="allow answers from a result cache (default: send Cache-Control: no-cache, so "
        "every request reaches the model)",
    )

    mode = parser.add_argument_group("load")
    e.into = mode
    loops = mode.add_mutually_exclusive_group()
    loops.add_argument(
        "--concurrency",
        "-c",
        type=positive_int,
        help=f"closed loop: C connections sending back-to-back (default: {DEFAULT_CONCURRENCY}) "
        "[env INFERQ_LOADGEN_CONCURRENCY]",
    )
    loops.add_argument(
        "--rate",
        "-r",
        type=rate_schedule,
        metavar="SCHEDULE",
        help="open loop: Poisson arrivals at RATE req/s, or a ramp FROM:TO:DURATION "
        "(see below) [env INFERQ_LOADGEN_RATE]",
    )
    parser.set_defaults(
        env_concurrency=e.value("INFERQ_LOADGEN_CONCURRENCY", positive_int, "--concurrency"),
        env_rate=e.value("INFERQ_LOADGEN_RATE", rate_schedule, "--rate"),
    )
    mode.add_argument(
        "--jobs",
        action="store_true",
        help="async jobs: POST .../jobs, then poll GET /v2/jobs/{id}?wait=S until a final "
        "status; latency is submit to final status",
    )
    e.add(
        "--job-wait",
        env="INFERQ_LOADGEN_JOB_WAIT",
        type=non_negative_int,
        default=10,
        help="jobs: seconds each poll asks the server to wait",
    )
    e.add(
        "--poll-interval",
        env="INFERQ_LOADGEN_POLL_INTERVAL",
        type=duration,
        default=0.05,
        help="jobs: least time between two polls of one job, seconds",
    )
    e.add(
        "--duration",
        "-d",
        env="INFERQ_LOADGEN_DURATION",
        type=duration,
        help="measured time, e.g. 30s, 2m",
        shown=f" (default: the --rate schedule's length, else {DEFAULT_DURATION_S:g}s)",
    )
    e.add(
        "--warmup",
        env="INFERQ_LOADGEN_WARMUP",
        type=non_negative_duration,
        default=1.0,
        help="unrecorded time before measuring, seconds",
    )
    e.add(
        "--max-requests",
        env="INFERQ_LOADGEN_MAX_REQUESTS",
        type=positive_int,
        default=DEFAULT_MAX_REQUESTS,
        help="cap on measured requests (closed loop: on warm-up ones too)",
    )
    e.add(
        "--timeout",
        env="INFERQ_LOADGEN_TIMEOUT",
        type=duration,
        default=30.0,
        help="per request (jobs: per job) limit, seconds; open loop: from the intended send",
    )
    e.add(
        "--max-connections",
        env="INFERQ_LOADGEN_MAX_CONNECTIONS",
        type=positive_int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="open loop: most connections opened to keep up with the arrivals",
    )

    out = parser.add_argument_group("output")
    out.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="live progress line on stderr (default: only when stderr is a terminal)",
    )
    out.add_argument("--json", metavar="PATH", help="write the result as JSON ('-': stdout)")
    out.add_argument("--report", metavar="PATH.html", help="write a self-contained HTML report")
    out.add_argument("--png", metavar="PATH.png", help="write the charts as a PNG")
    out.add_argument("--no-uvloop", action="store_true", help="use the default asyncio loop")


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


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


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
    url = getattr(args, "env_url", None) or DEFAULT_URL
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
    specs = input_specs(await fetch_metadata(ref))
    rng = np.random.default_rng(args.seed)
    overrides = dict(args.shape)
    return [
        encode_body(
            generate_tensors(specs, rows=args.rows, rng=rng, overrides=overrides),
            binary=args.binary,
            parameters=params,
        )
        for _ in range(args.distinct)
    ]


def config_of(args: argparse.Namespace, url: str, ref: ModelRef) -> dict[str, Any]:
    """What was run, for the JSON and HTML outputs."""
    schedule, concurrency = _mode(args)
    return {
        "url": url,
        "model": ref.model,
        "model_version": ref.version,
        "mode": ("jobs " if args.jobs else "") + ("open" if schedule else "closed"),
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


def _install_sigint(stop: asyncio.Event) -> Callable[[], None]:
    """First Ctrl-C: stop sending and report; the handler then steps aside, so a second
    Ctrl-C interrupts at once.  Returns the undo."""
    loop = asyncio.get_running_loop()

    def first() -> None:
        stop.set()
        print("\nstopping: finishing requests in flight (Ctrl-C again to abort)", file=sys.stderr)
        loop.remove_signal_handler(signal.SIGINT)

    try:
        loop.add_signal_handler(signal.SIGINT, first)
    except (ValueError, RuntimeError, NotImplementedError):  # not the main thread, or Windows
        return lambda: None

    def undo() -> None:
        loop.remove_signal_handler(signal.SIGINT)

    return undo


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
    bodies = await _bodies(args, ref, document)
    headers = dict(args.header)
    if not args.cache:
        headers.setdefault("Cache-Control", "no-cache")
    suffix = "/jobs" if args.jobs else "/infer"
    requests = build_requests(ref.path(suffix), bodies, headers)
    job_stats = JobStats()
    operation = (
        jobs_operation(job_stats, wait_s=args.job_wait, poll_interval_s=args.poll_interval)
        if args.jobs
        else None
    )
    recorder = Recorder()
    stop = asyncio.Event()
    undo = _install_sigint(stop)
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    progress = (
        Progress(recorder, sys.stderr, tty=sys.stderr.isatty())
        if show
        else contextlib.nullcontext()
    )
    common: dict[str, Any] = {
        "requests": requests,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "max_requests": args.max_requests,
        "timeout_s": args.timeout,
        "operation": operation,
        "recorder": recorder,
        "stop": stop,
    }
    try:
        async with progress:
            if schedule is not None:
                result = await run_open_loop(
                    ref.url(suffix),
                    rate=schedule,
                    max_connections=args.max_connections,
                    seed=args.seed,
                    **common,
                )
            else:
                result = await run_closed_loop(ref.url(suffix), concurrency=concurrency, **common)
    finally:
        undo()
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
    from loadgen.png import png_report
    from loadgen.report import html_report

    try:
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
    if args.png:
        _write(args.png, png_report(result))
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
