"""The model repository: ``{repo}/{model}/config.toml`` plus ``{repo}/{model}/{version}/``.

The layout Triton users know. A config names the backend, the inputs and outputs, batching,
timeout and cache settings, and the version policy. Invalid configs are rejected at load time with
an error naming the file and the field. Models load only from inside the repository: names and
versions are checked, and every resolved path must stay under the repository root, so ``..``,
absolute paths and symlinks that point out of it are refused.
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol.control import VersionPolicy, check_weights, version_order
from protocol.errors import ProtocolError
from protocol.keys import MAX_PARTITIONS, is_valid_name
from protocol.registry import ModelMetadata, RepositoryModel, TensorSpec
from protocol.tensor import DATATYPES

CONFIG_FILE = "config.toml"
BACKENDS: dict[str, tuple[str, ...]] = {
    "onnx": ("model.onnx",),
    "pytorch": ("model.pt2", "model.ts"),
    "simulated": (),
    "python": ("model.py",),
}
"""Backend name -> the files a version folder may hold, in order of preference; it must hold
one of them (none needed when empty). PyTorch: a ``torch.export`` archive or TorchScript.
Python: the version's own code (``consumer.backends.python``)."""
PLATFORMS = {"onnx": "onnxruntime_onnx", "pytorch": "pytorch_libtorch"}
"""The platform reported in model metadata when the config names none (Triton's names)."""
TOKENIZE = "tokenize"
TOKENIZE_OUTPUTS = ("input_ids", "attention_mask", "token_type_ids")


class RepositoryError(Exception):
    """A model that cannot be loaded from the repository, with where and why."""


class MissingVersion(RepositoryError):
    """A committed policy names a version that has no folder in the repository (removed since
    the policy was committed, or never present on this worker)."""


@dataclass(frozen=True)
class SimulatedLatency:
    """Batch latency ``base_ms + per_row_ms * rows``, with jitter and a failure rate."""

    base_ms: float = 5.0
    per_row_ms: float = 0.05
    jitter_ms: float = 0.0
    failure_rate: float = 0.0
    seed: int = 0
    crash_value: float | None = None
    """An input value that makes the worker process exit at once (chaos tests)."""
    load_ms: float = 0.0
    """How long loading a version takes (a large model's load and warm-up, without the CPU)."""
    executions_dir: Path | None = None
    """A folder where each worker process records the rows it ran (chaos tests count
    executions per request); relative paths are relative to the model's folder."""


@dataclass(frozen=True)
class TokenizeStage:
    """``[preprocess] kind = "tokenize"``: UTF-8 text in one BYTES input becomes the integer
    token tensors a transformer graph takes, each batch padded to its own longest sequence."""

    input: str
    """The public BYTES input that holds one text per row."""
    tokenizer: str = "tokenizer.json"
    """A Hugging Face ``tokenizers`` file, inside each version folder."""
    max_length: int = 256
    """Longer texts are truncated to this many tokens (special tokens included)."""
    outputs: tuple[str, ...] = ("input_ids", "attention_mask")
    """The INT64 ``[batch, sequence]`` tensors handed to the model, in call order."""
    bucket_rows: int = 0
    """Batches of more rows run as length-sorted sub-batches of this many (0: never split)."""

    def output_specs(self) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(n, "INT64", (-1, -1)) for n in self.outputs)


@dataclass(frozen=True)
class PythonCode:
    """``[python]``: which class of a version's ``model.py`` serves, and its own settings."""

    class_name: str | None = None
    """``class``: the class to serve; None: the one class ``model.py`` defines."""
    parameters: dict[str, Any] = field(default_factory=dict)
    """``[python.parameters]``: free-form settings handed to the model's ``load``."""


@dataclass(frozen=True)
class Warmup:
    """``[warmup]``: model calls made after a version loads, before it serves."""

    batch_sizes: tuple[int, ...] = (1,)
    """One call per entry, of that many rows (``[]``: no warm-up; simulated models default to
    none)."""
    texts: tuple[str, ...] = ()
    """Sample rows for BYTES inputs (cycled to fill a batch); without them a model with a BYTES
    input is not warmed up. Other inputs get zeros."""


