"""Transports: one small protocol, implemented over gRPC (tritonclient aio + a protobuf fast path) and HTTP."""

from ._base import Transport
from ._grpc import GrpcTransport
from ._http import HttpTransport
from ._options import TLSConfig

__all__ = ["GrpcTransport", "HttpTransport", "TLSConfig", "Transport"]
