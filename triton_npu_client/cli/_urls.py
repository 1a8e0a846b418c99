"""``--url`` for every verb that makes a client: one server, several replicas, or a ``dns+`` name.

The flag may be repeated and each value may be a comma-separated list; ``dns+grpc://name:port`` stands for every
address record of ``name`` (a Kubernetes headless Service). A URL without a scheme (``host:port``) is gRPC, the
protocol every verb can use. Without the flag, ``$TRITON_URLS`` (a comma-separated list), else ``$TRITON_URL``, is
the default, as in every README snippet. The list is checked here, before any server starts or any connection is
made, with the same rules as ``Client`` (one scheme family, no credentials in a URL).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

from .._errors import UsageError

__all__ = ["ENV_URL", "ENV_URLS", "URL_HELP", "add_url_argument", "checked_urls"]

ENV_URLS = "TRITON_URLS"
ENV_URL = "TRITON_URL"

URL_HELP = (
    "server URL grpc://HOST:PORT (HOST:PORT alone is gRPC; or http://...); several replicas: repeat the flag or give "
    "a comma-separated list; dns+grpc://NAME:PORT: every address of NAME is a replica; default: $TRITON_URLS, "
    "else $TRITON_URL"
)


def _from_environment() -> tuple[str, str] | None:
    """(the variable's name, its value) of the first of $TRITON_URLS and $TRITON_URL that is set and not empty."""
    for name in (ENV_URLS, ENV_URL):
        value = os.environ.get(name, "").strip()
        if value:
            return name, value
    return None


class _AppendUrls(argparse.Action):
    """Appends each comma-separated piece; an empty piece is kept, so :func:`checked_urls` can name it."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        urls = list(getattr(namespace, self.dest, None) or [])
        urls.extend(piece.strip() for piece in str(values).split(","))
        setattr(namespace, self.dest, urls)


def add_url_argument(p: argparse.ArgumentParser, *, required: bool = False, help: str = URL_HELP) -> None:
    """``--url``; ``required``: unless $TRITON_URLS or $TRITON_URL gives a default."""
    required = required and _from_environment() is None
    p.add_argument("--url", action=_AppendUrls, default=None, required=required, metavar="URL", help=help)


def checked_urls(urls: Sequence[str] | None) -> tuple[str, ...] | None:
    """The ``--url`` values as ``Client`` takes them (else those of $TRITON_URLS or $TRITON_URL), or None when
    neither gives any.

    Raises :class:`UsageError` (one line, no credentials quoted) for an empty piece, a malformed URL, or gRPC and
    HTTP URLs mixed.
    """
    source = "--url"
    if urls is None:
        found = _from_environment()
        if found is None:
            return None
        source = f"${found[0]}"
        urls = [piece.strip() for piece in found[1].split(",")]
    if any(not u for u in urls):
        raise UsageError(f"{source}: an empty URL in the list (a stray comma?); expected grpc://HOST:PORT, ... "
                         f"given {len(urls)} pieces, {sum(not u for u in urls)} empty")  # fmt: skip
    # host:port alone is gRPC (every verb speaks it); a URL with a scheme is taken as written.
    urls = [u if "://" in u else f"grpc://{u}" for u in urls]
    from .._client import ClientConfig

    # The Client's own checks, without connecting: a mistake is reported before anything starts.
    try:
        return ClientConfig(urls=tuple(urls)).urls
    except UsageError as err:
        if source == "--url":
            raise
        raise UsageError(f"{source}: {err}") from None
