"""``topics``: text in, its closest topic labels out (the Python backend's post-processing
example). The version folder holds the code and the labels (``1/model.py``, ``1/labels.json``,
in git); building writes the minilm graph and tokenizer next to them (``minilm.write``), since
the model embeds both the requests and, once at load, its labels' descriptions with them."""

from __future__ import annotations

from pathlib import Path

from inferq.examples import minilm

MODEL = "topics"


def build(repo: Path) -> list[Path]:
    """Write ``{repo}/topics/1/model.onnx`` and ``tokenizer.json``."""
    return minilm.write(repo / MODEL / "1")
