"""One JSON error shape for every failure of the admin API, validation errors included.

``{"error": {"code": "...", "message": "...", "details": {...}}}``; ``code`` is stable (clients
branch on it), ``message`` is for people, ``details`` carries what the code needs (the fields that
failed validation, the keys that were unreachable, ...).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: str = Field(description="Stable machine-readable code, e.g. `unauthorized`, `invalid_request`.")
    message: str = Field(description="What went wrong, for people.")
    details: dict[str, Any] = Field(default_factory=dict, description="Structured context of the error.")


class ErrorBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    error: ErrorDetail


class ApiError(Exception):
    """An error with its HTTP status and stable code; rendered as :class:`ErrorBody`."""

    def __init__(self, status: int, code: str, message: str, details: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = details or {}
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, "details": self.details}}


# Codes used by HTTP statuses that do not come from an ApiError (routing, body limits).
STATUS_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
                405: "method_not_allowed", 406: "not_acceptable", 409: "conflict", 413: "body_too_large",
                415: "unsupported_media_type", 422: "invalid_request", 429: "too_many_requests",
                500: "internal_error", 502: "bad_gateway", 503: "unavailable", 504: "timeout"}


def error_body(status: int, message: str, details: dict[str, Any] | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"code": code or STATUS_CODES.get(status, "error"), "message": message, "details": details or {}}}
