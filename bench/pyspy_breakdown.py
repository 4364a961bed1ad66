"""Where a process's CPU went, from a py-spy recording (``py-spy record --format raw``).

    python bench/pyspy_breakdown.py FILE [FILE ...] [--json] [--top N]

Record with ``--gil`` (bench/peers.py does): a sample is then the thread holding the GIL, i.e.
Python (or C code called from it) on the CPU, not a thread waiting. Each sample is a stack; it
is charged to the package of its innermost frame that belongs to a known group (self time by
package): time in ``json`` called from our code counts as JSON, time in Starlette's routing as
Starlette. Samples whose innermost Python frame is the event loop's ``run`` are time in
uvloop's C code (socket I/O, httptools' parser, callbacks' C parts). Stages
are also given inclusively: the share of samples with that function anywhere on the stack.

``--by-stage`` charges each sample instead to the request stage (issue #27's table: HTTP, JSON
decode, validation, Redis I/O, encode, metrics, model call, ...) of its innermost frame that
names one (``STAGE_RULES``); frames of libraries that name none (numpy, typing, dataclasses'
``__init__``) count for their caller. With ``--cpu-us N`` (the process's measured CPU per
request, from a run without py-spy) each share is also given in microseconds per request.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^:()]+)(?::(?P<line>\d+))?\)$")

GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "metrics (prometheus_client, producer/metrics, instrument)",
        (
            "prometheus_client/",
            "producer/metrics.py",
            "producer/instrument.py",
            "consumer/metrics.py",
        ),
    ),
    ("JSON (json, orjson)", ("json/", "orjson")),
    ("msgpack codec (protocol/)", ("protocol/", "msgpack/")),
    ("redis-py", ("redis/",)),
    ("numpy", ("numpy/",)),
    ("structlog", ("structlog/",)),
    ("ONNX Runtime", ("onnxruntime/",)),
    ("Starlette", ("starlette/",)),
    ("uvicorn", ("uvicorn/",)),
    ("asyncio (futures, tasks, timers)", ("asyncio/",)),
    ("gateway code (producer/)", ("producer/",)),
    ("worker code (consumer/)", ("consumer/",)),
    ("runtime/", ("runtime/",)),
    ("threads, executors", ("threading.py", "concurrent/")),
)
EVENT_LOOP = "event loop C code (uvloop: sockets, httptools, callbacks)"

STAGES = (
    "InferenceService.infer",
    "parse_infer_request",
    "encode_infer_response",
    "AutoPipeline._send",
    "ReplyListener.run",
    "RequestMetrics.__call__",
    "Worker._run_batch",
    "Worker.accept",
    "ResultWriter._write",
    "ServedModel.run",
    "Worker._read_loop",
)


STAGE_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "HTTP (uvicorn, httptools, response sends)",
        (
            "uvicorn/",
            "producer/server.py",
            "producer/httpbody.py",
            "producer/fastpath.py",
            "starlette/",
        ),
    ),
    (
        "JSON decode (orjson, msgspec, json)",
        (
            "orjson",
            "msgspec",
            "json/",
            "parse_json_object",
            "_parse_slowly",
            "decode_request",
        ),
    ),
    ("V2 validation and tensor build", ("producer/v2_request.py",)),
    ("response encode", ("producer/v2_response.py",)),
    (
        "metrics",
        (
            "prometheus_client/",
            "producer/metrics.py",
            "producer/instrument.py",
            "consumer/metrics.py",
            "runtime/metrics.py",
        ),
    ),
    (
        "model call (ONNX Runtime, backends)",
        ("onnxruntime/", "consumer/backends/", "ServedModel.run"),
    ),
    ("msgpack codec (protocol/)", ("protocol/", "msgpack/")),
    (
        "Redis I/O (redis-py, runtime/resp, pipeliner, reader, writer)",
        (
            "redis/",
            "runtime/resp.py",
            "runtime/readconn.py",
            "runtime/connections.py",
            "producer/pipeliner.py",
            "producer/replies.py",
            "consumer/reader.py",
            "consumer/writer.py",
            "asyncio/streams.py",
        ),
    ),
    ("logging (structlog)", ("structlog/", "logging/")),
    ("asyncio (tasks, futures, timers)", ("asyncio/",)),
    ("gateway service (admission, routing, waiters)", ("producer/",)),
    ("worker (batcher, dispatcher)", ("consumer/",)),
    ("runtime/ (other)", ("runtime/",)),
)
"""Innermost match wins; a rule's pattern is a file path part or a function name."""


