"""What a chaos scenario counts, per request id, so that its assertions can fail.

Every request of a scenario has its own id (``req-{i}``) and its own input (one row of four
``i``), so its correct answer is known: the simulated model answers each row's sum, ``4 * i``.
For each id the tally keeps the last HTTP answer the client got, and the figures follow:

- ``correct``: answered 200 with the correct output for that id;
- ``refused``: answered 429, 503 or 504 (counted by kind): the service said no, in time;
- ``other``: any other status (a 500 for a poison input, say), counted by status;
- ``wrong``: answered 200 with somebody else's or a corrupt output;
- ``lost``: no answer at all (the client timed out or its connection dropped) or a wrong one;
- ``executions``: how often the model really ran the request, read from the simulated
  backend's record (``executions_dir``, one file per worker process, so crashes and restarts
  are counted too); ``executed_twice`` is the number of ids that ran more than once.

``sent == correct + sum(refused) + sum(other) + lost`` always holds, so nothing hides in a
catch-all "answered". A scenario asserts the bounds that apply to it: all correct (a worker's
SIGKILL), a loss bound (Redis killed), exactly one execution (a drain), none (expired requests).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from protocol.keys import GROUP
from protocol.messages import FIELD, InferRequest

REFUSALS = (429, 503, 504)
"""Answers that tell the caller the service could not take or finish the request in time."""

NO_ANSWER = 0
"""The status recorded for a request that got no HTTP answer at all."""


def request_id(i: int) -> str:
    return f"req-{i}"


def request_body(i: int, **parameters: object) -> bytes:
    """The V2 JSON body of request ``i`` for a simulated model (input ``x``, one row)."""
    doc: dict[str, Any] = {
        "id": request_id(i),
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [i] * 4}],
    }
    if parameters:
        doc["parameters"] = parameters
    return json.dumps(doc).encode()


def is_correct(i: int, response: Mapping[str, Any]) -> bool:
    """Whether a 200's V2 body is request ``i``'s own answer (its id and its row's sum)."""
    try:
        return response["id"] == request_id(i) and response["outputs"][0]["data"] == [4.0 * i]
    except (KeyError, IndexError, TypeError):
        return False


def read_executions(folder: Path) -> Counter[str]:
    """Executions per request id, from a simulated model's ``executions_dir`` (each line is the
    first element of a row it ran, ``i`` for ``request_body(i)``)."""
    runs: Counter[str] = Counter()
    for record in sorted(folder.glob("*.rows")):
        for line in record.read_text().splitlines():
            if line:
                runs[request_id(int(float(line)))] += 1
    return runs


@dataclass
class Outcome:
    status: int = NO_ANSWER
    """The last HTTP status the client got for this id; ``NO_ANSWER`` if none."""
    correct: bool = False
    attempts: int = 0
    """Requests sent for this id (more than one when the client retried a 503)."""
    message: str = ""
    """The error message of the last answer when it was not a 200."""


def held_by(r: redis.Redis, stream: str, consumer: str) -> list[str]:
    """Request ids of the entries ``consumer`` has read and not acknowledged: what a worker
    holds (and what must be reclaimed if it dies)."""
    pending = r.xpending_range(stream, GROUP, "-", "+", 100_000, consumername=consumer)
    ids = []
    for p in pending:
        entries = r.xrange(stream, p["message_id"], p["message_id"])
        if entries:
            request = InferRequest.decode(entries[0][1][FIELD])
            ids.append(request.client_id or request.id)
    return ids


def pending(r: redis.Redis, stream: str) -> int:
    """Entries of ``stream`` read by a worker and not acknowledged yet."""
    return int(r.xpending(stream, GROUP)["pending"])


class Tally:
    """Per request id: what the client got, and how often the model ran it."""

    def __init__(self) -> None:
        self.outcomes: dict[str, Outcome] = {}
        self.executions: Counter[str] = Counter()
        self.completed = 0
        """Answers received so far, of any kind (drives a scenario's "after N answers")."""
        self.reasons: dict[int, str] = {}
        """The first error message seen per status other than 200 (for failure messages)."""

    # -- recording ---------------------------------------------------------------------------

    def send(self, i: int) -> None:
        """Request ``i`` is (re)sent."""
        self.outcomes.setdefault(request_id(i), Outcome()).attempts += 1

    def answer(self, i: int, status: int, body: Mapping[str, Any] | None = None) -> None:
        """The client got ``status`` (and for a 200 its decoded body) for request ``i``."""
        outcome = self.outcomes.setdefault(request_id(i), Outcome(attempts=1))
        outcome.status = status
        outcome.correct = status == 200 and body is not None and is_correct(i, body)
        outcome.message = "" if status == 200 else str((body or {}).get("error", ""))
        if status != 200 and status not in self.reasons:
            self.reasons[status] = outcome.message
        self.completed += 1

    def no_answer(self, i: int) -> None:
        """Request ``i`` got no HTTP answer (client timeout, connection reset)."""
        outcome = self.outcomes.setdefault(request_id(i), Outcome(attempts=1))
        outcome.status, outcome.message = NO_ANSWER, "no answer"
        self.completed += 1

    def count_executions(self, runs: Counter[str] | Path) -> None:
        """Adopt the model's record of executions (``read_executions`` or its folder)."""
        self.executions = read_executions(runs) if isinstance(runs, Path) else runs

    # -- figures -----------------------------------------------------------------------------

    @property
    def sent(self) -> int:
        return len(self.outcomes)

    @property
    def retries(self) -> int:
        return sum(o.attempts - 1 for o in self.outcomes.values())

    @property
    def correct(self) -> int:
        return sum(1 for o in self.outcomes.values() if o.correct)

    @property
    def statuses(self) -> Counter[int]:
        return Counter(o.status for o in self.outcomes.values())

    @property
    def refused(self) -> Counter[int]:
        """Final answers 429, 503 and 504, by status (every kind present, zero or not)."""
        statuses = self.statuses
        return Counter({s: statuses[s] for s in REFUSALS})

    @property
    def other(self) -> Counter[int]:
        """Final answers that are neither a 200, a refusal, nor no answer, by status."""
        return Counter(
            {s: n for s, n in self.statuses.items() if s not in (200, NO_ANSWER, *REFUSALS)}
        )

    @property
    def wrong(self) -> int:
        return sum(1 for o in self.outcomes.values() if o.status == 200 and not o.correct)

    @property
    def unanswered(self) -> int:
        return self.statuses[NO_ANSWER]

    @property
    def lost(self) -> int:
        """No answer at all, or a 200 with a wrong answer."""
        return self.unanswered + self.wrong

    @property
    def executed_twice(self) -> int:
        return sum(1 for n in self.executions.values() if n > 1)

    def failures(self) -> Counter[tuple[int, str]]:
        """Final answers other than 200, by status and error message (what a failed scenario
        prints to say what went wrong)."""
        return Counter((o.status, o.message) for o in self.outcomes.values() if o.status != 200)

    def failure_lines(self) -> str:
        """``failures()`` as lines, most frequent first."""
        return "\n".join(f"  {n} x {s}: {m}" for (s, m), n in self.failures().most_common())

    def ids(self, *, status: int | None = None, correct: bool | None = None) -> list[str]:
        """Request ids whose final outcome matches."""
        return [
            i
            for i, o in self.outcomes.items()
            if (status is None or o.status == status) and (correct is None or o.correct == correct)
        ]

    def ran(self, ids: Iterable[str]) -> int:
        """How many of ``ids`` the model ran at least once."""
        return sum(1 for i in ids if self.executions[i] > 0)

    def line(self, name: str, **extra: object) -> str:
        """One figure line, every value measured: what the README's chaos table shows."""
        refused = self.refused
        other = ",".join(f"{s}:{n}" for s, n in sorted(self.other.items())) or "0"
        figures = " ".join(f"{k}={v}" for k, v in extra.items())
        return (
            f"chaos[{name}]: sent={self.sent} correct={self.correct} "
            f"refused_429={refused[429]} refused_503={refused[503]} refused_504={refused[504]} "
            f"other={other} wrong={self.wrong} executed_twice={self.executed_twice} "
            f"lost={self.lost} {figures}"
        ).strip()
