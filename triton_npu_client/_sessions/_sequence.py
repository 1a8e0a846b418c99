"""Sequence sessions: one stateful conversation with a sequence-batched model.

::

    async with model.sequence() as seq:          # a fresh id; the first step carries START
        r1 = await seq.infer(X=x1)
        async for r in seq.stream(N=5):          # a step answered by several responses (decoupled model)
            ...
        last = await seq.end(X=x3)               # the last step carries END
    # leaving the block without end(): END is sent for you (bounded, best effort)

- **Ids.** A random non-zero 63-bit integer (independent clients never collide in practice), or a UUID string
  when the model's correlation id is a string. Never 0 or "", which would silently turn sequencing off.
- **Order.** Steps of one session are strictly serialised (an :class:`asyncio.Lock`, which queues callers in
  call order; a streamed step holds it until its last response is read or the stream is closed).
- **START / END.** START rides on every step until the server has acknowledged one. END rides on
  :meth:`SequenceSession.end`, or on a closing request when the block is left without it. The closing request
  carries no inputs when every input of the model is optional (the server toolkit's models free the state
  without computing a step); otherwise it re-sends the last step's inputs and its answer is discarded. A session
  that *adopts* a sequence the server already holds (a resumed chat) never sends START and ENDs it at the close
  even without a step of its own; one *detached* (a chat's ``detach()``) sends nothing more, END included.
  A START that nothing answered (refused, cancelled, timed out) may leave the id held by Triton's sequence
  batcher: before START goes out on it again the session sends END alone (and a closing request carries no
  START), because a START on a held id is Triton's "conflict, terminated early" path, under which 2.51 loses
  requests and has crashed.
- **Losses** are judged in one place (``_errors/_classify.judge_step``), the same over every path:
  :class:`SequenceLost` only when the server dropped the sequence or a step's outcome is unknown; any other
  failure is that step's own error, the session goes on, and END is still sent at the close.
- **Cancellation.** Cancelling a :meth:`~SequenceSession.stream` step (or leaving its loop early) cancels that
  request on the server (a gRPC call of its own); the model keeps what it computed before it stopped, and the
  session goes on. Cancelling an :meth:`~SequenceSession.infer` step leaves its outcome unknown: later steps
  raise :class:`SequenceLost`. A stream step sent with ``rolled_back=True`` (a chat turn) is one the model rolls
  back when it is cancelled, *times out* or fails: its timeout is that step's own error, not a loss; a refusal
  before any response is no acknowledgement (a refused first step is followed by START again); and closing the
  session while it streams cancels it and sends END at once.
- **Idle timeout.** A step that leaves later than the model's ``max_sequence_idle_microseconds`` after the
  previous answer is warned about (:class:`SequenceIdleWarning`) when it actually leaves, after any wait for a
  connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import uuid
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Final, Protocol, Self

import numpy as np

from .._call import USE_CLIENT_DEFAULT, Call, Caller, OnSend, Responses, Route, UseClientDefault
from .._errors import (
    RequestTimeout,
    SequenceClosedError,
    SequenceIdleWarning,
    SequenceLost,
    SequenceUsageError,
    TritonError,
    UsageError,
    judge_step,
)
from .._model import ModelSpec, Plans, build_request
from .._protocol import chat as proto
from .._trace import AVAILABLE as TRACING
from .._trace import Span
from .._trace import start as start_span
from .._wire import InferRequest, InferResult

__all__ = [
    "SequenceSession",
    "SessionTarget",
    "defer_sequence",
    "new_sequence_id",
    "open_sequence",
    "validate_sequence_id",
]

_log = logging.getLogger("triton_npu_client.sequence")

MAX_INT_ID: Final = 2**63 - 1  # gRPC carries integer ids as int64
MAX_STR_ID_CHARS: Final = 128  # Triton's limit for string correlation ids
DEFAULT_END_TIMEOUT_S: Final = 5.0

# Closing requests still in flight after their caller was cancelled: held here so they are not collected.
_CLOSING: set[asyncio.Task[None]] = set()
# How long stopping a cut-short rolled-back step may take (the CANCEL request, then the step's last response)
# before its call is cancelled after all.
_STOP_GRACE_S: Final = 2.0
_TRUE: Final = np.array([True])
_TRUE.flags.writeable = False  # one array for every session's CANCEL request: nobody may change it


class SessionTarget(Protocol):
    """What a session needs of a model handle: its spec and the caller it sends through."""

    @property
    def spec(self) -> ModelSpec: ...

    @property
    def caller(self) -> Caller: ...

    @property
    def plans(self) -> Plans: ...


def new_sequence_id(*, string: bool) -> int | str:
    """A fresh correlation id: a random non-zero 63-bit integer, or a UUID4 string."""
    if string:
        return str(uuid.uuid4())
    while True:
        value = secrets.randbits(63)
        if value:
            return value


def validate_sequence_id(sequence_id: object, spec: ModelSpec) -> int | str:
    """Check a caller-given id against the model: type, non-zero / non-empty, within Triton's limits."""
    seq = spec.sequence
    if seq is None:
        raise SequenceUsageError(f"model {spec.name!r} is not stateful (no sequence_batching)", model=spec.name)
    if isinstance(sequence_id, bool) or not isinstance(sequence_id, int | str):
        raise SequenceUsageError(f"a sequence id is an int or a str, got {type(sequence_id).__name__}", model=spec.name)
    if isinstance(sequence_id, int):
        if not seq.accepts_int_ids:
            raise SequenceUsageError(
                f"model {spec.name!r} takes string sequence ids, got the int {sequence_id}", model=spec.name
            )
        if not 0 < sequence_id <= MAX_INT_ID:
            raise SequenceUsageError(
                f"an integer sequence id must be in 1..2**63-1 (0 turns sequencing off), got {sequence_id}",
                model=spec.name,
            )
        return sequence_id
    if not seq.accepts_str_ids:
        raise SequenceUsageError(
            f"model {spec.name!r} takes integer sequence ids, got the str {sequence_id!r}", model=spec.name
        )
    if not sequence_id or len(sequence_id) > MAX_STR_ID_CHARS:
        raise SequenceUsageError(
            f'a string sequence id must have 1..{MAX_STR_ID_CHARS} characters ("" turns sequencing off), '
            f"got {len(sequence_id)}",
            model=spec.name,
        )
    return sequence_id


