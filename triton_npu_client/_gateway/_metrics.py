"""The gateway's own Prometheus metrics, served on its ``/metrics``.

One registry per gateway (not the process-global one), so two gateways in one process (tests, a benchmark) never
mix their counts. Names carry the ``tnc_openai_`` prefix; ``endpoint`` is the route (``/v1/chat/completions``...),
never a path with an id in it, so the label set stays bounded.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["CONTENT_TYPE", "Metrics"]

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TTFT_BUCKETS: Final = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "tnc_openai_requests", "Requests answered, by endpoint and HTTP status", ["endpoint", "status"], registry=r
        )
        self.latency = Histogram(
            "tnc_openai_request_seconds",
            "Time from a request's arrival to its last byte, by endpoint",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "tnc_openai_time_to_first_token_seconds",
            "Time from a request's arrival to its first generated text, by endpoint",
            ["endpoint"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "tnc_openai_tokens",
            "Tokens by endpoint and kind: prompt (the whole input), prefilled (computed this request), completion",
            ["endpoint", "kind"],
            registry=r,
        )
        self.in_flight = Gauge("tnc_openai_turns_in_flight", "Generation requests running now", registry=r)
        self.live_chains = Gauge(
            "tnc_openai_live_chains", "Responses chains whose conversation is open on the server", registry=r
        )
        self.replays = Counter(
            "tnc_openai_replays",
            "Turns whose conversation was rebuilt from stored messages, by why",
            ["why"],
            registry=r,
        )

        self.made_room = Counter(
            "tnc_openai_chains_closed_for_room",
            "Open chains closed because the server refused a new conversation at its cap (their next turn replays)",
            registry=r,
        )

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
