"""A private ``redis-server`` on a free loopback port, for ``inferq up`` and the test suite."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from runtime.cluster import seed_urls

INSTALL_HINT = (
    "install Redis 7 (Debian/Ubuntu: `sudo apt-get install redis-server`; macOS: "
    "`brew install redis`) or point --redis / INFERQ_REDIS_URL at a running Redis"
)


class RedisServerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def answers(url: str, timeout_s: float = 0.5) -> bool:
    """Whether a Redis at ``url`` (any of its seeds, for a cluster) answers PING."""
    for seed in seed_urls(url):
        client = redis.Redis.from_url(
            seed, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        try:
            if client.ping():
                return True
        except (redis.RedisError, OSError):
            continue
        finally:
            client.close()
    return False


class RedisServer:
    """Starts ``redis-server`` in a temporary folder that ``stop`` removes, or in ``data_dir``
    (kept). Either folder outlives the process until ``stop``: ``spawn`` after a crash starts it
    again on the same port and folder, so with AOF turned on it replays what was written before
    the crash (``inferq up`` supervises its private Redis this way)."""

    def __init__(
        self,
        *,
        port: int | None = None,
        binary: str = "redis-server",
        password: str | None = None,
        extra_args: tuple[str, ...] = (),
        data_dir: Path | None = None,
    ) -> None:
        self.port = port or free_port()
        self.binary = binary
        self.password = password
        self.extra_args = extra_args
        self.data_dir = data_dir
        self._process: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def folder(self) -> str:
        """Where it keeps its data (the AOF, when ``extra_args`` turn it on)."""
        if self.data_dir is not None:
            return str(self.data_dir)
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="inferq-redis-")
        return self._dir.name

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        process = self.spawn(timeout_s)
        if process.poll() is not None:
            err = process.stderr.read().decode() if process.stderr else ""
            self.stop()
            raise RedisServerError(f"redis-server exited at start: {err.strip()}")
        if not answers(self.url, 0.2):
            self.stop()
            raise RedisServerError(f"redis-server did not answer within {timeout_s} s")
        return self

    def spawn(self, timeout_s: float = 10.0) -> subprocess.Popen[bytes]:
        """The server's process: this one if it runs, else a new one on the same port and
        folder (so it replays its AOF), returned once it answers, exits or ``timeout_s`` is
        over. It never raises for a server that fails: a supervisor (``inferq up``) sees the
        exit and restarts it with backoff."""
        if self._process is not None and self._process.poll() is None:
            return self._process
        path = shutil.which(self.binary)
        if path is None:
            raise RedisServerError(f"no `{self.binary}` on PATH: {INSTALL_HINT}")
        if self._process is not None and self._process.stderr:
            self._process.stderr.close()
        self._process = process = subprocess.Popen(
            [
                path,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.folder,
                "--loglevel",
                "warning",
                *(["--requirepass", self.password] if self.password else []),
                *self.extra_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            # Own process group: a Ctrl-C meant for `inferq up` must not stop Redis before the
            # gateway and workers have drained into it.
            process_group=0,
        )
        deadline = time.monotonic() + timeout_s
        while process.poll() is None and time.monotonic() < deadline:
            if answers(self.url, 0.2):
                break
            time.sleep(0.05)
        return process

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if self._process is not None and self._process.stderr:
            self._process.stderr.close()
        self._process = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def kill(self) -> None:
        """SIGKILL, as a crash would: no final AOF flush, no clean shutdown."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self.stop()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
