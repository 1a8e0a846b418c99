"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status that goes with it.

Every failure a handler meets ends as one :class:`APIError`: a caller's mistake found by the gateway's own checks, or
an SDK error (:func:`from_sdk`) mapped to the status an OpenAI client expects (400 invalid, 404 unknown, 409 a chain
whose turn is still running, 429/503 at capacity with ``Retry-After``, 504 on timeout). The message never quotes an
API key; it names the parameter, what was expected and what was given.
"""

from __future__ import annotations

from typing import Any, Final

from .._errors import (
    ChatBusyError,
    ChatMessageError,
    ChatOptionError,
    ConnectError,
    InputError,
    InvalidArgumentError,
    ModelNotFoundError,
    ModelNotReadyError,
    RequestTimeout,
    SequenceBusyError,
    SequenceCapacityError,
    ServerUnavailable,
    TritonError,
    UsageError,
)

__all__ = ["APIError", "from_sdk", "invalid", "kind_of", "refused", "shown"]

#: Seconds a client is told to wait after a capacity refusal (the ``Retry-After`` header).
RETRY_AFTER_S: Final = 1


class APIError(Exception):
    """One failed request: the status, OpenAI's error fields and any extra headers (``Retry-After``)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str | None, message: str, *, code: str | None = "invalid_value") -> APIError:
    """A 400 for a value the gateway refuses: ``message`` says what was expected and what was given."""
    return APIError(400, message, param=param, code=code)


def refused(param: str, what: str) -> APIError:
    """A 400 for a parameter this gateway does not implement: refused, never silently ignored."""
    return APIError(
        400,
        f"{param}: {what} is not supported by this server (triton-npu openai); remove it from the request",
        param=param,
        code="unsupported_parameter",
    )


def busy(message: str) -> APIError:
    return APIError(
        429, message, type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)}
    )


def from_sdk(err: TritonError, *, param: str | None = None) -> APIError:
    """The status and fields for an error the SDK raised while serving a request."""
    text = str(err)
    if isinstance(err, ChatOptionError):
        return invalid(getattr(err, "option", None) or param, text)
    if isinstance(err, ChatMessageError | InputError):
        return invalid(param or "messages", text)
    if isinstance(err, ChatBusyError | SequenceBusyError):
        return APIError(409, text, code="conversation_busy")
    if isinstance(err, ModelNotFoundError):
        return APIError(404, text, param="model", code="model_not_found")
    if isinstance(err, RequestTimeout):
        return APIError(504, text, type="timeout_error", code="timeout")
    if isinstance(err, SequenceCapacityError):
        return APIError(
            503, text, type="server_error", code="server_at_capacity", headers={"Retry-After": str(RETRY_AFTER_S)}
        )
    if isinstance(err, ServerUnavailable | ConnectError | ModelNotReadyError):
        return APIError(
            503, text, type="server_error", code="server_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)}
        )
    if isinstance(err, InvalidArgumentError | UsageError):
        return invalid(param, text)
    return APIError(500, text, type="server_error", code="server_error")


def kind_of(value: object) -> str:
    """A JSON value's kind as an error message says it ("a string", "an array", "null")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def shown(value: object) -> str:
    """A given value as an error message quotes it: its repr, cut at 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
