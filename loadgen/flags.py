"""The flags of ``inferq loadgen``: their types, defaults and ``INFERQ_LOADGEN_*`` variables.

:func:`add_arguments` puts every flag on a parser (:mod:`loadgen.cli` runs what it parsed).
Value flags also read ``INFERQ_LOADGEN_*`` environment variables (the flag's name in capitals,
dashes as underscores: ``--max-connections`` is ``INFERQ_LOADGEN_MAX_CONNECTIONS``); a flag on
the command line wins.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from loadgen.open import DEFAULT_MAX_CONNECTIONS
from loadgen.schedule import RateSchedule, parse_duration

__all__ = ["EXAMPLES", "add_arguments"]

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_GRPC_URL = "http://127.0.0.1:8001"
DEFAULT_MODEL = "digits"
DEFAULT_CONCURRENCY = 16
DEFAULT_DURATION_S = 10.0
DEFAULT_MAX_REQUESTS = 10_000_000
DEFAULT_DISTINCT = 8
METADATA_TIMEOUT_S = 10.0


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
    e.add(
        "--protocol",
        env="INFERQ_LOADGEN_PROTOCOL",
        default="http",
        choices=["http", "grpc"],
        help="http: V2 over HTTP/1.1; grpc: the V2 ModelInfer RPC (raw tensors) to the URL's "
        f"host and port (default then: {DEFAULT_GRPC_URL})",
    )

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
    out.add_argument(
        "--png",
        metavar="PATH.png",
        help="write the charts as a PNG (needs matplotlib: pip install 'inferq[charts]')",
    )
    out.add_argument("--no-uvloop", action="store_true", help="use the default asyncio loop")
