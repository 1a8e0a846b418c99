"""The one place that translates tritonclient / gRPC / HTTP / asyncio errors into the SDK's error tree.

Classification is by exception type and status code (gRPC ``StatusCode``, HTTP status), never by message
text, with one documented exception: :func:`map_stream_error`, because per-request errors on a gRPC
bidirectional stream arrive as a bare string with no status code at all.

What Triton 2.51 answers (seen against the real server):

* unknown model: gRPC ``NOT_FOUND`` / HTTP 404 for infer, metadata and config;
* a model that exists in the repository but is unloaded: the same ``NOT_FOUND`` / 404 ("has no available
  versions"), so both become :class:`ModelNotFoundError`; statistics for either answer ``INVALID_ARGUMENT`` / 400;
* server stopped: gRPC ``UNAVAILABLE`` (the channel cannot connect), HTTP: aiohttp ``ClientConnectorError``;
* client deadline: gRPC ``DEADLINE_EXCEEDED``; a wrong input: ``INVALID_ARGUMENT`` / 400.
"""

from __future__ import annotations

import asyncio
from typing import Final

import grpc

from ._exceptions import (
    ConnectError,
    InternalServerError,
    InvalidArgumentError,
    ModelNotFoundError,
    ModelNotReadyError,
    PermissionDeniedError,
    RequestTimeout,
    SequenceError,
    SequenceLost,
    ServerUnavailable,
    TransportError,
    TritonError,
)

__all__ = ["map_error", "map_stream_error", "sequence_error"]

_GRPC: Final[dict[str, type[TritonError]]] = {
    "DEADLINE_EXCEEDED": RequestTimeout,
    "UNAVAILABLE": ServerUnavailable,
    "RESOURCE_EXHAUSTED": ServerUnavailable,
    "NOT_FOUND": ModelNotFoundError,
    "INVALID_ARGUMENT": InvalidArgumentError,
    "OUT_OF_RANGE": InvalidArgumentError,
    "FAILED_PRECONDITION": ModelNotReadyError,
    "UNAUTHENTICATED": PermissionDeniedError,
    "PERMISSION_DENIED": PermissionDeniedError,
    "ALREADY_EXISTS": InvalidArgumentError,
    "UNIMPLEMENTED": InvalidArgumentError,
    "INTERNAL": InternalServerError,
    "UNKNOWN": InternalServerError,
    "DATA_LOSS": InternalServerError,
    "ABORTED": ServerUnavailable,
}

_HTTP: Final[dict[int, type[TritonError]]] = {
    400: InvalidArgumentError,
    401: PermissionDeniedError,
    403: PermissionDeniedError,
    404: ModelNotFoundError,
    408: RequestTimeout,
    429: ServerUnavailable,
    499: RequestTimeout,
    500: InternalServerError,
    502: ServerUnavailable,
    503: ServerUnavailable,
    504: RequestTimeout,
}


def _status_name(status: object) -> str | None:
    """``grpc.StatusCode.NOT_FOUND`` / ``"StatusCode.NOT_FOUND"`` / ``"404"`` -> ``"NOT_FOUND"`` / ``"404"``."""
    if status is None:
        return None
    if isinstance(status, grpc.StatusCode):
        return str(status.name)
    text = str(status)
    return text.removeprefix("StatusCode.")


def _class_for(status: str | None) -> type[TritonError]:
    if status is None:
        return InternalServerError
    if status.isdigit():
        code = int(status)
        if code in _HTTP:
            return _HTTP[code]
        return InternalServerError if code >= 500 else InvalidArgumentError
    return _GRPC.get(status, InternalServerError)


def _http_connect_errors() -> tuple[type[BaseException], ...]:
    try:
        import aiohttp
    except ImportError:  # pragma: no cover - aiohttp comes with tritonclient[http]
        return ()
    return (aiohttp.ClientConnectionError,)


def _http_timeout_errors() -> tuple[type[BaseException], ...]:
    try:
        import aiohttp
    except ImportError:  # pragma: no cover
        return ()
    return (aiohttp.ServerTimeoutError, aiohttp.ConnectionTimeoutError)


