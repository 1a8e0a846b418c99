"""The gateway's response store: both stores keep the same records with the same semantics (owners, unique ids,
compare-and-set heads); the SQLite one survives reopening, shares a file between two instances, refuses a newer
schema and never writes over a file it did not make. Pure: no server."""

from __future__ import annotations

import asyncio
import sqlite3
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from triton_npu_client._errors import ClientClosedError, UsageError
from triton_npu_client._gateway._store import (
    SCHEMA_VERSION,
    DuplicateIdError,
    MemoryStore,
    RecordError,
    ResponseStore,
    SQLiteStore,
    StoredConversation,
    StoredResponse,
    StoreError,
    default_store_path,
)

OWNER = "sha256:owner-a"
OTHER = "sha256:owner-b"
# Emoji (outside the BMP), CJK, right-to-left, combining marks, a NUL, a lone surrogate (valid in a JSON string).
UNICODE = "héllo 👋🏽 你好 שלום e\u0301 \x00 \ud800 end"


def _response(rid: str = "resp_1", *, owner: str = OWNER, **changes: Any) -> StoredResponse:
    fields: dict[str, Any] = {
        "id": rid,
        "owner": owner,
        "created_at": 1_700_000_000,
        "model": "chat",
        "status": "completed",
        "body": {
            "id": rid,
            "object": "response",
            "output": [{"type": "message", "content": [{"type": "output_text", "text": UNICODE, "annotations": []}]}],
            "usage": {"input_tokens": 3, "output_tokens": 5, "details": {"cached": None, "ratio": 0.25}},
            "metadata": {"k": "v"},
            "flag": True,
        },
        "input_items": ({"type": "message", "role": "user", "content": UNICODE}, {"type": "message", "role": "x"}),
        "messages": (("system", "be terse"), ("user", UNICODE), ("assistant", "ok\nline two")),
        "previous_response_id": "resp_0",
        "conversation_id": "conv_1",
        "chat_state": {"sequence_id": 2**40, "replica": "r0", "tokens": [1, 2, 3], "digest": UNICODE},
    }
    fields.update(changes)
    return StoredResponse(**fields)


def _conversation(cid: str = "conv_1", *, owner: str = OWNER, **changes: Any) -> StoredConversation:
    fields: dict[str, Any] = {
        "id": cid,
        "owner": owner,
        "created_at": 1_700_000_001,
        "metadata": {"topic": UNICODE, "empty": ""},
        "items": ({"type": "message", "role": "user", "content": [{"type": "input_text", "text": UNICODE}]},),
        "messages": (("user", UNICODE),),
        "head": None,
    }
    fields.update(changes)
    return StoredConversation(**fields)


