"""The Python backend: a version's own code, ``{repository}/{model}/{version}/model.py``.

``model.py`` defines one class (or ``[python] class`` names one) with the contract of every
backend::

    class Model:
        def load(self, config, device): ...   # optional: read weights from config.folder
        def predict(self, inputs): ...        # dict of numpy arrays in, dict of arrays out
        def unload(self): ...                 # optional

The class is built with no arguments. ``load`` gets a ``ModelSettings`` (name, version, folder,
inputs, outputs, max_batch, ``[python.parameters]``) and the device ("cpu" or "cuda");
``predict`` gets one batch, every input with the batch dimension first (``BYTES`` inputs as
object arrays of ``bytes``; arrays are read-only views of the requests), and returns every
declared output with the same number of rows (``BYTES`` outputs as arrays of ``bytes`` or
``str``). What it returns is checked against the config (``check_outputs``). Any of the three
may be ``async def``.

Everything the class does runs on its version's own thread (``UserThread``): the import, the
constructor, ``load``, every ``predict`` and ``unload``, one call at a time, never on the
worker's event loop (``may_run_inline`` is False, however quick the calls), so thread-affine
state (a CUDA context, an event loop, a database handle) stays valid. A ``predict`` is waited
for until the batch's deadline; what happens after that is ``consumer.backends.userthread``'s
to say.

Only code inside the repository runs: ``model.py`` is resolved (symlinks followed) and must lie
inside the repository; it is imported from that file under a module name of its own
(``inferq_model_{model}_{version}_{n}``), never through ``sys.path``, and nothing a request
carries names code. No pickle: a model keeps its weights as ONNX, safetensors or skops.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import itertools
import re
import sys
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from consumer.backends.base import Arrays, BackendError, BadOutput
from consumer.backends.userthread import UserThread
from consumer.repository import ModelConfig, is_inside
from protocol.registry import TensorSpec

log = structlog.get_logger("inferq.worker")

UNLOAD_TIMEOUT_S = 10.0
"""How long unloading waits for the model's ``unload``."""
_modules = itertools.count(1)


@dataclass(frozen=True)
class ModelSettings:
    """What a Python model's ``load(config, device)`` gets as ``config``."""

    name: str
    version: str
    folder: Path
    """The version folder, where the model keeps its files."""
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch: int
    parameters: dict[str, Any] = field(default_factory=dict)
    """``[python.parameters]`` from config.toml."""


class PythonBackend:
    may_run_inline = False

    def __init__(self, config: ModelConfig, version: str, *, device: str = "cpu") -> None:
        self.config = config
        self.version = version
        self.device = device
        self._thread: UserThread | None = None
        self._model: Any = None
        self._module = ""
        self._path = Path()

    @property
    def model(self) -> Any:
        """The instance of the model's class this version serves (None unless loaded)."""
        return self._model

    def _error(self, why: str) -> BackendError:
        return BackendError(f"model '{self.config.name}' version {self.version}: {why}")

    def load(self) -> None:
        path = self.config.model_file(self.version)
        assert path is not None
        resolved = path.resolve()
        if not resolved.is_file():
            raise self._error(f"missing {path}")
        if not is_inside(self.config.root.parent, resolved):
            raise self._error(f"{path} points outside the model repository (refused)")
        self._path = resolved
        self._module = re.sub(
            r"\W", "_", f"inferq_model_{self.config.name}_{self.version}_{next(_modules)}"
        )
        thread = UserThread(f"python-{self.config.name}-{self.version}")
        thread.start()
        try:
            model = self._call(thread, "model.py", self._instantiate, deadline=None)
            if hasattr(model, "load"):
                settings = ModelSettings(
                    name=self.config.name,
                    version=self.version,
                    folder=self.config.version_path(self.version),
                    inputs=self.config.inputs,
                    outputs=self.config.outputs,
                    max_batch=self.config.max_batch,
                    parameters=dict(self.config.python.parameters),
                )
                self._call(thread, "load", model.load, settings, self.device, deadline=None)
        except BaseException:
            thread.stop()
            sys.modules.pop(self._module, None)
            raise
        self._thread, self._model = thread, model

    def _instantiate(self) -> Any:
        """On the model's thread: import ``model.py`` and build its model class."""
        spec = importlib.util.spec_from_file_location(self._module, self._path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[self._module] = module  # dataclasses and typing look classes up here
        spec.loader.exec_module(module)
        cls = _model_class(module, self.config.python.class_name)
        if isinstance(cls, str):
            raise self._error(f"{self._path}: {cls}")
        return cls()

    def predict(self, inputs: Arrays, deadline: float | None = None) -> Arrays:
        thread, model = self._thread, self._model
        if thread is None:
            raise self._error("is not loaded")
        if deadline is None:  # warm-up: no caller, so the model's default timeout
            deadline = time.monotonic() + self.config.default_timeout_ms / 1000
        out = self._call(thread, "predict", model.predict, inputs, deadline=deadline)
        if not isinstance(out, Mapping):
            raise BadOutput(
                f"returned a {type(out).__name__} from predict, which must return a dict of "
                "output name -> numpy array"
            )
        return dict(out)

    def _call(
        self, thread: UserThread, what: str, fn: Any, *args: Any, deadline: float | None
    ) -> Any:
        """A call into the model's code on its thread; what it raises (but ``InvalidInput``
        and the backend's own errors) comes back as a BackendError naming the exception and
        the line of model.py it passed through last."""
        try:
            return thread.call(fn, *args, what=what, deadline=deadline)
        except BackendError:  # Overran, InvalidInput and our own errors, as they are
            raise
        except (Exception, SystemExit, asyncio.CancelledError) as e:
            # The model's code may raise anything: SystemExit from sys.exit() too, and
            # CancelledError from tasks of its own.
            raise BackendError(_describe(what, e, self._path)) from e

    def unload(self) -> None:
        thread, model = self._thread, self._model
        self._thread = self._model = None
        if thread is None:
            return
        try:
            if hasattr(model, "unload"):
                deadline = time.monotonic() + UNLOAD_TIMEOUT_S
                self._call(thread, "unload", model.unload, deadline=deadline)
        except BackendError as e:
            log.warning(
                "python model unload failed; its thread is abandoned",
                model=self.config.name,
                version=self.version,
                error=str(e),
            )
        finally:
            thread.stop()
            sys.modules.pop(self._module, None)


def _model_class(module: Any, name: str | None) -> type | str:
    """The class to serve, or why there is none."""
    if name is not None:
        cls = getattr(module, name, None)
        if not inspect.isclass(cls):
            return f"defines no class {name!r} ([python] class in config.toml)"
        return cls if callable(getattr(cls, "predict", None)) else f"{name} has no predict method"
    found = [
        c
        for c in vars(module).values()
        if inspect.isclass(c)
        and c.__module__ == module.__name__
        and callable(getattr(c, "predict", None))
    ]
    if len(found) != 1:
        names = ", ".join(c.__name__ for c in found) or "none"
        return (
            f"must define exactly one class with a predict method (found {names}); "
            "or name one with [python] class in config.toml"
        )
    return found[0]


def _describe(what: str, error: BaseException, path: Path) -> str:
    """``predict raised ValueError: bad row (model.py line 12)``: the innermost line of the
    model's own file the exception passed through."""
    lines = [f.lineno for f in traceback.extract_tb(error.__traceback__) if f.filename == str(path)]
    where = f" ({path.name} line {lines[-1]})" if lines else ""
    return f"{what} raised {type(error).__name__}: {error}{where}"
