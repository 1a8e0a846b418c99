"""The history digest a chat turn's last response carries, computed the same way by the server and the client.

A chain over committed turns: ``digest(previous, messages, reply)``, starting from :data:`EMPTY` for a fresh
conversation. Both sides know exactly the same strings (the messages the client sent, the reply text the client
received), so equal digests mean both sides hold the same history; the server drops old messages to fit its
context, but that changes neither side's chain. Like ``_markers``, this module imports the standard library only, so
either side reads it without the other's dependencies.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

__all__ = ["EMPTY", "history_digest"]

#: The digest of a conversation with no committed turn.
EMPTY = ""


def history_digest(previous: str, messages: Iterable[tuple[str, str]], reply: str) -> str:
    """The digest after a turn that added ``messages`` (role, text pairs) and was answered with ``reply``."""
    h = hashlib.sha256()

    def part(text: str) -> None:
        # Length-prefixed, so no two different histories give the same byte stream.
        data = text.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)

    part(previous)
    for role, text in messages:
        part(role)
        part(text)
    part("assistant")
    part(reply)
    return h.hexdigest()[:32]
