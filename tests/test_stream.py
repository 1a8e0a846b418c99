"""The gRPC stream multiplexer against the real server: requests from ``model.request(...).to_grpc()``,
answers as :class:`InferResult`."""

from __future__ import annotations

import asyncio
import shutil
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from triton_npu_client import (
    Call,
    Client,
    ClientClosedError,
    InternalServerError,
    LocalTriton,
    ModelNotFoundError,
    RequestTimeout,
    TransportError,
    UsageError,
    default_model_repository,
)
from triton_npu_client._client._model import Model
from triton_npu_client._transport import GrpcTransport
from triton_npu_client._transport._stream import _SEND_QUEUE, Outgoing, SharedStreamCall, StreamMultiplexer

# Generous: only reached when something hangs, never part of a passing run's timing.
SAFETY_NET_S = 30.0


@pytest.fixture
async def client(triton_server: LocalTriton) -> AsyncIterator[Client]:
    async with Client(triton_server.grpc_url) as c:
        yield c


@pytest.fixture
def channel(client: Client) -> grpc.aio.Channel:
    """The client's one channel: each test puts a multiplexer of its own on it."""
    transport = client.transport
    assert isinstance(transport, GrpcTransport)
    return transport.channel


@pytest.fixture
async def scale(client: Client) -> Model:
    return await client.model("scale_fp32")


@pytest.fixture
async def repeat(client: Client) -> Model:
    return await client.model("repeat_int32")


def scale_proto(scale: Model, x: np.ndarray[Any, Any]) -> Any:
    """A fresh ``ModelInferRequest`` for scale_fp32 (sample form: the batch dim of 1 is added)."""
    return scale.request(INPUT0=x).to_grpc(request_id="-")


def repeat_proto(repeat: Model, n: int) -> Any:
    return repeat.request(N=np.array([n], dtype=np.int32)).to_grpc(request_id="-")


@pytest.mark.parametrize("streams", [1, 3])
async def test_many_concurrent_requests_each_get_their_own_answer_in_order_per_key(
    channel: grpc.aio.Channel, scale: Model, streams: int
) -> None:
    """400 concurrent requests under 10 keys: every caller gets 2 * its own input; one key stays on one stream
    and its answers come back in the order its requests were sent."""
    rng = np.random.default_rng(streams)
    inputs = [rng.standard_normal(int(rng.integers(1, 9))).astype(np.float32) for _ in range(400)]
    answered: dict[int, list[int]] = defaultdict(list)
    stream_of: dict[int, set[int]] = defaultdict(set)
    async with StreamMultiplexer(channel, streams=streams) as mux:

        async def one(i: int) -> np.ndarray[Any, Any]:
            key = i % 10
            call = mux.call(scale_proto(scale, inputs[i]), key=key, timeout_s=60)
            result = await call.single()
            answered[key].append(i)
            assert call._stream is not None
            stream_of[key].add(call._stream.index)
            return result["OUTPUT0"]

        # Tasks start in index order, so each key's requests are sent in index order.
        outputs = await asyncio.gather(*(one(i) for i in range(len(inputs))))
        assert mux.pending_count == 0
    for x, y in zip(inputs, outputs, strict=True):
        np.testing.assert_array_equal(y, (x * 2)[None, :])
    for key, order in answered.items():
        assert order == sorted(order), f"key {key} answered out of order"
    assert all(len(indices) == 1 for indices in stream_of.values())
    assert len(set().union(*stream_of.values())) == streams


