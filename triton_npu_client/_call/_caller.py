"""The caller: what every request goes through between the handles above and the transport's one call primitive.

It applies the client's defaults (the per-call timeout), retries stateless requests under one deadline, and
routes stateless requests through the coalescer (on by default for dynamic_batching models). Model handles and
sessions hold a caller; a client made by ``with_options`` gets its own caller over the same transport.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import Final

import attrs

from .._errors import ClientClosedError, TritonError
from .._trace import AVAILABLE as TRACING
from .._trace import Span
from .._trace import start as start_span
from .._transport import NO_RETRY, Call, Responses, RetryPolicy, Transport, run_with_retry
from .._wire import InferRequest, InferResult
from ._coalesce import Coalescer
from ._defaults import UseClientDefault

__all__ = ["Caller"]


class Caller:
    """A transport plus the client's defaults: ``timeout_s`` per call, ``retry`` for stateless requests."""

    __slots__ = ("closed", "coalescer", "retry", "timeout_s", "transport")

    def __init__(
        self,
        transport: Transport,
        *,
        timeout_s: float | None,
        retry: RetryPolicy,
        coalescer: Coalescer | None = None,
    ) -> None:
        self.transport: Final = transport
        self.timeout_s: Final = timeout_s
        self.retry: Final = retry
        self.coalescer: Final = coalescer
        # Set by the client that made this caller when it closes; handles made from it refuse from then on.
        self.closed = False

    def __repr__(self) -> str:
        return f"<Caller {self.transport!r} timeout_s={self.timeout_s}>"

    def timeout(self, timeout_s: float | UseClientDefault | None) -> float | None:
        """``timeout_s``, or the client's default when it was not given."""
        return self.timeout_s if isinstance(timeout_s, UseClientDefault) else timeout_s

    def call(self, call: Call) -> Responses:
        """The transport's call primitive, as is: never retried, never coalesced (sequence steps, streams)."""
        if self.closed:
            raise ClientClosedError("the client this model handle belongs to is closed")
        return self.transport.call(call)

    async def infer(
        self,
        request: InferRequest,
        *,
        timeout_s: float | None,
        request_id: str = "",
        retry: bool | RetryPolicy = True,
        coalesce: bool = True,
        max_batch_size: int = 0,
        dynamic_batching: bool = False,
    ) -> InferResult:
        """A stateless request answered once: coalesced when enabled and eligible, retried per the policy
        (``retry``: the client's policy, none, or this one)."""
        if self.closed:
            raise ClientClosedError("the client this model handle belongs to is closed")
        policy = self._policy(retry)
        coalescer = self.coalescer
        if not (coalesce and coalescer is not None and not request_id and coalescer.eligible(
            request, max_batch_size=max_batch_size, dynamic_batching=dynamic_batching
        )):
            call = Call(request=request, timeout_s=timeout_s, request_id=request_id)
            return await (self._traced(call, policy) if TRACING else self._send(call, policy))
        span = start_span("triton.infer", model=request.model, version=request.version) if TRACING else None

        def merged_send(merged: InferRequest, budget_s: float | None) -> Awaitable[InferResult]:
            # The merged request's own budget (its earliest member's), not this caller's whole timeout.
            call = Call(request=merged, timeout_s=budget_s)
            return self._send(call, policy) if span is None else self._send_under(span, call, policy)

        coalesced = coalescer.infer(request, timeout_s=timeout_s, max_batch_size=max_batch_size, send=merged_send)
        if span is None:
            return await coalesced
        span.set("triton.coalesced", True)
        return await _spanned(span, coalesced)

    async def send(self, call: Call, retry: bool | RetryPolicy = True) -> InferResult:
        """A stateless ``call`` answered once, retried per ``retry`` (as :meth:`infer`), never coalesced: the path
        of a request that was built and checked already (a scoring job's batches) and needs nothing else."""
        if self.closed:
            raise ClientClosedError("the client this model handle belongs to is closed")
        policy = self._policy(retry)
        return await (self._traced(call, policy) if TRACING else self._send(call, policy))

    def _policy(self, retry: bool | RetryPolicy) -> RetryPolicy:
        if retry is True:
            return self.retry
        return NO_RETRY if retry is False else retry

    async def _traced(self, call: Call, policy: RetryPolicy) -> InferResult:
        request = call.request
        span = start_span("triton.infer", model=request.model, version=request.version)
        if span is None:
            return await self._send(call, policy)
        # Current for the whole call (one task): the transport sends its context, the fleet notes its replica.
        return await _spanned(span, self._send(call, policy))

    async def _send_under(self, span: Span, call: Call, policy: RetryPolicy) -> InferResult:
        # A merged request is sent from the coalescer's task: it carries the span of the caller whose send it took
        # (the batch's oldest), so Triton's span of the batch hangs under that caller's span.
        token = span.attach()
        try:
            return await self._send(call, policy)
        finally:
            span.detach(token)

    async def _send(self, call: Call, policy: RetryPolicy) -> InferResult:
        transport = self.transport
        # The first attempt is the hot path: no retry machinery unless it fails with something the policy retries.
        started = time.monotonic()
        try:
            return await transport.call(call).single()
        except TritonError as err:
            if (policy.max_attempts == 1 and policy.max_moves == 0) or not policy.retriable(err):
                raise
            first = err

        async def attempt(budget_s: float | None) -> InferResult:
            again = call if budget_s == call.timeout_s else attrs.evolve(call, timeout_s=budget_s)
            return await transport.call(again).single()

        elsewhere = getattr(transport, "elsewhere", None)
        timeout_s = call.timeout_s
        if policy.patience_s is None and timeout_s is not None:
            timeout_s -= time.monotonic() - started  # one deadline across every attempt, the first included
        return await run_with_retry(
            attempt, policy, timeout_s=timeout_s, failed_first=first,
            elsewhere=None if elsewhere is None else lambda: bool(elsewhere(call)),
        )  # fmt: skip


async def _spanned(span: Span, answer: Awaitable[InferResult]) -> InferResult:
    """``answer`` awaited with ``span`` current, its outcome and first response recorded on it."""
    token = span.attach()
    try:
        result = await answer
    except BaseException as err:
        span.finish(err)
        raise
    finally:
        span.detach(token)
    span.set_first_response()
    span.finish()
    return result
