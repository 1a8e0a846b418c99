"""The Conversations API's items through the real ``openai`` client against a real Triton: listed (with OpenAI's
pagination), added, fetched and deleted one by one, the metadata updated; and what an edit means for a conversation
whose chain is live on the server: its next turn replays the stored items instead of continuing a history that no
longer matches them. Then the store's side of it (both stores, and the migration of a schema-1 file). Replies are
greedy, so each turn must equal its stateless twin: the same history sent whole to Chat Completions."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest
from openai import AsyncOpenAI

from triton_npu_client import Client
from triton_npu_client._gateway import GatewayOptions, MemoryStore, OpenAIGateway, SQLiteStore
from triton_npu_client._gateway._store import (
    SCHEMA_VERSION,
    RecordError,
    ResponseStore,
    StoredConversation,
    StoredResponse,
    message_item,
)

TOKENS = 8
GREEDY: dict[str, Any] = {"temperature": 0, "max_output_tokens": TOKENS}


# The fixtures client, gateway (an embedded OpenAIGateway) and oa (AsyncOpenAI on it) are conftest.py's.


async def twin(oa: AsyncOpenAI, said: list[tuple[str, str]]) -> tuple[str, int]:
    """The stateless twin's text and prompt tokens: the whole history through Chat Completions."""
    done = await oa.chat.completions.create(
        model="chat",
        messages=[{"role": r, "content": t} for r, t in said],  # type: ignore[misc]
        max_tokens=TOKENS,
        temperature=0,
    )
    assert done.usage is not None
    return done.choices[0].message.content or "", done.usage.prompt_tokens


async def replays(gateway: OpenAIGateway) -> float:
    """How many turns the gateway replayed because their chain was not live (forked, edited, not open here)."""
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{gateway.url}/metrics")).text
    line = next((x for x in text.splitlines() if x.startswith('tnc_openai_replays_total{why="not_live"}')), None)
    return 0.0 if line is None else float(line.split()[-1])


def texts(items: list[Any]) -> list[tuple[str, str]]:
    return [(i.role, i.content[0].text) for i in items]


# --- listing, adding, fetching, deleting, updating ------------------------------------------------------------


async def test_items_list_every_item_of_the_conversation_with_openais_pagination(oa: AsyncOpenAI) -> None:
    conv = await oa.conversations.create(items=[{"type": "message", "role": "system", "content": "Be brief."}])
    r1 = await oa.responses.create(model="chat", input="Where is the house?", conversation=conv.id, **GREEDY)
    r2 = await oa.responses.create(model="chat", input="Who lives there?", conversation=conv.id, **GREEDY)
    said = [("system", "Be brief."), ("user", "Where is the house?"), ("assistant", r1.output_text),
            ("user", "Who lives there?"), ("assistant", r2.output_text)]  # fmt: skip
    oldest_first = await oa.conversations.items.list(conv.id, order="asc")
    assert texts(oldest_first.data) == said
    # The turns' items are the responses' own: the output message keeps its id, and the input its input item's.
    assert oldest_first.data[2].id == r1.output[0].id
    assert oldest_first.data[4].model_dump(exclude_none=True) == r2.output[0].model_dump(exclude_none=True)
    assert oldest_first.data[3].id == (await oa.responses.input_items.list(r2.id)).data[0].id
    newest_first = await oa.conversations.items.list(conv.id)  # desc is OpenAI's default
    assert [i.id for i in newest_first.data] == [i.id for i in reversed(oldest_first.data)]
    # Pages of two, each starting past the last one's last id, as the client's auto-pagination follows them.
    page = await oa.conversations.items.list(conv.id, order="asc", limit=2)
    assert page.has_more is True
    assert page.last_id == oldest_first.data[1].id
    async with httpx.AsyncClient() as http:
        query = {"order": "asc", "limit": 2, "after": oldest_first.data[1].id}
        raw = (await http.get(f"{oa.base_url}conversations/{conv.id}/items", params=query)).json()
    assert raw["object"] == "list"
    assert [i["id"] for i in raw["data"]] == [i.id for i in oldest_first.data[2:4]]
    assert (raw["first_id"], raw["last_id"], raw["has_more"]) == (oldest_first.data[2].id, oldest_first.data[3].id,
                                                                  True)  # fmt: skip
    walked = [item.id async for item in oa.conversations.items.list(conv.id, order="asc", limit=2)]
    assert walked == [i.id for i in oldest_first.data]
    one = await oa.conversations.items.retrieve(oldest_first.data[3].id, conversation_id=conv.id)
    assert texts([one]) == [("user", "Who lives there?")]
    await oa.conversations.delete(conv.id)
    for r in (r1, r2):
        await oa.responses.delete(r.id)


