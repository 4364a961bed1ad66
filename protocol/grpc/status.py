"""gRPC status codes and the HTTP statuses they stand for: one table, used by the gateway to
answer (an error's HTTP status to its gRPC code) and by clients to count (a code back to the
HTTP status it stands for), so both transports report failures in the same terms."""

from __future__ import annotations

import grpc

GRPC_CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,  # HTTP only: a body that arrived too slowly
    409: grpc.StatusCode.ABORTED,
    410: grpc.StatusCode.NOT_FOUND,  # HTTP only: a job record Redis lost
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,  # message larger than --max-body-bytes
    415: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.FAILED_PRECONDITION,  # HTTP only: an Idempotency-Key reused
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,  # the client gave up (nginx's "client closed request")
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
"""The gRPC code of each HTTP status the gateway answers with."""

_PREFERRED = {400, 404, 429, 504}
"""Where two statuses share a code, the one a code stands for on the way back."""

HTTP_STATUSES: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNKNOWN: 500,
    **{
        code: status
        for status, code in sorted(GRPC_CODES.items(), key=lambda item: item[0] in _PREFERRED)
    },
}
"""The HTTP status a gRPC code stands for (where several share it: INVALID_ARGUMENT 400,
NOT_FOUND 404, RESOURCE_EXHAUSTED 429, DEADLINE_EXCEEDED 504)."""


def grpc_code(status: int) -> grpc.StatusCode:
    """The gRPC code of an HTTP status (UNKNOWN for one outside the table)."""
    return GRPC_CODES.get(status, grpc.StatusCode.UNKNOWN)


def http_status(code: grpc.StatusCode) -> int:
    """The HTTP status a gRPC code stands for (500 for one outside the table)."""
    return HTTP_STATUSES.get(code, 500)
