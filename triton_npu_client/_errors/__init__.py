"""Errors: the one tree (``_exceptions``, which draws it) and the one classifier that maps wire failures into it
(``_classify``).

The tree loads with the package; the classifier (which imports grpc) loads on first use of one of its names, so
that the server toolkit inside Triton's stub, which imports the package, never pulls in grpc.
"""

import typing as _typing

from ._exceptions import (
    BatchSizeError,
    ChatBusyError,
    ChatHistoryMismatch,
    ChatMessageError,
    ChatOptionError,
    CheckpointFilesMismatch,
    CheckpointMismatch,
    ClientClosedError,
    ConnectError,
    DuplicateInputError,
    InputDtypeError,
    InputError,
    InputFileError,
    InputFileNotFound,
    InputShapeError,
    InternalServerError,
    InvalidArgumentError,
    JobAborted,
    JobPathError,
    LocalServerError,
    MissingInputError,
    ModelLoadError,
    ModelNotFoundError,
    ModelNotReadyError,
    OutputExistsError,
    OutputFolderError,
    PermissionDeniedError,
    PortInUseError,
    RequestTimeout,
    ResumeNotConfirmed,
    RowParseError,
    SameFileError,
    SequenceBusyError,
    SequenceCapacityError,
    SequenceClosedError,
    SequenceError,
    SequenceIdleWarning,
    SequenceLost,
    SequenceUsageError,
    ServerBinaryNotFound,
    ServerError,
    ServerStartTimeout,
    ServerUnavailable,
    StubNotFound,
    TLSError,
    TransportError,
    TritonError,
    UnknownFormatError,
    UnknownInputError,
    UnknownOutputError,
    UsageError,
)

if _typing.TYPE_CHECKING:
    from ._classify import (
        StepVerdict,
        judge_step,
        map_error,
        map_stream_error,
    )

_CLASSIFY = frozenset({"StepVerdict", "judge_step", "map_error", "map_stream_error"})


def __getattr__(name: str) -> _typing.Any:
    if name not in _CLASSIFY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import _classify

    value = getattr(_classify, name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


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
    "StepVerdict",
    "StubNotFound",
    "TLSError",
    "TransportError",
    "TritonError",
    "UnknownFormatError",
    "UnknownInputError",
    "UnknownOutputError",
    "UsageError",
    "judge_step",
    "map_error",
    "map_stream_error",
]
