"""ordered_map: results in input order, bounded in flight and in memory, failures per item, clean cancellation.

The pure tests decide the order in which calls finish with events (no sleeps); the last test runs it against the
real server's scale_fp32.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator

import numpy as np
import pytest

from triton_npu_client import Client, LocalTriton
from triton_npu_client._jobs import ordered_map


class Gate:
    """Calls that finish only when the test releases them, in the order it chooses; counts what is in flight."""

    def __init__(self) -> None:
        self.release: dict[int, asyncio.Event] = {}
        self.started: list[int] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.cancelled: list[int] = []
        self.pulled = 0

    def event(self, item: int) -> asyncio.Event:
        return self.release.setdefault(item, asyncio.Event())

    async def call(self, item: int) -> int:
        self.started.append(item)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await self.event(item).wait()
            if item % 7 == 3:
                raise ValueError(f"bad row {item}")
            return item * 10
        except asyncio.CancelledError:
            self.cancelled.append(item)
            raise
        finally:
            self.in_flight -= 1

    async def source(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            self.pulled += 1
            yield i


async def _release_in_random_order(gate: Gate, n: int, seed: int) -> None:
    rng = random.Random(seed)
    released: set[int] = set()
    while len(released) < n:
        await asyncio.sleep(0)  # let the consumer start what it can; this is a yield, not a delay
        waiting = [i for i in gate.started if i not in released]
        if waiting:
            pick = rng.choice(waiting)
            released.add(pick)
            gate.event(pick).set()


async def test_results_come_in_input_order_whatever_order_calls_finish() -> None:
    gate = Gate()
    n, concurrency = 60, 5
    releaser = asyncio.create_task(_release_in_random_order(gate, n, seed=11))
    out = [pair async for pair in ordered_map(gate.source(n), gate.call, concurrency=concurrency)]
    await releaser
    assert [item for item, _ in out] == list(range(n))
    for item, outcome in out:
        if item % 7 == 3:
            assert isinstance(outcome, ValueError)
            assert str(outcome) == f"bad row {item}"
        else:
            assert outcome == item * 10
    assert gate.most_in_flight == concurrency
    assert sorted(gate.started) == list(range(n))


async def test_the_input_is_pulled_only_as_slots_free_up() -> None:
    """Memory is bounded: with the head call held, no more than `concurrency` items are ever pulled."""
    gate = Gate()
    results = ordered_map(gate.source(1000), gate.call, concurrency=4)
    first = asyncio.ensure_future(anext(results))
    while len(gate.started) < 4:
        await asyncio.sleep(0)
    for i in (1, 2, 3):  # everything but the head finishes: the window is full, nothing more may be pulled
        gate.event(i).set()
    while gate.in_flight > 1:
        await asyncio.sleep(0)
    assert (gate.pulled, len(gate.started)) == (4, 4)
    gate.event(0).set()
    assert await first == (0, 0)
    await results.aclose()


async def test_a_wider_window_keeps_calls_running_past_a_slow_head() -> None:
    """window > concurrency: the head held, finished calls make room for new ones, never more than `concurrency`
    in flight and never more than `window` items held."""
    gate = Gate()
    results = ordered_map(gate.source(1000), gate.call, concurrency=2, window=5)
    first = asyncio.ensure_future(anext(results))
    for i in (1, 2, 3):  # the head (0) stays held; each later call finishes and another starts in its place
        while len(gate.started) < i + 1:
            await asyncio.sleep(0)
        assert gate.in_flight == 2
        gate.event(i).set()
    while len(gate.started) < 5 or gate.in_flight > 2:
        await asyncio.sleep(0)
    gate.event(4).set()
    while gate.in_flight > 1:
        await asyncio.sleep(0)
    assert (gate.pulled, len(gate.started), gate.most_in_flight) == (5, 5, 2)  # the window is full: no 6th pull
    gate.event(0).set()
    assert await first == (0, 0)
    rest = [await anext(results) for _ in range(4)]
    assert [item for item, _ in rest] == [1, 2, 3, 4]
    assert [outcome for item, outcome in rest if item != 3] == [10, 20, 40]
    assert isinstance(rest[2][1], ValueError)  # item 3 fails in the Gate
    await results.aclose()
    with pytest.raises(ValueError, match="window must be >= concurrency"):
        async for _ in ordered_map(range(3), gate.call, concurrency=3, window=2):
            pass


async def test_leaving_early_cancels_the_calls_in_flight_and_closes_the_input() -> None:
    gate = Gate()
    closed = asyncio.Event()

    async def source() -> AsyncIterator[int]:
        try:
            async for item in gate.source(100):
                yield item
        finally:
            closed.set()

    gate.event(0).set()
    async with contextlib.aclosing(ordered_map(source(), gate.call, concurrency=3)) as results:
        async for item, outcome in results:
            assert (item, outcome) == (0, 0)
            break
    assert closed.is_set()
    # 0 was yielded; 1 and 2 were in flight and are cancelled; nothing more was pulled.
    assert (gate.pulled, sorted(gate.started), sorted(gate.cancelled)) == (3, [0, 1, 2], [1, 2])
    assert gate.in_flight == 0


async def test_cancelling_the_consumer_cancels_the_calls() -> None:
    gate = Gate()

    async def consume() -> None:
        async for _ in ordered_map(gate.source(10), gate.call, concurrency=2):
            pass

    task = asyncio.create_task(consume())
    while len(gate.started) < 2:
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(gate.cancelled) == [0, 1]
    assert gate.in_flight == 0


async def test_plain_iterables_and_bad_concurrency() -> None:
    async def double(x: int) -> int:
        return 2 * x

    assert [p async for p in ordered_map(range(5), double, concurrency=2)] == [(i, 2 * i) for i in range(5)]
    with pytest.raises(ValueError, match="concurrency must be >= 1, got 0"):
        async for _ in ordered_map(range(5), double, concurrency=0):
            pass


async def test_rows_through_the_real_server_stay_in_order(triton_server: LocalTriton) -> None:
    """Batches of scale_fp32 at 8 in flight: every output lands with its own input, in order."""
    async with Client(triton_server.grpc_url, timeout_s=60) as client:
        model = await client.model("scale_fp32")

        async def score(rows: np.ndarray) -> np.ndarray:
            return (await model.infer_batch(INPUT0=rows))["OUTPUT0"]

        batches = [np.full((1 + i % 5, 4), float(i), np.float32) for i in range(120)]
        out = [pair async for pair in ordered_map(batches, score, concurrency=8)]
    assert len(out) == len(batches)
    for sent, (item, result) in zip(batches, out, strict=True):
        assert item is sent
        assert isinstance(result, np.ndarray)
        np.testing.assert_array_equal(result, sent * 2)