async def test_a_failing_request_does_not_disturb_the_others(channel: grpc.aio.Channel, scale: Model) -> None:
    """Unknown-model and bad-shape requests fail with their own mapped errors; good ones on the same stream succeed."""
    async with StreamMultiplexer(channel) as mux:

        async def good(v: float) -> np.ndarray[Any, Any]:
            result = await mux.call(scale_proto(scale, np.full(3, v, np.float32)), timeout_s=60).single()
            return result["OUTPUT0"]

        async def unknown() -> None:
            request = scale_proto(scale, np.ones(3, np.float32))
            request.model_name = "no_such_model"
            await mux.call(request, timeout_s=60).single()

        async def bad_shape() -> None:  # refused by Triton itself: over the stream, text without a status
            request = scale_proto(scale, np.ones(3, np.float32))
            request.inputs[0].shape[:] = [1, 5]  # claims 5 values, carries 3
            await mux.call(request, timeout_s=60).single()

        coros: list[Any] = []
        for i in range(30):
            coros += [good(float(i)), unknown(), bad_shape()]
        results: list[Any] = await asyncio.gather(*coros, return_exceptions=True)
        for i in range(30):
            np.testing.assert_array_equal(results[3 * i], np.full((1, 3), 2.0 * i, np.float32))
            assert isinstance(results[3 * i + 1], ModelNotFoundError)
            assert results[3 * i + 1].model == "no_such_model"
            # No status and no marker: InternalServerError, whatever words Triton's text uses; the text says why.
            assert type(results[3 * i + 2]) is InternalServerError
            assert "input byte size mismatch for input 'INPUT0'" in results[3 * i + 2].message
        # The stream survived all of it.
        np.testing.assert_array_equal(await good(7.0), np.full((1, 3), 14.0, np.float32))
        assert mux.pending_count == 0


async def test_close_fails_pending_requests_and_refuses_new_ones(channel: grpc.aio.Channel, scale: Model) -> None:
    """aclose() fails a request still waiting for its answer with ClientClosedError, and later calls too."""
    mux = StreamMultiplexer(channel)
    single = mux.call(scale_proto(scale, np.ones(4, np.float32)))
    streamed = mux.call(scale_proto(scale, np.ones(4, np.float32)), many=True)

    async def first_of_streamed() -> Any:
        return await anext(streamed)

    waiting = asyncio.create_task(single.single())
    reading = asyncio.create_task(first_of_streamed())
    # One loop turn: both tasks send and wait; the reader task made by the first has not run yet, so no
    # answer can have been routed (an ordering fact of the event loop, not a timing guess).
    await asyncio.sleep(0)
    assert mux.pending_count == 2
    await mux.aclose()
    with pytest.raises(ClientClosedError):
        await waiting
    with pytest.raises(ClientClosedError):
        await reading
    with pytest.raises(ClientClosedError):
        await mux.call(scale_proto(scale, np.ones(4, np.float32))).single()
    assert mux.pending_count == 0
    assert mux.is_closed


async def test_a_cancelled_caller_drops_its_answer_and_the_stream_goes_on(
    channel: grpc.aio.Channel, scale: Model
) -> None:
    """Cancelling a waiting caller forgets its request and frees its slot; the next request is answered."""
    # One slot: the next request can only be sent if the cancelled caller gave its slot back.
    async with StreamMultiplexer(channel, max_pending=1) as mux:
        task = asyncio.create_task(mux.call(scale_proto(scale, np.ones(4, np.float32))).single())
        await asyncio.sleep(0)
        assert mux.pending_count == 1
        stream = mux._slots[0]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert mux.pending_count == 0
        answer = await mux.call(scale_proto(scale, np.full(2, 3.0, np.float32)), timeout_s=60).single()
        np.testing.assert_array_equal(answer["OUTPUT0"], np.full((1, 2), 6.0, np.float32))
        assert mux._slots[0] is stream  # the same stream carried on


async def test_client_side_timeout_raises_request_timeout(channel: grpc.aio.Channel, scale: Model) -> None:
    """A zero client-side wait raises RequestTimeout (also a TimeoutError), leaves nothing pending and frees
    its slot."""
    async with StreamMultiplexer(channel, max_pending=1) as mux:
        with pytest.raises(RequestTimeout) as info:
            await mux.call(scale_proto(scale, np.ones(4, np.float32)), timeout_s=0).single()
        assert isinstance(info.value, TimeoutError)
        assert info.value.model == "scale_fp32"
        assert mux.pending_count == 0
        answer = await mux.call(scale_proto(scale, np.ones(2, np.float32)), timeout_s=60).single()
        np.testing.assert_array_equal(answer["OUTPUT0"], np.full((1, 2), 2.0, np.float32))


