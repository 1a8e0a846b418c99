"""Retries, decided in one place: :class:`RetryPolicy` says what is sent again, where, and after how long.

Every loop that sends a request again asks the policy and nothing else: the caller's loop for stateless requests
(:func:`run_with_retry`: the same replica after a backoff, or another replica at once when the transport has one),
a scoring job (the same loop with a patient policy, :meth:`RetryPolicy.patient`), the Ray scorer between endpoints,
and the fleet's health probes (:func:`backoff_s`). A transport never retries on its own, so nothing nests.
A new rule goes into :meth:`RetryPolicy.decide` (docs/architecture.md, "Retries").
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Literal, TypeVar

import attrs

from .._errors import (
    ConnectError,
    ModelNotFoundError,
    ModelNotReadyError,
    RequestTimeout,
    ServerUnavailable,
    TritonError,
)

__all__ = [
    "NO_RETRY", "Retry", "RetryPolicy", "backoff_s", "is_replica_failure", "is_retriable", "run_with_retry",
]  # fmt: skip

_log = logging.getLogger("triton_npu_client.retry")

T = TypeVar("T")
Where = Literal["same", "other"]


def is_retriable(err: BaseException) -> bool:
    """Whether a stateless request that failed with ``err`` may be sent again.

    Only "the server never took the request" kinds: no connection, UNAVAILABLE / RESOURCE_EXHAUSTED / 503.
    Never an invalid input, a model error, a refusal that will not change (a missing API key, which Triton
    sends as UNAVAILABLE, is mapped to :class:`PermissionDeniedError` first), or a timeout (the server may
    still be running it).
    """
    return isinstance(err, ConnectError | ServerUnavailable)


def is_replica_failure(err: BaseException) -> bool:
    """A failure that says the replica itself is unreachable or refusing all work: take it out, move on.

    The "never taken" kinds of :func:`is_retriable` (so moving a stateless request is as safe as retrying it),
    minus overload (RESOURCE_EXHAUSTED, 429, 503), which says "busy", not "gone".
    """
    if isinstance(err, ConnectError):
        return True
    return isinstance(err, ServerUnavailable) and err.status in (None, "UNAVAILABLE", "502")


def backoff_s(attempt: int, *, initial_s: float, max_s: float, multiplier: float = 2.0) -> float:
    """The exponential backoff before try ``attempt`` (1-based): ``min(max_s, initial_s * multiplier**(n-1))``."""
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    return float(min(max_s, initial_s * multiplier ** min(attempt - 1, 64)))


@attrs.frozen
class Retry:
    """A decision to send a request again: ``where`` ("same": this place again, "other": another replica) after
    ``delay_s`` seconds."""

    where: Where
    delay_s: float


@attrs.frozen(kw_only=True)
class RetryPolicy:
    """How a stateless request is retried. ``max_attempts`` counts the tries at one place, the first included
    (1 = no retry; None = no limit but ``patience_s``).

    The n-th retry at the same place waits ``min(max_backoff_s, initial_backoff_s * multiplier**(n-1))``, scaled
    by a random factor in ``[1 - jitter, 1]`` so that many clients do not retry in step. A failure of the replica
    itself (no connection, UNAVAILABLE) moves the request to another replica at once when the transport has one
    (a fleet), at most ``max_moves`` times; that does not count as an attempt.

    ``patience_s``: retry until this long has passed since the first failure; each attempt then gets the whole
    timeout (a job that waits out a restarting server) instead of one deadline across all. ``repeat_taken``: also
    retry what the server may have taken (a timeout) and a model missing or not ready (a server restarting): for
    requests that are safe to repeat, such as a scoring job's. Sequence steps are never retried.
    """

    max_attempts: int | None = attrs.field(
        default=3, validator=attrs.validators.optional(attrs.validators.ge(1))  # type: ignore[arg-type]
    )
    initial_backoff_s: float = attrs.field(default=0.05, validator=attrs.validators.ge(0))
    max_backoff_s: float = attrs.field(default=2.0, validator=attrs.validators.ge(0))
    multiplier: float = attrs.field(default=2.0, validator=attrs.validators.ge(1))
    jitter: float = attrs.field(default=0.5, validator=[attrs.validators.ge(0), attrs.validators.le(1)])
    max_moves: int = attrs.field(default=16, validator=attrs.validators.ge(0))
    patience_s: float | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.gt(0)))
    repeat_taken: bool = False

    @classmethod
    def patient(cls, patience_s: float) -> RetryPolicy:
        """A job's policy: what may be transient is retried with backoff (0.1 s doubling to 2 s) for
        ``patience_s`` after the first failure, whatever the number of attempts."""
        return cls(max_attempts=None, initial_backoff_s=0.1, max_backoff_s=2.0, patience_s=patience_s,
                   repeat_taken=True)  # fmt: skip

    def retriable(self, err: BaseException) -> bool:
        """Whether ``err`` may be transient under this policy (see :func:`is_retriable` and ``repeat_taken``)."""
        if is_retriable(err):
            return True
        return self.repeat_taken and isinstance(err, RequestTimeout | ModelNotFoundError | ModelNotReadyError)

    def delay_s(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number ``attempt`` (1-based) at the same place. Pure given ``rng``."""
        base = backoff_s(attempt, initial_s=self.initial_backoff_s, max_s=self.max_backoff_s,
                         multiplier=self.multiplier)  # fmt: skip
        u = (rng or random).random()
        return base * (1.0 - self.jitter * u)

    def decide(
        self,
        err: BaseException,
        *,
        waits: int,
        moves: int = 0,
        elsewhere: bool = False,
        failing_for_s: float = 0.0,
        left_s: float | None = None,
        rng: random.Random | None = None,
    ) -> Retry | None:
        """Whether to send again a request that just failed with ``err``, where, and after how long (None: give up).

        ``waits``: the retries at the same place so far; ``moves``: the moves to another replica so far;
        ``elsewhere``: whether the transport has another replica for it; ``failing_for_s``: the time since its
        first failure; ``left_s``: what is left of its deadline (None: no limit). Pure given ``rng``.
        """
        if not self.retriable(err):
            return None
        if elsewhere and moves < self.max_moves and is_replica_failure(err):
            return Retry("other", 0.0)
        if self.max_attempts is not None and waits + 1 >= self.max_attempts:
            return None
        delay = self.delay_s(waits + 1, rng)
        if self.patience_s is not None and failing_for_s > self.patience_s:
            return None  # retried until patience_s has passed since the first failure
        if left_s is not None and delay >= left_s:
            return None  # no retry that could not finish in time
        return Retry("same", delay)


