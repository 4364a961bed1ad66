"""Key names, priority lanes, name validation, the shared clock and result-cache digests."""

from __future__ import annotations

import re

import numpy as np
import pytest

from protocol.cachekey import digest
from protocol.deadline import (
    ZERO,
    ClockOffset,
    deadline_after,
    has_expired,
    redis_time_ms,
    remaining_ms,
)
from protocol.jobs import JOB_ID_RANDOM_BYTES, job_id_key, new_job_id
from protocol.keys import (
    GROUP,
    JOB_TAG_CHARS,
    LANES_BY_PRIORITY,
    Keys,
    Lane,
    StreamKey,
    hash_tag,
    idempotency_tag,
    idempotency_tag_bytes,
    is_valid_name,
    job_tag,
)
from protocol.tensor import Tensor, pack_bytes_elements

KEY = job_id_key("test")

# --------------------------------------------------------------------------------------------
# Keys


def _every_key(keys: Keys) -> list[str]:
    return [
        keys.stream("digits", Lane.NORMAL),
        *keys.streams("digits"),
        keys.stream("digits", Lane.NORMAL, 1),
        keys.replies("gw-1"),
        keys.result("abc"),
        keys.cache("digits", "1", "d1g3st"),
        keys.workers,
        keys.worker("w-1"),
        keys.models,
        keys.job("j1"),
        keys.idempotency("m1", "k1"),
        keys.job_events,
        keys.dlq("digits"),
        keys.control,
        keys.control_reply("c1"),
        keys.policies,
        keys.policy_generation,
        keys.model_status("digits"),
        keys.model_lock("digits"),
        keys.stats,
        keys.stats_lease,
    ]


@pytest.mark.parametrize("namespace", ["inferq", "test-7f3a", "prod.eu"])
def test_every_key_lives_under_the_namespace(namespace: str) -> None:
    keys = Keys(namespace)
    for key in _every_key(keys):
        assert key.startswith(f"{namespace}:"), key


def test_keys_follow_the_documented_layout() -> None:
    keys = Keys()
    assert keys.stream("digits", Lane.HIGH) == "inferq:stream:{digits}:high"
    assert keys.stream("digits", Lane.LOW, 2) == "inferq:stream:{digits:2}:low"
    assert keys.replies("gw") == "inferq:replies:{gw}"
    assert keys.result("r") == "inferq:result:r"
    assert keys.cache("m", "2", "ff") == "inferq:cache:m:2:ff"
    assert keys.workers == "inferq:{inferq}:workers"
    assert keys.worker("w") == "inferq:{inferq}:worker:w"
    assert keys.models == "inferq:{inferq}:models"
    assert keys.job("abcdefghijklmnopqrstuv") == "inferq:job:{ijkl}abcdefghijklmnopqrstuv"
    assert keys.job("j1") == "inferq:job:{j1}j1"
    assert keys.idempotency("m", "i") == f"inferq:idempotency:{{{idempotency_tag('m', 'i')}}}m:i"
    assert keys.dlq("m") == "inferq:dlq:{m}"
    assert keys.job_events == "inferq:jobevents"
    assert GROUP == "workers"


def test_distinct_kinds_of_key_never_share_a_name() -> None:
    keys = _every_key(Keys())
    unique = set(keys)
    # streams("digits") repeats stream("digits", NORMAL); everything else is distinct
    assert len(unique) == len(keys) - 1


def test_a_models_streams_are_listed_highest_priority_first() -> None:
    assert Keys("ns").streams("m") == [
        "ns:stream:{m}:high",
        "ns:stream:{m}:normal",
        "ns:stream:{m}:low",
    ]
    assert LANES_BY_PRIORITY == (Lane.HIGH, Lane.NORMAL, Lane.LOW)


def test_all_streams_lists_every_partition_each_highest_lane_first() -> None:
    keys = Keys("ns")
    assert keys.all_streams("m", 2) == keys.streams("m", 0) + keys.streams("m", 1)
    assert keys.all_streams("m") == keys.streams("m")


# Hash tags: what one command needs together shares a slot, and nothing else does.


def test_a_partitions_lanes_share_one_hash_tag_so_one_xreadgroup_reads_them() -> None:
    keys = Keys()
    for partition in (0, 1, 7):
        assert len({hash_tag(s) for s in keys.streams("digits", partition)}) == 1


def test_models_and_partitions_get_different_hash_tags() -> None:
    keys = Keys()
    tags = {
        hash_tag(keys.stream(model, Lane.NORMAL, p))
        for model in ("digits", "minilm", "resnet-50")
        for p in range(4)
    }
    assert len(tags) == 12


def test_the_dead_letter_stream_shares_the_slot_of_partition_0() -> None:
    keys = Keys()
    assert hash_tag(keys.dlq("digits")) == hash_tag(keys.stream("digits", Lane.LOW))


