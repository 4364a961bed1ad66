"""Demand hints: a model name in, the same name out; anything else refused as a protocol error."""

from __future__ import annotations

import pytest

from protocol import ProtocolError
from protocol.demand import decode_hint, encode_hint


def test_a_hint_names_its_model():
    assert decode_hint(encode_hint("digits-png")) == "digits-png"


@pytest.mark.parametrize("fields", [{}, {b"model": b""}, {b"model": b"../x"}, {b"other": b"a"}])
def test_a_hint_without_a_valid_model_name_is_refused(fields):
    with pytest.raises(ProtocolError):
        decode_hint(fields)
