"""Client-side batching: concurrent stateless requests to one model travel as one batched request.

Why: on the 2-core machines this SDK targets, gRPC's per-call machinery in Python (~250-350 us of client CPU
per call, whether unary or one message on a stream) is the client's whole cost, and it is taken from the
server. Sixteen callers waiting on the same model can share one call instead: rows are concatenated (the
encoded bytes, no re-validation), sent as one request with a batch of N, and the answer is sliced back
per caller. Measured here at 16 in flight on ``scale_fp32``: ~3x the throughput, client CPU per request
from ~300 us to ~80 us (see ``bench/RESULTS.md``).

How: per group (model, version, input signature, requested outputs, timeout setting), at most
``max_in_flight`` merged requests are outstanding. A request arriving while a slot is free is sent at once
(an idle client adds no latency); otherwise it waits for the next free slot and leaves with everything
that queued meanwhile, up to the model's ``max_batch_size`` rows. No batch waits on a timer.

Bounded queue, backpressure: at most ``max_queued`` requests wait per group. A caller arriving at a full
queue waits for room, in arrival order, before its request joins the queue (as ``asyncio.Queue.put``
does) rather than being refused: a refusal would only move the waiting into a retry loop in every caller,
while waiting keeps arrival order and its timeout still bounds it. What the bound caps is the work the
coalescer owns: the requests each batch is cut from and that ``aclose`` must fail.

Deadlines: a caller's timeout runs from the moment it calls and covers waiting for room, queueing and the
merged call. A caller whose deadline passes before its request leaves gets
:class:`~triton_npu_client.RequestTimeout` and nothing is sent for it. A merged request runs under the
earliest deadline of its members, so no member waits past its own: ``send`` gets the earliest member's remaining
budget as its timeout (the gRPC deadline and Triton's server-side timeout), and the coalescer cancels the wait at
that deadline whatever ``send`` does with it.
The timeout setting (``timeout_s``, not the absolute deadline) is part of the group: callers that use the
same setting merge, and their deadlines differ only by when they arrived, so the earliest one cuts a later
member short by at most that spread; callers with other settings (1 s and 60 s, say) never share a request,
so a short one never cuts a long one. A group per absolute deadline would give every caller its own group.

What changes for callers (why a client does it by default only for ``dynamic_batching`` models, see
:class:`Coalescing`):

- Rows of different callers execute in one batch, as Triton's dynamic batcher would do on the server: only
  for models whose rows are independent (what any model with ``dynamic_batching`` already promises).
- A merged request the server refuses (a ``ServerError``: a model error, an input it rejects) is re-sent one
  caller at a time, so each caller gets its own answer or its own error, as with the server's own batching.
- A transport failure or a timeout of the merged request is raised to every caller in it, each getting its
  own copy (same type and attributes, ``__cause__`` the shared original), so what one caller does to its
  exception (traceback, notes, attributes) never shows in another's.
- A merged request that runs past its earliest member's deadline fails all its members with
  ``RequestTimeout``, members with later deadlines included.
- Cancelling a caller whose request is still queued here removes it (nothing is sent for it); once its
  merged request is sent, cancelling drops its answer but does not cancel the shared gRPC call.
- Requests with a ``request_id``, sequence steps, unbatched models (``max_batch_size`` 0) and requests with
  more rows than half the model's ``max_batch_size`` are never coalesced; they take the ordinary path.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable
from typing import Final, Literal

import attrs
import numpy as np

from .._errors import ClientClosedError, RequestTimeout, ServerError
from .._wire import EncodedInput, InferRequest, InferResult

__all__ = ["Coalescer", "Coalescing"]

_log = logging.getLogger("triton_npu_client.coalesce")

_CLOSED: Final = "The client was closed while this request waited to be coalesced."
# Requests admitted per group when Coalescing.max_queued is None, in units of the model's max_batch_size:
# every request has at least one row, so this is always enough for the next full batch of each slot.
_QUEUED_PER_BATCH: Final = 4


@attrs.frozen(kw_only=True)
class Coalescing:
    """Client-side batching of concurrent stateless requests (``Client(url, coalescing=Coalescing())``).

    ``max_in_flight``: merged requests outstanding per group (model, input signature, timeout). 1 gives the biggest
    batches; 2 (the default) lets one batch queue on the server while another runs, which kept the server
    busy at low concurrency in the measurements (``bench/RESULTS.md``).
    ``max_queued``: requests waiting per group to be merged; further callers wait for room (their timeout
    runs meanwhile). None (the default) is 4 times the model's ``max_batch_size``. A value below
    ``max_batch_size`` also caps how many requests one batch can take.
    ``models``: which models coalesce. ``"dynamic_batching"`` (the default, and the client's): only models whose
    config has ``dynamic_batching``, whose authors already let Triton merge requests; ``"batched"``: any model with a
    batch dimension (``max_batch_size`` > 1). A merged request the server refuses (a model error, an input it
    rejects) is re-sent caller by caller, so each caller gets its own answer or its own error; a transport failure
    or a timeout reaches every caller in the batch (each its own copy).
    """

    max_in_flight: int = attrs.field(default=2, validator=attrs.validators.ge(1))
    models: Literal["dynamic_batching", "batched"] = attrs.field(
        default="dynamic_batching", validator=attrs.validators.in_(("dynamic_batching", "batched"))
    )
    max_queued: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.ge(1)))


# send(request, timeout_s): the request's own call, under ``timeout_s`` (None: no limit).
Send = Callable[[InferRequest, float | None], Awaitable[InferResult]]
_Place = dict["_Waiting", None]  # an insertion-ordered set: FIFO, and O(1) removal of a cancelled caller


class _Waiting:
    """One caller: its request, the future its result arrives on, its deadline and where it waits."""

    __slots__ = ("deadline", "future", "max_batch_size", "place", "request", "send", "timeout_s", "timer")

    def __init__(
        self,
        request: InferRequest,
        future: asyncio.Future[InferResult],
        *,
        timeout_s: float | None,
        deadline: float | None,
        max_batch_size: int,
        send: Send,
    ) -> None:
        self.request = request
        self.future = future
        self.timeout_s = timeout_s
        self.deadline = deadline
        self.max_batch_size = max_batch_size
        self.send = send
        self.place: _Place | None = None  # group.queue or group.overflow while it waits; None once it left
        self.timer: asyncio.TimerHandle | None = None


class _Group:
    __slots__ = ("capacity", "in_flight", "overflow", "queue")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.queue: _Place = {}  # admitted: at most `capacity`, what the next batches are cut from
        self.overflow: _Place = {}  # callers waiting for room in the queue (backpressure)
        self.in_flight = 0

    def idle(self) -> bool:
        return not self.queue and not self.overflow and self.in_flight == 0


def _signature(request: InferRequest, timeout_s: float | None) -> Hashable:
    # The relative timeout, not the deadline: see "Deadlines" in the module docstring.
    return (
        request.model,
        request.version,
        tuple((i.name, i.dtype, i.shape[1:]) for i in request.inputs),
        request.outputs,
        timeout_s,
    )


def own_copy(err: BaseException) -> BaseException:
    """A new exception of ``err``'s type with its args and attributes, ``__cause__`` ``err``.

    Built without calling ``__init__`` (whose parameters vary by class), so any exception copies; one that
    refuses (a ``__new__`` of its own with other needs) is returned as is.
    """
    cls = type(err)
    try:
        twin = cls.__new__(cls, *err.args)
        state = dict(err.__dict__)
        if "__notes__" in state:  # add_note() appends in place: each copy gets its own list
            state["__notes__"] = list(state["__notes__"])
        twin.__dict__.update(state)
    except Exception:  # pragma: no cover - a class whose __new__ wants other arguments than its args
        _log.debug("could not copy %r; its callers share it", err)
        return err
    twin.__cause__ = err
    return twin


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


def _budget(limit: asyncio.Timeout) -> float:
    """What remains until ``limit``'s deadline, in seconds (0 once it has passed): the timeout ``send`` gets."""
    when = limit.when()
    assert when is not None  # only made with a deadline
    return max(0.0, when - asyncio.get_running_loop().time())


class Coalescer:
    """The queues of one client. :meth:`infer` sends a request alone or with others, as slots allow."""

    def __init__(self, policy: Coalescing) -> None:
        self._policy = policy
        self._groups: dict[Hashable, _Group] = {}
        self._tasks: dict[asyncio.Task[None], list[_Waiting]] = {}
        self._closed = False

    def __repr__(self) -> str:
        queued = sum(len(g.queue) for g in self._groups.values())
        waiting = sum(len(g.overflow) for g in self._groups.values())
        return (
            f"<Coalescer max_in_flight={self._policy.max_in_flight} tasks={len(self._tasks)} "
            f"queued={queued} waiting_for_room={waiting}>"
        )

    def eligible(self, request: InferRequest, *, max_batch_size: int, dynamic_batching: bool = True) -> bool:
        """Whether ``request`` may be merged: a model in scope, batched, and small enough to leave room for others."""
        if not dynamic_batching and self._policy.models == "dynamic_batching":
            return False
        rows = request.batch_size
        return rows is not None and max_batch_size > 1 and rows * 2 <= max_batch_size

    async def infer(
        self, request: InferRequest, *, timeout_s: float | None, max_batch_size: int, send: Send
    ) -> InferResult:
        """Send ``request`` (possibly merged with others) through ``send`` and return its own result.

        ``timeout_s`` (None: no limit) counts from this call and covers the wait here and the merged call.
        A merged request goes through the ``send`` of its oldest caller with the earliest deadline of its callers:
        ``send`` gets what remains of it as its timeout, and the coalescer cancels the call when it passes (they get
        ``RequestTimeout``), whatever ``send`` does with that timeout.
        """
        if self._closed:
            raise ClientClosedError(_CLOSED)
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        key = _signature(request, timeout_s)
        group = self._groups.get(key)
        if group is None:
            capacity = self._policy.max_queued or _QUEUED_PER_BATCH * max_batch_size
            group = self._groups[key] = _Group(max(capacity, 1))
        w = _Waiting(
            request,
            loop.create_future(),
            timeout_s=timeout_s,
            deadline=deadline,
            max_batch_size=max_batch_size,
            send=send,
        )
        place = group.queue if len(group.queue) < group.capacity and not group.overflow else group.overflow
        place[w] = None
        w.place = place
        self._launch(key, group)
        if deadline is not None and w.place is not None:  # no timer for one sent at once (the usual case)
            w.timer = loop.call_at(deadline, self._expire, key, group, w)
        try:
            return await w.future
        finally:
            if w.timer is not None:
                w.timer.cancel()
            if w.place is not None:  # cancelled while waiting here: leave, so it is never sent
                self._leave(group, w)
                self._launch(key, group)

    def _leave(self, group: _Group, w: _Waiting) -> None:
        """Take ``w`` out of the queue or the overflow; a place freed in the queue goes to the next in line."""
        place = w.place
        if place is None:
            return
        w.place = None
        del place[w]
        if place is group.queue:
            self._admit(group)

    def _admit(self, group: _Group) -> None:
        overflow = group.overflow
        while overflow and len(group.queue) < group.capacity:
            w = next(iter(overflow))
            del overflow[w]
            if w.future.done():  # cancelled; its own finally sees place None and does nothing more
                w.place = None
                continue
            group.queue[w] = None
            w.place = group.queue

    def _expire(self, key: Hashable, group: _Group, w: _Waiting) -> None:
        """Timer callback at ``w``'s deadline: if it is still waiting here, it fails and is never sent."""
        if w.place is None:  # already sent: its merged request runs under a deadline no later than this one
            return
        self._leave(group, w)
        if not w.future.done():
            w.future.set_exception(self._queued_timeout(w))
        self._launch(key, group)

    @staticmethod
    def _queued_timeout(w: _Waiting) -> RequestTimeout:
        return RequestTimeout(
            f"The {w.timeout_s} s timeout passed while the request waited to be coalesced; it was not sent.",
            model=w.request.model,
            version=w.request.version or None,
        )

    def _take(self, group: _Group) -> list[_Waiting]:
        """The next batch from the head of the queue: up to its head's ``max_batch_size`` rows."""
        batch: list[_Waiting] = []
        rows = 0
        queue = group.queue
        now = asyncio.get_running_loop().time()
        limit = 0
        while queue:
            w = next(iter(queue))
            if w.future.done():  # cancelled, its task not yet resumed: drop it here
                del queue[w]
                w.place = None
                continue
            if w.deadline is not None and w.deadline <= now:  # its timer is due but has not run yet
                del queue[w]
                w.place = None
                w.future.set_exception(self._queued_timeout(w))
                continue
            n = w.request.batch_size or 0
            if not batch:
                limit = w.max_batch_size
            elif rows + n > limit:
                break
            del queue[w]
            w.place = None
            if w.timer is not None:
                w.timer.cancel()
            batch.append(w)
            rows += n
        self._admit(group)
        return batch

    def _launch(self, key: Hashable, group: _Group) -> None:
        """Send batches while the group has free slots and queued requests; forget the group once idle."""
        loop = asyncio.get_running_loop()
        while not self._closed and group.in_flight < self._policy.max_in_flight and group.queue:
            batch = self._take(group)
            if not batch:  # every queued one had left; those admitted from the overflow meanwhile go next
                continue
            group.in_flight += 1
            task = loop.create_task(self._run(key, group, batch))
            # Held until done; aclose() fails the batch of a task cancelled before it ever ran.
            self._tasks[task] = batch
            task.add_done_callback(self._forget)
        if group.idle() and self._groups.get(key) is group:
            del self._groups[key]

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)

    async def _run(self, key: Hashable, group: _Group, batch: list[_Waiting]) -> None:
        deadlines = [w.deadline for w in batch if w.deadline is not None]
        # The earliest deadline of the batch: no member waits past its own.
        limit = asyncio.timeout_at(min(deadlines)) if deadlines else None
        try:
            merged = merge([w.request for w in batch])
            if limit is None:
                result = await batch[0].send(merged, None)
            else:
                async with limit:
                    result = await batch[0].send(merged, _budget(limit))
            parts = split(result, [w.request.batch_size or 0 for w in batch])
        except asyncio.CancelledError:
            for w in batch:
                if not w.future.done():
                    w.future.set_exception(ClientClosedError(_CLOSED))
            raise
        except ServerError as err:
            if len(batch) == 1 or (limit is not None and limit.expired()):
                self._fail(batch, err, limit)
            else:
                # The server refused the merged request: send each caller's own rows alone, so that each gets its
                # own answer or its own error, as with Triton's own batching (stateless requests only come here).
                _log.debug("coalesced request of %d refused (%r): re-sent one by one", len(batch), err)
                await asyncio.gather(*(self._alone(w, limit) for w in batch))
        except Exception as err:
            self._fail(batch, err, limit)
        else:
            for w, part in zip(batch, parts, strict=True):
                if not w.future.done():
                    w.future.set_result(part)
        finally:
            group.in_flight -= 1
            # Whatever queued while this batch was out leaves now, together.
            self._launch(key, group)

    @staticmethod
    async def _alone(w: _Waiting, limit: asyncio.Timeout | None) -> None:
        try:
            if limit is None:
                result = await w.send(w.request, None)
            else:
                async with asyncio.timeout_at(limit.when()):
                    result = await w.send(w.request, _budget(limit))
        except Exception as err:
            if not w.future.done():
                w.future.set_exception(err)
        else:
            if not w.future.done():
                w.future.set_result(result)

    @staticmethod
    def _fail(batch: list[_Waiting], err: Exception, limit: asyncio.Timeout | None) -> None:
        error: Exception = err
        if limit is not None and limit.expired():
            error = RequestTimeout(
                f"The coalesced request of {len(batch)} callers ran past the earliest of their deadlines.",
                model=batch[0].request.model,
                version=batch[0].request.version or None,
            )
            error.__cause__ = err
        _log.debug("coalesced request of %d failed: %r", len(batch), error)
        for w in batch:
            if not w.future.done():
                w.future.set_exception(own_copy(error))

    async def aclose(self) -> None:
        """Stop: merged requests in flight are cancelled, their callers and queued ones get ClientClosedError.

        Waits for the cancelled merged requests to unwind. Cancelling the caller of ``aclose`` during that
        wait cancels it as usual (the coalescer is closed by then all the same).
        """
        if self._closed:
            return
        self._closed = True
        for group in self._groups.values():
            for place in (group.queue, group.overflow):
                for w in place:
                    w.place = None
                    if not w.future.done():
                        w.future.set_exception(ClientClosedError(_CLOSED))
                place.clear()
        self._groups.clear()
        tasks = dict(self._tasks)
        for task, batch in tasks.items():
            task.cancel()
            # A task cancelled before it ever ran never reaches its own handler: fail its callers here.
            for w in batch:
                if not w.future.done():
                    w.future.set_exception(ClientClosedError(_CLOSED))
        if tasks:
            # asyncio.wait does not raise for the tasks' own cancellation, so only a cancellation aimed at
            # our caller interrupts it, and that one propagates.
            await asyncio.wait(tasks)
