"""How a fleet client watches its replicas: health-check pace, backoff, DNS re-resolution."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import attrs

from .._transport import backoff_s

__all__ = ["FleetOptions", "Resolver"]

# (host, port) -> the addresses the name stands for now (IPv4 or IPv6 literals). The default asks the system
# resolver (getaddrinfo), which is what a Kubernetes headless Service answers with one record per ready pod.
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]


def _positive(_self: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value > 0:
        raise ValueError(f"FleetOptions.{attribute.name} must be > 0, got {value!r}")


@attrs.frozen(kw_only=True)
class FleetOptions:
    """How a client over several replicas checks them.

    - ``health_interval_s``: a healthy replica is asked "server ready?" and "which models are ready?" this often.
    - ``probe_backoff_s`` / ``max_probe_backoff_s``: a replica that failed is probed again after
      ``probe_backoff_s``, doubling per failed probe up to ``max_probe_backoff_s``, and put back when it answers.
    - ``health_timeout_s``: the limit of one health probe.
    - ``resolve_interval_s``: how often ``dns+`` names are resolved again (pods come and go).
    """

    health_interval_s: float = attrs.field(default=2.0, validator=_positive)
    probe_backoff_s: float = attrs.field(default=0.1, validator=_positive)
    max_probe_backoff_s: float = attrs.field(default=5.0, validator=_positive)
    health_timeout_s: float = attrs.field(default=2.0, validator=_positive)
    resolve_interval_s: float = attrs.field(default=5.0, validator=_positive)

    def backoff_s(self, failures: int) -> float:
        """Seconds before the next probe of a replica that has failed ``failures`` times in a row (>= 1)."""
        # The retry layer's one backoff curve (no jitter: one client's probes do not need spreading).
        return backoff_s(max(failures, 1), initial_s=self.probe_backoff_s, max_s=self.max_probe_backoff_s)
