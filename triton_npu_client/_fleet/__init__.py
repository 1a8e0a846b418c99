"""Several Triton replicas behind one client: discovery, health, routing (stateless and pinned sequences)."""

from .._transport import is_replica_failure
from ._discovery import DNS_PREFIX, Endpoint, Place, parse_endpoint, system_resolver
from ._hashing import rendezvous, sequence_key
from ._options import FleetOptions, Resolver
from ._replica import ReplicaStatus
from ._transport import FleetTransport

__all__ = [
    "DNS_PREFIX",
    "Endpoint",
    "FleetOptions",
    "FleetTransport",
    "Place",
    "ReplicaStatus",
    "Resolver",
    "is_replica_failure",
    "parse_endpoint",
    "rendezvous",
    "sequence_key",
    "system_resolver",
]
