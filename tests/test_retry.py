"""RetryPolicy: the delay is a pure function; only transport failures are retried, a bounded number of times.

The policy is the one place a retry is decided (what, where, how long): its decisions are checked pure here, and
through real servers below that no loop nests inside another (scoring, the fleet, the caller: one loop)."""

from __future__ import annotations

import random
import socket
import time

import numpy as np
import pytest
from _seams import CountingTransport
from hypothesis import given
from hypothesis import strategies as st

from triton_npu_client import (
    Client,
    ConnectError,
    FleetOptions,
    InvalidArgumentError,
    JobAborted,
    LocalTriton,
    ModelNotFoundError,
    ModelNotReadyError,
    RequestTimeout,
    RetryPolicy,
    ServerUnavailable,
    TritonError,
    score_rows,
)
from triton_npu_client._call import Retry, is_retriable, run_with_retry
from triton_npu_client._client._model import Model


@given(
    attempt=st.integers(1, 40),
    initial=st.floats(0, 5),
    cap=st.floats(0, 30),
    mult=st.floats(1, 4),
    jitter=st.floats(0, 1),
    seed=st.integers(0, 2**32),
)
def test_delay_is_bounded_and_deterministic(
    attempt: int, initial: float, cap: float, mult: float, jitter: float, seed: int
) -> None:
    """delay_s lies in [(1-jitter)*base, base] with base = min(cap, initial*mult**(n-1)), same for the same rng."""
    policy = RetryPolicy(initial_backoff_s=initial, max_backoff_s=cap, multiplier=mult, jitter=jitter)
    base = min(cap, initial * mult ** (attempt - 1))
    d = policy.delay_s(attempt, random.Random(seed))
    assert (1 - jitter) * base - 1e-12 <= d <= base + 1e-12
    assert d == policy.delay_s(attempt, random.Random(seed))


