"""Pure unit tests of the decoupled step loop (triton_npu_client.server.StepLoop), without Triton.

Fake response senders stand in for Triton's: the loop's pacing, cancellation and shutdown paths depend
on timings a real server cannot be made to produce on demand. Most tests drive the loop pass by pass
(``start=False``) with a hand-moved clock; the threaded tests wait for events, never for time.
The same loop, inside a real Triton, is tested in test_seq_count_stream.py.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from triton_npu_client.server import SEQUENCE_BUSY, ExitReason, StepLoop, StepOutput, Stream
from triton_npu_client.server._generate import DEFAULT_CANCEL_CHECK_EVERY

FINAL = 1
DEADLINE_S = 30.0  # only a bound on waiting for an event; never reached when the code is right


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeSender:
    """Records what a stream's sender got; FINAL twice, or anything after FINAL, is a test failure."""

    def __init__(self, *, on_final: Any = None) -> None:
        self.sent: list[tuple[Any, int]] = []
        self.cancel = False
        self.broken_send = False
        self.final = threading.Event()
        self.first = threading.Event()
        self.after_final: list[Any] = []
        self._on_final = on_final
        self._lock = threading.Lock()

    def send(self, response: Any = None, flags: int = 0) -> None:
        if self.broken_send and not flags & FINAL:
            raise RuntimeError("sender is gone")
        with self._lock:
            if self.final.is_set():
                self.after_final.append((response, flags))
                return
            self.sent.append((response, flags))
        self.first.set()
        if flags & FINAL:
            if self._on_final is not None:
                self._on_final()
            self.final.set()

    def is_cancelled(self) -> bool:
        return self.cancel

    @property
    def responses(self) -> list[Any]:
        with self._lock:
            return [r for r, _ in self.sent if r is not None]

    @property
    def flags(self) -> list[int]:
        with self._lock:
            return [f for _, f in self.sent]


@dataclass
class Job:
    """Emit ``n`` pieces, waiting ``wait_s`` between two."""

    n: int
    wait_s: float = 0.0
    emitted: list[int] = field(default_factory=list)


