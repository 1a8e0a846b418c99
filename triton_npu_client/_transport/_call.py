"""The one value a transport is asked to send: :class:`Call`.

A request plus how it travels (route, deadline, sequence flags, ...), frozen: the fleet sends the same value to
another replica, the retry loop sends it again, a test seam reads it; a change is ``attrs.evolve(call, ...)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import attrs

from .._wire import InferRequest

__all__ = ["Call", "OnSend", "Route", "TraceContext", "with_trace"]

# How one request travels:
#   "unary"   one RPC / HTTP request, one response;
#   "shared"  one message on the client's long-lived multiplexed gRPC stream (many requests share it, so a
#             request cannot be cancelled on the server alone);
#   "own"     its own gRPC ModelStreamInfer call: cancelling it cancels that request on the server.
Route = Literal["unary", "shared", "own"]

# Called once, right before the request leaves this process (after any wait for a connection or a stream slot):
# the session layer checks idleness there, not when the caller asked.
OnSend = Callable[[], None]

# W3C trace-context headers (``traceparent``, ``tracestate``) as lowercase (key, value) pairs.
TraceContext = tuple[tuple[str, str], ...]


@attrs.frozen(kw_only=True)
class Call:
    """One inference request and how it travels; what :meth:`Transport.call` takes.

    - ``timeout_s``: bounds the whole exchange on the client and, for stateless requests, is Triton's server-side
      timeout too (None: no limit).
    - ``route``: see :data:`Route`; checked against the transport's ``can_stream``.
    - ``many``: a decoupled model may answer several times and ends with the final flag (streamed routes only).
    - ``request_id``: Triton's request id (the shared stream numbers its requests itself).
    - ``sequence_id`` / ``sequence_start`` / ``sequence_end``: a step of a stateful model's sequence.
    - ``on_send``: called once, right before the request leaves this process.
    - ``trace``: the trace context to send with it; None (the default) sends the current span's, read when the
      call is made (the shared stream carries none of its own: Triton reads a stream's context when it opens).
    """

    request: InferRequest
    timeout_s: float | None = None
    route: Route = "unary"
    many: bool = False
    request_id: str = ""
    sequence_id: int | str | None = None
    sequence_start: bool = False
    sequence_end: bool = False
    on_send: OnSend | None = attrs.field(default=None, eq=False)
    trace: TraceContext | None = None

    @property
    def model(self) -> str:
        return self.request.model

    @property
    def stateless(self) -> bool:
        """One unary request answered once, outside any sequence: what may be retried and sent to any replica."""
        return self.sequence_id is None and self.route == "unary" and not self.many


def with_trace(base: tuple[tuple[str, str], ...], trace: TraceContext) -> tuple[tuple[str, str], ...]:
    """``base`` metadata with ``trace``'s keys replacing any of the same name."""
    keys = {k for k, _ in trace}
    return (*(kv for kv in base if kv[0] not in keys), *trace)
