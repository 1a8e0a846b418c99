"""OpenTelemetry spans for requests, sequence steps and chat turns, and the trace context sent to Triton.

Optional: when ``opentelemetry`` cannot be imported (``opentelemetry-api`` is not installed) nothing here imports
it, :data:`AVAILABLE` is False, and every call site skips tracing after one module-global check. When it is
installed, ``opentelemetry`` is imported on first use (not by ``import triton_npu_client``), spans come from the
tracer "triton_npu_client" of the global tracer provider (or the one given to :func:`use_tracer_provider`), and a
tracer that records nothing (the API alone, no SDK) costs one ``start_span`` per request: its span is dropped at
once and the request takes the untraced path.

Spans: ``triton.infer`` (a stateless request, coalescing and retries included), ``triton.sequence.step`` (one step
of a sequence, streamed or not) and ``triton.chat.turn`` (a chat turn, its replay included; its steps are its
children). Attributes: ``triton.model``, ``triton.model_version``, ``triton.replica`` (set by the fleet through
:func:`note_replica`), ``triton.sequence_id``, ``triton.outcome`` (``"ok"``, ``"cancelled"`` or the error's class
name), ``triton.ttfr_ms`` (time to the first response, from the span's start), ``triton.chat.tokens`` and
``triton.chat.replayed`` for a turn. A failure sets the span's status to ERROR; a cancellation does not.

Trace context: while one of these spans is current, the transports add the W3C ``traceparent`` (through
``opentelemetry.propagate.inject``, so the application's configured propagators) to each inference call's gRPC
metadata or HTTP headers; Triton started with ``--trace-config mode=opentelemetry`` makes its own spans children of
it. See docs/tracing.md.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
import types
from collections.abc import AsyncIterator
from typing import Any, Final

__all__ = [
    "AVAILABLE",
    "TRACER_NAME",
    "Span",
    "grpc_metadata",
    "http_headers",
    "note_replica",
    "start",
    "use_tracer_provider",
]

TRACER_NAME: Final = "triton_npu_client"

# Looked up once: find_spec finds the package without importing it, and None is the answer for a blocked import
# (sys.modules["opentelemetry"] = None) too. A constant: call sites import it by name and check it per request.
AVAILABLE: Final[bool] = importlib.util.find_spec("opentelemetry") is not None

# Filled on first use (see _load): the opentelemetry modules and this package's tracer.
_unusable = False  # "opentelemetry" found, but not its API (a namespace package of something else): no tracing
_otel: Any = None
_tracer: Any = None
_provider: Any = None  # given to use_tracer_provider; None: the global provider
_KEY: Final = "triton_npu_client.span"  # the current Span wrapper, kept in the OpenTelemetry context


def _load() -> Any:
    """Import opentelemetry (first use only); None when its API turns out not importable."""
    global _otel, _tracer, _unusable
    if _otel is None:
        if _unusable or not AVAILABLE:
            return None
        try:
            from opentelemetry import context, propagate, trace
        except ImportError:  # e.g. a namespace package "opentelemetry" without the API
            _unusable = True
            return None
        _otel = types.SimpleNamespace(context=context, propagate=propagate, trace=trace)
        _tracer = None
    if _tracer is None:
        trace = _otel.trace
        provider = _provider if _provider is not None else trace.get_tracer_provider()
        _tracer = provider.get_tracer(TRACER_NAME)
    return _otel


def use_tracer_provider(provider: Any) -> None:
    """Take spans from ``provider`` instead of the global tracer provider (``None``: the global one again).

    For tests and for applications that keep a provider of their own for this client.
    """
    global _provider, _tracer
    _provider = provider
    _tracer = None


def _outcome(err: BaseException | None) -> str:
    if err is None:
        return "ok"
    if isinstance(err, asyncio.CancelledError | GeneratorExit):
        return "cancelled"
    return type(err).__name__


class Span:
    """One recording span of this package, with its start time and, for a step of a chat turn, the turn's span."""

    __slots__ = ("_ctx", "_ended", "_first", "_parent", "_started", "span")

    def __init__(self, span: Any, parent: Span | None) -> None:
        self.span = span
        self._parent = parent
        self._started = time.perf_counter()
        self._first = False
        self._ended = False
        self._ctx: Any = None

    def context(self) -> Any:
        """The OpenTelemetry context with this span current (and this wrapper findable by note_replica)."""
        if self._ctx is None:
            otel = _otel
            self._ctx = otel.context.set_value(_KEY, self, otel.trace.set_span_in_context(self.span))
        return self._ctx

    def attach(self) -> object:
        """Make this span current in this task until :meth:`detach` (never across a ``yield``)."""
        return _otel.context.attach(self.context())

    @staticmethod
    def detach(token: object) -> None:
        _otel.context.detach(token)

    def set(self, key: str, value: Any) -> None:
        self.span.set_attribute(key, value)

    def set_first_response(self) -> None:
        """The first response arrived now: ``triton.ttfr_ms`` (once; later calls change nothing)."""
        if not self._first:
            self._first = True
            self.span.set_attribute("triton.ttfr_ms", (time.perf_counter() - self._started) * 1e3)

    def note_replica(self, url: str) -> None:
        self.span.set_attribute("triton.replica", url)
        if self._parent is not None:
            self._parent.note_replica(url)

    def finish(self, err: BaseException | None = None) -> None:
        """Record the outcome (``err`` None: "ok") and end the span; once."""
        if self._ended:
            return
        self._ended = True
        span = self.span
        outcome = _outcome(err)
        span.set_attribute("triton.outcome", outcome)
        if err is not None and outcome != "cancelled":
            trace = _otel.trace
            span.record_exception(err)
            span.set_status(trace.Status(trace.StatusCode.ERROR, outcome))
        span.end()

    def iterate(self, responses: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """``responses`` with this span current while each is awaited (a fleet opens the call at the first one) and
        the first one's arrival recorded. The span is not current while the caller holds a response."""
        return _Iterate(self, responses)


class _Iterate:
    # A plain iterator, not an async generator: one left unfinished holds nothing to finalise.
    __slots__ = ("_responses", "_span")

    def __init__(self, span: Span, responses: AsyncIterator[Any]) -> None:
        self._span = span
        self._responses = responses

    def __aiter__(self) -> _Iterate:
        return self

    async def __anext__(self) -> Any:
        span = self._span
        token = span.attach()
        try:
            item = await anext(self._responses)
        finally:
            span.detach(token)
        span.set_first_response()
        return item


def start(
    name: str,
    *,
    model: str,
    version: str | None = None,
    sequence_id: int | str | None = None,
    parent: Span | None = None,
) -> Span | None:
    """A started span, or None when nothing records it (no SDK, or sampled out with no context to pass on).

    ``parent``: this package's span to hang it under (a chat turn's step); else the current context's span.
    """
    if _load() is None:
        return None
    attributes: dict[str, Any] = {"triton.model": model}
    if version:
        attributes["triton.model_version"] = version
    if sequence_id is not None:
        attributes["triton.sequence_id"] = sequence_id if isinstance(sequence_id, str) else str(sequence_id)
    ctx = parent.context() if parent is not None else None
    span = _tracer.start_span(name, context=ctx, attributes=attributes)
    if not span.is_recording():
        if span.get_span_context().is_valid:
            span.end()  # sampled out: its context still travels through the current one, nothing of ours
        return None
    return Span(span, parent)


def note_replica(url: str) -> None:
    """Set ``triton.replica`` on this package's current span (and on the chat turn above a step); a no-op when
    tracing is off or no span of ours is current."""
    otel = _otel
    if otel is None:  # no span of ours was ever started
        return
    wrapper = otel.context.get_value(_KEY)
    if wrapper is not None:
        wrapper.note_replica(url)


def _carrier() -> dict[str, str] | None:
    otel = _otel if _otel is not None else _load()
    if otel is None or not otel.trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    otel.propagate.inject(carrier)
    return carrier or None


def grpc_metadata(base: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """``base`` plus the current trace context (``traceparent``, ...) when a valid span is current; else ``base``."""
    carrier = _carrier()
    if carrier is None:
        return base
    return (*(kv for kv in base if kv[0] not in carrier), *carrier.items())


def http_headers(base: dict[str, str]) -> dict[str, str] | None:
    """A copy of ``base`` plus the current trace context when a valid span is current (None when both are empty)."""
    carrier = _carrier()
    if carrier is None:
        return dict(base) if base else None
    headers = {k: v for k, v in base.items() if k.lower() not in carrier}
    headers.update(carrier)
    return headers