class Model:
    """Callbacks that record how the loop called them."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []
        self.admitted: list[tuple[list[Any], list[Any]]] = []
        self.exits: list[tuple[Any, ExitReason]] = []
        self.refuse: set[Any] = set()
        self.fail_step = False
        self.fail_admit = False
        # Keys whose presence makes step (or admit) raise, before it mutates anything.
        self.poison_step: set[Any] = set()
        self.poison_admit: set[Any] = set()

    def step(self, due: Sequence[Stream[Job]]) -> list[StepOutput]:
        keys = [s.key for s in due]
        self.batches.append(keys)
        if len(set(keys)) != len(keys):
            raise AssertionError(f"two streams of one sequence in one step: {keys}")
        if self.fail_step:
            raise ValueError("boom in step")
        if bad := self.poison_step.intersection(keys):
            raise ValueError(f"poisoned step {sorted(bad)}")
        outs = []
        for s in due:
            if s.job.n == 0:
                outs.append(StepOutput(done=True))
                continue
            piece = len(s.job.emitted) + 1
            s.job.emitted.append(piece)
            done = piece == s.job.n
            outs.append(StepOutput(response=(s.key, piece), done=done, wait_s=s.job.wait_s))
        return outs

    def admit(self, new: Sequence[Stream[Job]], running: Sequence[Stream[Job]]) -> list[Any]:
        self.admitted.append(([s.key for s in new], [s.key for s in running]))
        if self.fail_admit:
            raise ValueError("boom in admit")
        if bad := self.poison_admit.intersection(s.key for s in new):
            raise ValueError(f"poisoned admit {sorted(bad)}")
        return [("refused", s.key) if s.key in self.refuse else None for s in new]

    def on_exit(self, stream: Stream[Job], reason: ExitReason) -> None:
        self.exits.append((stream.key, reason))


def make_loop(model: Model, clock: FakeClock | None = None, **kwargs: Any) -> StepLoop[Job]:
    # Every stream asked every pass unless a test says otherwise (the rotation has its own test).
    kwargs.setdefault("cancel_check_every", 1)
    return StepLoop(
        step=model.step,
        admit=model.admit,
        on_exit=model.on_exit,
        final_flag=FINAL,
        error_response=lambda message: ("error", message),
        clock=clock or FakeClock(),
        **kwargs,
    )


def test_every_pass_advances_all_active_streams_by_one_response_and_ends_each_with_final() -> None:
    """Three streams of 3, 1 and 0 pieces: one step call per pass, one response per stream per pass, FINAL last."""
    model = Model()
    loop = make_loop(model, start=False)
    senders = {key: FakeSender() for key in (1, 2, 3)}
    for key, n in ((1, 3), (2, 1), (3, 0)):
        assert loop.submit(key, senders[key], Job(n)) is None
    assert loop.active == 3

    assert loop.run_pass() == 0.0  # stream 1 still has work and is due at once
    assert model.batches == [[1, 2, 3]]
    assert senders[1].sent == [((1, 1), 0)]
    assert senders[2].sent == [((2, 1), FINAL)]  # FINAL on the last response, not alone
    assert senders[3].sent == [(None, FINAL)]  # nothing to send: FINAL alone
    assert loop.active == 1

    loop.run_pass()
    assert loop.run_pass() is None  # nothing left to do until the next submit
    assert model.batches == [[1, 2, 3], [1], [1]]
    assert senders[1].sent == [((1, 1), 0), ((1, 2), 0), ((1, 3), FINAL)]
    assert sorted(model.exits) == [(1, "done"), (2, "done"), (3, "done")]
    assert loop.active == 0
    assert all(not s.after_final for s in senders.values())


def test_a_second_step_of_a_streaming_sequence_is_refused_and_never_interleaved() -> None:
    """While sequence 7 streams, another step of 7 is refused (busy marker); a different sequence is not."""
    model = Model()
    loop = make_loop(model, start=False)
    first = FakeSender()
    assert loop.submit(7, first, Job(3)) is None
    loop.run_pass()
    refusal = loop.submit(7, FakeSender(), Job(5))
    assert refusal is not None
    assert refusal.reason == "busy"
    assert refusal.message.startswith(SEQUENCE_BUSY)
    assert "sequence 7 is busy" in refusal.message
    assert loop.submit(8, FakeSender(), Job(1)) is None
    while loop.run_pass() is not None:
        pass
    # The refused step never reached the model: stream 7 emitted exactly its own three pieces.
    assert first.responses == [(7, 1), (7, 2), (7, 3)]
    assert all(keys.count(7) == 1 for keys in model.batches)
    assert loop.submit(7, FakeSender(), Job(1)) is None  # free again once its step ended


def test_the_sequence_is_free_before_its_final_flag_goes_out() -> None:
    """A client that sends the next step the moment it reads FINAL must not be told the sequence is busy."""
    model = Model()
    loop = make_loop(model, start=False)
    verdicts: list[Any] = []
    sender = FakeSender(on_final=lambda: verdicts.append(loop.submit(5, FakeSender(), Job(1))))
    loop.submit(5, sender, Job(2))
    loop.run_pass()
    loop.run_pass()
    assert sender.final.is_set()
    assert verdicts == [None]


def test_a_cancelled_stream_stops_at_the_next_pass_and_the_others_go_on() -> None:
    """Cancelling stream 1 mid-way: FINAL alone, no more steps, counted; stream 2 runs to its end."""
    model = Model()
    loop = make_loop(model, start=False)
    one, two = FakeSender(), FakeSender()
    loop.submit(1, one, Job(100))
    loop.submit(2, two, Job(4))
    loop.run_pass()
    loop.run_pass()
    one.cancel = True
    loop.run_pass()
    assert one.sent == [((1, 1), 0), ((1, 2), 0), (None, FINAL)]
    assert loop.cancelled == 1
    assert (1, "cancelled") in model.exits
    while loop.run_pass() is not None:
        pass
    assert two.responses == [(2, 1), (2, 2), (2, 3), (2, 4)]
    assert two.flags[-1] == FINAL
    assert all(1 not in keys for keys in model.batches[2:])
    assert loop.cancelled == 1


def test_cancel_stops_a_sequences_stream_as_its_cancelled_request_would() -> None:
    """loop.cancel(key) (a client's CANCEL request): that stream ends at the next pass as cancelled, with an
    empty FINAL (its call ends normally), though its sender never said cancelled; the other stream goes on, and
    cancelling a sequence with nothing streaming (or cancelled already) says so."""
    model = Model()
    loop = make_loop(model, start=False)
    one, two = FakeSender(), FakeSender()
    loop.submit(1, one, Job(100))
    loop.submit(2, two, Job(4))
    loop.run_pass()
    assert loop.cancel(1) is True
    assert loop.cancel(3) is False
    loop.run_pass()
    assert one.sent == [((1, 1), 0), (None, FINAL)]
    assert not one.cancel
    assert (1, "cancelled") in model.exits
    assert loop.cancelled == 1
    assert loop.cancel(1) is False  # ended: nothing left to stop
    while loop.run_pass() is not None:
        pass
    assert two.responses == [(2, 1), (2, 2), (2, 3), (2, 4)]
    assert all(1 not in keys for keys in model.batches[1:])


def test_cancel_of_a_stream_not_admitted_yet_never_admits_it() -> None:
    model = Model()
    loop = make_loop(model, start=False)
    one = FakeSender()
    loop.submit(1, one, Job(5))
    assert loop.cancel(1) is True
    assert loop.run_pass() is None
    assert one.sent == [(None, FINAL)]
    assert model.batches == []


def test_a_stream_cancelled_before_admission_is_never_admitted() -> None:
    """Cancelled while queued: counted, FINAL sent, and neither admit, step nor on_exit sees it."""
    model = Model()
    loop = make_loop(model, start=False)
    sender = FakeSender()
    loop.submit(3, sender, Job(5))
    sender.cancel = True
    assert loop.run_pass() is None
    assert sender.sent == [(None, FINAL)]
    assert loop.cancelled == 1
    assert model.admitted == []
    assert model.batches == []
    assert model.exits == []


def test_pacing_waits_between_steps_and_still_sees_cancellation_while_waiting() -> None:
    """wait_s delays the next step; the loop's wait is capped so cancellation is checked meanwhile."""
    model = Model()
    clock = FakeClock()
    loop = make_loop(model, clock, start=False, cancel_poll_s=0.05)
    slow, fast = FakeSender(), FakeSender()
    loop.submit(1, slow, Job(3, wait_s=1.0))
    loop.submit(2, fast, Job(10, wait_s=0.01))
    assert loop.run_pass() == pytest.approx(0.01)
    clock.now += 0.01
    loop.run_pass()
    assert slow.responses == [(1, 1)]  # not due yet
    assert fast.responses == [(2, 1), (2, 2)]
    fast.cancel = True
    assert loop.run_pass() == pytest.approx(0.05)  # 0.98 s to go, but the wait is capped for cancellations
    assert fast.flags[-1] == FINAL
    slow.cancel = True
    clock.now += 0.05
    assert loop.run_pass() is None
    assert slow.sent == [((1, 1), 0), (None, FINAL)]  # stopped while waiting: no second step taken
    assert loop.cancelled == 2


def test_admit_sees_new_and_running_streams_and_can_refuse() -> None:
    """admit gets the arrivals and the running streams; a refused arrival gets its response with FINAL."""
    model = Model()
    model.refuse = {9}
    loop = make_loop(model, start=False)
    loop.submit(1, FakeSender(), Job(5))
    loop.run_pass()
    refused = FakeSender()
    loop.submit(9, refused, Job(5))
    loop.submit(2, FakeSender(), Job(5))
    loop.run_pass()
    assert model.admitted == [([1], []), ([9, 2], [1])]
    assert refused.sent == [(("refused", 9), FINAL)]
    assert all(9 not in keys for keys in model.batches)
    assert (9, "failed") not in model.exits  # never admitted: nothing of it to free
    assert loop.submit(9, FakeSender(), Job(1)) is None  # its sequence is free again


@pytest.mark.parametrize("where", ["step", "admit"])
def test_a_failing_callback_fails_its_streams_and_the_loop_goes_on(where: str) -> None:
    """An exception in step/admit ends the affected streams with an error and FINAL; later streams run."""
    model = Model()
    loop = make_loop(model, start=False)
    victim = FakeSender()
    loop.submit(1, victim, Job(3))
    setattr(model, f"fail_{where}", True)
    loop.run_pass()
    assert len(victim.sent) == 1
    response, flags = victim.sent[0]
    assert flags == FINAL
    assert response[0] == "error"
    assert f"boom in {where}" in response[1]
    setattr(model, f"fail_{where}", False)
    later = FakeSender()
    loop.submit(1, later, Job(2))
    while loop.run_pass() is not None:
        pass
    assert later.responses == [(1, 1), (1, 2)]


def test_a_step_returning_the_wrong_number_of_outputs_fails_its_streams() -> None:
    """A buggy step callback (one output for two streams) ends both with an error, never a misrouted response."""
    loop: StepLoop[Job] = StepLoop(
        step=lambda due: [StepOutput(response="x")],
        final_flag=FINAL,
        error_response=lambda message: ("error", message),
        start=False,
    )
    a, b = FakeSender(), FakeSender()
    loop.submit(1, a, Job(1))
    loop.submit(2, b, Job(1))
    loop.run_pass()
    for sender in (a, b):
        assert sender.flags == [FINAL]
        assert "1 outputs for 2 streams" in sender.sent[0][0][1]
    assert loop.active == 0


def test_a_broken_sender_or_is_cancelled_ends_only_its_stream() -> None:
    """send() raising ends that stream (on_exit "failed"); is_cancelled() raising counts as cancelled."""
    model = Model()
    loop = make_loop(model, start=False)
    broken, odd, fine = FakeSender(), FakeSender(), FakeSender()
    broken.broken_send = True

    def unsure() -> bool:
        raise RuntimeError("lost")

    loop.submit(1, broken, Job(5))
    loop.submit(2, odd, Job(5))
    loop.submit(3, fine, Job(2))
    odd.is_cancelled = unsure  # type: ignore[method-assign]
    loop.run_pass()
    loop.run_pass()
    assert broken.sent == [(None, FINAL)]
    assert (1, "failed") in model.exits
    assert odd.sent == [(None, FINAL)]
    assert loop.cancelled == 1
    assert fine.responses == [(3, 1), (3, 2)]


def test_threaded_loop_streams_concurrently_and_stops_a_cancelled_stream_within_a_pass() -> None:
    """On its thread: a cancelled endless stream gets at most one more response, a finite one completes.

    Alone in the loop, the stream is asked every pass (a share of one stream is the stream).
    """
    model = Model()
    loop = StepLoop(
        step=model.step,
        admit=model.admit,
        on_exit=model.on_exit,
        final_flag=FINAL,
        error_response=lambda message: ("error", message),
        name="test-step-loop-cancel",
    )
    try:
        endless, finite = FakeSender(), FakeSender()
        loop.submit(1, endless, Job(10**9, wait_s=0.001))
        loop.submit(2, finite, Job(50, wait_s=0.001))
        assert finite.final.wait(DEADLINE_S)
        endless.cancel = True
        seen = len(endless.responses)
        assert seen >= 1
        assert endless.final.wait(DEADLINE_S)
        assert len(endless.responses) <= seen + 1  # a pass already past its check may send one more
        assert loop.cancelled == 1
        assert finite.responses == [(2, i) for i in range(1, 51)]
        assert loop.active == 0
    finally:
        loop.close()


def test_each_running_stream_is_asked_once_in_cancel_check_every_passes() -> None:
    """is_cancelled() is a round trip to Triton's process: each pass asks a rotating quarter of the streams."""
    model = Model()
    loop = make_loop(model, start=False, cancel_check_every=4)

    class Counting(FakeSender):
        def __init__(self) -> None:
            super().__init__()
            self.asked = 0

        def is_cancelled(self) -> bool:
            self.asked += 1
            return self.cancel

    senders = [Counting() for _ in range(8)]
    for key, sender in enumerate(senders, start=1):
        loop.submit(key, sender, Job(100))
    loop.run_pass()  # arrivals: every one asked once
    assert [s.asked for s in senders] == [1] * 8
    for _ in range(4):
        loop.run_pass()  # 2 of 8 per pass: each asked once more over 4 passes
    assert [s.asked for s in senders] == [2] * 8
    victim = senders[3]
    victim.cancel = True
    passes = 0
    while not victim.final.is_set() and passes < 10:
        loop.run_pass()
        passes += 1
    assert victim.final.is_set()
    assert passes <= 4
    assert loop.cancelled == 1
    assert not any(s.final.is_set() for s in senders if s is not victim)


def test_background_sends_keep_each_streams_order_and_final_last() -> None:
    """With sends on the outbox thread, every stream still gets its responses in order, FINAL last and once."""
    model = Model()
    loop = StepLoop(
        step=model.step,
        admit=model.admit,
        on_exit=model.on_exit,
        final_flag=FINAL,
        error_response=lambda message: ("error", message),
        name="test-step-loop-outbox",
    )
    try:
        senders = [FakeSender() for _ in range(8)]
        for key, sender in enumerate(senders, start=1):
            loop.submit(key, sender, Job(30))
        for sender in senders:
            assert sender.final.wait(DEADLINE_S)
        for key, sender in enumerate(senders, start=1):
            assert sender.responses == [(key, i) for i in range(1, 31)]
            assert sender.flags[-1] == FINAL
            assert sender.flags.count(FINAL) == 1
            assert sender.after_final == []
    finally:
        loop.close()


def test_close_wakes_a_waiting_loop_and_ends_every_stream() -> None:
    """close() returns although the loop waits on an hour-long pace; streams get an error with FINAL."""
    model = Model()
    name = "test-step-loop-close"
    loop = StepLoop(
        step=model.step,
        admit=model.admit,
        on_exit=model.on_exit,
        final_flag=FINAL,
        error_response=lambda message: ("error", message),
        cancel_poll_s=3600.0,
        name=name,
    )
    waiting = FakeSender()
    loop.submit(1, waiting, Job(3, wait_s=3600.0))
    assert waiting.first.wait(DEADLINE_S)  # the first step is immediate; then the loop waits for an hour
    loop.close(timeout_s=DEADLINE_S)
    assert name not in {t.name for t in threading.enumerate()}
    assert waiting.flags == [0, FINAL]
    assert waiting.sent[-1][0] == ("error", "the model is shutting down")
    assert (1, "shutdown") in model.exits
    refusal = loop.submit(2, FakeSender(), Job(1))
    assert refusal is not None
    assert refusal.reason == "closed"
    assert loop.closed


def test_cancel_poll_must_be_positive() -> None:
    with pytest.raises(ValueError, match="cancel_poll_s"):
        StepLoop(step=lambda due: [], final_flag=FINAL, error_response=str, cancel_poll_s=0, start=False)


def test_a_step_after_a_cancelled_one_is_accepted_at_once_and_runs_after_it_is_reaped() -> None:
    """Cancel, then the next step of the same sequence before the loop noticed: accepted, never interleaved."""
    model = Model()
    loop = make_loop(model, start=False)
    old = FakeSender()
    assert loop.submit(7, old, Job(100)) is None
    loop.run_pass()
    old.cancel = True
    new = FakeSender()
    assert loop.submit(7, new, Job(2)) is None  # no busy refusal, no wait
    while loop.run_pass() is not None:
        pass
    assert model.exits[0] == (7, "superseded")  # the old stream left before the new one ran
    assert old.responses[0] == (7, 1)
    assert old.flags == [0, FINAL]
    assert SEQUENCE_BUSY in old.responses[-1][1]
    assert "superseded" in old.responses[-1][1]
    assert new.responses == [(7, 1), (7, 2)]
    assert loop.submit(7, FakeSender(), Job(1)) is None


def test_a_step_of_a_busy_sequence_waits_for_the_previous_one_within_the_grace() -> None:
    """A step that arrives while the previous one is finishing waits (bounded) and is then accepted."""
    model = Model()
    loop = make_loop(model, busy_grace_s=DEADLINE_S)  # threaded: the loop finishes the old step meanwhile
    try:
        old = FakeSender()
        assert loop.submit(7, old, Job(3, wait_s=0.0)) is None
        assert loop.submit(7, FakeSender(), Job(1)) is None  # waited for the old step to finish
        # Its FINAL leaves from the outbox thread, ahead of anything the new step sends.
        assert old.final.wait(DEADLINE_S)
        assert old.responses == [(7, 1), (7, 2), (7, 3)]
    finally:
        loop.close()


# --- one stream per sequence, with the default cancellation sampling ------------------------------------------


def default_loop(model: Model, **kwargs: Any) -> StepLoop[Job]:
    """The loop as the chat model runs it: superseding, and asking only a share of the streams each pass."""
    assert DEFAULT_CANCEL_CHECK_EVERY > 1  # else these tests would not test the sampling
    return make_loop(model, start=False, cancel_check_every=DEFAULT_CANCEL_CHECK_EVERY, **kwargs)


@pytest.mark.parametrize("overlap", ["refuse", "supersede"])
def test_cancel_then_next_step_at_once_never_puts_two_streams_of_a_sequence_in_one_pass(overlap: str) -> None:
    """Eight streams; 4 is cancelled and its next step sent at once, before a pass asked 4: the old one leaves first.

    Today's main accepted the new step (its predecessor was cancelled) and the loop, asking a quarter of the
    streams per pass, ran both in one step: every other stream failed with it.
    """
    model = Model()
    loop = default_loop(model, overlap=overlap)

    class Counting(FakeSender):
        asked = 0

        def is_cancelled(self) -> bool:
            self.asked += 1
            return self.cancel

    senders = {key: Counting() for key in range(1, 9)}
    for key, sender in senders.items():
        assert loop.submit(key, sender, Job(6)) is None
    loop.run_pass()  # admission: every stream asked
    # Rotate until a pass asks 4: the next pass asks two of the others, not 4.
    while True:
        asked = senders[4].asked
        loop.run_pass()
        if senders[4].asked > asked:
            break
    senders[4].cancel = True
    nxt = FakeSender()
    assert loop.submit(4, nxt, Job(3)) is None
    while loop.run_pass() is not None:
        pass
    assert all(len(set(keys)) == len(keys) for keys in model.batches), model.batches
    assert nxt.responses == [(4, 1), (4, 2), (4, 3)]
    assert model.exits.index((4, "superseded")) < model.exits.index((4, "done"))
    for key, sender in senders.items():
        if key != 4:
            assert sender.responses == [(key, i) for i in range(1, 7)], key
            assert sender.flags.count(FINAL) == 1
    assert loop.active == 0


def test_supersede_retires_a_running_stream_that_was_never_cancelled() -> None:
    """overlap="supersede": a new step (or an END) of a streaming sequence is accepted at once; the old stream
    ends as superseded, with an error saying so, in the loop's thread, before the new one is admitted."""
    model = Model()
    loop = default_loop(model, overlap="supersede", busy_grace_s=3600.0)  # no grace wait would ever apply
    old, other = FakeSender(), FakeSender()
    loop.submit(1, old, Job(100))
    loop.submit(2, other, Job(5))
    loop.run_pass()
    loop.run_pass()
    closing = FakeSender()
    assert loop.submit(1, closing, Job(0)) is None  # an END-only close: one pass, no piece
    assert loop.active == 2  # the old stream is no longer counted: its sequence's stream is the new one
    loop.run_pass()
    assert old.responses[:2] == [(1, 1), (1, 2)]
    assert old.flags == [0, 0, FINAL]
    message = old.sent[-1][0][1]
    assert message.startswith(SEQUENCE_BUSY)
    assert "superseded" in message
    assert closing.sent == [(None, FINAL)]
    assert model.exits[:2] == [(1, "superseded"), (1, "done")]
    assert model.admitted[-1] == ([1], [2])  # admitted after the old one left the running set
    assert loop.superseded == 1
    assert loop.cancelled == 0  # nobody cancelled it
    while loop.run_pass() is not None:
        pass
    assert other.responses == [(2, i) for i in range(1, 6)]


def test_a_superseded_stream_still_queued_is_never_admitted() -> None:
    """Two steps of one sequence before any pass: the older is answered (superseded) and never reaches admit."""
    model = Model()
    loop = default_loop(model, overlap="supersede")
    first, second = FakeSender(), FakeSender()
    loop.submit(3, first, Job(5))
    loop.submit(3, second, Job(2))
    while loop.run_pass() is not None:
        pass
    assert first.flags == [FINAL]
    assert "superseded" in first.sent[0][0][1]
    assert model.admitted == [([3], [])]
    assert second.responses == [(3, 1), (3, 2)]
    assert (3, "cancelled") not in model.exits  # never admitted: nothing of it to free


@pytest.mark.parametrize("size", [2, 7])
def test_a_failing_step_fails_only_the_stream_that_causes_it(size: int) -> None:
    """step raises whenever stream 2 is in the batch: the loop splits the batch, fails 2 alone, the rest go on."""
    model = Model()
    model.poison_step = {2}
    loop = default_loop(model, overlap="supersede")
    senders = {key: FakeSender() for key in range(1, size + 1)}
    for key, sender in senders.items():
        loop.submit(key, sender, Job(4))
    while loop.run_pass() is not None:
        pass
    victim = senders.pop(2)
    assert victim.flags == [FINAL]
    assert victim.sent[0][0][0] == "error"
    assert "poisoned step [2]" in victim.sent[0][0][1]
    assert (2, "failed") in model.exits
    for key, sender in senders.items():
        assert sender.responses == [(key, i) for i in range(1, 5)], key  # each piece once: the retry is exact
        assert sender.flags.count(FINAL) == 1


def test_a_failing_admit_fails_only_the_stream_that_causes_it() -> None:
    """admit raises whenever 5 arrives: the others of its pass are admitted; 5 is failed, and on_exit frees it."""
    model = Model()
    model.poison_admit = {5}
    loop = default_loop(model, overlap="supersede")
    senders = {key: FakeSender() for key in range(1, 7)}
    for key, sender in senders.items():
        loop.submit(key, sender, Job(2))
    while loop.run_pass() is not None:
        pass
    victim = senders.pop(5)
    assert victim.flags == [FINAL]
    assert "admitting the request failed: poisoned admit [5]" in victim.sent[0][0][1]
    assert (5, "failed") in model.exits  # admit may have given it something: on_exit is its chance to free it
    # Each retry sees the streams admitted before it as running (an eviction must never take their slots).
    assert model.admitted[-1] == ([6], [1, 2, 3, 4])
    for key, sender in senders.items():
        assert sender.responses == [(key, 1), (key, 2)]
