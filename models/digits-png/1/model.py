"""digits-png: a handwritten digit from a PNG image, through the digits network.

Each row of ``image`` is one PNG: its bytes, or the same in base64 (JSON can only carry text).
The image is flattened onto white (transparency), made grey, padded to a square with white,
averaged down to 8x8 and inverted, so dark ink on a light background becomes the digits data's
0..16 ink values; then one ONNX Runtime call runs the whole batch. A row that is not a PNG, or
a PNG too large, is refused as that request's own bad input (HTTP 400), never the batch's.
"""

from __future__ import annotations

import base64
import binascii
import io

import numpy as np
import onnxruntime as ort
from PIL import Image

from consumer.backends import InvalidInput

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SIDE = 8  # the digits data: 8x8 pixels of 0..16 ink


def to_pixels(image: Image.Image) -> np.ndarray:
    """64 ink values, 0..16, from an image of any size and mode."""
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, "white"), rgba)
    grey = image.convert("L")
    side = max(grey.size)
    square = Image.new("L", (side, side), 255)
    square.paste(grey, ((side - grey.width) // 2, (side - grey.height) // 2))
    small = np.asarray(square.resize((SIDE, SIDE), Image.Resampling.BOX), dtype=np.float32)
    return ((255.0 - small) * (16.0 / 255.0)).reshape(SIDE * SIDE)


def decode(value: bytes, row: int, max_pixels: int) -> Image.Image:
    """The PNG in ``value`` (raw, or base64), or ``InvalidInput`` for that row."""
    data = value if value.startswith(PNG_SIGNATURE) else _unbase64(value)
    if not data.startswith(PNG_SIGNATURE):
        raise InvalidInput("input 'image' is not a PNG image (nor one in base64)", row)
    try:
        image = Image.open(io.BytesIO(data), formats=["PNG"])  # reads the header only
        if image.width * image.height > max_pixels:
            raise InvalidInput(
                f"input 'image' is {image.width}x{image.height} pixels, more than the "
                f"{max_pixels} this model takes",
                row,
            )
        image.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise InvalidInput(f"input 'image' is not a readable PNG: {e}", row) from None
    return image


def _unbase64(value: bytes) -> bytes:
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return b""


class DigitsFromPng:
    def load(self, config, device):
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers = ["CUDAExecutionProvider"] if device == "cuda" else []
        self.session = ort.InferenceSession(
            str(config.folder / "model.onnx"),
            sess_options=options,
            providers=[*providers, "CPUExecutionProvider"],
        )
        self.max_pixels = int(config.parameters.get("max_pixels", 4_194_304))
        self.session.run(None, {"input": np.zeros((1, SIDE * SIDE), np.float32)})  # warm-up

    def predict(self, inputs):
        images = inputs["image"]
        pixels = np.stack(
            [to_pixels(decode(v, row, self.max_pixels)) for row, v in enumerate(images)]
        )
        logits, label = self.session.run(["logits", "label"], {"input": pixels})
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        return {"label": label, "probabilities": shifted / shifted.sum(axis=1, keepdims=True)}

    def unload(self):
        self.session = None
