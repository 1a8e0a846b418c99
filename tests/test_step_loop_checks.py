"""StepLoop's background cancellation checks: running streams are asked from a thread of their own.

``is_cancelled()`` is a round trip to Triton's process; asked on the loop's thread it stalls every stream's
decode. Threaded loops with fake senders, no Triton; the tests wait for events, never for time.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from test_server_toolkit_generate import DEADLINE_S, FINAL, FakeSender, Job, Model

from triton_npu_client.server import StepLoop, StepOutput, Stream

NAME = "test-step-loop-checks"


class AskedSender(FakeSender):
    """Records which thread asked ``is_cancelled()``; ``asked_aside`` is set once the watcher thread asked."""

    def __init__(self, *, broken: bool = False) -> None:
        super().__init__()
        self.askers: list[str] = []
        self.asked_aside = threading.Event()
        self.broken = broken

    def is_cancelled(self) -> bool:
        name = threading.current_thread().name
        self.askers.append(name)
        if name != NAME:
            self.asked_aside.set()
        if self.broken and name != NAME:
            raise RuntimeError("the request is gone")
        return self.cancel


class Endless(Model):
    """Streams that never finish on their own, paced so that the loop does not spin."""

    def step(self, due: Sequence[Stream[Job]]) -> list[StepOutput]:
        return [StepOutput(response=(s.key, 0), wait_s=0.002) for s in due]


def make_loop(model: Model) -> StepLoop[Job]:
    return StepLoop(
        step=model.step,
        admit=model.admit,
        on_exit=model.on_exit,
        final_flag=FINAL,
        error_response=lambda message: ("error", message),
        cancel_check_every=2,
        background_checks=True,  # off by default (see StepLoop): these fake senders outlive their FINAL safely
        name=NAME,
    )


def test_running_streams_are_asked_off_the_loop_thread_and_a_cancel_still_stops_one() -> None:
    model = Endless()
    loop = make_loop(model)
    senders = [AskedSender() for _ in range(4)]
    try:
        for key, sender in enumerate(senders, start=1):
            assert loop.submit(key, sender, Job(0)) is None
        for sender in senders:
            assert sender.asked_aside.wait(DEADLINE_S)
        victim = senders[1]
        victim.cancel = True
        assert victim.final.wait(DEADLINE_S)
        assert victim.flags[-1] == FINAL
        assert (2, "cancelled") in model.exits
        assert loop.cancelled == 1
        assert not any(s.final.is_set() for s in senders if s is not victim)
    finally:
        loop.close(timeout_s=DEADLINE_S)
    # The loop's own thread asks each stream once, on arrival, before admitting it; every later question came
    # from the watcher thread.
    for sender in senders:
        assert sender.askers[0] == NAME
        assert sender.askers.count(NAME) == 1
        assert len(sender.askers) >= 2
    assert not {f"{NAME}-cancel", f"{NAME}-send", NAME} & {t.name for t in threading.enumerate()}


def test_a_check_that_fails_on_the_watcher_ends_the_stream_as_cancelled() -> None:
    model = Endless()
    loop = make_loop(model)
    broken, fine = AskedSender(broken=True), AskedSender()
    try:
        loop.submit(1, broken, Job(0))
        loop.submit(2, fine, Job(0))
        assert broken.final.wait(DEADLINE_S)
        assert (1, "cancelled") in model.exits
        assert fine.asked_aside.wait(DEADLINE_S)
        assert not fine.final.is_set()
    finally:
        loop.close(timeout_s=DEADLINE_S)
    assert fine.final.is_set()  # closing ends it, with the shutdown error
    assert fine.sent[-1] == (("error", "the model is shutting down"), FINAL)


def test_without_a_thread_the_checks_stay_inline() -> None:
    """Driven pass by pass (start=False) the loop asks in the pass itself: tests keep exact pass counts."""
    model = Endless()
    loop = StepLoop(step=model.step, final_flag=FINAL, error_response=str, cancel_check_every=1, start=False)
    sender = AskedSender()
    loop.submit(1, sender, Job(0))
    loop.run_pass()
    sender.cancel = True
    loop.run_pass()
    assert sender.final.is_set()
    assert loop.cancelled == 1
