"""``inferq loadgen`` / ``python -m loadgen``: flags, environment, URL policy, end to end."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from loadgen.cli import (
    DEFAULT_URL,
    _mode,
    add_parser,
    main,
    resolve_url,
    run,
)
from loadgen.schedule import RateSchedule
from loadgen.settings import LoadgenSettings, is_loopback
from protocol.exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from protocol.options import from_args

METADATA = {
    "name": "m",
    "versions": ["1"],
    "platform": "test",
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 1]}],
}


def parse(argv: list[str], environ: dict[str, str] | None = None) -> argparse.Namespace:
    """Parse as ``inferq`` would, with the subcommand registered by ``add_parser``."""
    parser = argparse.ArgumentParser(prog="inferq")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub, environ or {})
    return parser.parse_args(["loadgen", *argv])


def settings(argv: list[str], environ: dict[str, str] | None = None) -> LoadgenSettings:
    """The settings ``run`` builds from those arguments."""
    built: LoadgenSettings = from_args(LoadgenSettings, parse(argv, environ))
    return built


def test_subcommand_flags_and_defaults() -> None:
    args = parse(["--model", "digits", "--rate", "100:1000:10s", "--binary", "--rows", "4"])
    assert args.func is run
    assert args.model == "digits" and args.binary and args.rows == 4
    assert isinstance(args.rate, RateSchedule) and args.rate.length_s == 10
    assert args.concurrency is None and args.duration is None and args.warmup == 1.0
    assert args.max_requests == 10_000_000 and args.max_connections == 512
    assert _mode(from_args(LoadgenSettings, args)) == (args.rate, 0)
    given = settings(
        ["-c", "8", "-d", "2m", "--shape", "x=2,4", "--param", "priority=1", "-H", "a: b"]
    )
    assert _mode(given) == (None, 8)
    assert given.duration == 120.0
    assert given.shape == (("x", (2, 4)),) and given.param == (("priority", 1),)
    assert given.header == (("a", "b"),)
    assert _mode(settings([])) == (None, 16)
    assert settings([]) == LoadgenSettings()  # no flag, no variable: the declared defaults


def test_environment_supplies_defaults_and_the_command_line_wins() -> None:
    env = {
        "INFERQ_LOADGEN_DURATION": "5s",
        "INFERQ_LOADGEN_MAX_CONNECTIONS": "7",
        "INFERQ_LOADGEN_CONCURRENCY": "3",
        "INFERQ_LOADGEN_MODEL": "m",
    }
    got = settings([], env)
    assert (got.duration, got.max_connections, got.model) == (5.0, 7, "m")
    assert _mode(got) == (None, 3)
    assert _mode(settings(["--rate", "50"], env))[0] is not None  # the flag beats the env
    assert settings(["--duration", "1"], env).duration == 1.0
    env_rate = {"INFERQ_LOADGEN_RATE": "200", "INFERQ_LOADGEN_CONCURRENCY": "3"}
    schedule, _ = _mode(settings([], env_rate))
    assert schedule is not None and schedule.final_rps == 200
    assert _mode(settings(["-c", "2"], env_rate)) == (None, 2)


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["--rate", "fast"], {}, "--rate"),
        (["--concurrency", "0"], {}, "--concurrency"),
        (["--rate", "10", "--concurrency", "2"], {}, "not allowed with"),
        (["--shape", "x"], {}, "INPUT=D1,D2"),
        (["--param", "novalue"], {}, "KEY=VALUE"),
        (["--duration", "-1"], {}, "--duration"),
        ([], {"INFERQ_LOADGEN_MAX_REQUESTS": "lots"}, "INFERQ_LOADGEN_MAX_REQUESTS"),
    ],
)
def test_bad_flags_are_usage_errors(argv, environ, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(argv, environ)
    assert exc.value.code == EXIT_USAGE
    assert message in capsys.readouterr().err


def test_only_a_url_on_the_command_line_may_leave_the_machine() -> None:
    assert resolve_url(settings([])) == DEFAULT_URL
    assert resolve_url(settings([], {"INFERQ_LOADGEN_URL": "http://localhost:9"})).endswith(":9")
    with pytest.raises(ValueError, match="pass --url"):
        settings([], {"INFERQ_LOADGEN_URL": "http://10.0.0.5:8000"})
    explicit = settings(["--url", "http://10.0.0.5:8000"], {"INFERQ_LOADGEN_URL": "http://x:1"})
    assert resolve_url(explicit) == "http://10.0.0.5:8000"
    with pytest.raises(ValueError, match="https"):
        resolve_url(settings(["--url", "https://127.0.0.1/"]))
    assert all(map(is_loopback, ["127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["10.0.0.1", "example.com", "0.0.0.0", "::"]))


def test_a_non_loopback_url_from_the_environment_is_refused_before_sending(capsys) -> None:
    rc = main(["-d", "0.1"], environ={"INFERQ_LOADGEN_URL": "http://192.0.2.1:8000"})
    assert rc == EXIT_USAGE
    assert "only loopback hosts are taken from the environment" in capsys.readouterr().err


def test_png_without_matplotlib_is_refused_before_any_load(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    # Port 1 answers nothing: the run would fail with exit 1 if it started.
    rc = main(["--url", "http://127.0.0.1:1", "-d", "0.1", "--png", str(tmp_path / "r.png")])
    assert rc == EXIT_USAGE
    assert "--png: charts need matplotlib: pip install 'inferq[charts]'" in capsys.readouterr().err
    assert not (tmp_path / "r.png").exists()


class ServerThread:
    """The tiny server on its own loop in a thread, for the CLI (which runs its own loop)."""

    def __init__(self, server_cls: Any, handler: Any) -> None:
        self._cls = server_cls
        self._handler = handler
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.url = ""
        self.requests: list[Any] = []
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with self._cls(self._handler) as srv:
            self.url = srv.url
            self.requests = srv.requests
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> ServerThread:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def v2_handler(response_bytes: Any) -> Any:
    """Model metadata, ``/infer`` and a minimal jobs API for model ``m``."""
    jobs: dict[str, int] = {}

    def reply(doc: Any, status: int = 200, **headers: str) -> bytes:
        headers["content-type"] = "application/json"
        return response_bytes(json.dumps(doc).encode(), status=status, headers=headers)

    def handler(req: Any) -> bytes:
        if req.method == "GET" and req.path == "/v2/models/m":
            return reply(METADATA)
        if req.method == "POST" and req.path == "/v2/models/m/infer":
            return reply({"model_name": "m", "outputs": []})
        if req.method == "POST" and req.path == "/v2/models/m/jobs":
            job_id = f"j{len(jobs)}"
            jobs[job_id] = 0
            return reply({"id": job_id, "status": "queued"}, 202, location=f"/v2/jobs/{job_id}")
        if req.method == "GET" and req.path.startswith("/v2/jobs/"):
            job_id = req.path.split("?")[0].rsplit("/", 1)[1]
            return reply({"id": job_id, "status": "succeeded"})
        return reply({"error": "not found"}, 404)

    return handler


def test_closed_loop_with_generated_json_inputs_and_every_output(
    tiny_server, response_bytes, tmp_path: Path, capsys
) -> None:
    out = {k: tmp_path / f"run.{k}" for k in ("json", "html", "png")}
    with ServerThread(tiny_server, v2_handler(response_bytes)) as srv:
        rc = main(
            [
                "--url",
                srv.url,
                "--model",
                "m",
                "-c",
                "2",
                # A count, not a time: a starved test process still sends them all; -d bounds it.
                "--max-requests",
                "20",
                "-d",
                "30",
                "--warmup",
                "0",
                "--rows",
                "3",
                "--param",
                "priority=1",
                "--no-progress",
                "--json",
                str(out["json"]),
                "--report",
                str(out["html"]),
                "--png",
                str(out["png"]),
            ],
            environ={},
        )
        requests = list(srv.requests)
    assert rc == EXIT_OK
    assert "closed loop" in capsys.readouterr().out
    assert requests[0].method == "GET" and requests[0].path == "/v2/models/m"
    posts = requests[1:]
    assert posts and {r.path for r in posts} == {"/v2/models/m/infer"}
    assert all(r.headers["cache-control"] == "no-cache" for r in posts)
    body = json.loads(posts[0].body)
    assert body["inputs"][0]["shape"] == [3, 4] and len(body["inputs"][0]["data"]) == 12
    assert body["parameters"] == {"priority": 1}
    assert len({r.body for r in posts}) > 1  # distinct random bodies, cycled
    result = json.loads(out["json"].read_text())
    assert result["config"]["model"] == "m" and result["config"]["mode"] == "closed"
    assert result["ok"] == result["requests"] > 0 and result["timeline"]
    assert out["html"].read_text().count("<svg") == 3
    assert out["png"].read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_open_loop_binary_tensors_and_json_on_stdout(tiny_server, response_bytes, capsys) -> None:
    with ServerThread(tiny_server, v2_handler(response_bytes)) as srv:
        rc = main(
            [
                "--url",
                srv.url + "/v2/models/m/infer",
                "--rate",
                "300",
                "-d",
                "0.1",
                "--warmup",
                "0",
                "--binary",
                "--cache",
                "--json",
                "-",
                "--progress",
            ],
            environ={},
        )
        posts = [r for r in srv.requests if r.method == "POST"]
    captured = capsys.readouterr()
    assert rc == EXIT_OK
    result = json.loads(captured.out)  # stdout holds only the JSON
    assert result["mode"] == "open" and result["config"]["rate"] == "300/s"
    assert "open loop" in captured.err  # the summary went to stderr, with the progress line
    assert posts and all("cache-control" not in r.headers for r in posts)
    first = posts[0]
    assert first.headers["content-type"] == "application/octet-stream"
    n = int(first.headers["inference-header-content-length"])
    header = json.loads(first.body[:n])
    assert header["inputs"][0]["parameters"]["binary_data_size"] == 16 == len(first.body) - n


def test_input_file_and_jobs_mode(tiny_server, response_bytes, tmp_path: Path, capsys) -> None:
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
    path = tmp_path / "body.json"
    path.write_text(json.dumps(doc))
    with ServerThread(tiny_server, v2_handler(response_bytes)) as srv:
        argv = ["--url", srv.url, "-m", "m", "-c", "1", "--max-requests", "5", "-d", "30"]
        argv += ["--warmup", "0", "--input-file", str(path), "--jobs", "--json", "-"]
        rc = main(argv, environ={})
        paths = {r.path.split("?")[0] for r in srv.requests}
        bodies = {r.body for r in srv.requests if r.method == "POST"}
    assert rc == EXIT_OK
    result = json.loads(capsys.readouterr().out)
    assert "/v2/models/m" not in paths  # no metadata needed with --input-file
    assert "/v2/models/m/jobs" in paths and any(p.startswith("/v2/jobs/j") for p in paths)
    assert bodies == {json.dumps(doc, separators=(",", ":")).encode()}
    assert result["mode"] == "jobs/closed"
    assert result["jobs"]["submitted"] >= result["ok"] > 0
    assert result["jobs"]["final_status"]["succeeded"] == result["jobs"]["submitted"]


def test_failures_before_the_load_are_reported_plainly(
    tiny_server, response_bytes, tmp_path: Path, capsys
) -> None:
    with ServerThread(tiny_server, v2_handler(response_bytes)) as srv:
        assert main(["--url", srv.url, "-m", "nope", "-d", "0.1"], environ={}) == EXIT_FAILED
        assert "answered 404" in capsys.readouterr().err
        missing = tmp_path / "missing.json"
        rc = main(["--url", srv.url, "--input-file", str(missing), "-d", "0.1"], environ={})
        assert rc == EXIT_USAGE
        assert "cannot read --input-file" in capsys.readouterr().err
        rc = main(["--url", srv.url, "-m", "m", "--shape", "z=1", "-d", "0.1"], environ={})
        assert rc == EXIT_USAGE and "does not have" in capsys.readouterr().err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert main(["--url", f"http://127.0.0.1:{port}", "-d", "0.1"], environ={}) == 1
    assert "cannot fetch model metadata" in capsys.readouterr().err


def test_a_run_where_nothing_succeeds_exits_1(tiny_server, response_bytes, capsys) -> None:
    def handler(req: Any) -> bytes:
        if req.method == "GET":
            return response_bytes(json.dumps(METADATA).encode())
        return response_bytes(b'{"error": "busy"}', status=503, reason="Unavailable")

    with ServerThread(tiny_server, handler) as srv:
        rc = main(["--url", srv.url, "-m", "m", "-c", "1", "-d", "0.1", "--warmup", "0"], {})
    assert rc == EXIT_FAILED
    assert "503 x" in capsys.readouterr().out
