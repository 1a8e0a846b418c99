"""Sequence sessions: one stateful conversation with a sequence-batched model.

::

    async with model.sequence() as seq:          # a fresh id; the first step carries START
        r1 = await seq.infer(X=x1)
        r2 = await seq.infer(X=x2)
        last = await seq.end(X=x3)               # the last step carries END
    # leaving the block without end(): END is sent for you (bounded, best effort)

What it takes care of (see TRITON_FACTS.md for the server's side):

- **Ids.** A random non-zero 63-bit integer (``secrets.randbits(63)``: independent clients never collide in
  practice), or a UUID string when the model's correlation id is a string. Never 0 or "", which would
  silently turn sequencing off. A caller-given id is checked against the model before anything is sent.
- **Order.** Steps of one session are strictly serialised (an :class:`asyncio.Lock`, which queues callers
  in call order). Over the stream multiplexer a session's steps also share one stream.
- **START / END.** START rides on every step until the server has acknowledged one (a START step the server
  refused built nothing). END rides on :meth:`Sequence.end`, or on a closing request when the block is left
  without it — normally, on an exception, or on cancellation. **Chosen:** the closing request re-sends the
  last step's inputs with END set and its answer is discarded; the model needs inputs on every request and
  the last ones are known to be valid. It is bounded by ``end_timeout_s`` and shielded from the caller's
  cancellation, so that abandoned sessions free their server state.
- **Loss.** :class:`SequenceLost` (with ``steps_acknowledged``) when the server no longer knows the sequence:
  idle timeout, restart, reload, stub crash, or a broken stream under a step. A step whose outcome is
  unknown (the stream broke, the caller gave up waiting, the caller was cancelled) also ends the session:
  the state may or may not include that step, so later steps raise :class:`SequenceLost`. A sequence step
  is never retried.
- **Idle timeout.** The session knows the model's ``max_sequence_idle_microseconds`` and warns with
  :class:`SequenceIdleWarning` before a step that comes later than that after the last answer.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import uuid
import warnings
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Final, Self

from .._call._defaults import USE_CLIENT_DEFAULT, UseClientDefault
from .._errors import (
    RequestTimeout,
    SequenceClosedError,
    SequenceLost,
    SequenceUsageError,
    TransportError,
    TritonError,
)
from .._errors._classify import sequence_error
from .._model import build_request
from .._transport._grpc import GrpcTransport
from .._transport._stream import StreamMultiplexer
from .._wire import InferRequest, InferResult

if TYPE_CHECKING:
    from .._client._model import Model
    from .._model import ModelSpec

__all__ = [
    "SequenceIdleWarning",
    "SequenceSession",
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


class SequenceIdleWarning(UserWarning):
    """A sequence step comes later than the model's idle timeout after the previous answer: it may be lost."""


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
    model: Model,
    *,
    sequence_id: int | str | None = None,
    stream: bool | None = None,
    timeout_s: float | UseClientDefault | None = USE_CLIENT_DEFAULT,
    end_timeout_s: float = DEFAULT_END_TIMEOUT_S,
    outputs: Sequence[str] | None = None,
) -> SequenceSession:
    """A new session on ``model`` (what ``model.sequence(...)`` returns). No I/O until the first step.

    ``stream`` chooses the path of the steps: ``True``, the client's gRPC stream multiplexer (one long-lived
    bidirectional stream shared by many sequences); ``False``, one unary call per step (gRPC or HTTP, the
    client's protocol); ``None`` (the default), the stream for a decoupled model (Triton serves those only
    there) and unary calls otherwise. Why not the stream for every model: Triton 2.51 crashes (SIGSEGV in
    ``TRITONBACKEND_RequestRelease``) under streamed load when a *non-decoupled* Python model answers, which a
    decoupled model that sends each answer with the FINAL flag avoids (``bench/repro_stream_crash/``).
    ``timeout_s`` bounds each step's wait (the client's default when not given; ``None``: no limit).
    """
    transport = model.client.transport
    if stream is None:
        stream = model.spec.decoupled
    if stream and not isinstance(transport, GrpcTransport):
        raise SequenceUsageError(
            f"model {model.name!r}: stream=True needs a gRPC client; this one speaks {transport.protocol}",
            model=model.name,
        )
    if not stream and model.spec.decoupled:
        raise SequenceUsageError(
            f"model {model.name!r} is decoupled: Triton serves it over the gRPC stream only; "
            f"use a grpc:// client and stream=True (or leave stream unset)",
            model=model.name,
        )
    return SequenceSession(
        model,
        multiplexer=transport.multiplexer() if isinstance(transport, GrpcTransport) and stream else None,
        sequence_id=sequence_id,
        timeout_s=model.client.config.timeout_s if isinstance(timeout_s, UseClientDefault) else timeout_s,
        end_timeout_s=end_timeout_s,
        outputs=tuple(outputs) if outputs is not None else None,
    )


