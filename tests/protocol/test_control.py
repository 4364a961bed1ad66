"""The control-plane messages: version policies, commands and load reports."""

from __future__ import annotations

import msgpack
import pytest

from protocol import PROTOCOL_VERSION, ProtocolError, VersionMismatch
from protocol.control import Command, LoadReport, Op, VersionPolicy, check_weights


def test_a_policy_round_trips_and_knows_its_traffic():
    policy = VersionPolicy(("1", "2"), {"1": 90.0, "2": 10.0}, generation=7)
    assert VersionPolicy.decode(policy.encode()) == policy
    assert policy.traffic() == {"1": 0.9, "2": 0.1}


def test_without_weights_all_traffic_goes_to_the_newest_version():
    assert VersionPolicy(("1", "2"), {}, 1).traffic() == {"1": 0.0, "2": 1.0}
    assert VersionPolicy((), {}, 1).traffic() == {}
    assert not VersionPolicy((), {}, 1).loaded


def test_weights_must_name_served_versions():
    with pytest.raises(ProtocolError, match="not served"):
        VersionPolicy(("1",), {"2": 1.0}, 1)


@pytest.mark.parametrize(
    ("weights", "words"),
    [
        ({}, "must be an object"),
        ([1, 2], "must be an object"),
        ({"1": -1}, "not negative"),
        ({"1": float("inf")}, "finite"),
        ({"1": "90"}, "must be a number"),
        ({"1": True}, "must be a number"),
        ({"../1": 1}, "invalid version"),
        ({"1": 0, "2": 0}, "positive weight"),
    ],
)
def test_bad_weights_say_what_is_wrong(weights, words):
    with pytest.raises(ProtocolError, match=words):
        check_weights(weights)


def test_a_zero_weight_keeps_a_version_without_default_traffic():
    policy = VersionPolicy(("1", "2"), check_weights({"1": 0, "2": 5}), 1)
    assert policy.traffic() == {"1": 0.0, "2": 1.0}


def test_commands_and_reports_round_trip():
    command = Command(Op.PREPARE, "digits", VersionPolicy(("3",), {}, 4), "ns:control:reply:x")
    assert Command.decode(command.encode()) == command
    report = LoadReport("w1", "digits", 4, False, ("2",), "bad file", 12.5, 1_700, {"2": 1.0})
    assert LoadReport.decode(report.encode()) == report
    fell_back = LoadReport("w1", "digits", 4, True, ("1",), fallback="no version folder for 2")
    assert LoadReport.decode(fell_back.encode()) == fell_back


@pytest.mark.parametrize(
    "items",
    [
        ["explode", "m", [[], {}, 1], ""],
        ["prepare", "../m", [[], {}, 1], ""],
        ["prepare", "m", [["1"], {"2": 1}, 1], ""],
        ["prepare", "m", [[], {}, 1]],
        ["prepare", "m", "policy", ""],
    ],
)
def test_malformed_commands_are_protocol_errors(items):
    raw = msgpack.packb([PROTOCOL_VERSION, *items])
    with pytest.raises(ProtocolError):
        Command.decode(raw)


def test_a_command_from_another_protocol_version_is_refused():
    with pytest.raises(VersionMismatch):
        Command.decode(msgpack.packb([PROTOCOL_VERSION + 1, "prepare", "m", [[], {}, 1], ""]))
    with pytest.raises(ProtocolError):
        LoadReport.decode(b"\xc1")
