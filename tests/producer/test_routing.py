"""The traffic split: which version a request that names none goes to."""

from __future__ import annotations

from collections import Counter

from producer.routing import VersionRouter


def test_a_90_10_split_is_exact_over_every_ten_requests():
    router = VersionRouter()
    picks = [router.choose("m", {"1": 90.0, "2": 10.0}) for _ in range(1000)]
    for start in range(0, 1000, 10):
        assert Counter(picks[start : start + 10]) == {"1": 9, "2": 1}


def test_the_canary_is_spread_out_not_bunched():
    router = VersionRouter()
    picks = [router.choose("m", {"a": 1.0, "b": 1.0}) for _ in range(6)]
    assert picks in (["a", "b"] * 3, ["b", "a"] * 3)


def test_uneven_weights_land_on_their_share():
    router = VersionRouter()
    counts = Counter(router.choose("m", {"1": 1.0, "2": 2.0, "3": 7.0}) for _ in range(1000))
    assert counts == {"1": 100, "2": 200, "3": 700}


def test_a_new_split_starts_afresh_and_models_do_not_share_state():
    router = VersionRouter()
    for _ in range(3):
        router.choose("m", {"1": 50.0, "2": 50.0})
    assert Counter(router.choose("m", {"2": 1.0, "3": 3.0}) for _ in range(8)) == {"2": 2, "3": 6}
    assert router.choose("other", {"9": 1.0}) == "9"