@pytest.mark.parametrize(
    ("query", "param", "words"),
    [
        ({"limit": 0}, "limit", "1..100"),
        ({"limit": 101}, "limit", "1..100"),
        ({"order": "sideways"}, "order", "'asc' or 'desc'"),
        ({"after": "msg_nope"}, "after", "no item 'msg_nope'"),
        ({"include[]": "reasoning.encrypted_content"}, "include", "not supported"),
        ({"wibble": 1}, "wibble", "Unrecognized"),
    ],
)
async def test_a_bad_item_query_is_a_400_naming_it(oa: AsyncOpenAI, query: dict[str, Any], param: str,
                                                   words: str) -> None:  # fmt: skip
    conv = await oa.conversations.create(items=[{"role": "user", "content": "hello"}])
    async with httpx.AsyncClient() as http:
        got = await http.get(f"{oa.base_url}conversations/{conv.id}/items", params=query)
    assert got.status_code == 400, got.text
    assert got.json()["error"]["param"] == param
    assert words in got.json()["error"]["message"]
    await oa.conversations.delete(conv.id)


async def test_items_added_to_a_live_conversation_are_in_its_next_turn_which_replays(
    oa: AsyncOpenAI, gateway: OpenAIGateway
) -> None:
    conv = await oa.conversations.create()
    r1 = await oa.responses.create(model="chat", input="Where is the house?", conversation=conv.id, **GREEDY)
    r2 = await oa.responses.create(model="chat", input="Who lives there?", conversation=conv.id, **GREEDY)
    assert r2.usage is not None
    assert r2.usage.input_tokens - r2.usage.input_tokens_details.cached_tokens <= 16  # live: the new message only
    added = await oa.conversations.items.create(conv.id, items=[
        {"type": "message", "role": "user", "content": "The garden is large."},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is."}]},
    ])  # fmt: skip
    assert texts(added.data) == [("user", "The garden is large."), ("assistant", "It is.")]
    assert all(i.id.startswith("msg_") and i.status == "completed" for i in added.data)  # type: ignore[union-attr]
    before = await replays(gateway)
    r3 = await oa.responses.create(model="chat", input="And the sister?", conversation=conv.id, **GREEDY)
    said = [("user", "Where is the house?"), ("assistant", r1.output_text), ("user", "Who lives there?"),
            ("assistant", r2.output_text), ("user", "The garden is large."), ("assistant", "It is."),
            ("user", "And the sister?")]  # fmt: skip
    text, prompt = await twin(oa, said)
    assert r3.output_text == text
    assert r3.usage is not None
    assert r3.usage.input_tokens == prompt  # conditioned on the whole history, the added items included
    assert await replays(gateway) == before + 1  # replayed from the items: the live chain lacked the added ones
    # The turn after it continues live again, from r3.
    r4 = await oa.responses.create(model="chat", input="Why so?", conversation=conv.id, **GREEDY)
    assert r4.output_text == (await twin(oa, [*said, ("assistant", r3.output_text), ("user", "Why so?")]))[0]
    assert r4.usage is not None
    assert r4.usage.input_tokens - r4.usage.input_tokens_details.cached_tokens <= 16
    assert await replays(gateway) == before + 1
    await oa.conversations.delete(conv.id)
    for r in (r1, r2, r3, r4):
        await oa.responses.delete(r.id)


