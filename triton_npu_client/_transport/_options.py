"""TLS material for ``grpcs://`` and ``https://`` connections."""

from __future__ import annotations

import os
import ssl
from pathlib import Path

import attrs

__all__ = ["TLSConfig"]


def _read(path: str | os.PathLike[str] | None) -> bytes | None:
    return Path(path).read_bytes() if path is not None else None


@attrs.frozen(kw_only=True)
class TLSConfig:
    """TLS material for ``grpcs://`` and ``https://`` URLs: file paths (PEM).

    ``ca_file`` verifies the server (system roots when None); ``cert_file`` + ``key_file`` authenticate the
    client (mutual TLS). ``server_name`` overrides the name checked in the server certificate.
    Triton's own TLS is gRPC only; ``https://`` is for a TLS-terminating gateway in front of it (docs/security.md).
    A handshake refused either way (server certificate not trusted, client certificate refused or missing) raises
    :class:`~triton_npu_client.TLSError`, never retried. The repr shows the paths only; no key is ever read into one.
    """

    ca_file: str | None = attrs.field(default=None, converter=attrs.converters.optional(os.fspath))
    cert_file: str | None = attrs.field(default=None, converter=attrs.converters.optional(os.fspath))
    key_file: str | None = attrs.field(default=None, converter=attrs.converters.optional(os.fspath))
    server_name: str | None = None

    def grpc_credentials(self) -> object:
        """``grpc.ChannelCredentials`` built from the files (read now: call this outside the event loop's hot path)."""
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file),
            private_key=_read(self.key_file),
            certificate_chain=_read(self.cert_file),
        )

    def ssl_context(self) -> ssl.SSLContext:
        """An ``ssl.SSLContext`` for HTTPS."""
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file is not None:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx
