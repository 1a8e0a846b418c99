"""Transports: one small protocol, implemented over gRPC (tritonclient aio + a protobuf fast path) and HTTP."""

from ._base import Json, OneResponse, OnSend, Responses, Route, Transport, server_timeout_us
from ._grpc import GrpcTransport
from ._http import DEFAULT_HTTP_CONNECTIONS, HttpTransport
from ._options import TLSConfig

__all__ = [
    "DEFAULT_HTTP_CONNECTIONS",
    "GrpcTransport",
    "HttpTransport",
    "Json",
    "OnSend",
    "OneResponse",
    "Responses",
    "Route",
    "TLSConfig",
    "Transport",
    "server_timeout_us",
]
