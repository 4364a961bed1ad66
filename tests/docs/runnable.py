"""The runnable blocks of the README and of docs/*.md, run as a newcomer pastes them.

A fenced block is *runnable* when the line before its opening fence is ``<!-- runnable -->`` (an
HTML comment: invisible on GitHub, and the fence keeps its language, so other tests that find a
block by its language still do). Two kinds:

- a **transcript** (``text`` or ``console``): ``$ `` lines are commands (a line ending in ``\\``
  goes on), the lines after one are what it printed;
- a **script** (``sh`` or ``bash``): the whole block, run under ``set -eo pipefail``.

All the runnable blocks of one document run in order, in one ``bash`` session (so ``export`` and
variables carry from one block to the next, as in a terminal), against a live ``inferq up`` on free
ports: the documented ``127.0.0.1:8000`` (or ``localhost:8000``) and the Redis URL ``make run``
printed become the live ones, and ``pkill -STOP|-CONT -f 'inferq worker'`` signals only the live
stack's workers. Every command must exit 0, and what a transcript shows must appear in what the
command printed, line by line in order (``shown_in``): lines the document leaves out (most of
``curl -i``'s headers) may be there too, values that differ from run to run (times, ids, worker
names) are masked, runs of spaces count as one, and ``...`` in a shown line stands for anything.

``python -m tests.docs.runnable --write [FILE ...]`` runs the blocks the same way and writes what
each transcript command printed into the file: how the "real output" blocks are regenerated.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- runnable -->"
DOCUMENTED_URL = "127.0.0.1:8000"
DOCUMENTED_REDIS = re.compile(r"redis://127\.0\.0\.1:\d+/0")
TRANSCRIPTS = ("text", "console")
SCRIPTS = ("sh", "bash")
COMMAND_TIMEOUT_S = 90.0
UNSHOWN_HEADERS = ("date:", "server:", "content-length:", "traceparent:")
"""curl -i headers that ``--write`` leaves out: they say nothing about inferq."""

_FENCE = re.compile(r"^(`{3,})(\w*)[^`]*$")


@dataclass(frozen=True)
class Command:
    text: str
    """As written, continuation lines included."""
    shown: tuple[str, ...]
    """What the document says it printed (may be empty)."""
    line: int
    """1-based line of the command in its document."""


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    """1-based line of the opening fence."""
    language: str
    body: str
    runnable: bool
    end: int = 0
    """1-based line of the closing fence."""

    @property
    def transcript(self) -> bool:
        return self.language in TRANSCRIPTS

    def where(self, line: int | None = None) -> str:
        return f"{self.path.relative_to(ROOT)}:{line or self.line}"

    def commands(self) -> list[Command]:
        """A transcript's commands with what each printed; a script is one command."""
        if not self.transcript:
            return [Command(self.body, (), self.line + 1)]
        commands: list[Command] = []
        lines = self.body.splitlines()
        i = 0
        while i < len(lines):
            if not lines[i].startswith("$ "):
                if commands or lines[i].strip():
                    raise ValueError(f"{self.where(self.line + 1 + i)}: output before any $ line")
                i += 1
                continue
            start = i
            text = [lines[i][2:]]
            while text[-1].endswith("\\") and i + 1 < len(lines):
                i += 1
                text.append(lines[i])
            i += 1
            shown = []
            while i < len(lines) and not lines[i].startswith("$ "):
                if lines[i].strip():
                    shown.append(lines[i])
                i += 1
            commands.append(Command("\n".join(text), tuple(shown), self.line + 1 + start))
        return commands


def blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file, in order."""
    found: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, language = opening.group(1), opening.group(2)
        before = next((x.strip() for x in reversed(lines[:i]) if x.strip()), "")
        end = next(
            (j for j in range(i + 1, len(lines)) if lines[j].strip() == fence),
            None,
        )
        if end is None:
            raise ValueError(f"{path}:{i + 1}: a code block that never closes")
        body = "\n".join(lines[i + 1 : end]) + "\n"
        found.append(Block(path, i + 1, language, body, before == MARKER, end + 1))
        i = end + 1
    return found


def runnable(path: Path) -> list[Block]:
    marked = [b for b in blocks(path) if b.runnable]
    for b in marked:
        if b.language not in TRANSCRIPTS + SCRIPTS:
            raise ValueError(
                f"{b.where()}: a runnable block must be one of {TRANSCRIPTS + SCRIPTS}"
            )
    return marked


def documents() -> list[Path]:
    """The README and every page of docs/ that has a runnable block."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [p for p in pages if runnable(p)]


