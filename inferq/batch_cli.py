"""``inferq batch run|submit|status|wait|cancel|download``: batches from the command line, over
the Python client (``inferq.client``).

``run in.jsonl -o out.jsonl`` submits the file as one batch, shows a progress bar (lines done,
failed, rate, ETA) and appends each answered line to ``out.jsonl`` (and failed ones to
``--errors``) as soon as the batch has it. It keeps the batch's id beside the output
(``out.jsonl.batch``), so run again after Ctrl-C or a crash it follows the same batch: nothing
finished is run again, and lines already in the output are not written twice. Should the batch
be gone (deleted, past its retention), the rerun submits only the lines the output lacks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import httpx
from tqdm import tqdm

from inferq.client import FINAL_BATCH, Batch, Client, InferqError
from protocol.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_NOT_FOUND, EXIT_OK, EXIT_USAGE

DEFAULT_URL = "http://127.0.0.1:8000"


def add_parser(subparsers: Any, environ: Mapping[str, str]) -> None:
    batch = subparsers.add_parser(
        "batch",
        help="run a JSONL file of requests as a batch, and manage batches",
        description="Batches of inference requests (docs/batches.md): one JSON request a line, "
        "each run as a low-priority job; the output is one JSON line per input line.",
    )
    batch.add_argument(
        "--url",
        default=environ.get("INFERQ_URL", DEFAULT_URL),
        help=f"the gateway (env INFERQ_URL; default {DEFAULT_URL})",
    )
    actions = batch.add_subparsers(dest="action", required=True, metavar="ACTION")
    run = actions.add_parser("run", help="submit, follow with a progress bar, write the output")
    run.add_argument("input", type=Path, help="JSONL: one request a line")
    run.add_argument("-o", "--output", type=Path, required=True, help="where output lines go")
    run.add_argument("--errors", type=Path, help="where error lines go (default: not kept)")
    _create_flags(run)
    run.add_argument("--poll-s", type=float, default=0.5, help="how often progress is read")
    submit = actions.add_parser("submit", help="submit a JSONL file; print the batch")
    submit.add_argument("input", type=Path)
    _create_flags(submit)
    for name, text in (
        ("status", "the batch, as JSON"),
        ("wait", "follow a batch to its end with a progress bar"),
        ("cancel", "cancel a batch: lines not started are not run"),
    ):
        actions.add_parser(name, help=text).add_argument("id", help="the batch id")
    download = actions.add_parser("download", help="write a batch's output (and errors)")
    download.add_argument("id")
    download.add_argument("-o", "--output", type=Path, required=True)
    download.add_argument("--errors", type=Path)


def _create_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="the model of lines that are bare V2 requests")
    parser.add_argument("--completion-window", help="e.g. 24h (the default), 30m")


def run(args: argparse.Namespace) -> int:
    try:
        with Client(args.url) as client:
            return _ACTIONS[args.action](client, args)
    except InferqError as e:
        print(f"inferq batch {args.action}: {e}", file=sys.stderr)
        return EXIT_NOT_FOUND if e.status == 404 else EXIT_FAILED
    except httpx.HTTPError as e:
        print(f"inferq batch {args.action}: cannot reach {args.url}: {e}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as e:
        print(f"inferq batch {args.action}: {e}", file=sys.stderr)
        return EXIT_USAGE


def _submit(client: Client, args: argparse.Namespace) -> int:
    batch = _create(client, args.input.read_bytes().splitlines(), args)
    print(json.dumps(batch.last, indent=2))
    return EXIT_OK


def _create(client: Client, lines: list[bytes], args: argparse.Namespace) -> Batch:
    return client.batch(lines, model=args.model, completion_window=args.completion_window)


def _status(client: Client, args: argparse.Namespace) -> int:
    print(json.dumps(client.get_batch(args.id).last, indent=2))
    return EXIT_OK


def _cancel(client: Client, args: argparse.Namespace) -> int:
    print(json.dumps(client.get_batch(args.id).cancel(), indent=2))
    return EXIT_OK


def _wait(client: Client, args: argparse.Namespace) -> int:
    batch = client.get_batch(args.id)
    with _Progress(batch.last) as bar:
        doc = batch.wait(progress=bar.update)
    print(json.dumps(doc, indent=2))
    return EXIT_OK if doc["status"] == "completed" else EXIT_FAILED


def _download(client: Client, args: argparse.Namespace) -> int:
    batch = client.get_batch(args.id)
    with args.output.open("w") as out:
        for doc in batch.output():
            out.write(json.dumps(doc) + "\n")
    if args.errors is not None:
        with args.errors.open("w") as err:
            for doc in batch.errors():
                err.write(json.dumps(doc) + "\n")
    return EXIT_OK


def _run(client: Client, args: argparse.Namespace) -> int:
    raw = args.input.read_bytes()
    state_path = args.output.with_name(args.output.name + ".batch")
    digest = hashlib.sha256(raw).hexdigest()
    done = _answered(args.output) | (_answered(args.errors) if args.errors else set())
    batch = _resumed(client, state_path, digest)
    if batch is None:
        lines = [x for n, x in enumerate(raw.splitlines(), 1) if x.strip()]
        todo = [x for x in lines if _custom_id(x) not in done]
        if not todo:
            print(f"inferq batch run: every line is in {args.output} already", file=sys.stderr)
            return EXIT_OK
        batch = _create(client, todo, args)
        state_path.write_text(json.dumps({"batch_id": batch.id, "input_sha256": digest}))
        print(f"batch {batch.id}: {len(todo)} lines submitted", file=sys.stderr)
    else:
        print(f"batch {batch.id}: resumed", file=sys.stderr)
    try:
        doc = _follow(batch, args, done)
    except KeyboardInterrupt:
        print(
            f"\ninferq batch run: interrupted; batch {batch.id} goes on: run the same command "
            "again to resume",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    state_path.unlink(missing_ok=True)
    counts = doc["request_counts"]
    print(
        f"batch {batch.id} {doc['status']}: {counts['completed']} completed, "
        f"{counts['failed']} failed",
        file=sys.stderr,
    )
    return EXIT_OK if doc["status"] == "completed" else EXIT_FAILED


def _resumed(client: Client, state_path: Path, digest: str) -> Batch | None:
    """The batch a run of the same input started, if the server still has it."""
    try:
        state = json.loads(state_path.read_text())
    except (OSError, ValueError):
        return None
    if state.get("input_sha256") != digest:
        return None
    try:
        return client.get_batch(state["batch_id"])
    except InferqError as e:
        if e.status == 404:
            return None
        raise


def _follow(batch: Batch, args: argparse.Namespace, done: set[str]) -> dict[str, Any]:
    """Follow the batch to its end, appending new answers as they come."""
    with (
        args.output.open("a") as out,
        args.errors.open("a") if args.errors else open_null() as err,
        _Progress(batch.last) as bar,
    ):
        written = -1
        while True:
            doc = batch.status()
            bar.update(doc)
            counts = doc["request_counts"]
            answered = counts["completed"] + counts["failed"]
            final = doc["status"] in FINAL_BATCH
            if answered != written or final:
                _append(batch.output(), out, done)
                if args.errors:
                    _append(batch.errors(), err, done)
                written = answered
            if final:
                return doc
            batch.client._sleep(args.poll_s)


def _append(lines: Any, out: IO[str], done: set[str]) -> None:
    """Append the answers not yet written as one write of whole lines, so that a reader of the
    file (or an interrupt) never sees a line cut short by a buffer boundary."""
    chunk: list[str] = []
    for doc in lines:
        key = doc.get("custom_id") or f"#{doc.get('line')}"
        if key not in done:
            chunk.append(json.dumps(doc, separators=(",", ":")) + "\n")
            done.add(key)
    if chunk:
        out.write("".join(chunk))
        out.flush()


def _answered(path: Path | None) -> set[str]:
    """The custom ids (or ``#line``) already written to an output or errors file. A last line
    cut short by a crash (no newline) is cut off the file: its answer is written again, on a
    line of its own."""
    if path is None or not path.exists():
        return set()
    text = path.read_text()
    if text and not text.endswith("\n"):
        whole = text.rfind("\n") + 1
        with path.open("r+b") as f:
            f.truncate(len(text[:whole].encode()))
        text = text[:whole]
    out = set()
    for line in text.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue  # not an answer (edited by hand?): its line's answer is written again
        out.add(doc.get("custom_id") or f"#{doc.get('line')}")
    return out


def _custom_id(raw: bytes) -> str | None:
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    value = doc.get("custom_id", doc.get("id"))
    return value if isinstance(value, str) else None


class _Progress:
    """A tqdm bar over a batch's lines: done, failed, rate and ETA."""

    def __init__(self, doc: dict[str, Any]) -> None:
        total = doc.get("request_counts", {}).get("total") or None
        self._bar = tqdm(total=total, unit="line", desc=doc.get("id", "batch")[:18])
        self._shown = 0

    def update(self, doc: dict[str, Any]) -> None:
        counts = doc["request_counts"]
        answered = counts["completed"] + counts["failed"]
        self._bar.update(answered - self._shown)
        self._shown = answered
        self._bar.set_postfix(failed=counts["failed"], status=doc["status"], refresh=False)

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *_: object) -> None:
        self._bar.close()


class open_null:
    """A file that drops what is written (no ``--errors``)."""

    def __enter__(self) -> open_null:
        return self

    def __exit__(self, *_: object) -> None:
        pass

    def write(self, _: str) -> None:
        pass

    def flush(self) -> None:
        pass


_ACTIONS = {
    "run": _run,
    "submit": _submit,
    "status": _status,
    "wait": _wait,
    "cancel": _cancel,
    "download": _download,
}
