"""bench/pyspy_breakdown.py --by-stage: each py-spy sample is charged to one request stage."""

from __future__ import annotations

from pathlib import Path

from bench.pyspy_breakdown import EVENT_LOOP, breakdown, frames, stage_of

_LOOP = "Runner.run (asyncio/runners.py:118)"
_PARSE = "parse_infer_request (producer/v2_request.py:241)"


def _stage(*stack: str) -> str:
    return stage_of(frames(";".join(stack)))


def test_a_library_without_a_stage_counts_for_its_caller() -> None:
    numpy = "_all (numpy/_core/_methods.py:70)"
    assert _stage(_LOOP, _PARSE, numpy) == "V2 validation and tensor build"


def test_the_innermost_frame_that_names_a_stage_wins() -> None:
    decode = "parse_json_object (producer/v2_request.py:121)"
    assert _stage(_LOOP, _PARSE, decode).startswith("JSON decode")
    writes = "StreamWriter.writelines (asyncio/streams.py:346)"
    send = "execute (redis/asyncio/client.py:10)"
    assert _stage(_LOOP, send, writes).startswith("Redis I/O")


def test_a_sample_in_the_event_loop_itself_is_its_c_code() -> None:
    assert _stage("main (inferq/cli.py:249)", _LOOP) == EVENT_LOOP


def test_by_stage_shares_add_up_to_one(tmp_path: Path) -> None:
    raw = tmp_path / "raw.txt"
    raw.write_text(f"{_LOOP};{_PARSE} 3\n{_LOOP} 1\n")
    groups = breakdown([raw], by_stage=True)["groups"]
    assert groups == {"V2 validation and tensor build": 0.75, EVENT_LOOP: 0.25}