def test_a_job_record_shares_its_idempotency_keys_slot_when_its_id_carries_the_tag() -> None:
    keys = Keys()
    tag = idempotency_tag_bytes("digits", "scan-0001")
    job_id = new_job_id(1_796_000_000_000, tag + bytes(JOB_ID_RANDOM_BYTES - len(tag)), KEY)
    assert job_tag(job_id) == idempotency_tag("digits", "scan-0001")
    assert len(job_tag(job_id)) == JOB_TAG_CHARS
    assert hash_tag(keys.job(job_id)) == hash_tag(keys.idempotency("digits", "scan-0001"))
    # Different keys (and the same key for another model) spread over different tags.
    assert idempotency_tag("digits", "scan-0002") != idempotency_tag("digits", "scan-0001")
    assert idempotency_tag("other", "scan-0001") != idempotency_tag("digits", "scan-0001")


def test_jobs_issued_together_spread_over_tags() -> None:
    ids = [new_job_id(1_796_000_000_000, bytes([i]) * JOB_ID_RANDOM_BYTES, KEY) for i in range(50)]
    assert len({job_tag(i) for i in ids}) == 50  # the tag is random bits, not the issue time


def test_an_idempotency_key_with_braces_keeps_the_tag_inferq_gave_it() -> None:
    keys = Keys()
    key = keys.idempotency("m", "{evil}")
    assert hash_tag(key) == idempotency_tag("m", "{evil}")


def test_the_control_plane_shares_one_slot_per_namespace() -> None:
    keys = Keys("prod")
    control = [
        keys.workers,
        keys.worker("w-1"),
        keys.worker("w-2"),
        keys.models,
        keys.control,
        keys.control_reply("c"),
        keys.policies,
        keys.policy_generation,
        keys.model_status("m"),
        keys.model_lock("m"),
        keys.stats,
        keys.stats_lease,
    ]
    assert {hash_tag(k) for k in control} == {"prod"}
    assert hash_tag(Keys("other").workers) == "other"


def test_hash_tag_follows_redis_rules() -> None:
    assert hash_tag("a{b}c") == "b"
    assert hash_tag("a{b}c{d}") == "b"
    assert hash_tag("a{}c{d}") == "a{}c{d}"  # empty first tag: the whole key
    assert hash_tag("a{bc") == "a{bc"
    assert hash_tag("plain") == "plain"


@pytest.mark.parametrize("namespace", ["a{b", "ns}", "{x}"])
def test_a_namespace_with_braces_is_refused(namespace: str) -> None:
    with pytest.raises(ValueError, match="braces"):
        Keys(namespace)


@pytest.mark.parametrize("namespace", ["inferq", "a", "ns-with.dots"])
@pytest.mark.parametrize("model", ["digits", "m", "resnet-50.v2", "A_b-C.d", "9", "x" * 128])
@pytest.mark.parametrize("lane", list(Lane))
@pytest.mark.parametrize("partition", [0, 1, 63])
def test_parse_stream_inverts_stream(
    namespace: str, model: str, lane: Lane, partition: int
) -> None:
    keys = Keys(namespace)
    key = keys.stream(model, lane, partition)
    assert keys.parse_stream_key(key) == StreamKey(model, lane, partition)
    assert keys.parse_stream(key) == (model, lane)


@pytest.mark.parametrize(
    "key",
    [
        "inferq:result:abc",
        "inferq:stream:{digits}:urgent",
        "inferq:stream:{digits}:",
        "inferq:stream:{digits}",
        "inferq:stream:digits:normal",
        "inferq:stream:{}:normal",
        "inferq:stream:{digits:0}:normal",
        "inferq:stream:{digits:01}:normal",
        "inferq:stream:{digits:x}:normal",
        "inferq:stream:{digits:-1}:normal",
        "inferq:stream:",
        "other:stream:{digits}:normal",
        "inferqx:stream:{digits}:normal",
        "xinferq:stream:{digits}:normal",
        "inferq:dlq:{digits}",
        "",
    ],
)
def test_parse_stream_refuses_keys_that_are_not_request_streams(key: str) -> None:
    assert Keys().parse_stream(key) is None


def test_parse_stream_only_knows_its_own_namespace() -> None:
    assert Keys("a").parse_stream(Keys("ab").stream("m", Lane.LOW)) is None
    assert Keys("ab").parse_stream(Keys("a").stream("m", Lane.LOW)) is None


def test_parse_dlq_inverts_dlq_and_refuses_other_keys() -> None:
    keys = Keys()
    assert keys.parse_dlq(keys.dlq("digits")) == "digits"
    assert keys.parse_dlq(keys.stream("digits", Lane.LOW)) is None
    assert keys.parse_dlq("inferq:dlq:{bad/name}") is None
    assert keys.dlq_pattern == "inferq:dlq:{*"


