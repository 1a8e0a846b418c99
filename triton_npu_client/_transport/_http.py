"""HTTP transport over ``tritonclient.http.aio`` with the binary tensor extension.

tritonclient's HTTP client has one total ``conn_timeout`` for every request and no per-call client timeout,
so the session gets no total limit and each call runs under its own ``asyncio.timeout``.

Cancellation: cancelling the awaiting task closes the HTTP request on the client side, but Triton 2.51 keeps
running a request it has already accepted over HTTP (seen against the real server); only gRPC cancels the
request on the server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Final

import tritonclient.http.aio as httpclient

from .._errors._classify import map_error
from .._wire import InferRequest, InferResult
from ._base import Json, server_timeout_us
from ._options import TLSConfig

__all__ = ["HttpTransport"]


class HttpTransport:
    """One aiohttp session to ``target`` (``host:port``)."""

    protocol: Final = "http"

    def __init__(
        self,
        target: str,
        *,
        headers: Mapping[str, str] | None = None,
        tls: TLSConfig | None = None,
    ) -> None:
        self.target = target
        self._headers = dict(headers or {})
        self._client = httpclient.InferenceServerClient(
            target,
            conn_timeout=None,
            ssl=tls is not None,
            ssl_context=tls.ssl_context() if tls is not None else None,
        )

    def __repr__(self) -> str:
        return f"<HttpTransport {self.target}>"

    async def _call(self, coro: Any, timeout_s: float | None, **ctx: Any) -> Any:
        from tritonclient.utils import InferenceServerException

        try:
            async with asyncio.timeout(timeout_s):
                return await coro
        except (InferenceServerException, TimeoutError, OSError) as err:
            raise map_error(err, **ctx) from err
        except Exception as err:
            import aiohttp

            if isinstance(err, aiohttp.ClientError):
                raise map_error(err, **ctx) from err
            raise

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
        coro = self._client.infer(
            request.model,
            request.http_inputs(),
            model_version=request.version,
            outputs=request.http_outputs(),
            request_id=request_id,
            sequence_id=sequence_id if sequence_id is not None else 0,
            sequence_start=sequence_start,
            sequence_end=sequence_end,
            timeout=server_timeout_us(timeout_s, sequence_id),
            headers=self._headers,
        )
        result = await self._call(
            coro,
            timeout_s,
            model=request.model,
            version=request.version or None,
            request_id=request_id,
            sequence_id=sequence_id,
        )
        return InferResult.from_http(result)

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
        await self._client.close()
