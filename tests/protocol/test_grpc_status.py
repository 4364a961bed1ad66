"""One table of HTTP statuses and gRPC codes: every error the gateway raises has its code, and a
code read back stands for the HTTP status a client would have got."""

from __future__ import annotations

import grpc

import producer.errors as errors
from producer.errors import GatewayError
from protocol.grpc.status import GRPC_CODES, grpc_code, http_status


def test_every_gateway_error_has_the_grpc_status_of_its_http_status():
    classes = [
        c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, GatewayError)
    ]
    assert len(classes) >= 12
    for cls in classes:
        assert cls.status in GRPC_CODES, cls
    expected = {
        400: "INVALID_ARGUMENT",
        401: "UNAUTHENTICATED",
        403: "PERMISSION_DENIED",
        404: "NOT_FOUND",
        409: "ABORTED",
        413: "RESOURCE_EXHAUSTED",
        429: "RESOURCE_EXHAUSTED",
        500: "INTERNAL",
        503: "UNAVAILABLE",
        504: "DEADLINE_EXCEEDED",
    }
    for status, name in expected.items():
        assert GRPC_CODES[status] is getattr(grpc.StatusCode, name)
        back = {
            "INVALID_ARGUMENT": 400,
            "RESOURCE_EXHAUSTED": 429,
            "DEADLINE_EXCEEDED": 504,
            "NOT_FOUND": 404,
        }
        back = back.get(name, status)
        assert http_status(GRPC_CODES[status]) == back
    assert grpc_code(errors.TooManyRequests("x").status) is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert http_status(grpc.StatusCode.OK) == 200 and http_status(grpc.StatusCode.DATA_LOSS) == 500
