"""One replica of a fleet: its transport, what the health checks found, and what the client measured."""

from __future__ import annotations

import collections
import statistics
import time

import attrs

from .._transport import Transport
from ._discovery import Place

__all__ = ["Replica", "ReplicaStatus"]

_LATENCIES = 1024  # the last this many answered requests make a replica's latency figures


@attrs.frozen(kw_only=True)
class ReplicaStatus:
    """A snapshot of one replica, from ``await client.replicas()``.

    ``healthy`` is None until the first health check has answered. ``models``: the models it reported READY at
    the last check. ``outstanding``: requests (and open streams) in flight to it now; ``requests``/``errors``:
    counted since the client started; latencies are of the last 1,024 answered stateless requests and steps.
    ``pinned``: live sequences this client keeps on it. ``epoch`` grows each time it is taken out: sequences
    pinned in an earlier epoch are lost. ``last_error`` is the latest failure that took it out (no secrets:
    messages never quote headers).
    """

    url: str
    healthy: bool | None
    models: tuple[str, ...]
    outstanding: int
    requests: int
    errors: int
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    pinned: int
    epoch: int
    last_error: str | None
    down_for_s: float | None


class Replica:
    """Mutable state, touched only from the event loop the client lives on (no locks needed)."""

    __slots__ = (
        "check_applied",
        "checks_started",
        "down_since",
        "epoch",
        "errors",
        "failures",
        "last_error",
        "latencies",
        "models",
        "next_check_at",
        "outstanding",
        "place",
        "requests",
        "state",
        "transport",
        "url",
    )  # fmt: skip

    def __init__(self, place: Place, transport: Transport) -> None:
        self.place = place
        self.url = place.url
        self.transport = transport
        self.state: bool | None = None  # None: not checked yet
        self.models: frozenset[str] | None = None
        self.epoch = 0
        self.failures = 0
        # Checks can overlap (the watch and a refresh): only the latest one to start may decide the state.
        self.checks_started = 0
        self.check_applied = 0
        self.next_check_at = 0.0
        self.down_since: float | None = None
        self.last_error: str | None = None
        self.outstanding = 0
        self.requests = 0
        self.errors = 0
        self.latencies: collections.deque[float] = collections.deque(maxlen=_LATENCIES)

    def __repr__(self) -> str:
        return f"<Replica {self.url} healthy={self.state} outstanding={self.outstanding}>"

    def serves(self, model: str) -> bool:
        """Healthy, and the model was READY at the last check."""
        return self.state is True and (self.models is None or model in self.models)

    def status(self, pinned: int) -> ReplicaStatus:
        lat = sorted(self.latencies)
        p50 = statistics.median(lat) if lat else None
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None
        return ReplicaStatus(
            url=self.url,
            healthy=self.state,
            models=tuple(sorted(self.models or ())),
            outstanding=self.outstanding,
            requests=self.requests,
            errors=self.errors,
            latency_p50_ms=p50,
            latency_p99_ms=p99,
            pinned=pinned,
            epoch=self.epoch,
            last_error=self.last_error,
            down_for_s=None if self.down_since is None else time.monotonic() - self.down_since,
        )
