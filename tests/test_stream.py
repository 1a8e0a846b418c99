"""The gRPC stream multiplexer against the real server, with raw protobuf requests to ``scale_fp32``."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from triton_npu_client import (
    Client,
    ClientClosedError,
    InternalServerError,
    InvalidArgumentError,
    LocalTriton,
    ModelNotFoundError,
    RequestTimeout,
    TransportError,
    UsageError,
    default_model_repository,
)
from triton_npu_client._transport._stream import StreamMultiplexer


def scale_request(x: np.ndarray[Any, Any], *, model: str = "scale_fp32") -> Any:
    request = service_pb2.ModelInferRequest(model_name=model)
    tensor = request.inputs.add()
    tensor.name = "INPUT0"
    tensor.datatype = "FP32"
    tensor.shape.extend(x.shape)
    request.raw_input_contents.append(np.ascontiguousarray(x, dtype=np.float32).tobytes())
    return request


def output0(response: Any) -> np.ndarray[Any, Any]:
    return np.frombuffer(response.raw_output_contents[0], dtype=np.float32).reshape(tuple(response.outputs[0].shape))


@pytest.fixture
async def channel(triton_server: LocalTriton) -> AsyncIterator[grpc.aio.Channel]:
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{triton_server.grpc_port}")
    try:
        yield ch
    finally:
        await ch.close()


@pytest.mark.parametrize("streams", [1, 3])
async def test_many_concurrent_requests_each_get_their_own_answer(channel: grpc.aio.Channel, streams: int) -> None:
    """400 concurrent requests over one stream or a pool of three: every caller gets 2 * its own input."""
    rng = np.random.default_rng(streams)
    inputs = [rng.standard_normal((1, int(rng.integers(1, 9)))).astype(np.float32) for _ in range(400)]
    async with StreamMultiplexer(channel, streams=streams) as mux:

        async def one(i: int) -> np.ndarray[Any, Any]:
            return output0(await mux.infer(scale_request(inputs[i]), key=i))

        outputs = await asyncio.gather(*(one(i) for i in range(len(inputs))))
        assert mux.pending_count == 0
    for x, y in zip(inputs, outputs, strict=True):
        np.testing.assert_array_equal(y, x * 2)


async def test_a_failing_request_does_not_disturb_the_others(channel: grpc.aio.Channel) -> None:
    """Unknown-model and bad-shape requests fail with their own mapped errors; good ones on the same stream succeed."""
    async with StreamMultiplexer(channel) as mux:

        async def good(v: float) -> np.ndarray[Any, Any]:
            return output0(await mux.infer(scale_request(np.full((1, 3), v, np.float32))))

        async def unknown() -> None:
            await mux.infer(scale_request(np.ones((1, 3), np.float32), model="no_such_model"))

        async def bad_shape() -> None:
            request = scale_request(np.ones((1, 3), np.float32))
            request.inputs[0].shape[:] = [1, 5]  # claims 5 values, carries 3
            await mux.infer(request)

        coros: list[Any] = []
        for i in range(30):
            coros += [good(float(i)), unknown(), bad_shape()]
        results: list[Any] = await asyncio.gather(*coros, return_exceptions=True)
        for i in range(30):
            np.testing.assert_array_equal(results[3 * i], np.full((1, 3), 2.0 * i, np.float32))
            assert isinstance(results[3 * i + 1], ModelNotFoundError)
            assert results[3 * i + 1].model == "no_such_model"
            assert isinstance(results[3 * i + 2], InvalidArgumentError)
        # The stream survived all of it.
        np.testing.assert_array_equal(await good(7.0), np.full((1, 3), 14.0, np.float32))


async def test_close_fails_pending_requests_and_refuses_new_ones(channel: grpc.aio.Channel) -> None:
    """aclose() fails a request still waiting for its answer with ClientClosedError, and later calls too."""
    mux = StreamMultiplexer(channel)
    waiting = asyncio.create_task(mux.infer(scale_request(np.ones((1, 4), np.float32))))
    responses = mux.stream(scale_request(np.ones((1, 4), np.float32)))
    await asyncio.sleep(0)  # let the task run up to its await on the answer (one loop turn, not a timing guess)
    assert mux.pending_count == 2
    await mux.aclose()
    with pytest.raises(ClientClosedError):
        await waiting
    with pytest.raises(ClientClosedError):
        await anext(responses)
    with pytest.raises(ClientClosedError):
        await mux.infer(scale_request(np.ones((1, 4), np.float32)))
    assert mux.pending_count == 0


async def test_a_cancelled_caller_drops_its_answer_and_the_stream_goes_on(channel: grpc.aio.Channel) -> None:
    """Cancelling a waiting caller forgets its request; the next request on the same stream is answered."""
    async with StreamMultiplexer(channel) as mux:
        task = asyncio.create_task(mux.infer(scale_request(np.ones((1, 4), np.float32))))
        await asyncio.sleep(0)
        assert mux.pending_count == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert mux.pending_count == 0
        answer = await mux.infer(scale_request(np.full((1, 2), 3.0, np.float32)))
        np.testing.assert_array_equal(output0(answer), np.full((1, 2), 6.0, np.float32))


async def test_client_side_timeout_raises_request_timeout(channel: grpc.aio.Channel) -> None:
    """A zero client-side wait raises RequestTimeout (also a TimeoutError) and leaves nothing pending."""
    async with StreamMultiplexer(channel) as mux:
        with pytest.raises(RequestTimeout) as info:
            await mux.infer(scale_request(np.ones((1, 4), np.float32)), timeout_s=0)
        assert isinstance(info.value, TimeoutError)
        assert mux.pending_count == 0


async def test_streamed_request_ends_on_the_final_flag(channel: grpc.aio.Channel) -> None:
    """stream() asks for the final flag and ends after it: a non-decoupled model yields exactly one response."""
    x = np.arange(6, dtype=np.float32).reshape(1, 6)
    async with StreamMultiplexer(channel) as mux:
        request = scale_request(x)
        async with mux.stream(request) as responses:
            got = [output0(r) async for r in responses]
        # The caller's protobuf is left as it was given (only its id is set).
        assert "triton_enable_empty_final_response" not in request.parameters
        assert mux.pending_count == 0
    assert len(got) == 1
    np.testing.assert_array_equal(got[0], x * 2)


async def test_stream_failure_fails_pending_then_a_new_stream_opens(tmp_path: Path) -> None:
    """Killing the server fails a pending request with a TransportError; after a restart a new stream opens."""
    shutil.copytree(default_model_repository() / "scale_fp32", tmp_path / "scale_fp32")
    server = LocalTriton(tmp_path, stop_grace_s=0)
    async with server:
        # Only the gRPC port is reused: the old HTTP port may sit in TIME_WAIT after the kill.
        grpc_port = server.grpc_port
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
        mux = StreamMultiplexer(ch)
        try:
            first = await mux.infer(scale_request(np.ones((1, 2), np.float32)))
            np.testing.assert_array_equal(output0(first), np.full((1, 2), 2.0, np.float32))
            responses = mux.stream(scale_request(np.ones((1, 2), np.float32)))
            # Blocking stop on purpose: the server is dead before the loop can even send the request,
            # so it is certainly pending when the stream breaks.
            server.stop()
            with pytest.raises(TransportError):
                async for _ in responses:
                    pass
            assert mux.pending_count == 0
            async with LocalTriton(tmp_path, grpc_port=grpc_port, stop_grace_s=0):
                again = await mux.infer(scale_request(np.full((1, 2), 5.0, np.float32)))
                np.testing.assert_array_equal(output0(again), np.full((1, 2), 10.0, np.float32))
                await mux.aclose()
        finally:
            await mux.aclose()
            await ch.close()


def repeat_request(n: int) -> Any:
    request = service_pb2.ModelInferRequest(model_name="repeat_int32")
    tensor = request.inputs.add()
    tensor.name = "N"
    tensor.datatype = "INT32"
    tensor.shape.extend([1])
    request.raw_input_contents.append(np.array([n], dtype=np.int32).tobytes())
    return request


async def test_decoupled_responses_stream_in_order_and_end_on_final_flag(channel: grpc.aio.Channel) -> None:
    """A decoupled model's N responses arrive in order per request, interleaved requests apart, then end."""
    async with StreamMultiplexer(channel) as mux:

        async def pieces(n: int) -> list[int]:
            async with mux.stream(repeat_request(n)) as responses:
                return [int(np.frombuffer(r.raw_output_contents[0], np.int32)[0]) async for r in responses]

        counts = [0, 1, 7, 3, 12, 5]
        got = await asyncio.gather(*(pieces(n) for n in counts))
        assert got == [list(range(n)) for n in counts]
        assert mux.pending_count == 0


async def test_decoupled_error_ends_its_stream_only(channel: grpc.aio.Channel) -> None:
    """An error response on one decoupled request raises from its iterator; a concurrent one completes."""
    async with StreamMultiplexer(channel) as mux, mux.stream(repeat_request(4)) as good:
        with pytest.raises(InternalServerError, match="N must be >= 0, got -1"):
            async with mux.stream(repeat_request(-1)) as bad:
                _ = [r async for r in bad]
        assert [int(np.frombuffer(r.raw_output_contents[0], np.int32)[0]) async for r in good] == [0, 1, 2, 3]


async def test_decoupled_spec_read_from_the_real_config(triton_server: LocalTriton) -> None:
    """The model handle knows repeat_int32 is decoupled, and unary inference on it is refused before sending."""
    async with Client(triton_server.grpc_url) as client:
        model = await client.model("repeat_int32")
        assert model.spec.decoupled is True
        with pytest.raises(UsageError, match="decoupled"):
            await model.infer(N=np.array([2], dtype=np.int32))
