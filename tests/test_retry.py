"""RetryPolicy: the delay is a pure function; only transport failures are retried, a bounded number of times."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from triton_npu_client import (
    ConnectError,
    InvalidArgumentError,
    RequestTimeout,
    RetryPolicy,
    ServerUnavailable,
    TritonError,
)
from triton_npu_client._call._retry import is_retriable, run_with_retry


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
