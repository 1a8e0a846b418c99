"""Bounded concurrency with results in input order: the engine of a scoring job (groundwork for ``score()``).

:func:`ordered_map` pulls items from a (sync or async) iterable, runs ``fn`` on at most ``concurrency`` of them at
once, and yields ``(item, outcome)`` pairs strictly in input order, where an outcome is the result or the exception
that item raised: one bad item never stops the others, and the caller decides what a failure means (an errors file,
a retry).

Memory stays bounded whatever the input's size: the input is pulled only when a slot is free, and the results that
finished out of order wait in a window of at most ``concurrency`` entries. A slow head item therefore holds back the
pulling of new ones (head-of-line blocking); that is the price of bounded memory with ordered output.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from typing import TypeVar

__all__ = ["ordered_map"]

T = TypeVar("T")
R = TypeVar("R")


async def _aiter(items: Iterable[T] | AsyncIterable[T]) -> AsyncGenerator[T, None]:
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
) -> AsyncIterator[tuple[T, R | Exception]]:
    """Yield ``(item, fn(item) or its exception)`` in input order, with at most ``concurrency`` calls in flight.

    ``Exception`` subclasses raised by ``fn`` are yielded as outcomes; anything else (``CancelledError``,
    ``KeyboardInterrupt``) propagates. Leaving the loop early, or an error pulling the input, cancels the calls
    still in flight and waits for them to end.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    source = _aiter(items)
    window: deque[tuple[T, asyncio.Task[R]]] = deque()
    exhausted = False
    try:
        while True:
            # Fill the window: the only place the input is pulled, so at most `concurrency` items are ever held.
            while not exhausted and len(window) < concurrency:
                try:
                    item = await anext(source)
                except StopAsyncIteration:
                    exhausted = True
                    break
                window.append((item, asyncio.ensure_future(fn(item))))
            if not window:
                return
            item, task = window[0]
            outcome: R | Exception
            try:
                # Shielded: cancelling the consumer must not look like a failed call; the finally below cancels.
                outcome = await asyncio.shield(task)
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # the consumer was cancelled
                outcome = RuntimeError("the call was cancelled")  # fn cancelled itself: that item's outcome
            except Exception as err:
                outcome = err
            window.popleft()
            yield item, outcome
    finally:
        pending = [task for _, task in window if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for _, task in window:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: no "exception was never retrieved" warning for dropped results
        await source.aclose()
