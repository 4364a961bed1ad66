"""The one mapping from a refusal to what a caller is told."""

from __future__ import annotations

import json

from producer.errors import BadRequest, http_form


def test_a_message_quoting_a_lone_surrogate_is_still_a_valid_body() -> None:
    status, body, _ = http_form(BadRequest("no input '\ud800'"))
    assert status == 400
    body.decode("utf-8")  # valid UTF-8: the surrogate travels as its JSON escape
    assert json.loads(body)["error"] == "no input '\ud800'"
