"""The gateway's response store: the responses and conversations it keeps, so a later request can go on from them.

OpenAI's Responses API keeps a response (``store=true``, the default) so that a later request can continue it
(``previous_response_id``), fetch it, delete it or list its input items; a Conversation holds its items (listed,
added to and deleted one by one) and its head moves with each response added to it. The gateway keeps, per
response, the whole conversation after it as plain messages (what a fresh chat would replay) and an opaque
``chat_state`` (how to resume the live conversation on the server), so a chain survives a gateway restart, and
deleting one response of a chain never breaks the responses after it.

::

    store = SQLiteStore(default_store_path())          # or MemoryStore() (tests, --store memory)
    await store.put_response(StoredResponse(id="resp_1", owner=owner, ...))
    previous = await store.get_response("resp_1", owner=owner)   # None: missing, or another key's
    if not await store.advance_conversation("conv_1", owner=owner, expected_head="resp_1", new_head="resp_2"):
        ...                                              # the head moved meanwhile: answer 409
    await store.aclose()

- **The interface** is :class:`ResponseStore` (a Protocol); :class:`SQLiteStore` and :class:`MemoryStore` have the
  same semantics. A record goes in and comes back through the same JSON encoding in both, so what ``MemoryStore``
  gives back is what ``SQLiteStore`` would (tuples inside ``body`` come back as lists, for instance), and a value
  that is not JSON-able is refused (:class:`RecordError`) by both before anything is stored.
- **Owners.** Every record has an ``owner`` (a hash of the API key; ``""`` when the gateway has no keys). A record
  of another owner is indistinguishable from a missing one: ``get_*`` returns None, ``delete_*`` does nothing, and
  ``advance_conversation`` returns False, so the gateway answers 404 for both. Ids are unique across owners: a
  second ``put_*`` of an id raises :class:`DuplicateIdError` whoever owns the first.
- **Heads.** ``advance_conversation`` is a compare-and-set (one ``UPDATE ... WHERE head IS ?``, or, when it appends
  the turn's items, a read and a write under SQLite's write lock): atomic even between two gateway processes sharing
  one file. False means the head moved (or the conversation is gone).
- **Items.** A conversation's ``items`` are all of it, in order: those it was created with, those added through the
  items API, and each response's input and output; ``messages`` are the same as records, one per item.
- **Records.** A message is kept as ``(role, text)``, or ``(role, text, fields)`` when it has tool fields
  (``{"tool_calls": [{"id", "name", "arguments"}], "tool_call_id", "name"}``: an assistant's calls, a tool's result;
  a ``function_call`` item is an assistant record with one call and no text).
  Adding or deleting items (``add_conversation_items``, ``delete_conversation_item``) clears the head in the same
  write: the server's conversation of the head no longer matches the items, so the next turn replays the items
  instead of continuing it.
- **No caps.** The store keeps what it is given; the gateway caps inputs before storing.
- **SQLite** (standard library only): one worker thread owns the one connection and runs every call in turn, so
  the event loop never waits on the disk and calls never interleave; WAL journal mode (readers never wait for a
  writer, and a second process may share the file), ``synchronous=NORMAL`` (a crash of the process loses nothing
  committed; a power cut may lose the last commits, never corrupt the file) and a busy timeout for the moments when
  another process writes. A table records the schema version; a newer one is refused (:class:`StoreError`), an
  older one is migrated when the file is opened (version 1 kept a conversation's first items only: version 2 fills
  them in from the head response's history; version 3 adds the records with tool fields and the function_call and
  function_call_output items, which a gateway of version 2 would not read: its records are version 3's as they are).
- **Files it did not make are left alone.** An existing non-empty file must start with SQLite's header, and an SQLite
  database must hold no tables or this store's own: anything else is a :class:`StoreError` naming the path, and
  the file is left byte for byte as it was. A new file is made readable by its owner only (it holds conversations).
- **Cancelling** a call stops the wait, not the work: a put already handed to the worker thread still lands.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import secrets
import sqlite3
import stat
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Protocol, Self, TypeVar

import attrs

from .._errors import ClientClosedError, TritonError, UsageError

__all__ = [
    "RESPONSE_STATUSES",
    "SCHEMA_VERSION",
    "DuplicateIdError",
    "MemoryStore",
    "RecordError",
    "ResponseStore",
    "SQLiteStore",
    "StoreError",
    "StoredConversation",
    "StoredResponse",
    "MessageRecord",
    "default_store_path",
    "message_item",
]

# The schema this code writes; a file of a later one is refused (an older gateway must not half-understand it), an
# earlier one migrated (see _migrate). 2: a conversation's items are all of its items, not only its first ones. 3:
# records may carry tool fields, and items may be function calls and their outputs.
SCHEMA_VERSION: Final = 3
RESPONSE_STATUSES: Final = frozenset({"completed", "incomplete", "failed", "cancelled"})

_SQLITE_HEADER: Final = b"SQLite format 3\x00"
# A named table of its own: a bare "schema_version" is common enough in other programs' databases to be mistaken.
_VERSION_TABLE: Final = "triton_npu_store_schema"
# Long enough to outwait another process's commit (milliseconds), short enough that a stuck lock is reported.
_BUSY_TIMEOUT_MS: Final = 10_000

_T = TypeVar("_T")


# --- errors -------------------------------------------------------------------------------------------------------


class StoreError(TritonError):
    """The response store cannot be used: its file is not an SQLite database of this store, has a newer schema,
    cannot be created or read, or a database call failed. ``path`` names the file."""

    def __init__(self, message: str, *, path: str | os.PathLike[str] | None = None) -> None:
        super().__init__(message)
        self.path = None if path is None else Path(path)


class RecordError(UsageError, ValueError):
    """A record given to the store cannot be kept: a field is not JSON-able (or holds NaN or an infinity)."""


class DuplicateIdError(RecordError):
    """A record with this id is already stored (ids are unique, whoever owns them). ``record_id`` names it."""

    def __init__(self, message: str, *, record_id: str) -> None:
        super().__init__(message)
        self.record_id = record_id


# --- the records --------------------------------------------------------------------------------------------------


#: A message as the store keeps it: ``(role, text)``, or ``(role, text, tool fields)`` (a JSON object).
MessageRecord = tuple[str, str] | tuple[str, str, dict[str, Any]]


def _messages(value: Iterable[Sequence[Any]]) -> tuple[MessageRecord, ...]:
    out: list[MessageRecord] = []
    for message in value:
        if (
            len(message) not in (2, 3)
            or not all(isinstance(part, str) for part in message[:2])
            or (len(message) == 3 and not isinstance(message[2], dict))
        ):
            raise TypeError(
                f"a message is a (role, text) pair of str, or (role, text, tool fields) with an object of them, not "
                f"{message!r}"
            )
        out.append((message[0], message[1]) if len(message) == 2 else (message[0], message[1], dict(message[2])))
    return tuple(out)


def _items(value: Iterable[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    return tuple(value)


def _metadata(value: Mapping[str, str]) -> dict[str, str]:
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise TypeError("conversation metadata maps str to str")
    return dict(value)


@attrs.frozen(kw_only=True)
class StoredResponse:
    """One stored response, as the gateway needs it to answer ``GET /v1/responses/{id}`` and to continue from it.

    ``body`` is the OpenAI Response object as returned to the client; ``input_items`` this response's own input
    items as the API lists them; ``messages`` the whole conversation after this response as records, what a
    fresh chat would replay; ``chat_state`` an opaque JSON-able dict for resuming the live conversation on the
    server (None: replay ``messages``). The conversation's text stays out of ``repr`` (and so out of logs).
    """

    id: str
    owner: str
    created_at: int
    model: str
    status: str = attrs.field(validator=attrs.validators.in_(RESPONSE_STATUSES))
    body: dict[str, Any] = attrs.field(repr=False)
    input_items: tuple[dict[str, Any], ...] = attrs.field(converter=_items, repr=False)
    messages: tuple[MessageRecord, ...] = attrs.field(converter=_messages, repr=False)
    previous_response_id: str | None = None
    conversation_id: str | None = None
    chat_state: dict[str, Any] | None = attrs.field(default=None, repr=False)


@attrs.frozen(kw_only=True)
class StoredConversation:
    """One stored conversation: its items, and ``head``, the response whose conversation on the server it continues.

    ``items`` are all its items as the API lists them (each with an ``id``), in order, and ``messages`` the same as
    records, one per item. ``head`` is the latest response added to it, whose history equals the items;
    None when there is none yet, or once items were added or deleted through the items API (the next turn then
    replays ``messages``).
    """

    id: str
    owner: str
    created_at: int
    metadata: dict[str, str] = attrs.field(converter=_metadata)
    items: tuple[dict[str, Any], ...] = attrs.field(converter=_items, repr=False)
    messages: tuple[MessageRecord, ...] = attrs.field(converter=_messages, repr=False)
    head: str | None = None


class ResponseStore(Protocol):
    """Where the gateway keeps responses and conversations. See the module docstring for the shared semantics."""

    async def put_response(self, response: StoredResponse, /) -> None:
        """Insert a response; :class:`DuplicateIdError` when its id is stored already."""
        ...

    async def get_response(self, id: str, /, *, owner: str) -> StoredResponse | None:
        """The response, or None when it is missing or another owner's."""
        ...

    async def delete_response(self, id: str, /, *, owner: str) -> StoredResponse | None:
        """Delete the response and return it; None (nothing deleted) when it is missing or another owner's."""
        ...

    async def forget_chat_state(self, id: str, /) -> bool:
        """Set the response's ``chat_state`` to None (its live chat was closed, so resuming it would fail; the next
        turn replays ``messages``); False when there is no such response. The gateway's own bookkeeping, not a
        client's request: no owner."""
        ...

    async def put_conversation(self, conversation: StoredConversation, /) -> None:
        """Insert a conversation; :class:`DuplicateIdError` when its id is stored already."""
        ...

    async def get_conversation(self, id: str, /, *, owner: str) -> StoredConversation | None:
        """The conversation, or None when it is missing or another owner's."""
        ...

    async def delete_conversation(self, id: str, /, *, owner: str) -> bool:
        """Delete the conversation (its responses stay); False when it is missing or another owner's."""
        ...

    async def advance_conversation(
        self,
        id: str,
        /,
        *,
        owner: str,
        expected_head: str | None,
        new_head: str | None,
        items: Sequence[dict[str, Any]] = (),
        messages: Sequence[Sequence[Any]] = (),
    ) -> bool:
        """Set the head to ``new_head`` if it is still ``expected_head``, appending ``items`` and ``messages`` (a
        turn's) in the same write; False, changing nothing, when it moved, or the conversation is missing or another
        owner's."""
        ...

    async def add_conversation_items(
        self, id: str, /, *, owner: str, items: Sequence[dict[str, Any]], messages: Sequence[Sequence[Any]]
    ) -> StoredConversation | None:
        """Append items (and their messages, one each) and clear the head; the conversation as it is now, or None
        when it is missing or another owner's."""
        ...

    async def delete_conversation_item(self, id: str, item_id: str, /, *, owner: str) -> StoredConversation | None:
        """Delete one item (and its message) and clear the head; the conversation as it is now, or None (nothing
        changed) when it is missing, another owner's, or holds no such item."""
        ...

    async def update_conversation(
        self, id: str, /, *, owner: str, metadata: Mapping[str, str]
    ) -> StoredConversation | None:
        """Replace the conversation's metadata; the conversation as it is now, or None when it is missing or another
        owner's."""
        ...

    async def aclose(self) -> None:
        """Release the store; calls after it raise :class:`ClientClosedError`. Closing twice is harmless."""
        ...