def open_sequence(
    model: SessionTarget,
    *,
    sequence_id: int | str | None = None,
    stream: bool | None = None,
    timeout_s: float | UseClientDefault | None = USE_CLIENT_DEFAULT,
    end_timeout_s: float = DEFAULT_END_TIMEOUT_S,
    outputs: Sequence[str] | None = None,
) -> SequenceSession:
    """A new session on ``model`` (what ``model.sequence(...)`` returns). No I/O until the first step.

    ``stream`` chooses the path of :meth:`~SequenceSession.infer` steps: ``True``, the client's shared gRPC
    stream (one long-lived bidirectional stream multiplexing many sequences); ``False``, one unary call per step
    (gRPC or HTTP, the client's protocol); ``None`` (the default), the shared stream for a decoupled model
    (Triton serves those only there) and unary calls otherwise. Why not the stream for every model: Triton 2.51
    crashes under streamed load when a *non-decoupled* Python model answers (``bench/repro_stream_crash/``).
    :meth:`~SequenceSession.stream` steps of a decoupled model always take a gRPC call of their own, so that
    each can be cancelled alone. ``timeout_s`` bounds each step (the client's default when not given).
    """
    spec = model.spec
    caller = model.caller
    transport = caller.transport
    if stream is None:
        stream = spec.decoupled
    if (stream or spec.decoupled) and not transport.can_stream:
        raise SequenceUsageError(
            f"model {spec.name!r}: "
            + ("it is decoupled, which Triton serves only over the gRPC stream" if spec.decoupled else "stream=True")
            + f"; this client speaks {transport.protocol}: use a gRPC client (grpc://)",
            model=spec.name,
        )
    if not stream and spec.decoupled:
        raise SequenceUsageError(
            f"model {spec.name!r} is decoupled: Triton serves it over the gRPC stream only; leave stream unset",
            model=spec.name,
        )
    return SequenceSession(
        model,
        route="shared" if stream else "unary",
        sequence_id=sequence_id,
        timeout_s=caller.timeout(timeout_s),
        end_timeout_s=end_timeout_s,
        outputs=tuple(outputs) if outputs is not None else None,
    )


