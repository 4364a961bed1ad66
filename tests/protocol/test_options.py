"""Options declared once on the settings classes: parsers, settings objects and ``inferq up``'s
forwarding all derive from the declaration."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import pytest

from consumer.settings import WorkerSettings
from inferq.cli import build_parser
from producer.settings import GatewaySettings
from protocol.options import add_flags, forward_argv, from_args, option, options
from runtime.connections import RedisSettings


def parser_for(*classes: type, environ: dict[str, str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_flags(parser, environ or {}, *classes)
    return parser


def test_every_option_has_a_flag_and_an_inferq_variable_named_alike():
    for cls in (GatewaySettings, WorkerSettings):
        for _, opt in options(cls):
            assert opt.flag.startswith("--") and opt.env.startswith("INFERQ_")
            assert opt.help


def test_no_flags_give_the_dataclass_defaults():
    args = parser_for(GatewaySettings).parse_args([])
    built = from_args(GatewaySettings, args)
    default = GatewaySettings()
    for f, _ in options(GatewaySettings):
        assert getattr(built, f.name) == getattr(default, f.name), f.name


def test_a_variable_sets_the_default_and_a_flag_wins():
    environ = {"INFERQ_PORT": "9000", "INFERQ_REDIS_URL": "redis://elsewhere:1/0"}
    parser = parser_for(GatewaySettings, environ=environ)
    assert from_args(GatewaySettings, parser.parse_args([])).port == 9000
    settings = from_args(GatewaySettings, parser.parse_args(["--port", "9001"]))
    assert settings.port == 9001
    assert settings.redis == RedisSettings(url="redis://elsewhere:1/0")


def test_a_bad_variable_is_a_usage_error_naming_it(capsys):
    with pytest.raises(SystemExit):
        parser_for(WorkerSettings, environ={"INFERQ_CLAIM_IDLE_MS": "-3"})
    assert "INFERQ_CLAIM_IDLE_MS='-3' is not a valid --claim-idle-ms" in capsys.readouterr().err


def test_up_forwards_every_gateway_and_worker_option_unchanged():
    up = build_parser({}).parse_args(
        [
            "up",
            "--redis",
            "redis://127.0.0.1:7000/2",
            "--namespace",
            "ns",
            "--port",
            "8123",
            "--max-batch",
            "7",
            "--flush-ms",
            "0.5",
            "--models",
            "a,b",
            "--model-repository",
            "/srv/models",
            "--admin-token",
            "s3cret",
            "--job-ttl",
            "99",
        ]
    )
    for command, cls in (("gateway", GatewaySettings), ("worker", WorkerSettings)):
        argv, env = forward_argv(up, [cls])
        child = build_parser(env).parse_args([command, *argv])
        for f, opt in options(cls):
            if opt.forward:
                expected = getattr(up, opt.dest)
                if expected is None and opt.follows:
                    expected = getattr(up, opt.follows)
                assert getattr(child, opt.dest) == expected, f.name
        assert "s3cret" not in argv
    worker = from_args(
        WorkerSettings,
        build_parser({}).parse_args(["worker", *forward_argv(up, [WorkerSettings])[0]]),
    )
    assert (worker.models, worker.model_repository, worker.max_batch) == (
        ("a", "b"),
        Path("/srv/models"),
        7,
    )


def test_up_hands_the_admin_token_down_in_the_environment_only():
    up = build_parser({"INFERQ_ADMIN_TOKEN": "s3cret"}).parse_args(["up"])
    argv, env = forward_argv(up, [GatewaySettings])
    assert env["INFERQ_ADMIN_TOKEN"] == "s3cret"
    assert "--admin-token" not in argv


def test_worker_ids_are_never_handed_down():
    up = build_parser({"INFERQ_WORKER_ID": "w1"}).parse_args(["up"])
    argv, _ = forward_argv(up, [WorkerSettings])
    assert "--worker-id" not in argv


def test_the_workers_metrics_follow_ups_host_unless_given_their_own():
    def metrics_host(*flags: str) -> str:
        argv, _ = forward_argv(build_parser({}).parse_args(["up", *flags]), [WorkerSettings])
        return argv[argv.index("--metrics-host") + 1]

    assert metrics_host() == GatewaySettings().host == "127.0.0.1"
    assert metrics_host("--host", "0.0.0.0") == "0.0.0.0"
    assert metrics_host("--host", "0.0.0.0", "--metrics-host", "10.1.2.3") == "10.1.2.3"


def test_a_worker_binds_its_metrics_to_this_machine_only_unless_told():
    worker = from_args(WorkerSettings, build_parser({}).parse_args(["worker"]))
    assert worker.metrics_host == "127.0.0.1"
    told = build_parser({"INFERQ_METRICS_HOST": "0.0.0.0"}).parse_args(["worker"])
    assert from_args(WorkerSettings, told).metrics_host == "0.0.0.0"


def test_overrides_replace_a_forwarded_value():
    up = build_parser({}).parse_args(["up"])
    argv, _ = forward_argv(up, [WorkerSettings], namespace="other")
    assert argv[argv.index("--namespace") + 1] == "other"


def test_up_hands_the_redis_url_down_in_the_environment_only_as_it_may_hold_a_password():
    up = build_parser({}).parse_args(["up", "--redis", "redis://:Pw0rd@127.0.0.1:7000/0"])
    for cls in (GatewaySettings, WorkerSettings):
        argv, env = forward_argv(up, [cls], redis="redis://:Pw1@127.0.0.1:7001/0")
        assert env == {"INFERQ_REDIS_URL": "redis://:Pw1@127.0.0.1:7001/0"}
        assert "--redis" not in argv and not any("Pw" in a for a in argv)


@dataclass(frozen=True)
class Tool:
    """A command with the kinds of flags loadgen declares."""

    target: str | None = option(
        None, flag="--target", env="T_TARGET", env_check=lambda v: _local(v), help="where"
    )
    fast: bool = option(False, flag="--fast", kind="switch", group="mode", help="go")
    tag: tuple[str, ...] = option((), flag="--tag", aliases=("-t",), kind="repeat", help="")
    count: int | None = option(
        None, flag="--count", env="T_COUNT", parse=int, exclusive="loop", help=""
    )
    rate: float | None = option(
        None, flag="--rate", env="T_RATE", parse=float, exclusive="loop", help=""
    )
    show: bool | None = option(None, flag="--show", kind="toggle", help="")


def _local(value: str) -> None:
    if not value.startswith("local"):
        raise ValueError(f"{value} from T_TARGET: only local targets come from the environment")


def tool(argv: list[str], environ: dict[str, str] | None = None) -> Tool:
    built: Tool = from_args(Tool, parser_for(Tool, environ=environ).parse_args(argv))
    return built


def test_switches_repeats_aliases_and_toggles_derive_from_the_declaration():
    assert tool([]) == Tool()
    got = tool(["--fast", "-t", "a", "--tag", "b", "--no-show"])
    assert (got.fast, got.tag, got.show) == (True, ("a", "b"), False)
    assert "mode" in [g.title for g in parser_for(Tool)._action_groups]


def test_of_exclusive_flags_one_on_the_command_line_beats_every_variable():
    environ = {"T_RATE": "2.5", "T_COUNT": "3"}
    assert (tool([], environ).count, tool([], environ).rate) == (3, 2.5)
    assert (tool(["--count", "7"], environ).count, tool(["--count", "7"], environ).rate) == (
        7,
        None,
    )
    with pytest.raises(SystemExit):
        tool(["--count", "1", "--rate", "1"])


def test_a_checked_variable_is_checked_and_a_flag_is_not():
    assert tool(["--target", "far"], {"T_TARGET": "far"}).target == "far"
    assert tool([], {"T_TARGET": "local:1"}).target == "local:1"
    with pytest.raises(ValueError, match="only local targets"):
        tool([], {"T_TARGET": "far"})


def test_a_switchs_variable_turns_it_on_and_up_forwards_it_as_the_bare_flag():
    on = parser_for(GatewaySettings, environ={"INFERQ_WORKERS_ON_DEMAND": "1"}).parse_args([])
    assert from_args(GatewaySettings, on).workers_on_demand is True
    off = parser_for(GatewaySettings, environ={"INFERQ_WORKERS_ON_DEMAND": "off"}).parse_args([])
    assert from_args(GatewaySettings, off).workers_on_demand is False
    assert (
        from_args(GatewaySettings, parser_for(GatewaySettings).parse_args([])).workers_on_demand
        is False
    )

    def child(argv: list[str]) -> GatewaySettings:
        return from_args(GatewaySettings, parser_for(GatewaySettings).parse_args(argv))

    argv, _ = forward_argv(on, [GatewaySettings])
    assert "--workers-on-demand" in argv and child(argv).workers_on_demand
    argv, _ = forward_argv(off, [GatewaySettings])
    assert "--workers-on-demand" not in argv and not child(argv).workers_on_demand
    argv, _ = forward_argv(off, [GatewaySettings], workers_on_demand=True)  # up at --workers 0:N
    assert child(argv).workers_on_demand
