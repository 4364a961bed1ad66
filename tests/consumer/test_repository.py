"""The model repository: loading configs, rejecting bad ones, and staying inside the root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from consumer.repository import (
    CONFIG_FILE,
    MissingVersion,
    ModelConfig,
    RepositoryError,
    RepositoryScan,
    SimulatedLatency,
    Warmup,
    list_models,
    load_config,
)
from protocol.registry import ModelMetadata, TensorSpec

MODELS = Path(__file__).resolve().parents[2] / "models"

SIMULATED = """
backend = "simulated"

[[inputs]]
name = "x"
datatype = "FP32"
shape = [-1, 4]

[[outputs]]
name = "y"
datatype = "INT64"
shape = [-1]
"""

ONNX = SIMULATED.replace('backend = "simulated"', 'backend = "onnx"')


def make_model(
    repo: Path,
    name: str = "m",
    config: str = SIMULATED,
    versions: tuple[str, ...] = ("1",),
    model_file: bool = False,
) -> Path:
    model_dir = repo / name
    model_dir.mkdir(parents=True)
    (model_dir / CONFIG_FILE).write_text(config)
    for v in versions:
        (model_dir / v).mkdir()
        if model_file:
            (model_dir / v / "model.onnx").write_bytes(b"not really onnx")
    return model_dir


def rejected(repo: Path, name: str = "m") -> str:
    with pytest.raises(RepositoryError) as info:
        load_config(repo, name)
    return str(info.value)


# --------------------------------------------------------------------------------------------
# The example model


def test_the_digits_example_loads_as_its_config_describes() -> None:
    config = load_config(MODELS, "digits")
    assert config.name == "digits"
    assert config.backend == "onnx"
    assert config.platform == "onnxruntime_onnx"
    assert config.inputs == (TensorSpec("input", "FP32", (-1, 64)),)
    assert config.outputs == (
        TensorSpec("logits", "FP32", (-1, 10)),
        TensorSpec("label", "INT64", (-1,)),
    )
    assert config.versions == ("1",)
    assert config.max_batch == 64
    assert config.flush_ms == 2.0
    assert config.default_timeout_ms == 10_000
    assert config.cache_enabled is True
    assert config.cache_ttl_s == 300
    model_file = config.model_file("1")
    assert model_file == MODELS / "digits" / "1" / "model.onnx"
    assert model_file.is_file()


def test_the_example_repository_lists_the_digits_model() -> None:
    assert "digits" in list_models(MODELS)


def test_the_digits_metadata_names_the_last_version_the_default() -> None:
    metadata = load_config(MODELS, "digits").metadata()
    assert metadata.default_version == "1"
    assert metadata.max_batch == 64
    assert ModelMetadata.decode(metadata.encode()) == metadata
    assert load_config(MODELS, "digits").metadata(max_batch=8).max_batch == 8


# --------------------------------------------------------------------------------------------
# Valid configs


def test_a_minimal_config_takes_the_defaults(tmp_path: Path) -> None:
    make_model(tmp_path)
    config = load_config(tmp_path, "m")
    assert config == ModelConfig(
        name="m",
        root=tmp_path / "m",
        backend="simulated",
        platform="simulated",
        inputs=(TensorSpec("x", "FP32", (-1, 4)),),
        outputs=(TensorSpec("y", "INT64", (-1,)),),
        versions=("1",),
        warmup=Warmup(batch_sizes=()),  # a simulated model only sleeps: nothing to warm
    )
    assert config.max_batch == 32
    assert config.flush_ms == 2.0
    assert config.simulated == SimulatedLatency()
    assert config.model_file("1") is None


def test_an_onnx_model_defaults_to_the_onnxruntime_platform(tmp_path: Path) -> None:
    make_model(tmp_path, config=ONNX, model_file=True)
    config = load_config(tmp_path, "m")
    assert config.platform == "onnxruntime_onnx"
    assert config.model_file("1") == tmp_path / "m" / "1" / "model.onnx"


def test_every_setting_is_read(tmp_path: Path) -> None:
    top = """
platform = "custom"
max_batch = 7
flush_ms = 0
default_timeout_ms = 1500
intra_op_threads = 4
"""
    tables = """
