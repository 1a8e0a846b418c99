"""triton-npu-client: an async client SDK for Triton Inference Server, and the server models beside it.

One flat public namespace: everything a user needs is importable from here; modules starting with
an underscore are private.
"""

import typing as _typing

from ._exceptions import (
    BatchSizeError,
    ClientClosedError,
    ConnectError,
    DuplicateInputError,
    InputDtypeError,
    InputError,
    InputShapeError,
    InternalServerError,
    InvalidArgumentError,
    LocalServerError,
    MissingInputError,
    ModelLoadError,
    ModelNotFoundError,
    ModelNotReadyError,
    PerfAnalyzerError,
    PerfAnalyzerUnavailable,
    PermissionDeniedError,
    PortInUseError,
    RequestTimeout,
    SequenceClosedError,
    SequenceError,
    SequenceLost,
    SequenceUsageError,
    ServerBinaryNotFound,
    ServerError,
    ServerStartTimeout,
    ServerUnavailable,
    StubNotFound,
    TransportError,
    TritonError,
    UnknownInputError,
    UnknownOutputError,
    UsageError,
)
from ._version import (
    __version__,
)

if _typing.TYPE_CHECKING:
    from ._client import (
        Client,
        ClientConfig,
        ModelStatistics,
        RepositoryModel,
        ServerMetadata,
    )
    from ._coalesce import (
        Coalescing,
    )
    from ._local import (
        LocalTriton,
        default_model_repository,
        find_tritonserver,
    )
    from ._model import (
        Model,
    )
    from ._options import (
        USE_CLIENT_DEFAULT,
        TLSConfig,
    )
    from ._perfanalyzer import (
        PerfAnalyzer,
        PerfResult,
        arun_perf_analyzer,
        ensure_perf_analyzer,
        run_perf_analyzer,
    )
    from ._request import (
        InferRequest,
        InferResult,
    )
    from ._retry import (
        RetryPolicy,
    )
    from ._sequence import (
        SequenceIdleWarning,
        SequenceSession,
        open_sequence,
    )
    from ._spec import (
        ControlInput,
        ModelSpec,
        SequenceSpec,
        TensorSpec,
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
    "Coalescing": "._coalesce",
    "LocalTriton": "._local",
    "default_model_repository": "._local",
    "find_tritonserver": "._local",
    "Model": "._model",
    "USE_CLIENT_DEFAULT": "._options",
    "TLSConfig": "._options",
    "PerfAnalyzer": "._perfanalyzer",
    "PerfResult": "._perfanalyzer",
    "arun_perf_analyzer": "._perfanalyzer",
    "ensure_perf_analyzer": "._perfanalyzer",
    "run_perf_analyzer": "._perfanalyzer",
    "InferRequest": "._request",
    "InferResult": "._request",
    "RetryPolicy": "._retry",
    "SequenceIdleWarning": "._sequence",
    "SequenceSession": "._sequence",
    "open_sequence": "._sequence",
    "ControlInput": "._spec",
    "ModelSpec": "._spec",
    "SequenceSpec": "._spec",
    "TensorSpec": "._spec",
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
    "Client",
    "ClientClosedError",
    "ClientConfig",
    "Coalescing",
    "ConnectError",
    "ControlInput",
    "DuplicateInputError",
    "InferRequest",
    "InferResult",
    "InputDtypeError",
    "InputError",
    "InputShapeError",
    "InternalServerError",
    "InvalidArgumentError",
    "LocalServerError",
    "LocalTriton",
    "MissingInputError",
    "Model",
    "ModelLoadError",
    "ModelNotFoundError",
    "ModelNotReadyError",
    "ModelSpec",
    "ModelStatistics",
    "PerfAnalyzer",
    "PerfAnalyzerError",
    "PerfAnalyzerUnavailable",
    "PerfResult",
    "PermissionDeniedError",
    "PortInUseError",
    "RepositoryModel",
    "RequestTimeout",
    "RetryPolicy",
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
    "StubNotFound",
    "TLSConfig",
    "TensorSpec",
    "TransportError",
    "TritonError",
    "USE_CLIENT_DEFAULT",
    "UnknownInputError",
    "UnknownOutputError",
    "UsageError",
    "__version__",
    "arun_perf_analyzer",
    "default_model_repository",
    "ensure_perf_analyzer",
    "find_tritonserver",
    "open_sequence",
    "run_perf_analyzer",
]
