"""One exception tree for everything the SDK raises on purpose.

::

    TritonError                         base; carries model / version / request_id / status / sequence_id
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
    │   │   ├── SequenceCapacityError       the model holds as many sequences as it can: START later
    │   │   └── SequenceBusyError           the sequence's previous step still streams on the server
    │   └── InternalServerError             model raised, stub died, anything else
    │       └── ChatHistoryMismatch         a chat's two sides disagree on the conversation (never expected)
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
    │   ├── SequenceUsageError              (also ValueError): not a stateful model, or a bad sequence id
    │   ├── ChatOptionError                 (also ValueError): a chat option the model cannot take
    │   ├── ChatMessageError                (also ValueError): a malformed chat message
    │   ├── ChatBusyError                   (also RuntimeError): a turn while another of the chat streams
    │   ├── RowParseError                   (also ValueError): a scoring job's input row could not be read
    │   ├── JobPathError                    (also ValueError): a scoring job's path cannot be used
    │   │   ├── InputFileError                  the input cannot be read as rows
    │   │   │   └── InputFileNotFound           (also FileNotFoundError)
    │   │   ├── UnknownFormatError              a format not known from the suffix, or not one the job handles
    │   │   ├── SameFileError                   two of the job's paths are one file (the input among them)
    │   │   ├── OutputExistsError               (also FileExistsError): a file the job did not write
    │   │   ├── OutputFolderError               the folder is missing or not writable
    │   │   └── ResumeNotConfirmed              an in-memory source met a checkpoint: resume=True or overwrite
    │   └── CheckpointMismatch              (also RuntimeError): the checkpoint belongs to another job
    │       └── CheckpointFilesMismatch         the checkpoint disagrees with the files it describes
    ├── JobAborted                      a scoring job stopped: the server stayed unreachable past its patience
    └── LocalServerError                starting a local tritonserver failed
        ├── ServerBinaryNotFound            (also FileNotFoundError)
        ├── StubNotFound                    no Python-backend stub for this Python
        ├── PortInUseError                  (also OSError)
        ├── ModelLoadError                  a model in the repository failed to load
        └── ServerStartTimeout              (also TimeoutError)

    SequenceIdleWarning (a UserWarning, not an error): a sequence step leaves later than the model's idle timeout

Every public exception of the package is defined here (``tests/test_errors.py`` checks it), whichever layer
raises it: the sessions raise the chat errors, the scoring jobs the path and checkpoint errors.

Mapping from ``tritonclient`` / gRPC / HTTP errors happens in exactly one place,
:mod:`triton_npu_client._errors._classify`, by type and status code, never by message text.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "BatchSizeError",
    "ChatBusyError",
    "ChatHistoryMismatch",
    "ChatMessageError",
    "ChatOptionError",
    "CheckpointFilesMismatch",
    "CheckpointMismatch",
    "ClientClosedError",
    "ConnectError",
    "DuplicateInputError",
    "InputDtypeError",
    "InputError",
    "InputFileError",
    "InputFileNotFound",
    "InputShapeError",
    "InternalServerError",
    "InvalidArgumentError",
    "JobAborted",
    "JobPathError",
    "LocalServerError",
    "MissingInputError",
    "ModelLoadError",
    "ModelNotFoundError",
    "ModelNotReadyError",
    "OutputExistsError",
    "OutputFolderError",
    "PermissionDeniedError",
    "PortInUseError",
    "RequestTimeout",
    "ResumeNotConfirmed",
    "RowParseError",
    "SameFileError",
    "SequenceBusyError",
    "SequenceCapacityError",
    "SequenceClosedError",
    "SequenceError",
    "SequenceIdleWarning",
    "SequenceLost",
    "SequenceUsageError",
    "ServerBinaryNotFound",
    "ServerError",
    "ServerStartTimeout",
    "ServerUnavailable",
    "StubNotFound",
    "TLSError",
    "TransportError",
    "TritonError",
    "UnknownFormatError",
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


class ChatHistoryMismatch(InternalServerError):
    """A turn's final response carried a history digest other than the client's: the two sides disagree on the
    conversation (it should never happen). The turn is not committed; the next turn, sent with the digest the
    client holds, makes the server roll that turn back too, so the chat goes on.

    ``expected`` is the digest the client computed, ``given`` the server's.
    """

    def __init__(self, message: str, *, expected: str, given: str, model: str | None = None,
                 sequence_id: int | str | None = None) -> None:
        super().__init__(message, model=model, sequence_id=sequence_id)
        self.expected = expected
        self.given = given


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


class ChatOptionError(UsageError, ValueError):
    """A chat option has a value the model cannot take; raised before anything is sent.

    ``option`` names it, ``expected`` says what it takes and ``given`` is the value given.
    """

    def __init__(self, option: str, expected: str, given: object, *, model: str | None = None) -> None:
        super().__init__(f"chat option {option!r}: expected {expected}, given {given!r}", model=model)
        self.option = option
        self.expected = expected
        self.given = given


class ChatMessageError(UsageError, ValueError):
    """A chat message is malformed (unknown role, text not a str); raised before anything is sent."""


class ChatBusyError(UsageError, RuntimeError):
    """A turn was started while another turn of the same chat still streams; nothing was sent or queued."""


class RowParseError(UsageError, ValueError):
    """A row of a scoring job's input file could not be read; the message names the line and the parse error."""