@dataclass(frozen=True)
class ModelConfig:
    name: str
    root: Path
    backend: str
    platform: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    versions: tuple[str, ...]
    """Versions to load, in serving order (the last one is the default)."""
    weights: dict[str, float] = field(default_factory=dict)
    """Version -> share of requests that name no version (empty: all to the newest)."""
    max_batch: int = 32
    flush_ms: float = 2.0
    default_timeout_ms: int = 10_000
    cache_enabled: bool = True
    cache_ttl_s: int = 300
    intra_op_threads: int = 1
    simulated: SimulatedLatency = field(default_factory=SimulatedLatency)
    preprocess: TokenizeStage | None = None
    """A pre-processing stage run on the worker between the request and the backend."""
    python: PythonCode = field(default_factory=PythonCode)
    warmup: Warmup = field(default_factory=Warmup)
    device: str | None = None
    """Where this model runs ("cpu" or "cuda"); None: wherever the worker's --device says. A
    small model pinned to the CPU stays off the accelerator on a GPU worker."""
    partitions: int = 1
    """Request streams per lane, each on its own Redis Cluster slot (see ``protocol.keys``):
    gateways spread requests over them and every worker of the model reads all of them."""

    def version_path(self, version: str) -> Path:
        return self.root / version

    def model_file(self, version: str) -> Path | None:
        """The file the backend loads: the first of its accepted names that exists (the first
        name when none does, for the error message), or None when the backend needs no file."""
        candidates = [self.version_path(version) / n for n in BACKENDS[self.backend]]
        return next((p for p in candidates if p.is_file()), candidates[0] if candidates else None)

    def backend_inputs(self) -> tuple[TensorSpec, ...]:
        """The tensors the backend receives, in call order: the pre-processing stage's outputs
        when the model has one, else the public inputs."""
        return self.inputs if self.preprocess is None else self.preprocess.output_specs()

    def metadata(
        self, *, max_batch: int | None = None, flush_ms: float | None = None
    ) -> ModelMetadata:
        """As the gateway knows the model; ``max_batch`` and ``flush_ms``: a worker's overrides."""
        return ModelMetadata(
            name=self.name,
            versions=self.versions,
            default_version=self.versions[-1] if self.versions else "",
            platform=self.platform,
            inputs=self.inputs,
            outputs=self.outputs,
            max_batch=max_batch or self.max_batch,
            default_timeout_ms=self.default_timeout_ms,
            cache_enabled=self.cache_enabled,
            cache_ttl_s=self.cache_ttl_s,
            weights=self.weights,
            partitions=self.partitions,
            backend=self.backend,
            flush_ms=self.flush_ms if flush_ms is None else flush_ms,
        )


