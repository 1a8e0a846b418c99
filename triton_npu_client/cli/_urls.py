"""``--url`` for every verb that makes a client: one server, several replicas, or a ``dns+`` name.

The flag may be repeated and each value may be a comma-separated list; ``dns+grpc://name:port`` stands for every
address record of ``name`` (a Kubernetes headless Service). The list is checked here, before any server starts or
any connection is made, with the same rules as ``Client`` (one scheme family, no credentials in a URL).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from .._errors import UsageError

__all__ = ["URL_HELP", "add_url_argument", "checked_urls"]

URL_HELP = (
    "server URL grpc://HOST:PORT (or http://...); several replicas: repeat the flag or give a comma-separated "
    "list; dns+grpc://NAME:PORT: every address of NAME is a replica"
)


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
    p.add_argument("--url", action=_AppendUrls, default=None, required=required, metavar="URL", help=help)


def checked_urls(urls: Sequence[str] | None) -> tuple[str, ...] | None:
    """The ``--url`` values as ``Client`` takes them, or None when the flag was not given.

    Raises :class:`UsageError` (one line, no credentials quoted) for an empty piece, a malformed URL, or gRPC and
    HTTP URLs mixed.
    """
    if urls is None:
        return None
    if any(not u for u in urls):
        raise UsageError(f"--url: an empty URL in the list (a stray comma?); expected grpc://HOST:PORT, ... "
                         f"given {len(urls)} pieces, {sum(not u for u in urls)} empty")  # fmt: skip
    from .._client import ClientConfig

    # The Client's own checks, without connecting: a mistake is reported before anything starts.
    return ClientConfig(urls=tuple(urls)).urls
