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

It lives in ``protocol`` because flags and variables are a contract, and because every command
uses it: the product's and loadgen's, which may import nothing of the product but ``protocol``.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, Literal

_MISSING: Any = dataclasses.MISSING
_FROM_ENV = "option_environment"
"""The ``argparse`` attribute holding the variables ``add_flags`` kept apart for ``from_args``."""


class _Unset:
    """No command-line default of its own: the field's default applies."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


@dataclasses.dataclass(frozen=True)
class Option:
    """How a user sets one settings field."""

    flag: str
    help: str
    env: str = ""
    """The variable; "" for a flag that has none."""
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
    kind: Literal["value", "switch", "repeat", "toggle"] = "value"
    """``switch``: a flag alone sets True; ``repeat``: each use adds one parsed value to a tuple;
    ``toggle``: ``--x`` / ``--no-x``, None when neither is given."""
    aliases: tuple[str, ...] = ()
    """Short forms of the flag (``-c``)."""
    metavar: str | None = None
    group: str | None = None
    """The section of ``--help`` the flag is listed in."""
    exclusive: str = ""
    """Flags that share this name exclude each other; one given on the command line also beats
    the variables of all of them (``from_args`` resolves it)."""
    env_check: Callable[[Any], None] | None = None
    """Checks a value that came from the variable, not the command line (``from_args`` calls
    it; it raises ValueError with the reason)."""

    def __post_init__(self) -> None:
        if not self.dest:
            object.__setattr__(self, "dest", self.flag.lstrip("-").replace("-", "_"))

    @property
    def env_apart(self) -> bool:
        """Whether the variable's value must be told apart from a flag's (resolved later by
        ``from_args``) instead of becoming the flag's default."""
        return bool(self.exclusive) or self.env_check is not None


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
    if value is None or value == "" or value == () or opt.kind != "value":
        return ""
    return f" (default: {opt.render(value)})"


def _container(
    parser: argparse.ArgumentParser,
    opt: Option,
    exclusive: dict[str, argparse._MutuallyExclusiveGroup],
) -> Any:
    """Where the flag goes: the parser, its ``--help`` section, or an exclusive group in it."""
    into: Any = parser
    if opt.group is not None:
        into = next((g for g in parser._action_groups if g.title == opt.group), None)
        into = into or parser.add_argument_group(opt.group)
    if opt.exclusive:
        if opt.exclusive not in exclusive:
            exclusive[opt.exclusive] = into.add_mutually_exclusive_group()
        into = exclusive[opt.exclusive]
    return into


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
    exclusive: dict[str, argparse._MutuallyExclusiveGroup] = {}
    apart: dict[str, Any] = dict(parser.get_default(_FROM_ENV) or {})
    for cls in settings_classes:
        for f, opt in options(cls):
            dest = opt.dest if flag is None else flag.lstrip("-").replace("-", "_")
            if dest in seen or (only is not None and f.name not in only):
                continue
            seen.add(dest)
            default = _default(f, opt)
            raw = None if if_given or not opt.env else environ.get(opt.env)
            value = argparse.SUPPRESS if if_given else default
            if raw is not None:
                try:
                    value = opt.parse(raw)
                except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
                    # A secret's value is never echoed (the terminal may be logged).
                    shown = f"{opt.env} ({e})" if opt.secret else f"{opt.env}={raw!r}"
                    parser.error(f"environment variable {shown} is not a valid {opt.flag}")
                if opt.env_apart:
                    apart[dest], value = value, default
            env = f" [env {opt.env}]" if opt.env else ""
            kwargs: dict[str, Any] = {
                "dest": dest,
                "help": f"{opt.help}{_shown(default, opt)}{env}",
            }
            if opt.kind == "switch":
                kwargs.update(action="store_true", default=value)
            elif opt.kind == "toggle":
                kwargs.update(action=argparse.BooleanOptionalAction, default=value)
            else:
                kwargs.update(type=opt.parse, choices=opt.choices, metavar=opt.metavar)
                if opt.kind == "repeat":
                    kwargs.update(action="append", default=None)
                else:
                    kwargs["default"] = value
            into = _container(parser, opt, exclusive)
            into.add_argument(flag or opt.flag, *opt.aliases, **kwargs)
    if apart:
        parser.set_defaults(**{_FROM_ENV: apart})


def from_args(settings_class: type, args: argparse.Namespace, **extra: Any) -> Any:
    """The settings object from parsed arguments; an unset option (None) keeps the field's
    own default, ``extra`` sets fields that have no flag. Variables ``add_flags`` kept apart
    apply here: checked, and only where no flag of their exclusive group was given."""
    values = dict(extra)
    from_env: Mapping[str, Any] = getattr(args, _FROM_ENV, None) or {}
    fields = options(settings_class)
    given = {opt.exclusive for _, opt in fields if getattr(args, opt.dest, None) is not None}
    for f, opt in fields:
        value = getattr(args, opt.dest, None)
        if value is None and opt.dest in from_env and opt.exclusive not in given - {""}:
            value = from_env[opt.dest]
            if opt.env_check is not None:
                opt.env_check(value)
        if value is None:
            continue
        if opt.kind == "repeat":
            value = tuple(value)
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
            if opt.kind == "switch":
                if value:  # the flag alone; nothing for off, the default
                    argv.append(opt.flag)
                continue
            if opt.secret:
                env[opt.env] = opt.render(value)
            else:
                argv += [opt.flag, opt.render(value)]
    return argv, env