def test_no_jitter_is_exact_exponential() -> None:
    """Without jitter the delays double up to the cap."""
    policy = RetryPolicy(initial_backoff_s=0.1, max_backoff_s=0.5, multiplier=2, jitter=0)
    assert [policy.delay_s(n) for n in range(1, 6)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    with pytest.raises(ValueError, match="attempt"):
        policy.delay_s(0)


def test_what_is_retriable() -> None:
    """Connect failures and UNAVAILABLE are retriable; invalid input and timeouts never are."""
    assert is_retriable(ConnectError("x"))
    assert is_retriable(ServerUnavailable("x"))
    assert not is_retriable(InvalidArgumentError("x"))
    assert not is_retriable(RequestTimeout("x"))


@pytest.mark.parametrize(
    ("errors", "calls", "raised"),
    [
        ([ServerUnavailable("busy"), ConnectError("down")], 3, None),
        ([ServerUnavailable("busy")] * 5, 4, ServerUnavailable),
        ([InvalidArgumentError("bad")], 1, InvalidArgumentError),
    ],
)
async def test_run_with_retry(errors: list[TritonError], calls: int, raised: type[Exception] | None) -> None:
    """Retries until success or max_attempts, sleeping the policy's delays; invalid input fails at once."""
    policy = RetryPolicy(max_attempts=4, initial_backoff_s=1.0, max_backoff_s=10.0, multiplier=2.0, jitter=0)
    pending = list(errors)
    made: list[int] = []
    slept: list[float] = []

    async def call(remaining: float | None) -> str:
        made.append(1)
        if pending:
            raise pending.pop(0)
        return "ok"

    async def sleep(s: float) -> None:
        slept.append(s)

    if raised is None:
        assert await run_with_retry(call, policy, sleep=sleep) == "ok"
    else:
        with pytest.raises(raised):
            await run_with_retry(call, policy, sleep=sleep)
    assert len(made) == calls
    assert slept == [1.0, 2.0, 4.0][: calls - 1]


async def test_one_deadline_across_attempts() -> None:
    """Attempts share one deadline: each gets what is left, and no retry starts that cannot finish in time."""
    now = [0.0]
    policy = RetryPolicy(max_attempts=10, initial_backoff_s=1.0, max_backoff_s=1.0, jitter=0)
    budgets: list[float | None] = []

    async def call(remaining: float | None) -> str:
        budgets.append(remaining)
        now[0] += 0.5  # each attempt takes half a second
        raise ServerUnavailable("busy")

    async def sleep(s: float) -> None:
        now[0] += s

    with pytest.raises(ServerUnavailable):
        await run_with_retry(call, policy, timeout_s=4.0, sleep=sleep, clock=lambda: now[0])
    # 0.5 s per attempt + 1 s back-off: attempts start at 0, 1.5 and 3.0; a fourth would start at 4.5 > 4.
    assert budgets == [4.0, 2.5, 1.0]
    assert now[0] == 3.5


def test_restricted_protocol_is_permission_denied_and_not_retried() -> None:
    """Triton answers a missing API key with UNAVAILABLE over gRPC: it maps to PermissionDeniedError, never retried."""
    from tritonclient.utils import InferenceServerException

    from triton_npu_client import PermissionDeniedError
    from triton_npu_client._errors._classify import map_error

    err = map_error(
        InferenceServerException(
            "This protocol is restricted, expecting header 'triton-grpc-protocol-x-api-key'",
            status="StatusCode.UNAVAILABLE",
        )
    )
    assert isinstance(err, PermissionDeniedError)
    assert not is_retriable(err)


# -- the policy's decisions: pure, given an rng ----------------------------------------------------------------------


def test_a_replica_failure_moves_at_once_and_overload_backs_off_in_place() -> None:
    """Where: "other" (no wait, no attempt counted) for an unreachable replica when the transport has another;
    "same" after the policy's delay otherwise, and for "busy" (RESOURCE_EXHAUSTED), which moving would not help."""
    policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.1, jitter=0.5, max_moves=2)
    down = ConnectError("down")
    assert policy.decide(down, waits=0, elsewhere=True) == Retry("other", 0.0)
    assert policy.decide(down, waits=5, moves=1, elsewhere=True) == Retry("other", 0.0)  # moves are not attempts
    same = policy.decide(down, waits=0, moves=2, elsewhere=True, rng=random.Random(7))  # out of moves
    assert same == Retry("same", policy.delay_s(1, random.Random(7)))
    busy = ServerUnavailable("busy", status="RESOURCE_EXHAUSTED")
    assert policy.decide(busy, waits=1, elsewhere=True, rng=random.Random(3)) == Retry(
        "same", policy.delay_s(2, random.Random(3))
    )
    assert policy.decide(down, waits=2) is None  # the third try at one place was the last
    assert policy.decide(InvalidArgumentError("bad"), waits=0, elsewhere=True) is None
    assert policy.decide(down, waits=0, left_s=0.01, rng=random.Random(1)) is None  # could not finish in time


def test_a_patient_policy_retries_what_a_job_may_wait_out_until_its_patience_is_spent() -> None:
    """A job's policy: timeouts and a model gone while its server restarts are transient too, attempts are
    unbounded, and patience (time since the first failure) ends the retries; the default policy retries neither."""
    patient = RetryPolicy.patient(10.0)
    for err in (RequestTimeout("late"), ModelNotReadyError("loading"), ModelNotFoundError("gone"), ConnectError("x")):
        assert patient.retriable(err)
        assert not RetryPolicy().retriable(err) or isinstance(err, ConnectError)
        decision = patient.decide(err, waits=1000, failing_for_s=1.0, rng=random.Random(0))
        assert decision == Retry("same", patient.delay_s(1001, random.Random(0)))
        assert 1.0 <= decision.delay_s <= 2.0  # 0.1 s doubling, capped at 2 s, jitter 0.5
    assert patient.decide(RequestTimeout("late"), waits=3, failing_for_s=10.01, rng=random.Random(0)) is None
    assert patient.decide(InvalidArgumentError("bad"), waits=0) is None


