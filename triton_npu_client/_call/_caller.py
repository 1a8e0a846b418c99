"""The caller: what every request goes through between the handles above and the transport's one call primitive.

It applies the client's defaults (the per-call timeout), retries stateless requests under one deadline, and
routes stateless requests through the coalescer (on by default for dynamic_batching models). Model handles and
sessions hold a caller; a client made by ``with_options`` gets its own caller over the same transport.
"""

from __future__ import annotations

import time
from typing import Final

from .._errors import ClientClosedError, TritonError
from .._trace import AVAILABLE as TRACING
from .._trace import Span
from .._trace import start as start_span
from .._transport import OnSend, Responses, Route, Transport
from .._wire import InferRequest, InferResult
from ._coalesce import Coalescer
from ._defaults import UseClientDefault
from ._retry import NO_RETRY, RetryPolicy, is_retriable, run_with_retry

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

    def call(
        self,
        request: InferRequest,
        *,
        timeout_s: float | None,
        route: Route = "unary",
        many: bool = False,
        request_id: str = "",
        sequence_id: int | str | None = None,
        sequence_start: bool = False,
        sequence_end: bool = False,
        on_send: OnSend | None = None,
    ) -> Responses:
        """The transport's call primitive, as is: never retried, never coalesced (sequence steps, streams)."""
        if self.closed:
            raise ClientClosedError("the client this model handle belongs to is closed")
        return self.transport.call(
            request,
            timeout_s=timeout_s,
            route=route,
            many=many,
            request_id=request_id,
            sequence_id=sequence_id,
            sequence_start=sequence_start,
            sequence_end=sequence_end,
            on_send=on_send,
        )

    async def infer(
        self,
        request: InferRequest,
        *,
        timeout_s: float | None,
        request_id: str = "",
        retry: bool = True,
        coalesce: bool = True,
        max_batch_size: int = 0,
        dynamic_batching: bool = False,
    ) -> InferResult:
        """A stateless request answered once: coalesced when enabled and eligible, retried per the policy."""
        if self.closed:
            raise ClientClosedError("the client this model handle belongs to is closed")
        span = start_span("triton.infer", model=request.model, version=request.version) if TRACING else None
        # Current for the whole call (one task): the transport sends its context, the fleet notes its replica.
        token = span.attach() if span is not None else None
        try:
            coalescer = self.coalescer
            policy = self.retry if retry else NO_RETRY
            if coalesce and coalescer is not None and not request_id and coalescer.eligible(
                request, max_batch_size=max_batch_size, dynamic_batching=dynamic_batching
            ):
                if span is not None:
                    span.set("triton.coalesced", True)
                result = await coalescer.infer(
                    request,
                    timeout_s=timeout_s,
                    max_batch_size=max_batch_size,
                    # The merged request's own budget (its earliest member's), not this caller's whole timeout.
                    send=lambda merged, budget_s: self._send(merged, budget_s, "", policy, span),
                )
            else:
                result = await self._send(request, timeout_s, request_id, policy)
        except BaseException as err:
            if span is not None:
                span.finish(err)
            raise
        finally:
            if span is not None:
                span.detach(token)
        if span is not None:
            span.set_first_response()
            span.finish()
        return result

    async def _send(
        self,
        request: InferRequest,
        timeout_s: float | None,
        request_id: str,
        policy: RetryPolicy,
        span: Span | None = None,
    ) -> InferResult:
        if span is not None:
            # A merged request is sent from the coalescer's task: it carries the span of the caller whose send it
            # took (the batch's oldest), so Triton's span of the batch hangs under that caller's span.
            token = span.attach()
            try:
                return await self._send(request, timeout_s, request_id, policy)
            finally:
                span.detach(token)
        transport = self.transport
        # The first attempt is the hot path: no retry machinery unless it fails with something retriable.
        started = time.monotonic()
        try:
            return await transport.call(request, timeout_s=timeout_s, request_id=request_id).single()
        except TritonError as err:
            if policy.max_attempts == 1 or not is_retriable(err):
                raise
            first = err

        async def attempt(remaining_s: float | None) -> InferResult:
            return await transport.call(request, timeout_s=remaining_s, request_id=request_id).single()

        # One deadline across every attempt, the first included.
        left = None if timeout_s is None else timeout_s - (time.monotonic() - started)
        return await run_with_retry(attempt, policy, timeout_s=left, failed_first=first)
