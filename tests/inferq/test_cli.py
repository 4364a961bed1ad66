"""The command line: flags, their environment variables, help, and ``inferq up``."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from inferq.cli import build_parser, main
from inferq.gateways import gateway_specs
from inferq.redisserver import free_port
from tests.support import checkout_env, missing

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_every_subcommand_has_complete_help(capsys):
    for argv in (["--help"], ["up", "--help"], ["gateway", "--help"], ["worker", "--help"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv, environ={})
        assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--redis",
        "--workers",
        "--host",
        "--port",
        "--grpc-port",
        "INFERQ_GRPC_PORT",
        "--model-repository",
        "--models",
        "--max-batch",
        "--flush-ms",
        "INFERQ_REDIS_URL",
        "INFERQ_MAX_BATCH",
    ):
        assert flag in text


def test_environment_variables_set_defaults_and_flags_win():
    parser = build_parser(
        {
            "INFERQ_REDIS_URL": "redis://elsewhere:6380/1",
            "INFERQ_MAX_BATCH": "8",
            "INFERQ_FLUSH_MS": "0.5",
            "INFERQ_MODELS": "digits",
        }
    )
    args = parser.parse_args(["worker"])
    assert (args.redis_url, args.max_batch, args.flush_ms, args.models) == (
        "redis://elsewhere:6380/1",
        8,
        0.5,
        ("digits",),
    )
    assert parser.parse_args(["worker", "--max-batch", "4"]).max_batch == 4


def test_grpc_listens_on_8001_by_default_and_0_turns_it_off():
    assert build_parser({}).parse_args(["gateway"]).grpc_port == 8001
    assert build_parser({"INFERQ_GRPC_PORT": "0"}).parse_args(["up"]).grpc_port == 0
    assert build_parser({}).parse_args(["up", "--grpc-port", "9001"]).grpc_port == 9001
    with pytest.raises(SystemExit):
        build_parser({}).parse_args(["gateway", "--grpc-port", "70000"])


def test_a_bad_environment_value_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser({"INFERQ_MAX_BATCH": "lots"})
    assert exit_.value.code == 2
    assert "INFERQ_MAX_BATCH" in capsys.readouterr().err


def test_up_serves_worker_metrics_from_port_8002_by_default():
    # Worker i of `inferq up` gets the base + i: a local Prometheus sees every worker's stages
    # with no flag (README: Monitoring), and INFERQ_METRICS_PORT / --metrics-port move the base.
    # 8002 is Triton's metrics port, beside 8000/8001; 9100 (node_exporter's) and the rest of
    # 9100-9999 belong to Prometheus exporters that often run on the same host.
    assert build_parser({}).parse_args(["up"]).metrics_port == 8002
    assert not 9090 <= build_parser({}).parse_args(["worker"]).metrics_port <= 9999
    assert build_parser({"INFERQ_METRICS_PORT": "9200"}).parse_args(["up"]).metrics_port == 9200
    assert build_parser({}).parse_args(["up", "--metrics-port", "0"]).metrics_port == 0


@pytest.mark.parametrize(
    ("flags", "ports"),
    [
        ([], [0]),  # one gateway: its /metrics on the shared port is the whole process
        (["--gateways", "3"], [8100, 8101, 8102]),  # several: each its own, 8100 + i
        (["--gateways", "2", "--gateway-metrics-port", "9000"], [9000, 9001]),
        (["--gateways", "2", "--gateway-metrics-port", "0"], [0, 0]),
        (["--gateway-metrics-port", "9000"], [9000]),
    ],
)
def test_each_gateway_gets_a_metrics_port_of_its_own_when_several_share_one(flags, ports):
    args = build_parser({}).parse_args(["up", *flags])
    listeners = [socket.socket() for _ in range(args.gateways)]
    try:
        specs = gateway_specs(args, "redis://127.0.0.1:1/0", listeners)
    finally:
        for sock in listeners:
            sock.close()
    given = [int(s.argv[s.argv.index("--gateway-metrics-port") + 1]) for s in specs]
    assert given == ports


@pytest.mark.parametrize("command", ["gateway", "worker"])
def test_an_otel_exporter_that_is_not_installed_is_a_usage_error(command, capsys):
    if importlib.util.find_spec("opentelemetry") is None:
        missing("the otel extra (pip install -e '.[otel]')")
    environ = {"OTEL_TRACES_EXPORTER": "no-such-exporter"}
    code = main([command, "--redis", "redis://127.0.0.1:1/0"], environ=environ)
    assert code == 2
    assert "no-such-exporter" in capsys.readouterr().err


def test_worker_with_a_missing_model_exits_with_a_clear_message(tmp_path, capsys):
    code = main(
        [
            "worker",
            "--redis",
            "redis://127.0.0.1:1/0",
            "--model-repository",
            str(tmp_path),
            "--models",
            "nope",
        ],
        environ={},
    )
    assert code == 2
    assert "model 'nope' not found" in capsys.readouterr().err


def _processes_mentioning(text: str, where: str = "cmdline") -> list[int]:
    """Processes whose command line (or ``where="environ"``: environment) holds ``text``."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/{where}").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline and int(pid) != os.getpid():
            found.append(int(pid))
    return found