@pytest.fixture(params=["memory", "sqlite"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ResponseStore]:
    made: ResponseStore = (
        MemoryStore() if request.param == "memory" else SQLiteStore(tmp_path / "data" / "responses.sqlite3")
    )
    yield made
    await made.aclose()


# --- the shared semantics ---------------------------------------------------------------------------------------


async def test_a_response_comes_back_as_it_went_in(store: ResponseStore) -> None:
    kept = _response()
    await store.put_response(kept)
    got = await store.get_response("resp_1", owner=OWNER)
    assert got == kept
    assert got is not None
    assert got.body["output"][0]["content"][0]["text"] == UNICODE
    assert got.messages[1] == ("user", UNICODE)
    # The optional fields may be absent, and come back absent.
    bare = _response("resp_2", previous_response_id=None, conversation_id=None, chat_state=None, input_items=())
    await store.put_response(bare)
    assert await store.get_response("resp_2", owner=OWNER) == bare


async def test_a_conversation_comes_back_as_it_went_in(store: ResponseStore) -> None:
    kept = _conversation()
    await store.put_conversation(kept)
    assert await store.get_conversation("conv_1", owner=OWNER) == kept
    assert await store.get_conversation("conv_2", owner=OWNER) is None


async def test_a_stored_record_does_not_change_with_the_callers_dicts(store: ResponseStore) -> None:
    kept = _response()
    await store.put_response(kept)
    kept.body["usage"]["input_tokens"] = 99
    got = await store.get_response("resp_1", owner=OWNER)
    assert got is not None
    assert got.body["usage"]["input_tokens"] == 3
    got.body["flag"] = False
    again = await store.get_response("resp_1", owner=OWNER)
    assert again is not None
    assert again.body["flag"] is True


async def test_another_owner_sees_nothing_and_deletes_nothing(store: ResponseStore) -> None:
    await store.put_response(_response())
    await store.put_conversation(_conversation())
    assert await store.get_response("resp_1", owner=OTHER) is None
    assert await store.delete_response("resp_1", owner=OTHER) is None
    assert await store.get_conversation("conv_1", owner=OTHER) is None
    assert await store.delete_conversation("conv_1", owner=OTHER) is False
    assert await store.advance_conversation("conv_1", owner=OTHER, expected_head=None, new_head="resp_9") is False
    # The owner's records are untouched by all of that.
    assert await store.get_response("resp_1", owner=OWNER) == _response()
    assert await store.get_conversation("conv_1", owner=OWNER) == _conversation()
    # The key-less gateway's owner "" is an owner like any other.
    assert await store.get_response("resp_1", owner="") is None


async def test_an_id_is_stored_once(store: ResponseStore) -> None:
    await store.put_response(_response())
    await store.put_conversation(_conversation())
    # Also when another owner asks: ids are unique across owners.
    with pytest.raises(DuplicateIdError) as caught:
        await store.put_response(_response(owner=OTHER, model="other"))
    assert caught.value.record_id == "resp_1"
    assert isinstance(caught.value, UsageError)
    with pytest.raises(DuplicateIdError):
        await store.put_conversation(_conversation(metadata={}))
    assert await store.get_response("resp_1", owner=OWNER) == _response()
    assert await store.get_response("resp_1", owner=OTHER) is None
    assert await store.get_conversation("conv_1", owner=OWNER) == _conversation()


async def test_delete_returns_the_record_once(store: ResponseStore) -> None:
    await store.put_response(_response())
    await store.put_response(_response("resp_2"))
    assert await store.delete_response("resp_1", owner=OWNER) == _response()
    assert await store.delete_response("resp_1", owner=OWNER) is None
    assert await store.get_response("resp_1", owner=OWNER) is None
    assert await store.get_response("resp_2", owner=OWNER) == _response("resp_2")
    await store.put_conversation(_conversation())
    assert await store.delete_conversation("conv_1", owner=OWNER) is True
    assert await store.delete_conversation("conv_1", owner=OWNER) is False
    assert await store.get_conversation("conv_1", owner=OWNER) is None
    # A deleted id may be stored again (it is the gateway that never reuses one).
    await store.put_response(_response(model="again"))
    got = await store.get_response("resp_1", owner=OWNER)
    assert got is not None
    assert got.model == "again"


async def test_the_head_moves_only_from_where_it_was(store: ResponseStore) -> None:
    await store.put_conversation(_conversation())
    assert await store.advance_conversation("conv_1", owner=OWNER, expected_head=None, new_head="resp_1") is True
    # A second writer that also saw no head lost the race.
    assert await store.advance_conversation("conv_1", owner=OWNER, expected_head=None, new_head="resp_x") is False
    assert await store.advance_conversation("conv_1", owner=OWNER, expected_head="resp_0", new_head="resp_x") is False
    assert await store.advance_conversation("conv_1", owner=OWNER, expected_head="resp_1", new_head="resp_2") is True
    got = await store.get_conversation("conv_1", owner=OWNER)
    assert got is not None
    assert got.head == "resp_2"
    assert got == _conversation(head="resp_2")
    assert await store.advance_conversation("conv_9", owner=OWNER, expected_head=None, new_head="resp_3") is False


async def test_racing_advances_let_exactly_one_win(store: ResponseStore) -> None:
    await store.put_conversation(_conversation())
    won = await asyncio.gather(
        *(
            store.advance_conversation("conv_1", owner=OWNER, expected_head=None, new_head=f"resp_{i}")
            for i in range(50)
        )
    )
    assert won.count(True) == 1
    got = await store.get_conversation("conv_1", owner=OWNER)
    assert got is not None
    assert got.head == f"resp_{won.index(True)}"


async def test_forget_chat_state_keeps_the_rest(store: ResponseStore) -> None:
    await store.put_response(_response())
    assert await store.forget_chat_state("resp_1") is True
    assert await store.get_response("resp_1", owner=OWNER) == _response(chat_state=None)
    assert await store.forget_chat_state("resp_9") is False


async def test_what_is_not_json_is_refused_before_anything_is_stored(store: ResponseStore) -> None:
    for bad in ({"s": {1, 2}}, {"x": float("nan")}, {"o": object()}):
        with pytest.raises(RecordError, match="resp_1"):
            await store.put_response(_response(body=bad))
    with pytest.raises(RecordError, match="chat_state"):
        await store.put_response(_response(chat_state={"inf": float("inf")}))
    with pytest.raises(RecordError, match="items"):
        await store.put_conversation(_conversation(items=({"b": b"bytes"},)))
    assert await store.get_response("resp_1", owner=OWNER) is None
    assert await store.get_conversation("conv_1", owner=OWNER) is None


async def test_many_concurrent_calls(store: ResponseStore) -> None:
    await asyncio.gather(*(store.put_response(_response(f"resp_{i}", created_at=i)) for i in range(100)))
    # Puts of new ids interleaved with gets of the stored ones.
    results = await asyncio.gather(
        *(
            store.get_response(f"resp_{i // 2}", owner=OWNER)
            if i % 2
            else store.put_response(_response(f"resp_new_{i}", created_at=i))
            for i in range(200)
        )
    )
    assert [r.created_at for r in results[1::2] if r is not None] == list(range(100))
    assert results[0::2] == [None] * 100
    fetched = await asyncio.gather(*(store.get_response(f"resp_new_{i}", owner=OWNER) for i in range(0, 200, 2)))
    assert [r.created_at if r else None for r in fetched] == list(range(0, 200, 2))


async def test_a_closed_store_refuses_calls(store: ResponseStore) -> None:
    await store.put_response(_response())
    await store.aclose()
    await store.aclose()  # twice is harmless
    with pytest.raises(ClientClosedError):
        await store.get_response("resp_1", owner=OWNER)
    with pytest.raises(ClientClosedError):
        await store.put_conversation(_conversation())


def test_the_records_check_their_fields() -> None:
    with pytest.raises(ValueError, match="status"):
        _response(status="running")
    with pytest.raises(TypeError, match="role, text"):
        _response(messages=(("user", "a", "b"),))
    with pytest.raises(TypeError, match="metadata"):
        _conversation(metadata={"n": 1})
    # Lists are taken and kept as tuples; the conversation's text stays out of repr.
    made = _response(messages=[["user", "hi"]], input_items=[{"a": 1}])
    assert made.messages == (("user", "hi"),)
    assert made.input_items == ({"a": 1},)
    assert "hi" not in repr(made)
    assert UNICODE not in repr(made)


# --- SQLite only --------------------------------------------------------------------------------------------------


async def test_records_survive_reopening(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "folders" / "responses.sqlite3"
    async with SQLiteStore(path) as first:
        await first.put_response(_response())
        await first.put_response(_response("resp_2"))
        await first.put_conversation(_conversation())
        assert await first.advance_conversation("conv_1", owner=OWNER, expected_head=None, new_head="resp_1")
        assert await first.delete_response("resp_2", owner=OWNER) is not None
    assert path.is_file()
    assert path.stat().st_mode & 0o077 == 0  # it holds conversations: the owner's only
    second = await SQLiteStore.open(path)
    try:
        assert await second.get_response("resp_1", owner=OWNER) == _response()
        assert await second.get_response("resp_2", owner=OWNER) is None
        assert await second.get_conversation("conv_1", owner=OWNER) == _conversation(head="resp_1")
        with pytest.raises(DuplicateIdError):
            await second.put_response(_response())
    finally:
        await second.aclose()


async def test_the_file_is_in_wal_mode_with_a_schema_version(tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite3"
    async with SQLiteStore(path):
        pass
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert conn.execute("SELECT version FROM triton_npu_store_schema").fetchall() == [(SCHEMA_VERSION,)]
    conn.close()


async def test_two_instances_on_one_file_share_records_and_the_compare_and_set(tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite3"
    async with SQLiteStore(path) as a, SQLiteStore(path) as b:
        await a.put_conversation(_conversation())
        await b.put_response(_response())
        assert await a.get_response("resp_1", owner=OWNER) == _response()
        with pytest.raises(DuplicateIdError):
            await b.put_conversation(_conversation())
        assert await a.advance_conversation("conv_1", owner=OWNER, expected_head=None, new_head="resp_1") is True
        assert await b.advance_conversation("conv_1", owner=OWNER, expected_head=None, new_head="resp_b") is False
        # Both instances race from the same head, each on its own thread and connection: one wins.
        won = await asyncio.gather(
            *(
                store.advance_conversation("conv_1", owner=OWNER, expected_head="resp_1", new_head=f"resp_race_{i}")
                for i, store in enumerate([a, b] * 20)
            )
        )
        assert won.count(True) == 1
        got = await b.get_conversation("conv_1", owner=OWNER)
        assert got is not None
        assert got.head == f"resp_race_{won.index(True)}"
        # A record deleted through one is gone for the other, once.
        deleted = await asyncio.gather(
            a.delete_response("resp_1", owner=OWNER), b.delete_response("resp_1", owner=OWNER)
        )
        assert sorted(d is None for d in deleted) == [False, True]


async def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite3"
    async with SQLiteStore(path) as store:
        await store.put_response(_response())
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE triton_npu_store_schema SET version = ?", (SCHEMA_VERSION + 98,))
    conn.close()
    with pytest.raises(StoreError) as caught:
        SQLiteStore(path)
    message = str(caught.value)
    assert str(path) in message
    assert f"schema version {SCHEMA_VERSION + 98}" in message
    assert f"version {SCHEMA_VERSION}," in message
    assert caught.value.path == path


@pytest.mark.parametrize(
    "content",
    [b"not a database, just text\n" * 200, b"SQLite", b"\x00" * 4096, b"SQLite format 2\x00" + b"\x00" * 4080],
    ids=["text", "short", "zeros", "near-header"],
)
def test_a_file_that_is_not_sqlite_is_refused_and_left_as_it_was(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "responses.sqlite3"
    path.write_bytes(content)
    with pytest.raises(StoreError, match="not an SQLite database") as caught:
        SQLiteStore(path)
    assert str(path) in str(caught.value)
    assert path.read_bytes() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == ["responses.sqlite3"]  # no -wal, no -shm, no journal


def test_another_programs_sqlite_database_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE schema_version (version INTEGER)")
        conn.execute("CREATE TABLE responses (id TEXT)")
        conn.execute("INSERT INTO responses VALUES ('theirs')")
    conn.close()
    before = path.read_bytes()
    with pytest.raises(StoreError, match="database of something else") as caught:
        SQLiteStore(path)
    assert str(path) in str(caught.value)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db"]


async def test_an_empty_file_becomes_a_store(tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite3"
    path.touch()
    async with SQLiteStore(path) as store:
        await store.put_response(_response())
        assert await store.get_response("resp_1", owner=OWNER) == _response()
    assert path.read_bytes()[:16] == b"SQLite format 3\x00"


def test_a_folder_or_an_unmakeable_parent_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="not a regular file"):
        SQLiteStore(tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StoreError, match="folder") as caught:
        SQLiteStore(blocker / "responses.sqlite3")
    assert caught.value.path == blocker / "responses.sqlite3"
    assert blocker.read_text() == "x"


# --- where the store lives by default -----------------------------------------------------------------------------


def test_default_store_path_honours_xdg_data_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_store_path() == tmp_path / "xdg" / "triton-npu" / "responses.sqlite3"
    # Unset, empty or relative (the XDG spec says to ignore a relative one): ~/.local/share.
    fallback = tmp_path / "home" / ".local" / "share" / "triton-npu" / "responses.sqlite3"
    for value in ("", "relative/data"):
        monkeypatch.setenv("XDG_DATA_HOME", value)
        assert default_store_path() == fallback
    monkeypatch.delenv("XDG_DATA_HOME")
    assert default_store_path() == fallback


def test_default_store_path_on_macos(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_store_path() == tmp_path / "Library" / "Application Support" / "triton-npu" / "responses.sqlite3"
