"""Transports: one small protocol (a :class:`Call` in, its responses out), implemented over gRPC (tritonclient aio +
a protobuf fast path) and HTTP, and the one retry policy every loop that sends again asks."""

from ._base import Json, OneResponse, Responses, Transport, server_timeout_us
from ._call import Call, OnSend, Route, TraceContext, with_trace
from ._grpc import GrpcTransport
from ._http import DEFAULT_HTTP_CONNECTIONS, HttpTransport
from ._options import TLSConfig
from ._retry import NO_RETRY, Retry, RetryPolicy, backoff_s, is_replica_failure, is_retriable, run_with_retry

__all__ = [
    "DEFAULT_HTTP_CONNECTIONS",
    "NO_RETRY",
    "Call",
    "GrpcTransport",
    "HttpTransport",
    "Json",
    "OnSend",
    "OneResponse",
    "Responses",
    "Retry",
    "RetryPolicy",
    "Route",
    "TLSConfig",
    "TraceContext",
    "Transport",
    "backoff_s",
    "is_replica_failure",
    "is_retriable",
    "run_with_retry",
    "server_timeout_us",
    "with_trace",
]