def stage_of(stack: list[tuple[str, str]]) -> str:
    func, file = stack[-1]
    if func in ("Runner.run", "run_forever", "BaseEventLoop.run_forever") and "asyncio" in file:
        return EVENT_LOOP
    for func, file in reversed(stack):
        for name, patterns in STAGE_RULES:
            if any(p in file or p == func for p in patterns):
                return name
    return "other"


def frames(stack: str) -> list[tuple[str, str]]:
    out = []
    for raw in stack.split(";"):
        m = _FRAME.match(raw.strip())
        out.append((m["func"], m["file"]) if m else (raw, ""))
    return out


SENDS = "socket sends (send() system calls)"
_SENDING = {"OneWrite.write", "OneWrite.flush", "_Protocol.send", "StreamWriter.writelines"}
_UVICORN_WRITES = ("httptools_impl.py:524)", "httptools_impl.py:551)")
"""uvicorn 0.54's two ``transport.write`` lines in ``RequestResponseCycle.send`` (headers,
body): before the gateway wrote responses itself, its sends were charged there."""


def group_of(stack: list[tuple[str, str]], innermost: str = "") -> str:
    func, file = stack[-1]
    if func in _SENDING or innermost.endswith(_UVICORN_WRITES):
        return SENDS
    if func in ("Runner.run", "run_forever", "BaseEventLoop.run_forever") and "asyncio" in file:
        return EVENT_LOOP
    for _, file in reversed(stack):
        for name, patterns in GROUPS:
            if any(p in file for p in patterns):
                return name
    return "other"


def breakdown(paths: list[Path], top: int = 0, by_stage: bool = False) -> dict[str, object]:
    groups: Counter[str] = Counter()
    lines: Counter[str] = Counter()
    stages: Counter[str] = Counter()
    total = 0
    for path in paths:
        for line in path.read_text().splitlines():
            stack_text, _, count_text = line.rpartition(" ")
            if not count_text.isdigit():
                continue
            n = int(count_text)
            stack = frames(stack_text)
            total += n
            innermost = stack_text.rsplit(";", 1)[-1].strip()
            groups[stage_of(stack) if by_stage else group_of(stack, innermost)] += n
            lines[innermost] += n
            names = {f for f, _ in stack}
            for stage in STAGES:
                if stage in names:
                    stages[stage] += n
    return {
        "samples": total,
        "groups": {k: round(v / total, 3) for k, v in groups.most_common()} if total else {},
        "stages": {k: round(v / total, 3) for k, v in stages.most_common()} if total else {},
        "lines": {k: round(v / total, 3) for k, v in lines.most_common(top)} if total else {},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--top", type=int, default=0, help="also the N busiest source lines")
    parser.add_argument("--by-stage", action="store_true", help="groups: request stages")
    parser.add_argument("--cpu-us", type=float, help="CPU µs per request, to scale shares by")
    args = parser.parse_args()
    result = breakdown(args.files, args.top, args.by_stage)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{result['samples']} samples")
    for title in ("groups", "stages", "lines"):
        print(f"{title}:")
        for k, v in result[title].items():  # type: ignore[attr-defined]
            us = f"  {v * args.cpu_us:6.1f} µs" if args.cpu_us and title != "lines" else ""
            print(f"  {v:6.1%}{us}  {k}")


if __name__ == "__main__":
    main()
