"""The history digest a chat turn's last response carries, computed the same way by the server and the client.

A chain over committed turns: ``digest(previous, messages, reply)``, starting from :data:`EMPTY` for a fresh
conversation. Both sides know exactly the same strings (the messages the client sent, the reply text the client
received), so equal digests mean both sides hold the same history; the server drops old messages to fit its
context, but that changes neither side's chain. Like ``_markers``, this module imports the standard library only, so
either side reads it without the other's dependencies.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence

__all__ = ["EMPTY", "digest_role", "history_digest"]

#: The digest of a conversation with no committed turn.
EMPTY = ""


def digest_role(
    role: str,
    *,
    tool_calls: Sequence[tuple[str, str, str]] = (),
    tool_call_id: str | None = None,
    name: str | None = None,
) -> str:
    """What stands for a message's role in the digest: the role alone for a plain message (so a conversation without
    tools digests as it always did), else the role, a NUL (no role holds one) and its tool-use fields as compact
    JSON: ``[[[id, name, arguments], ...], tool_call_id, name]`` (``tool_calls`` as (id, name, arguments) triples,
    the arguments the JSON text exactly as sent or received)."""
    if not tool_calls and tool_call_id is None and name is None:
        return role
    fields = [[list(c) for c in tool_calls], tool_call_id, name]
    return role + "\0" + json.dumps(fields, separators=(",", ":"), ensure_ascii=False)


def history_digest(
    previous: str,
    messages: Iterable[tuple[str, str]],
    reply: str,
    reply_calls: Sequence[tuple[str, str, str]] = (),
) -> str:
    """The digest after a turn that added ``messages`` (role, text pairs; a role with tool-use fields spelled by
    :func:`digest_role`) and was answered with ``reply`` (its content) and ``reply_calls`` (its tool calls, as
    (id, name, arguments) triples)."""
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
    part(digest_role("assistant", tool_calls=reply_calls))
    part(reply)
    return h.hexdigest()[:32]
