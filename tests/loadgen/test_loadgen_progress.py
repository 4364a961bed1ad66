"""The live progress line, the per-second timeline it reads, and the final summary."""

from __future__ import annotations

import asyncio
import io
import re

import pytest

from loadgen.progress import Progress, Snapshot, format_progress, take_snapshot
from loadgen.recorder import Recorder, Timeline
from loadgen.result import LoadResult


def test_timeline_keeps_p50_p99_and_errors_per_second() -> None:
    t = Timeline(start=100.0)
    for i in range(100):
        t.record(100.0 + i / 100, (i + 1) / 1000, ok=True)  # second 0: 1..100 ms
    t.record(101.5, 0.5, ok=True)
    t.record(101.6, 0.0, ok=False)
    rows = t.rows()
    assert len(rows) == 2
    assert rows[0].requests == rows[0].ok == 100 and rows[0].errors == 0
    assert rows[0].p50_ms == pytest.approx(50, rel=0.01)
    assert rows[0].p99_ms == pytest.approx(99, rel=0.01)
    assert rows[0].max_ms == pytest.approx(100)
    assert (rows[1].t, rows[1].ok, rows[1].errors, rows[1].p99_ms) == (1.0, 1, 1, 500.0)
    assert t.last_complete(100.5) is None
    assert t.last_complete(101.2) == rows[0]
    empty = t.last_complete(105.0)
    assert empty is not None and empty.requests == 0 and empty.p99_ms is None


def test_progress_line_formats() -> None:
    measuring = Snapshot(
        phase="measuring",
        elapsed_s=3.0,
        phase_s=10.0,
        rate_rps=1234.4,
        requests=3702,
        errors=2,
        p99_ms=12.34,
        in_flight=16,
        backlog=0,
        connections=16,
    )
    line = format_progress(measuring)
    assert line == (
        "measuring    3.0/10.0s  1,234 req/s  done 3,702  errors 2 (0.1%)  p99 12.3 ms  "
        "in-flight 16"
    )
    open_loop = Snapshot("draining", 0.4, None, 0.0, 10, 0, None, 3, 7, 20, target_rps=500.0)
    assert format_progress(open_loop) == (
        "draining     0.4s  0 req/s  (target 500)  done 10  errors 0  p99 -  in-flight 3  "
        "backlog 7  conns 20"
    )


def test_snapshot_follows_the_run_phases() -> None:
    rec = Recorder()
    assert take_snapshot(rec, 0.0, 0.0).phase == "connecting"
    rec.begin(10.0, warmup_s=1.0, duration_s=5.0)
    s = take_snapshot(rec, 10.5, 100.0)
    assert (s.phase, s.elapsed_s, s.phase_s, s.rate_rps) == ("warm-up", 0.5, 1.0, 100.0)
    for i in range(10):
        rec.record(200, 0.010, 11.0 + i / 20)
    rec.record(500, 0.001, 11.6)
    s = take_snapshot(rec, 12.2, 9.0)
    assert (s.phase, s.requests, s.errors) == ("measuring", 11, 1)
    assert s.p99_ms == pytest.approx(10, rel=0.01)
    assert take_snapshot(rec, 16.5, 0).phase == "draining"
    rec.finished = True
    assert take_snapshot(rec, 17.0, 0).phase == "done"


@pytest.mark.parametrize("tty", [True, False])
def test_progress_redraws_in_place_only_on_a_terminal(tty: bool) -> None:
    now = [0.0]
    rec = Recorder()
    stream = io.StringIO()

    async def main() -> None:
        async with Progress(rec, stream, tty=tty, interval_s=3600, clock=lambda: now[0]) as p:
            rec.begin(0.0, 0.0, 10.0)
            for i in range(50):
                rec.record(200, 0.004, i / 50)
            now[0] = 1.0
            p.draw()
            now[0] = 2.0
            p.draw()

    asyncio.run(main())
    out = stream.getvalue()
    if tty:
        assert out.count("\r") == 2 and out.count("\x1b[K") == 2 and out.endswith("\n")
        assert "\n" not in out[:-1]
    else:
        assert out.count("\n") == 2 and "\r" not in out
    first = out.strip("\r\n").replace("\r", "\n").splitlines()[0]
    assert "50 req/s" in first  # 50 completions in the first second
    assert "p99 4.0 ms" in first and "done 50" in first


def _result(mode: str) -> LoadResult:
    rec = Recorder()
    rec.begin(0.0, 0.0, 2.0)
    for i in range(100):
        rec.record(200, 0.001 * (i + 1), i / 50)
    rec.record(429, 0.0005, 1.0)
    rec.record_error("RequestTimeout", 1.5)
    rec.service.record(0.002)
    rec.send_lag.record(0.0001)
    return LoadResult.from_recorder(
        rec,
        mode=mode,
        url="http://127.0.0.1:1/v2/models/m/infer",
        concurrency=4,
        duration_s=2.0,
        warmup_requests=7,
        target_rps=51.0,
        offered_rps=51.0,
        schedule="51/s",
    )


def test_summary_shows_throughput_statuses_and_hdr_percentiles() -> None:
    text = _result("closed").summary()
    assert "closed loop  http://127.0.0.1:1/v2/models/m/infer  concurrency=4" in text
    assert "requests 102 (ok 100)" in text and "warm-up 7" in text
    assert "status   200 x100  429 x1  RequestTimeout x1" in text
    # 1..100 ms, one each: HDR percentiles are within 0.1 % of the sample of their rank
    shown = dict(re.findall(r"(p[\d.]+|max) ([\d.]+)", text.split("latency ms (2xx):")[1]))
    for key, want in {"p50": 50, "p90": 90, "p99": 99, "p99.9": 100}.items():
        assert abs(float(shown[key]) - want) <= want / 1000, (key, shown[key])
    assert shown["max"] == "100.000"
    assert "intended" not in text


def test_open_loop_summary_says_where_latency_is_measured_from() -> None:
    res = _result("open")
    res.extra["jobs"] = {
        "submitted": 3,
        "polls": 6,
        "polls_per_job": 2.0,
        "final_status": {"succeeded": 3},
    }
    text = res.summary()
    assert "open loop" in text and "target 51.0 req/s (51/s)" in text
    assert "[from intended send time]" in text and "[from actual send]" in text
    assert "send lag ms" in text
    assert "jobs: submitted 3, polls 6 (2.00/job), final: succeeded 3" in text
    d = res.to_dict()
    assert d["status_counts"] == {"200": 100, "429": 1}
    assert d["errors"] == {"429": 1, "RequestTimeout": 1}
    assert d["histogram"]["count"] == 100 and d["window_s"] == 2.0
