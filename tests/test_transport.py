"""The transport layer's guarantees against the real server: the multiplexer's close and reader failure, its bound
on requests in flight, one gRPC channel with keepalive, the stream pool size, the own-stream route and the HTTP
connection limit."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import numpy as np
import pytest

from triton_npu_client import Call, Client, ClientClosedError, LocalTriton, TransportError, TritonError, UsageError
from triton_npu_client._client._model import Model
from triton_npu_client._transport import GrpcTransport
from triton_npu_client._transport._grpc import DEFAULT_CHANNEL_OPTIONS
from triton_npu_client._transport._stream import OwnStreamCall, StreamMultiplexer

# Generous: only reached when something hangs, never part of a passing run's timing.
SAFETY_NET_S = 30.0


@pytest.fixture
async def client(triton_server: LocalTriton) -> AsyncIterator[Client]:
    async with Client(triton_server.grpc_url) as c:
        yield c


@pytest.fixture
def channel(client: Client) -> grpc.aio.Channel:
    transport = client.transport
    assert isinstance(transport, GrpcTransport)
    return transport.channel


@pytest.fixture
async def scale(client: Client) -> Model:
    return await client.model("scale_fp32")


@pytest.fixture
async def slow(client: Client) -> Model:
    return await client.model("slow_echo")


def scale_proto(scale: Model) -> Any:
    return scale.request(INPUT0=np.ones(2, np.float32)).to_grpc(request_id="-")


def slow_proto(slow: Model, delay_s: float) -> Any:
    return slow_request(slow, delay_s).to_grpc(request_id="-")


def slow_request(slow: Model, delay_s: float) -> Any:
    return slow.request(INPUT0=np.ones(3, np.float32), DELAY_S=np.array([delay_s], np.float32))


# -- the multiplexer's close and its readers ------------------------------------------------------------


async def test_mux_aclose_keeps_its_callers_cancellation_and_still_closes_every_stream(
    channel: grpc.aio.Channel, scale: Model, slow: Model
) -> None:
    """A task cancelled while awaiting mux.aclose() ends cancelled; the mux is closed and requests pending on
    every stream (not only the one being awaited) fail with ClientClosedError."""
    mux = StreamMultiplexer(channel, streams=2)
    try:
        for key in (0, 1):  # hash(k) % 2: one live stream per slot
            await mux.call(scale_proto(scale), key=key, timeout_s=SAFETY_NET_S).single()
        assert all(s is not None and s.alive for s in mux._slots)
        # Slow requests: no answer can arrive while the test steps through the close.
        waiting = [
            asyncio.create_task(mux.call(slow_proto(slow, 2.0), key=key, timeout_s=SAFETY_NET_S).single())
            for key in (0, 1)
        ]
        await asyncio.sleep(0)
        assert mux.pending_count == 2
        closing = asyncio.create_task(mux.aclose())
        await asyncio.sleep(0)  # closing runs up to its wait for the stopped readers
        assert not closing.done()
        closing.cancel()
        await asyncio.wait([closing])
        assert closing.cancelled()
        assert mux.is_closed
        async with asyncio.timeout(SAFETY_NET_S):
            for task in waiting:
                with pytest.raises(ClientClosedError):
                    await task
    finally:
        await mux.aclose()


async def test_a_cancelled_reader_fails_pending_requests_and_the_next_opens_a_new_stream(
    channel: grpc.aio.Channel, scale: Model, slow: Model
) -> None:
    """Cancelling a live stream's reader task fails the request waiting on it with ClientClosedError at once
    (instead of leaving it to hang); the next request opens a fresh stream."""
    async with StreamMultiplexer(channel) as mux:
        await mux.call(scale_proto(scale), timeout_s=SAFETY_NET_S).single()
        stream = mux._slots[0]
        assert stream is not None
        waiting = asyncio.create_task(mux.call(slow_proto(slow, 2.0)).single())  # no client deadline
        await asyncio.sleep(0)
        assert mux.pending_count == 1
        stream._reader.cancel()
        async with asyncio.timeout(SAFETY_NET_S):
            with pytest.raises(ClientClosedError):
                await waiting
        assert mux.pending_count == 0
        again = await mux.call(scale_proto(scale), timeout_s=SAFETY_NET_S).single()
        np.testing.assert_array_equal(again["OUTPUT0"], np.full((1, 2), 2.0, np.float32))
        assert mux._slots[0] is not stream


async def test_requests_beyond_max_pending_wait_before_they_are_sent(channel: grpc.aio.Channel, slow: Model) -> None:
    """max_pending=2: a third request is not sent (its on_send does not run) until one of the first two is
    answered."""
    events: list[tuple[str, int]] = []
    pending_at_send: dict[int, int] = {}
    async with StreamMultiplexer(channel, max_pending=2) as mux:

        def on_send(i: int) -> Callable[[], None]:
            def record() -> None:
                events.append(("send", i))
                pending_at_send[i] = mux.pending_count

            return record

        async def one(i: int) -> None:
            call = mux.call(slow_proto(slow, 0.3), timeout_s=SAFETY_NET_S, on_send=on_send(i))
            await call.single()
            events.append(("answer", i))

        await asyncio.gather(*(one(i) for i in range(3)))
    assert events[:2] == [("send", 0), ("send", 1)]
    assert events[2] in (("answer", 0), ("answer", 1))
    assert events[3] == ("send", 2)
    # Never more than two sent and unanswered, the third included.
    assert pending_at_send[0] == 0
    assert pending_at_send[1] == 1
    assert pending_at_send[2] <= 1


# -- gRPC: one channel, keepalive ----------------------------------------------------------------------------


async def test_a_grpc_client_opens_one_channel(triton_server: LocalTriton, monkeypatch: pytest.MonkeyPatch) -> None:
    """Construction, an admin call, a unary and a shared-stream inference all run on one channel."""
    opened: list[grpc.aio.Channel] = []
    real_insecure = grpc.aio.insecure_channel

    def counting(*args: Any, **kwargs: Any) -> grpc.aio.Channel:
        channel = real_insecure(*args, **kwargs)
        opened.append(channel)
        return channel

    monkeypatch.setattr(grpc.aio, "insecure_channel", counting)
    async with Client(triton_server.grpc_url) as client:
        assert await client.is_server_ready()
        model = await client.model("scale_fp32")
        unary = await model.infer(INPUT0=np.ones(2, np.float32))
        shared = await client.transport.call(
            Call(request=model.request(INPUT0=np.ones(2, np.float32)), timeout_s=SAFETY_NET_S, route="shared")
        ).single()
        np.testing.assert_array_equal(unary["OUTPUT0"], shared["OUTPUT0"])
        transport = client.transport
        assert isinstance(transport, GrpcTransport)
        assert opened == [transport.channel]


async def test_keepalive_is_on_by_default_and_caller_options_merge_over_it() -> None:
    """The defaults ping a connection at least every minute; a caller's options replace only what they name, and
    an unanswered ping fails the connection after the keepalive timeout in force (grpc's own ping timeout, 60 s
    unless set, follows it)."""
    assert DEFAULT_CHANNEL_OPTIONS["grpc.keepalive_time_ms"] <= 60_000
    plain = GrpcTransport("127.0.0.1:1")
    tuned = GrpcTransport(
        "127.0.0.1:1",
        channel_options={
            "grpc.keepalive_time_ms": 1000,
            "grpc.keepalive_timeout_ms": 500,
            "grpc.max_receive_message_length": 1234,
        },
    )
    try:
        options = dict(plain.channel_options)
        assert {k: options[k] for k in DEFAULT_CHANNEL_OPTIONS} == dict(DEFAULT_CHANNEL_OPTIONS)
        assert options["grpc.http2.ping_timeout_ms"] == DEFAULT_CHANNEL_OPTIONS["grpc.keepalive_timeout_ms"]
        options = dict(tuned.channel_options)
        assert options["grpc.keepalive_time_ms"] == 1000
        assert options["grpc.keepalive_timeout_ms"] == 500
        assert options["grpc.http2.ping_timeout_ms"] == 500
        assert options["grpc.max_receive_message_length"] == 1234
        assert options["grpc.max_send_message_length"] == DEFAULT_CHANNEL_OPTIONS["grpc.max_send_message_length"]
    finally:
        await plain.aclose()
        await tuned.aclose()


class BlackholeProxy:
    """A TCP forwarder on 127.0.0.1 to ``upstream_port``; :meth:`blackhole` silences the connections open now
    (bytes are read and dropped both ways, sockets stay open) while later connections forward normally."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream_port = upstream_port
        self._silenced: set[int] = set()  # connection numbers
        self._connections = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._pumps: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> BlackholeProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._pumps:
            task.cancel()
        for writer in self._writers:
            writer.close()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        await self._server.wait_closed()

    def blackhole(self) -> None:
        self._silenced.update(range(self._connections))

    async def _accept(self, down_reader: asyncio.StreamReader, down_writer: asyncio.StreamWriter) -> None:
        number = self._connections
        self._connections += 1
        self._writers.add(down_writer)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._upstream_port)
        except OSError:
            down_writer.close()
            return
        self._writers.add(up_writer)
        for source, sink in ((down_reader, up_writer), (up_reader, down_writer)):
            task = asyncio.create_task(self._pump(number, source, sink))
            self._pumps.add(task)

    async def _pump(self, number: int, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            try:
                while data := await source.read(65536):
                    if number not in self._silenced:
                        sink.write(data)
                        await sink.drain()
            finally:
                sink.close()


async def _answers(client: Client) -> bool:
    try:
        return await client.is_server_live(timeout_s=2.0)
    except TransportError:
        return False


async def test_keepalive_fails_a_request_pending_on_a_silent_connection(triton_server: LocalTriton) -> None:
    """A connection that goes silent (no FIN, no RST) fails the request pending on the shared stream with a
    transport error once a keepalive ping goes unanswered; the next request reconnects and succeeds."""
    async with (
        BlackholeProxy(triton_server.grpc_port) as proxy,
        Client(
            f"grpc://127.0.0.1:{proxy.port}",
            channel_options={"grpc.keepalive_time_ms": 1000, "grpc.keepalive_timeout_ms": 1000},
        ) as client,
    ):
        slow = await client.model("slow_echo")
        scale = await client.model("scale_fp32")
        sent = asyncio.Event()
        # The answer takes 2 s on the server, but the proxy is silenced as soon as the request leaves, so only
        # keepalive can end the wait.
        pending = client.transport.call(
            Call(request=slow_request(slow, 2.0), timeout_s=None, route="shared", on_send=sent.set)
        )
        waiting = asyncio.create_task(pending.single())
        await sent.wait()
        proxy.blackhole()
        async with asyncio.timeout(SAFETY_NET_S):
            with pytest.raises(TransportError):
                await waiting
        # The channel reconnects in the background; a request sent while the dead connection is still closing
        # may fail too (gRPC's own behaviour), so wait until the server answers again, as for a restart.
        async with asyncio.timeout(SAFETY_NET_S):
            while not await _answers(client):
                await asyncio.sleep(0.05)
        again = await client.transport.call(
            Call(request=scale.request(INPUT0=np.ones(2, np.float32)), timeout_s=SAFETY_NET_S, route="shared")
        ).single()
        np.testing.assert_array_equal(again["OUTPUT0"], np.full((1, 2), 2.0, np.float32))


# -- gRPC: the stream pool and the own-stream route ----------------------------------------------------------


async def test_streams_option_sizes_the_pool_and_keys_spread_over_it(triton_server: LocalTriton) -> None:
    """Client(streams=3) gives a 3-stream multiplexer; requests under different keys use more than one stream."""
    bare = GrpcTransport("127.0.0.1:1", streams=3)
    try:
        assert bare.multiplexer().streams == 3
    finally:
        await bare.aclose()
    with pytest.raises(UsageError):
        GrpcTransport("127.0.0.1:1", streams=0)
    async with Client(triton_server.grpc_url, streams=3) as client:
        transport = client.transport
        assert isinstance(transport, GrpcTransport)
        mux = transport.multiplexer()
        assert mux.streams == 3
        scale = await client.model("scale_fp32")
        used: set[int] = set()
        for key in range(6):
            call = mux.call(scale_proto(scale), key=key, timeout_s=SAFETY_NET_S)
            await call.single()
            assert call._stream is not None
            used.add(call._stream.index)
        assert len(used) > 1
        assert sum(1 for s in mux._slots if s is not None and s.alive) == len(used)


async def test_own_route_yields_every_response_then_stops(client: Client) -> None:
    """A decoupled request on its own call yields its N results, then stops, and its call is over."""
    model = await client.model("repeat_int32")
    responses = client.transport.call(
        Call(request=model.request(N=np.array([5], np.int32)), route="own", many=True, timeout_s=SAFETY_NET_S)
    )
    assert isinstance(responses, OwnStreamCall)
    got = [int(r["OUT"][0]) async for r in responses]
    assert got == [0, 1, 2, 3, 4]
    with pytest.raises(StopAsyncIteration):
        await anext(responses)
    # Complete: the client does not cancel it; the server ends the call with OK on its own, and the loop stopped
    # only once it had. (A call dropped before its end is cancelled by grpc when it is collected: Triton 2.51
    # crashes when such a cancellation races its own end of the call.)
    assert responses._call.done()
    assert await responses._call.code() == grpc.StatusCode.OK


async def test_an_own_route_call_refused_by_the_model_ends_on_the_server_side(client: Client) -> None:
    """A request the model refuses (its error is the last response) is not cancelled by the client: the server ends
    the call with OK before the error is raised (cancelling there raced Triton 2.51's own end and crashed it)."""
    model = await client.model("repeat_int32")
    responses = client.transport.call(
        Call(request=model.request(N=np.array([-1], np.int32)), route="own", many=True, timeout_s=SAFETY_NET_S)
    )
    assert isinstance(responses, OwnStreamCall)
    with pytest.raises(TritonError, match="N must be >= 0, got -1"):
        await anext(responses)
    assert responses._call.done()
    assert not responses._call.cancelled()
    assert await responses._call.code() == grpc.StatusCode.OK
    with pytest.raises(StopAsyncIteration):
        await anext(responses)


async def test_closing_an_own_route_call_early_cancels_it(client: Client) -> None:
    """Closing after the first of many responses cancels the gRPC call (the server still had plenty to send)."""
    model = await client.model("repeat_int32")
    responses = client.transport.call(
        Call(request=model.request(N=np.array([2000], np.int32)), route="own", many=True, timeout_s=SAFETY_NET_S)
    )
    assert isinstance(responses, OwnStreamCall)
    first = await anext(responses)
    assert int(first["OUT"][0]) == 0
    await responses.aclose()
    assert responses._call.cancelled()
    assert await responses._call.code() == grpc.StatusCode.CANCELLED
    with pytest.raises(StopAsyncIteration):
        await anext(responses)


# -- HTTP: the connection limit ------------------------------------------------------------------------------


async def test_http_requests_beyond_the_connection_limit_wait_before_they_are_sent(
    triton_server: LocalTriton,
) -> None:
    """http_connections=2 and three concurrent slow calls: the third's on_send runs only after one finished."""
    events: list[tuple[str, int]] = []
    async with Client(triton_server.http_url, http_connections=2) as client:
        slow = await client.model("slow_echo")

        async def one(i: int) -> None:
            call = client.transport.call(
                Call(
                    request=slow_request(slow, 0.3), timeout_s=SAFETY_NET_S, on_send=lambda: events.append(("send", i))
                )
            )
            await call.single()
            events.append(("answer", i))

        await asyncio.gather(*(one(i) for i in range(3)))
    assert events[:2] == [("send", 0), ("send", 1)]
    assert events[2] in (("answer", 0), ("answer", 1))
    assert events[3] == ("send", 2)


async def test_closing_a_shared_call_from_another_task_wakes_its_reader(client: Client) -> None:
    """aclose() from another task ends a reader waiting on the shared stream (it would otherwise wait forever)."""
    slow = await client.model("slow_echo")
    sent = asyncio.Event()
    responses = client.transport.call(
        Call(request=slow_request(slow, 3.0), timeout_s=None, route="shared", on_send=sent.set)
    )
    reader = asyncio.create_task(responses.single())
    await sent.wait()
    await responses.aclose()
    async with asyncio.timeout(SAFETY_NET_S):
        with pytest.raises(ClientClosedError):
            await reader
