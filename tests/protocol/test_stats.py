"""The published backlog snapshot: one codec, garbage refused."""

from __future__ import annotations

import msgpack
import pytest

from protocol import PROTOCOL_VERSION, ProtocolError
from protocol.stats import LaneRow, StatsSnapshot

ROW = LaneRow("digits", "normal", 2, 10, 4, "xinfo", 3, 1, 2, 1500, 96)


def test_a_snapshot_round_trips() -> None:
    snapshot = StatsSnapshot(
        1000,
        900,
        (ROW, LaneRow("m", "low", 0, 0, 0, "no-group", 0, 0, 0, None, None)),
        {"digits": 1},
        "gw-1",
    )
    assert StatsSnapshot.decode(snapshot.encode()) == snapshot


def test_freshness_is_judged_on_the_redis_clock() -> None:
    snapshot = StatsSnapshot(1000, 1000, (), {})
    assert snapshot.fresh(1500, 1000) and snapshot.fresh(2000, 1000)
    assert not snapshot.fresh(2001, 1000)
    assert not snapshot.fresh(999, 1000)  # from the future: a clock gone wrong


@pytest.mark.parametrize(
    "fields",
    [
        [1, 1, [["m", "low", -1, 0, 0, "xinfo", 0, 0, 0, None, None]], {}, ""],
        [1, 1, [["m", "low", 0, 0, 0, "xinfo", 0, 0, 0, "old", None]], {}, ""],
        [1, 1, [["m", "low"]], {}, ""],
        [1, 1, [], {"m": "x"}, ""],
        ["1", 1, [], {}, ""],
        [1, 1, [], {}, 7],
    ],
)
def test_a_malformed_snapshot_raises_protocol_error(fields: list[object]) -> None:
    raw = msgpack.packb([PROTOCOL_VERSION, *fields])
    with pytest.raises(ProtocolError):
        StatsSnapshot.decode(raw)