class SequenceSession:
    """One sequence (correlation id) on a stateful model; an async context manager. See the module docstring.

    Made by ``model.sequence(...)`` / ``client.sequence(name, ...)`` (see :func:`open_sequence`).
    ``multiplexer`` given: steps travel on that gRPC stream multiplexer; ``None``: each step is one unary
    call through the model's client (gRPC or HTTP), never retried.
    """

    def __init__(
        self,
        model: Model,
        *,
        multiplexer: StreamMultiplexer | None = None,
        sequence_id: int | str | None = None,
        timeout_s: float | None = None,
        end_timeout_s: float = DEFAULT_END_TIMEOUT_S,
        outputs: tuple[str, ...] | None = None,
    ) -> None:
        spec = model.spec
        if spec.sequence is None:
            raise SequenceUsageError(f"model {spec.name!r} is not stateful (no sequence_batching)", model=spec.name)
        if sequence_id is None:
            self._id: int | str = new_sequence_id(string=spec.sequence.string_ids)
        else:
            self._id = validate_sequence_id(sequence_id, spec)
        self._model = model
        self._spec = spec
        self._mux = multiplexer
        self._timeout_s = timeout_s
        self._end_timeout_s = end_timeout_s
        self._outputs = outputs
        self._idle_timeout_s = spec.sequence.idle_timeout_us / 1e6
        self._lock = asyncio.Lock()
        self._acked = 0
        self._ended = False  # END sent by end(): further steps are a usage error
        self._loss: SequenceLost | None = None  # set: further steps raise SequenceLost
        # Whether the server may hold state for this id, i.e. whether closing must send END.
        self._needs_end = False
        self._last_request: InferRequest | None = None
        self._last_answer_at: float | None = None

    def __repr__(self) -> str:
        via = self.via
        state = "lost" if self._loss is not None else "ended" if self._ended else "open"
        return f"<Sequence {self._spec.name} id={self._id!r} via={via} steps={self._acked} {state}>"

    @property
    def via(self) -> str:
        """How the steps travel: ``"stream"`` (the gRPC stream multiplexer), else the client's URL scheme."""
        return "stream" if self._mux is not None else self._model.client.config.scheme

    @property
    def sequence_id(self) -> int | str:
        return self._id

    @property
    def model(self) -> str:
        return self._spec.name

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

    # -- steps ----------------------------------------------------------------------------------------

    async def infer(
        self,
        inputs: Mapping[str, object] | None = None,
        /,
        *,
        timeout_s: float | None = None,
        **named: object,
    ) -> InferResult:
        """Send one step and return its result. Inputs are given as for ``model.infer``."""
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
        return await self._step(self._build(inputs, named), end=True, timeout_s=timeout_s)

    def _build(self, inputs: Mapping[str, object] | None, named: Mapping[str, object]) -> InferRequest:
        # Validation happens here, before the lock and before anything is sent.
        return build_request(self._spec, inputs, named, outputs=self._outputs)

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

    def _unknown(self, why: str, err: BaseException | None) -> SequenceLost:
        lost = SequenceLost(
            f"sequence {self._id!r}: the outcome of a step is unknown ({why}); its state cannot be trusted",
            sequence_id=self._id,
            steps_acknowledged=self._acked,
            model=self._spec.name,
            status=err.status if isinstance(err, TritonError) else None,
        )
        lost.__cause__ = err
        return lost

    async def _step(self, request: InferRequest, *, end: bool, timeout_s: float | None) -> InferResult:
        self._refuse()
        async with self._lock:
            self._refuse()  # the state may have changed while this caller queued
            start = self._acked == 0
            self._warn_if_idle(start)
            self._ended = end
            self._last_request = request
            self._needs_end = True
            try:
                result = await self._send(request, start=start, end=end, timeout_s=timeout_s or self._timeout_s)
            except asyncio.CancelledError:
                # Sent (or about to be): the server may apply it. The caller never sees its answer.
                self._loss = self._unknown("the caller was cancelled while it was in flight", None)
                raise
            except TritonError as err:
                raise self._failed(err, start=start, end=end) from err
            self._acked += 1
            if end:
                self._needs_end = False
            self._last_answer_at = asyncio.get_running_loop().time()
            return result

    def _failed(self, err: TritonError, *, start: bool, end: bool) -> TritonError:
        """Classify a failed step, update the session, and return the error to raise."""
        if isinstance(err, RequestTimeout):
            # The step may still run: the error for this step is the timeout, later steps get SequenceLost.
            self._loss = self._unknown("no answer in time", err)
            return err
        if isinstance(err, SequenceLost):
            err.steps_acknowledged = self._acked
            self._loss = err
            self._needs_end = False  # the server does not know the id: nothing to free
            return err
        if isinstance(err, TransportError):
            # The step may or may not have reached the model; the server may still hold the sequence.
            self._loss = self._unknown(f"{type(err).__name__}: {err.message}", err)
            return err if start else self._loss
        if not start and self._mux is None:
            # Unary steps: a missing START, an unloaded model or a dead stub arrive as plain status codes.
            upgraded = sequence_error(err, sequence_id=self._id, steps_acknowledged=self._acked)
            if isinstance(upgraded, SequenceLost):
                self._loss = upgraded
                self._needs_end = False
                return upgraded
        # The server refused this step and still knows the sequence (or never started it): the session goes on.
        if end:
            self._ended = False
        return err

    def _warn_if_idle(self, start: bool) -> None:
        if start or self._last_answer_at is None:
            return
        idle = asyncio.get_running_loop().time() - self._last_answer_at
        if idle > self._idle_timeout_s:
            warnings.warn(
                SequenceIdleWarning(
                    f"sequence {self._id!r} of model {self._spec.name!r} was idle {idle:.2f} s, longer than the "
                    f"model's idle timeout ({self._idle_timeout_s:g} s): the server has probably dropped it"
                ),
                stacklevel=4,
            )

    async def _send(self, request: InferRequest, *, start: bool, end: bool, timeout_s: float | None) -> InferResult:
        if self._mux is None:
            return await self._model.infer_request(
                request,
                timeout_s=timeout_s,
                sequence_id=self._id,
                sequence_start=start,
                sequence_end=end,
                retry=False,
            )
        # No server-side timeout on a streamed step: Triton dropping a step from the sequence batcher's queue
        # would leave the sequence's state without it. The client-side wait is bounded instead.
        proto = request.to_grpc(sequence_id=self._id, sequence_start=start, sequence_end=end)
        response = await self._mux.infer(proto, key=self._id, timeout_s=timeout_s, steps_acknowledged=self._acked)
        return InferResult.from_grpc(response)

    # -- closing --------------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """End the sequence if the server may still hold it (bounded, best effort). Idempotent.

        The closing request re-sends the last step's inputs with END (see the module docstring); a caller
        cancelled while it runs does not stop it.
        """
        if self._loss is None:
            self._ended = True
        request = self._last_request
        if not self._needs_end or request is None:
            return
        self._needs_end = False  # idempotent: a second aclose() sends nothing
        task = asyncio.get_running_loop().create_task(self._send_closing(request))
        _CLOSING.add(task)
        task.add_done_callback(_CLOSING.discard)
        await asyncio.shield(task)

    async def _send_closing(self, request: InferRequest) -> None:
        try:
            # Behind any step still queued on the lock, so the END really is the sequence's last request.
            async with asyncio.timeout(self._end_timeout_s), self._lock:
                # Nothing acknowledged yet: START+END resets and frees whatever reached the server.
                await self._send(request, start=self._acked == 0, end=True, timeout_s=self._end_timeout_s)
        except (TritonError, TimeoutError) as err:
            _log.debug("closing request of sequence %r failed (best effort): %s", self._id, err)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