class JobPathError(UsageError, ValueError):
    """A path a scoring job was given cannot be used. ``path``: the path; ``role``: input, output, errors, ..."""

    def __init__(self, message: str, *, path: str | os.PathLike[str] | None = None, role: str | None = None) -> None:
        super().__init__(message)
        self.path = None if path is None else Path(path)
        self.role = role


class InputFileError(JobPathError):
    """The input file cannot be read as rows: unreadable, a directory, or not of its format (a CSV without header)."""


class InputFileNotFound(InputFileError, FileNotFoundError):
    """The input file does not exist."""


class UnknownFormatError(JobPathError):
    """A file's format is not known from its suffix, or the format given is not one the job reads or writes.

    ``role`` says which: ``"input"`` or ``"output"``.
    """


class SameFileError(JobPathError):
    """Two of the job's paths name the same file: an output path is the input (also through a link), or two of
    output, errors and checkpoint coincide. ``other_role`` names the second."""

    def __init__(
        self, message: str, *, path: str | os.PathLike[str] | None = None, role: str | None = None,
        other_role: str | None = None,
    ) -> None:
        super().__init__(message, path=path, role=role)
        self.other_role = other_role


class OutputExistsError(JobPathError, FileExistsError):
    """An output, errors or checkpoint path holds something the job did not write (a file without this job's
    checkpoint, a symlink, a directory): refused unless ``overwrite=True`` (``--overwrite``)."""


class OutputFolderError(JobPathError):
    """The folder of an output, errors or checkpoint path does not exist, or the job may not write in it."""


class ResumeNotConfirmed(JobPathError):
    """An in-memory source (an iterable) met an existing checkpoint: the job cannot tell whether the iterable yields
    the rows it had, so it resumes only with ``resume=True``, and starts over only with ``overwrite=True``."""


class CheckpointMismatch(UsageError, RuntimeError):
    """The checkpoint beside the output belongs to another job (its fingerprint: the input file and options)."""


class CheckpointFilesMismatch(CheckpointMismatch):
    """The checkpoint disagrees with the files it describes (an output missing or shorter than the bytes it
    committed, a row count that does not fit the bytes): restore the files, or delete the checkpoint to start over."""


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



# --- warnings -------------------------------------------------------------------------


class SequenceIdleWarning(UserWarning):
    """A sequence step comes later than the model's idle timeout after the previous answer: it may be lost."""
