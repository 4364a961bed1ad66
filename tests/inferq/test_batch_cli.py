"""``inferq batch``: ``run`` writes every answer once with a progress bar, and interrupted
(SIGINT) then run again it follows the same batch, so no line runs twice; submit, status, wait,
download and cancel."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from inferq.batch_cli import _answered, _append
from tests.support import sim_body, wait_until

pytestmark = pytest.mark.integration

LINES = 24


def batch_cli(url: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "inferq", "batch", "--url", url, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def write_input(path: Path, n: int, model: str = "slow") -> None:
    path.write_text(
        "".join(
            json.dumps(
                {
                    "custom_id": f"r{i}",
                    "url": f"/v2/models/{model}/infer",
                    "body": sim_body(float(i)),
                }
            )
            + "\n"
            for i in range(n)
        )
    )


def lines_of(path: Path) -> list[dict]:
    """The whole lines of a file the CLI may be writing (a line not yet ended is not counted)."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(x) for x in text[: text.rfind("\n") + 1].splitlines()]


def test_a_last_line_cut_short_by_a_crash_is_cut_off_and_its_answer_written_again(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"custom_id":"r0","line":1}\n{"custom_id":"r1","li')
    assert _answered(out) == {"r0"}
    assert out.read_text() == '{"custom_id":"r0","line":1}\n'
    with out.open("a") as f:
        _append([{"custom_id": "r0"}, {"custom_id": "r1", "line": 2}], f, {"r0"})
    assert [d["custom_id"] for d in lines_of(out)] == ["r0", "r1"]


def test_run_interrupted_and_run_again_resumes_without_rerunning_a_line(stack, tmp_path):
    """The worker is frozen before the interrupt, so the run cannot end first however late the
    test's thread gets to send it (one CI run's did: 400 lines of `slow` ended in 2.5 s)."""
    s = stack(models=("serial",))  # a line at a time, 200 ms each
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(source, LINES, model="serial")
    first = batch_cli(s.url, "run", str(source), "-o", str(out), "--poll-s", "0.1")
    try:
        wait_until(lambda: len(lines_of(out)) >= 2, timeout_s=60, what="some lines written")
        with s.workers[0].paused():
            first.send_signal(signal.SIGINT)
            _, err = first.communicate(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    assert first.returncode == 130, err
    assert "run the same command again" in err
    written = len(lines_of(out))
    assert 0 < written < LINES
    again = batch_cli(s.url, "run", str(source), "-o", str(out), "--poll-s", "0.1")
    _, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    assert "resumed" in err and f"{LINES} completed, 0 failed" in err
    ids = [doc["custom_id"] for doc in lines_of(out)]
    assert sorted(ids) == sorted(f"r{i}" for i in range(LINES)) and len(ids) == LINES
    assert not (tmp_path / "out.jsonl.batch").exists()
    with s.client() as c:
        assert len(c.get("/v2/batches").json()["data"]) == 1, "the rerun made a second batch"
    assert s.workers[0].stats.requests == LINES, "a line ran twice"


def test_submit_status_wait_download_and_cancel(stack, tmp_path):
    s = stack(models=("sim",))
    source = tmp_path / "in.jsonl"
    write_input(source, 30, model="sim")
    proc = batch_cli(s.url, "submit", str(source))
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    batch_id = json.loads(out)["id"]
    proc = batch_cli(s.url, "wait", batch_id)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and json.loads(out)["status"] == "completed", err
    proc = batch_cli(s.url, "status", batch_id)
    assert json.loads(proc.communicate(timeout=30)[0])["request_counts"]["completed"] == 30
    target, errors = tmp_path / "o.jsonl", tmp_path / "e.jsonl"
    proc = batch_cli(s.url, "download", batch_id, "-o", str(target), "--errors", str(errors))
    proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert len(lines_of(target)) == 30 and lines_of(errors) == []
    proc = batch_cli(s.url, "cancel", batch_id)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "409" in err  # it has ended already
    proc = batch_cli(s.url, "status", "batch_nope")
    proc.communicate(timeout=30)
    assert proc.returncode == 1