def defer_sequence(
    name: str,
    fetch: Callable[[], Awaitable[SessionTarget]],
    *,
    sequence_id: int | str | None = None,
    stream: bool | None = None,
    timeout_s: float | UseClientDefault | None = USE_CLIENT_DEFAULT,
    end_timeout_s: float = DEFAULT_END_TIMEOUT_S,
    outputs: Sequence[str] | None = None,
) -> SequenceSession:
    """What ``client.sequence(name, ...)`` returns: the session :func:`open_sequence` makes on the model that
    ``fetch()`` gives, made without I/O. ``fetch`` runs (once) when the session is entered or sends its first step,
    and the checks that need the model's config run then."""

    async def opened() -> SequenceSession:
        return open_sequence(
            await fetch(), sequence_id=sequence_id, stream=stream, timeout_s=timeout_s, end_timeout_s=end_timeout_s,
            outputs=outputs,
        )

    return SequenceSession._deferred(name, opened)


class SequenceSession:
    """One sequence (correlation id) on a stateful model; an async context manager. See the module docstring.

    Made by ``model.sequence(...)`` (see :func:`open_sequence`) or ``client.sequence(name, ...)`` (see
    :func:`defer_sequence`): the same type either way. One made by name reaches its model when it is entered or
    sends its first step; until then :attr:`sequence_id`, :attr:`spec` and :attr:`via` are not known yet.
    """

    def __init__(
        self,
        model: SessionTarget,
        *,
        route: Route = "unary",
        sequence_id: int | str | None = None,
        timeout_s: float | None = None,
        end_timeout_s: float = DEFAULT_END_TIMEOUT_S,
        outputs: tuple[str, ...] | None = None,
    ) -> None:
        self._name = model.spec.name
        self._opener: Callable[[], Awaitable[SequenceSession]] | None = None
        self._configure(
            model, route=route, sequence_id=sequence_id, timeout_s=timeout_s, end_timeout_s=end_timeout_s,
            outputs=outputs,
        )
        self._start_state()

    @classmethod
    def _deferred(cls, name: str, opener: Callable[[], Awaitable[SequenceSession]]) -> SequenceSession:
        """A session on the model ``name`` that ``opener()`` opens (once) when it is entered or first used."""
        self = cls.__new__(cls)
        self._name = name
        self._opener = opener
        self._start_state()
        return self

    def _configure(
        self,
        model: SessionTarget,
        *,
        route: Route,
        sequence_id: int | str | None,
        timeout_s: float | None,
        end_timeout_s: float,
        outputs: tuple[str, ...] | None,
    ) -> None:
        spec = model.spec
        if spec.sequence is None:
            raise SequenceUsageError(f"model {spec.name!r} is not stateful (no sequence_batching)", model=spec.name)
        self._target = model
        if sequence_id is None:
            self._id: int | str = new_sequence_id(string=spec.sequence.string_ids)
        else:
            self._id = validate_sequence_id(sequence_id, spec)
        self._spec = spec
        self._caller = model.caller
        self._plans = model.plans
        self._route: Route = route
        self._timeout_s = timeout_s
        self._end_timeout_s = end_timeout_s
        self._outputs = outputs
        self._idle_timeout_s = spec.sequence.idle_timeout_us / 1e6
        # END with no inputs frees the state without a step, when the model allows requests without inputs.
        self._end_only = all(t.optional for t in spec.inputs)
        # A decoupled model that takes CANCEL stops a rolled-back step when asked (see _stop_step).
        self._cancel_input = spec.decoupled and spec.input(proto.CANCEL) is not None

    def _start_state(self) -> None:
        self._lock = asyncio.Lock()
        self._binding = asyncio.Lock()
        self._acked = 0
        self._ended = False  # END sent by end(): further steps are a usage error
        self._loss: SequenceLost | None = None  # set: further steps raise SequenceLost
        # Whether the server may hold state for this id, i.e. whether closing must send END.
        self._needs_end = False
        self._last_request: InferRequest | None = None
        self._last_answer_at: float | None = None
        # The call of a rolled_back stream step still in flight (its reader may have abandoned it): closing the
        # session cancels it and sends END without waiting for it.
        self._rolled_back_call: Responses | None = None
        self._closed_under: Responses | None = None  # that call, once aclose() cancelled it
        # The chat turn's span while a turn streams here: its steps' spans hang under it (set by ChatSession).
        self._trace_parent: Span | None = None
        # A sequence the server already holds, started by another session (a chat resumed from its state, maybe in
        # another process): no step carries START, and closing sends END even before this session sent a step.
        self._adopted = False
        self._detached = False  # let go of without END (_detach): closing sends nothing
        # A START went out and nothing answered it (the model refused it, or it was cancelled or timed out): Triton's
        # sequence batcher may still hold the id. A second START on a held id takes Triton 2.51's "conflict ...
        # terminated early" path, under which it has lost requests (a client waits forever) and crashed (SIGABRT,
        # SIGSEGV); so such an id gets END alone first (_release_start), and a closing request carries no START.
        self._start_unanswered = False

    def __repr__(self) -> str:
        state = "lost" if self._loss is not None else "ended" if self._ended else "open"
        if self._opener is not None:
            return f"<Sequence {self._name} (model not reached yet) {state}>"
        return f"<Sequence {self._name} id={self._id!r} via={self.via} steps={self._acked} {state}>"

    async def _bind(self) -> None:
        """Reach the model, for a session made by name (:meth:`_deferred`); nothing for one made on a model."""
        if self._opener is None:
            return
        async with self._binding:
            if self._opener is None:  # another task bound it while this one waited
                return
            if self._ended:
                raise SequenceClosedError(
                    f"the sequence on model {self._name!r} was closed before its first step; open a new one",
                    model=self._name,
                )
            bound = await self._opener()
            # Only the settings are taken: this session's state (closed meanwhile, say) stays its own.
            self._configure(
                bound._target, route=bound._route, sequence_id=bound._id, timeout_s=bound._timeout_s,
                end_timeout_s=bound._end_timeout_s, outputs=bound._outputs,
            )
            self._opener = None

    def _not_bound(self, what: str) -> SequenceUsageError:
        return SequenceUsageError(
            f"the {what} of a sequence on model {self._name!r} opened by name is known once it has reached the model: "
            "enter it (async with) or send a step first",
            model=self._name,
        )

    @property
    def via(self) -> str:
        """How :meth:`infer` steps travel: ``"stream"`` (the shared gRPC stream), else the client's protocol."""
        if self._opener is not None:
            raise self._not_bound("path (via)")
        return "stream" if self._route == "shared" else self._caller.transport.protocol

    @property
    def sequence_id(self) -> int | str:
        if self._opener is not None:
            raise self._not_bound("id")
        return self._id

    @property
    def model(self) -> str:
        return self._name

    @property
    def _known_id(self) -> int | str | None:
        """The id for a message: ``None`` before a session opened by name has reached its model."""
        return None if self._opener is not None else self._id

    @property
    def spec(self) -> ModelSpec:
        if self._opener is not None:
            raise self._not_bound("spec")
        return self._spec

    @property
    def steps_acknowledged(self) -> int:
        """Steps the server has answered."""
        return self._acked

    @property
    def is_open(self) -> bool:
        """Whether a step may be sent now (neither ended nor lost)."""
        return not self._ended and self._loss is None

    @property
    def is_lost(self) -> bool:
        return self._loss is not None

    @property
    def _starts_next(self) -> bool:
        """Whether the next step carries START: none acknowledged yet, and the sequence is not an adopted one."""
        return self._acked == 0 and not self._adopted

    def _adopt(self) -> None:
        """Continue a sequence the server already holds (no START; END at the close). Before any step only."""
        assert self._last_request is None, "adopted after a step was sent"
        assert self._acked == 0, "adopted after a step was answered"
        self._adopted = True
        self._needs_end = True

    async def _detach(self) -> None:
        """Let the session go without ending the sequence: the server keeps it (until the model's idle timeout) for
        another session to adopt. A ``rolled_back`` stream step in flight is cancelled (the model rolls it back;
        its reader gets :class:`SequenceClosedError`), and nothing else is sent, now or at a later close."""
        if self._loss is None:
            self._ended = True
        self._detached = True
        self._needs_end = False
        in_flight = self._rolled_back_call
        if in_flight is not None:
            self._closed_under = in_flight
            await in_flight.aclose()

    def renewed(self) -> SequenceSession:
        """A new session on the same model with the same settings and a fresh id (nothing is sent)."""
        if self._opener is not None:
            return SequenceSession._deferred(self._name, self._opener)
        return SequenceSession(
            self._target,
            route=self._route,
            timeout_s=self._timeout_s,
            end_timeout_s=self._end_timeout_s,
            outputs=self._outputs,
        )

    # -- steps ----------------------------------------------------------------------------------------

    async def infer(
        self,
        inputs: Mapping[str, object] | None = None,
        /,
        *,
        timeout_s: float | None = None,
        **named: object,
    ) -> InferResult:
        """Send one step and return its one result. Inputs are given as for ``model.infer``.

        A decoupled model that answers a step with several responses raises :class:`UsageError` here (after
        the step ran): read such steps with :meth:`stream`.
        """
        await self._bind()
        return await self._step(self._build(inputs, named), end=False, timeout_s=timeout_s)

    async def end(
        self,
        inputs: Mapping[str, object] | None = None,
        /,
        *,
        timeout_s: float | None = None,
        **named: object,
    ) -> InferResult:
        """Send the last step (it carries END) and return its result; the session is closed afterwards."""
        await self._bind()
        return await self._step(self._build(inputs, named), end=True, timeout_s=timeout_s)

    async def stream(
        self,
        inputs: Mapping[str, object] | None = None,
        /,
        *,
        end: bool = False,
        timeout_s: float | None = None,
        rolled_back: bool = False,
        **named: object,
    ) -> AsyncIterator[InferResult]:
        """Send one step and yield every response to it, until the final one (``end=True``: the step carries END).

        On a decoupled model the step takes a gRPC call of its own: leaving the loop early (or cancelling the
        task that iterates) cancels it on the server, and the session goes on. For an immediate cancel on
        ``break``, iterate inside ``contextlib.aclosing(seq.stream(...))``.

        ``rolled_back=True`` says the model rolls this step back when it is cancelled, times out or fails (a chat
        turn): a :class:`RequestTimeout` is raised as this step's own error and the session goes on, as after a
        cancel (without it a timeout leaves the step's outcome unknown: the session is lost); a step refused
        before any response is not counted as acknowledged (a refused first step leaves no state, so the next
        one carries START again). Closing the session while such a step streams cancels it and sends END at once.
        On a decoupled model that declares ``CANCEL`` (the chat models) such a step is never cancelled by
        cancelling its call when it is cut short (loop left, task cancelled, timeout): a CANCEL request asks the
        model to end it, and its call is read to its end (:meth:`_stop_step`), because Triton 2.51 crashes when a
        cancellation races the responses it writes; the step's timeout is then kept by the session.
        """
        await self._bind()
        request = self._build(inputs, named)
        span = self._span(end) if TRACING else None
        try:
            self._refuse()
            async with self._lock:
                self._refuse()
                start = self._starts_next
                if start and self._start_unanswered:
                    await self._release_start()
                decoupled = self._spec.decoupled
                step_timeout_s = timeout_s or self._timeout_s
                # A rolled-back step on a model that takes CANCEL is stopped by asking the model (_stop_step), never
                # by cancelling its gRPC call, which Triton 2.51 crashes on when the cancellation races the
                # responses it writes. So its reads run shielded (a cancellation of this task reaches this code,
                # not the call) and its timeout is kept here; the call's own deadline is only a safety net.
                cooperative = rolled_back and self._cancel_input
                deadline = None
                call_timeout_s = step_timeout_s
                if cooperative and step_timeout_s is not None:
                    deadline = asyncio.get_running_loop().time() + step_timeout_s
                    call_timeout_s = step_timeout_s + 2 * _STOP_GRACE_S
                token = span.attach() if span is not None else None  # never across a yield: the send only
                try:
                    responses = self._send(
                        request, start=start, end=end, timeout_s=call_timeout_s,
                        route="own" if decoupled else self._route, many=decoupled,
                    )
                finally:
                    if span is not None:
                        span.detach(token)
                if rolled_back:
                    self._rolled_back_call = responses
                answered = False
                finished = False
                over = False  # the call's answer ended (its last response, an error): nothing left to stop
                pending: asyncio.Future[InferResult] | None = None
                results = responses if span is None else span.iterate(responses)
                try:
                    try:
                        while True:
                            try:
                                if cooperative:
                                    pending = asyncio.ensure_future(anext(results))
                                    async with asyncio.timeout_at(deadline):
                                        result = await asyncio.shield(pending)
                                    pending = None
                                else:
                                    result = await anext(results)
                            except StopAsyncIteration:
                                over = True
                                break
                            except TritonError:
                                over = True
                                raise
                            if not answered:
                                answered = True
                                self._acknowledged(end=False)
                            yield result
                    except asyncio.CancelledError:
                        if not self._closed_by_aclose(responses):
                            raise
                        over = True  # the closer cancelled the call
                    except TimeoutError as err:
                        if isinstance(err, TritonError):
                            raise
                        # This step's own deadline (cooperative steps only): stopped and rolled back, as a cancel.
                        await self._stop_step(results, pending)
                        over = True
                        raise RequestTimeout(
                            f"model {self._spec.name!r}: no answer within {step_timeout_s} s on sequence "
                            f"{self._id!r}; the step was stopped (rolled back)",
                            model=self._spec.name,
                            status="DEADLINE_EXCEEDED",
                            sequence_id=self._id,
                        ) from None
                    if self._closed_under is responses:
                        raise self._closed_while_streaming() from None
                    finished = True
                except TritonError as err:
                    if self._closed_under is responses and isinstance(err, SequenceClosedError):
                        raise
                    if rolled_back and isinstance(err, RequestTimeout):
                        raise  # rolled back on the server like a cancel: neither acknowledged nor lost
                    # A refused rolled-back step left nothing behind, so its refusal is no acknowledgement: after a
                    # refused first step (an input over a cap, the slot cap) the next one carries START again.
                    finished = not rolled_back
                    raise self._failed(err, start=start) from err
                finally:
                    if self._rolled_back_call is responses:
                        self._rolled_back_call = None
                    if cooperative and not over:
                        await self._stop_step(results, pending)  # cut short: the model stops the step
                    # Cut short (cancelled, or the loop left early): closing cancels the call on the server unless
                    # its answer is over. An END step cut short may not have been applied, so _needs_end stays set
                    # and the close re-sends END.
                    await responses.aclose()
                    if finished:
                        if not answered:
                            self._acknowledged(end=end)  # a step answered by the final flag alone
                        elif end:
                            self._needs_end = False
        except BaseException as err:
            if span is not None:
                span.finish(err)
            raise
        if span is not None:
            span.finish()

    async def _stop_step(
        self, results: AsyncIterator[InferResult], pending: asyncio.Future[InferResult] | None
    ) -> None:
        """Stop a rolled-back step that was cut short without cancelling its call (bounded, best effort): a CANCEL
        request of its own asks the model to end the step, then the step's call is read to its end (its last
        response, which the model sends at once). If that does not happen within the grace, the caller's aclose()
        cancels the call after all. A second cancellation of this task cuts it short the same way."""
        try:
            async with asyncio.timeout(_STOP_GRACE_S):
                stop = self._caller.call(
                    Call(
                        request=build_request(self._spec, {proto.CANCEL: _TRUE}, None),
                        timeout_s=_STOP_GRACE_S,
                        route="own",
                        many=True,
                        sequence_id=self._id,
                    )
                )
                async for _ in stop:
                    pass
                if pending is not None:
                    try:
                        await pending
                    except StopAsyncIteration:
                        return
                async for _ in results:
                    pass  # what the step sent before it stopped: nobody reads it now
        except (TritonError, TimeoutError) as err:
            _log.debug("stopping a step of sequence %r: %s (its call is cancelled instead)", self._id, err)
        finally:
            if pending is not None and not pending.done():
                pending.cancel()

    def _closed_by_aclose(self, responses: Responses) -> bool:
        """Whether a cancellation that reached a step's reader came from aclose() cancelling the step's call,
        not from a cancellation of the reader's own task."""
        task = asyncio.current_task()
        return self._closed_under is responses and task is not None and not task.cancelling()

    def _closed_while_streaming(self) -> SequenceClosedError:
        return SequenceClosedError(
            f"sequence {self._id!r} of model {self._spec.name!r} was closed while this step streamed; the step "
            "was cancelled",
            model=self._spec.name,
            sequence_id=self._id,
        )

    def _build(self, inputs: Mapping[str, object] | None, named: Mapping[str, object]) -> InferRequest:
        # Validation happens here, before the lock and before anything is sent.
        return build_request(self._spec, inputs, named, outputs=self._outputs, plans=self._plans)

    def _refuse(self) -> None:
        if self._ended:
            raise SequenceClosedError(
                f"sequence {self._id!r} of model {self._spec.name!r} has ended; open a new one",
                model=self._spec.name,
                sequence_id=self._id,
            )
        if self._loss is not None:
            raise SequenceLost(
                f"sequence {self._id!r} was lost earlier: {self._loss.message}",
                sequence_id=self._id,
                steps_acknowledged=self._acked,
                model=self._spec.name,
            ) from self._loss

    def _send(
        self, request: InferRequest, *, start: bool, end: bool, timeout_s: float | None, route: Route, many: bool
    ) -> Responses:
        self._ended = end
        self._last_request = request
        self._needs_end = True
        if start:
            self._start_unanswered = True
        return self._caller.call(
            Call(
                request=request,
                timeout_s=timeout_s,
                route=route,
                many=many,
                sequence_id=self._id,
                sequence_start=start,
                sequence_end=end,
                on_send=None if start else self._idle_check(),
            )
        )

    def _span(self, end: bool) -> Span | None:
        span = start_span(
            "triton.sequence.step",
            model=self._spec.name,
            version=self._spec.version,
            sequence_id=self._id,
            parent=self._trace_parent,
        )
        if span is not None and end:
            span.set("triton.sequence.end", True)
        return span

    async def _step(self, request: InferRequest, *, end: bool, timeout_s: float | None) -> InferResult:
        span = self._span(end) if TRACING else None
        # Current for the whole step (one task): the transport sends its context, the fleet notes its replica when
        # it opens the call.
        token = span.attach() if span is not None else None
        try:
            self._refuse()
            async with self._lock:
                self._refuse()  # the state may have changed while this caller queued
                start = self._starts_next
                if start and self._start_unanswered:
                    await self._release_start()
                responses = self._send(
                    request, start=start, end=end, timeout_s=timeout_s or self._timeout_s,
                    route=self._route, many=self._spec.decoupled,
                )
                try:
                    result = await responses.single()
                except asyncio.CancelledError:
                    # Sent (or about to be): the server may apply it. The caller never sees its answer.
                    self._loss = SequenceLost(
                        f"sequence {self._id!r}: a step was cancelled in flight; its outcome is unknown",
                        sequence_id=self._id,
                        steps_acknowledged=self._acked,
                        model=self._spec.name,
                    )
                    raise
                except UsageError:
                    # Answered, by more than one response (read such steps with stream()): the step ran.
                    self._acknowledged(end=end)
                    raise
                except TritonError as err:
                    raise self._failed(err, start=start) from err
                self._acknowledged(end=end)
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

    def _acknowledged(self, *, end: bool) -> None:
        self._acked += 1
        self._start_unanswered = False
        if end:
            self._needs_end = False
        self._last_answer_at = asyncio.get_running_loop().time()

    def _failed(self, err: TritonError, *, start: bool) -> TritonError:
        """Judge a failed step (in the one classifier), update the session, and return the error to raise."""
        verdict = judge_step(err, sequence_id=self._id, start=start, acknowledged=self._acked)
        if verdict.lost:
            error = verdict.error
            if isinstance(error, SequenceLost):
                # Raised below the session (the fleet, when the sequence's replica failed), where the count of
                # acknowledged steps is not known: this session knows it.
                error.steps_acknowledged = self._acked
            self._loss = error if isinstance(error, SequenceLost) else SequenceLost(
                f"sequence {self._id!r}: {type(error).__name__}: {error.message}",
                sequence_id=self._id,
                steps_acknowledged=self._acked,
                model=self._spec.name,
                status=error.status,
            )
        else:
            self._ended = False  # a refused END step did not end the sequence
        self._needs_end = verdict.send_end
        return verdict.error

    def _idle_check(self) -> OnSend:
        last = self._last_answer_at

        def check() -> None:
            if last is None:
                return
            idle = asyncio.get_running_loop().time() - last
            if idle > self._idle_timeout_s:
                warnings.warn(
                    SequenceIdleWarning(
                        f"sequence {self._id!r} of model {self._spec.name!r}: this step leaves {idle:.2f} s after "
                        f"the previous answer, later than the model's idle timeout ({self._idle_timeout_s:g} s): "
                        "the server has probably dropped the sequence"
                    ),
                    stacklevel=2,
                )

        return check

    # -- closing --------------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """End the sequence if the server may still hold it (bounded, best effort). Idempotent.

        The closing request carries END and no inputs when the model allows it, else the last step's inputs
        (see the module docstring); a caller cancelled while it runs does not stop it. A ``rolled_back`` stream
        step still in flight (being read, or abandoned by its reader) is cancelled first and END leaves at once,
        without waiting for it: the model rolls the step back and the END frees the sequence. An adopted sequence
        (a resumed chat) is ended even if this session sent no step, reaching its model first when it was opened by
        name; a detached one is not.
        """
        if self._detached:
            return
        if self._opener is not None and self._adopted and self._needs_end:
            try:
                async with asyncio.timeout(DEFAULT_END_TIMEOUT_S):
                    await self._bind()
            except (TritonError, TimeoutError) as err:
                _log.debug("closing request of adopted sequence on %r not sent (best effort): %s", self._name, err)
                self._needs_end = False
        if self._loss is None:
            self._ended = True
        request = self._last_request
        # Without a step sent yet, only a model that takes a request without inputs can be sent END.
        if not self._needs_end or (request is None and not self._end_only):
            return
        self._needs_end = False  # idempotent: a second aclose() sends nothing
        if self._end_only or request is None:
            request = build_request(self._spec, None, None)
        in_flight = self._rolled_back_call
        if in_flight is not None:
            self._closed_under = in_flight
            await in_flight.aclose()
        task = asyncio.get_running_loop().create_task(self._send_closing(request, queue=in_flight is None))
        _CLOSING.add(task)
        task.add_done_callback(_CLOSING.discard)
        await asyncio.shield(task)

    async def _send_closing(self, request: InferRequest, *, queue: bool = True) -> None:
        try:
            async with asyncio.timeout(self._end_timeout_s), contextlib.AsyncExitStack() as stack:
                if queue:
                    # Behind any step still queued on the lock, so the END really is the sequence's last request.
                    # (Not behind a cancelled rolled_back step: its reader may never resume to release the lock.
                    # Steps queued behind it see the session ended and send nothing.)
                    await stack.enter_async_context(self._lock)
                # Nothing sent yet: START+END resets and frees whatever reached the server. A START sent and not
                # answered may hold the id on the server: END alone (refused harmlessly if it does not).
                await self._send_end(request, start=self._starts_next and not self._start_unanswered)
        except (TritonError, TimeoutError) as err:
            # Sent once: a refused END is not retried (Triton ends the sequence on END whatever the model answers,
            # so a second END would only be told to START).
            _log.debug("closing request of sequence %r failed (best effort): %s", self._id, err)

    async def _send_end(self, request: InferRequest, *, start: bool) -> None:
        responses = self._caller.call(
            Call(
                request=request,
                timeout_s=self._end_timeout_s,
                route=self._route,
                many=self._spec.decoupled,
                sequence_id=self._id,
                sequence_start=start,
                sequence_end=True,
            )
        )
        async for _ in responses:
            pass

    async def _release_start(self) -> None:
        """END alone on this id before its START goes out again (under the step lock; bounded, best effort).

        The earlier START was not answered, so Triton may hold the id: this END frees it (the model frees whatever
        it kept; a refused first step kept nothing). If Triton does not hold it, the END is refused as a step
        without START, which changes nothing. Either way the next START meets no sequence in progress.
        """
        last = self._last_request
        request = build_request(self._spec, None, None) if self._end_only or last is None else last
        try:
            async with asyncio.timeout(self._end_timeout_s):
                await self._send_end(request, start=False)
        except (TritonError, TimeoutError) as err:
            _log.debug("END before a second START on sequence %r: %s (expected when nothing was held)", self._id, err)
        self._start_unanswered = False

    async def __aenter__(self) -> Self:
        await self._bind()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