# -- what varies from run to run --------------------------------------------------------------

_MASKS = [
    (re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(\.\d+)?Z?"), "<time>"),
    (re.compile(r"\b\d\d:\d\d:\d\d\b"), "<time>"),
    (re.compile(r"\b\d{13}-\d+\b"), "<entry>"),  # a Redis stream entry id
    (re.compile(r"\b[\w.]+(-[\w.]+)*-\d+-[0-9a-f]{6}-\d+\b"), "<worker>"),  # host-pid-random-i
    (re.compile(r"(?<![\w-])[\w-]{32}(?![\w-])"), "<id>"),  # job ids, trace ids
    (re.compile(r"(?<![\w.])\d+(\.\d+)?(ms|s)\b"), "<duration>"),
]


def masked(line: str) -> str:
    for pattern, placeholder in _MASKS:
        line = pattern.sub(placeholder, line)
    return " ".join(line.split())


def _pattern(shown: str) -> re.Pattern[str]:
    parts = masked(shown).split("...")
    return re.compile(".*".join(re.escape(p) for p in parts))


def shown_in(shown: tuple[str, ...] | list[str], printed: str) -> str | None:
    """None if every shown line matches a printed line, in order; else the first that does not."""
    lines = [masked(x) for x in printed.replace("\r", "").splitlines()]
    at = 0
    for line in shown:
        pattern = _pattern(line)
        while at < len(lines) and not pattern.fullmatch(lines[at]):
            at += 1
        if at == len(lines):
            return line
        at += 1
    return None


# -- the live side ----------------------------------------------------------------------------


@dataclass
class Live:
    """Where the documents' commands go instead of the documented addresses."""

    url: str
    """``127.0.0.1:PORT`` of the live gateway."""
    redis_url: str
    worker_pids: Callable[[], list[int]]
    substitutions: list[tuple[str, str]] = field(default_factory=list)
    """(live, documented) pairs seen, for writing outputs back."""

    def command(self, text: str) -> str:
        """The documented command, aimed at the live stack."""
        text = text.replace("localhost:8000", self.url).replace(DOCUMENTED_URL, self.url)
        text = DOCUMENTED_REDIS.sub(self.redis_url, text)
        pids = " ".join(str(p) for p in self.worker_pids())
        return re.sub(r"pkill -(STOP|CONT) -f 'inferq worker'", rf"kill -\1 {pids}", text)

    def documented(self, printed: str, original_redis: str) -> str:
        """Printed output, with the live addresses written back as the document has them."""
        return printed.replace(self.url, DOCUMENTED_URL).replace(self.redis_url, original_redis)


class Shell:
    """One ``bash`` session fed command by command, as a terminal is."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self._proc = subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=env,
            start_new_session=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        with self._proc.stdout:
            for raw in self._proc.stdout:
                self._lines.put(raw.decode(errors="replace"))
        self._lines.put(None)

    def run(
        self, command: str, *, strict: bool = False, timeout_s: float = COMMAND_TIMEOUT_S
    ) -> tuple[int | None, str]:
        """(exit status, what it printed); stdin is /dev/null. ``strict``: under
        ``set -eo pipefail`` (a failing line ends the session: status None)."""
        token = uuid.uuid4().hex
        on, off = ("set -eo pipefail\n", "\nset +eo pipefail") if strict else ("", "")
        script = f"{{\n{on}{command}{off}\n}} </dev/null 2>&1\nprintf '\\n{token} %d\\n' $?\n"
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(script.encode())
            self._proc.stdin.flush()
        except BrokenPipeError:
            return None, ""
        out: list[str] = []
        while True:
            try:
                line = self._lines.get(timeout=timeout_s)
            except queue.Empty:
                printed = "".join(out)
                raise TimeoutError(f"no answer in {timeout_s} s; printed:\n{printed}") from None
            if line is None:
                return None, "".join(out)
            if line.startswith(token):
                return int(line.split()[1]), "".join(out).rstrip("\n")
            out.append(line)

    def close(self) -> None:
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        if self._proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self._proc.stdin.close()
        self._reader.join(10)


def shell_env() -> dict[str, str]:
    """The test's environment without inferq settings (the documents set their own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERQ_")}
    env["INFERQ_PYTHON"] = sys.executable
    return env


PRELUDE = (
    # This checkout's code, whatever `inferq` the PATH has (a function beats the PATH, also
    # after `. .venv/bin/activate`).
    'inferq() { "$INFERQ_PYTHON" -m inferq "$@"; }\nexport -f inferq\n'
)


@dataclass
class Outcome:
    block: Block
    command: Command
    status: int | None
    printed: str


def run_document(path: Path, live: Live, shell: Shell) -> Iterator[Outcome]:
    """Run every runnable block of ``path`` in ``shell``, yielding each command's outcome."""
    status, printed = shell.run(PRELUDE)
    assert status == 0, printed
    for block in runnable(path):
        for command in block.commands():
            status, printed = shell.run(live.command(command.text), strict=not block.transcript)
            yield Outcome(block, command, status, printed)
            if status is None:
                return


@contextlib.contextmanager
def live_stack(*flags: str) -> Iterator[Live]:
    """``inferq up`` serving the repository's models, as ``make run`` does, on a private Redis
    of its own and free ports, in the default namespace."""
    from inferq.redisserver import RedisServer
    from tests.upstack import up_processes

    with RedisServer() as redis, up_processes(redis.url, "inferq", ROOT / "models") as start:
        up = start(*flags)
        up.wait_for(lambda: any(x.startswith("inferq is serving") for x in up.lines), "ready", 180)

        def workers() -> list[int]:
            slots = {e["child"] for e in up.events("child started")}
            return [up.pid(s) for s in sorted(slots) if s.startswith("worker ")]

        yield Live(f"127.0.0.1:{up.port}", redis.url, workers)
        up.stop()


# -- writing outputs back ---------------------------------------------------------------------


def rewrite(path: Path, outcomes: list[Outcome], live: Live) -> str:
    """The document with each transcript command's shown lines replaced by what it printed."""
    lines = path.read_text().splitlines()
    regions: dict[int, tuple[int, list[str]]] = {}
    """First line of a command's output -> (its last line, the new output); 1-based."""
    for o in outcomes:
        if not o.block.transcript:
            continue
        first = o.command.line + o.command.text.count("\n") + 1
        later = [c.line for c in o.block.commands() if c.line > o.command.line]
        last = (later[0] if later else o.block.end) - 1
        original = DOCUMENTED_REDIS.search(o.command.text)
        printed = live.documented(o.printed, original.group(0) if original else live.redis_url)
        new = [x.rstrip("\r") for x in printed.splitlines()]
        new = [x for x in new if not x.lower().startswith(UNSHOWN_HEADERS)]
        if last >= first and not lines[last - 1].strip():
            new.append("")  # the blank line before the next command stays
        regions[first] = (last, new)
    result: list[str] = []
    skip_to = 0
    for n in range(1, len(lines) + 2):
        if n in regions:
            skip_to, new = regions[n]
            result.extend(new)
        if n <= skip_to or n > len(lines):
            continue
        result.append(lines[n - 1])
    return "\n".join(result) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="write what each command printed")
    parser.add_argument("files", nargs="*", type=Path)
    args = parser.parse_args(argv)
    files = [f.resolve() for f in args.files] or documents()
    failed = 0
    with live_stack() as live:
        for path in files:
            shell = Shell(ROOT, shell_env())
            try:
                outcomes = list(run_document(path, live, shell))
            finally:
                shell.close()
            for o in outcomes:
                where = o.block.where(o.command.line)
                if o.status != 0:
                    failed += 1
                    print(f"{where}: exit {o.status}\n{o.printed}", file=sys.stderr)
                elif o.block.transcript and (missing := shown_in(o.command.shown, o.printed)):
                    print(f"{where}: not printed: {missing}", file=sys.stderr)
            if args.write:
                path.write_text(rewrite(path, outcomes, live))
                print(f"wrote {path.relative_to(ROOT)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