# --------------------------------------------------------------------------------------------
# Lanes


@pytest.mark.parametrize(
    ("priority", "lane"),
    [
        (1, Lane.HIGH),
        (0, Lane.NORMAL),
        (2, Lane.LOW),
        (3, Lane.LOW),
        (100, Lane.LOW),
        (2**63 - 1, Lane.LOW),
        (-1, Lane.NORMAL),
    ],
)
def test_priority_maps_one_to_high_zero_to_normal_and_two_or_more_to_low(
    priority: int, lane: Lane
) -> None:
    assert Lane.for_priority(priority) is lane


# --------------------------------------------------------------------------------------------
# Names


@pytest.mark.parametrize(
    "name", ["digits", "1", "10", "resnet-50", "v1.2.3", "A_b", "a.b-c_d", "x" * 128, "0.9"]
)
def test_plain_names_are_valid(name: str) -> None:
    assert is_valid_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "",
        ".",
        "..",
        "a..b",
        "a/..",
        "../etc",
        ".hidden",
        "a/b",
        "/abs",
        "a\\b",
        "a:b",
        ":",
        "model:high",
        "-dash",
        "_under",
        "sp ace",
        "tab\t",
        "digits\n",
        "\ndigits",
        "caf\u00e9",
        "\u0661",  # a non-ASCII digit
        "nul\x00",
        "x" * 129,
    ],
)
def test_names_that_could_escape_a_key_or_a_path_are_invalid(name: str) -> None:
    assert not is_valid_name(name)


# --------------------------------------------------------------------------------------------
# The shared clock


def test_clock_offset_takes_the_redis_time_at_the_round_trips_midpoint() -> None:
    offset = ClockOffset.from_sample(local_before_ms=1000.0, redis_ms=5000.0, local_after_ms=1010.0)
    assert offset.offset_ms == 5000.0 - 1005.0
    assert offset.uncertainty_ms == 5.0


def test_clock_offset_of_an_instant_round_trip_is_exact() -> None:
    offset = ClockOffset.from_sample(200.0, 150.0, 200.0)
    assert offset == ClockOffset(offset_ms=-50.0, uncertainty_ms=0.0)


def test_a_local_clock_that_stepped_back_mid_sample_counts_as_no_round_trip() -> None:
    offset = ClockOffset.from_sample(local_before_ms=1000.0, redis_ms=900.0, local_after_ms=990.0)
    assert offset.uncertainty_ms == 0.0
    assert offset.offset_ms == -100.0


def test_better_of_prefers_the_sample_with_the_smaller_uncertainty() -> None:
    tight = ClockOffset(offset_ms=10.0, uncertainty_ms=0.2)
    loose = ClockOffset(offset_ms=50.0, uncertainty_ms=3.0)
    assert tight.better_of(loose) is tight
    assert loose.better_of(tight) is tight


def test_better_of_keeps_the_current_estimate_on_a_tie() -> None:
    a = ClockOffset(1.0, 2.0)
    b = ClockOffset(5.0, 2.0)
    assert a.better_of(b) is a
    assert b.better_of(a) is b


def test_the_best_of_many_samples_is_the_shortest_round_trip() -> None:
    samples = [
        ClockOffset.from_sample(0.0, 100.0, 8.0),
        ClockOffset.from_sample(10.0, 111.0, 12.0),  # rtt 2: the best
        ClockOffset.from_sample(20.0, 130.0, 25.0),
    ]
    best = samples[0]
    for sample in samples[1:]:
        best = best.better_of(sample)
    assert best is samples[1]
    assert best.offset_ms == 100.0


def test_to_redis_ms_shifts_a_local_time_by_the_offset() -> None:
    assert ClockOffset(offset_ms=250.5, uncertainty_ms=1.0).to_redis_ms(1000.0) == 1250
    assert ZERO.to_redis_ms(1234.9) == 1234


def test_redis_time_reply_parts_become_milliseconds() -> None:
    assert redis_time_ms(b"1700000000", b"250000") == 1_700_000_000_250.0
    assert redis_time_ms("2", "1500") == 2001.5
    assert redis_time_ms(0, 999) == 0.999


def test_deadlines_are_absolute_and_never_before_now() -> None:
    assert deadline_after(1000, 250.9) == 1250
    assert deadline_after(1000, 0) == 1000
    assert deadline_after(1000, -50) == 1000


def test_a_deadline_has_expired_from_its_own_millisecond_on() -> None:
    assert remaining_ms(1000, 990) == 10
    assert remaining_ms(1000, 1010) == -10
    assert not has_expired(1000, 999)
    assert has_expired(1000, 1000)
    assert has_expired(1000, 1001)


# --------------------------------------------------------------------------------------------
# Result-cache digests


