"""Command-line options declared once, on the settings dataclasses themselves.

A settings field that users may set carries an ``Option`` in its metadata: the flag, the
``INFERQ_*`` variable, the parser of its text, the help, and how ``inferq up`` forwards it to a
child process. Everything else derives from that one declaration:

- ``add_flags`` adds the flags of a settings class to an ``argparse`` parser, with defaults taken
  from the environment (a flag on the command line wins) and the default and variable shown in
  the help;
- ``from_args`` builds the frozen settings object from the parsed arguments;
- ``forward_argv`` turns parsed arguments back into the flags a child process needs.

The default is the dataclass field's own default: tests that construct settings directly get
the same values as a user who gives no flag. The one exception is declared next to the field
(``Option.cli_default``), with its reason.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

_MISSING: Any = dataclasses.MISSING


class _Unset:
    """No command-line default of its own: the field's default applies."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


@dataclasses.dataclass(frozen=True)
class Option:
    """How a user sets one settings field."""

    flag: str
    env: str
    help: str
    parse: Callable[[str], Any] = str
    """Text (a flag's value or the variable's) to the field's value; raises ValueError."""
    render: Callable[[Any], str] = str
    """The field's value back to text, for forwarding to a child process."""
    choices: Sequence[str] | None = None
    cli_default: Any = UNSET
    """A command-line default that differs from the dataclass default (rare; say why)."""
    forward: bool = True
    """Whether ``inferq up`` passes the value on to its children's command lines."""
    follows: str = ""
    """Another option's ``dest`` whose value ``inferq up`` forwards when this one is unset
    (``--metrics-host`` follows ``--host``); needs ``cli_default=None`` to tell unset apart."""
    secret: bool = False
    """Forwarded in the environment, never in argv (the process list shows argv)."""
    build: Callable[[Any], Any] | None = None
    """The parsed value to the field's value, where they differ (a URL to ``RedisSettings``)."""
    dest: str = ""
    """The ``argparse`` attribute; by default the flag's name with underscores."""

    def __post_init__(self) -> None:
        if not self.dest:
            object.__setattr__(self, "dest", self.flag.lstrip("-").replace("-", "_"))


def option(default: Any = _MISSING, *, default_factory: Any = _MISSING, **kwargs: Any) -> Any:
    """A dataclass field with an ``Option``: ``port: int = option(8000, flag=..., env=...)``."""
    meta = {"option": Option(**kwargs)}
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def options(settings_class: type) -> list[tuple[dataclasses.Field[Any], Option]]:
    """The user-settable fields of a settings dataclass, in declaration order."""
    return [
        (f, f.metadata["option"])
        for f in dataclasses.fields(settings_class)
        if "option" in f.metadata
    ]


def _default(f: dataclasses.Field[Any], opt: Option) -> Any:
    if opt.cli_default is not UNSET:
        return opt.cli_default
    if f.default is not _MISSING:
        return f.default
    return None  # a default factory: computed by the dataclass (a fresh id per process)


def _shown(value: Any, opt: Option) -> str:
    if value is None or value == "" or value == ():
        return ""
    return f" (default: {opt.render(value)})"


def add_flags(
    parser: argparse.ArgumentParser,
    environ: Mapping[str, str],
    *settings_classes: type,
    only: Collection[str] | None = None,
    flag: str | None = None,
    if_given: bool = False,
) -> None:
    """Add the options of the classes (each once; ``only`` these fields) to ``parser``.
    ``flag`` renames the one option that ``only`` selects (same variable). ``if_given``: the
    flags of a subcommand that repeat its parent's (``inferq dlq list --redis``), which set
    the value only when given, so the parent's (given, from the environment or the default)
    stands otherwise."""
    seen = {a.dest for a in parser._actions}
    for cls in settings_classes:
        for f, opt in options(cls):
            dest = opt.dest if flag is None else flag.lstrip("-").replace("-", "_")
            if dest in seen or (only is not None and f.name not in only):
                continue
            seen.add(dest)
            default = _default(f, opt)
            raw = None if if_given else environ.get(opt.env)
            value = argparse.SUPPRESS if if_given else default
            if raw is not None:
                try:
                    value = opt.parse(raw)
                except (TypeError, ValueError, argparse.ArgumentTypeError):
                    parser.error(
                        f"environment variable {opt.env}={raw!r} is not a valid {opt.flag}"
                    )
            parser.add_argument(
                flag or opt.flag,
                type=opt.parse,
                default=value,
                choices=opt.choices,
                dest=dest,
                help=f"{opt.help}{_shown(default, opt)} [env {opt.env}]",
            )


def from_args(settings_class: type, args: argparse.Namespace, **extra: Any) -> Any:
    """The settings object from parsed arguments; an unset option (None) keeps the field's
    own default, ``extra`` sets fields that have no flag."""
    values = dict(extra)
    for f, opt in options(settings_class):
        value = getattr(args, opt.dest, None)
        if value is not None:
            values[f.name] = value if opt.build is None else opt.build(value)
    return settings_class(**values)


def forward_argv(
    args: argparse.Namespace, settings_classes: Iterable[type], **override: Any
) -> tuple[list[str], dict[str, str]]:
    """The flags (and, for secrets, environment variables) that give a child process the same
    options as ``args``; ``override`` replaces values by field name (``redis=...``)."""
    argv: list[str] = []
    env: dict[str, str] = {}
    seen: set[str] = set()
    for cls in settings_classes:
        for f, opt in options(cls):
            if not opt.forward or opt.dest in seen:
                continue
            seen.add(opt.dest)
            value = override[f.name] if f.name in override else getattr(args, opt.dest, None)
            if value is None and opt.follows:
                value = getattr(args, opt.follows, None)
            if value is None or value == "" or value == ():
                continue
            if opt.secret:
                env[opt.env] = opt.render(value)
            else:
                argv += [opt.flag, opt.render(value)]
    return argv, env
