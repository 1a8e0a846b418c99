"""HTTP transport over ``tritonclient.http.aio`` with the binary tensor extension.

tritonclient's HTTP client has one total ``conn_timeout`` for every request and no per-call client timeout,
so the session gets no total limit and each call runs under its own ``asyncio.timeout``.

Connections: aiohttp opens at most ``connections`` at once and queues the rest silently. This transport holds a
semaphore of the same size in front of it, so a request waits *here*, where it is visible, and the caller's
``on_send`` runs only when a connection is free: a sequence step that queued past the model's idle timeout is
warned about when it actually leaves, not when it was asked for.

Cancellation: cancelling the awaiting task closes the HTTP request on the client side, but Triton 2.51 keeps
running a request it has already accepted over HTTP; only gRPC cancels the request on the server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Final

import tritonclient.http.aio as httpclient

from .._errors import ClientClosedError, UsageError, map_error
from .._trace import AVAILABLE as TRACING
from .._trace import http_headers
from .._wire import InferResult
from ._base import Json, OneResponse, Responses, server_timeout_us
from ._call import Call
from ._options import TLSConfig

__all__ = ["DEFAULT_HTTP_CONNECTIONS", "HttpTransport"]

# Enough for hundreds of concurrent sessions (one step in flight each) without queueing on this side.
DEFAULT_HTTP_CONNECTIONS: Final = 1024


class _HttpCall(OneResponse):
    """One HTTP inference request: the one response, sent when first awaited."""

    __slots__ = ("_call", "_headers", "_transport")

    def __init__(self, transport: HttpTransport, call: Call, headers: dict[str, str] | None) -> None:
        super().__init__()
        self._transport = transport
        self._call = call
        self._headers = headers

    async def _send(self) -> InferResult:
        transport = self._transport
        call = self._call
        request = call.request
        sequence_id = call.sequence_id
        ctx = {
            "model": request.model,
            "version": request.version or None,
            "request_id": call.request_id,
            "sequence_id": sequence_id or None,
        }
        try:
            async with asyncio.timeout(call.timeout_s):
                async with transport._connections:
                    if call.on_send is not None:
                        call.on_send()
                    result = await transport._client.infer(
                        request.model,
                        request.http_inputs(),
                        model_version=request.version,
                        outputs=request.http_outputs(),
                        request_id=call.request_id,
                        sequence_id=sequence_id if sequence_id is not None else 0,
                        sequence_start=call.sequence_start,
                        sequence_end=call.sequence_end,
                        timeout=server_timeout_us(call.timeout_s, sequence_id),
                        # A copy per call (made in call()): tritonclient writes Inference-Header-Content-Length into
                        # the dict it is given, and a stale value breaks the next request that has no binary data
                        # (an END-only step).
                        headers=self._headers,
                    )
        except Exception as err:
            raise transport._mapped(err, ctx) from err
        return InferResult.from_http(result)


class HttpTransport:
    """One aiohttp session to ``target`` (``host:port``) with at most ``connections`` open at once."""

    protocol: Final = "http"
    can_stream: Final = False

    def __init__(
        self,
        target: str,
        *,
        headers: Mapping[str, str] | None = None,
        tls: TLSConfig | None = None,
        connections: int = DEFAULT_HTTP_CONNECTIONS,
    ) -> None:
        if connections < 1:
            raise UsageError(f"connections must be >= 1, got {connections}")
        self.target = target
        self.connections = connections
        self._headers = dict(headers or {})
        self._client = httpclient.InferenceServerClient(
            target,
            conn_limit=connections,
            conn_timeout=None,
            ssl=tls is not None,
            ssl_context=tls.ssl_context() if tls is not None else None,
        )
        # aiohttp's certificate errors do not carry the URL: the message names it from here.
        self._tls_url = f"https://{target}" if tls is not None else None
        self._connections = asyncio.Semaphore(connections)
        self._closed = False

    def __repr__(self) -> str:
        return f"<HttpTransport {self.target}>"

    def _mapped(self, err: BaseException, ctx: Mapping[str, Any]) -> BaseException:
        from tritonclient.utils import InferenceServerException

        if isinstance(err, InferenceServerException | TimeoutError | OSError):
            return map_error(err, tls_url=self._tls_url, **ctx)
        import aiohttp

        if isinstance(err, aiohttp.ClientError):
            return map_error(err, tls_url=self._tls_url, **ctx)
        return err

    async def _call(self, coro: Any, timeout_s: float | None, **ctx: Any) -> Any:
        try:
            async with asyncio.timeout(timeout_s):
                return await coro
        except Exception as err:
            mapped = self._mapped(err, ctx)
            if mapped is err:
                raise
            raise mapped from err

    def call(self, call: Call, /) -> Responses:
        if self._closed:
            raise ClientClosedError(f"the HTTP connection to {self.target} is closed")
        if call.route != "unary" or call.many:
            raise UsageError(
                f"model {call.request.model!r}: HTTP has no streamed route (Triton serves decoupled models only over "
                "the gRPC stream); use a grpc:// client",
                model=call.request.model,
            )
        headers: dict[str, str] | None
        if call.trace is not None:
            headers = dict(self._headers)
            headers.update(call.trace)
        elif TRACING:
            # With the current span's trace context, for Triton's own trace.
            headers = http_headers(self._headers)
        else:
            headers = dict(self._headers) if self._headers else None
        return _HttpCall(self, call, headers)

    async def is_server_live(self, *, timeout_s: float | None) -> bool:
        return bool(await self._call(self._client.is_server_live(headers=self._headers), timeout_s))

    async def is_server_ready(self, *, timeout_s: float | None) -> bool:
        return bool(await self._call(self._client.is_server_ready(headers=self._headers), timeout_s))

    async def is_model_ready(self, name: str, version: str, *, timeout_s: float | None) -> bool:
        coro = self._client.is_model_ready(name, version, headers=self._headers)
        return bool(await self._call(coro, timeout_s, model=name, version=version or None))

    async def server_metadata(self, *, timeout_s: float | None) -> Json:
        return dict(await self._call(self._client.get_server_metadata(headers=self._headers), timeout_s))

    async def model_metadata(self, name: str, version: str, *, timeout_s: float | None) -> Json:
        coro = self._client.get_model_metadata(name, version, headers=self._headers)
        return dict(await self._call(coro, timeout_s, model=name, version=version or None))

    async def model_config(self, name: str, version: str, *, timeout_s: float | None) -> Json:
        coro = self._client.get_model_config(name, version, headers=self._headers)
        answer = await self._call(coro, timeout_s, model=name, version=version or None)
        return dict(answer.get("config", answer))

    async def repository_index(self, *, timeout_s: float | None) -> list[Json]:
        answer = await self._call(self._client.get_model_repository_index(headers=self._headers), timeout_s)
        return [dict(m) for m in answer]

    async def load_model(self, name: str, *, timeout_s: float | None) -> None:
        await self._call(self._client.load_model(name, headers=self._headers), timeout_s, model=name)

    async def unload_model(self, name: str, *, timeout_s: float | None) -> None:
        await self._call(self._client.unload_model(name, headers=self._headers), timeout_s, model=name)

    async def inference_statistics(self, name: str, version: str, *, timeout_s: float | None) -> list[Json]:
        coro = self._client.get_inference_statistics(name, version, headers=self._headers)
        answer = await self._call(coro, timeout_s, model=name, version=version or None)
        return [dict(m) for m in answer.get("model_stats", ())]

    async def aclose(self) -> None:
        """Close the aiohttp session; safe to call twice."""
        self._closed = True
        await self._client.close()
