"""Opt-in client-side batching: concurrent stateless requests to one model travel as one batched request.

Why: on the 2-core machines this SDK targets, gRPC's per-call machinery in Python (~250-350 us of client CPU
per call, whether unary or one message on a stream) is the client's whole cost, and it is taken from the
server. Sixteen callers waiting on the same model can share one call instead: rows are concatenated (the
encoded bytes, no re-validation), sent as one request with a batch of N, and the answer is sliced back
per caller. Measured here at 16 in flight on ``scale_fp32``: ~3x the throughput, client CPU per request
from ~300 us to ~80 us (see ``bench/RESULTS.md``).

How: per (model, version, input signature, requested outputs, timeout) group, at most
``max_in_flight`` merged requests are outstanding. A request arriving while a slot is free is sent at once
(an idle client adds no latency); otherwise it waits for the next free slot and leaves with everything
that queued meanwhile, up to the model's ``max_batch_size`` rows. Nothing waits on a timer.

What changes for callers (why it is opt-in, see :class:`Coalescing`):

- Rows of different callers execute in one batch, as Triton's dynamic batcher would do on the server: only
  for models whose rows are independent (what any model with ``dynamic_batching`` already promises).
- An error of the merged request (model error, timeout, transport) is raised to every caller in it.
- Cancelling a caller whose request is still queued here removes it (nothing is sent for it); once its
  merged request is sent, cancelling drops its answer but does not cancel the shared gRPC call.
- Requests with a ``request_id``, sequence steps, unbatched models (``max_batch_size`` 0) and requests with
  more rows than half the model's ``max_batch_size`` are never coalesced; they take the ordinary path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Hashable
from typing import Final

import attrs
import numpy as np

from .._errors import ClientClosedError
from .._wire import EncodedInput, InferRequest, InferResult

__all__ = ["Coalescer", "Coalescing"]

_log = logging.getLogger("triton_npu_client.coalesce")

_CLOSED: Final = "The client was closed while this request waited to be coalesced."


@attrs.frozen(kw_only=True)
class Coalescing:
    """Client-side batching of concurrent stateless requests (``Client(url, coalescing=Coalescing())``).

    ``max_in_flight``: merged requests outstanding per model and input signature. 1 gives the biggest
    batches; 2 (the default) lets one batch queue on the server while another runs, which kept the server
    busy at low concurrency in the measurements (``bench/RESULTS.md``).
    Off by default: it changes error sharing and cancellation (see the module docstring).
    """

    max_in_flight: int = attrs.field(default=2, validator=attrs.validators.ge(1))


class _Waiting:
    __slots__ = ("future", "request")

    def __init__(self, request: InferRequest, future: asyncio.Future[InferResult]) -> None:
        self.request = request
        self.future = future


class _Group:
    __slots__ = ("in_flight", "queue")

    def __init__(self) -> None:
        self.queue: list[_Waiting] = []
        self.in_flight = 0


Send = Callable[[InferRequest], Awaitable[InferResult]]


def _signature(request: InferRequest, timeout_s: float | None) -> Hashable:
    return (
        request.model,
        request.version,
        tuple((i.name, i.dtype, i.shape[1:]) for i in request.inputs),
        request.outputs,
        timeout_s,
    )


def merge(requests: list[InferRequest]) -> InferRequest:
    """One request whose rows are the rows of ``requests`` in order (same model, inputs and outputs)."""
    first = requests[0]
    if len(requests) == 1:
        return first
    inputs = []
    for k, enc in enumerate(first.inputs):
        parts = [r.inputs[k] for r in requests]
        rows = sum(p.shape[0] for p in parts)
        inputs.append(
            EncodedInput(
                name=enc.name,
                dtype=enc.dtype,
                shape=(rows, *enc.shape[1:]),
                # Row-major wire bytes (BYTES too: length-prefixed elements) concatenate along the batch dim.
                data=b"".join(p.data for p in parts),
                array=np.concatenate([p.array for p in parts]),
            )
        )
    return InferRequest(
        model=first.model,
        version=first.version,
        inputs=tuple(inputs),
        outputs=first.outputs,
        batch_size=sum(r.batch_size or 0 for r in requests),
    )


def split(result: InferResult, sizes: list[int]) -> list[InferResult]:
    """The per-request results of a merged result: each output sliced along its batch dim."""
    if len(sizes) == 1:
        return [result]
    arrays = {name: result[name] for name in result}
    out = []
    start = 0
    for n in sizes:
        stop = start + n
        out.append(
            InferResult(
                model=result.model,
                version=result.version,
                outputs={name: arr[start:stop] for name, arr in arrays.items()},
            )
        )
        start = stop
    return out


class Coalescer:
    """The queues of one client. :meth:`infer` sends a request alone or with others, as slots allow."""

    def __init__(self, policy: Coalescing) -> None:
        self._policy = policy
        self._groups: dict[Hashable, _Group] = {}
        self._tasks: dict[asyncio.Task[None], list[_Waiting]] = {}
        self._closed = False

    def __repr__(self) -> str:
        queued = sum(len(g.queue) for g in self._groups.values())
        return f"<Coalescer max_in_flight={self._policy.max_in_flight} tasks={len(self._tasks)} queued={queued}>"

    @staticmethod
    def eligible(request: InferRequest, *, max_batch_size: int) -> bool:
        """Whether ``request`` may be merged: batched, and small enough to leave room for others."""
        rows = request.batch_size
        return rows is not None and max_batch_size > 1 and rows * 2 <= max_batch_size

    async def infer(
        self, request: InferRequest, *, timeout_s: float | None, max_batch_size: int, send: Send
    ) -> InferResult:
        """Send ``request`` (possibly merged with others) through ``send`` and return its own result."""
        if self._closed:
            raise ClientClosedError(_CLOSED)
        key = _signature(request, timeout_s)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group()
        future: asyncio.Future[InferResult] = asyncio.get_running_loop().create_future()
        group.queue.append(_Waiting(request, future))
        if group.in_flight < self._policy.max_in_flight:
            self._launch(key, group, max_batch_size, send)
        # A caller cancelled here cancels its future: _take skips it, so a queued request is never sent.
        return await future

    def _take(self, group: _Group, max_batch_size: int) -> list[_Waiting]:
        batch: list[_Waiting] = []
        rows = 0
        queue = group.queue
        i = 0
        while i < len(queue):
            w = queue[i]
            if w.future.done():  # cancelled while queued
                i += 1
                continue
            n = w.request.batch_size or 0
            if rows + n > max_batch_size:
                break
            batch.append(w)
            rows += n
            i += 1
        del queue[:i]
        return batch

    def _launch(self, key: Hashable, group: _Group, max_batch_size: int, send: Send) -> None:
        batch = self._take(group, max_batch_size)
        if not batch:
            if not group.queue and group.in_flight == 0:
                self._groups.pop(key, None)
            return
        group.in_flight += 1
        task = asyncio.get_running_loop().create_task(self._run(key, group, batch, max_batch_size, send))
        # Held until done; aclose() fails the batch of a task cancelled before it ever ran.
        self._tasks[task] = batch
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)

    async def _run(self, key: Hashable, group: _Group, batch: list[_Waiting], max_batch_size: int, send: Send) -> None:
        try:
            merged = merge([w.request for w in batch])
            result = await send(merged)
            parts = split(result, [w.request.batch_size or 0 for w in batch])
        except asyncio.CancelledError:
            for w in batch:
                if not w.future.done():
                    w.future.set_exception(ClientClosedError(_CLOSED))
            raise
        except Exception as err:
            _log.debug("coalesced request of %d failed: %r", len(batch), err)
            for w in batch:
                if not w.future.done():
                    w.future.set_exception(err)
        else:
            for w, part in zip(batch, parts, strict=True):
                if not w.future.done():
                    w.future.set_result(part)
        finally:
            group.in_flight -= 1
            if not self._closed:
                # Whatever queued while this batch was out leaves now, together.
                self._launch(key, group, max_batch_size, send)

    async def aclose(self) -> None:
        """Stop: merged requests in flight are cancelled, their callers and queued ones get ClientClosedError."""
        if self._closed:
            return
        self._closed = True
        for group in self._groups.values():
            for w in group.queue:
                if not w.future.done():
                    w.future.set_exception(ClientClosedError(_CLOSED))
            group.queue.clear()
        tasks = dict(self._tasks)
        for task in tasks:
            task.cancel()
        for task, batch in tasks.items():
            with contextlib.suppress(asyncio.CancelledError):
                await task
            for w in batch:
                if not w.future.done():
                    w.future.set_exception(ClientClosedError(_CLOSED))
        self._groups.clear()
