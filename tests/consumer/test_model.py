"""One model call per batch, split back per request; a poison input fails alone (bisection)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from consumer.model import ServedModel
from consumer.repository import load_config
from protocol.messages import InferRequest, Status, Timings
from protocol.tensor import Tensor
from tests.support import write_simulated_model


def request(i: int, value: float) -> InferRequest:
    x = Tensor.from_numpy("x", np.full((1, 4), value, dtype=np.float32))
    return InferRequest(
        id=f"r{i}",
        model="sim",
        version="1",
        inputs=[x],
        outputs=None,
        deadline_ms=10**15,
        enqueued_ms=0,
        result_key="",
        result_ttl_ms=1,
    )


class PoisonOnNegative:
    """Raises for any batch holding a negative input, like a model crashing on bad data."""

    def __init__(self) -> None:
        self.calls = 0

    def load(self) -> None: ...

    def unload(self) -> None: ...

    def predict(self, inputs, deadline=None):
        self.calls += 1
        x = inputs["x"]
        if (x < 0).any():
            raise ValueError("negative input")
        return {"sum": x.sum(axis=1, keepdims=True)}


def served(tmp_path: Path) -> tuple[ServedModel, PoisonOnNegative]:
    write_simulated_model(tmp_path, "sim", base_ms=0, per_row_ms=0, max_batch=8)
    model = ServedModel(load_config(tmp_path, "sim"))
    backend = PoisonOnNegative()
    model.backends["1"] = backend
    return model, backend


def test_a_batch_runs_as_one_call_and_each_request_gets_its_own_rows(tmp_path):
    model, backend = served(tmp_path)
    outcome = model.run([request(i, float(i)) for i in range(5)], "w")
    assert backend.calls == 1
    assert [r.outputs[0].to_numpy().tolist() for r in outcome.results] == [
        [[4.0 * i]] for i in range(5)
    ]


def test_each_result_carries_its_waits_the_call_and_the_batch_size_even_after_bisection(tmp_path):
    model, _ = served(tmp_path)
    batch = [request(i, -1.0 if i == 2 else float(i)) for i in range(4)]
    waited = [(float(i), 10.0 + i) for i in range(4)]
    outcome = model.run(batch, "w", waited)
    for i, result in enumerate(outcome.results):
        t = result.timings
        assert (t.queued_ms, t.batch_wait_ms, t.batch_size) == (float(i), 10.0 + i, 4)
        assert t.infer_ms >= 0.0 and result.worker == "w" and result.model == "sim"
    assert [r.status for r in outcome.results] == [Status.OK] * 2 + [Status.FAILED, Status.OK]


def test_without_waits_a_result_waited_for_nothing(tmp_path):
    model, _ = served(tmp_path)
    (result,) = model.run([request(0, 1.0)], "w").results
    assert result.timings == Timings(0.0, 0.0, result.timings.infer_ms, 1)


def test_one_poison_input_fails_alone_and_the_rest_of_its_batch_succeeds(tmp_path):
    model, backend = served(tmp_path)
    batch = [request(i, -1.0 if i == 5 else float(i)) for i in range(8)]
    outcome = model.run(batch, "w")
    statuses = [r.status for r in outcome.results]
    assert statuses == [Status.OK] * 5 + [Status.FAILED] + [Status.OK] * 2
    assert "negative input" in outcome.results[5].error
    assert [r.id for r in outcome.results] == [r.id for r in batch]
    assert backend.calls <= 1 + 2 * 3  # the batch, then at most two halves per level


class RowCounter:
    """Sums each row; records the rows of every call."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def load(self) -> None: ...

    def unload(self) -> None: ...

    def predict(self, inputs, deadline=None):
        x = inputs["x"]
        self.calls.append(x.shape[0])
        return {"sum": x.sum(axis=1, keepdims=True)}


def test_a_request_with_more_rows_than_max_batch_runs_as_several_calls(tmp_path):
    write_simulated_model(tmp_path, "sim", base_ms=0, per_row_ms=0, max_batch=1024)
    model = ServedModel(load_config(tmp_path, "sim"))
    backend = RowCounter()
    model.backends["1"] = backend
    rows = 250_000
    x = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) % 7
    big = InferRequest(
        id="big",
        model="sim",
        version="1",
        inputs=[Tensor.from_numpy("x", x)],
        outputs=None,
        deadline_ms=10**15,
        enqueued_ms=0,
        result_key="",
        result_ttl_ms=1,
    )
    outcome = model.run([request(0, 1.0), big, request(2, 2.0)], "w")
    assert len(backend.calls) == -(-(rows + 2) // 1024)  # ceil: 245 calls
    assert max(backend.calls) == 1024 and sum(backend.calls) == rows + 2
    small, large, last = outcome.results
    assert [r.status for r in outcome.results] == [Status.OK] * 3
    assert small.outputs[0].to_numpy().tolist() == [[4.0]]
    assert last.outputs[0].to_numpy().tolist() == [[8.0]]
    np.testing.assert_array_equal(large.outputs[0].to_numpy(), x.sum(axis=1, keepdims=True))
