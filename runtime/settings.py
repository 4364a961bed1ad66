"""The options every inferq process that talks to Redis shares: where Redis is, the key
namespace, the log level. The gateway's and the worker's settings extend this class."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass

from protocol.argtypes import positive_float
from protocol.options import add_flags, option
from runtime.connections import RedisSettings

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_HOST = "127.0.0.1"
"""Where listeners bind unless told: this machine only (``--host``, ``--metrics-host``)."""
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ConnectionSettings:
    redis: RedisSettings = option(
        default_factory=RedisSettings,
        flag="--redis",
        env="INFERQ_REDIS_URL",
        dest="redis_url",
        cli_default=DEFAULT_REDIS_URL,
        build=lambda url: RedisSettings(url=url),
        # The URL may hold a password (user:password@): `inferq up` hands it to its children
        # in the environment, where the process list does not show it.
        secret=True,
        help="Redis URL (redis:// or rediss:// for TLS; user:password@ for AUTH)",
    )
    namespace: str = option(
        "inferq",
        flag="--namespace",
        env="INFERQ_NAMESPACE",
        help="prefix of every Redis key, so deployments can share one Redis",
    )
    log_level: str = option(
        "info", flag="--log-level", env="INFERQ_LOG_LEVEL", choices=LOG_LEVELS, help="log level"
    )
    redis_wedge_s: float = option(
        30.0,
        flag="--redis-wedge-s",
        env="INFERQ_REDIS_WEDGE_S",
        parse=positive_float,
        help="a process that cannot use its Redis connections (an exhausted pool, loops that "
        "fail) for this long while Redis answers a new connection exits with status 70, for "
        "its supervisor to restart it (runtime.wedge)",
    )


def connection_flags(
    parser: argparse.ArgumentParser, environ: Mapping[str, str], *, if_given: bool = False
) -> None:
    """``--redis`` and ``--namespace``, for the commands that only read Redis (lag, dlq,
    models); ``if_given`` for an action that repeats its command's (see ``add_flags``)."""
    add_flags(parser, environ, ConnectionSettings, only=("redis", "namespace"), if_given=if_given)