[cache]
enabled = false
ttl_s = 9

[simulated]
base_ms = 1
per_row_ms = 0.5
jitter_ms = 0.25
failure_rate = 0.1
seed = 42
"""
    make_model(tmp_path, config=top + SIMULATED + tables)
    config = load_config(tmp_path, "m")
    assert config.platform == "custom"
    assert config.max_batch == 7
    assert config.flush_ms == 0.0
    assert isinstance(config.flush_ms, float)
    assert config.default_timeout_ms == 1500
    assert config.intra_op_threads == 4
    assert config.cache_enabled is False
    assert config.cache_ttl_s == 9
    assert config.simulated == SimulatedLatency(1.0, 0.5, 0.25, 0.1, 42)


# --------------------------------------------------------------------------------------------
# Invalid configs: every error names the file and the field

TOP = SIMULATED.split("[[inputs]]")[0]
TENSORS = "[[inputs]]" + SIMULATED.split("[[inputs]]")[1]


def _input(**fields: str) -> str:
    body = {"name": '"x"', "datatype": '"FP32"', "shape": "[-1, 4]", **fields}
    lines = "".join(f"{k} = {v}\n" for k, v in body.items() if v != "")
    return (
        TOP + "[[inputs]]\n" + lines + '[[outputs]]\nname = "y"\ndatatype = "INT64"\nshape = [-1]\n'
    )


INVALID = [
    ("missing backend", SIMULATED.replace('backend = "simulated"', ""), "backend"),
    ("unknown backend", SIMULATED.replace('"simulated"', '"tensorrt"'), "backend"),
    ("backend not a string", SIMULATED.replace('"simulated"', "1"), "backend"),
    ("platform not a string", "platform = 3\n" + SIMULATED, "platform"),
    ("bad datatype", _input(datatype='"FLOAT"'), "inputs[0].datatype"),
    ("lower-case datatype", _input(datatype='"fp32"'), "inputs[0].datatype"),
    ("datatype not a string", _input(datatype="32"), "inputs[0].datatype"),
    ("missing datatype", _input(datatype=""), "inputs[0].datatype"),
    ("shape without batch dim", _input(shape="[4, -1]"), "inputs[0].shape"),
    ("shape of one fixed dim", _input(shape="[4]"), "inputs[0].shape"),
    ("empty shape", _input(shape="[]"), "inputs[0].shape"),
    ("zero dim", _input(shape="[-1, 0]"), "inputs[0].shape"),
    ("negative dim", _input(shape="[-1, -4]"), "inputs[0].shape"),
    ("string dim", _input(shape='[-1, "4"]'), "inputs[0].shape"),
    ("float dim", _input(shape="[-1, 4.0]"), "inputs[0].shape"),
    ("bool dim", _input(shape="[-1, true]"), "inputs[0].shape"),
    ("shape not a list", _input(shape='"-1,4"'), "inputs[0].shape"),
    ("missing shape", _input(shape=""), "inputs[0].shape"),
    ("missing name", _input(name=""), "inputs[0].name"),
    ("name not a string", _input(name="7"), "inputs[0].name"),
    (
        "duplicate input names",
        SIMULATED + '[[inputs]]\nname = "x"\ndatatype = "INT8"\nshape = [-1]\n',
        "inputs",
    ),
    (
        "duplicate output names",
        SIMULATED + '[[outputs]]\nname = "y"\ndatatype = "INT8"\nshape = [-1]\n',
        "outputs",
    ),
    ("no inputs", TOP + '[[outputs]]\nname = "y"\ndatatype = "INT8"\nshape = [-1]\n', "inputs"),
    (
        "empty inputs",
        "inputs = []\n" + SIMULATED.split("[[inputs]]")[0] + "[[outputs]]\n"
        'name = "y"\ndatatype = "INT8"\nshape = [-1]\n',
        "inputs",
    ),
    (
        "inputs not tables",
        'inputs = ["x"]\n' + TOP + '[[outputs]]\nname = "y"\ndatatype = "INT8"\nshape = [-1]\n',
        "inputs[0]",
    ),
    ("outputs not a list", 'outputs = "y"\n' + TOP + TENSORS.split("[[outputs]]")[0], "outputs"),
    ("negative flush_ms", "flush_ms = -1.0\n" + SIMULATED, "flush_ms"),
    ("infinite flush_ms", "flush_ms = inf\n" + SIMULATED, "flush_ms"),
    ("nan flush_ms", "flush_ms = nan\n" + SIMULATED, "flush_ms"),
    ("string flush_ms", 'flush_ms = "2"\n' + SIMULATED, "flush_ms"),
    ("bool flush_ms", "flush_ms = true\n" + SIMULATED, "flush_ms"),
    ("zero max_batch", "max_batch = 0\n" + SIMULATED, "max_batch"),
    ("negative max_batch", "max_batch = -8\n" + SIMULATED, "max_batch"),
    ("float max_batch", "max_batch = 2.5\n" + SIMULATED, "max_batch"),
    ("string max_batch", 'max_batch = "64"\n' + SIMULATED, "max_batch"),
    ("bool max_batch", "max_batch = true\n" + SIMULATED, "max_batch"),
    ("negative timeout", "default_timeout_ms = -5\n" + SIMULATED, "default_timeout_ms"),
    ("float threads", "intra_op_threads = 1.5\n" + SIMULATED, "intra_op_threads"),
    ("cache not a table", "cache = true\n" + SIMULATED, "cache"),
    ("cache.enabled not a bool", SIMULATED + "[cache]\nenabled = 1\n", "cache.enabled"),
    ("cache.ttl_s zero", SIMULATED + "[cache]\nttl_s = 0\n", "cache.ttl_s"),
    ("simulated.base_ms string", SIMULATED + '[simulated]\nbase_ms = "5"\n', "simulated.base_ms"),
    ("simulated.seed float", SIMULATED + "[simulated]\nseed = 1.5\n", "simulated.seed"),
    ("version_policy not a table", "version_policy = 1\n" + SIMULATED, "version_policy"),
    ("latest zero", SIMULATED + "[version_policy]\nlatest = 0\n", "version_policy.latest"),
    ("latest string", SIMULATED + '[version_policy]\nlatest = "all"\n', "version_policy.latest"),
    ("specific empty", SIMULATED + "[version_policy]\nspecific = []\n", "version_policy.specific"),
    (
        "specific not a list",
        SIMULATED + '[version_policy]\nspecific = "1"\n',
        "version_policy.specific",
    ),
    (
        "specific holds a float",
        SIMULATED + "[version_policy]\nspecific = [1.5]\n",
        "version_policy.specific",
    ),
    (
        "specific names a missing version",
        SIMULATED + '[version_policy]\nspecific = ["1", "7"]\n',
        "version_policy.specific",
    ),
]


@pytest.mark.parametrize(("why", "config", "field"), INVALID, ids=[c[0] for c in INVALID])
def test_an_invalid_config_is_rejected_naming_the_file_and_the_field(
    tmp_path: Path, why: str, config: str, field: str
) -> None:
    make_model(tmp_path, config=config)
    message = rejected(tmp_path)
    assert str(tmp_path / "m" / CONFIG_FILE) in message
    assert f"field '{field}'" in message


def test_a_missing_specific_version_is_named(tmp_path: Path) -> None:
    make_model(tmp_path, config=SIMULATED + '[version_policy]\nspecific = ["1", "7"]\n')
    assert "7" in rejected(tmp_path).split("specific'")[1]


@pytest.mark.parametrize(
    "text",
    [
        "backend = ",
        'backend = "simulated"\nbackend = "onnx"\n',
        "[[inputs]\n",
        'backend = "simulated\n',
    ],
)
def test_invalid_toml_is_rejected_naming_the_file(tmp_path: Path, text: str) -> None:
    make_model(tmp_path, config=text)
    message = rejected(tmp_path)
    assert str(tmp_path / "m" / CONFIG_FILE) in message
    assert "not valid TOML" in message


def test_a_config_that_is_not_utf8_is_rejected_as_invalid_toml(tmp_path: Path) -> None:
    model_dir = make_model(tmp_path)
    (model_dir / CONFIG_FILE).write_bytes(b'backend = "\xff"\n')
    assert "not valid TOML" in rejected(tmp_path)


def test_a_model_without_version_folders_is_rejected_naming_its_folder(tmp_path: Path) -> None:
    model_dir = make_model(tmp_path, versions=())
    (model_dir / "notes.txt").write_text("2 is coming")
    message = rejected(tmp_path)
    assert str(model_dir) in message
    assert "no version folders" in message


def test_an_onnx_version_without_model_onnx_is_rejected_naming_the_file(tmp_path: Path) -> None:
    make_model(tmp_path, config=ONNX, versions=("1", "2"), model_file=True)
    (tmp_path / "m" / "2" / "model.onnx").unlink()
    message = rejected(tmp_path)
    assert str(tmp_path / "m" / "2" / "model.onnx") in message
    assert "version 2" in message


def test_a_model_onnx_that_is_a_folder_is_rejected(tmp_path: Path) -> None:
    make_model(tmp_path, config=ONNX)
    (tmp_path / "m" / "1" / "model.onnx").mkdir()
    assert "missing" in rejected(tmp_path)


def test_an_older_version_without_model_onnx_does_not_matter_when_not_loaded(
    tmp_path: Path,
) -> None:
    make_model(tmp_path, config=ONNX, versions=("1", "2"), model_file=True)
    (tmp_path / "m" / "1" / "model.onnx").unlink()
    assert load_config(tmp_path, "m").versions == ("2",)


def test_a_missing_model_is_reported_as_not_found(tmp_path: Path) -> None:
    message = rejected(tmp_path, "ghost")
    assert "'ghost' not found" in message
    assert str(tmp_path / "ghost" / CONFIG_FILE) in message


# --------------------------------------------------------------------------------------------
# Staying inside the repository


@pytest.mark.parametrize(
    "name", ["..", "../m", "a/b", "m/../m", "/etc", ".m", ".", "", "a..b", "m:1", "m\n"]
)
def test_model_names_that_could_leave_the_repository_are_refused(tmp_path: Path, name: str) -> None:
    make_model(tmp_path / "repo")
    make_model(tmp_path, "etc")
    with pytest.raises(RepositoryError, match="invalid model name"):
        load_config(tmp_path / "repo", name)


def test_a_model_folder_symlinked_out_of_the_repository_is_refused(tmp_path: Path) -> None:
    make_model(tmp_path / "outside")
    (tmp_path / "repo").mkdir()
    os.symlink(tmp_path / "outside" / "m", tmp_path / "repo" / "m")
    assert "outside the repository" in rejected(tmp_path / "repo")


def test_a_version_folder_symlinked_out_of_the_repository_is_refused(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    make_model(repo, versions=())
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", repo / "m" / "1")
    message = rejected(repo)
    assert str(repo / "m" / "1") in message
    assert "outside the repository" in message


def test_a_specific_version_symlinked_out_of_the_repository_is_refused(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    make_model(repo, config=SIMULATED + '[version_policy]\nspecific = ["2", "1"]\n')
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", repo / "m" / "2")
    assert "outside the repository" in rejected(repo)


def test_a_model_file_symlinked_out_of_the_repository_is_refused(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    make_model(repo, config=ONNX)
    (tmp_path / "stolen.onnx").write_bytes(b"weights")
    os.symlink(tmp_path / "stolen.onnx", repo / "m" / "1" / "model.onnx")
    message = rejected(repo)
    assert str(repo / "m" / "1" / "model.onnx") in message
    assert "outside the repository" in message


def test_a_config_file_symlinked_out_of_the_repository_is_refused(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    model_dir = make_model(repo)
    (tmp_path / "config.toml").write_text(SIMULATED)
    (model_dir / CONFIG_FILE).unlink()
    os.symlink(tmp_path / "config.toml", model_dir / CONFIG_FILE)
    assert "outside the repository" in rejected(repo)


def test_symlinks_that_stay_inside_the_repository_are_followed(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    make_model(repo, config=ONNX, versions=("1",), model_file=True)
    os.symlink(repo / "m" / "1", repo / "m" / "2")
    assert load_config(repo, "m").versions == ("2",)


def test_a_version_folder_with_an_invalid_name_is_ignored(tmp_path: Path) -> None:
    make_model(tmp_path, versions=("1", ".hidden", "-x"))
    assert load_config(tmp_path, "m").versions == ("1",)


# --------------------------------------------------------------------------------------------
# Version policy


def test_the_default_policy_loads_only_the_highest_version(tmp_path: Path) -> None:
    make_model(tmp_path, versions=("1", "3", "2"))
    config = load_config(tmp_path, "m")
    assert config.versions == ("3",)
    assert config.metadata().default_version == "3"


def test_latest_two_picks_the_two_highest_numeric_versions(tmp_path: Path) -> None:
    make_model(
        tmp_path,
        config=SIMULATED + "[version_policy]\nlatest = 2\n",
        versions=("1", "2", "9", "10"),
    )
    config = load_config(tmp_path, "m")
    assert config.versions == ("9", "10")
    assert config.metadata().default_version == "10"


def test_versions_sort_numerically_not_as_text(tmp_path: Path) -> None:
    make_model(
        tmp_path,
        config=SIMULATED + "[version_policy]\nlatest = 100\n",
        versions=("10", "9", "100", "1", "20"),
    )
    assert load_config(tmp_path, "m").versions == ("1", "9", "10", "20", "100")


def test_named_versions_sort_after_numbered_ones(tmp_path: Path) -> None:
    make_model(
        tmp_path,
        config=SIMULATED + "[version_policy]\nlatest = 3\n",
        versions=("beta", "2", "10", "alpha"),
    )
    assert load_config(tmp_path, "m").versions == ("10", "alpha", "beta")


def test_latest_larger_than_the_versions_available_loads_them_all(tmp_path: Path) -> None:
    make_model(tmp_path, config=SIMULATED + "[version_policy]\nlatest = 5\n", versions=("2", "1"))
    assert load_config(tmp_path, "m").versions == ("1", "2")


def test_specific_versions_load_in_the_order_given(tmp_path: Path) -> None:
    make_model(
        tmp_path,
        config=SIMULATED + '[version_policy]\nspecific = [10, "2"]\n',
        versions=("1", "2", "10"),
    )
    config = load_config(tmp_path, "m")
    assert config.versions == ("10", "2")
    assert config.metadata().default_version == "2"


# --------------------------------------------------------------------------------------------
# list_models


def test_list_models_names_every_folder_with_a_config_in_order(tmp_path: Path) -> None:
    make_model(tmp_path, "zeta")
    make_model(tmp_path, "alpha")
    make_model(tmp_path, "Mid-1.0")
    (tmp_path / "no-config").mkdir()
    (tmp_path / "loose-file").write_text("x")
    make_model(tmp_path, ".hidden")
    assert list_models(tmp_path) == ["Mid-1.0", "alpha", "zeta"]


def test_list_models_includes_models_that_will_fail_to_load(tmp_path: Path) -> None:
    make_model(tmp_path, "broken", config="backend = ")
    assert list_models(tmp_path) == ["broken"]
    with pytest.raises(RepositoryError):
        load_config(tmp_path, "broken")


def test_an_empty_repository_lists_no_models(tmp_path: Path) -> None:
    assert list_models(tmp_path) == []


def test_a_repository_that_is_not_a_folder_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(RepositoryError, match="not a directory"):
        list_models(tmp_path / "missing")
    (tmp_path / "file").write_text("")
    with pytest.raises(RepositoryError, match="not a directory"):
        list_models(tmp_path / "file")


def test_weights_in_the_config_pick_the_versions_and_their_split(tmp_path: Path) -> None:
    make_model(
        tmp_path,
        config=SIMULATED + '[version_policy]\nweights = { "1" = 90, "2" = 10 }\n',
        versions=("1", "2", "3"),
    )
    config = load_config(tmp_path, "m")
    assert config.versions == ("1", "2")
    assert config.weights == {"1": 90.0, "2": 10.0}
    assert config.metadata().weights == {"1": 90.0, "2": 10.0}


@pytest.mark.parametrize(
    ("weights", "words"),
    [
        ('{ "1" = -1 }', "not negative"),
        ('{ "7" = 1 }', "no folder: 7"),
        ('{ "1" = "x" }', "must be a number"),
        ("[1]", "must be dict"),
    ],
)
def test_bad_config_weights_name_the_field(tmp_path: Path, weights: str, words: str) -> None:
    make_model(tmp_path, config=SIMULATED + f"[version_policy]\nweights = {weights}\n")
    message = rejected(tmp_path)
    assert "version_policy.weights" in message and words in message


def test_a_committed_policy_overrides_the_config(tmp_path: Path) -> None:
    from protocol.control import VersionPolicy

    make_model(tmp_path, versions=("1", "2", "3"))
    config = load_config(tmp_path, "m", VersionPolicy(("1", "3"), {"1": 1.0, "3": 1.0}, 5))
    assert config.versions == ("1", "3") and config.weights == {"1": 1.0, "3": 1.0}
    assert load_config(tmp_path, "m", VersionPolicy((), {}, 6)).versions == ()
    with pytest.raises(RepositoryError, match="no version folder for 9"):
        load_config(tmp_path, "m", VersionPolicy(("9",), {}, 7))


def test_a_config_may_pin_its_model_to_a_device(tmp_path: Path) -> None:
    from consumer.model import ServedModel

    make_model(tmp_path, "pinned", config='device = "cpu"\n' + SIMULATED)
    make_model(tmp_path, "free")
    assert ServedModel(load_config(tmp_path, "pinned"), device="cuda").device == "cpu"
    assert ServedModel(load_config(tmp_path, "free"), device="cuda").device == "cuda"
    make_model(tmp_path, "bad", config='device = "tpu"\n' + SIMULATED)
    assert "field 'device' must be" in rejected(tmp_path, "bad")


# -- what a worker advertises of its repository ------------------------------------------------


def test_a_scan_lists_every_model_folder_with_its_versions_or_why_it_cannot_load(tmp_path):
    make_model(tmp_path, "a", versions=("1", "2"))
    make_model(tmp_path, "broken", config="backend = 'nope'\n")
    scan = RepositoryScan(tmp_path, max_batch=8, flush_ms=0.5)
    by_name = {m.name: m for m in scan.scan()}
    assert sorted(by_name) == ["a", "broken"]
    a = by_name["a"]
    assert a.versions == ("1", "2") and not a.error
    assert a.metadata is not None and a.metadata.versions == ("2",)  # latest = 1
    assert (a.metadata.max_batch, a.metadata.flush_ms, a.metadata.backend) == (8, 0.5, "simulated")
    broken = by_name["broken"]
    assert broken.metadata is None and "field 'backend'" in broken.error
    # A folder added later is in the next scan; one removed is gone from it.
    make_model(tmp_path, "later")
    assert [m.name for m in scan.scan()] == ["a", "broken", "later"]
    (tmp_path / "later" / CONFIG_FILE).unlink()
    assert [m.name for m in scan.scan()] == ["a", "broken"]


def test_a_scan_reads_a_config_again_only_when_its_folder_changed(tmp_path, monkeypatch):
    model_dir = make_model(tmp_path, "a")
    scan = RepositoryScan(tmp_path)
    first = scan.scan()
    reads: list[str] = []
    real = load_config

    def counting(repo: Path, name: str, policy=None) -> ModelConfig:
        reads.append(name)
        return real(repo, name, policy)

    monkeypatch.setattr("consumer.repository.load_config", counting)
    assert scan.scan() == first and reads == []
    (model_dir / "3").mkdir()
    (again,) = scan.scan()
    assert reads == ["a"] and again.versions == ("1", "3")


def test_a_worker_with_models_named_lists_only_those(tmp_path):
    make_model(tmp_path, "a")
    make_model(tmp_path, "b")
    listed = RepositoryScan(tmp_path, ("b", "missing")).scan()
    assert [(m.name, m.metadata is not None) for m in listed] == [("b", True), ("missing", False)]
    assert "model 'missing' not found" in listed[1].error


def test_a_policy_naming_a_missing_version_is_its_own_error(tmp_path):
    from protocol.control import VersionPolicy

    make_model(tmp_path, "a", versions=("1",))
    with pytest.raises(MissingVersion, match="no version folder for 2"):
        load_config(tmp_path, "a", VersionPolicy(("2",), {}, 3))
