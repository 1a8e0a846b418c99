"""Retry policy for stateless requests: bounded exponential backoff with jitter, on transport failures only."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import attrs

from .._errors import ConnectError, ServerUnavailable, TritonError

__all__ = ["NO_RETRY", "RetryPolicy", "is_retriable", "run_with_retry"]

_log = logging.getLogger("triton_npu_client.retry")

T = TypeVar("T")


def is_retriable(err: BaseException) -> bool:
    """Whether a stateless request that failed with ``err`` may be sent again.

    Only "the server never took the request" kinds: no connection, UNAVAILABLE / RESOURCE_EXHAUSTED / 503.
    Never an invalid input, a model error, a refusal that will not change (a missing API key, which Triton
    sends as UNAVAILABLE, is mapped to :class:`PermissionDeniedError` first), or a timeout (the server may
    still be running it).
    """
    return isinstance(err, ConnectError | ServerUnavailable)


@attrs.frozen(kw_only=True)
class RetryPolicy:
    """How a stateless request is retried. ``max_attempts`` counts the first try (1 = no retry).

    The n-th retry waits ``min(max_backoff_s, initial_backoff_s * multiplier**(n-1))``, scaled by a random
    factor in ``[1 - jitter, 1]`` so that many clients do not retry in step.
    Sequence steps are never retried: the sequence layer passes ``retry=False``.
    """

    max_attempts: int = attrs.field(default=3, validator=attrs.validators.ge(1))
    initial_backoff_s: float = attrs.field(default=0.05, validator=attrs.validators.ge(0))
    max_backoff_s: float = attrs.field(default=2.0, validator=attrs.validators.ge(0))
    multiplier: float = attrs.field(default=2.0, validator=attrs.validators.ge(1))
    jitter: float = attrs.field(default=0.5, validator=[attrs.validators.ge(0), attrs.validators.le(1)])

    def delay_s(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number ``attempt`` (1-based). Pure given ``rng``."""
        if attempt < 1:
            raise ValueError(f"attempt must be >= 1, got {attempt}")
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (attempt - 1))
        u = (rng or random).random()
        return base * (1.0 - self.jitter * u)


NO_RETRY = RetryPolicy(max_attempts=1)


async def run_with_retry(
    call: Callable[[float | None], Awaitable[T]],
    policy: RetryPolicy,
    *,
    timeout_s: float | None = None,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    rng: random.Random | None = None,
    clock: Callable[[], float] = time.monotonic,
    failed_first: TritonError | None = None,
) -> T:
    """Await ``call(remaining_s)``; on a retriable :class:`TritonError` try again per ``policy``.

    ``timeout_s`` is ONE deadline across every attempt and the waits between them: each attempt gets what is
    left, and no retry starts that could not finish in time (the last error is raised instead).
    ``failed_first``: the caller already made attempt 1 itself, which failed with this retriable error.
    """
    deadline = None if timeout_s is None else clock() + timeout_s
    attempt = 1
    err: TritonError | None = failed_first
    while True:
        if err is not None:
            if attempt >= policy.max_attempts or not is_retriable(err):
                raise err
            delay = policy.delay_s(attempt, rng)
            if deadline is not None and clock() + delay >= deadline:
                raise err
            _log.debug("retry %d/%d in %.3fs after %r", attempt, policy.max_attempts - 1, delay, err)
            attempt += 1
            await sleep(delay)
        remaining = None if deadline is None else max(0.0, deadline - clock())
        try:
            return await call(remaining)
        except TritonError as failed:
            err = failed
