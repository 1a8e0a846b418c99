"""One long-lived gRPC ``ModelStreamInfer`` stream (or a small pool) carrying many requests at once.

Why: a sequence step over unary gRPC pays a whole RPC (headers, a new HTTP/2 stream, a deadline) per
step; over one bidirectional stream it is one message each way. The multiplexer feeds each stream from an
:class:`asyncio.Queue` through a request iterator that only ends on close, runs one reader task per stream,
gives every request a unique ``id`` and hands each response to the waiter registered under
``infer_response.id``.

Facts that shape it (Triton 2.51, see TRITON_FACTS.md):

- For non-decoupled models one stream answers in request order across *all* its requests, so a slow
  request holds up everything behind it on that stream. A pool of streams, chosen by a caller's
  affinity key (a sequence id, so one sequence's steps stay on one stream, in order), limits that.
- Per-request errors arrive as text in ``error_message`` with the request's id; the stream goes on.
- An exception raised inside the request iterator is swallowed by grpc and turns into a cancellation,
  so requests are serialised (hence validated) in the caller, before they are queued. Serialising
  early also means a caller may reuse or mutate its protobuf as soon as the call returns.
- A stream-level failure (server gone) ends the call with ``grpc.aio.AioRpcError``: every request pending
  on that stream fails with a transport error, and the next request opens a fresh stream.

Mapping of error text and status codes lives in :mod:`triton_npu_client._errmap` (the one place);
the reader task only routes responses, the waiting caller maps, so the reader stays cheap.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Any, Final, Self

import grpc
from tritonclient.grpc import service_pb2

from .._errors import ClientClosedError, ConnectError, RequestTimeout, TritonError
from .._errors._classify import map_error, map_stream_error

__all__ = ["ResponseStream", "StreamMultiplexer"]

_log = logging.getLogger("triton_npu_client.stream")

_METHOD: Final = "/inference.GRPCInferenceService/ModelStreamInfer"
_FINAL_PARAM: Final = "triton_final_response"
_ENABLE_EMPTY_FINAL: Final = "triton_enable_empty_final_response"
_END_OF_REQUESTS: Final = object()

ModelInferRequest = service_pb2.ModelInferRequest
ModelInferResponse = service_pb2.ModelInferResponse


class _Waiter:
    """Where the reader delivers the answers to one request: a future (one response) or a queue (many)."""

    __slots__ = ("future", "model", "queue", "request_id", "sequence_id")

    def __init__(
        self,
        *,
        request_id: str,
        model: str,
        sequence_id: int | str | None,
        future: asyncio.Future[Any] | None = None,
        queue: asyncio.Queue[Any] | None = None,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.sequence_id = sequence_id
        self.future = future
        self.queue = queue


class _Stream:
    """One ``ModelStreamInfer`` call, its request queue, its reader task and the requests pending on it."""

    def __init__(self, mux: StreamMultiplexer, index: int) -> None:
        self.index = index
        self.pending: dict[str, _Waiter] = {}
        self.alive = True
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._mux = mux
        self._call = mux._open_call(self._requests())
        self._reader = asyncio.get_running_loop().create_task(self._read(), name=f"triton-stream-reader-{index}")

    async def _requests(self) -> AsyncIterator[bytes]:
        # Ends only on close: a stream whose iterator ends is half-closed and takes no further requests.
        queue = self._queue
        while True:
            item = await queue.get()
            if item is _END_OF_REQUESTS:
                return
            yield item  # type: ignore[misc]

    def send(self, waiter: _Waiter, payload: bytes) -> None:
        self.pending[waiter.request_id] = waiter
        self._queue.put_nowait(payload)

    async def _read(self) -> None:
        try:
            async for message in self._call:
                self._route(message)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as err:
            _log.debug("stream %d failed: %s", self.index, err)
            self._fail(_stream_failure(err), cause=err)
        except Exception as err:  # pragma: no cover - grpc raising something else is a grpc bug
            self._fail(ConnectError(f"The gRPC stream failed: {err!r}"), cause=err)
        else:
            # The server ended the call on its own (e.g. shutting down): whatever is pending is lost.
            self._fail(ConnectError("The server ended the gRPC stream."), cause=None)

    def _route(self, message: Any) -> None:
        response = message.infer_response
        waiter = self.pending.get(response.id)
        if waiter is None:
            # Its caller was cancelled or timed out: the answer is dropped, as documented.
            return
        if waiter.future is not None:
            del self.pending[response.id]
            if not waiter.future.done():
                waiter.future.set_result(message)
            return
        assert waiter.queue is not None
        if message.error_message or _is_final(response):
            del self.pending[response.id]
        waiter.queue.put_nowait(message)

    def _fail(self, error: TritonError, *, cause: BaseException | None) -> None:
        if self.alive:
            # Let the request iterator finish on its own: grpc's task may be suspended inside it (awaiting the
            # queue), and a generator finalised there logs "asynchronous generator is already running".
            self._queue.put_nowait(_END_OF_REQUESTS)
        self.alive = False
        pending, self.pending = self.pending, {}
        for waiter in pending.values():
            exc = _with_context(error, waiter)
            exc.__cause__ = cause
            if waiter.future is not None:
                if not waiter.future.done():
                    waiter.future.set_exception(exc)
            elif waiter.queue is not None:
                waiter.queue.put_nowait(exc)
        self._call.cancel()

    async def aclose(self) -> None:
        self._fail(ClientClosedError("The stream multiplexer was closed."), cause=None)
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


def _stream_failure(err: grpc.aio.AioRpcError) -> TritonError:
    """The error for requests pending on a stream that ``err`` ended.

    A dead server shows up as UNAVAILABLE, or as INTERNAL / UNKNOWN when grpc fails to write to the
    broken connection first: for a whole stream those mean "the stream broke", a transport failure,
    not a server-side refusal. Any other status keeps its ordinary mapping (e.g. a missing API key).
    """
    code = err.code()
    if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED):
        return ConnectError(f"The gRPC stream broke ({code.name}): {err.details()}", status=code.name)
    return map_error(err)


def _is_final(response: Any) -> bool:
    params = response.parameters
    return _FINAL_PARAM in params and bool(params[_FINAL_PARAM].bool_param)


def _sequence_id(request: Any) -> int | str | None:
    params = request.parameters
    if "sequence_id" not in params:
        return None
    param = params["sequence_id"]
    kind = param.WhichOneof("parameter_choice")
    if kind == "string_param":
        return str(param.string_param)
    if kind in ("int64_param", "uint64_param"):
        return int(getattr(param, kind))
    return None


def _with_context(error: TritonError, waiter: _Waiter) -> TritonError:
    """A copy of a stream-wide error that names the request it failed."""
    exc = type(error)(
        error.message,
        model=waiter.model,
        request_id=waiter.request_id,
        status=error.status,
        sequence_id=waiter.sequence_id,
    )
    return exc


class StreamMultiplexer:
    """Many concurrent requests over ``streams`` long-lived bidirectional gRPC streams on one channel.

    ::

        mux = StreamMultiplexer(channel, streams=2)
        response = await mux.infer(request_pb, key=sequence_id)     # one response
        async with mux.stream(request_pb) as responses:             # decoupled: many, then final
            async for response in responses: ...
        await mux.aclose()

    Requests with the same ``key`` travel on the same stream, so Triton receives them in call order.
    The multiplexer sets each request's ``id`` (the caller's value is overwritten). The channel belongs
    to the caller: :meth:`aclose` ends the streams, not the channel.
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        *,
        streams: int = 1,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> None:
        if streams < 1:
            raise ValueError(f"streams must be >= 1, got {streams}")
        self._multicallable = channel.stream_stream(
            _METHOD,
            request_serializer=None,  # we send bytes serialised in the caller (see the module docstring)
            response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
        )
        self._metadata = tuple(metadata)
        self._slots: list[_Stream | None] = [None] * streams
        self._ids = itertools.count(1)
        self._round_robin = itertools.count()
        self._closed = False

    def __repr__(self) -> str:
        live = sum(1 for s in self._slots if s is not None and s.alive)
        return f"<StreamMultiplexer streams={live}/{len(self._slots)} pending={self.pending_count}>"

    @property
    def pending_count(self) -> int:
        """Requests sent and not yet answered (or failed) whose caller still waits."""
        return sum(len(s.pending) for s in self._slots if s is not None)

    @property
    def is_closed(self) -> bool:
        return self._closed

    def _open_call(self, requests: AsyncIterator[bytes]) -> Any:
        return self._multicallable(requests, metadata=self._metadata or None)

    def _slot_for(self, key: int | str | None) -> _Stream:
        if self._closed:
            raise ClientClosedError("The stream multiplexer is closed.")
        n = len(self._slots)
        index = (hash(key) if key is not None else next(self._round_robin)) % n
        stream = self._slots[index]
        if stream is None or not stream.alive:
            # Lazily (re)open: after a stream failure the next request gets a fresh stream.
            stream = _Stream(self, index)
            self._slots[index] = stream
        return stream

    def _register(self, request: Any, *, key: int | str | None, many: bool) -> tuple[_Stream, _Waiter, bytes]:
        request_id = str(next(self._ids))
        request.id = request_id
        if many:
            request.parameters[_ENABLE_EMPTY_FINAL].bool_param = True
        try:
            payload = request.SerializeToString()
        finally:
            if many:
                del request.parameters[_ENABLE_EMPTY_FINAL]
        stream = self._slot_for(key)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(
            request_id=request_id,
            model=request.model_name,
            sequence_id=_sequence_id(request),
            future=None if many else loop.create_future(),
            queue=asyncio.Queue() if many else None,
        )
        return stream, waiter, payload

    async def infer(
        self,
        request: Any,
        *,
        key: int | str | None = None,
        timeout_s: float | None = None,
        steps_acknowledged: int = 0,
    ) -> Any:
        """Send one request and return its ``ModelInferResponse``; raise the mapped error on failure.

        ``key`` pins the stream (same key, same stream, same order). ``timeout_s`` bounds the wait on
        this side only; the request has already been sent and Triton still runs it (give the request
        a server-side ``timeout`` parameter to bound that). Cancelling the caller drops the answer.
        ``steps_acknowledged`` is context for a :class:`SequenceLost` raised for a sequence step.
        """
        stream, waiter, payload = self._register(request, key=key, many=False)
        stream.send(waiter, payload)
        future = waiter.future
        assert future is not None
        try:
            if timeout_s is None:
                message = await future
            else:
                async with asyncio.timeout(timeout_s):
                    message = await future
        except TimeoutError as err:
            stream.pending.pop(waiter.request_id, None)
            raise RequestTimeout(
                f"No answer within {timeout_s} s on the gRPC stream.",
                model=waiter.model,
                request_id=waiter.request_id,
                status="DEADLINE_EXCEEDED",
                sequence_id=waiter.sequence_id,
            ) from err
        except asyncio.CancelledError:
            stream.pending.pop(waiter.request_id, None)
            raise
        if message.error_message:
            raise map_stream_error(
                message.error_message,
                model=waiter.model,
                request_id=waiter.request_id,
                sequence_id=waiter.sequence_id,
                steps_acknowledged=steps_acknowledged,
            )
        return message.infer_response

    def stream(self, request: Any, *, key: int | str | None = None) -> ResponseStream:
        """Send one request that gets several responses (decoupled model); iterate them until the final one.

        The request is sent now (so calls keep their order); the returned object is an async iterator
        and an async context manager whose exit drops whatever has not been read.
        """
        stream, waiter, payload = self._register(request, key=key, many=True)
        stream.send(waiter, payload)
        return ResponseStream(stream, waiter)

    async def aclose(self) -> None:
        """End every stream's requests, stop the readers, fail pending requests with ClientClosedError."""
        if self._closed:
            return
        self._closed = True
        slots, self._slots = self._slots, [None] * len(self._slots)
        for stream in slots:
            if stream is not None:
                await stream.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class ResponseStream:
    """The responses to one request on a stream, ending after the response with the final flag.

    The empty final response Triton sends when asked (``triton_enable_empty_final_response``) ends the
    iteration without being yielded; a final response that carries outputs is yielded, then it ends.
    """

    def __init__(self, stream: _Stream, waiter: _Waiter) -> None:
        self._stream = stream
        self._waiter = waiter
        self._done = False

    @property
    def request_id(self) -> str:
        return self._waiter.request_id

    def __repr__(self) -> str:
        return f"<ResponseStream request_id={self.request_id!r} done={self._done}>"

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Any:
        if self._done:
            raise StopAsyncIteration
        queue = self._waiter.queue
        assert queue is not None
        while True:
            try:
                item = await queue.get()
            except asyncio.CancelledError:
                self._drop()
                raise
            if isinstance(item, BaseException):
                self._done = True
                raise item
            if item.error_message:
                self._done = True
                raise map_stream_error(
                    item.error_message,
                    model=self._waiter.model,
                    request_id=self._waiter.request_id,
                    sequence_id=self._waiter.sequence_id,
                )
            response = item.infer_response
            if _is_final(response):
                self._done = True
                if not response.outputs:
                    raise StopAsyncIteration
            return response

    def _drop(self) -> None:
        self._done = True
        self._stream.pending.pop(self._waiter.request_id, None)

    async def aclose(self) -> None:
        """Stop listening: later responses to this request are dropped."""
        self._drop()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._drop()