async def test_streamed_request_ends_on_the_final_flag(channel: grpc.aio.Channel, scale: Model) -> None:
    """many=True asks for the final flag and ends after it: a non-decoupled model yields exactly one result."""
    x = np.arange(6, dtype=np.float32)
    async with StreamMultiplexer(channel) as mux:
        request = scale_proto(scale, x)
        responses = mux.call(request, many=True, timeout_s=60)
        got = [r["OUTPUT0"] async for r in responses]
        # The caller's protobuf is left as it was given (only its id is set).
        assert "triton_enable_empty_final_response" not in request.parameters
        assert mux.pending_count == 0
        with pytest.raises(StopAsyncIteration):
            await anext(responses)
    assert len(got) == 1
    np.testing.assert_array_equal(got[0], (x * 2)[None, :])


async def test_stream_failure_fails_pending_then_a_new_stream_opens(tmp_path: Path) -> None:
    """Killing the server fails a pending request with a TransportError; after a restart a new stream opens."""
    shutil.copytree(default_model_repository() / "scale_fp32", tmp_path / "scale_fp32")
    server = LocalTriton(tmp_path, stop_grace_s=0)
    async with server, Client(server.grpc_url, streams=1) as client:
        # Only the gRPC port is reused: the old HTTP port may sit in TIME_WAIT after the kill.
        grpc_port = server.grpc_port
        scale = await client.model("scale_fp32")
        transport = client.transport
        assert isinstance(transport, GrpcTransport)
        mux = transport.multiplexer()
        first = await transport.call(
            Call(request=scale.request(INPUT0=np.ones(2, np.float32)), timeout_s=60, route="shared")
        ).single()
        np.testing.assert_array_equal(first["OUTPUT0"], np.full((1, 2), 2.0, np.float32))
        broken = mux._slots[0]
        responses = transport.call(
            Call(request=scale.request(INPUT0=np.ones(2, np.float32)), timeout_s=60, route="shared", many=True)
        )
        # Blocking stop on purpose: the loop cannot run before the server is dead, and the request is queued on
        # the (still open-looking) stream before the reader can see it break, so it is certainly pending.
        server.stop()
        with pytest.raises(TransportError):
            async for _ in responses:
                pass
        assert mux.pending_count == 0
        async with LocalTriton(tmp_path, grpc_port=grpc_port, stop_grace_s=0):
            # The channel may still be in its reconnect back-off (a fresh call fails fast there): wait it out.
            await client.wait_for_model_ready("scale_fp32")
            again = await transport.call(
                Call(request=scale.request(INPUT0=np.full(2, 5.0, np.float32)), timeout_s=60, route="shared")
            ).single()
            np.testing.assert_array_equal(again["OUTPUT0"], np.full((1, 2), 10.0, np.float32))
            assert transport.multiplexer() is mux
            assert mux._slots[0] is not broken
            await client.aclose()


async def test_decoupled_responses_stream_in_order_and_end_on_final_flag(
    channel: grpc.aio.Channel, repeat: Model
) -> None:
    """A decoupled model's N responses arrive in order per request, interleaved requests apart, then end."""
    async with StreamMultiplexer(channel) as mux:

        async def pieces(n: int) -> list[int]:
            responses: SharedStreamCall = mux.call(repeat_proto(repeat, n), many=True, timeout_s=60)
            return [int(r["OUT"][0]) async for r in responses]

        counts = [0, 1, 7, 3, 12, 5]
        got = await asyncio.gather(*(pieces(n) for n in counts))
        assert got == [list(range(n)) for n in counts]
        assert mux.pending_count == 0


async def test_decoupled_error_ends_its_stream_only(channel: grpc.aio.Channel, repeat: Model) -> None:
    """An error response on one decoupled request raises from its iterator; a concurrent one completes."""
    async with StreamMultiplexer(channel) as mux:
        good = mux.call(repeat_proto(repeat, 4), many=True, timeout_s=60)
        first = await anext(good)  # sent first, so it is in flight while the bad one fails
        bad = mux.call(repeat_proto(repeat, -1), many=True, timeout_s=60)
        with pytest.raises(InternalServerError, match="N must be >= 0, got -1"):
            _ = [r async for r in bad]
        rest = [int(r["OUT"][0]) async for r in good]
        assert [int(first["OUT"][0]), *rest] == [0, 1, 2, 3]
        assert mux.pending_count == 0


