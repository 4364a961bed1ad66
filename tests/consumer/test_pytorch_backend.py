"""The PyTorch backend serves the digits network exactly as ONNX Runtime does, from a torch.export
archive or TorchScript, and refuses files it cannot load safely."""

from __future__ import annotations

import json
import shutil
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from consumer.backends import BackendError, create_backend
from consumer.backends.pytorch import TorchBackend
from consumer.repository import RepositoryError, load_config
from inferq.examples import digits_pt

MODELS = Path(__file__).resolve().parents[2] / "models"
SAMPLES = json.loads((MODELS / "digits" / "samples.json").read_text())


def _repo(root: Path) -> Path:
    root.mkdir()
    shutil.copytree(MODELS / "digits", root / "digits", ignore=shutil.ignore_patterns("train.py"))
    (root / "digits-pt" / "1").mkdir(parents=True)
    shutil.copy(MODELS / "digits-pt" / "config.toml", root / "digits-pt" / "config.toml")
    return root


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One repository per format, each with digits (ONNX) and digits-pt built from it."""
    repos = {}
    for fmt in ("pt2", "ts"):
        repo = _repo(tmp_path_factory.mktemp(fmt) / "models")
        digits_pt.build(repo, fmt=fmt)
        repos[fmt] = repo
    return repos


@pytest.fixture(scope="module")
def inputs() -> np.ndarray:
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 17, size=(300, 64)).astype(np.float32)
    return np.concatenate([np.array(SAMPLES["inputs"], dtype=np.float32), noise])


def _predict(repo: Path, model: str, x: np.ndarray) -> dict[str, np.ndarray]:
    backend = create_backend(load_config(repo, model), "1")
    backend.load()
    try:
        return backend.predict({"input": x})
    finally:
        backend.unload()


@pytest.mark.parametrize("fmt", ["pt2", "ts"])
def test_torch_gives_the_onnx_outputs_for_the_same_weights(built, inputs, fmt) -> None:
    repo = built[fmt]
    assert load_config(repo, "digits-pt").model_file("1") == repo / "digits-pt/1" / f"model.{fmt}"
    expected = _predict(repo, "digits", inputs)
    got = _predict(repo, "digits-pt", inputs)
    assert got["logits"].dtype == np.float32 and got["label"].dtype == np.int64
    assert np.abs(got["logits"] - expected["logits"]).max() < 1e-5
    assert np.array_equal(got["label"], expected["label"])
    assert got["label"][:10].tolist() == SAMPLES["labels"]


def test_the_committed_digits_pt_archive_matches_the_digits_onnx_model(inputs) -> None:
    expected = _predict(MODELS, "digits", inputs)
    got = _predict(MODELS, "digits-pt", inputs)
    assert np.abs(got["logits"] - expected["logits"]).max() < 1e-5
    assert np.array_equal(got["label"], expected["label"])


def test_the_export_archive_is_preferred_and_the_platform_is_libtorch(built, tmp_path) -> None:
    repo = _repo(tmp_path / "models")
    folder = repo / "digits-pt" / "1"
    shutil.copy(built["ts"] / "digits-pt/1/model.ts", folder)
    assert load_config(repo, "digits-pt").model_file("1") == folder / "model.ts"
    shutil.copy(built["pt2"] / "digits-pt/1/model.pt2", folder)
    config = load_config(repo, "digits-pt")
    assert config.model_file("1") == folder / "model.pt2"
    assert config.metadata().platform == "pytorch_libtorch"


def test_a_version_without_a_model_file_is_refused_naming_both_names(tmp_path) -> None:
    repo = _repo(tmp_path / "models")
    with pytest.raises(RepositoryError, match=r"missing .*digits-pt/1/model\.pt2 or model\.ts"):
        load_config(repo, "digits-pt")


@pytest.mark.parametrize("fmt", ["pt2", "ts"])
def test_a_corrupt_file_is_a_backend_error_naming_the_file(tmp_path, fmt) -> None:
    repo = _repo(tmp_path / "models")
    path = repo / "digits-pt" / "1" / f"model.{fmt}"
    path.write_bytes(b"not a model")
    with pytest.raises(BackendError, match=rf"version 1: cannot load .*model\.{fmt}"):
        create_backend(load_config(repo, "digits-pt"), "1").load()


def _rewrite(src: Path, dst: Path, change) -> None:
    with zipfile.ZipFile(src) as old, zipfile.ZipFile(dst, "w") as new:
        for item in old.infolist():
            data = change(item.filename, old.read(item.filename))
            if data is not None:
                new.writestr(item, data)


def test_an_archive_with_pickled_weights_is_refused_before_torch_reads_it(built, tmp_path) -> None:
    repo = _repo(tmp_path / "models")

    def pickled(name: str, data: bytes) -> bytes:
        if not name.endswith("_weights_config.json"):
            return data
        config = json.loads(data)
        next(iter(config["config"].values()))["use_pickle"] = True
        return json.dumps(config).encode()

    _rewrite(built["pt2"] / "digits-pt/1/model.pt2", repo / "digits-pt/1/model.pt2", pickled)
    with pytest.raises(BackendError, match=r"model\.pt2: '.*' is stored pickled \(refused\)"):
        create_backend(load_config(repo, "digits-pt"), "1").load()


def test_an_archive_with_native_code_is_refused(built, tmp_path) -> None:
    repo = _repo(tmp_path / "models")
    target = repo / "digits-pt/1/model.pt2"
    shutil.copy(built["pt2"] / "digits-pt/1/model.pt2", target)
    with zipfile.ZipFile(target, "a") as archive:
        archive.writestr("model/data/aotinductor/model/model.so", b"\x7fELF")
    with pytest.raises(BackendError, match=r"unexpected archive entry .*aotinductor.*refused"):
        create_backend(load_config(repo, "digits-pt"), "1").load()


def test_unload_releases_the_module_and_predict_then_fails(built) -> None:
    backend = create_backend(load_config(built["pt2"], "digits-pt"), "1")
    backend.load()
    backend.unload()
    with pytest.raises(BackendError, match="is not loaded"):
        backend.predict({"input": np.zeros((1, 64), dtype=np.float32)})


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_cuda_device_is_a_clear_error(built) -> None:
    backend = TorchBackend(load_config(built["pt2"], "digits-pt"), "1", device="cuda")
    with pytest.raises(BackendError, match="--device cuda asked for, but torch sees no CUDA"):
        backend.load()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_outputs_match_the_cpu(built, inputs) -> None:
    config = load_config(built["pt2"], "digits-pt")
    cpu, cuda = TorchBackend(config, "1"), TorchBackend(config, "1", device="cuda")
    cpu.load()
    cuda.load()
    expected, got = cpu.predict({"input": inputs}), cuda.predict({"input": inputs})
    assert np.abs(got["logits"] - expected["logits"]).max() < 1e-4
    assert np.array_equal(got["label"], expected["label"])


class _DictOut(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"label": x.argmax(1), "logits": x * 2}


class _OneOut(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def _script(module: torch.nn.Module, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script(module).save(str(path))


def test_dict_outputs_are_taken_by_name(tmp_path) -> None:
    repo = _repo(tmp_path / "models")
    _script(_DictOut(), repo / "digits-pt/1/model.ts")
    x = np.arange(128, dtype=np.float32).reshape(2, 64)
    out = _predict(repo, "digits-pt", x)
    assert np.array_equal(out["logits"], x * 2) and out["label"].tolist() == [63, 63]


def test_an_output_count_unlike_the_config_is_an_error_naming_the_outputs(tmp_path) -> None:
    repo = _repo(tmp_path / "models")
    _script(_OneOut(), repo / "digits-pt/1/model.ts")
    with pytest.raises(BackendError, match="returned Tensor; the config declares outputs logits"):
        _predict(repo, "digits-pt", np.zeros((1, 64), dtype=np.float32))