class _Fields:
    """Typed access to one config table; every error names the file and the field."""

    def __init__(self, path: Path, table: dict[str, Any], prefix: str = "") -> None:
        self.path, self.table, self.prefix = path, table, prefix

    def fail(self, key: str, why: str) -> RepositoryError:
        return RepositoryError(f"{self.path}: field '{self.prefix}{key}' {why}")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        if key not in self.table:
            if default is ...:
                raise self.fail(key, "is required")
            return default
        value = self.table[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            names = " or ".join(k.__name__ for k in kinds)
            raise self.fail(key, f"must be {names}, got {value!r}")
        return value

    def positive(self, key: str, kind: type, default: Any) -> Any:
        value = self.get(key, (int, float) if kind is float else kind, default)
        if value <= 0:
            raise self.fail(key, f"must be positive, got {value!r}")
        return kind(value)

    def sub(self, key: str) -> _Fields:
        return _Fields(self.path, self.get(key, dict, {}), f"{self.prefix}{key}.")


def _specs(f: _Fields, key: str) -> tuple[TensorSpec, ...]:
    items = f.get(key, list)
    if not items:
        raise f.fail(key, "must list at least one tensor")
    specs = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise f.fail(f"{key}[{i}]", "must be a table with name, datatype and shape")
        t = _Fields(f.path, item, f"{f.prefix}{key}[{i}].")
        datatype = t.get("datatype", str)
        if datatype not in DATATYPES:
            raise t.fail("datatype", f"must be one of {', '.join(sorted(DATATYPES))}")
        shape = t.get("shape", list)
        if not shape or not all(
            isinstance(d, int) and not isinstance(d, bool) and (d > 0 or d == -1) for d in shape
        ):
            raise t.fail("shape", "must be a list of positive integers or -1")
        if shape[0] != -1:
            raise t.fail("shape", "must start with the batch dimension -1")
        specs.append(TensorSpec(t.get("name", str), datatype, tuple(shape)))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise f.fail(key, "has duplicate names")
    return tuple(specs)


def is_inside(root: Path, path: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True


def available_versions(model_dir: Path) -> list[str]:
    """Version folders of a model, oldest first."""
    return sorted(
        (p.name for p in model_dir.iterdir() if p.is_dir() and is_valid_name(p.name)),
        key=version_order,
    )


def _versions(
    f: _Fields, model_dir: Path, repo: Path, override: VersionPolicy | None
) -> tuple[tuple[str, ...], dict[str, float]]:
    """The versions to load and their traffic weights: the committed policy when one is given
    (an admin load), else the config's ``[version_policy]``."""
    available = available_versions(model_dir)
    policy = f.sub("version_policy")
    weights: dict[str, float] = {}
    if override is not None:
        versions = list(override.versions)
        weights = dict(override.weights)
        missing = [v for v in versions if v not in available]
        if missing:
            raise MissingVersion(
                f"{model_dir}: no version folder for {', '.join(missing)} "
                f"(versions in the repository: {', '.join(available) or 'none'})"
            )
    elif "weights" in policy.table:
        try:
            weights = check_weights(policy.get("weights", dict))
        except ProtocolError as e:
            raise policy.fail("weights", str(e).removeprefix("weights: ")) from None
        versions = sorted(weights, key=version_order)
        missing = [v for v in versions if v not in available]
        if missing:
            raise policy.fail("weights", f"names versions with no folder: {', '.join(missing)}")
    elif "specific" in policy.table:
        wanted = policy.get("specific", list)
        if not wanted or not all(isinstance(v, str | int) for v in wanted):
            raise policy.fail("specific", "must be a non-empty list of versions")
        versions = [str(v) for v in wanted]
        missing = [v for v in versions if v not in available]
        if missing:
            raise policy.fail("specific", f"names versions with no folder: {', '.join(missing)}")
    else:
        latest = policy.positive("latest", int, 1)
        versions = available[-latest:]
    if not versions and (override is None or override.loaded):
        raise RepositoryError(
            f"{model_dir}: no version folders (expected e.g. {model_dir}/1/; the example models "
            "that are not in git are built by `inferq models build-examples`)"
        )
    for v in versions:
        if not is_inside(repo, model_dir / v):
            raise RepositoryError(f"{model_dir / v}: version folder points outside the repository")
    return tuple(versions), weights


def load_config(repo: Path, name: str, policy: VersionPolicy | None = None) -> ModelConfig:
    """Read and validate one model's config from the repository; ``policy`` (a committed admin
    policy) replaces the config's own choice of versions and weights."""
    if not is_valid_name(name):
        raise RepositoryError(f"invalid model name {name!r}: use letters, digits, '_', '-', '.'")
    model_dir = repo / name
    if not is_inside(repo, model_dir):
        raise RepositoryError(f"{model_dir}: model folder points outside the repository")
    path = model_dir / CONFIG_FILE
    if not path.is_file():
        raise RepositoryError(f"model '{name}' not found: no {path}")
    if not is_inside(repo, path):
        raise RepositoryError(f"{path}: config file points outside the repository")
    try:
        with path.open("rb") as fh:
            table = tomllib.load(fh)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:  # TOML must be UTF-8
        raise RepositoryError(f"{path}: not valid TOML: {e}") from e
    f = _Fields(path, table)
    backend = f.get("backend", str)
    if backend not in BACKENDS:
        raise f.fail("backend", f"must be one of {', '.join(BACKENDS)}, got {backend!r}")
    cache = f.sub("cache")
    sim = f.sub("simulated")
    versions, weights = _versions(f, model_dir, repo, policy)
    config = ModelConfig(
        name=name,
        root=model_dir,
        backend=backend,
        platform=f.get("platform", str, PLATFORMS.get(backend, backend)),
        inputs=_specs(f, "inputs"),
        outputs=_specs(f, "outputs"),
        versions=versions,
        weights=weights,
        max_batch=f.positive("max_batch", int, 32),
        flush_ms=float(f.get("flush_ms", (int, float), 2.0)),
        default_timeout_ms=f.positive("default_timeout_ms", int, 10_000),
        cache_enabled=cache.get("enabled", bool, True),
        cache_ttl_s=cache.positive("ttl_s", int, 300),
        intra_op_threads=int(f.get("intra_op_threads", int, 1)),
        simulated=SimulatedLatency(
            base_ms=float(sim.get("base_ms", (int, float), 5.0)),
            per_row_ms=float(sim.get("per_row_ms", (int, float), 0.05)),
            jitter_ms=float(sim.get("jitter_ms", (int, float), 0.0)),
            load_ms=float(sim.get("load_ms", (int, float), 0.0)),
            failure_rate=float(sim.get("failure_rate", (int, float), 0.0)),
            seed=int(sim.get("seed", int, 0)),
            crash_value=(
                float(sim.get("crash_value", (int, float))) if "crash_value" in sim.table else None
            ),
            executions_dir=(
                model_dir / sim.get("executions_dir", str)
                if "executions_dir" in sim.table
                else None
            ),
        ),
        preprocess=_preprocess(f),
        python=_python(f, backend),
        warmup=_warmup(f, backend),
        device=f.get("device", str, None),
        partitions=f.positive("partitions", int, 1),
    )
    if config.partitions > MAX_PARTITIONS:
        raise f.fail("partitions", f"must be at most {MAX_PARTITIONS}, got {config.partitions}")
    if config.device not in (None, "cpu", "cuda"):
        raise f.fail("device", f'must be "cpu" or "cuda", got {config.device!r}')
    if config.flush_ms < 0 or not math.isfinite(config.flush_ms):
        raise f.fail("flush_ms", f"must be a finite number, not negative, got {config.flush_ms!r}")
    for v in config.versions:
        file = config.model_file(v)
        if file is not None:
            if not file.is_file():
                wanted = " or ".join(BACKENDS[backend])
                raise RepositoryError(f"model '{name}' version {v}: missing {file.parent / wanted}")
            if not is_inside(repo, file):
                raise RepositoryError(f"{file}: model file points outside the repository")
        if config.preprocess is not None:
            _check_tokenizer(f, repo, config, v)
    return config


def _preprocess(f: _Fields) -> TokenizeStage | None:
    if "preprocess" not in f.table:
        return None
    p = f.sub("preprocess")
    kind = p.get("kind", str)
    if kind != TOKENIZE:
        raise p.fail("kind", f"must be {TOKENIZE!r}, got {kind!r}")
    inputs = _specs(f, "inputs")
    text = [s.name for s in inputs if s.datatype == "BYTES"]
    name = p.get("input", str, text[0] if len(text) == 1 else "")
    if len(inputs) != 1 or name != inputs[0].name or inputs[0].datatype != "BYTES":
        raise p.fail("input", "must name the model's one input, of datatype BYTES")
    tokenizer = p.get("tokenizer", str, "tokenizer.json")
    if not tokenizer or Path(tokenizer).is_absolute() or ".." in Path(tokenizer).parts:
        raise p.fail(
            "tokenizer", f"must be a file name inside the version folder, got {tokenizer!r}"
        )
    outputs = p.get("outputs", list, ["input_ids", "attention_mask"])
    if (
        not outputs
        or any(o not in TOKENIZE_OUTPUTS for o in outputs)
        or len(set(outputs)) != len(outputs)
    ):
        raise p.fail("outputs", f"must list distinct names from {', '.join(TOKENIZE_OUTPUTS)}")
    bucket_rows = p.get("bucket_rows", int, 0)
    if bucket_rows < 0:
        raise p.fail("bucket_rows", f"must not be negative, got {bucket_rows!r}")
    return TokenizeStage(
        input=name,
        tokenizer=tokenizer,
        max_length=p.positive("max_length", int, 256),
        outputs=tuple(outputs),
        bucket_rows=bucket_rows,
    )


def _python(f: _Fields, backend: str) -> PythonCode:
    if "python" not in f.table:
        return PythonCode()
    if backend != "python":
        raise f.fail("python", f'is for backend = "python" only, not {backend!r}')
    p = f.sub("python")
    class_name = p.get("class", str, None)
    if class_name is not None and not class_name.isidentifier():
        raise p.fail("class", f"must be a class name, got {class_name!r}")
    return PythonCode(class_name=class_name, parameters=dict(p.get("parameters", dict, {})))


def _warmup(f: _Fields, backend: str) -> Warmup:
    w = f.sub("warmup")
    # A simulated model only sleeps: warming it proves nothing, and one with a failure rate
    # would fail its warm-up. Real backends get one 1-row call unless the config says otherwise.
    sizes = w.get("batch_sizes", list, [] if backend == "simulated" else [1])
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes):
        raise w.fail("batch_sizes", "must be a list of positive integers")
    texts = w.get("texts", list, [])
    if not all(isinstance(t, str) for t in texts):
        raise w.fail("texts", "must be a list of strings")
    return Warmup(batch_sizes=tuple(sizes), texts=tuple(texts))


def _check_tokenizer(f: _Fields, repo: Path, config: ModelConfig, version: str) -> None:
    """The tokenizer file of a version: present, and inside the repository."""
    assert config.preprocess is not None
    path = config.version_path(version) / config.preprocess.tokenizer
    if not path.is_file():
        raise f.fail("preprocess.tokenizer", f"names {path}, which does not exist")
    if not is_inside(repo, path):
        raise f.fail("preprocess.tokenizer", f"names {path}, which points outside the repository")


def list_models(repo: Path) -> list[str]:
    """Every model folder in the repository that has a config file."""
    if not repo.is_dir():
        raise RepositoryError(f"model repository {repo} is not a directory")
    return sorted(
        p.name for p in repo.iterdir() if is_valid_name(p.name) and (p / CONFIG_FILE).is_file()
    )


Fingerprint = tuple[int, int, tuple[tuple[str, tuple[tuple[str, int], ...]], ...]]


class RepositoryScan:
    """What a worker's repository holds for the models a load call may name on it: every model
    folder (``names`` empty: the worker serves the whole repository), or just ``names``.

    Rescanned with every heartbeat, so it must stay cheap: a model's config is parsed again only
    when its folder changed (the config file's mtime and size, the version folders and the
    names and mtimes of what they hold); otherwise a scan is a few ``stat`` calls per model.
    Run it off the event loop (it touches the file system)."""

    def __init__(
        self,
        repo: Path,
        names: tuple[str, ...] = (),
        *,
        max_batch: int | None = None,
        flush_ms: float | None = None,
    ) -> None:
        self.repo = repo
        self.names = names
        self._max_batch, self._flush_ms = max_batch, flush_ms
        self._seen: dict[str, tuple[Fingerprint | None, RepositoryModel]] = {}

    def scan(self) -> tuple[RepositoryModel, ...]:
        try:
            names = list(self.names) or list_models(self.repo)
        except (RepositoryError, OSError):
            names = []
        found: dict[str, tuple[Fingerprint | None, RepositoryModel]] = {}
        for name in names:
            fingerprint = _fingerprint(self.repo / name) if is_valid_name(name) else None
            seen = self._seen.get(name)
            if seen is not None and fingerprint is not None and seen[0] == fingerprint:
                found[name] = seen
            else:
                found[name] = (fingerprint, self._describe(name))
        self._seen = found
        return tuple(model for _, model in found.values())

    def _describe(self, name: str) -> RepositoryModel:
        folder = self.repo / name
        versions: tuple[str, ...] = ()
        try:
            if is_valid_name(name) and folder.is_dir():
                versions = tuple(available_versions(folder))
            config = load_config(self.repo, name)
        except (RepositoryError, OSError) as e:
            return RepositoryModel(name, versions, None, str(e))
        except Exception as e:  # an operator's file must never end the heartbeat that scans it
            return RepositoryModel(name, versions, None, f"{type(e).__name__}: {e}")
        meta = config.metadata(
            max_batch=self._max_batch or config.max_batch,
            flush_ms=config.flush_ms if self._flush_ms is None else self._flush_ms,
        )
        return RepositoryModel(name, versions, meta)


def _fingerprint(folder: Path) -> Fingerprint | None:
    """What changes when anything that ``load_config`` reads there changes; None when the
    folder cannot be read (the model is described again at every scan)."""
    try:
        config = (folder / CONFIG_FILE).stat()
        versions = []
        with os.scandir(folder) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                if entry.is_dir():
                    with os.scandir(entry.path) as files:
                        held = tuple(sorted((f.name, f.stat().st_mtime_ns) for f in files))
                    versions.append((entry.name, held))
    except OSError:
        return None
    return config.st_mtime_ns, config.st_size, tuple(versions)