async def test_decoupled_spec_read_from_the_real_config(client: Client) -> None:
    """The model handle knows repeat_int32 is decoupled, and unary inference on it is refused before sending."""
    model = await client.model("repeat_int32")
    assert model.spec.decoupled is True
    with pytest.raises(UsageError, match="decoupled"):
        await model.infer(N=np.array([2], dtype=np.int32))


# -- a stream whose queue is full ----------------------------------------------------------------------------


class SilentPeer:
    """A TCP listener on 127.0.0.1 that accepts and never speaks HTTP/2: a gRPC call to it stays unconnected, its
    request iterator is never read, so the stream's queue fills. :meth:`kill` closes it all: the stream dies."""

    def __init__(self) -> None:
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self.port = 0

    async def __aenter__(self) -> SilentPeer:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.kill()
        assert self._server is not None
        await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)

    def kill(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()


def _nowhere() -> Outgoing:
    """A request that never reaches a server here: its bytes do not matter."""
    return Outgoing("m", None, lambda request_id, many: b"")


async def _full(mux: StreamMultiplexer) -> None:
    """Return once the multiplexer's one stream has a full queue (what the tests below need)."""
    async with asyncio.timeout(SAFETY_NET_S):
        while (stream := mux._slots[0]) is None or not stream._queue.full():
            await asyncio.sleep(0.01)


async def test_a_full_stream_queue_is_waited_on_only_until_the_callers_deadline() -> None:
    """A caller whose request meets a full stream queue gets RequestTimeout at its deadline, not a hang; the
    requests already queued are unaffected, and fail with a transport error when the stream dies."""
    async with SilentPeer() as peer:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{peer.port}")
        mux = StreamMultiplexer(channel)
        queued = [asyncio.create_task(mux.call(_nowhere()).single()) for _ in range(_SEND_QUEUE + 1)]
        try:
            await _full(mux)
            late = asyncio.create_task(mux.call(_nowhere(), timeout_s=0.2).single())
            done, _ = await asyncio.wait([late], timeout=SAFETY_NET_S)
            assert done == {late}, "the caller waited past its deadline for room in the stream's queue"
            assert type(late.exception()) is RequestTimeout
            assert not any(t.done() for t in queued)
            peer.kill()
            async with asyncio.timeout(SAFETY_NET_S):
                outcomes = await asyncio.gather(*queued, return_exceptions=True)
            assert all(isinstance(o, TransportError) for o in outcomes), {type(o) for o in outcomes}
            assert mux.pending_count == 0
        finally:
            for task in queued:
                task.cancel()
            await mux.aclose()
            await channel.close()


async def test_callers_waiting_for_room_in_a_dying_streams_queue_get_its_error() -> None:
    """Callers without a deadline waiting for room in a full queue fail with the stream's transport error when the
    stream dies, like the requests already queued: nobody will read that queue again."""
    async with SilentPeer() as peer:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{peer.port}")
        mux = StreamMultiplexer(channel)
        extra = 20  # beyond the queue (and the one request grpc may already hold): waiting for room
        calls = [asyncio.create_task(mux.call(_nowhere()).single()) for _ in range(_SEND_QUEUE + 1 + extra)]
        try:
            await _full(mux)
            await asyncio.sleep(0)  # every caller has reached the queue: queued, or waiting for room
            assert mux.pending_count == len(calls)
            peer.kill()
            done, _ = await asyncio.wait(calls, timeout=SAFETY_NET_S)
            assert len(done) == len(calls), f"{len(calls) - len(done)} callers still wait for a dead stream's queue"
            outcomes = [t.exception() for t in calls]
            assert all(isinstance(o, TransportError) for o in outcomes), {type(o) for o in outcomes}
            assert mux.pending_count == 0
        finally:
            for task in calls:
                task.cancel()
            await mux.aclose()
            await channel.close()