# --- the one encoding of both stores ------------------------------------------------------------------------------

_RESPONSE_COLUMNS: Final = (
    "id, owner, created_at, model, status, body, input_items, messages, previous_response_id, conversation_id, "
    "chat_state"
)
_CONVERSATION_COLUMNS: Final = "id, owner, created_at, metadata, items, messages, head"


def _dumps(value: object, *, field: str, record_id: str) -> str:
    try:
        # ASCII escapes: a lone surrogate (valid in a JSON string a client sent) cannot be encoded as UTF-8 for
        # SQLite, but its \uXXXX escape can. Compact separators; NaN is not JSON, so another reader could not parse it.
        return json.dumps(value, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise RecordError(f"{field} of {record_id!r} cannot be stored as JSON: {e}") from None


def _response_row(r: StoredResponse) -> tuple[Any, ...]:
    def dump(value: object, field: str) -> str:
        return _dumps(value, field=field, record_id=r.id)

    return (
        r.id, r.owner, r.created_at, r.model, r.status, dump(r.body, "body"), dump(r.input_items, "input_items"),
        dump(r.messages, "messages"), r.previous_response_id, r.conversation_id,
        None if r.chat_state is None else dump(r.chat_state, "chat_state"),
    )  # fmt: skip


def _conversation_row(c: StoredConversation) -> tuple[Any, ...]:
    def dump(value: object, field: str) -> str:
        return _dumps(value, field=field, record_id=c.id)

    return (
        c.id, c.owner, c.created_at, dump(c.metadata, "metadata"), dump(c.items, "items"),
        dump(c.messages, "messages"), c.head,
    )  # fmt: skip


def _response_from_row(row: Sequence[Any]) -> StoredResponse:
    (id_, owner, created_at, model, status, body, input_items, messages, previous, conversation, chat_state) = row
    return StoredResponse(
        id=id_, owner=owner, created_at=created_at, model=model, status=status, body=json.loads(body),
        input_items=json.loads(input_items), messages=json.loads(messages), previous_response_id=previous,
        conversation_id=conversation, chat_state=None if chat_state is None else json.loads(chat_state),
    )  # fmt: skip


def _conversation_from_row(row: Sequence[Any]) -> StoredConversation:
    id_, owner, created_at, metadata, items, messages, head = row
    return StoredConversation(
        id=id_, owner=owner, created_at=created_at, metadata=json.loads(metadata), items=json.loads(items),
        messages=json.loads(messages), head=head,
    )  # fmt: skip


def _duplicate(kind: str, record_id: str) -> DuplicateIdError:
    return DuplicateIdError(f"a {kind} with id {record_id!r} is stored already: ids are unique", record_id=record_id)


def _check_items(id: str, items: Sequence[dict[str, Any]], messages: Sequence[Sequence[Any]]) -> None:
    """Refuse, before anything changes, items that cannot be stored or that do not pair with their messages."""
    if len(items) != len(messages):
        raise RecordError(f"conversation {id!r}: {len(items)} items and {len(messages)} messages: one message per item")
    _dumps(list(items), field="items", record_id=id)
    _messages(messages)


def _with_items(
    c: StoredConversation, items: Sequence[dict[str, Any]], messages: Sequence[Sequence[Any]], head: str | None
) -> StoredConversation:
    return attrs.evolve(c, items=(*c.items, *items), messages=(*c.messages, *_messages(messages)), head=head)


def _without_item(c: StoredConversation, item_id: str) -> StoredConversation | None:
    """``c`` less the item ``item_id`` and its message, its head cleared; None when it has no such item."""
    index = next((i for i, item in enumerate(c.items) if item.get("id") == item_id), None)
    if index is None:
        return None
    # Items and messages pair one to one (every write keeps them so): the item's message is at the same index.
    return attrs.evolve(
        c,
        items=c.items[:index] + c.items[index + 1 :],
        messages=c.messages[:index] + c.messages[index + 1 :],
        head=None,
    )


# --- in memory ------------------------------------------------------------------------------------------------------


class MemoryStore:
    """A :class:`ResponseStore` in a dict: the same semantics as :class:`SQLiteStore`, kept until the process ends
    (tests, ``--store memory``). Records are kept encoded, as SQLite keeps them, so a caller that mutates a dict it
    stored (or got back) changes nothing stored."""

    def __init__(self) -> None:
        self._responses: dict[str, tuple[Any, ...]] = {}
        self._conversations: dict[str, tuple[Any, ...]] = {}
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosedError("the in-memory response store is closed")

    async def put_response(self, response: StoredResponse, /) -> None:
        self._check_open()
        row = _response_row(response)  # refuses what SQLite could not store, before any change
        if response.id in self._responses:
            raise _duplicate("response", response.id)
        self._responses[response.id] = row

    async def get_response(self, id: str, /, *, owner: str) -> StoredResponse | None:
        self._check_open()
        row = self._responses.get(id)
        return None if row is None or row[1] != owner else _response_from_row(row)

    async def delete_response(self, id: str, /, *, owner: str) -> StoredResponse | None:
        self._check_open()
        row = self._responses.get(id)
        if row is None or row[1] != owner:
            return None
        del self._responses[id]
        return _response_from_row(row)

    async def forget_chat_state(self, id: str, /) -> bool:
        self._check_open()
        row = self._responses.get(id)
        if row is None:
            return False
        self._responses[id] = (*row[:10], None)
        return True

    async def put_conversation(self, conversation: StoredConversation, /) -> None:
        self._check_open()
        row = _conversation_row(conversation)
        if conversation.id in self._conversations:
            raise _duplicate("conversation", conversation.id)
        self._conversations[conversation.id] = row

    async def get_conversation(self, id: str, /, *, owner: str) -> StoredConversation | None:
        self._check_open()
        row = self._conversations.get(id)
        return None if row is None or row[1] != owner else _conversation_from_row(row)

    async def delete_conversation(self, id: str, /, *, owner: str) -> bool:
        self._check_open()
        row = self._conversations.get(id)
        if row is None or row[1] != owner:
            return False
        del self._conversations[id]
        return True

    async def advance_conversation(
        self,
        id: str,
        /,
        *,
        owner: str,
        expected_head: str | None,
        new_head: str | None,
        items: Sequence[dict[str, Any]] = (),
        messages: Sequence[Sequence[Any]] = (),
    ) -> bool:
        self._check_open()
        _check_items(id, items, messages)
        # No await between the read and the write: on one event loop this is as atomic as SQLite's UPDATE.
        row = self._conversations.get(id)
        if row is None or row[1] != owner or row[6] != expected_head:
            return False
        self._conversations[id] = _conversation_row(_with_items(_conversation_from_row(row), items, messages, new_head))
        return True

    def _change(
        self, id: str, owner: str, change: Callable[[StoredConversation], StoredConversation | None]
    ) -> StoredConversation | None:
        self._check_open()
        row = self._conversations.get(id)
        if row is None or row[1] != owner:
            return None
        changed = change(_conversation_from_row(row))
        if changed is None:
            return None
        encoded = _conversation_row(changed)
        self._conversations[id] = encoded
        return _conversation_from_row(encoded)

    async def add_conversation_items(
        self, id: str, /, *, owner: str, items: Sequence[dict[str, Any]], messages: Sequence[Sequence[Any]]
    ) -> StoredConversation | None:
        _check_items(id, items, messages)
        return self._change(id, owner, lambda c: _with_items(c, items, messages, None))

    async def delete_conversation_item(self, id: str, item_id: str, /, *, owner: str) -> StoredConversation | None:
        return self._change(id, owner, lambda c: _without_item(c, item_id))

    async def update_conversation(
        self, id: str, /, *, owner: str, metadata: Mapping[str, str]
    ) -> StoredConversation | None:
        _metadata(metadata)  # a TypeError before any change, as SQLiteStore's
        return self._change(id, owner, lambda c: attrs.evolve(c, metadata=metadata))

    async def aclose(self) -> None:
        self._closed = True

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


# --- SQLite ---------------------------------------------------------------------------------------------------------


def default_store_path() -> Path:
    """Where the gateway keeps its responses by default: the user's data folder.

    ``$XDG_DATA_HOME/triton-npu/responses.sqlite3`` (``~/.local/share/...`` when it is unset, or relative, which
    the XDG spec says to ignore); on macOS ``~/Library/Application Support/triton-npu/...``; on Windows
    ``%LOCALAPPDATA%\\triton-npu\\...``.
    """
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Application Support"
    elif sys.platform == "win32":
        local = os.environ.get("LOCALAPPDATA")
        base = Path(local) if local else Path.home() / "AppData" / "Local"
    else:
        xdg = os.environ.get("XDG_DATA_HOME")
        base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".local" / "share"
    return base / "triton-npu" / "responses.sqlite3"


_SCHEMA: Final = (
    """CREATE TABLE IF NOT EXISTS responses (
        id TEXT PRIMARY KEY NOT NULL,
        owner TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        model TEXT NOT NULL,
        status TEXT NOT NULL,
        body TEXT NOT NULL,
        input_items TEXT NOT NULL,
        messages TEXT NOT NULL,
        previous_response_id TEXT,
        conversation_id TEXT,
        chat_state TEXT
    )""",
    """CREATE TABLE IF NOT EXISTS conversations (
        id TEXT PRIMARY KEY NOT NULL,
        owner TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        metadata TEXT NOT NULL,
        items TEXT NOT NULL,
        messages TEXT NOT NULL,
        head TEXT
    )""",
)


class SQLiteStore:
    """A :class:`ResponseStore` in an SQLite file (see the module docstring); two processes may share the file.

    The constructor opens the file at once, so a path that cannot serve fails at startup, before the gateway
    listens; it waits on the disk, so from a running event loop use ``await SQLiteStore.open(path)``.
    Raises :class:`StoreError` (naming the path) for a file that is not this store's or has a newer schema.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        # Absolute: ":memory:" or "file:..." would otherwise mean something else to sqlite3.connect.
        self.path = Path(path).absolute()
        self._closed = False
        self._conn: sqlite3.Connection | None = None  # made, used and closed in the worker thread only
        # One thread, one connection: calls run one at a time in the order they were made, off the event loop.
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="triton-npu-store")
        try:
            self._worker.submit(self._open).result()
        except BaseException:
            self._closed = True
            self._worker.shutdown(wait=True)
            raise

    @classmethod
    async def open(cls, path: str | os.PathLike[str]) -> Self:
        """Open the store without blocking the event loop."""
        return await asyncio.to_thread(cls, path)

    def __repr__(self) -> str:
        return f"SQLiteStore({str(self.path)!r}{', closed' if self._closed else ''})"

    # -- opening -----------------------------------------------------------------------------------------------

    def _open(self) -> None:
        _prepare_file(self.path)
        try:
            conn = sqlite3.connect(self.path, isolation_level=None)  # autocommit: transactions are explicit
        except sqlite3.Error as e:
            raise StoreError(f"cannot open the response store {self.path}: {e}", path=self.path) from e
        try:
            conn.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
            # Read-only checks before anything writes (even the journal mode is written in the file's header).
            self._refuse_foreign(conn)
            # WAL where the file system allows it; otherwise SQLite keeps its rollback journal, slower for
            # concurrent readers but as correct, so the store still opens.
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            with _immediate(conn):
                self._refuse_foreign(conn)  # again, under the write lock: another program may have written meanwhile
                conn.execute(f"CREATE TABLE IF NOT EXISTS {_VERSION_TABLE} (version INTEGER NOT NULL)")
                (found,) = conn.execute(f"SELECT max(version) FROM {_VERSION_TABLE}").fetchone()
                if found is None:
                    conn.execute(f"INSERT INTO {_VERSION_TABLE} (version) VALUES (?)", (SCHEMA_VERSION,))
                elif not isinstance(found, int) or found > SCHEMA_VERSION:
                    raise StoreError(
                        f"the response store {self.path} has schema version {found!r}, newer than version "
                        f"{SCHEMA_VERSION}, the newest this triton-npu-client knows: upgrade triton-npu-client, or "
                        "give another store path",
                        path=self.path,
                    )
                for statement in _SCHEMA:
                    conn.execute(statement)
                if isinstance(found, int) and found < SCHEMA_VERSION:
                    # In the same transaction as the version's change: a migration is all done, or not at all.
                    _migrate(conn, found)
                    conn.execute(f"UPDATE {_VERSION_TABLE} SET version = ?", (SCHEMA_VERSION,))
        except BaseException as e:
            conn.close()
            if isinstance(e, sqlite3.Error):
                raise StoreError(f"cannot open the response store {self.path}: {e}", path=self.path) from e
            raise
        self._conn = conn

    def _refuse_foreign(self, conn: sqlite3.Connection) -> None:
        names = sorted(name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'"))
        if names and _VERSION_TABLE not in names:
            shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
            raise StoreError(
                f"{self.path} is an SQLite database of something else (tables {shown}): the response store never "
                "writes into a database it did not make; give another store path",
                path=self.path,
            )

    # -- running calls in the worker -------------------------------------------------------------------------------

    async def _run(self, call: Callable[[sqlite3.Connection], _T]) -> _T:
        if self._closed:
            raise ClientClosedError(f"the response store {self.path} is closed")
        return await asyncio.get_running_loop().run_in_executor(self._worker, self._in_worker, call)

    def _in_worker(self, call: Callable[[sqlite3.Connection], _T]) -> _T:
        conn = self._conn
        if conn is None:
            raise ClientClosedError(f"the response store {self.path} is closed")
        try:
            return call(conn)
        except RecordError:
            raise
        except sqlite3.Error as e:
            raise StoreError(f"the response store {self.path} failed: {e}", path=self.path) from e
        except (ValueError, TypeError) as e:  # a row this code did not write: bad JSON, a wrong type, a bad status
            raise StoreError(
                f"the response store {self.path} holds a record it cannot read: {e}", path=self.path
            ) from e

    # -- the interface ---------------------------------------------------------------------------------------------

    async def put_response(self, response: StoredResponse, /) -> None:
        row = _response_row(response)  # in the caller: a RecordError is the caller's, not the database's

        def put(conn: sqlite3.Connection) -> None:
            try:
                conn.execute(f"INSERT INTO responses ({_RESPONSE_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?)", row)
            except sqlite3.IntegrityError:
                raise _duplicate("response", response.id) from None

        await self._run(put)

    async def get_response(self, id: str, /, *, owner: str) -> StoredResponse | None:
        def get(conn: sqlite3.Connection) -> StoredResponse | None:
            row = conn.execute(
                f"SELECT {_RESPONSE_COLUMNS} FROM responses WHERE id = ? AND owner = ?", (id, owner)
            ).fetchone()
            return None if row is None else _response_from_row(row)

        return await self._run(get)

    async def delete_response(self, id: str, /, *, owner: str) -> StoredResponse | None:
        def delete(conn: sqlite3.Connection) -> StoredResponse | None:
            # Read and delete under one write lock: of two processes deleting at once, one gets the record.
            with _immediate(conn):
                row = conn.execute(
                    f"SELECT {_RESPONSE_COLUMNS} FROM responses WHERE id = ? AND owner = ?", (id, owner)
                ).fetchone()
                if row is None:
                    return None
                conn.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (id, owner))
            return _response_from_row(row)

        return await self._run(delete)

    async def forget_chat_state(self, id: str, /) -> bool:
        def clear(conn: sqlite3.Connection) -> bool:
            return conn.execute("UPDATE responses SET chat_state = NULL WHERE id = ?", (id,)).rowcount == 1

        return await self._run(clear)

    async def put_conversation(self, conversation: StoredConversation, /) -> None:
        row = _conversation_row(conversation)

        def put(conn: sqlite3.Connection) -> None:
            try:
                conn.execute(f"INSERT INTO conversations ({_CONVERSATION_COLUMNS}) VALUES (?,?,?,?,?,?,?)", row)
            except sqlite3.IntegrityError:
                raise _duplicate("conversation", conversation.id) from None

        await self._run(put)

    async def get_conversation(self, id: str, /, *, owner: str) -> StoredConversation | None:
        def get(conn: sqlite3.Connection) -> StoredConversation | None:
            row = conn.execute(
                f"SELECT {_CONVERSATION_COLUMNS} FROM conversations WHERE id = ? AND owner = ?", (id, owner)
            ).fetchone()
            return None if row is None else _conversation_from_row(row)

        return await self._run(get)

    async def delete_conversation(self, id: str, /, *, owner: str) -> bool:
        def delete(conn: sqlite3.Connection) -> bool:
            return conn.execute("DELETE FROM conversations WHERE id = ? AND owner = ?", (id, owner)).rowcount == 1

        return await self._run(delete)

    async def advance_conversation(
        self,
        id: str,
        /,
        *,
        owner: str,
        expected_head: str | None,
        new_head: str | None,
        items: Sequence[dict[str, Any]] = (),
        messages: Sequence[Sequence[Any]] = (),
    ) -> bool:
        _check_items(id, items, messages)  # in the caller: a RecordError is the caller's, not the database's

        def advance(conn: sqlite3.Connection) -> bool:
            if not items:
                # One statement, so the compare and the set are one atomic step, also against another process.
                # IS, not =: "head = NULL" is never true, and a new conversation's head is NULL.
                cursor = conn.execute(
                    "UPDATE conversations SET head = ? WHERE id = ? AND owner = ? AND head IS ?",
                    (new_head, id, owner, expected_head),
                )
                return cursor.rowcount == 1
            # The items are appended to what is stored: read and written under one write lock, so another process
            # can neither move the head nor add items in between.
            with _immediate(conn):
                found = self._conversation(conn, id, owner)
                if found is None or found.head != expected_head:
                    return False
                self._write_conversation(conn, _with_items(found, items, messages, new_head))
            return True

        return await self._run(advance)

    @staticmethod
    def _conversation(conn: sqlite3.Connection, id: str, owner: str) -> StoredConversation | None:
        row = conn.execute(
            f"SELECT {_CONVERSATION_COLUMNS} FROM conversations WHERE id = ? AND owner = ?", (id, owner)
        ).fetchone()
        return None if row is None else _conversation_from_row(row)

    @staticmethod
    def _write_conversation(conn: sqlite3.Connection, c: StoredConversation) -> None:
        _, _, _, metadata, items, messages, head = _conversation_row(c)
        conn.execute(
            "UPDATE conversations SET metadata = ?, items = ?, messages = ?, head = ? WHERE id = ? AND owner = ?",
            (metadata, items, messages, head, c.id, c.owner),
        )

    async def _change(
        self, id: str, owner: str, change: Callable[[StoredConversation], StoredConversation | None]
    ) -> StoredConversation | None:
        def run(conn: sqlite3.Connection) -> StoredConversation | None:
            # Read, change and write under one write lock: of two processes changing one conversation, each sees the
            # other's change.
            with _immediate(conn):
                found = self._conversation(conn, id, owner)
                changed = None if found is None else change(found)
                if changed is not None:
                    self._write_conversation(conn, changed)
            return changed

        return await self._run(run)

    async def add_conversation_items(
        self, id: str, /, *, owner: str, items: Sequence[dict[str, Any]], messages: Sequence[Sequence[Any]]
    ) -> StoredConversation | None:
        _check_items(id, items, messages)
        return await self._change(id, owner, lambda c: _with_items(c, items, messages, None))

    async def delete_conversation_item(self, id: str, item_id: str, /, *, owner: str) -> StoredConversation | None:
        return await self._change(id, owner, lambda c: _without_item(c, item_id))

    async def update_conversation(
        self, id: str, /, *, owner: str, metadata: Mapping[str, str]
    ) -> StoredConversation | None:
        _dumps(_metadata(metadata), field="metadata", record_id=id)  # in the caller, before any change
        return await self._change(id, owner, lambda c: attrs.evolve(c, metadata=metadata))

    async def aclose(self) -> None:
        """Close the connection once the calls already made have run; closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        try:
            await asyncio.get_running_loop().run_in_executor(self._worker, self._close_connection)
        finally:
            self._worker.shutdown(wait=False)  # the worker is idle now (or finishes the close, if we were cancelled)

    def _close_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


def _migrate(conn: sqlite3.Connection, version: int) -> None:
    """Bring a store of schema ``version`` to :data:`SCHEMA_VERSION`, inside the caller's write transaction.

    1 -> 2: version 1 kept a conversation's first items only (its history was its head response's). A conversation
    with a head gets the head's history as its items, one message item each, so that listing, adding and deleting
    items start from the whole conversation. A conversation whose head response is gone keeps what it had (its next
    turn is refused as before: its history went with that response).

    2 -> 3: nothing to rewrite (version 2's records are pairs, which version 3 reads as they are): the version moves
    so that a gateway of version 2 refuses a file that may hold records and items it cannot read.
    """
    if version < 2:
        rows = conn.execute("SELECT id, owner, head FROM conversations WHERE head IS NOT NULL").fetchall()
        for conversation_id, owner, head in rows:
            found = conn.execute("SELECT messages FROM responses WHERE id = ? AND owner = ?", (head, owner)).fetchone()
            if found is None:
                continue
            pairs = _messages(json.loads(found[0]))
            items = [message_item(_new_item_id(), rec[0], rec[1]) for rec in pairs]
            conn.execute(
                "UPDATE conversations SET items = ?, messages = ? WHERE id = ?",
                (
                    _dumps(items, field="items", record_id=conversation_id),
                    _dumps(pairs, field="messages", record_id=conversation_id),
                    conversation_id,
                ),
            )


def _new_item_id() -> str:
    return f"msg_{secrets.token_hex(24)}"


def message_item(item_id: str, role: str, text: str) -> dict[str, Any]:
    """A conversation's message item as the API lists it: an assistant's text is an ``output_text`` part, written as
    the gateway writes its output (empty annotations and logprobs), anyone else's an ``input_text`` part."""
    part: dict[str, Any] = (
        {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        if role == "assistant"
        else {"type": "input_text", "text": text}
    )
    return {"id": item_id, "type": "message", "role": role, "status": "completed", "content": [part]}


@contextlib.contextmanager
def _immediate(conn: sqlite3.Connection) -> Iterator[None]:
    """A transaction that takes the write lock at once, so what it reads stays true until it commits."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        if conn.in_transaction:  # some errors (a full disk) end the transaction themselves
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def _prepare_file(path: Path) -> None:
    """Make the folders and a private empty file for a new store; check that an existing file is an SQLite one.

    Never writes to an existing file: one that is not SQLite's (by its first 16 bytes) is refused as it is.
    """
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise StoreError(f"cannot make the folder of the response store {path}: {e}", path=path) from e
    try:
        # Owner-only, as SQLite's -wal and -shm files will be too (they copy the database's mode): it holds chats.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        pass
    except OSError as e:
        raise StoreError(f"cannot create the response store {path}: {e}", path=path) from e
    else:
        os.close(fd)
        return
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a folder, or a FIFO that reading would hang on
            raise StoreError(f"the response store {path} is not a regular file: give another store path", path=path)
        with open(path, "rb") as f:
            head = f.read(len(_SQLITE_HEADER))
    except OSError as e:
        raise StoreError(f"cannot read the response store {path}: {e}", path=path) from e
    # An empty file is an empty database to SQLite; anything else must be one already.
    if head and head != _SQLITE_HEADER:
        raise StoreError(
            f"{path} is not an SQLite database: the response store never writes over a file it did not make; give "
            "another store path",
            path=path,
        )
