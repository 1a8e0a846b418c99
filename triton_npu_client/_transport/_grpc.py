"""gRPC transport: tritonclient's aio client for admin calls, the generated stub for inference.

Inference skips tritonclient's per-call work (building ``InferInput`` objects, re-encoding parameters): an
:class:`InferRequest` already holds the ``ModelInferRequest`` protobuf, which goes straight to
``GRPCInferenceServiceStub.ModelInfer``. The channel, stub and call metadata are public so the stream
multiplexer can open ``ModelStreamInfer`` on the same connection.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Final

import grpc
import tritonclient.grpc.aio as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc

from .._errors import ConnectError, ServerUnavailable
from .._errors._classify import map_error
from .._wire import InferRequest, InferResult
from ._base import Json, server_timeout_us
from ._options import TLSConfig
from ._stream import StreamMultiplexer

__all__ = ["DEFAULT_CHANNEL_OPTIONS", "GrpcTransport"]

_log = logging.getLogger("triton_npu_client.grpc")

_INT32_MAX: Final = 2**31 - 1

# tritonclient's own defaults (2 GB messages; keepalive as KeepAliveOptions()). tritonclient REPLACES them
# all when any channel_args are given; this transport merges the caller's options over them instead.
DEFAULT_CHANNEL_OPTIONS: Final[Mapping[str, Any]] = {
    "grpc.max_send_message_length": _INT32_MAX,
    "grpc.max_receive_message_length": _INT32_MAX,
    "grpc.keepalive_time_ms": _INT32_MAX,
    "grpc.keepalive_timeout_ms": 20000,
    "grpc.keepalive_permit_without_calls": False,
    "grpc.http2.max_pings_without_data": 2,
}


class GrpcTransport:
    """One gRPC channel to ``target`` (``host:port``)."""

    protocol: Final = "grpc"

    def __init__(
        self,
        target: str,
        *,
        headers: Mapping[str, str] | None = None,
        tls: TLSConfig | None = None,
        channel_options: Mapping[str, Any] | Sequence[tuple[str, Any]] | None = None,
    ) -> None:
        self.target = target
        self._headers = dict(headers or {})
        # gRPC metadata keys must be lowercase.
        self._metadata: tuple[tuple[str, str], ...] = tuple((k.lower(), v) for k, v in self._headers.items())
        merged = dict(DEFAULT_CHANNEL_OPTIONS)
        merged.update(dict(channel_options or {}))
        if tls is not None and tls.server_name:
            merged["grpc.ssl_target_name_override"] = tls.server_name
        self.channel_options: tuple[tuple[str, Any], ...] = tuple(merged.items())
        creds = tls.grpc_credentials() if tls is not None else None
        if creds is not None:
            self._channel = grpc.aio.secure_channel(target, creds, options=self.channel_options)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=self.channel_options)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        self._mux: StreamMultiplexer | None = None
        self._admin = grpcclient.InferenceServerClient(target, creds=creds, channel_args=list(self.channel_options))

    def __repr__(self) -> str:
        return f"<GrpcTransport {self.target}>"

    # -- for the stream multiplexer -----------------------------------------------------------------

    @property
    def channel(self) -> grpc.aio.Channel:
        """The ``grpc.aio.Channel`` inference runs on."""
        return self._channel

    @property
    def stub(self) -> service_pb2_grpc.GRPCInferenceServiceStub:
        """The generated ``GRPCInferenceServiceStub`` on :attr:`channel`."""
        return self._stub

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata (the client's headers) as lowercase ``(key, value)`` pairs."""
        return self._metadata

    # -- errors -------------------------------------------------------------------------------------

    def _map(self, err: BaseException, **ctx: Any) -> Exception:
        mapped = map_error(err, **ctx)
        # UNAVAILABLE also means "restricted protocol" or "shutting down"; only the channel's own state says
        # whether there was no connection at all (not the message text).
        if type(mapped) is ServerUnavailable:
            state = self._channel.get_state(try_to_connect=False)
            if state in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.IDLE):
                return ConnectError(
                    mapped.message,
                    model=mapped.model,
                    version=mapped.version,
                    request_id=mapped.request_id,
                    status=mapped.status,
                    sequence_id=mapped.sequence_id,
                )
        return mapped

    # -- inference ----------------------------------------------------------------------------------

    async def infer(
        self,
        request: InferRequest,
        *,
        timeout_s: float | None,
        request_id: str = "",
        sequence_id: int | str | None = None,
        sequence_start: bool = False,
        sequence_end: bool = False,
    ) -> InferResult:
        """Send the prebuilt protobuf; the deadline is also Triton's server-side ``timeout`` parameter."""
        proto = request.to_grpc(
            request_id=request_id,
            sequence_id=sequence_id,
            sequence_start=sequence_start,
            sequence_end=sequence_end,
            timeout_us=server_timeout_us(timeout_s, sequence_id),
        )
        try:
            # Cancelling the awaiting task cancels this call: grpc.aio turns CancelledError into an RPC cancel.
            response = await self._stub.ModelInfer(proto, metadata=self._metadata, timeout=timeout_s)
        except grpc.RpcError as err:
            raise self._map(
                err, model=request.model, version=request.version, request_id=request_id, sequence_id=sequence_id
            ) from err
        return InferResult.from_grpc(response)

    # -- admin (tritonclient) -----------------------------------------------------------------------

    async def _call(self, coro: Any, **ctx: Any) -> Any:
        from tritonclient.utils import InferenceServerException

        try:
            return await coro
        except (InferenceServerException, grpc.RpcError) as err:
            raise self._map(err, **ctx) from err

    async def is_server_live(self, *, timeout_s: float | None) -> bool:
        return bool(await self._call(self._admin.is_server_live(headers=self._headers, client_timeout=timeout_s)))

    async def is_server_ready(self, *, timeout_s: float | None) -> bool:
        return bool(await self._call(self._admin.is_server_ready(headers=self._headers, client_timeout=timeout_s)))

    async def is_model_ready(self, name: str, version: str, *, timeout_s: float | None) -> bool:
        coro = self._admin.is_model_ready(name, version, headers=self._headers, client_timeout=timeout_s)
        return bool(await self._call(coro, model=name, version=version or None))

    async def server_metadata(self, *, timeout_s: float | None) -> Json:
        coro = self._admin.get_server_metadata(headers=self._headers, as_json=True, client_timeout=timeout_s)
        return dict(await self._call(coro))

    async def model_metadata(self, name: str, version: str, *, timeout_s: float | None) -> Json:
        coro = self._admin.get_model_metadata(
            name, version, headers=self._headers, as_json=True, client_timeout=timeout_s
        )
        return dict(await self._call(coro, model=name, version=version or None))

    async def model_config(self, name: str, version: str, *, timeout_s: float | None) -> Json:
        coro = self._admin.get_model_config(
            name, version, headers=self._headers, as_json=True, client_timeout=timeout_s
        )
        answer = await self._call(coro, model=name, version=version or None)
        return dict(answer.get("config", answer))

    async def repository_index(self, *, timeout_s: float | None) -> list[Json]:
        coro = self._admin.get_model_repository_index(headers=self._headers, as_json=True, client_timeout=timeout_s)
        answer = await self._call(coro)
        return [dict(m) for m in answer.get("models", ())]

    async def load_model(self, name: str, *, timeout_s: float | None) -> None:
        await self._call(self._admin.load_model(name, headers=self._headers, client_timeout=timeout_s), model=name)

    async def unload_model(self, name: str, *, timeout_s: float | None) -> None:
        await self._call(self._admin.unload_model(name, headers=self._headers, client_timeout=timeout_s), model=name)

    async def inference_statistics(self, name: str, version: str, *, timeout_s: float | None) -> list[Json]:
        coro = self._admin.get_inference_statistics(
            name, version, headers=self._headers, as_json=True, client_timeout=timeout_s
        )
        answer = await self._call(coro, model=name, version=version or None)
        return [dict(m) for m in answer.get("model_stats", ())]

    def multiplexer(self, *, streams: int = 1) -> StreamMultiplexer:
        """The stream multiplexer on this channel: made on first use, closed with the transport."""
        if self._mux is None or self._mux.is_closed:
            self._mux = StreamMultiplexer(self._channel, streams=streams, metadata=self._metadata)
        return self._mux

    async def aclose(self) -> None:
        """Close the multiplexer (pending steps fail with ClientClosedError) and both channels; idempotent."""
        try:
            if self._mux is not None:
                await self._mux.aclose()
            await self._admin.close()
        finally:
            await self._channel.close()


# Re-exported for the stream multiplexer's type hints.
ModelInferRequest = service_pb2.ModelInferRequest
