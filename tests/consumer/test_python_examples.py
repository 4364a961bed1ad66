"""The Python backend's examples in-process: digits-png gives the digits network's answer for
the image of a digit, and topics ranks the labels a text is about first."""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from consumer.backends import Backend, InvalidInput, create_backend
from consumer.model import ServedModel
from consumer.repository import load_config
from protocol.messages import Status
from tests.consumer.test_python_backend import text_request

MODELS = Path(__file__).resolve().parents[2] / "models"
SAMPLES = json.loads((MODELS / "digits" / "samples.json").read_text())
PNGS = MODELS / "digits-png" / "1" / "samples"
TOPICS = {
    "The striker scored twice in the cup final.": "sport",
    "The central bank raised interest rates again.": "economy",
    "Heavy snow and strong winds are expected tomorrow.": "weather",
    "Parliament voted on the new law after the election.": "politics",
    "Add the flour and bake for twenty minutes.": "food",
    "We booked a flight and a hotel for our holiday.": "travel",
}


def objects(values: list[bytes]) -> np.ndarray:
    column = np.empty(len(values), dtype=object)
    column[:] = values
    return column


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def loaded(model: str) -> Iterator[Backend]:
    backend = create_backend(load_config(MODELS, model), "1")
    backend.load()
    yield backend
    backend.unload()


@pytest.fixture(scope="module")
def digits_png() -> Iterator[Backend]:
    yield from loaded("digits-png")


@pytest.fixture(scope="module")
def digits() -> Iterator[Backend]:
    yield from loaded("digits")


def test_digits_png_runs_the_digits_graph_itself():
    ours = (MODELS / "digits-png" / "1" / "model.onnx").read_bytes()
    assert ours == (MODELS / "digits" / "1" / "model.onnx").read_bytes()


def test_the_sample_images_are_the_digits_samples_drawn_by_make_samples():
    spec = importlib.util.spec_from_file_location(
        "make_samples", MODELS / "digits-png" / "make_samples.py"
    )
    assert spec is not None and spec.loader is not None
    make_samples = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_samples)
    for pixels, label in zip(SAMPLES["inputs"], SAMPLES["labels"], strict=True):
        committed = np.asarray(Image.open(PNGS / f"{label}.png"))
        assert committed.shape == (32, 32)
        assert np.array_equal(committed, np.asarray(make_samples.draw(pixels)))


def test_an_image_of_a_digit_gets_the_digits_models_answer_for_its_pixels(digits_png, digits):
    images = [(PNGS / f"{label}.png").read_bytes() for label in SAMPLES["labels"]]
    got = digits_png.predict({"image": objects(images)})
    expected = digits.predict({"input": np.array(SAMPLES["inputs"], dtype=np.float32)})
    assert got["label"].tolist() == SAMPLES["labels"] == expected["label"].tolist()
    logits = expected["logits"]
    softmax = np.exp(logits - logits.max(axis=1, keepdims=True))
    softmax /= softmax.sum(axis=1, keepdims=True)
    # The pixels come back to within 1/255 of the 0..16 scale: the probabilities nearly equal.
    assert np.abs(got["probabilities"] - softmax).max() < 0.02
    assert got["probabilities"].dtype == np.float32


def test_base64_colour_transparent_and_larger_images_read_the_same(digits_png):
    three = Image.open(PNGS / "3.png")
    rgba = three.convert("RGBA")
    rgba.putalpha(Image.eval(three, lambda v: 255 - v))  # ink opaque, paper transparent
    rows = [
        png(three),
        base64.b64encode(png(three)),
        png(three.convert("RGB")),
        png(rgba),
        png(three.resize((96, 96), Image.Resampling.NEAREST)),
    ]
    got = digits_png.predict({"image": objects(rows)})
    assert got["label"].tolist() == [3] * len(rows)
    assert np.abs(got["probabilities"] - got["probabilities"][0]).max() < 0.02


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (b"GIF89a not a png", "input 'image' is not a PNG image (nor one in base64)"),
        (b"\x89PNG\r\n\x1a\n" + b"\0" * 20, "input 'image' is not a readable PNG"),
    ],
)
def test_a_row_that_is_not_a_png_is_that_requests_own_bad_input(digits_png, row, message):
    good = (PNGS / "1.png").read_bytes()
    with pytest.raises(InvalidInput, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        digits_png.predict({"image": objects([good, row])})
    assert e.value.row == 1


def test_an_image_larger_than_the_config_allows_is_refused_before_decoding(digits_png):
    huge = png(Image.new("L", (4096, 1025), 255))
    with pytest.raises(InvalidInput, match="is 4096x1025 pixels, more than the 4194304"):
        digits_png.predict({"image": objects([huge])})


@pytest.fixture(scope="module")
def topics_repo(minilm_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The committed topics model with the minilm files next to it, as build-examples leaves
    it (copied from the session's minilm build rather than written again)."""
    repo = tmp_path_factory.mktemp("topics-repo")
    ignore = shutil.ignore_patterns("*.onnx", "__pycache__")  # another test may be writing there
    shutil.copytree(MODELS / "topics", repo / "topics", ignore=ignore)
    for name in ("model.onnx", "tokenizer.json"):
        shutil.copy(minilm_repo / "minilm" / "1" / name, repo / "topics" / "1" / name)
    return repo


def test_topics_ranks_what_a_text_is_about_first_in_one_call(topics_repo):
    model = ServedModel(load_config(topics_repo, "topics"))
    model.load()  # with its warm-up calls, whose outputs are checked too
    texts = list(TOPICS)
    outcome = model.run(
        [text_request(i, t.encode(), model="topics") for i, t in enumerate(texts)], "w"
    )
    model.unload()
    assert [r.status for r in outcome.results] == [Status.OK] * len(texts)
    for result, expected in zip(outcome.results, TOPICS.values(), strict=True):
        labels, scores = (t.to_numpy() for t in result.outputs)
        assert labels.shape == scores.shape == (1, 3)
        assert labels[0, 0] == expected.encode()
        assert scores[0].tolist() == sorted(scores[0].tolist(), reverse=True)


def test_topics_refuses_text_that_is_not_utf8_for_that_row_only(topics_repo):
    model = ServedModel(load_config(topics_repo, "topics"))
    model.load()
    outcome = model.run(
        [
            text_request(0, b"Snow tomorrow.", model="topics"),
            text_request(1, b"caf\xe9", model="topics"),
        ],
        "w",
    )
    model.unload()
    assert [r.status for r in outcome.results] == [Status.OK, Status.INVALID]
    assert outcome.results[1].error.startswith("input 'text' is not UTF-8")


def test_topics_without_its_built_files_says_how_to_build_them(tmp_path):
    shutil.copytree(
        MODELS / "topics",
        tmp_path / "topics",
        ignore=shutil.ignore_patterns("*.onnx", "tokenizer.json", "__pycache__"),
    )
    with pytest.raises(Exception, match="run `inferq models build-examples`"):
        ServedModel(load_config(tmp_path, "topics")).load()