async def test_deleting_an_item_of_a_live_conversation_replays_the_rest_and_leaves_the_chain_alone(
    oa: AsyncOpenAI, gateway: OpenAIGateway
) -> None:
    conv = await oa.conversations.create()
    r1 = await oa.responses.create(model="chat", input="Where is the house?", conversation=conv.id, **GREEDY)
    r2 = await oa.responses.create(model="chat", input="Who lives there?", conversation=conv.id, **GREEDY)
    items = (await oa.conversations.items.list(conv.id, order="asc")).data
    # The first question goes; what the server holds for the chain (r2's history) no longer matches the items.
    after = await oa.conversations.items.delete(items[0].id, conversation_id=conv.id)
    assert after.id == conv.id
    assert after.object == "conversation"
    assert [i.id for i in (await oa.conversations.items.list(conv.id, order="asc")).data] == [i.id for i in items[1:]]
    with pytest.raises(openai.NotFoundError) as gone:
        await oa.conversations.items.retrieve(items[0].id, conversation_id=conv.id)
    assert gone.value.body["code"] == "item_not_found"  # type: ignore[index]
    before = await replays(gateway)
    r3 = await oa.responses.create(model="chat", input="What did she say?", conversation=conv.id, **GREEDY)
    said = [("assistant", r1.output_text), ("user", "Who lives there?"), ("assistant", r2.output_text),
            ("user", "What did she say?")]  # fmt: skip
    text, prompt = await twin(oa, said)
    assert r3.output_text == text
    assert r3.usage is not None
    assert r3.usage.input_tokens == prompt  # the deleted question is in nothing the reply was conditioned on
    assert await replays(gateway) == before + 1
    # r2 itself is untouched: its chain still continues live, on its own history.
    r2b = await oa.responses.create(model="chat", input="What did she say?", previous_response_id=r2.id, **GREEDY)
    full = [("user", "Where is the house?"), *said]
    assert r2b.output_text == (await twin(oa, full))[0]
    assert r2b.usage is not None
    assert r2b.usage.input_tokens - r2b.usage.input_tokens_details.cached_tokens <= 16
    await oa.conversations.delete(conv.id)
    for r in (r1, r2, r3, r2b):
        await oa.responses.delete(r.id)


async def test_deleting_a_conversations_latest_response_replays_its_items(oa: AsyncOpenAI) -> None:
    conv = await oa.conversations.create()
    r1 = await oa.responses.create(model="chat", input="Where is the house?", conversation=conv.id, **GREEDY)
    await oa.responses.delete(r1.id)  # its live chat is ended; the conversation's items keep the history
    r2 = await oa.responses.create(model="chat", input="Who lives there?", conversation=conv.id, **GREEDY)
    text, prompt = await twin(oa, [("user", "Where is the house?"), ("assistant", r1.output_text),
                                   ("user", "Who lives there?")])  # fmt: skip
    assert r2.output_text == text
    assert r2.usage is not None
    assert r2.usage.input_tokens == prompt
    await oa.conversations.delete(conv.id)
    await oa.responses.delete(r2.id)