async def test_moving_to_another_replica_is_no_attempt_and_no_wait() -> None:
    """The one loop: two moves (the transport had another replica), then backoff in place up to max_attempts."""
    policy = RetryPolicy(max_attempts=2, initial_backoff_s=1.0, jitter=0)
    others = [True, True, False, False]
    sent: list[int] = []
    slept: list[float] = []

    async def call(remaining: float | None) -> str:
        sent.append(1)
        raise ConnectError("down")

    async def sleep(s: float) -> None:
        slept.append(s)

    with pytest.raises(ConnectError):
        await run_with_retry(call, policy, sleep=sleep, elsewhere=lambda: others.pop(0))
    assert len(sent) == 4  # the first, two moves, one retry in place
    assert slept == [1.0]


# -- through real servers: one loop, never one inside another --------------------------------------------------------


def _dead_url() -> str:
    """A loopback gRPC URL nothing listens on (bound, then closed): every request is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"grpc://127.0.0.1:{s.getsockname()[1]}"


async def test_a_scoring_request_is_retried_by_its_job_alone_and_its_patience_holds(triton_server: LocalTriton) -> None:
    """Scoring's patience is the caller's one loop under the job's policy: the client's own policy (5 attempts
    here) is not applied inside each of the job's retries, and the job still waits out its patience."""
    async with Client(triton_server.grpc_url) as live:
        spec = (await live.model("scale_fp32")).spec
    dead = _dead_url()
    eager = RetryPolicy(max_attempts=5, initial_backoff_s=0.001, jitter=0)
    async with Client(dead, retry=eager) as plain:
        counting = CountingTransport(plain.transport)
        counted = Client(dead, transport=counting, retry=eager)  # type: ignore[arg-type]
        model = Model(counted._caller, spec, {})
        started = time.monotonic()
        with pytest.raises(JobAborted, match="patience_s"):
            async for _ in score_rows(model, [np.ones(4, np.float32)], batch_size=1, concurrency=1, patience_s=0.3):
                pass
        waited = time.monotonic() - started
    assert waited >= 0.3
    # The job's backoff (0.1 s doubling, jitter 0.5) fits at most 3 retries in 0.3 s: 4 sends. Nested under the
    # client's policy, the first of the job's attempts alone would have been sent 5 times.
    assert 2 <= counting.infer_calls <= 4


async def test_the_fleet_sends_once_and_the_callers_loop_moves_the_request(triton_server: LocalTriton) -> None:
    """A replica that passed its check and died since fails the request once; the fleet takes it out and has no
    loop of its own: the caller's policy moves the request to the other replica (no attempt counted), or, allowed
    no move, gives the error back."""
    dead = _dead_url()
    live = triton_server.grpc_url
    fast = FleetOptions(health_interval_s=60.0, probe_backoff_s=0.05, max_probe_backoff_s=0.2, resolve_interval_s=60)
    for policy in (RetryPolicy(max_attempts=1), RetryPolicy(max_attempts=1, max_moves=0)):
        async with Client([live, dead], fleet=fast, coalescing=None, retry=policy) as client:
            scale = await client.model("scale_fp32")  # the first health round: the dead replica is out
            fleet = client.transport
            gone, good = fleet._replicas[dead], fleet._replicas[live]  # type: ignore[attr-defined]
            # Back in, not probed again meanwhile, and the least loaded: the next request goes there first.
            gone.state, gone.models, gone.next_check_at = True, None, time.monotonic() + 600
            good.outstanding += 1000
            try:
                if policy.max_moves:
                    result = await scale.infer(INPUT0=np.array([3.0], np.float32))
                    assert result["OUTPUT0"].tolist() == [[6.0]]
                else:
                    with pytest.raises(ConnectError):
                        await scale.infer(INPUT0=np.array([3.0], np.float32))
            finally:
                good.outstanding -= 1000
            status = {s.url: s for s in await client.replicas()}
        assert status[dead].requests == 1
        assert status[dead].healthy is False
        assert status[live].requests == (1 if policy.max_moves else 0)
