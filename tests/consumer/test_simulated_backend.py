"""The simulated backend answers each row's sum and, when asked, records every row it ran."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from consumer.backends.simulated import SimulatedBackend
from consumer.repository import load_config
from tests.support import write_simulated_model


def test_each_call_appends_the_rows_it_ran_to_its_process_record(tmp_path: Path):
    runs = tmp_path / "runs"
    write_simulated_model(
        tmp_path / "repo", "sim", base_ms=0, per_row_ms=0, max_batch=8, executions_dir=runs
    )
    backend = SimulatedBackend(load_config(tmp_path / "repo", "sim"), "1")
    backend.load()
    x = np.array([[3, 3, 3, 3], [5, 5, 5, 5]], dtype=np.float32)
    out = backend.predict({"x": x})
    backend.predict({"x": x[:1]})
    assert out["sum"].ravel().tolist() == [12.0, 20.0]
    assert (runs / f"{os.getpid()}.rows").read_text().split() == ["3.0", "5.0", "3.0"]


def test_nothing_is_recorded_unless_asked(tmp_path: Path):
    write_simulated_model(tmp_path, "sim", base_ms=0, per_row_ms=0, max_batch=8)
    config = load_config(tmp_path, "sim")
    SimulatedBackend(config, "1").predict({"x": np.ones((1, 4), np.float32)})
    assert config.simulated.executions_dir is None