def map_error(
    err: BaseException,
    *,
    model: str | None = None,
    version: str | None = None,
    request_id: str | None = None,
    sequence_id: int | str | None = None,
) -> TritonError:
    """Translate ``err`` into the SDK's error tree (the caller raises the result ``from err``).

    An error that already is a :class:`TritonError` is returned with missing context filled in.
    """
    ctx: dict[str, object] = {
        "model": model,
        "version": version,
        "request_id": request_id or None,
        "sequence_id": sequence_id,
    }
    if isinstance(err, TritonError):
        for key, val in ctx.items():
            if getattr(err, key, None) is None and val is not None:
                setattr(err, key, val)
        return err

    status: str | None
    message: str
    from tritonclient.utils import InferenceServerException

    if isinstance(err, InferenceServerException):
        status = _status_name(err.status())
        message = err.message() or str(err)
        if status == "CANCELLED":
            # tritonclient reports a cancelled call as an exception; the SDK lets CancelledError through
            # instead, so this only happens when the server side cancelled: treat it as unavailability.
            cls: type[TritonError] = ServerUnavailable
        else:
            cls = _class_for(status)
    elif isinstance(err, grpc.RpcError):
        code = err.code() if callable(getattr(err, "code", None)) else None
        status = _status_name(code)
        details = err.details() if callable(getattr(err, "details", None)) else None
        message = str(details) if details else f"gRPC call failed with {status}"
        cls = ServerUnavailable if status == "CANCELLED" else _class_for(status)
    elif isinstance(err, (TimeoutError, asyncio.TimeoutError, *_http_timeout_errors())):
        status = "DEADLINE_EXCEEDED"
        message = "the call ran past its deadline"
        cls = RequestTimeout
    elif isinstance(err, (*_http_connect_errors(), ConnectionError, OSError)):
        status = None
        message = f"cannot connect to the server: {err}"
        cls = ConnectError
    else:
        status = None
        message = f"{type(err).__name__}: {err}"
        cls = InternalServerError

    where = f"model {model!r}: " if model else ""
    return cls(
        f"{where}{message}",
        model=model,
        version=version,
        request_id=request_id or None,
        status=status,
        sequence_id=sequence_id,
    )


def map_stream_error(
    message: str,
    *,
    model: str | None = None,
    request_id: str | None = None,
    sequence_id: int | str | None = None,
    steps_acknowledged: int = 0,
) -> TritonError:
    """Classify a per-request error of a gRPC bidirectional stream (``ModelStreamInferResponse.error_message``).

    This is the ONE function of the package that classifies by message text: the stream carries these
    errors as bare strings with no status code, so the text is all there is. The phrases below are
    Triton 2.51's own (sequence batcher and Python backend).
    """
    ctx = {"model": model, "request_id": request_id or None, "status": None}
    where = f"model {model!r}: " if model else ""
    if "must specify a non-zero or non-empty correlation ID" in message:
        return SequenceError(f"{where}{message}", sequence_id=sequence_id, **ctx)
    lost = (
        "must specify the START flag" in message
        or "Stub process is not healthy" in message
        or "is not found" in message
        or "has no available versions" in message
    )
    # Nothing is lost before the server acknowledged a step: a failed START is the error itself.
    if sequence_id is not None and lost and steps_acknowledged > 0:
        return _lost(f"{where}{message}", sequence_id, steps_acknowledged, model, request_id)
    if "is not found" in message or "has no available versions" in message:
        return ModelNotFoundError(f"{where}{message}", sequence_id=sequence_id, **ctx)
    input_words = ("input", "shape", "data-type", "datatype", "byte size", "batch size")
    if any(w in message for w in input_words):
        return InvalidArgumentError(f"{where}{message}", sequence_id=sequence_id, **ctx)
    return InternalServerError(f"{where}{message}", sequence_id=sequence_id, **ctx)


def _lost(message: str, sequence_id: int | str, steps: int, model: str | None, request_id: str | None) -> SequenceLost:
    return SequenceLost(
        f"sequence {sequence_id!r} lost after {steps} acknowledged step(s): {message}",
        sequence_id=sequence_id,
        steps_acknowledged=steps,
        model=model,
        request_id=request_id or None,
    )


def sequence_error(
    err: TritonError,
    *,
    sequence_id: int | str,
    steps_acknowledged: int,
) -> TritonError:
    """Upgrade the error of a non-START sequence step to :class:`SequenceLost` where the server lost the sequence.

    For a unary step, a missing START (idle timeout, restart) comes back as INVALID_ARGUMENT, a reloaded or
    unloaded model as NOT_FOUND, a dead stub as INTERNAL/UNKNOWN, and a server restart as UNAVAILABLE or a
    connection failure: in every case the state the sequence built is gone. Call this only for steps after
    the first (a START step that fails has lost nothing). Timeouts stay timeouts: the step may still run.
    """
    if isinstance(err, SequenceLost | RequestTimeout):
        return err
    if isinstance(
        err, InvalidArgumentError | ModelNotFoundError | InternalServerError | SequenceError | TransportError
    ):
        lost = _lost(err.message, sequence_id, steps_acknowledged, err.model, err.request_id)
        lost.status = err.status
        lost.version = err.version
        lost.__cause__ = err
        return lost
    return err