def _env() -> dict[str, str]:
    env = checkout_env(PYTHONUNBUFFERED="1")  # they run in tmp_path: the checkout's code
    env.pop("INFERQ_REDIS_URL", None)
    return env


@pytest.mark.serial  # scans every process on the machine
def test_up_starts_everything_serves_digits_and_stops_without_orphans(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "inferq",
            "up",
            "--redis",
            "redis://127.0.0.1:1/0",
            "--port",
            str(port),
            "--grpc-port",
            "0",
            "--workers",
            "2",
            "--log-level",
            "warning",
            "--metrics-port",
            "0",
            "--model-repository",
            str(REPO_ROOT / "models"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
        cwd=tmp_path,
    )
    redis_port = curl = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # bounded by the test timeout
            if m := re.search(r"private redis-server at redis://127.0.0.1:(\d+)", line):
                redis_port = m.group(1)
            if line.strip().startswith("curl "):
                curl = line.strip()
                break
        assert redis_port is not None and curl is not None, "inferq up printed no curl example"
        body = json.loads(re.search(r"-d '(.*)'$", curl).group(1))
        r = httpx.post(f"http://127.0.0.1:{port}/v2/models/digits/infer", json=body, timeout=10)
        assert r.status_code == 200
        labels = next(o for o in r.json()["outputs"] if o["name"] == "label")["data"]
        samples = json.loads((REPO_ROOT / "models/digits/samples.json").read_text())
        assert labels == samples["labels"][:1]
        # redis-server (its process title) and the gateway and both workers (their Redis URL
        # comes in the environment, never on the command line, which may carry a password).
        assert len(_processes_mentioning(f"127.0.0.1:{redis_port}")) == 1
        assert len(_processes_mentioning(f"127.0.0.1:{redis_port}", "environ")) == 3
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(60)
        finally:
            if proc.stdout:
                proc.stdout.close()
        assert code == 0
    assert _processes_mentioning(f"127.0.0.1:{redis_port}") == []


def test_up_without_redis_says_how_to_install_it(tmp_path):
    env = _env()
    env["PATH"] = str(tmp_path)  # no redis-server anywhere on it
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "inferq",
            "up",
            "--redis",
            "redis://127.0.0.1:1/0",
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 1
    assert "install Redis" in result.stderr


@pytest.mark.parametrize(("taken_flag", "listener"), [("--grpc-port", " for gRPC"), ("--port", "")])
def test_a_gateway_port_in_use_is_one_line_and_exit_2(tmp_path, taken_flag, listener):
    # Exit 2 is a usage error: `inferq up` and `inferq gateway --gateways N` stop instead of
    # restarting a gateway that would fail alike. Nothing connects to Redis first.
    import socket

    with socket.socket() as taken:  # no SO_REUSEPORT: nothing may share it
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = {"--port": str(free_port()), "--grpc-port": str(free_port()), taken_flag: str(port)}
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "inferq",
                "gateway",
                "--redis",
                "redis://127.0.0.1:1/0",
                *(x for flag_value in ports.items() for x in flag_value),
                "--log-level",
                "warning",
            ],
            capture_output=True,
            text=True,
            env=_env(),
            cwd=tmp_path,
            timeout=60,
        )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == (
        f"inferq gateway: cannot listen{listener} on 127.0.0.1:{port}: Address already in use\n"
    )


@pytest.mark.parametrize(
    ("argv", "command", "unknown"),
    [
        (["dlq", "list", "digits"], "inferq dlq list", "digits"),
        (["worker", "--no-such-flag"], "inferq worker", "--no-such-flag"),
        (["lag", "digits"], "inferq lag", "digits"),
        (["up", "--no-such-flag"], "inferq up", "--no-such-flag"),
    ],
)
def test_an_argument_no_command_takes_gets_that_commands_usage(argv, command, unknown, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv, environ={})
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {command} [-h]"), err
    assert err.endswith(f"{command}: error: unrecognized arguments: {unknown}\n"), err
