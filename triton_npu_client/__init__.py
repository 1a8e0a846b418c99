"""triton-npu-client: an async client SDK for Triton Inference Server, and the server models beside it.

One flat public namespace: everything a user needs is importable from here; modules starting with
an underscore are private.
"""

import typing as _typing

from ._errors import (
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
from ._version import (
    __version__,
)

if _typing.TYPE_CHECKING:
    from ._call import (
        USE_CLIENT_DEFAULT,
        Coalescing,
        RetryPolicy,
    )
    from ._client import (
        Client,
        ClientConfig,
        Model,
        ModelStatistics,
        RepositoryModel,
        ServerMetadata,
        SharedMemoryPool,
        SharedMemoryStats,
    )
    from ._fleet import (
        FleetOptions,
        ReplicaStatus,
    )
    from ._jobs import (
        RayScorer,
        ScoredBatch,
        ScoredRow,
        ScoreSummary,
        score,
        score_batches,
        score_rows,
        score_sync,
    )
    from ._local import (
        LocalTriton,
        default_model_repository,
        find_tritonserver,
        write_chat_model,
    )
    from ._model import (
        ControlInput,
        ModelSpec,
        SequenceSpec,
        TensorSpec,
        validate_batch,
        validate_row,
    )
    from ._sessions import (
        ChatMessage,
        ChatOptions,
        ChatReply,
        ChatSession,
        SequenceSession,
        open_chat,
        open_sequence,
    )
    from ._transport import (
        TLSConfig,
    )
    from ._wire import (
        InferRequest,
        InferResult,
    )

# Everything else loads on first use (PEP 562), so that `import triton_npu_client.server` inside a
# Triton Python-backend stub stays light: the stub's embedded interpreter must not pull in tritonclient,
# grpc or ssl just to reach the server toolkit.
_LAZY: dict[str, str] = {
    "Client": "._client",
    "ClientConfig": "._client",
    "ModelStatistics": "._client",
    "RepositoryModel": "._client",
    "ServerMetadata": "._client",
    "SharedMemoryPool": "._client",
    "SharedMemoryStats": "._client",
    "Coalescing": "._call",
    "FleetOptions": "._fleet",
    "ReplicaStatus": "._fleet",
    "LocalTriton": "._local",
    "default_model_repository": "._local",
    "find_tritonserver": "._local",
    "write_chat_model": "._local",
    "Model": "._client",
    "USE_CLIENT_DEFAULT": "._call",
    "TLSConfig": "._transport",
    "InferRequest": "._wire",
    "InferResult": "._wire",
    "RetryPolicy": "._call",
    "SequenceSession": "._sessions",
    "open_sequence": "._sessions",
    "ChatMessage": "._sessions",
    "ChatOptions": "._sessions",
    "ChatReply": "._sessions",
    "ChatSession": "._sessions",
    "open_chat": "._sessions",
    "ScoredBatch": "._jobs",
    "ScoredRow": "._jobs",
    "ScoreSummary": "._jobs",
    "score": "._jobs",
    "score_batches": "._jobs",
    "score_rows": "._jobs",
    "score_sync": "._jobs",
    "RayScorer": "._jobs",
    "ControlInput": "._model",
    "ModelSpec": "._model",
    "SequenceSpec": "._model",
    "TensorSpec": "._model",
    "validate_batch": "._model",
    "validate_row": "._model",
}


def __getattr__(name: str) -> _typing.Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "BatchSizeError",
    "ChatBusyError",
    "ChatHistoryMismatch",
    "ChatMessage",
    "ChatMessageError",
    "ChatOptionError",
    "ChatOptions",
    "ChatReply",
    "ChatSession",
    "CheckpointFilesMismatch",
    "CheckpointMismatch",
    "Client",
    "ClientClosedError",
    "ClientConfig",
    "Coalescing",
    "ConnectError",
    "ControlInput",
    "DuplicateInputError",
    "FleetOptions",
    "InferRequest",
    "InferResult",
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
    "LocalTriton",
    "MissingInputError",
    "Model",
    "ModelLoadError",
    "ModelNotFoundError",
    "ModelNotReadyError",
    "ModelSpec",
    "ModelStatistics",
    "OutputExistsError",
    "OutputFolderError",
    "PermissionDeniedError",
    "PortInUseError",
    "RayScorer",
    "ReplicaStatus",
    "RepositoryModel",
    "RequestTimeout",
    "ResumeNotConfirmed",
    "RetryPolicy",
    "RowParseError",
    "SameFileError",
    "ScoreSummary",
    "ScoredBatch",
    "ScoredRow",
    "SequenceBusyError",
    "SequenceCapacityError",
    "SequenceClosedError",
    "SequenceError",
    "SequenceIdleWarning",
    "SequenceLost",
    "SequenceSession",
    "SequenceSpec",
    "SequenceUsageError",
    "ServerBinaryNotFound",
    "ServerError",
    "ServerMetadata",
    "ServerStartTimeout",
    "ServerUnavailable",
    "SharedMemoryPool",
    "SharedMemoryStats",
    "StubNotFound",
    "TLSConfig",
    "TLSError",
    "TensorSpec",
    "TransportError",
    "TritonError",
    "USE_CLIENT_DEFAULT",
    "UnknownFormatError",
    "UnknownInputError",
    "UnknownOutputError",
    "UsageError",
    "__version__",
    "default_model_repository",
    "find_tritonserver",
    "open_chat",
    "open_sequence",
    "score",
    "score_batches",
    "score_rows",
    "score_sync",
    "validate_batch",
    "validate_row",
    "write_chat_model",
]
