"""A background step loop for decoupled models: many streaming requests advanced together, one step at a time.

``execute`` reads its requests, hands each one's response sender and a job to :meth:`StepLoop.submit`
and returns ``None``; one thread then runs every active stream in passes. A pass checks each sender's
``is_cancelled()``, admits the streams that arrived since the last pass (one ``admit`` call for all of
them), then calls ``step`` once for every stream that is due, so each pass sends at most one response
per stream: the shape continuous batching takes (``admit`` = prefill, ``step`` = one decode step for
the whole batch, ``on_exit`` = free what the stream held).

One stream per sequence, always: Triton 2.51 releases a request when ``execute`` returns, so the
sequence batcher may deliver the next step of a sequence while the previous one still streams here.
Two streams of one sequence must never share a pass. With ``overlap="supersede"`` (what a chat wants: a
client that cancels a turn and sends the next, or closes, at once) the new step is always accepted and
the loop *retires* the old stream, on its own thread, before it admits the new one: the old one ends as
superseded (``on_exit`` reason ``"superseded"``) with an error saying so. With
``overlap="refuse"`` a step of a sequence whose stream is still running (and not cancelled) is refused
with a :class:`Refusal` ``"busy"``; one whose stream was cancelled is accepted and the old stream retired
the same way. Either way the rule never depends on which streams' cancellation a pass happens to ask.

A failure belongs to the stream that caused it: when a batched ``step`` or ``admit`` raises, the loop
calls it again on halves of the batch until it finds the streams that fail alone, and fails only those.
So both callbacks must be safe to call again on the same streams after they raised (mutate nothing
before a raise, or only idempotently).

Pure Python: the senders are duck-typed (``send(response=None, flags=0)``, ``is_cancelled()``) and the
pb-specific pieces (the FINAL flag, how an error response is built) are passed in, so the loop runs
and is tested without Triton.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from .._protocol import SEQUENCE_BUSY
from ._controls import CorrelationId
from ._state import Clock, Refusal
from ._timing import StepTrace

__all__ = ["SEQUENCE_BUSY", "ExitReason", "StepLoop", "StepOutput", "Stream"]

_log = logging.getLogger("triton_npu_client.server")

J = TypeVar("J")

DEFAULT_BUSY_GRACE_S = 0.5
_BUSY_POLL_S = 0.02

ExitReason = Literal["done", "cancelled", "superseded", "failed", "shutdown"]
Overlap = Literal["supersede", "refuse"]

#: How long the loop may go without checking cancellations while streams wait for their next step.
DEFAULT_CANCEL_POLL_S = 0.05
#: Every running stream's cancellation is asked at least once in this many passes (a share of the streams
#: each pass, the longest unasked first). Each ``is_cancelled()`` is a round trip to Triton's process (about
#: 0.1 ms here): asking all 32 streams of a chat batch every pass cost a third of the pass. With a thread of
#: its own (``background_checks``) the loop only hands the share over and reads the answers at its next pass.
DEFAULT_CANCEL_CHECK_EVERY = 4


@dataclass(eq=False, slots=True)
class Stream(Generic[J]):
    """One active request: its sequence, its response sender and the model's job (mutable, the model's own).

    ``steps`` counts the steps taken (0 until the first); ``not_before`` is the loop clock's time before
    which the next step is not taken (see :attr:`StepOutput.wait_s`).
    """

    key: CorrelationId
    sender: Any
    job: J
    steps: int = 0
    not_before: float = 0.0
    checked_at: int = -1  # the pass at which its cancellation was last asked
    send_failed: bool = False  # a response could not be sent (set by the outbox thread)
    cancel_seen: bool = False  # its request said it was cancelled (set by the watcher thread, or cancel())
    check_queued: bool = False  # a cancellation check waits for the watcher thread
    finished: bool = False  # the loop ended it (set before its FINAL is sent)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepOutput:
    """What one step of one stream produced.

    ``response`` is sent as is (None: nothing to send this step); ``done`` ends the stream, with the
    FINAL flag on ``response`` or alone. ``wait_s`` delays the stream's next step (pacing); the loop
    keeps checking cancellations while it waits.
    """

    response: Any = None
    done: bool = False
    wait_s: float = 0.0


StepFn = Callable[[Sequence[Stream[J]]], Sequence[StepOutput]]
AdmitFn = Callable[[Sequence[Stream[J]], Sequence[Stream[J]]], Sequence[Any]]
ExitFn = Callable[[Stream[J], ExitReason], None]


class StepLoop(Generic[J]):
    """Runs submitted streams on one background thread, all due streams advanced together each pass.

    ``step(due)`` returns one :class:`StepOutput` per stream, in order. ``admit(new, running)``
    (optional) is called once per pass for the streams that arrived, before their first step, with the
    streams already running; it returns, per new stream, None to admit it or a response that refuses it
    (sent with the FINAL flag). ``on_exit(stream, reason)`` (optional) runs when an admitted stream
    leaves, before its FINAL flag is sent, and for a stream whose ``admit`` raised (it may hold what
    admit gave it). ``error_response(message)`` builds the error response sent when a callback raises,
    a stream is superseded or the loop shuts down. ``final_flag`` is
    ``pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL``. ``overlap``: what a step of a sequence whose
    stream is still in the loop does (see the module docstring); ``superseded_message(key)`` (optional)
    is the error text a retired stream gets. With the thread running, ``background_sends`` sends responses
    from a thread of their own and ``background_checks`` asks running streams' cancellation from another
    (each a round trip to Triton's process that the decode thread would otherwise wait out); a new stream
    is always asked on the loop's thread before it is admitted. ``background_checks`` is off by default and
    must stay off with Triton's senders: the watcher may ask a stream whose FINAL response the send thread has
    just sent, and Triton 2.51 then reads the freed response factory (``TRITONBACKEND_ResponseFactoryIsCancelled``)
    and the whole server dies of a segmentation fault (seen under load in the suite). Asked on the loop's
    thread, a stream is asked only while it runs, before its FINAL is queued. ``overlap_sends=False`` makes each
    pass wait until the send thread has sent everything queued, so that no other thread of the loop runs Python
    while a pass computes (measured: it saves the decode thread no CPU and costs the sends' overlap; docs/chat.md).

    Every callback runs on the loop's thread, one at a time: model state they share needs no lock.
    ``start=False`` runs no thread: the caller drives :meth:`run_pass` (tests, with an injected clock).
    ``trace`` (see ``_timing``): marks each request's way through the loop and times each pass; None, the default,
    costs one test per pass and per response.
    """

    def __init__(
        self,
        *,
        step: StepFn[J],
        final_flag: int,
        error_response: Callable[[str], Any],
        admit: AdmitFn[J] | None = None,
        on_exit: ExitFn[J] | None = None,
        cancel_poll_s: float = DEFAULT_CANCEL_POLL_S,
        cancel_check_every: int = DEFAULT_CANCEL_CHECK_EVERY,
        background_sends: bool = True,
        background_checks: bool = False,
        overlap_sends: bool = True,
        busy_grace_s: float = DEFAULT_BUSY_GRACE_S,
        overlap: Overlap = "refuse",
        superseded_message: Callable[[CorrelationId], str] | None = None,
        clock: Clock = time.monotonic,
        name: str = "step-loop",
        start: bool = True,
        trace: StepTrace | None = None,
    ) -> None:
        if cancel_poll_s <= 0:
            raise ValueError(f"cancel_poll_s must be > 0, got {cancel_poll_s}")
        self._step = step
        self._admit = admit
        self._on_exit = on_exit
        self._final = final_flag
        self._error_response = error_response
        self._cancel_poll_s = cancel_poll_s
        if cancel_check_every < 1:
            raise ValueError(f"cancel_check_every must be >= 1, got {cancel_check_every}")
        self._cancel_check_every = cancel_check_every
        self._overlap_sends = overlap_sends
        self._passes = 0
        if overlap not in ("supersede", "refuse"):
            raise ValueError(f"overlap must be 'supersede' or 'refuse', got {overlap!r}")
        self._busy_grace_s = busy_grace_s
        self._overlap = overlap
        self._superseded_message = superseded_message or _superseded
        self._clock = clock
        self._trace = trace
        self._cond = threading.Condition()
        # Guarded by _cond: what execute threads and the loop thread share.
        self._pending: list[Stream[J]] = []
        # The newest stream of each sequence (running or queued); an older one still in the loop is in _retire.
        self._busy: dict[CorrelationId, Stream[J]] = {}
        # Streams replaced by a newer stream of their sequence: the loop ends them before it admits anything.
        self._retire: list[Stream[J]] = []
        self._closing = False
        # Loop thread only.
        self._running: list[Stream[J]] = []
        self._cancelled = 0
        self._superseded = 0
        self._thread: threading.Thread | None = None
        self._outbox: _Outbox | None = None
        self._watcher: _Watcher | None = None
        if start:
            if background_sends:
                self._outbox = _Outbox(f"{name}-send", trace)
            if background_checks:
                self._watcher = _Watcher(f"{name}-cancel", self._wake)
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    def __repr__(self) -> str:
        return f"StepLoop(active={self.active}, cancelled={self.cancelled}, closed={self.closed})"

    @property
    def active(self) -> int:
        """Streams submitted and not yet finished (waiting for admission included)."""
        with self._cond:
            return len(self._busy)

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closing

    @property
    def cancelled(self) -> int:
        """Streams stopped because their request was cancelled (or could not say), since the loop started."""
        return self._cancelled

    @property
    def superseded(self) -> int:
        """Streams retired because a newer step of their sequence arrived, since the loop started."""
        return self._superseded

    def submit(self, key: CorrelationId, sender: Any, job: J) -> Refusal | None:
        """Queue a stream for sequence ``key``; a :class:`Refusal` (nothing queued) when it cannot run.

        ``"closed"``: the loop is shutting down. ``"busy"`` (``overlap="refuse"`` only): a step of ``key``
        is still streaming. The caller answers a refusal itself. With ``overlap="supersede"`` this never
        waits; with ``"refuse"`` it waits up to ``busy_grace_s`` for the previous step to end or be cancelled.
        """
        with self._cond:
            if self._closing:
                return Refusal(reason="closed", message="the model is shutting down; no new steps are accepted")
            current = self._busy.get(key)
            if current is not None and self._overlap == "refuse":
                # A client that cancels a step and sends the next one at once must not be told "busy": the server
                # may see the new request a moment before it sees the cancellation. Real time, not the injected
                # clock: this bounds how long an execute thread blocks here.
                deadline = time.monotonic() + self._busy_grace_s
                while (current := self._busy.get(key)) is not None and not self._is_cancelled(current):
                    left = deadline - time.monotonic()
                    if left <= 0 or self._closing:
                        break
                    self._cond.wait(min(left, _BUSY_POLL_S))
                if self._closing:
                    return Refusal(reason="closed", message="the model is shutting down; no new steps are accepted")
                if current is not None and not self._is_cancelled(current):
                    return Refusal(
                        reason="busy",
                        message=f"{SEQUENCE_BUSY} sequence {key!r} is busy: its previous step is still streaming; "
                        "steps of a sequence must not overlap (wait for the final response, or for a cancelled "
                        "step to stop)",
                    )
            if current is not None:
                # Still in the loop (cancelled or not): the loop retires it before it admits the new one, whatever
                # share of the streams its cancellation check reaches this pass.
                self._retire.append(current)
            stream = Stream(key=key, sender=sender, job=job, not_before=self._clock())
            self._busy[key] = stream
            self._pending.append(stream)
            self._cond.notify_all()
        return None

    def cancel(self, key: CorrelationId) -> bool:
        """Stop the stream of sequence ``key`` as if its request had been cancelled (``on_exit`` reason
        ``"cancelled"``, then an empty response with FINAL, so its call ends normally); False if none runs.

        A client's cooperative cancel: it asks for this with a request of its own instead of cancelling the
        stream's gRPC call, whose cancellation races Triton 2.51's handler while responses are being written (the
        crash docs/triton-facts.md describes). The loop acts on it at its next pass, woken at once.
        """
        with self._cond:
            stream = self._busy.get(key)
            if stream is None:
                return False
            stream.cancel_seen = True
            self._cond.notify_all()
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop: every unfinished stream gets an error with the FINAL flag; waits up to ``timeout_s`` for the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                _log.warning("step loop thread still running %g s after close", timeout_s)
        else:
            self._shutdown()
        if self._outbox is not None:
            self._outbox.close(timeout_s)
        if self._watcher is not None:
            self._watcher.close(timeout_s)

    def run_pass(self) -> float | None:
        """One pass: cancellations, admissions, one step of every due stream.

        Returns how long the loop may wait before the next pass (None: nothing to do until a submit).
        """
        if self._outbox is not None:
            # At most one pass of responses waiting to leave: computing further ahead would only grow the
            # queue (and every client's latency) when sending is the slower side. Without overlap, none: the send
            # thread is idle (touches no Python) while the pass runs.
            self._outbox.wait_below(len(self._running) + 1 if self._overlap_sends else 1)
        trace = self._trace
        started = cpu = 0.0
        if trace is not None:
            started, cpu = trace.clock(), time.thread_time()
        with self._cond:
            new, self._pending = self._pending, []
            retire, self._retire = self._retire, []
        if trace is not None:
            for stream in new:
                trace.mark(stream.sender, "taken", started)
        if retire:
            new = self._retire_streams(retire, new)
        running = self._drop_cancelled(self._running, admitted=True)
        arrived = self._drop_cancelled(new, admitted=False)
        self._running = running
        if arrived:
            self._running = running + self._admitted(arrived, running)
        now = self._clock()
        due = [s for s in self._running if s.not_before <= now]
        if due:
            self._advance(due, now)
        if trace is not None and (arrived or due):
            trace.pass_done(
                start=started, end=trace.clock(), cpu_s=time.thread_time() - cpu, admitted=len(arrived),
                stepped=len(due), running=len(self._running),
            )  # fmt: skip
        if not self._running:
            if trace is not None:
                trace.flush_passes()
            return None
        wait = min(s.not_before for s in self._running) - self._clock()
        return min(max(wait, 0.0), self._cancel_poll_s)

    def _retire_streams(self, retire: list[Stream[J]], new: list[Stream[J]]) -> list[Stream[J]]:
        """End the streams a newer step of their sequence replaced, before anything is admitted; return ``new``
        without them.

        Each is in ``new`` (queued, never admitted), in the running list, or already finished (it ended on
        its own before the loop saw the replacement).
        """
        gone = {id(s) for s in retire}
        queued = [s for s in new if id(s) in gone]
        if queued:
            new = [s for s in new if id(s) not in gone]
        admitted = [s for s in self._running if id(s) in gone]
        if admitted:
            self._running = [s for s in self._running if id(s) not in gone]
        for stream, was_admitted in [*((s, False) for s in queued), *((s, True) for s in admitted)]:
            self._superseded += 1
            error = self._error(self._superseded_message(stream.key))
            self._finish(stream, error, "superseded", admitted=was_admitted)
        return new

    def _drop_cancelled(self, streams: list[Stream[J]], *, admitted: bool) -> list[Stream[J]]:
        """Drop the streams whose request was cancelled (or whose sending failed).

        A new stream is always asked. Of the running ones, each pass asks the ``1 / cancel_check_every``
        share asked longest ago (at least one), so each is asked once in ``cancel_check_every`` passes and a
        cancelled step stops within that many steps (one more with the watcher thread, which answers for the
        next pass).
        """
        ask: set[int] = set(map(id, streams))
        if admitted:
            self._passes += 1
            share = -(-len(streams) // self._cancel_check_every)
            ask = {id(s) for s in sorted(streams, key=lambda s: s.checked_at)[:share]}
            if self._watcher is not None:
                asked = [s for s in streams if id(s) in ask]
                for stream in asked:
                    stream.checked_at = self._passes
                self._watcher.ask(asked)
                ask = set()
        kept = []
        for stream in streams:
            if stream.send_failed:
                self._finish(stream, None, "failed", admitted=admitted)
                continue
            if stream.cancel_seen:
                self._cancelled += 1
                self._finish(stream, None, "cancelled", admitted=admitted)
                continue
            if id(stream) not in ask:
                kept.append(stream)
                continue
            stream.checked_at = self._passes
            if self._is_cancelled(stream):
                self._cancelled += 1
                self._finish(stream, None, "cancelled", admitted=admitted)
            else:
                kept.append(stream)
        return kept

    def _admitted(self, arrived: list[Stream[J]], running: list[Stream[J]]) -> list[Stream[J]]:
        if self._admit is None:
            return arrived
        admitted = []
        for stream, verdict in self._admit_isolated(arrived, running):
            if verdict is None:
                admitted.append(stream)
            elif isinstance(verdict, _Failed):
                # admit may have given it something (a slot) before it raised: on_exit frees it.
                self._finish(stream, self._error(f"admitting the request failed: {verdict.error}"), "failed")
            else:
                self._finish(stream, verdict, "failed", admitted=False)
        return admitted

    def _admit_isolated(self, arrived: list[Stream[J]], running: list[Stream[J]]) -> list[tuple[Stream[J], Any]]:
        """``admit`` for ``arrived``; when it raises, again on each half, down to the streams that fail alone."""
        assert self._admit is not None
        trace = self._trace
        if trace is not None:
            for stream in arrived:
                trace.mark(stream.sender, "admit_start")
        try:
            verdicts = list(self._admit(arrived, running))
        except Exception as err:
            if len(arrived) == 1:
                _log.exception("admit failed for sequence %r", arrived[0].key)
                return [(arrived[0], _Failed(err))]
            _log.warning("admit failed for %d streams (%s): trying them apart", len(arrived), err)
            mid = len(arrived) // 2
            first = self._admit_isolated(arrived[:mid], running)
            # The first half's admitted streams run now: the second half's admit must see them as running.
            running = running + [stream for stream, verdict in first if verdict is None]
            return first + self._admit_isolated(arrived[mid:], running)
        if trace is not None:
            for stream in arrived:
                trace.mark(stream.sender, "admit_end")
        if len(verdicts) != len(arrived):
            # A bug of the callback, not of a stream: trying fewer streams would not find a culprit.
            bug = RuntimeError(f"admit returned {len(verdicts)} verdicts for {len(arrived)} streams")
            _log.error("%s", bug)
            return [(s, _Failed(bug)) for s in arrived]
        return list(zip(arrived, verdicts, strict=True))

    def _step_isolated(self, due: list[Stream[J]]) -> list[tuple[Stream[J], StepOutput | _Failed]]:
        """``step`` for ``due``; when it raises, again on each half, down to the streams that fail alone."""
        try:
            outputs = list(self._step(due))
        except Exception as err:
            if len(due) == 1:
                _log.exception("step failed for sequence %r", due[0].key)
                return [(due[0], _Failed(err))]
            _log.warning("step failed for %d streams (%s): trying them apart", len(due), err)
            mid = len(due) // 2
            return self._step_isolated(due[:mid]) + self._step_isolated(due[mid:])
        if len(outputs) != len(due):
            bug = RuntimeError(f"step returned {len(outputs)} outputs for {len(due)} streams")
            _log.error("%s", bug)
            return [(s, _Failed(bug)) for s in due]
        return list(zip(due, outputs, strict=True))

    def _advance(self, due: list[Stream[J]], now: float) -> None:
        ended: set[int] = set()
        # The pass's responses go to the outbox at once: one wake-up of its thread per pass, not one per response
        # (each wake-up takes the GIL from the decode thread).
        outgoing: list[tuple[Stream[Any], Any, int]] = []
        stepped = self._step_isolated(due)
        trace = self._trace
        if trace is not None:
            done_at = trace.clock()
            for stream, _ in stepped:
                trace.mark(stream.sender, "step_end", done_at)
        for stream, out in stepped:
            if isinstance(out, _Failed):
                ended.add(id(stream))
                self._finish(stream, self._error(f"computing the next response failed: {out.error}"), "failed")
                continue
            stream.steps += 1
            if out.done:
                ended.add(id(stream))
                self._finish(stream, out.response, "done")
                continue
            stream.not_before = now + max(out.wait_s, 0.0)
            if out.response is None:
                continue
            if trace is not None:
                trace.mark(stream.sender, "queued")
            if self._outbox is not None:
                outgoing.append((stream, out.response, 0))
                continue
            if trace is not None:
                trace.mark(stream.sender, "send_start")
            try:
                stream.sender.send(out.response, flags=0)
            except Exception as err:
                _log.warning("sending a response for sequence %r failed: %s", stream.key, err)
                ended.add(id(stream))
                self._finish(stream, None, "failed")
            if trace is not None:
                trace.mark(stream.sender, "send_end")
        if outgoing:
            assert self._outbox is not None
            self._outbox.put_many(outgoing)
        if ended:
            self._running = [s for s in self._running if id(s) not in ended]

    def _finish(self, stream: Stream[J], response: Any, reason: ExitReason, *, admitted: bool = True) -> None:
        """End ``stream``: free its sequence, run ``on_exit``, then send ``response`` (or nothing) with FINAL."""
        stream.finished = True
        # Free the sequence before the FINAL goes out: a client that sends the next step as soon as
        # it reads FINAL must find the sequence free, not busy.
        with self._cond:
            if self._busy.get(stream.key) is stream:
                del self._busy[stream.key]
                self._cond.notify_all()  # a next step of this sequence may be waiting in submit()
        if admitted and self._on_exit is not None:
            try:
                self._on_exit(stream, reason)
            except Exception:
                _log.exception("on_exit failed for sequence %r", stream.key)
        if self._trace is not None:
            self._trace.mark(stream.sender, "queued")
        if self._outbox is not None:
            self._outbox.put(stream, response, self._final)
            return
        _send_final(stream, response, self._final, reason, self._trace)

    def _is_cancelled(self, stream: Stream[J]) -> bool:
        try:
            return bool(stream.sender.is_cancelled())
        except Exception as err:
            _log.warning("is_cancelled() failed for sequence %r, treated as cancelled: %s", stream.key, err)
            return True

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _error(self, message: str) -> Any:
        try:
            return self._error_response(message)
        except Exception:
            _log.exception("building an error response failed")
            return None

    def _shutdown(self) -> None:
        with self._cond:
            self._closing = True
            new, self._pending = self._pending, []
            self._retire = []  # each is in new or running, or already finished
        running, self._running = self._running, []
        for stream in running:
            self._finish(stream, self._error("the model is shutting down"), "shutdown")
        for stream in new:
            self._finish(stream, self._error("the model is shutting down"), "shutdown", admitted=False)

    def _run(self) -> None:
        wait: float | None = None
        while True:
            with self._cond:
                if not self._closing and not self._pending:
                    self._cond.wait(wait)
                if self._closing:
                    break
            try:
                wait = self.run_pass()
            except Exception:
                # The loop must outlive any bug in one pass, or every later request would hang.
                _log.exception("step loop pass failed")
                wait = self._cancel_poll_s
        self._shutdown()


@dataclass(frozen=True, slots=True)
class _Failed:
    """A callback raised for this stream alone."""

    error: Exception


def _superseded(key: CorrelationId) -> str:
    return (
        f"{SEQUENCE_BUSY} this step of sequence {key!r} was superseded by a newer request of the same sequence "
        "(a next step, or its END) and stopped; it was rolled back"
    )


def _send_final(stream: Stream[Any], response: Any, flags: int, reason: str, trace: StepTrace | None) -> None:
    if trace is not None:
        trace.mark(stream.sender, "send_start")
    try:
        if response is None:
            stream.sender.send(flags=flags)
        else:
            stream.sender.send(response, flags=flags)
    except Exception as err:
        # A cancelled request may refuse further sends; the stream is over either way.
        _log.debug("final send for sequence %r (%s) failed: %s", stream.key, reason, err)
    if trace is not None:
        trace.mark(stream.sender, "send_end")
        trace.finish(stream.sender)


class _Outbox:
    """Sends responses on a thread of its own, in the order they were put.

    The Python backend's ``send()`` waits until Triton's process has taken the response (a round trip
    between processes, about 0.3 ms here). Sent from the loop's thread, 32 streams' responses cost as much
    as the decode step that made them; sent from here, they overlap the next step (both release the GIL).
    One thread keeps every stream's responses in order, its FINAL last.
    """

    def __init__(self, name: str, trace: StepTrace | None = None) -> None:
        self._trace = trace
        self._queue: deque[tuple[Stream[Any], Any, int]] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, stream: Stream[Any], response: Any, flags: int) -> None:
        self.put_many([(stream, response, flags)])

    def put_many(self, items: Sequence[tuple[Stream[Any], Any, int]]) -> None:
        with self._cond:
            self._queue.extend(items)
            self._cond.notify_all()

    def wait_below(self, limit: int) -> None:
        """Block until fewer than ``limit`` responses wait (or the outbox closes)."""
        with self._cond:
            # A dead sender thread (a bug) must not hang the loop: then the queue only grows, as it would
            # without this limit.
            while len(self._queue) >= max(limit, 1) and not self._closing and self._thread.is_alive():
                self._cond.wait(_BUSY_POLL_S)

    def close(self, timeout_s: float) -> None:
        """Send what is queued, then stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                # What waits now, sent in one go: the lock and the waiters are touched once per batch. The items
                # stay queued until sent, so wait_below counts them.
                batch = list(self._queue)
            trace = self._trace
            for stream, response, flags in batch:
                if flags:
                    _send_final(stream, response, flags, "final", trace)
                elif not stream.send_failed:
                    if trace is not None:
                        trace.mark(stream.sender, "send_start")
                    try:
                        stream.sender.send(response, flags=0)
                    except Exception as err:
                        _log.warning("sending a response for sequence %r failed: %s", stream.key, err)
                        stream.send_failed = True  # the loop ends the stream at its next pass
                    if trace is not None:
                        trace.mark(stream.sender, "send_end")
            with self._cond:
                for _ in batch:
                    self._queue.popleft()
                self._cond.notify_all()


class _Watcher:
    """Asks running streams whether their request was cancelled, on a thread of its own.

    ``is_cancelled()`` is a round trip to Triton's process: asked on the loop's thread it stalls the decode
    for every stream asked. Here it overlaps the next pass (the wait releases the GIL); a stream found
    cancelled gets ``cancel_seen``, which the loop acts on at its next pass (``wake`` runs it at once if it
    waits). A stream the loop ended meanwhile is skipped, or its answer ignored.
    """

    def __init__(self, name: str, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._queue: deque[Stream[Any]] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def ask(self, streams: Sequence[Stream[Any]]) -> None:
        fresh = [s for s in streams if not s.check_queued and not s.finished]
        if not fresh:
            return
        with self._cond:
            for stream in fresh:
                stream.check_queued = True
                self._queue.append(stream)
            self._cond.notify_all()

    def close(self, timeout_s: float) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                stream = self._queue.popleft()
            try:
                if stream.finished:
                    continue
                try:
                    cancelled = bool(stream.sender.is_cancelled())
                except Exception as err:
                    # A request that ended meanwhile may refuse the question: then the answer does not matter.
                    if stream.finished:
                        continue
                    _log.warning("is_cancelled() failed for sequence %r, treated as cancelled: %s", stream.key, err)
                    cancelled = True
                if cancelled and not stream.finished:
                    stream.cancel_seen = True
                    self._wake()
            finally:
                stream.check_queued = False