NO_RETRY = RetryPolicy(max_attempts=1, max_moves=0)


async def run_with_retry(
    call: Callable[[float | None], Awaitable[T]],
    policy: RetryPolicy,
    *,
    timeout_s: float | None = None,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    rng: random.Random | None = None,
    clock: Callable[[], float] = time.monotonic,
    failed_first: TritonError | None = None,
    elsewhere: Callable[[], bool] | None = None,
) -> T:
    """Await ``call(budget_s)``; while it fails, do what ``policy.decide`` says. The one retry loop.

    ``timeout_s`` is ONE deadline across every attempt and the waits between them (each attempt gets what is
    left), unless the policy has ``patience_s``: then each attempt gets the whole ``timeout_s``. ``failed_first``:
    the caller already made attempt 1 itself, which failed with this error. ``elsewhere()``: whether the
    transport has another replica for the request now.
    """
    started = clock()
    patient = policy.patience_s is not None
    deadline = None if timeout_s is None or patient else started + timeout_s
    waits = moves = 0
    err: TritonError | None = failed_first
    first_failed_at = started if failed_first is not None else None
    while True:
        if err is not None:
            now = clock()
            if first_failed_at is None:
                first_failed_at = now
            decision = policy.decide(
                err, waits=waits, moves=moves, elsewhere=elsewhere is not None and elsewhere(),
                failing_for_s=now - first_failed_at, left_s=None if deadline is None else deadline - now, rng=rng,
            )  # fmt: skip
            if decision is None:
                raise err
            if decision.where == "other":
                moves += 1
                _log.debug("moving to another replica after %r", err)
            else:
                waits += 1
                _log.debug("retry %d in %.3fs after %r", waits, decision.delay_s, err)
                await sleep(decision.delay_s)
        budget = timeout_s if deadline is None else max(0.0, deadline - clock())
        try:
            return await call(budget)
        except TritonError as failed:
            err = failed
