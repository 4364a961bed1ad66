"""Errors the gateway answers with: one class per HTTP status, and the one mapping from an
exception to what a caller is told.

Routes and services raise these with a message written for the person who sent the request.
``answer_for`` turns any exception into one (an unexpected one is logged and becomes a 500 that
says nothing of it); ``http_form`` gives its status, V2 error body ``{"error": "..."}`` and
headers. The gRPC form (``producer.grpc_service``) derives from the same classes: the code of the
status (``protocol.grpc.status``), the message, and ``retry_after`` as trailing metadata.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import structlog

from runtime.faults import Fault, classify, describe

log = structlog.get_logger("inferq.gateway")

INTERNAL_MESSAGE = "internal error in the gateway; see its log"
"""What a caller is told of an unexpected exception; the details go to the gateway's log."""


class GatewayError(Exception):
    status: int = 500
    default_retry_after_s: float | None = None
    """``Retry-After`` when the raiser names none: refusals that pass (429, 503) always say when
    to come back, so a client's retry loop never has to guess."""
    routed: str | None = None
    """The version the request had been routed to when it was refused (the metrics label)."""

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = self.default_retry_after_s if retry_after_s is None else retry_after_s

    def __str__(self) -> str:
        return self.message

    def retry_after(self) -> str | None:
        """The ``Retry-After`` value (whole seconds, at least 1), if the refusal has one."""
        if self.retry_after_s is None:
            return None
        return str(max(1, round(self.retry_after_s)))

    def headers(self) -> dict[str, str]:
        """The response headers this refusal comes with."""
        retry_after = self.retry_after()
        return {} if retry_after is None else {"retry-after": retry_after}


def answer_for(error: BaseException, **where: Any) -> GatewayError:
    """What the caller is told of ``error``: itself if it is a GatewayError; for a cancelled
    call, 499; for anything else (a bug), a 500 that names nothing, the traceback logged."""
    if isinstance(error, GatewayError):
        return error
    if isinstance(error, asyncio.CancelledError):
        return ClientClosedRequest("the call was cancelled before its answer was ready")
    log.error("unhandled error", exc_info=error, **where)
    return GatewayError(INTERNAL_MESSAGE)


def error_body(message: str) -> bytes:
    """The V2 error body, byte for byte what Starlette's ``JSONResponse`` sends; a message that
    quotes a string which is not Unicode (a lone surrogate) is still sent, escaped, never a
    second error while answering the first."""
    return json.dumps(
        {"error": message}, ensure_ascii=False, allow_nan=False, separators=(",", ":")
    ).encode("utf-8", "backslashreplace")


def http_form(error: GatewayError) -> tuple[int, bytes, dict[str, str]]:
    """The HTTP answer to a refusal: status, V2 error body, headers."""
    return error.status, error_body(error.message), error.headers()


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


def unconfirmed(error: BaseException, what: str, deadline_ms: int) -> GatewayTimeout:
    """The 504 for a request whose ``XADD`` got no reply (``runtime.faults.outcome_unknown``)
    and whose answer did not come before its deadline: it may have been queued and may have
    run, so it must never read as "not queued" (a client would run it twice)."""
    return GatewayTimeout(
        f"Redis did not confirm that {what} was queued ({describe(error)}) and no answer came "
        f"within its deadline of {deadline_ms} ms: it may have run. It does not start after "
        "its deadline; send it again only if running it twice is harmless"
    )


def job_unconfirmed(error: BaseException, job_id: str) -> GatewayTimeout:
    """The 504 for a job submission whose reply Redis never sent (see ``unconfirmed``)."""
    return GatewayTimeout(
        f"Redis did not confirm that job {job_id} was queued ({describe(error)}): it may have "
        f"been. GET /v2/jobs/{job_id} says whether it exists before you submit it again (an "
        "Idempotency-Key makes a resubmission safe)"
    )


def redis_unavailable(error: BaseException, doing: str = "queue the request") -> ServiceUnavailable:
    """The 503 for a Redis error: what kind of trouble and what Redis said, never the command
    or its arguments (``runtime.faults.describe``), with a ``Retry-After``."""
    unreachable = classify(error) in (Fault.CONNECTION, Fault.LOADING)
    return ServiceUnavailable(
        f"could not {doing}: {describe(error)}; retry shortly",
        retry_after_s=1 if unreachable else 2,
    )