def _t(name: str, values: list[float], dtype: str = "float32") -> Tensor:
    return Tensor.from_numpy(name, np.array(values, dtype=dtype))


BASE_INPUTS = [_t("a", [1.0, 2.0]), _t("b", [3.0])]
BASE = digest(BASE_INPUTS, ["y", "x"])


def test_a_digest_is_a_stable_hex_string() -> None:
    assert re.fullmatch(r"[0-9a-f]{32}", BASE)
    assert digest(BASE_INPUTS, ["y", "x"]) == BASE
    # Pinned: the digest is a cache key shared by every process, so it must not drift between
    # runs, hosts or releases unnoticed (Python's hash() would; this must not).
    request = [Tensor.from_numpy("input", np.arange(4, dtype=np.float32))]
    assert digest(request, ["label"]) == "590539cef88a9f428b438e965cc2987e"


def test_a_digest_is_the_same_for_equal_requests_built_separately() -> None:
    again = [_t("a", [1.0, 2.0]), _t("b", [3.0])]
    assert digest(again, ["y", "x"]) == BASE


def test_a_digest_ignores_the_order_of_inputs_and_outputs() -> None:
    assert digest(list(reversed(BASE_INPUTS)), ["x", "y"]) == BASE
    assert digest(list(reversed(BASE_INPUTS)), ["y", "x"]) == BASE


@pytest.mark.parametrize(
    ("inputs", "outputs", "what"),
    [
        ([_t("a", [1.0, 2.5]), _t("b", [3.0])], ["x", "y"], "a value"),
        ([_t("a", [2.0, 1.0]), _t("b", [3.0])], ["x", "y"], "the order of values"),
        ([_t("c", [1.0, 2.0]), _t("b", [3.0])], ["x", "y"], "an input name"),
        ([_t("a", [1.0, 2.0], "int32"), _t("b", [3.0])], ["x", "y"], "a datatype"),
        (
            [Tensor.checked("a", "FP32", (2, 1), BASE_INPUTS[0].data), _t("b", [3.0])],
            ["x", "y"],
            "a shape",
        ),
        ([_t("a", [1.0, 2.0])], ["x", "y"], "a missing input"),
        ([*BASE_INPUTS, _t("c", [])], ["x", "y"], "an extra empty input"),
        (BASE_INPUTS, ["x"], "a missing output"),
        (BASE_INPUTS, ["x", "y", "z"], "an extra output"),
        (BASE_INPUTS, ["x", "w"], "an output name"),
        (BASE_INPUTS, None, "all outputs"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_a_digest_changes_with_any_part_of_the_request(
    inputs: list[Tensor], outputs: list[str] | None, what: str
) -> None:
    assert digest(inputs, outputs) != BASE, what


def test_a_digest_changes_with_every_single_bit_of_input_data() -> None:
    tensor = Tensor.checked("raw", "UINT8", (4,), b"\x00\x01\x02\x03")
    seen = {digest([tensor], None)}
    for i in range(len(tensor.data)):
        for bit in range(8):
            flipped = bytearray(tensor.data)
            flipped[i] ^= 1 << bit
            seen.add(digest([Tensor.checked("raw", "UINT8", (4,), bytes(flipped))], None))
    assert len(seen) == 1 + 4 * 8


def test_a_digest_tells_bytes_elements_apart_by_their_framing() -> None:
    ab = Tensor.checked("t", "BYTES", (1,), pack_bytes_elements([b"ab"]))
    a_b = Tensor.checked("t", "BYTES", (2,), pack_bytes_elements([b"a", b"b"]))
    assert digest([ab], None) != digest([a_b], None)


def test_a_digest_does_not_confuse_where_names_and_data_split() -> None:
    one = Tensor.checked("ab", "UINT8", (1,), b"c")
    two = Tensor.checked("a", "UINT8", (1,), b"c")
    assert digest([one], None) != digest([two], None)
    split = [Tensor.checked("a", "UINT8", (1,), b"\x01"), Tensor.checked("b", "UINT8", (0,), b"")]
    joined = [Tensor.checked("a", "UINT8", (1,), b"\x01")]
    assert digest(split, None) != digest(joined, None)


@pytest.mark.parametrize(
    "outputs",
    [None, [], [""], ["*"], ["a", "b"], ["a\x00b"], ["ab"], ["a"], ["a", "a"]],
    ids=repr,
)
def test_a_digest_tells_every_requested_output_list_apart(outputs: list[str] | None) -> None:
    others = [None, [], [""], ["*"], ["a", "b"], ["a\x00b"], ["ab"], ["a"], ["a", "a"]]
    mine = digest(BASE_INPUTS, outputs)
    for other in others:
        if other != outputs:
            assert digest(BASE_INPUTS, other) != mine, (outputs, other)
