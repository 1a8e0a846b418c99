"""Session steps answered by many responses (a decoupled sequence model), cancelled one at a time, against the server.

``seq_count_stream`` keeps a per-sequence counter and answers a step with N responses, each carrying the counter
after one more increment, and how many cancelled steps the instance has stopped (``CANCELLED``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest

from triton_npu_client import Client, InvalidArgumentError, LocalTriton, Model, SequenceSession, UsageError

MODEL = "seq_count_stream"


@pytest.fixture
async def counter(triton_server: LocalTriton) -> AsyncIterator[Model]:
    async with Client(triton_server.grpc_url, timeout_s=60) as client:
        yield await client.model(MODEL)


def n(value: int, delay_ms: int = 0) -> dict[str, np.ndarray]:
    inputs = {"N": np.array([value], np.int32)}
    if delay_ms:
        inputs["DELAY_MS"] = np.array([delay_ms], np.int32)
    return inputs


def values(results: list) -> list[int]:  # type: ignore[type-arg]
    return [int(r["VALUE"][0, 0]) for r in results]


async def cancelled_count(model: Model) -> int:
    """The instance's count of stopped (cancelled) steps, read with a fresh one-response sequence."""
    async with model.sequence() as probe:
        return int((await probe.infer(n(1)))["CANCELLED"][0, 0])


async def test_a_step_streams_every_response(counter: Model) -> None:
    """seq.stream() yields all N responses of a step; state carries across steps; infer() takes a one-response step."""
    async with counter.sequence() as seq:
        first = [r async for r in seq.stream(n(5))]
        assert values(first) == [1, 2, 3, 4, 5]
        second = [r async for r in seq.stream(n(3))]
        assert values(second) == [6, 7, 8]
        assert values([await seq.infer(n(1))]) == [9]
        # A step answered several times cannot be returned as one result: a clear error after it ran...
        with pytest.raises(UsageError, match="2 responses"):
            await seq.infer(n(2))
        # ...and the session goes on: the next step continues the counter.
        assert values([r async for r in seq.stream(n(1), end=True)]) == [12]
        assert seq.steps_acknowledged == 5
        assert not seq.is_open


async def test_a_model_error_on_a_later_step_is_that_steps_error(counter: Model) -> None:
    """A step the model refuses (N < 0) raises its own error; the sequence is not lost and goes on."""
    async with counter.sequence() as seq:
        assert values([r async for r in seq.stream(n(2))]) == [1, 2]
        with pytest.raises(InvalidArgumentError):
            async for _ in seq.stream({"N": np.array([-1], np.int32)}):
                pass
        assert not seq.is_lost
        assert values([r async for r in seq.stream(n(1))]) == [3]


async def test_cancelling_one_streamed_step_stops_it_on_the_server(counter: Model) -> None:
    """Cancel one long streamed step while other sessions stream on: the server stops that work, the session lives."""
    before = await cancelled_count(counter)
    got: list[int] = []
    three = asyncio.Event()

    async def long_step(seq: SequenceSession) -> None:
        async for r in seq.stream(n(10_000, delay_ms=10)):
            got.append(int(r["VALUE"][0, 0]))
            if len(got) == 3:
                three.set()

    async def other(offset: int) -> list[int]:
        async with counter.sequence() as seq:
            out: list[int] = []
            for _ in range(3):
                out += values([r async for r in seq.stream(n(4, delay_ms=5))])
            return out

    async with counter.sequence() as victim:
        task = asyncio.create_task(long_step(victim))
        others = [asyncio.create_task(other(i)) for i in range(3)]
        await three.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert task.cancelled()
        # Other sessions were not disturbed.
        for result in await asyncio.gather(*others):
            assert result == list(range(1, 13))
        # The server noticed: its count of stopped steps rises by one (it reacts within one pass of its loop).
        deadline = time.monotonic() + 30
        while (now := await cancelled_count(counter)) == before and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert now == before + 1
        # The session is still usable, and the cancelled step stopped early: the counter went on from where the
        # server stopped it, far short of 10,000 (the responses read, plus at most the passes before it noticed).
        assert victim.is_open
        nxt = values([r async for r in victim.stream(n(1))])[0]
        assert len(got) + 1 <= nxt < 10_000
        assert nxt < len(got) + 500


async def test_leaving_the_loop_early_cancels_the_step(counter: Model) -> None:
    """Breaking out of the loop (inside aclosing) cancels the step on the server; the next step is accepted."""
    before = await cancelled_count(counter)
    async with counter.sequence() as seq:
        async with contextlib.aclosing(seq.stream(n(10_000, delay_ms=10))) as responses:
            async for r in responses:
                if int(r["VALUE"][0, 0]) == 2:
                    break
        deadline = time.monotonic() + 30
        while (now := await cancelled_count(counter)) == before and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert now == before + 1
        assert values([r async for r in seq.stream(n(1))])[0] < 500


async def test_http_refuses_a_decoupled_sequence_model(triton_server: LocalTriton) -> None:
    """A decoupled model is served only over the gRPC stream: an HTTP session is refused before any I/O."""
    async with Client(triton_server.http_url) as client:
        model = await client.model(MODEL)
        with pytest.raises(UsageError, match="gRPC"):
            model.sequence()


async def test_the_next_step_right_after_a_cancel_is_accepted(counter: Model) -> None:
    """Cancel a streamed step and send the next one at once: not refused as busy, and it continues the counter."""
    async with counter.sequence() as seq:
        for _ in range(3):
            async with contextlib.aclosing(seq.stream(n(10_000, delay_ms=5))) as responses:
                async for r in responses:
                    if int(r["VALUE"][0, 0]) % 2 == 0:
                        break
            assert len(values([r async for r in seq.stream(n(1))])) == 1
        assert seq.is_open
