"""The benchmark harness (bench/common.py) and the scripts' pure pieces: tables, ceilings,
per-level rows, repositories, meters, waits and saved results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from bench import batching, common, latency_vs_load, scaleout
from bench.common import (
    CpuMeter,
    call_latencies,
    cpu_idle_share,
    cpu_seconds,
    fmt,
    git_revision,
    infer_request,
    markdown_table,
    model_repository,
    rows_per_s,
    wait_until,
)
from loadgen.recorder import Recorder
from loadgen.result import LoadResult


def test_markdown_table_and_cells() -> None:
    table = markdown_table(["a", "b", "c"], [[1, 2.5, None], ["x", 12345.6, "-"]])
    assert table.splitlines() == [
        "| a | b | c |",
        "|---|---|---|",
        "| 1 | 2.50 | - |",
        "| x | 12,346 | - |",
    ]
    assert fmt(None) == "-" and fmt(3.14159, 1) == "3.1" and fmt(4125.0) == "4,125"


def test_model_ceilings_follow_the_simulated_cost() -> None:
    # 5 ms + 0.05 ms/row: one row per call gives 198/s, 32 rows per call 4,848/s
    assert batching.model_ceiling(1) == pytest.approx(1000 / 5.05)
    assert batching.model_ceiling(32) == pytest.approx(32 / 6.6 * 1000)
    # 50 ms + 1.25 ms/row with max_batch 8: 133 per worker, well under the gateway's ~3,500/s
    assert scaleout.per_worker_ceiling() == pytest.approx(8 / 60 * 1000)
    assert 8 * scaleout.per_worker_ceiling() < 3500 / 3


def test_latency_vs_load_rows_split_accepted_rejected_and_timed_out() -> None:
    rec = Recorder()
    rec.begin(0.0, 0.0, 1.0)
    for i in range(90):
        rec.record(200, 0.010 + i / 10_000, 0.5)
    for status in (429,) * 5 + (503,) * 2 + (504,) * 2:
        rec.record(status, 0.001, 0.5)
    rec.record_error("RequestTimeout", 0.9)
    res = LoadResult.from_recorder(
        rec, mode="open", url="http://127.0.0.1:1/", concurrency=3, duration_s=1.0
    )
    row = latency_vs_load.level_row(90, 450.0, res, 1000)
    assert (row["accepted"], row["rejected"], row["timed_out"], row["other_errors"]) == (
        90,
        7,
        2,
        1,
    )
    assert row["deadline_ms"] == 1000 and row["percent"] == 90
    assert row["p99_over_p50"] == pytest.approx(row["p99_ms"] / row["p50_ms"])
    body = latency_vs_load.body_for("accel", 250)
    assert body["parameters"] == {"timeout": 250_000}


def test_model_repository_is_temporary(tmp_path) -> None:
    with model_repository(
        digits=True, fast={"base_ms": 1.0, "per_row_ms": 0.0, "max_batch": 4}
    ) as repo:
        assert (repo / "fast" / "config.toml").read_text().count('backend = "simulated"') == 1
        assert (repo / "digits" / "config.toml").is_file()
        assert not (repo / "digits" / "train.py").exists()
    assert not repo.exists()


def test_requests_bypass_the_cache() -> None:
    req = infer_request("m", {"inputs": []})
    assert req.path == "/v2/models/m/infer" and req.headers["cache-control"] == "no-cache"


def test_cpu_meter_counts_this_process() -> None:
    meter = CpuMeter({os.getpid(): "gateway"})
    meter.start()
    end = time.process_time() + 0.05
    while time.process_time() < end:  # burn a little CPU to be measured
        pass
    used = meter.stop()
    assert 0 < used["gateway"] <= 1.5
    assert cpu_seconds(os.getpid()) > 0 and cpu_seconds(2**22 + 12345) == 0.0
    assert 0.0 <= cpu_idle_share(0.01) <= 1.0
    assert git_revision()


def test_save_stamps_revision_command_and_machine_into_results_and_a_committed_summary(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(common, "SUMMARIES", tmp_path / "summaries")
    path = common.save("demo", {"rows": [1, 2], "revision": "abc1234 (a baseline)"})
    raw = json.loads(path.read_text())
    assert raw == json.loads((tmp_path / "summaries" / "demo.json").read_text())
    assert raw["rows"] == [1, 2]
    assert raw["revision"] == "abc1234 (a baseline)"  # what the caller says wins
    assert raw["command"].startswith("python ") and raw["machine"]["cpus"] == os.cpu_count()
    common.save("plain", {})
    assert json.loads((tmp_path / "summaries" / "plain.json").read_text())["revision"]


def test_a_summary_leaves_out_what_it_is_told_to_and_raw_saves_commit_nothing(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(common, "SUMMARIES", tmp_path / "summaries")
    common.save("partial", {"runs": [1, 2, 3]}, commit=False)
    assert not (tmp_path / "summaries" / "partial.json").exists()
    common.save("partial", {"runs": [1, 2, 3], "rows": [2]}, omit=("runs",))
    summary = json.loads((tmp_path / "summaries" / "partial.json").read_text())
    assert summary["rows"] == [2] and "runs" not in summary
    assert json.loads((tmp_path / "results" / "partial.json").read_text())["runs"] == [1, 2, 3]


def test_in_process_rates_count_rows_and_time_each_call() -> None:
    seen: list[int] = []
    rate = rows_per_s(seen.append, 32, 0.02)
    assert rate > 0 and seen[0] == 0 and seen[1:3] == [0, 32]  # one untimed call first
    latencies = call_latencies(lambda: None, 0.01)
    assert latencies and all(t >= 0 for t in latencies)


def test_waits_end_when_the_condition_holds_and_fail_when_the_process_dies() -> None:
    calls = iter([False, OSError("not yet"), True])

    def check() -> bool:
        got = next(calls)
        if isinstance(got, Exception):
            raise got
        return got

    wait_until(check, "the thing", timeout_s=5)
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    dead.wait()
    with pytest.raises(RuntimeError, match="exited with 3"):
        wait_until(lambda: False, "a server", timeout_s=5, proc=dead)
    with pytest.raises(RuntimeError, match="never: not after 0 s"):
        wait_until(lambda: False, "never", timeout_s=0.01)


def test_the_redis_faults_result_names_the_checkout_as_every_bench_does() -> None:
    from bench import redis_faults
    from bench.common import ROOT, git_revision

    stamp = redis_faults.stamped([{"fault": "stall"}])
    assert stamp["revision"] == f"{git_revision()} ({ROOT})"
    assert stamp["results"] == [{"fault": "stall"}] and stamp["simulated_model"] is True
    assert not hasattr(redis_faults, "revision")  # one way: bench.common's
