"""A real ``inferq up`` in a subprocess, for the tests of supervision and the chaos suite: every
line it prints is kept (stdout and stderr apart, and both together), and its JSON log records
(its children's too) are decoded."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from inferq.redisserver import free_port

TAIL_LINES = 30
"""How many of the last lines of each stream a failed ``wait_for`` shows."""


class UpProcess:
    """A running ``inferq up``; every line it prints is kept, JSON log lines decoded.
    ``lines`` holds both streams in the order they were read, ``stdout``/``stderr`` each one."""

    def __init__(self, proc: subprocess.Popen[str], port: int, namespace: str) -> None:
        self.proc, self.port, self.namespace = proc, port, namespace
        self.lines: list[str] = []
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        assert proc.stdout is not None
        # stderr may be sent to stdout (stderr=STDOUT): then ``stdout`` holds both.
        pipes = [(proc.stdout, self.stdout)]
        if proc.stderr is not None:
            pipes.append((proc.stderr, self.stderr))
        self._readers = [
            threading.Thread(target=self._read, args=pipe, daemon=True) for pipe in pipes
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, pipe: IO[str], into: list[str]) -> None:
        with pipe:
            for line in pipe:
                line = line.rstrip("\n")
                into.append(line)
                self.lines.append(line)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> list[dict[str, Any]]:
        """Every JSON log line, in order. Children share the terminal (here a pipe), so a line
        may hold two records when two threads of one child write at once: both are kept."""
        records = []
        decoder = json.JSONDecoder()
        for line in list(self.lines):
            pos = line.find("{")
            while pos != -1:
                try:
                    doc, end = decoder.raw_decode(line, pos)
                except json.JSONDecodeError:
                    # Not a record from here (text, or one cut by another child's write): a
                    # record may still begin further on.
                    pos = line.find("{", pos + 1)
                    continue
                records.append(doc)
                pos = line.find("{", end)
        return records

    def events(self, name: str, **match: object) -> list[dict[str, Any]]:
        """Log records whose event is ``name`` (and whose fields match)."""
        return [
            doc
            for doc in self.log()
            if doc.get("event") == name and all(doc.get(k) == v for k, v in match.items())
        ]

    def pid(self, child: str) -> int:
        """The pid of ``child`` (``worker 0``, ``gateway 1``) now."""
        started = self.events("child started", child=child) + self.events(
            "child restarted", child=child
        )
        return int(started[-1]["pid"])

    def wait_for(self, condition: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
        """Poll ``condition`` until it holds; fail after ``timeout_s``, or as soon as the
        process has exited without it holding, saying what was awaited, the exit status and
        the last lines of its stdout and stderr (as they were at the failure)."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            if self.proc.poll() is not None:
                self.join()  # what it printed last may decide the condition
                if condition():
                    return
                raise AssertionError(self._failure(f"inferq up exited while waiting for {what}"))
            if time.monotonic() > deadline:
                raise AssertionError(
                    self._failure(f"timed out after {timeout_s} s waiting for {what}")
                )
            time.sleep(0.005)

    def _failure(self, headline: str) -> str:
        code = self.proc.poll()
        status = "still running" if code is None else f"exit status {code}"
        parts = [f"{headline} ({status})"]
        for name, lines in (("stdout", self.stdout), ("stderr", self.stderr)):
            tail = list(lines)[-TAIL_LINES:]
            shown = "\n".join(tail) if tail else "(nothing)"
            parts.append(f"last {len(tail)} of {len(lines)} lines of {name}:\n{shown}")
        return "\n".join(parts)

    def wait_ready(self) -> None:
        self.wait_for(lambda: any(x.startswith("inferq is serving") for x in self.lines), "ready")

    def stop(self) -> int:
        """SIGTERM, as a terminal's Ctrl-C or a service manager does; its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(60)
        self.join()
        return code

    def join(self) -> None:
        """Until everything it printed has been read (after it exited)."""
        for reader in self._readers:
            reader.join(10)


@contextmanager
def up_processes(
    redis_url: str, namespace: str, repo: Path, *common: str
) -> Iterator[Callable[..., UpProcess]]:
    """A factory ``start(*flags)`` of ``inferq up`` on this Redis and namespace, serving
    ``repo`` on a free port (``common`` flags on every one); all are killed at the end."""
    started: list[UpProcess] = []

    def start(*extra: str) -> UpProcess:
        port = free_port()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "inferq",
                "up",
                "--redis",
                redis_url,
                "--namespace",
                namespace,
                "--port",
                str(port),
                "--model-repository",
                str(repo),
                # No gRPC (these tests are HTTP's): the default 8001 may be held by anything else.
                "--grpc-port",
                "0",
                "--metrics-port",
                "0",
                "--gateway-metrics-port",
                "0",
                "--log-level",
                "info",
                *common,
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        u = UpProcess(proc, port, namespace)
        started.append(u)
        return u

    try:
        yield start
    finally:
        for u in started:
            if u.proc.poll() is None:
                u.proc.kill()
                u.proc.wait()
            u.join()
