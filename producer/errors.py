"""Errors the gateway answers with, each mapped to one HTTP status.

Routes and the inference service raise these; one exception handler turns them into the V2
error body ``{"error": "..."}``. Messages are written for the person who sent the request.
"""

from __future__ import annotations

INTERNAL_MESSAGE = "internal error in the gateway; see its log"
"""What a caller is told of an unexpected exception; the details go to the gateway's log."""


class GatewayError(Exception):
    status: int = 500

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        return self.message


class BadRequest(GatewayError):
    status = 400


class Unauthorized(GatewayError):
    status = 401


class Forbidden(GatewayError):
    status = 403


class NotFound(GatewayError):
    status = 404


class Conflict(GatewayError):
    status = 409


class PayloadTooLarge(GatewayError):
    status = 413


class UnsupportedMediaType(GatewayError):
    status = 415


class TooManyRequests(GatewayError):
    status = 429


class ModelFailed(GatewayError):
    """The model raised on a request the gateway had accepted as valid."""

    status = 500


class ServiceUnavailable(GatewayError):
    status = 503


class GatewayTimeout(GatewayError):
    status = 504
