"""gRPC transport: one channel, tritonclient's generated stub and protobufs for every call.

Inference skips tritonclient's per-call work (``InferInput`` objects, a request protobuf built per call): it
sends :meth:`InferRequest.grpc_bytes`, the request's serialised ``ModelInferRequest``. Admin calls go through the
same stub on the same channel (tritonclient's aio client would open a second channel) and come back as JSON-like
dicts, the same shape tritonclient's ``as_json=True`` gives, with fields at their protobuf default spelled out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

import grpc
from google.protobuf import json_format
from tritonclient.grpc import service_pb2, service_pb2_grpc

from .._errors import ClientClosedError, ConnectError, ServerUnavailable, TritonError, UsageError, map_error
from .._trace import AVAILABLE as TRACING
from .._trace import grpc_metadata
from .._wire import InferResult
from ._base import Json, OneResponse, Responses, server_timeout_us
from ._call import Call, with_trace
from ._options import TLSConfig
from ._stream import METHOD, Outgoing, OwnStreamCall, StreamMultiplexer

__all__ = ["DEFAULT_CHANNEL_OPTIONS", "GrpcTransport"]

_log = logging.getLogger("triton_npu_client.grpc")

_INT32_MAX: Final = 2**31 - 1
_PING_TIMEOUT: Final = "grpc.http2.ping_timeout_ms"

# Merged under the caller's channel options (tritonclient replaces all its defaults when any are given).
# Keepalive: a long-lived stream on a half-open connection would otherwise wait forever; a ping every 20 s
# that is not answered within 10 s fails the connection, so pending requests fail and the next one reconnects.
# At most 2 pings without data: Triton's default policy (5 min between data-less pings, 2 strikes) never
# answers an idle client's pings with GOAWAY.
DEFAULT_CHANNEL_OPTIONS: Final[Mapping[str, Any]] = {
    "grpc.max_send_message_length": _INT32_MAX,
    "grpc.max_receive_message_length": _INT32_MAX,
    "grpc.keepalive_time_ms": 20_000,
    "grpc.keepalive_timeout_ms": 10_000,
    "grpc.keepalive_permit_without_calls": 0,
    "grpc.http2.max_pings_without_data": 2,
}


def _to_dict(message: Any) -> Json:
    return dict(
        json_format.MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    )


class _UnaryCall(OneResponse):
    """One ``ModelInfer`` RPC: the one response, sent when first awaited."""

    __slots__ = ("_call", "_metadata", "_payload", "_transport")

    def __init__(
        self, transport: GrpcTransport, call: Call, payload: bytes, metadata: tuple[tuple[str, str], ...]
    ) -> None:
        super().__init__()
        self._transport = transport
        self._call = call
        self._payload = payload
        self._metadata = metadata

    async def _send(self) -> InferResult:
        call = self._call
        if call.on_send is not None:
            call.on_send()
        transport = self._transport
        try:
            # Cancelling the awaiting task cancels this call: grpc.aio turns CancelledError into an RPC cancel.
            response = await transport._infer(self._payload, metadata=self._metadata, timeout=call.timeout_s)
        except grpc.RpcError as err:
            request = call.request
            raise transport._map(
                err,
                model=request.model,
                version=request.version or None,
                request_id=call.request_id,
                sequence_id=call.sequence_id,
            ) from err
        return InferResult.from_grpc(response)


class GrpcTransport:
    """One gRPC channel to ``target`` (``host:port``); ``streams`` long-lived streams for the shared route."""

    protocol: Final = "grpc"
    can_stream: Final = True

    def __init__(
        self,
        target: str,
        *,
        headers: Mapping[str, str] | None = None,
        tls: TLSConfig | None = None,
        channel_options: Mapping[str, Any] | Sequence[tuple[str, Any]] | None = None,
        streams: int = 1,
    ) -> None:
        if streams < 1:
            raise UsageError(f"streams must be >= 1, got {streams}")
        self.target = target
        # gRPC metadata keys must be lowercase.
        self._metadata: tuple[tuple[str, str], ...] = tuple((k.lower(), v) for k, v in dict(headers or {}).items())
        merged = dict(DEFAULT_CHANNEL_OPTIONS)
        merged.update(dict(channel_options or {}))
        # grpc core (seen with grpcio 1.85) fails a connection on an unanswered ping, keepalive's included, only
        # after grpc.http2.ping_timeout_ms (60 s unless set), whatever keepalive_timeout_ms says: tie the two so
        # the keepalive timeout in force is the one given.
        merged.setdefault(_PING_TIMEOUT, merged["grpc.keepalive_timeout_ms"])
        if tls is not None and tls.server_name:
            merged["grpc.ssl_target_name_override"] = tls.server_name
        self.channel_options: tuple[tuple[str, Any], ...] = tuple(merged.items())
        creds = tls.grpc_credentials() if tls is not None else None
        # Triton refuses a client certificate by closing the connection without a TLS alert: only knowing that the
        # channel is TLS tells that apart from a plain server hanging up (see map_error).
        self._tls_url = f"grpcs://{target}" if creds is not None else None
        if creds is not None:
            self._channel = grpc.aio.secure_channel(target, creds, options=self.channel_options)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=self.channel_options)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        # Inference sends bytes assembled by InferRequest.grpc_bytes (no protobuf object per call).
        self._infer = self._channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=None,
            response_deserializer=service_pb2.ModelInferResponse.FromString,
        )
        self._own_stream = self._channel.stream_stream(
            METHOD, request_serializer=None, response_deserializer=service_pb2.ModelStreamInferResponse.FromString
        )
        self._credentials = creds  # kept for blocking_unregister's own channel
        self._streams = streams
        self._mux: StreamMultiplexer | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"<GrpcTransport {self.target}>"

    @property
    def channel(self) -> grpc.aio.Channel:
        """The one ``grpc.aio.Channel`` every call of this transport runs on."""
        return self._channel

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata (the client's headers) as lowercase ``(key, value)`` pairs."""
        return self._metadata

    # -- errors -------------------------------------------------------------------------------------

    def _map(self, err: BaseException, **ctx: Any) -> TritonError:
        mapped = map_error(err, tls_url=self._tls_url, **ctx)
        # UNAVAILABLE also means "shutting down"; only the channel's own state says whether there was no
        # connection at all.
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

    # -- inference: the one call primitive ----------------------------------------------------------

    def multiplexer(self) -> StreamMultiplexer:
        """The shared-stream multiplexer on this channel: made on first use, closed with the transport."""
        if self._mux is None or self._mux.is_closed:
            self._mux = StreamMultiplexer(self._channel, streams=self._streams, metadata=self._metadata)
        return self._mux

    def call(self, call: Call, /) -> Responses:
        if self._closed:
            raise ClientClosedError(f"the gRPC connection to {self.target} is closed")
        request = call.request
        route = call.route
        sequence_id = call.sequence_id
        metadata = self._metadata
        if call.trace is not None:
            metadata = with_trace(metadata, call.trace)
        elif TRACING and route != "shared":
            # The current span's context for Triton's own trace. Not on the shared stream: Triton reads a stream's
            # trace context once, from the metadata that opened it, for every request the stream carries.
            metadata = grpc_metadata(metadata)
        timeout_us = server_timeout_us(call.timeout_s, sequence_id)
        if route == "unary":
            if call.many:
                raise UsageError(
                    f"model {request.model!r}: a request answered by several responses needs a streamed route",
                    model=request.model,
                )
            payload = request.grpc_bytes(
                request_id=call.request_id,
                sequence_id=sequence_id,
                sequence_start=call.sequence_start,
                sequence_end=call.sequence_end,
                timeout_us=timeout_us,
            )
            return _UnaryCall(self, call, payload, metadata)

        def encode(stream_request_id: str, empty_final: bool) -> bytes:
            # The stream gives each request its id (and, for many responses, asks for the empty final one).
            return request.grpc_bytes(
                request_id=stream_request_id,
                sequence_id=sequence_id,
                sequence_start=call.sequence_start,
                sequence_end=call.sequence_end,
                timeout_us=timeout_us,
                empty_final=empty_final,
            )

        outgoing = Outgoing(request.model, sequence_id, encode)
        if route == "shared":
            return self.multiplexer().call(
                outgoing, key=sequence_id, many=call.many, timeout_s=call.timeout_s, on_send=call.on_send
            )
        if route == "own":
            return OwnStreamCall(
                self._own_stream, outgoing, metadata=metadata, many=call.many, timeout_s=call.timeout_s,
                on_send=call.on_send,
            )
        raise UsageError(f"unknown route {route!r}")

    # -- admin ----------------------------------------------------------------------------------------

    async def _admin(self, method: str, request: Any, timeout_s: float | None, **ctx: Any) -> Any:
        try:
            return await getattr(self._stub, method)(request, metadata=self._metadata, timeout=timeout_s)
        except grpc.RpcError as err:
            raise self._map(err, **ctx) from err

    async def is_server_live(self, *, timeout_s: float | None) -> bool:
        answer = await self._admin("ServerLive", service_pb2.ServerLiveRequest(), timeout_s)
        return bool(answer.live)

    async def is_server_ready(self, *, timeout_s: float | None) -> bool:
        answer = await self._admin("ServerReady", service_pb2.ServerReadyRequest(), timeout_s)
        return bool(answer.ready)

    async def is_model_ready(self, name: str, version: str, *, timeout_s: float | None) -> bool:
        request = service_pb2.ModelReadyRequest(name=name, version=version)
        answer = await self._admin("ModelReady", request, timeout_s, model=name, version=version or None)
        return bool(answer.ready)

    async def server_metadata(self, *, timeout_s: float | None) -> Json:
        return _to_dict(await self._admin("ServerMetadata", service_pb2.ServerMetadataRequest(), timeout_s))

    async def model_metadata(self, name: str, version: str, *, timeout_s: float | None) -> Json:
        request = service_pb2.ModelMetadataRequest(name=name, version=version)
        return _to_dict(await self._admin("ModelMetadata", request, timeout_s, model=name, version=version or None))

    async def model_config(self, name: str, version: str, *, timeout_s: float | None) -> Json:
        request = service_pb2.ModelConfigRequest(name=name, version=version)
        answer = await self._admin("ModelConfig", request, timeout_s, model=name, version=version or None)
        return dict(_to_dict(answer).get("config", {}))

    async def repository_index(self, *, timeout_s: float | None) -> list[Json]:
        answer = await self._admin("RepositoryIndex", service_pb2.RepositoryIndexRequest(), timeout_s)
        return [dict(m) for m in _to_dict(answer).get("models", ())]

    async def load_model(self, name: str, *, timeout_s: float | None) -> None:
        await self._admin("RepositoryModelLoad", service_pb2.RepositoryModelLoadRequest(model_name=name), timeout_s,
                          model=name)

    async def unload_model(self, name: str, *, timeout_s: float | None) -> None:
        request = service_pb2.RepositoryModelUnloadRequest(model_name=name)
        await self._admin("RepositoryModelUnload", request, timeout_s, model=name)

    async def inference_statistics(self, name: str, version: str, *, timeout_s: float | None) -> list[Json]:
        request = service_pb2.ModelStatisticsRequest(name=name, version=version)
        answer = await self._admin("ModelStatistics", request, timeout_s, model=name, version=version or None)
        return [dict(m) for m in _to_dict(answer).get("model_stats", ())]

    # -- system shared memory ------------------------------------------------------------------------

    async def infer_bytes(
        self, payload: bytes, *, timeout_s: float | None, model: str, version: str = ""
    ) -> service_pb2.ModelInferResponse:
        """Send a serialised ``ModelInferRequest`` as is; the response protobuf as it came (errors mapped).

        For requests whose tensors lie in shared memory: their outputs are read from the regions, not from
        ``raw_output_contents``, so the caller decodes the response itself.
        """
        if self._closed:
            raise ClientClosedError(f"the gRPC connection to {self.target} is closed")
        try:
            response: service_pb2.ModelInferResponse = await self._infer(
                payload, metadata=self._metadata, timeout=timeout_s
            )
        except grpc.RpcError as err:
            raise self._map(err, model=model, version=version or None) from err
        return response

    async def register_system_shared_memory(
        self, name: str, key: str, byte_size: int, *, offset: int = 0, timeout_s: float | None
    ) -> None:
        """Register the POSIX shared-memory object ``key`` (``/name`` form) with the server as region ``name``."""
        request = service_pb2.SystemSharedMemoryRegisterRequest(name=name, key=key, offset=offset, byte_size=byte_size)
        await self._admin("SystemSharedMemoryRegister", request, timeout_s)

    async def unregister_system_shared_memory(self, name: str, *, timeout_s: float | None) -> None:
        """Unregister region ``name``. An empty name is refused: Triton reads it as "every region"."""
        if not name:
            raise UsageError("unregister_system_shared_memory needs a region name (an empty one means all)")
        request = service_pb2.SystemSharedMemoryUnregisterRequest(name=name)
        await self._admin("SystemSharedMemoryUnregister", request, timeout_s)

    async def system_shared_memory_status(self, *, timeout_s: float | None) -> list[Json]:
        """Every registered system shared-memory region: dicts with name, key, offset, byte_size."""
        answer = await self._admin("SystemSharedMemoryStatus", service_pb2.SystemSharedMemoryStatusRequest(), timeout_s)
        return [dict(r) for r in _to_dict(answer).get("regions", {}).values()]

    def blocking_unregister(self, names: Sequence[str], *, timeout_s: float) -> list[str]:
        """Unregister regions over a short-lived blocking channel; the names that could not be. Never raises.

        For exit hooks: when the interpreter exits, the event loop this transport's channel runs on is gone.
        ``timeout_s`` bounds the whole attempt.
        """
        left = [n for n in names if n]
        if not left:
            return []
        deadline = time.monotonic() + timeout_s
        try:
            if self._credentials is not None:
                channel = grpc.secure_channel(self.target, self._credentials, options=self.channel_options)
            else:
                channel = grpc.insecure_channel(self.target, options=self.channel_options)
        except Exception:  # an exit hook must not raise
            return left
        try:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            for name in list(left):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                request = service_pb2.SystemSharedMemoryUnregisterRequest(name=name)
                try:
                    stub.SystemSharedMemoryUnregister(request, metadata=self._metadata, timeout=remaining)
                except grpc.RpcError as err:
                    if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        break  # no server to ask: the next pool's sweep takes the rest
                    continue
                left.remove(name)
        finally:
            channel.close()
        return left

    async def aclose(self) -> None:
        """Close the multiplexer (pending requests fail with ClientClosedError) and the channel; idempotent."""
        self._closed = True
        try:
            if self._mux is not None:
                await self._mux.aclose()
        finally:
            await self._channel.close()
