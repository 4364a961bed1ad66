"""``inferq models build-examples`` builds into the repository it is given, rewrites no
committed file with other bytes, and says what is wrong when it cannot."""

from __future__ import annotations

import shutil
from pathlib import Path

from consumer.backends import create_backend
from consumer.repository import load_config
from inferq.cli import main

MODELS = Path(__file__).resolve().parents[2] / "models"


def test_build_examples_writes_a_servable_digits_pt(tmp_path, capsys) -> None:
    shutil.copytree(MODELS / "digits", tmp_path / "digits")
    (tmp_path / "digits-pt").mkdir()
    shutil.copy(MODELS / "digits-pt" / "config.toml", tmp_path / "digits-pt")
    argv = ["models", "build-examples", "--repository", str(tmp_path), "--only", "digits-pt"]
    assert main(argv, environ={}) == 0
    assert f"wrote {tmp_path / 'digits-pt/1/model.pt2'}" in capsys.readouterr().out
    backend = create_backend(load_config(tmp_path, "digits-pt"), "1")
    backend.load()
    backend.unload()


def test_rebuilding_the_committed_digits_pt_writes_the_same_bytes(tmp_path, capsys) -> None:
    """The archive is committed: a build from any checkout (another path, other line numbers)
    must not leave `git status` showing it changed. Torch is pinned in the dev extra."""
    shutil.copytree(MODELS / "digits", tmp_path / "digits")
    argv = ["models", "build-examples", "--repository", str(tmp_path), "--only", "digits-pt"]
    assert main(argv, environ={}) == 0
    built = (tmp_path / "digits-pt/1/model.pt2").read_bytes()
    assert built == (MODELS / "digits-pt/1/model.pt2").read_bytes()
    assert main(argv, environ={}) == 0
    assert (tmp_path / "digits-pt/1/model.pt2").read_bytes() == built


def test_the_repository_comes_from_the_environment_too(tmp_path, capsys) -> None:
    shutil.copytree(MODELS / "digits", tmp_path / "digits")
    env = {"INFERQ_MODEL_REPOSITORY": str(tmp_path)}
    assert main(["models", "build-examples", "--only", "digits-pt"], environ=env) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "digits-pt/1/model.pt2").is_file()
    assert "has no config.toml; copy models/digits-pt/config.toml" in out


def test_an_unknown_example_or_a_missing_repository_is_a_usage_error(tmp_path, capsys) -> None:
    assert (
        main(["models", "build-examples", "--repository", str(tmp_path), "--only", "bert"], {}) == 2
    )
    assert "unknown example bert: choose from minilm, digits-pt" in capsys.readouterr().err
    missing = tmp_path / "missing"
    assert main(["models", "build-examples", "--repository", str(missing)], environ={}) == 2
    assert f"{missing} is not a directory" in capsys.readouterr().err