async def test_metadata_is_updated(oa: AsyncOpenAI) -> None:
    conv = await oa.conversations.create(metadata={"topic": "houses"})
    updated = await oa.conversations.update(conv.id, metadata={"topic": "gardens", "by": "emma"})
    assert updated.metadata == {"topic": "gardens", "by": "emma"}
    assert (await oa.conversations.retrieve(conv.id)).metadata == {"topic": "gardens", "by": "emma"}
    async with httpx.AsyncClient() as http:
        missing = await http.post(f"{oa.base_url}conversations/{conv.id}", json={})
        bad = await http.post(f"{oa.base_url}conversations/{conv.id}", json={"metadata": {"n": 1}})
        extra = await http.post(f"{oa.base_url}conversations/{conv.id}", json={"metadata": {}, "items": []})
    assert (missing.status_code, missing.json()["error"]["param"]) == (400, "metadata")
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "metadata")
    assert (extra.status_code, extra.json()["error"]["param"]) == (400, "items")
    await oa.conversations.delete(conv.id)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"items": []}, "items"),
        ({"items": "hello"}, "items"),
        ({"items": [{"role": "user", "content": "x"}] * 21}, "items"),
        ({"items": [{"type": "reasoning", "summary": []}]}, "items[0].type"),
        ({"items": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[]"}]}, "items[0].arguments"),
        ({"items": [{"role": "wizard", "content": "x"}]}, "items[0].role"),
        ({"items": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "items[0].content[0].type"),
    ],
)  # fmt: skip
async def test_bad_items_are_refused_naming_them_and_change_nothing(
    oa: AsyncOpenAI, body: dict[str, Any], param: str
) -> None:
    conv = await oa.conversations.create(items=[{"role": "user", "content": "hello"}])
    async with httpx.AsyncClient() as http:
        got = await http.post(f"{oa.base_url}conversations/{conv.id}/items", json=body)
    assert got.status_code == 400, got.text
    assert got.json()["error"]["param"] == param
    assert texts((await oa.conversations.items.list(conv.id)).data) == [("user", "hello")]
    await oa.conversations.delete(conv.id)


async def test_another_keys_conversation_items_are_404_and_unknown_ids_too(client: Client) -> None:
    options = GatewayOptions(api_keys=("key-a", "key-b"))
    async with OpenAIGateway(client, port=0, options=options) as gw:
        a = AsyncOpenAI(base_url=gw.base_url, api_key="key-a", max_retries=0)
        b = AsyncOpenAI(base_url=gw.base_url, api_key="key-b", max_retries=0)
        conv = await a.conversations.create(items=[{"role": "user", "content": "hello"}])
        item = (await a.conversations.items.list(conv.id)).data[0]
        attempts = [
            lambda: b.conversations.items.list(conv.id),
            lambda: b.conversations.items.create(conv.id, items=[{"role": "user", "content": "mine"}]),
            lambda: b.conversations.items.retrieve(item.id, conversation_id=conv.id),
            lambda: b.conversations.items.delete(item.id, conversation_id=conv.id),
            lambda: b.conversations.update(conv.id, metadata={"k": "v"}),
        ]
        for attempt in attempts:
            with pytest.raises(openai.NotFoundError) as refused:
                await attempt()
            assert refused.value.body["code"] == "conversation_not_found"  # type: ignore[index]
        # The owner's conversation is as it was.
        assert texts((await a.conversations.items.list(conv.id)).data) == [("user", "hello")]
        assert (await a.conversations.retrieve(conv.id)).metadata == {}
        with pytest.raises(openai.NotFoundError):
            await a.conversations.items.list("conv_unknown")
        with pytest.raises(openai.NotFoundError) as unknown:
            await a.conversations.items.delete("msg_unknown", conversation_id=conv.id)
        assert unknown.value.body["code"] == "item_not_found"  # type: ignore[index]
        await a.conversations.delete(conv.id)
        await a.close()
        await b.close()


async def test_an_edit_while_a_turn_of_the_conversation_runs_is_409(oa: AsyncOpenAI, gateway: OpenAIGateway) -> None:
    conv = await oa.conversations.create(items=[{"role": "user", "content": "hello"}])
    item = (await oa.conversations.items.list(conv.id)).data[0]
    async with httpx.AsyncClient(timeout=60) as http:
        body = {"model": "chat", "input": "Go on.", "conversation": conv.id, "max_output_tokens": 64, "stream": True,
                "temperature": 0}  # fmt: skip
        async with http.stream("POST", f"{gateway.base_url}/responses", json=body) as running:
            lines = running.aiter_lines()
            async for line in lines:
                if "output_text.delta" in line:
                    break
            added = await http.post(f"{gateway.base_url}/conversations/{conv.id}/items",
                                    json={"items": [{"role": "user", "content": "x"}]})  # fmt: skip
            deleted = await http.delete(f"{gateway.base_url}/conversations/{conv.id}/items/{item.id}")
            rest = [line async for line in lines]
        assert any("response.completed" in x or "response.incomplete" in x for x in rest)
    for got in (added, deleted):
        assert got.status_code == 409, got.text
        assert got.json()["error"]["code"] == "conversation_busy"
    # Once the turn is done, the edit goes through, and the conversation holds the turn and the edit.
    await oa.conversations.items.create(conv.id, items=[{"role": "user", "content": "x"}])
    listed = (await oa.conversations.items.list(conv.id, order="asc")).data
    assert [role for role, _ in texts(listed)] == ["user", "user", "assistant", "user"]
    await oa.conversations.delete(conv.id)


# --- the store ----------------------------------------------------------------------------------------------------


@pytest.fixture(params=["memory", "sqlite"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ResponseStore]:
    made: ResponseStore = MemoryStore() if request.param == "memory" else SQLiteStore(tmp_path / "r.sqlite3")
    yield made
    await made.aclose()


def _conversation(cid: str = "conv_1", owner: str = "o", head: str | None = "resp_1") -> StoredConversation:
    items = (message_item("msg_a", "user", "hi"), message_item("msg_b", "assistant", "hello"))
    return StoredConversation(id=cid, owner=owner, created_at=1, metadata={"k": "v"}, items=items,
                              messages=(("user", "hi"), ("assistant", "hello")), head=head)  # fmt: skip


async def test_a_store_appends_deletes_and_updates_items_and_clears_the_head(store: ResponseStore) -> None:
    await store.put_conversation(_conversation())
    added = await store.add_conversation_items(
        "conv_1", owner="o", items=[message_item("msg_c", "user", "more")], messages=[("user", "more")]
    )
    assert added is not None
    assert [i["id"] for i in added.items] == ["msg_a", "msg_b", "msg_c"]
    assert added.messages[-1] == ("user", "more")
    assert added.head is None  # its head's history no longer matches: the next turn replays
    assert await store.get_conversation("conv_1", owner="o") == added
    # A turn appends its items as its head moves, in one write; a stale head moves nothing.
    turn = [message_item("msg_d", "user", "q"), message_item("msg_e", "assistant", "a")]
    assert not await store.advance_conversation("conv_1", owner="o", expected_head="resp_1", new_head="resp_2",
                                                items=turn, messages=[("user", "q"), ("assistant", "a")])  # fmt: skip
    assert await store.advance_conversation("conv_1", owner="o", expected_head=None, new_head="resp_2", items=turn,
                                            messages=[("user", "q"), ("assistant", "a")])  # fmt: skip
    moved = await store.get_conversation("conv_1", owner="o")
    assert moved is not None
    assert (moved.head, len(moved.items), moved.messages[-2:]) == ("resp_2", 5, (("user", "q"), ("assistant", "a")))
    deleted = await store.delete_conversation_item("conv_1", "msg_b", owner="o")
    assert deleted is not None
    assert [i["id"] for i in deleted.items] == ["msg_a", "msg_c", "msg_d", "msg_e"]
    assert deleted.messages == (("user", "hi"), ("user", "more"), ("user", "q"), ("assistant", "a"))
    assert deleted.head is None
    assert await store.delete_conversation_item("conv_1", "msg_b", owner="o") is None  # gone already
    updated = await store.update_conversation("conv_1", owner="o", metadata={"x": "y"})
    assert updated is not None
    assert (updated.metadata, updated.items) == ({"x": "y"}, deleted.items)
    # Another owner changes nothing.
    assert await store.add_conversation_items("conv_1", owner="p", items=[], messages=[]) is None
    assert await store.delete_conversation_item("conv_1", "msg_a", owner="p") is None
    assert await store.update_conversation("conv_1", owner="p", metadata={}) is None
    assert await store.get_conversation("conv_1", owner="o") == updated
    with pytest.raises(RecordError, match="one message per item"):
        await store.add_conversation_items("conv_1", owner="o", items=[message_item("m", "user", "x")], messages=[])
    with pytest.raises(RecordError, match="items"):
        await store.add_conversation_items("conv_1", owner="o", items=[{"b": b"x"}], messages=[("user", "x")])
    assert await store.get_conversation("conv_1", owner="o") == updated


def _schema_1_file(path: Path) -> None:
    """A store as the gateway of schema 1 wrote it: a conversation of one turn, one without a head, one whose head
    response was deleted."""
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE triton_npu_store_schema (version INTEGER NOT NULL)")
    conn.execute("INSERT INTO triton_npu_store_schema VALUES (1)")
    conn.execute("""CREATE TABLE responses (id TEXT PRIMARY KEY NOT NULL, owner TEXT NOT NULL, created_at INTEGER
        NOT NULL, model TEXT NOT NULL, status TEXT NOT NULL, body TEXT NOT NULL, input_items TEXT NOT NULL, messages
        TEXT NOT NULL, previous_response_id TEXT, conversation_id TEXT, chat_state TEXT)""")
    conn.execute("""CREATE TABLE conversations (id TEXT PRIMARY KEY NOT NULL, owner TEXT NOT NULL, created_at INTEGER
        NOT NULL, metadata TEXT NOT NULL, items TEXT NOT NULL, messages TEXT NOT NULL, head TEXT)""")
    first = [{"id": "msg_0", "type": "message", "role": "system", "content": [{"type": "input_text", "text": "S"}]}]
    history = [["system", "S"], ["user", "Q"], ["assistant", "A"]]
    conn.execute(
        "INSERT INTO responses VALUES (?,?,?,?,?,?,?,?,?,?,?)",
        ("resp_1", "o", 1, "chat", "completed", "{}", "[]", json.dumps(history), None, "conv_1", None),
    )
    for cid, head in (("conv_1", "resp_1"), ("conv_2", None), ("conv_3", "resp_gone")):
        conn.execute("INSERT INTO conversations VALUES (?,?,?,?,?,?,?)",
                     (cid, "o", 1, "{}", json.dumps(first), json.dumps([["system", "S"]]), head))  # fmt: skip
    conn.commit()
    conn.close()


async def test_a_schema_1_store_is_migrated_to_whole_conversations(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    _schema_1_file(path)
    async with SQLiteStore(path) as store:
        one = await store.get_conversation("conv_1", owner="o")
        two = await store.get_conversation("conv_2", owner="o")
        three = await store.get_conversation("conv_3", owner="o")
        assert one is not None
        assert two is not None
        assert three is not None
        # With a head: its items are the head's history, one message item each (the head stays: it continues live).
        assert one.messages == (("system", "S"), ("user", "Q"), ("assistant", "A"))
        assert [(i["role"], i["content"][0]["text"], i["content"][0]["type"]) for i in one.items] == [
            ("system", "S", "input_text"), ("user", "Q", "input_text"), ("assistant", "A", "output_text")
        ]  # fmt: skip
        assert len({i["id"] for i in one.items}) == 3
        assert one.head == "resp_1"
        # Without a head, or with one that is gone: as they were.
        assert (two.messages, two.head) == ((("system", "S"),), None)
        assert (three.messages, three.head) == ((("system", "S"),), "resp_gone")
        response = await store.get_response("resp_1", owner="o")
        assert isinstance(response, StoredResponse)
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT version FROM triton_npu_store_schema").fetchall() == [(SCHEMA_VERSION,)]
    conn.close()
    async with SQLiteStore(path) as again:  # opened again: nothing left to migrate, nothing changes
        assert await again.get_conversation("conv_1", owner="o") == one
