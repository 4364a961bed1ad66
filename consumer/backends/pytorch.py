"""PyTorch backend: a ``torch.export`` archive (``model.pt2``) or TorchScript (``model.ts``).

Inputs are passed positionally, in the order the config declares them (or, behind a
pre-processing stage, the order of the stage's outputs); the module may return one tensor (for a
model with one output), a tuple or list in the order of the declared outputs, or a dict keyed by
output name. Calls run under ``torch.inference_mode()``.

No Python pickle runs on the load path. ``torch.export.load`` unpickles some payloads (tensor
subclasses, opaque objects, legacy layouts, sample inputs that ``weights_only`` loading refuses)
and loads AOTInductor shared objects, so an archive is admitted only when every entry is on an
allow-list of plain tensors and JSON, and its sample inputs load with ``weights_only=True``.
TorchScript archives are read by TorchScript's own C++ unpickler, which builds only TorchScript
values and tensors.
"""

from __future__ import annotations

import io
import json
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from consumer.backends.base import Arrays, BackendError
from consumer.repository import ModelConfig

_PT2_ENTRIES = re.compile(
    r"(archive_format|archive_version|byteorder|\.data/version|\.data/serialization_id"
    r"|models/[^/]+\.json|data/weights/weight_\d+|data/weights/[^/]+_config\.json"
    r"|data/constants/tensor_\d+|data/constants/[^/]+_config\.json"
    r"|data/sample_inputs/[^/]+\.pt|extra/[^/]+)"
)
"""Entries of a ``torch.export`` archive that hold plain tensors, JSON or text."""


class TorchBackend:
    may_run_inline = True

    def __init__(self, config: ModelConfig, version: str, *, device: str = "cpu") -> None:
        self.config = config
        self.version = version
        self.device = device
        self._module: Any = None
        self._input_names = [s.name for s in config.backend_inputs()]
        self._output_names = [o.name for o in config.outputs]

    def _error(self, why: str) -> BackendError:
        return BackendError(f"model '{self.config.name}' version {self.version}: {why}")

    def load(self) -> None:
        try:
            import torch
        except ImportError as e:
            raise self._error("the pytorch backend needs torch: pip install 'inferq[torch]'") from e
        if self.device == "cuda" and not torch.cuda.is_available():
            raise self._error(
                "--device cuda asked for, but torch sees no CUDA device "
                f"(torch {torch.__version__}, built for CUDA {torch.version.cuda or 'none'})"
            )
        path = self.config.model_file(self.version)
        assert path is not None
        if not path.is_file():
            raise self._error(f"missing {path}")
        # Process-wide in torch: the last model loaded sets it for all.
        torch.set_num_threads(self.config.intra_op_threads)
        try:
            if path.suffix == ".pt2":
                _check_pt2(path)
                module = torch.export.load(path).module()
            else:
                with warnings.catch_warnings():
                    # TorchScript is deprecated in favour of torch.export; archives that exist
                    # still load, and the warning on every load says nothing new.
                    warnings.simplefilter("ignore", DeprecationWarning)
                    module = torch.jit.load(str(path), map_location="cpu")  # type: ignore[no-untyped-call]
                module.eval()
            module = module.to(self.device)
        except BackendError as e:
            raise self._error(str(e)) from e
        except Exception as e:  # torch raises many kinds for a bad file
            raise self._error(f"cannot load {path}: {e}") from e
        self._module = module

    def predict(self, inputs: Arrays, deadline: float | None = None) -> Arrays:
        import torch

        if self._module is None:
            raise self._error("is not loaded")
        args = []
        for name in self._input_names:
            array = inputs[name]
            if array.dtype == object:
                raise self._error(f"input '{name}' is BYTES, which a torch module cannot take")
            # torch.from_numpy shares memory and warns on read-only arrays (request tensors are
            # views of the message): copy only those.
            tensor = torch.from_numpy(np.require(array, requirements=["C", "W"]))
            args.append(tensor.to(self.device))
        with torch.inference_mode():
            result = self._module(*args)
        return self._outputs(result)

    def _outputs(self, result: Any) -> Arrays:
        import torch

        names = self._output_names
        if isinstance(result, torch.Tensor):
            values = {names[0]: result} if len(names) == 1 else None
        elif isinstance(result, tuple | list) and len(result) == len(names):
            values = dict(zip(names, result, strict=True))
        elif isinstance(result, dict) and all(n in result for n in names):
            values = {n: result[n] for n in names}
        else:
            values = None
        if values is None or not all(isinstance(v, torch.Tensor) for v in values.values()):
            got = type(result).__name__
            if isinstance(result, tuple | list):
                got += f" of {len(result)}"
            raise self._error(
                f"the module returned {got}; the config declares outputs {', '.join(names)}"
            )
        return {n: v.detach().cpu().numpy() for n, v in values.items()}

    def unload(self) -> None:
        self._module = None
        if self.device == "cuda":
            import torch

            torch.cuda.empty_cache()


def _check_pt2(path: Path) -> None:
    """Refuse a ``torch.export`` archive whose loading would unpickle or run native code."""
    import torch

    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        root = names[0].split("/", 1)[0] + "/" if names else ""
        entries = {n.removeprefix(root): n for n in names if not n.endswith("/")}
        if "archive_format" not in entries or archive.read(entries["archive_format"]) != b"pt2":
            raise BackendError(f"{path}: not a torch.export (PT2) archive")
        for entry, name in entries.items():
            if not name.startswith(root) or not _PT2_ENTRIES.fullmatch(entry):
                raise BackendError(f"{path}: unexpected archive entry {name!r} (refused)")
            if entry.endswith("_config.json"):
                payloads = json.loads(archive.read(name)).get("config", {})
                for fqn, meta in payloads.items():
                    if meta.get("use_pickle") or not str(meta.get("path_name", "")).startswith(
                        ("weight_", "tensor_")
                    ):
                        raise BackendError(f"{path}: '{fqn}' is stored pickled (refused)")
            elif entry.startswith("data/sample_inputs/"):
                try:
                    torch.load(io.BytesIO(archive.read(name)), weights_only=True)
                except Exception as e:
                    raise BackendError(
                        f"{path}: sample inputs {name!r} are not plain tensors (refused): {e}"
                    ) from e
