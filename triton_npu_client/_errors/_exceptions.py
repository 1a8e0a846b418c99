"""One exception tree for everything the SDK raises on purpose.

::

    TritonError                         base; carries model / version / request_id / status
    ├── TransportError                  could not reach the server, or got no answer
    │   ├── ConnectError                    (also ConnectionError)
    │   ├── RequestTimeout                  (also TimeoutError): client deadline or server timeout
    │   ├── ServerUnavailable               UNAVAILABLE / RESOURCE_EXHAUSTED / HTTP 503: retriable
    │   └── TLSError                        the TLS handshake was refused, either way: never retried
    ├── ServerError                     the server answered, and refused
    │   ├── ModelNotFoundError              (also LookupError)
    │   ├── ModelNotReadyError
    │   ├── InvalidArgumentError            (also ValueError): the server rejected the request
    │   ├── PermissionDeniedError           restricted protocol / missing API key
    │   ├── SequenceError                   sequence misuse the server detected
    │   │   ├── SequenceLost                the server no longer knows the sequence
    │   │   └── SequenceCapacityError       the model holds as many sequences as it can: START later
    │   └── InternalServerError             model raised, stub died, anything else
    ├── UsageError                      the SDK was used wrongly; detected before any network call
    │   ├── InputError                      (also ValueError) base of the input-builder errors
    │   │   ├── UnknownInputError
    │   │   ├── MissingInputError
    │   │   ├── DuplicateInputError
    │   │   ├── InputDtypeError             (also TypeError): dtype cannot be cast safely
    │   │   ├── InputShapeError
    │   │   └── BatchSizeError
    │   ├── UnknownOutputError              (also ValueError)
    │   ├── ClientClosedError               (also RuntimeError)
    │   ├── SequenceClosedError             (also RuntimeError): a step after END
    │   └── SequenceUsageError              (also ValueError): not a stateful model, or a bad sequence id
    └── LocalServerError                starting a local tritonserver failed
        ├── ServerBinaryNotFound            (also FileNotFoundError)
        ├── StubNotFound                    no Python-backend stub for this Python
        ├── PortInUseError                  (also OSError)
        ├── ModelLoadError                  a model in the repository failed to load
        └── ServerStartTimeout              (also TimeoutError)

Mapping from ``tritonclient`` / gRPC / HTTP errors happens in exactly one place,
:mod:`triton_npu_client._errors._classify`, by type and status code, never by message text.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "BatchSizeError",
    "ClientClosedError",
    "ConnectError",
    "DuplicateInputError",
    "InputDtypeError",
    "InputError",
    "InputShapeError",
    "InternalServerError",
    "InvalidArgumentError",
    "LocalServerError",
    "MissingInputError",
    "ModelLoadError",
    "ModelNotFoundError",
    "ModelNotReadyError",
    "PermissionDeniedError",
    "PortInUseError",
    "RequestTimeout",
    "SequenceCapacityError",
    "SequenceClosedError",
    "SequenceError",
    "SequenceLost",
    "SequenceUsageError",
    "TLSError",
    "ServerBinaryNotFound",
    "ServerError",
    "ServerStartTimeout",
    "ServerUnavailable",
    "StubNotFound",
    "TransportError",
    "TritonError",
    "JobAborted",
    "RowParseError",
    "UnknownInputError",
    "UnknownOutputError",
    "UsageError",
]


class TritonError(Exception):
    """Base of every exception the SDK raises on purpose.

    Context travels as attributes, so callers never parse the message:
    ``model``, ``version``, ``request_id``, ``status`` (a gRPC status name such as
    ``"UNAVAILABLE"`` or an HTTP status code as a string) and ``sequence_id``.
    """

    def __init__(
        self,
        message: str,
        *,
        model: str | None = None,
        version: str | None = None,
        request_id: str | None = None,
        status: str | None = None,
        sequence_id: int | str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.model = model
        self.version = version
        self.request_id = request_id
        self.status = status
        self.sequence_id = sequence_id

    def __str__(self) -> str:
        return self.message


# --- could not reach the server -------------------------------------------------------


class TransportError(TritonError):
    """The server could not be reached, or did not answer in time."""


class ConnectError(TransportError, ConnectionError):
    """No connection to the server (refused, DNS, stream broken); a refused TLS handshake is :class:`TLSError`."""


class RequestTimeout(TransportError, TimeoutError):
    """The call ran past its deadline (client-side) or Triton's request timeout."""


class ServerUnavailable(TransportError):
    """The server is up but refuses work for now (UNAVAILABLE, RESOURCE_EXHAUSTED, 503)."""


class TLSError(TransportError):
    """The TLS handshake failed: the server's certificate is not trusted, or the server refused the client's
    certificate (a wrong one, or none where mutual TLS requires one), or one side does not speak TLS.

    A configuration error that the next attempt would meet again: never retried, and not a sign that the server is
    down (it is neither a :class:`ConnectError` nor a :class:`ServerUnavailable`). ``url`` is
    ``scheme://host:port`` (None where the error did not say) and ``reason`` says which side refused, in words.
    """

    def __init__(
        self,
        message: str,
        *,
        url: str | None = None,
        reason: str = "the TLS handshake failed",
        model: str | None = None,
        version: str | None = None,
        request_id: str | None = None,
        status: str | None = None,
        sequence_id: int | str | None = None,
    ) -> None:
        super().__init__(
            message, model=model, version=version, request_id=request_id, status=status, sequence_id=sequence_id
        )
        self.url = url
        self.reason = reason


