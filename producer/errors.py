"""Errors the gateway answers with, each mapped to one HTTP status.

Routes and the inference service raise these; one exception handler turns them into the V2
error body ``{"error": "..."}``. Messages are written for the person who sent the request.
"""

from __future__ import annotations

from runtime.faults import Fault, classify, describe

INTERNAL_MESSAGE = "internal error in the gateway; see its log"
"""What a caller is told of an unexpected exception; the details go to the gateway's log."""


class GatewayError(Exception):
    status: int = 500
    default_retry_after_s: float | None = None
    """``Retry-After`` when the raiser names none: refusals that pass (429, 503) always say when
    to come back, so a client's retry loop never has to guess."""

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = self.default_retry_after_s if retry_after_s is None else retry_after_s

    def __str__(self) -> str:
        return self.message

    def headers(self) -> dict[str, str]:
        """The response headers this refusal comes with."""
        headers = {}
        if self.retry_after_s is not None:
            headers["retry-after"] = str(max(1, round(self.retry_after_s)))
        return headers


class BadRequest(GatewayError):
    status = 400


class Unauthorized(GatewayError):
    status = 401

    def headers(self) -> dict[str, str]:
        return {**super().headers(), "www-authenticate": 'Bearer realm="inferq"'}  # RFC 6750


class Forbidden(GatewayError):
    status = 403


class NotFound(GatewayError):
    status = 404


class RequestTimeout(GatewayError):
    """The request (its body) did not arrive in time; the connection is closed after it."""

    status = 408

    def headers(self) -> dict[str, str]:
        # The rest of the body may still be on its way.
        return {**super().headers(), "connection": "close"}


class Conflict(GatewayError):
    status = 409


class Gone(GatewayError):
    """Something that existed is known to be gone (a job record Redis lost)."""

    status = 410


class PayloadTooLarge(GatewayError):
    status = 413


class UnsupportedMediaType(GatewayError):
    status = 415


class UnprocessableContent(GatewayError):
    """Well-formed, but it contradicts an earlier request (an Idempotency-Key reused with a
    different body)."""

    status = 422


class TooManyRequests(GatewayError):
    status = 429
    default_retry_after_s = 1.0


class ModelFailed(GatewayError):
    """The model raised on a request the gateway had accepted as valid."""

    status = 500


class ServiceUnavailable(GatewayError):
    status = 503
    default_retry_after_s = 1.0


class ClientClosedRequest(GatewayError):
    """The caller went away (hung up, or cancelled its call) before its answer was ready.
    Nobody reads the answer; 499 is what the metrics and logs record (nginx's convention)."""

    status = 499


class GatewayTimeout(GatewayError):
    status = 504


def redis_unavailable(error: BaseException, doing: str = "queue the request") -> ServiceUnavailable:
    """The 503 for a Redis error: what kind of trouble and what Redis said, never the command
    or its arguments (``runtime.faults.describe``), with a ``Retry-After``."""
    unreachable = classify(error) in (Fault.CONNECTION, Fault.LOADING)
    return ServiceUnavailable(
        f"could not {doing}: {describe(error)}; retry shortly",
        retry_after_s=1 if unreachable else 2,
    )
