"""gRPC streaming: the multiplexer (many requests on one long-lived ``ModelStreamInfer`` stream) and one request
on a call of its own.

Why a shared stream: a request over unary gRPC pays a whole RPC (headers, a new HTTP/2 stream, a deadline); on
one bidirectional stream it is one message each way. Why a call of its own: Triton cancels work per gRPC call,
so a request that must be cancellable alone (a streamed session step) cannot share a stream.

Facts that shape the multiplexer (Triton 2.51; ``docs/triton-facts.md``):

- Per-request errors arrive as text in ``error_message`` with the request's id; the stream goes on.
- An exception raised inside grpc's request iterator is swallowed and becomes a cancellation, so requests are
  serialised in the caller, before they are queued.
- A stream-level failure ends the call with ``grpc.aio.AioRpcError``: every request pending on that stream fails
  with a transport error, and the next request opens a fresh stream.

Everything is bounded: requests in flight per multiplexer (callers wait for a slot, *before* the request counts
as sent), the queue feeding each stream, and the answers buffered for one multi-response request. Every wait is
bounded too: by the caller's deadline (a free slot, room in a full stream queue, the answers) and by the stream's
death (a caller waiting for room in the queue of a stream that dies gets that stream's error at once).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Final, Self

import grpc
from tritonclient.grpc import service_pb2

from .._errors import (
    ClientClosedError,
    ConnectError,
    InternalServerError,
    RequestTimeout,
    TritonError,
    UsageError,
    map_error,
    map_stream_error,
)
from .._wire import InferResult
from ._call import OnSend

__all__ = ["Outgoing", "OwnStreamCall", "SharedStreamCall", "StreamMultiplexer", "is_final", "request_payload"]

_log = logging.getLogger("triton_npu_client.stream")

METHOD: Final = "/inference.GRPCInferenceService/ModelStreamInfer"
_FINAL_PARAM: Final = "triton_final_response"
_ENABLE_EMPTY_FINAL: Final = "triton_enable_empty_final_response"
_END_OF_REQUESTS: Final = object()

DEFAULT_MAX_PENDING: Final = 8192
_SEND_QUEUE: Final = 256
# How long a call whose answer is over (an error response, Triton's last for that request) may take to end on its own
# before it is cancelled after all.
_SETTLE_S: Final = 2.0
MAX_BUFFERED_RESPONSES: Final = 4096



def is_final(response: Any) -> bool:
    params = response.parameters
    return _FINAL_PARAM in params and bool(params[_FINAL_PARAM].bool_param)


def request_payload(request: Any, *, request_id: str, many: bool) -> bytes:
    """Serialise ``request`` with its id (and, for a multi-response request, the empty-final opt-in)."""
    request.id = request_id
    if not many:
        return bytes(request.SerializeToString())
    request.parameters[_ENABLE_EMPTY_FINAL].bool_param = True
    try:
        return bytes(request.SerializeToString())
    finally:
        del request.parameters[_ENABLE_EMPTY_FINAL]


class Outgoing:
    """What a streamed call sends: its model and sequence id (for errors) and its bytes, given the request id."""

    __slots__ = ("encode", "model", "sequence_id")

    def __init__(
        self, model: str, sequence_id: int | str | None, encode: Callable[[str, bool], bytes]
    ) -> None:
        self.model = model
        self.sequence_id = sequence_id
        # encode(request_id, many) -> the serialised ModelInferRequest
        self.encode = encode

    @classmethod
    def of(cls, request: Any) -> Outgoing:
        """An :class:`Outgoing` as is, or one made from a ``ModelInferRequest`` protobuf."""
        if isinstance(request, Outgoing):
            return request
        return cls(
            request.model_name,
            _sequence_id(request),
            lambda request_id, many: request_payload(request, request_id=request_id, many=many),
        )


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


def _stream_failure(err: grpc.aio.AioRpcError) -> TritonError:
    """The error for requests pending on a stream that ``err`` ended.

    A dead server shows up as UNAVAILABLE, or as INTERNAL / UNKNOWN / CANCELLED when grpc fails to write to the
    broken connection first: for a whole stream those mean "the stream broke", a transport failure, not a
    server-side refusal. Any other status keeps its ordinary mapping (e.g. a missing API key).
    """
    code = err.code()
    if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED):
        return ConnectError(f"The gRPC stream broke ({code.name}): {err.details()}", status=code.name)
    return map_error(err)


def _copy_for(error: TritonError, *, model: str, request_id: str, sequence_id: int | str | None) -> TritonError:
    """A stream-wide error as an exception of its own for one request (callers never share an instance)."""
    return type(error)(error.message, model=model, request_id=request_id, status=error.status, sequence_id=sequence_id)


def _timeout(model: str, request_id: str, sequence_id: int | str | None, timeout_s: float | None) -> RequestTimeout:
    return RequestTimeout(
        f"model {model!r}: no answer within {timeout_s} s on the gRPC stream",
        model=model,
        request_id=request_id,
        status="DEADLINE_EXCEEDED",
        sequence_id=sequence_id,
    )


def _deadline(timeout_s: float | None) -> float | None:
    return None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s


class _SendQueue:
    """The requests waiting for grpc's request iterator of one stream: bounded, one reader (that iterator).

    Not an ``asyncio.Queue``: a sender waiting there for room would wait forever once the stream dies, since nobody
    reads the queue of a dead stream. :meth:`close` wakes every waiting sender (and the reader) instead.
    """

    __slots__ = ("_closed", "_items", "_maxsize", "_reader", "_senders")

    def __init__(self, maxsize: int) -> None:
        self._items: collections.deque[bytes] = collections.deque()
        self._maxsize = maxsize
        self._reader: asyncio.Future[None] | None = None
        self._senders: collections.deque[asyncio.Future[None]] = collections.deque()
        self._closed = False

    def full(self) -> bool:
        return len(self._items) >= self._maxsize

    def put_nowait(self, item: bytes) -> None:
        """Queue ``item``; the caller has checked that there is room and that the queue is open."""
        self._items.append(item)
        reader = self._reader
        if reader is not None and not reader.done():
            reader.set_result(None)

    async def put(self, item: bytes) -> bool:
        """Queue ``item`` once there is room (True), or give up when the queue closes first (False: not queued)."""
        loop = asyncio.get_running_loop()
        while self.full() and not self._closed:
            room = loop.create_future()
            self._senders.append(room)
            try:
                await room
            except BaseException:
                if room.done() and not room.cancelled():
                    self._wake_sender()  # woken, then cancelled before running: pass the room on
                raise
        if self._closed:
            return False
        self.put_nowait(item)
        return True

    async def get(self) -> bytes | object:
        """The next request, or ``_END_OF_REQUESTS`` once closed (what is still queued is dropped with the stream)."""
        while not self._items and not self._closed:
            self._reader = asyncio.get_running_loop().create_future()
            await self._reader
        if self._closed:
            return _END_OF_REQUESTS
        item = self._items.popleft()
        self._wake_sender()
        return item

    def _wake_sender(self) -> None:
        while self._senders:
            room = self._senders.popleft()
            if not room.done():
                room.set_result(None)
                return

    def close(self) -> None:
        """End the requests: the reader gets ``_END_OF_REQUESTS``, every waiting sender gets False."""
        self._closed = True
        self._items.clear()
        for waiter in (self._reader, *self._senders):
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        self._senders.clear()


class _Inbox:
    """The answers to one multi-response request, in arrival order: a deque and one wake-up future.

    Lighter than an ``asyncio.Queue`` (made per request on the hot path); one reader only.
    """

    __slots__ = ("_items", "_wake")

    def __init__(self) -> None:
        self._items: collections.deque[Any] = collections.deque()
        self._wake: asyncio.Future[None] | None = None

    def qsize(self) -> int:
        return len(self._items)

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def get(self) -> Any:
        while not self._items:
            self._wake = asyncio.get_running_loop().create_future()
            await self._wake
        return self._items.popleft()


class _Waiter:
    """Where the reader delivers the answers to one request: a future (one response) or an inbox (many)."""

    __slots__ = ("future", "model", "queue", "sequence_id")

    def __init__(self, *, many: bool, model: str, sequence_id: int | str | None) -> None:
        self.model = model
        self.sequence_id = sequence_id
        self.future: asyncio.Future[Any] | None = None if many else asyncio.get_running_loop().create_future()
        self.queue: _Inbox | None = _Inbox() if many else None


class _Stream:
    """One ``ModelStreamInfer`` call, its request queue, its reader task and the requests pending on it."""

    def __init__(self, mux: StreamMultiplexer, index: int) -> None:
        self.index = index
        self.pending: dict[str, _Waiter] = {}
        self.alive = True
        self._queue = _SendQueue(_SEND_QUEUE)
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

    async def send(self, request_id: str, waiter: _Waiter, payload: bytes, deadline: float | None) -> None:
        """Queue ``payload`` for ``waiter``; a full queue is waited on until ``deadline`` (TimeoutError).

        When the stream dies meanwhile this returns at once without queueing: ``waiter`` already holds the error.
        """
        self.pending[request_id] = waiter
        queue = self._queue
        try:
            if not queue.full():
                queue.put_nowait(payload)  # the usual case: no timer
                return
            async with asyncio.timeout_at(deadline):
                await queue.put(payload)
        except BaseException:
            self.pending.pop(request_id, None)
            raise

    async def _read(self) -> None:
        error: TritonError
        cause: BaseException | None = None
        try:
            async for message in self._call:
                self._route(message)
        except asyncio.CancelledError:
            # Cancelled (by aclose, or by someone else): nobody will route answers any more.
            self._fail(ClientClosedError("The gRPC stream reader was stopped."), cause=None)
            raise
        except grpc.aio.AioRpcError as err:
            _log.debug("stream %d failed: %s", self.index, err)
            error, cause = _stream_failure(err), err
        except Exception as err:  # pragma: no cover - grpc raising something else is a grpc bug
            error, cause = ConnectError(f"The gRPC stream failed: {err!r}"), err
        else:
            # The server ended the call on its own (e.g. shutting down): whatever is pending is lost.
            error = ConnectError("The server ended the gRPC stream.")
        self._fail(error, cause=cause)

    def _route(self, message: Any) -> None:
        response = message.infer_response
        waiter = self.pending.get(response.id)
        if waiter is None:
            return  # its caller stopped listening (cancelled, timed out, closed)
        if waiter.future is not None:
            del self.pending[response.id]
            if not waiter.future.done():
                waiter.future.set_result(message)
            return
        queue = waiter.queue
        assert queue is not None
        if message.error_message or is_final(response):
            del self.pending[response.id]
        elif queue.qsize() >= MAX_BUFFERED_RESPONSES:
            # The reader cannot wait for one slow consumer without stalling every request on the stream.
            del self.pending[response.id]
            message = InternalServerError(
                f"more than {MAX_BUFFERED_RESPONSES} responses buffered for one request on the shared gRPC stream; "
                "read a long response stream on a call of its own (a session's stream())",
                model=response.model_name,
                request_id=response.id,
            )
        queue.put_nowait(message)

    def _fail(self, error: TritonError, *, cause: BaseException | None) -> None:
        if self.alive:
            # Let the request iterator finish on its own: grpc's task may be suspended inside it (awaiting the
            # queue), and a generator finalised there logs "asynchronous generator is already running". Closing
            # also wakes every sender waiting for room in a full queue.
            self.alive = False
            self._queue.close()
        pending, self.pending = self.pending, {}
        for request_id, waiter in pending.items():
            exc = _copy_for(error, model=waiter.model, request_id=request_id, sequence_id=waiter.sequence_id)
            exc.__cause__ = cause
            if waiter.future is not None:
                if not waiter.future.done():
                    waiter.future.set_exception(exc)
            elif waiter.queue is not None:
                waiter.queue.put_nowait(exc)
        self._call.cancel()

    def stop(self) -> asyncio.Task[None]:
        """Fail what is pending with ClientClosedError and cancel the reader; returns the reader to wait for."""
        self._fail(ClientClosedError("The stream multiplexer was closed."), cause=None)
        self._reader.cancel()
        return self._reader


class StreamMultiplexer:
    """Many concurrent requests over ``streams`` long-lived bidirectional gRPC streams on one channel.

    Requests with the same ``key`` travel on the same stream, so Triton receives them in the order they are
    sent. At most ``max_pending`` requests are in flight; more wait for a slot before they are sent. The
    channel belongs to the caller: :meth:`aclose` ends the streams, not the channel.

    No request here carries a trace context (``traceparent``) of its own: Triton 2.51 reads it from the metadata
    that opened the stream, for every request on it, so the streams open with the client's headers alone.
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        *,
        streams: int = 1,
        metadata: Sequence[tuple[str, str]] = (),
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        if streams < 1:
            raise ValueError(f"streams must be >= 1, got {streams}")
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self._multicallable = channel.stream_stream(
            METHOD,
            request_serializer=None,  # bytes, serialised by the caller (see the module docstring)
            response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
        )
        self._metadata = tuple(metadata)
        self._slots: list[_Stream | None] = [None] * streams
        self._ids = itertools.count(1)
        self._round_robin = itertools.count()
        self._closed = False
        self._room = asyncio.Semaphore(max_pending)

    def __repr__(self) -> str:
        live = sum(1 for s in self._slots if s is not None and s.alive)
        return f"<StreamMultiplexer streams={live}/{len(self._slots)} pending={self.pending_count}>"

    @property
    def streams(self) -> int:
        """How many streams requests are spread over."""
        return len(self._slots)

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

    def call(
        self,
        request: Any,
        *,
        key: int | str | None = None,
        many: bool = False,
        timeout_s: float | None = None,
        on_send: OnSend | None = None,
    ) -> SharedStreamCall:
        """``request`` (an :class:`Outgoing`, or a ``ModelInferRequest``) on the shared stream; sent when its answers
        are first awaited.

        ``timeout_s`` bounds the wait on this side only: the request has been sent and Triton still runs it.
        """
        return SharedStreamCall(self, request, key=key, many=many, timeout_s=timeout_s, on_send=on_send)

    async def aclose(self) -> None:
        """End every stream's requests, stop the readers, fail pending requests with ClientClosedError."""
        if self._closed:
            return
        self._closed = True
        slots, self._slots = self._slots, [None] * len(self._slots)
        # Every stream stops before the first wait: a caller cancelled during the wait leaves none running.
        readers = [stream.stop() for stream in slots if stream is not None]
        if readers:
            # asyncio.wait does not raise the readers' CancelledError, so a cancellation of *our* caller still does.
            await asyncio.wait(readers)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class SharedStreamCall:
    """The answers to one request on the shared stream (see :class:`StreamMultiplexer`)."""

    __slots__ = ("_deadline", "_done", "_key", "_many", "_model", "_mux", "_on_send", "_request", "_request_id",
                 "_sequence_id", "_stream", "_timeout_s", "_waiter")

    def __init__(
        self,
        mux: StreamMultiplexer,
        request: Any,
        *,
        key: int | str | None,
        many: bool,
        timeout_s: float | None,
        on_send: OnSend | None,
    ) -> None:
        self._mux = mux
        outgoing = Outgoing.of(request)
        self._request = outgoing
        self._key = key
        self._many = many
        self._timeout_s = timeout_s
        self._deadline = _deadline(timeout_s)
        self._on_send = on_send
        self._model = outgoing.model
        self._sequence_id = outgoing.sequence_id
        self._request_id = ""
        self._stream: _Stream | None = None
        self._waiter: _Waiter | None = None
        self._done = False

    def __repr__(self) -> str:
        return f"<SharedStreamCall model={self._model!r} request_id={self._request_id!r} done={self._done}>"

    @property
    def request_id(self) -> str:
        return self._request_id

    async def _send(self) -> _Waiter:
        mux = self._mux
        # Counted against max_pending until answered; a caller waiting here has sent nothing yet.
        room = mux._room
        if room.locked():
            async with asyncio.timeout_at(self._deadline):
                await room.acquire()
        else:
            await room.acquire()  # free: returns at once, no timer needed
        try:
            request_id = str(next(mux._ids))
            payload = self._request.encode(request_id, self._many)
            stream = mux._slot_for(self._key)
            waiter = _Waiter(many=self._many, model=self._model, sequence_id=self._sequence_id)
            if self._on_send is not None:
                self._on_send()
            await stream.send(request_id, waiter, payload, self._deadline)
        except BaseException:
            mux._room.release()
            raise
        self._request_id, self._stream, self._waiter = request_id, stream, waiter
        return waiter

    def _release(self) -> None:
        if not self._done:
            self._done = True
            if self._stream is not None:
                self._stream.pending.pop(self._request_id, None)
                self._mux._room.release()
            waiter = self._waiter
            if waiter is not None:
                # A reader still waiting (aclose() came from another task) must not wait for an answer that the
                # stream will no longer route to it.
                closed = ClientClosedError("this request's responses were closed", model=self._model)
                if waiter.future is not None and not waiter.future.done():
                    waiter.future.set_exception(closed)
                elif waiter.queue is not None:
                    waiter.queue.put_nowait(closed)

    def _error(self, message: Any) -> TritonError:
        if isinstance(message, TritonError):
            message.model = message.model or self._model
            message.sequence_id = self._sequence_id
            return message
        return map_stream_error(
            message.error_message, model=self._model, request_id=self._request_id, sequence_id=self._sequence_id
        )

    async def _wait(self, awaitable: Any) -> Any:
        try:
            async with asyncio.timeout_at(self._deadline):
                return await awaitable
        except TimeoutError as err:
            self._release()
            raise _timeout(self._model, self._request_id, self._sequence_id, self._timeout_s) from err
        except BaseException:
            self._release()
            raise

    async def single(self) -> InferResult:
        if self._done:
            raise UsageError("this request's answer was already read")
        try:
            waiter = await self._send()
        except TimeoutError as err:
            self._done = True
            raise _timeout(self._model, "", self._sequence_id, self._timeout_s) from err
        if waiter.future is not None:
            message = await self._wait(waiter.future)
            self._release()
            if message.error_message:
                raise self._error(message)
            return InferResult.from_grpc(message.infer_response)
        # Many responses allowed (a decoupled model), exactly one expected: read to the final flag under one timer.
        inbox = waiter.queue
        assert inbox is not None
        got = await self._wait(self._collect(inbox))
        self._release()
        if len(got) != 1:
            raise _not_one(self._model, len(got))
        return InferResult.from_grpc(got[0])

    async def _collect(self, inbox: _Inbox) -> list[Any]:
        got = []
        while True:
            item = await inbox.get()
            if isinstance(item, TritonError) or item.error_message:
                raise self._error(item)
            response = item.infer_response
            final = is_final(response)
            if response.outputs or not final:
                got.append(response)
            if final:
                return got

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> InferResult:
        if self._done:
            raise StopAsyncIteration
        if not self._many:
            result = await self.single()
            return result
        waiter = self._waiter
        if waiter is None:
            try:
                waiter = await self._send()
            except TimeoutError as err:
                self._done = True
                raise _timeout(self._model, "", self._sequence_id, self._timeout_s) from err
        assert waiter.queue is not None
        item = await self._wait(waiter.queue.get())
        if isinstance(item, TritonError) or item.error_message:
            self._release()
            raise self._error(item)
        response = item.infer_response
        if is_final(response):
            self._release()
            if not response.outputs:
                raise StopAsyncIteration
        return InferResult.from_grpc(response)

    async def aclose(self) -> None:
        """Stop listening: later responses to this request are dropped."""
        self._release()