# --- the server refused ---------------------------------------------------------------


class ServerError(TritonError):
    """The server answered, and refused the request."""


class ModelNotFoundError(ServerError, LookupError):
    """The server does not know this model (or this version)."""


class ModelNotReadyError(ServerError):
    """The model exists but is not loaded or not ready."""


class InvalidArgumentError(ServerError, ValueError):
    """The server rejected the request as invalid (INVALID_ARGUMENT, HTTP 400)."""


class PermissionDeniedError(ServerError):
    """The server refused the call for lack of credentials (restricted protocol, 401/403)."""


class SequenceError(ServerError):
    """The server detected misuse of a sequence (missing START, bad correlation id, ...)."""


class SequenceLost(SequenceError):
    """The server no longer knows this sequence: idle timeout, restart, reload, stub crash.

    ``steps_acknowledged`` counts the steps the server answered before the loss.
    A lost sequence is never retried automatically: the state it built is gone.
    """

    def __init__(
        self,
        message: str,
        *,
        sequence_id: int | str | None = None,
        steps_acknowledged: int = 0,
        model: str | None = None,
        version: str | None = None,
        request_id: str | None = None,
        status: str | None = None,
    ) -> None:
        super().__init__(
            message,
            model=model,
            version=version,
            request_id=request_id,
            status=status,
            sequence_id=sequence_id,
        )
        self.steps_acknowledged = steps_acknowledged


class SequenceCapacityError(SequenceError):
    """The model refused to START a sequence: it holds its cap of live sequences. Nothing was started; try later."""


class SequenceBusyError(SequenceError):
    """The model refused a step because the sequence's previous step is still streaming; the sequence is intact.

    Steps of one sequence never overlap on the server; send the step again once the previous one has ended.
    """


class InternalServerError(ServerError):
    """Any other server-side failure: the model raised, the stub died, an internal error."""


# --- the SDK was used wrongly ---------------------------------------------------------


class UsageError(TritonError):
    """The SDK was used wrongly; raised before anything crosses the network."""


class InputError(UsageError, ValueError):
    """An input does not match the model's config. ``input_name`` names it."""

    def __init__(self, message: str, *, input_name: str | None = None, model: str | None = None) -> None:
        super().__init__(message, model=model)
        self.input_name = input_name


class UnknownInputError(InputError):
    """An input name the model does not declare."""


class MissingInputError(InputError):
    """A required (non-optional) input was not given."""


class DuplicateInputError(InputError):
    """The same input was given twice."""


class InputDtypeError(InputError, TypeError):
    """The value's dtype cannot be cast to the model's dtype without loss."""


class InputShapeError(InputError):
    """The value's shape does not match the model's dims."""


class BatchSizeError(InputError):
    """The batch dimension is missing, or larger than the model's ``max_batch_size``."""


class UnknownOutputError(UsageError, ValueError):
    """A requested output the model does not declare."""


class ClientClosedError(UsageError, RuntimeError):
    """The client (or stream) was used after ``aclose()``."""


class SequenceClosedError(UsageError, RuntimeError):
    """A step was sent on a sequence that has already ended."""


class SequenceUsageError(UsageError, ValueError):
    """A sequence was opened wrongly: the model is not stateful, or the given sequence id is invalid for it."""


class RowParseError(UsageError, ValueError):
    """A row of a scoring job's input file could not be read; the message names the line and the parse error."""


# --- a job that stopped ------------------------------------------------------------------


class JobAborted(TritonError):
    """A scoring job stopped: the server stayed unreachable past its patience. Re-run it to resume."""


# --- starting a local server ----------------------------------------------------------


class LocalServerError(TritonError):
    """Starting or running a local ``tritonserver`` failed.

    ``log_lines`` holds the server's own error lines, when there are any.
    """

    def __init__(self, message: str, *, log_lines: Sequence[str] = (), model: str | None = None) -> None:
        super().__init__(message, model=model)
        self.log_lines = tuple(log_lines)


class ServerBinaryNotFound(LocalServerError, FileNotFoundError):
    """No ``tritonserver`` binary was found in any of the places looked at."""

    def __init__(self, message: str, *, searched: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.searched = tuple(searched)


class StubNotFound(LocalServerError):
    """The bundled Python backend has no stub for the running Python version."""


class PortInUseError(LocalServerError, OSError):
    """A requested port is already taken. ``port`` names it."""

    def __init__(self, message: str, *, port: int) -> None:
        super().__init__(message)
        self.port = port


class ModelLoadError(LocalServerError):
    """A model failed to load; ``model`` names it and ``log_lines`` has the server's words."""


class ServerStartTimeout(LocalServerError, TimeoutError):
    """The server did not become ready in time."""


# --- the perf_analyzer load generator -------------------------------------------------
