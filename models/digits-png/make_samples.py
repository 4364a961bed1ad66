"""Write ``1/samples/{digit}.png``: the ten held-out digits of ``models/digits/samples.json`` as
32x32 greyscale PNGs, dark ink on white, each of the 8x8 pixels a 4x4 block (so 1/model.py's
averaging gives the sample's pixels back, to 1/255 of the 0..16 scale).

    python models/digits-png/make_samples.py

The PNGs are committed: the README's curl line and tritonclient snippet send them, and the tests
check that this script still draws the same pixels.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent
SAMPLES = HERE.parent / "digits" / "samples.json"
SCALE = 4  # 8x8 -> 32x32, the size the digits data was drawn at


def draw(pixels: list[float]) -> Image.Image:
    """One digit (64 ink values, 0..16) as a 32x32 greyscale image, dark on white."""
    ink = np.asarray(pixels, dtype=np.float64).reshape(8, 8)
    grey = np.round(255.0 - ink * 255.0 / 16.0).astype(np.uint8)
    return Image.fromarray(np.kron(grey, np.ones((SCALE, SCALE), dtype=np.uint8)))


def main() -> None:
    samples = json.loads(SAMPLES.read_text())
    folder = HERE / "1" / "samples"
    folder.mkdir(exist_ok=True)
    for pixels, label in zip(samples["inputs"], samples["labels"], strict=True):
        draw(pixels).save(folder / f"{label}.png", optimize=True)


if __name__ == "__main__":
    main()
