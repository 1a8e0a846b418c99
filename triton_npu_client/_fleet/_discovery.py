"""Where the replicas are: fixed URLs, and ``dns+`` names whose every A/AAAA record is a replica."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

import attrs

__all__ = ["DNS_PREFIX", "Endpoint", "Place", "parse_endpoint", "system_resolver"]

DNS_PREFIX = "dns+"
_DEFAULT_PORTS = {"grpc": 8001, "grpcs": 443, "http": 8000, "https": 443}


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@attrs.frozen
class Place:
    """One replica's address: the URL a client would use for it alone, and the name its TLS certificate carries."""

    url: str  # scheme://host:port, the replica's key in the fleet
    target: str  # host:port, as the transports take it
    server_name: str | None = None  # for TLS when ``target`` is an address found through DNS


@attrs.frozen
class Endpoint:
    """A configured URL: one fixed replica, or a DNS name standing for all of its records (``dns+grpc://``)."""

    scheme: str
    host: str
    port: int
    dns: bool

    @property
    def url(self) -> str:
        return f"{DNS_PREFIX if self.dns else ''}{self.scheme}://{_host(self.host)}:{self.port}"

    def fixed(self) -> Place:
        return Place(f"{self.scheme}://{_host(self.host)}:{self.port}", f"{_host(self.host)}:{self.port}")

    def places(self, addresses: Sequence[str]) -> list[Place]:
        """The replicas behind this name, given its current records."""
        return [
            Place(f"{self.scheme}://{_host(a)}:{self.port}", f"{_host(a)}:{self.port}", server_name=self.host)
            for a in sorted(set(addresses))
        ]


def parse_endpoint(url: str) -> Endpoint:
    """An already-checked URL (see ``ClientConfig``) as an :class:`Endpoint`."""
    dns = url.startswith(DNS_PREFIX)
    parts = urlsplit(url.removeprefix(DNS_PREFIX))
    assert parts.hostname is not None
    return Endpoint(parts.scheme, parts.hostname, parts.port or _DEFAULT_PORTS[parts.scheme], dns)


async def system_resolver(host: str, port: int) -> Sequence[str]:
    """Every address ``host`` resolves to now, through the system resolver (what a headless Service answers)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})
