"""The options of ``inferq loadgen``, declared once as ``protocol.options`` declares every
command's: each field is one flag, its ``INFERQ_LOADGEN_*`` variable, its type and its help.

``add_flags(parser, environ, LoadgenSettings)`` derives the parser (``loadgen.cli`` does, for
``inferq loadgen`` and ``python -m loadgen`` alike) and ``from_args`` the frozen settings the run
takes. A flag on the command line wins over its variable. Two rules are declared here too: a URL
from the environment must be loopback (only one on the command line may leave the machine), and
``--concurrency`` and ``--rate`` exclude each other, the command line winning over either
variable.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadgen.http import parse_url
from loadgen.open import DEFAULT_MAX_CONNECTIONS
from loadgen.schedule import RateSchedule, parse_duration
from protocol.argtypes import non_negative_int, positive_int
from protocol.options import option

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_GRPC_URL = "http://127.0.0.1:8001"
DEFAULT_MODEL = "digits"
DEFAULT_CONCURRENCY = 16
DEFAULT_DURATION_S = 10.0


def positive_duration(raw: str) -> float:
    value = parse_duration(raw)
    if not value > 0:
        raise ValueError(raw)
    return value


def parse_header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME:VALUE, got {text!r}")
    return name.strip(), value.strip()


def parse_param(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return key.strip(), value


def parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
    name, sep, dims = text.partition("=")
    try:
        dimensions = tuple(int(d) for d in dims.split(",") if d.strip())
    except ValueError:
        dimensions = ()
    if not sep or not name.strip() or not dimensions or any(d < 0 for d in dimensions):
        raise argparse.ArgumentTypeError(
            f"expected INPUT=D1,D2,... (e.g. input=1,64), got {text!r}"
        )
    return name.strip(), dimensions


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback IP literal (no name resolution)."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def loopback_only(url: str) -> None:
    host = parse_url(url).host
    if not is_loopback(host):
        raise ValueError(
            f"refusing to send load to {host} from INFERQ_LOADGEN_URL: only loopback hosts are "
            "taken from the environment; pass --url to load another host"
        )


@dataclass(frozen=True)
class LoadgenSettings:
    # -- target
    url: str | None = option(
        None,
        flag="--url",
        env="INFERQ_LOADGEN_URL",
        env_check=loopback_only,
        group="target",
        help="server (http://HOST:PORT) or model URL (.../v2/models/NAME[/versions/V][/infer]); "
        f"only a URL given here may be non-loopback, one from the variable must be loopback "
        f"(default: {DEFAULT_URL})",
    )
    model: str | None = option(
        None,
        flag="--model",
        aliases=("-m",),
        env="INFERQ_LOADGEN_MODEL",
        group="target",
        help=f"model name (default: from the URL, else {DEFAULT_MODEL})",
    )
    model_version: str | None = option(
        None,
        flag="--model-version",
        env="INFERQ_LOADGEN_MODEL_VERSION",
        group="target",
        help="model version",
    )
    protocol: str = option(
        "http",
        flag="--protocol",
        env="INFERQ_LOADGEN_PROTOCOL",
        choices=("http", "grpc"),
        group="target",
        help="http: V2 over HTTP/1.1; grpc: the V2 ModelInfer RPC (raw tensors) to the URL's "
        f"host and port (default then: {DEFAULT_GRPC_URL})",
    )
    # -- workload
    input_file: Path | None = option(
        None,
        flag="--input-file",
        parse=Path,
        group="workload",
        help="JSON V2 inference request (or a list of them, cycled) to send instead of "
        "inputs generated from the model's metadata",
    )
    binary: bool = option(
        False,
        flag="--binary",
        kind="switch",
        group="workload",
        help="send tensors with the binary tensor extension",
    )
    rows: int = option(
        1,
        flag="--rows",
        env="INFERQ_LOADGEN_ROWS",
        parse=positive_int,
        group="workload",
        help="rows per request: the size of each input's first -1 dimension",
    )
    shape: tuple[tuple[str, tuple[int, ...]], ...] = option(
        (),
        flag="--shape",
        parse=parse_shape,
        kind="repeat",
        metavar="INPUT=D1,D2",
        group="workload",
        help="exact shape of one input (overrides the metadata and --rows); repeatable",
    )
    distinct: int = option(
        8,
        flag="--distinct",
        env="INFERQ_LOADGEN_DISTINCT",
        parse=positive_int,
        group="workload",
        help="distinct random requests to cycle through",
    )
    seed: int = option(
        0,
        flag="--seed",
        env="INFERQ_LOADGEN_SEED",
        parse=int,
        group="workload",
        help="seed of the random inputs and of the open loop's arrivals",
    )
    param: tuple[tuple[str, Any], ...] = option(
        (),
        flag="--param",
        parse=parse_param,
        kind="repeat",
        metavar="KEY=VALUE",
        group="workload",
        help="request parameter (VALUE parsed as JSON when it can be, e.g. priority=1, "
        "timeout=500000); repeatable",
    )
    header: tuple[tuple[str, str], ...] = option(
        (),
        flag="--header",
        aliases=("-H",),
        parse=parse_header,
        kind="repeat",
        metavar="NAME:VALUE",
        group="workload",
        help="extra HTTP header; repeatable",
    )
    cache: bool = option(
        False,
        flag="--cache",
        kind="switch",
        group="workload",
        help="allow answers from a result cache (default: send Cache-Control: no-cache, so "
        "every request reaches the model)",
    )
    # -- load
    concurrency: int | None = option(
        None,
        flag="--concurrency",
        aliases=("-c",),
        env="INFERQ_LOADGEN_CONCURRENCY",
        parse=positive_int,
        exclusive="loop",
        group="load",
        help=f"closed loop: C connections sending back-to-back (default: {DEFAULT_CONCURRENCY})",
    )
    rate: RateSchedule | None = option(
        None,
        flag="--rate",
        aliases=("-r",),
        env="INFERQ_LOADGEN_RATE",
        parse=RateSchedule.parse,
        exclusive="loop",
        metavar="SCHEDULE",
        group="load",
        help="open loop: Poisson arrivals at RATE req/s, or a ramp FROM:TO:DURATION (see below)",
    )
    jobs: bool = option(
        False,
        flag="--jobs",
        kind="switch",
        group="load",
        help="async jobs: POST .../jobs, then poll GET /v2/jobs/{id}?wait=S until a final "
        "status; latency is submit to final status",
    )
    job_wait: int = option(
        10,
        flag="--job-wait",
        env="INFERQ_LOADGEN_JOB_WAIT",
        parse=non_negative_int,
        group="load",
        help="jobs: seconds each poll asks the server to wait",
    )
    poll_interval: float = option(
        0.05,
        flag="--poll-interval",
        env="INFERQ_LOADGEN_POLL_INTERVAL",
        parse=positive_duration,
        group="load",
        help="jobs: least time between two polls of one job, seconds",
    )
    duration: float | None = option(
        None,
        flag="--duration",
        aliases=("-d",),
        env="INFERQ_LOADGEN_DURATION",
        parse=positive_duration,
        group="load",
        help="measured time, e.g. 30s, 2m "
        f"(default: the --rate schedule's length, else {DEFAULT_DURATION_S:g}s)",
    )
    warmup: float = option(
        1.0,
        flag="--warmup",
        env="INFERQ_LOADGEN_WARMUP",
        parse=parse_duration,
        group="load",
        help="unrecorded time before measuring, seconds",
    )
    max_requests: int = option(
        10_000_000,
        flag="--max-requests",
        env="INFERQ_LOADGEN_MAX_REQUESTS",
        parse=positive_int,
        group="load",
        help="cap on measured requests (closed loop: on warm-up ones too)",
    )
    timeout: float = option(
        30.0,
        flag="--timeout",
        env="INFERQ_LOADGEN_TIMEOUT",
        parse=positive_duration,
        group="load",
        help="per request (jobs: per job) limit, seconds; open loop: from the intended send",
    )
    max_connections: int = option(
        DEFAULT_MAX_CONNECTIONS,
        flag="--max-connections",
        env="INFERQ_LOADGEN_MAX_CONNECTIONS",
        parse=positive_int,
        group="load",
        help="open loop: most connections opened to keep up with the arrivals",
    )
    # -- output
    progress: bool | None = option(
        None,
        flag="--progress",
        kind="toggle",
        group="output",
        help="live progress line on stderr (default: only when stderr is a terminal)",
    )
    json_path: str | None = option(
        None,
        flag="--json",
        metavar="PATH",
        group="output",
        help="write the result as JSON ('-': stdout)",
    )
    report: str | None = option(
        None,
        flag="--report",
        metavar="PATH.html",
        group="output",
        help="write a self-contained HTML report",
    )
    png: str | None = option(
        None,
        flag="--png",
        metavar="PATH.png",
        group="output",
        help="write the charts as a PNG (needs matplotlib: pip install 'inferq[charts]')",
    )
    no_uvloop: bool = option(
        False,
        flag="--no-uvloop",
        kind="switch",
        group="output",
        help="use the default asyncio loop",
    )
