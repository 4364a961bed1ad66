"""topics: the closest topics of a text, by cosine similarity of minilm sentence embeddings.

At load, each topic's description (labels.json) is embedded once. Per batch: the texts are
tokenised (padded to the batch's longest), embedded in one ONNX Runtime call (the graph returns
unit-length embeddings, so a dot product is the cosine), compared with every topic, and the
``top_k`` best come back, best first: their names (BYTES) and their similarities (FP32). A row
that is not UTF-8 is refused as that request's own bad input (HTTP 400).
"""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from consumer.backends import InvalidInput


class Topics:
    def load(self, config, device):
        folder = config.folder
        missing = [n for n in ("model.onnx", "tokenizer.json") if not (folder / n).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{folder} has no {' or '.join(missing)}: run `inferq models build-examples`"
            )
        self.top_k = int(config.parameters.get("top_k", 3))
        declared = {o.name: o.shape[1] for o in config.outputs}
        if declared != {"labels": self.top_k, "scores": self.top_k}:
            raise ValueError(f"top_k = {self.top_k}, but the outputs declare {declared}")
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.enable_truncation(int(config.parameters.get("max_length", 256)))
        self.tokenizer.enable_padding()  # to the longest text of each call
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers = ["CUDAExecutionProvider"] if device == "cuda" else []
        self.session = ort.InferenceSession(
            str(folder / "model.onnx"),
            sess_options=options,
            providers=[*providers, "CPUExecutionProvider"],
        )
        topics = json.loads((folder / "labels.json").read_text())
        self.names = np.array([name.encode() for name in topics], dtype=object)
        self.topics = self.embed(list(topics.values()))  # [topics, 384], unit length

    def embed(self, texts):
        encodings = self.tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        (embedding,) = self.session.run(["embedding"], {"input_ids": ids, "attention_mask": mask})
        return embedding

    def predict(self, inputs):
        texts = []
        for row, value in enumerate(inputs["text"]):
            try:
                texts.append(value.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise InvalidInput(f"input 'text' is not UTF-8 ({e.reason})", row) from None
        similarity = self.embed(texts) @ self.topics.T  # cosines, [rows, topics]
        best = np.argsort(-similarity, axis=1, kind="stable")[:, : self.top_k]
        return {
            "labels": self.names[best],
            "scores": np.take_along_axis(similarity, best, axis=1),
        }
