"""The chaos tally counts what matters: a 200 is correct only with the request's own answer,
refusals are counted by kind, and a request without an answer is lost."""

from __future__ import annotations

from pathlib import Path

from tests.chaos.accounting import Tally, read_executions, request_id


def _ok(i: int) -> dict[str, object]:
    return {"id": request_id(i), "outputs": [{"name": "sum", "data": [4.0 * i]}]}


def test_only_a_200_with_the_requests_own_answer_is_correct():
    t = Tally()
    t.answer(0, 200, _ok(0))
    t.answer(1, 200, _ok(2))  # somebody else's answer
    t.answer(2, 200, {"id": request_id(2), "outputs": []})  # corrupt
    assert t.correct == 1 and t.wrong == 2 and t.lost == 2


def test_every_request_is_correct_refused_other_or_lost():
    t = Tally()
    for i, status in enumerate([200, 429, 503, 504, 504, 500]):
        t.send(i)
        t.answer(i, status, _ok(i) if status == 200 else None)
    t.send(6)
    t.no_answer(6)
    assert (t.sent, t.correct, t.lost) == (7, 1, 1)
    assert t.refused == {429: 1, 503: 1, 504: 2} and t.other == {500: 1}
    assert t.sent == t.correct + sum(t.refused.values()) + sum(t.other.values()) + t.lost


def test_the_last_answer_of_a_retried_request_counts():
    t = Tally()
    t.send(0)
    t.answer(0, 503)
    t.send(0)
    t.answer(0, 200, _ok(0))
    assert t.sent == 1 and t.correct == 1 and t.retries == 1 and t.refused[503] == 0


def test_executions_are_read_per_request_from_every_process_record(tmp_path: Path):
    (tmp_path / "101.rows").write_text("0.0\n1.0\n")
    (tmp_path / "202.rows").write_text("1.0\n")  # request 1 ran again in another process
    t = Tally()
    t.count_executions(tmp_path)
    assert read_executions(tmp_path) == {"req-0": 1, "req-1": 2}
    assert t.executed_twice == 1 and t.ran(["req-0", "req-2"]) == 1
    assert "executed_twice=1" in t.line("x")