def _not_one(model: str, n: int) -> UsageError:
    return UsageError(
        f"model {model!r} answered {n} responses to one request; read them with a stream "
        "(e.g. a session's stream()) instead",
        model=model,
    )


async def _single_of(responses: Any, model: str) -> InferResult:
    """Read every response of a multi-response request; exactly one is expected."""
    got: list[InferResult] = []
    async for result in responses:
        got.append(result)
    if len(got) != 1:
        raise _not_one(model, len(got))
    return got[0]


class OwnStreamCall:
    """One request on a ``ModelStreamInfer`` call of its own: closing or cancelling it cancels it on the server."""

    __slots__ = ("_call", "_deadline", "_done", "_many", "_metadata", "_model", "_multicallable", "_on_send",
                 "_request", "_request_id", "_sequence_id", "_timeout_s")

    def __init__(
        self,
        multicallable: Any,
        request: Any,
        *,
        metadata: Sequence[tuple[str, str]],
        many: bool,
        timeout_s: float | None,
        on_send: OnSend | None,
    ) -> None:
        self._multicallable = multicallable
        outgoing = Outgoing.of(request)
        self._request = outgoing
        self._metadata = tuple(metadata)
        self._many = many
        self._timeout_s = timeout_s
        self._on_send = on_send
        self._model = outgoing.model
        self._sequence_id = outgoing.sequence_id
        self._request_id = "1"
        self._call: Any = None
        self._deadline: float | None = None
        self._done = False

    def __repr__(self) -> str:
        return f"<OwnStreamCall model={self._model!r} done={self._done}>"

    def _open(self) -> Any:
        payload = self._request.encode(self._request_id, self._many)
        if self._on_send is not None:
            self._on_send()
        self._deadline = _deadline(self._timeout_s)
        # One request, then half-close: Triton goes on answering until the final response, then ends the call.
        self._call = self._multicallable(iter((payload,)), metadata=self._metadata or None, timeout=self._timeout_s)
        return self._call

    def _finish(self, *, complete: bool = False) -> None:
        """Done reading; cancel the call unless the answer is complete (the server then ends the call itself)."""
        if not self._done:
            self._done = True
            if not complete and self._call is not None and not self._call.done():
                self._call.cancel()

    async def single(self) -> InferResult:
        return await _single_of(self, self._model)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> InferResult:
        if self._done:
            await self._settle()
            raise StopAsyncIteration
        call = self._call if self._call is not None else self._open()
        try:
            message = await call.read()
        except grpc.aio.AioRpcError as err:
            self._finish()
            if self._past_deadline():
                raise self._timed_out(err.details() or str(err.code())) from err
            raise map_error(
                err, model=self._model, request_id=self._request_id, sequence_id=self._sequence_id
            ) from err
        except asyncio.CancelledError:
            self._finish()  # cancelled: cancel the call, so the server stops this request's work
            task = asyncio.current_task()
            if task is not None and task.cancelling() == 0 and self._past_deadline():
                # Nobody cancelled this task: grpc raises CancelledError for a call that ended "locally cancelled"
                # around its deadline (seen under load with a 0.2 s deadline). That is this request's timeout, and
                # a CancelledError the caller never asked for would tear down whatever awaits it.
                raise self._timed_out("the call was cancelled at its deadline") from None
            raise
        except BaseException:
            self._finish()
            raise
        if message is grpc.aio.EOF:
            self._finish()
            if self._many:
                # Without the final flag nobody can tell whether the answer is whole.
                raise ConnectError(
                    f"model {self._model!r}: the gRPC stream ended before the final response",
                    model=self._model,
                    sequence_id=self._sequence_id,
                )
            raise StopAsyncIteration
        if message.error_message:
            # The request is over (the server sends an error as its last response) and Triton ends the call by
            # itself. Cancelling it now would race that end: Triton 2.51 then crashes (SIGSEGV, or SIGABRT with
            # GRPC_CALL_ERROR_TOO_MANY_OPERATIONS), its known cancellation race, seen within seconds under
            # tests/test_chat_chaos.py, whose refused turns did exactly that.
            await self._settle()
            if self._past_deadline():
                raise self._timed_out(message.error_message)
            raise map_stream_error(
                message.error_message, model=self._model, request_id=self._request_id, sequence_id=self._sequence_id
            )
        response = message.infer_response
        if not self._many or is_final(response):
            self._finish(complete=True)
            if self._many and not response.outputs:
                raise StopAsyncIteration
        return InferResult.from_grpc(response)

    async def aclose(self) -> None:
        """Cancel the call if its answer is not over (the server sees the cancellation); else let it end."""
        if self._done:
            await self._settle()
        else:
            self._finish()

    async def _settle(self) -> None:
        """Done reading an answer that is over: let the server end the call (read to its end, bounded); cancel it
        only if it does not end in time, or if this task is cancelled meanwhile.

        Not cancelling matters even after the final response: a call dropped before it has ended is cancelled by
        grpc when it is collected, which races Triton's own end of the call (the crash described above).
        """
        self._done = True
        call = self._call
        if call is None or call.done():
            return
        try:
            async with asyncio.timeout(_SETTLE_S):
                while await call.read() is not grpc.aio.EOF:
                    pass  # what a misbehaving model sends after its error is not this request's answer
        except (grpc.aio.AioRpcError, TimeoutError):
            pass
        finally:
            if not call.done():
                call.cancel()

    def _past_deadline(self) -> bool:
        return self._deadline is not None and asyncio.get_running_loop().time() >= self._deadline

    def _timed_out(self, said: str) -> RequestTimeout:
        # A failure once the call's deadline has passed is the deadline's doing: grpc then reports, racing with its
        # own DEADLINE_EXCEEDED, INTERNAL "Internal error from Core", and the server may answer the request its
        # deadline cancelled with an error of its own (both seen against Triton 2.51 under load). The caller asked
        # for a bound on time and must see the timeout, not a server fault.
        return RequestTimeout(
            f"model {self._model!r}: no answer within {self._timeout_s} s on the gRPC stream ({said})",
            model=self._model,
            request_id=self._request_id,
            status="DEADLINE_EXCEEDED",
            sequence_id=self._sequence_id,
        )
