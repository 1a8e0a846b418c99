"""Bounded concurrency with results in input order: the engine of a scoring job (groundwork for ``score()``).

:func:`ordered_map` pulls items from a (sync or async) iterable, runs ``fn`` on at most ``concurrency`` of them at
once, and yields ``(item, outcome)`` pairs strictly in input order, where an outcome is the result or the exception
that item raised: one bad item never stops the others, and the caller decides what a failure means (an errors file,
a retry).

Memory stays bounded whatever the input's size: the input is pulled only when a slot is free, and the results that
finished out of order wait in a window of at most ``window`` entries (default ``concurrency``). With the default, a
slow head item holds back the pulling of new ones (head-of-line blocking); a larger window keeps ``concurrency``
calls running past a slow head, holding a few more results: the price of bounded memory with ordered output.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from typing import TypeVar

__all__ = ["ordered_map"]

T = TypeVar("T")
R = TypeVar("R")


async def aiter_any(items: Iterable[T] | AsyncIterable[T]) -> AsyncGenerator[T, None]:
    """Iterate a sync or an async iterable alike; leaving early closes an async one's generator now."""
    if isinstance(items, AsyncIterable):
        iterator = aiter(items)
        try:
            async for item in iterator:
                yield item
        finally:
            # Leaving early closes the caller's async generator too (its finally blocks run now, not at collection).
            close = getattr(iterator, "aclose", None)
            if close is not None:
                await close()
    else:
        for item in items:
            yield item


async def ordered_map(
    items: Iterable[T] | AsyncIterable[T],
    fn: Callable[[T], Awaitable[R]],
    *,
    concurrency: int,
    window: int | None = None,
) -> AsyncIterator[tuple[T, R | Exception]]:
    """Yield ``(item, fn(item) or its exception)`` in input order, with at most ``concurrency`` calls in flight.

    ``window`` (default ``concurrency``) bounds the items held at once: those in flight plus those finished but
    waiting for an earlier one. A window larger than ``concurrency`` keeps ``concurrency`` calls running while a
    slow call holds the head, at the cost of holding up to ``window`` results.
    ``Exception`` subclasses raised by ``fn`` are yielded as outcomes; anything else (``CancelledError``,
    ``KeyboardInterrupt``) propagates. Leaving the loop early, or an error pulling the input, cancels the calls
    still in flight and waits for them to end.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    held = concurrency if window is None else window
    if held < concurrency:
        raise ValueError(f"window must be >= concurrency ({concurrency}), got {held}")
    source = aiter_any(items)
    pending: deque[tuple[T, asyncio.Task[R]]] = deque()
    running = 0  # calls started and not finished; kept in step by _done below
    exhausted = False
    # Set by every call as it finishes: one event to wait on, instead of asyncio.wait() hooking and unhooking a
    # callback on every pending task each time round (a measurable cost per request in a job of small rows).
    finished = asyncio.Event()

    def _done(_: asyncio.Task[R]) -> None:
        nonlocal running
        running -= 1
        finished.set()

    try:
        while True:
            # Fill: the only place the input is pulled, so at most `held` items are ever held.
            while not exhausted and len(pending) < held and running < concurrency:
                try:
                    item = await anext(source)
                except StopAsyncIteration:
                    exhausted = True
                    break
                task = asyncio.ensure_future(fn(item))
                running += 1
                task.add_done_callback(_done)
                pending.append((item, task))
            if not pending:
                return
            item, task = pending[0]
            if not task.done():
                # Wake on any call finishing: the head (yield it), or another while there is room to start one.
                finished.clear()
                await finished.wait()
                continue
            outcome: R | Exception
            if task.cancelled():
                outcome = RuntimeError("the call was cancelled")  # fn cancelled itself: that item's outcome
            else:
                err = task.exception()
                if err is None:
                    outcome = task.result()
                elif isinstance(err, Exception):
                    outcome = err
                else:
                    raise err
            pending.popleft()
            yield item, outcome
    finally:
        left = [task for _, task in pending if not task.done()]
        for task in left:
            task.cancel()
        if left:
            await asyncio.gather(*left, return_exceptions=True)
        for _, task in pending:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: no "exception was never retrieved" warning for dropped results
        await source.aclose()
