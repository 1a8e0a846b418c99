"""The OpenAI gateway driven by the real ``openai`` client (``AsyncOpenAI(base_url=...)``) against a real Triton.

The session server serves ``chat`` (the GPT-2 demo) and ``minilm``; the gateway runs in the test's event loop on a
free loopback port. Replies are greedy (temperature 0), so a reply is a function of the conversation: every turn of
a Responses chain must equal its *stateless twin*, the same history sent whole to ``/v1/chat/completions``.
What the server holds is read from the chat model itself (``LIVE``, ``KV_BYTES`` on a one-request conversation).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import numpy as np
import openai
import pytest
from _probe import probe
from openai import AsyncOpenAI

from triton_npu_client import Client, LocalTriton, score_batches
from triton_npu_client._gateway import GatewayOptions, MemoryStore, OpenAIGateway, SQLiteStore

TOKENS = 8
GREEDY: dict[str, Any] = {"temperature": 0}
QUESTIONS = ("Where is the house?", "Who lives there?", "What did she say?", "And then?", "Why so?", "How long?")


# The fixtures client, gateway (an embedded OpenAIGateway) and oa (AsyncOpenAI on it) are conftest.py's.


async def twin(oa: AsyncOpenAI, messages: list[dict[str, str]], tokens: int = TOKENS) -> str:
    """The stateless twin: the whole history through Chat Completions."""
    done = await oa.chat.completions.create(model="chat", messages=messages, max_tokens=tokens, **GREEDY)  # type: ignore[arg-type]
    return done.choices[0].message.content or ""


def history(*pairs: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": role, "content": text} for role, text in pairs]


# --- models, chat completions, embeddings -----------------------------------------------------------------------


async def test_models_lists_the_chat_and_embedding_models_with_their_shape(oa: AsyncOpenAI) -> None:
    listed = {m.id: m for m in (await oa.models.list()).data}
    assert listed["chat"].model_extra == {"kind": "chat", "context_length": 1280}
    assert listed["minilm"].model_extra == {"kind": "embedding", "dimensions": 384}
    # The encoder's own steps and the stateless twin fit neither shape.
    assert not {"minilm_encoder", "minilm_tokenizer", "chat_stateless", "scale_fp32"} & set(listed)


async def test_chat_completion_streamed_and_not_agree_with_the_sdk_chat(oa: AsyncOpenAI, client: Client) -> None:
    messages = history(("system", "You are terse."), ("user", "Tell me about the sea."))
    whole = await oa.chat.completions.create(model="chat", messages=messages, max_tokens=TOKENS, **GREEDY)  # type: ignore[arg-type]
    stream = await oa.chat.completions.create(
        model="chat",
        messages=messages,
        max_tokens=TOKENS,
        stream=True,
        stream_options={"include_usage": True},  # type: ignore[arg-type]
        **GREEDY,
    )
    pieces, finish, usage = [], None, None
    async for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    async with client.chat("chat", system="You are terse.", temperature=0, max_tokens=TOKENS) as chat:
        sdk = await chat.ask("Tell me about the sea.")
    assert whole.choices[0].message.content == "".join(pieces) == sdk.text
    assert whole.choices[0].finish_reason == finish == "length"  # TOKENS tokens, cut: the model did not stop
    assert whole.usage is not None
    assert usage is not None
    assert whole.usage.completion_tokens == usage.completion_tokens == sdk.tokens == TOKENS
    # The whole prompt, as the server counts it (INPUT_TOKENS), whatever part of it the cache held already.
    assert whole.usage.prompt_tokens == usage.prompt_tokens == sdk.input_tokens
    assert sdk.input_tokens == sdk.prompt_tokens + usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    # The second time, the history's full blocks come from the server's shared prefix: counted as cached.
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens > 0


async def test_a_stop_string_finishes_with_stop(oa: AsyncOpenAI) -> None:
    messages = history(("user", "Tell me about the sea."))
    free = await twin(oa, messages, 16)
    cut_at = free.split()[1]
    done = await oa.chat.completions.create(model="chat", messages=messages, max_tokens=16, stop=[cut_at], **GREEDY)  # type: ignore[arg-type]
    assert done.choices[0].finish_reason == "stop"
    assert done.choices[0].message.content == free[: free.index(cut_at)]


async def test_embeddings_equal_score_for_the_same_texts(oa: AsyncOpenAI, client: Client) -> None:
    texts = ["a cat sat on the mat", "the stock market fell", "é ü 漢字", "x" * 300]
    floats = await oa.embeddings.create(model="minilm", input=texts)
    packed = await oa.embeddings.create(model="minilm", input=texts, encoding_format="base64")
    model = await client.model("minilm")
    column = np.array([t.encode() for t in texts], dtype=object).reshape(-1, 1)
    expected = np.concatenate(
        [out["EMBEDDING"] async for batch in score_batches(model, [{"TEXT": column}]) for _, out in batch.runs]
    )
    got = np.array([d.embedding for d in floats.data], dtype=np.float32)
    assert [d.index for d in floats.data] == list(range(len(texts)))
    np.testing.assert_array_equal(got, expected)
    # Asked for explicitly, base64 comes back as the string: little-endian float32, as OpenAI packs it.
    unpacked = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in packed.data]  # type: ignore[arg-type]
    np.testing.assert_array_equal(np.array(unpacked), expected)
    # One text alone is one batch of one: it equals score() of that text alone, bit for bit. Against its row in the
    # batch of four it is equal only to float rounding: the batch pads every text to the longest one ("x" * 300),
    # and the encoder's matrix products then sum in an order that depends on the shape and the CPU's kernels.
    one = await oa.embeddings.create(model="minilm", input=texts[0])
    alone = [out["EMBEDDING"] async for batch in score_batches(model, [{"TEXT": column[:1]}]) for _, out in batch.runs]
    single = np.array(one.data[0].embedding, dtype=np.float32)
    np.testing.assert_array_equal(single, np.concatenate(alone)[0])
    np.testing.assert_allclose(single, expected[0], rtol=0, atol=1e-5)
    assert not np.allclose(single, expected[1], rtol=0, atol=1e-2)


async def test_a_model_of_the_wrong_kind_or_unknown_is_refused(oa: AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        await oa.chat.completions.create(model="no_such_model", messages=[{"role": "user", "content": "x"}])
    assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        await oa.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="chat model"):
        await oa.embeddings.create(model="chat", input="x")


# --- refused parameters and bad input --------------------------------------------------------------------------

CHAT_REFUSED: list[tuple[str, dict[str, Any]]] = [
    ("n", {"n": 17}),
    ("tools[0].type", {"tools": [{"type": "custom", "custom": {"name": "f"}}]}),
    ("functions", {"functions": [{"name": "f", "parameters": {}}]}),
    ("logit_bias", {"logit_bias": {"50256": -100}}),
    ("audio", {"audio": {"voice": "alloy", "format": "wav"}}),
    ("store", {"store": True}),
    ("messages[0].content[0].type", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}),
    ("messages[0].role", {"messages": [{"role": "function", "content": "x", "name": "f"}]}),
    ("messages[0].name", {"messages": [{"role": "user", "content": "x", "name": "bob"}]}),
    ("not_a_parameter", {"not_a_parameter": 1}),
]  # fmt: skip
RESPONSES_REFUSED: list[tuple[str, dict[str, Any]]] = [
    ("tools[0].type", {"tools": [{"type": "web_search"}]}),
    ("text.verbosity", {"text": {"format": {"type": "text"}, "verbosity": "high"}}),
    ("reasoning", {"reasoning": {"effort": "high"}}),
    ("background", {"background": True}),
    ("include", {"include": ["reasoning.encrypted_content"]}),
    ("input[0].type", {"input": [{"type": "reasoning", "summary": []}]}),
    ("input[0].content[0].type", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}),
]  # fmt: skip


@pytest.mark.parametrize(("param", "extra"), CHAT_REFUSED, ids=[p for p, _ in CHAT_REFUSED])
async def test_every_unsupported_chat_parameter_is_refused_naming_it(
    gateway: OpenAIGateway, param: str, extra: dict[str, Any]
) -> None:
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], **extra}
    async with httpx.AsyncClient() as http:
        r = await http.post(f"{gateway.base_url}/chat/completions", json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("param", "extra"), RESPONSES_REFUSED, ids=[p for p, _ in RESPONSES_REFUSED])
async def test_every_unsupported_responses_parameter_is_refused_naming_it(
    gateway: OpenAIGateway, param: str, extra: dict[str, Any]
) -> None:
    body = {"model": "chat", "input": "hi", **extra}
    async with httpx.AsyncClient() as http:
        r = await http.post(f"{gateway.base_url}/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


async def test_neutral_values_of_refused_parameters_ask_for_nothing(oa: AsyncOpenAI) -> None:
    done = await oa.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=1, logprobs=False,
        presence_penalty=0, tools=[], **GREEDY,
    )  # fmt: skip
    assert done.usage is not None
    assert done.usage.completion_tokens == 2


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"messages": []}, "messages", "non-empty"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature", "[0.0, 2.0]"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature", "number"),
        ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p", "(0.0, 1.0]"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens", "1..32768"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**12}, "max_tokens", "1..32768"),
        ({"messages": [{"role": "user", "content": "x"}], "seed": 2**70}, "seed", "integer"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": [""]}, "stop", "non-empty"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": ["s"] * 17}, "stop", "at most 16"),
        ({"messages": [{"role": "user", "content": "x" * 70000}]}, "messages[0].content", "at most 65536"),
        ({"messages": [{"role": "user", "content": "x"}] * 513}, "messages", "at most 512"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "messages[0].role", "the user's"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "one of"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "string"),
    ],
)
async def test_bad_values_get_a_400_naming_the_parameter_and_the_server_stays_healthy(
    gateway: OpenAIGateway, oa: AsyncOpenAI, body: dict[str, Any], param: str, words: str
) -> None:
    async with httpx.AsyncClient() as http:
        r = await http.post(f"{gateway.base_url}/chat/completions", json={"model": "chat", **body})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param
    assert words in error["message"]
    assert await twin(oa, history(("user", "hi")), 2)


async def test_a_body_that_is_too_big_or_not_json_is_refused_before_it_is_read_whole(client: Client) -> None:
    options = GatewayOptions(limits=attrs_evolve_limits(max_body_bytes=1000))
    async with OpenAIGateway(client, port=0, options=options) as gw, httpx.AsyncClient() as http:
        big = await http.post(f"{gw.base_url}/chat/completions", content=b"{" + b" " * 5000 + b"}")
        assert big.status_code == 413
        assert big.json()["error"]["code"] == "request_too_large"
        bad = await http.post(f"{gw.base_url}/chat/completions", content=b"{not json")
        assert bad.status_code == 400
        assert bad.json()["error"]["code"] == "invalid_json"
        nope = await http.get(f"{gw.base_url}/no/such/route")
        assert nope.status_code == 404
        assert "error" in nope.json()


def attrs_evolve_limits(**changes: Any) -> Any:
    import attrs

    from triton_npu_client._gateway import Limits

    return attrs.evolve(Limits(), **changes)


# --- keys ------------------------------------------------------------------------------------------------------


async def test_missing_and_wrong_keys_are_401_and_another_keys_response_is_404(client: Client) -> None:
    options = GatewayOptions(api_keys=("key-a", "key-b"))
    async with OpenAIGateway(client, port=0, options=options) as gw:
        async with httpx.AsyncClient() as http:
            missing = await http.get(f"{gw.base_url}/models")
            assert missing.status_code == 401
            assert missing.json()["error"]["code"] == "missing_api_key"
            wrong = await http.get(f"{gw.base_url}/models", headers={"Authorization": "Bearer key-c"})
            assert wrong.status_code == 401
            assert "key-c" not in wrong.text
            assert (await http.get(f"{gw.url}/metrics")).status_code == 200  # no key: counts only
        a = AsyncOpenAI(base_url=gw.base_url, api_key="key-a", max_retries=0)
        b = AsyncOpenAI(base_url=gw.base_url, api_key="key-b", max_retries=0)
        first = await a.responses.create(model="chat", input="hello", max_output_tokens=2, **GREEDY)
        assert (await a.responses.retrieve(first.id)).id == first.id
        with pytest.raises(openai.NotFoundError):
            await b.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            await b.responses.create(model="chat", input="more", previous_response_id=first.id, max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            await b.responses.delete(first.id)
        await a.responses.delete(first.id)
        await a.close()
        await b.close()


# --- Responses chains ----------------------------------------------------------------------------------------


async def test_a_chain_of_five_turns_equals_its_stateless_twin_and_prefills_only_its_new_message(
    oa: AsyncOpenAI, client: Client
) -> None:
    live_before = await probe(client)
    said: list[tuple[str, str]] = [("system", "You are terse.")]
    previous: str | None = None
    ids = []
    for i, question in enumerate(QUESTIONS[:5]):
        r = await oa.responses.create(
            model="chat", input=question, instructions="You are terse." if i == 0 else None,
            previous_response_id=previous, max_output_tokens=TOKENS, **GREEDY,
        )  # fmt: skip
        said.append(("user", question))
        assert r.output_text == await twin(oa, history(*said)), f"turn {i + 1}"
        said.append(("assistant", r.output_text))
        assert r.usage is not None
        if i > 0:
            # Only the new message (and the turn's template tokens) is computed: the history is on the server.
            prefilled = r.usage.input_tokens - r.usage.input_tokens_details.cached_tokens
            assert prefilled <= 16 < r.usage.input_tokens, r.usage
        assert r.previous_response_id == previous
        previous = r.id
        ids.append(r.id)
    items = await oa.responses.input_items.list(ids[2])
    assert [i.content[0].text for i in items.data] == [QUESTIONS[2]]  # type: ignore[union-attr]
    assert (await oa.responses.retrieve(ids[4])).output_text == said[-1][1]
    for response_id in ids:
        await oa.responses.delete(response_id)
    with pytest.raises(openai.NotFoundError):
        await oa.responses.retrieve(ids[0])
    assert await probe(client) == live_before  # the chain's conversation was ended with its head


async def test_naming_an_older_response_forks_and_both_branches_go_on(oa: AsyncOpenAI) -> None:
    r1 = await oa.responses.create(model="chat", input=QUESTIONS[0], max_output_tokens=TOKENS, **GREEDY)
    r2 = await oa.responses.create(
        model="chat", input=QUESTIONS[1], previous_response_id=r1.id, max_output_tokens=TOKENS, **GREEDY
    )
    fork = await oa.responses.create(
        model="chat", input=QUESTIONS[2], previous_response_id=r1.id, max_output_tokens=TOKENS, **GREEDY
    )
    base = [("user", QUESTIONS[0]), ("assistant", r1.output_text)]
    assert fork.output_text == await twin(oa, history(*base, ("user", QUESTIONS[2])))
    # The fork replayed r1's history: its full blocks were shared with the live chain, so they count as cached.
    assert fork.usage is not None
    assert fork.usage.input_tokens_details.cached_tokens > 0
    r3 = await oa.responses.create(
        model="chat", input=QUESTIONS[3], previous_response_id=r2.id, max_output_tokens=TOKENS, **GREEDY
    )
    main = [*base, ("user", QUESTIONS[1]), ("assistant", r2.output_text), ("user", QUESTIONS[3])]
    assert r3.output_text == await twin(oa, history(*main))
    for r in (r1, r2, fork, r3):
        await oa.responses.delete(r.id)


async def test_store_false_keeps_nothing(oa: AsyncOpenAI, client: Client) -> None:
    live_before = await probe(client)
    r = await oa.responses.create(model="chat", input="hello", store=False, max_output_tokens=TOKENS, **GREEDY)
    assert r.output_text == await twin(oa, history(("user", "hello")))
    with pytest.raises(openai.NotFoundError):
        await oa.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        await oa.responses.create(model="chat", input="more", previous_response_id=r.id)
    assert await probe(client) == live_before


async def test_a_streamed_turn_sends_the_responses_events_in_order(oa: AsyncOpenAI) -> None:
    r1 = await oa.responses.create(model="chat", input=QUESTIONS[0], max_output_tokens=TOKENS, **GREEDY)
    stream = await oa.responses.create(
        model="chat", input=QUESTIONS[1], previous_response_id=r1.id, max_output_tokens=TOKENS, stream=True, **GREEDY
    )
    kinds, deltas, final = [], [], None
    async for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.incomplete"
    ]  # fmt: skip
    assert final is not None
    assert final.output_text == "".join(deltas)
    assert final.incomplete_details is not None
    assert final.incomplete_details.reason == "max_output_tokens"
    twin_text = await twin(oa, history(("user", QUESTIONS[0]), ("assistant", r1.output_text), ("user", QUESTIONS[1])))
    assert final.output_text == twin_text
    stored = await oa.responses.retrieve(final.id)
    assert stored.output_text == final.output_text


async def test_conversations_carry_the_history_between_responses(oa: AsyncOpenAI) -> None:
    conv = await oa.conversations.create(items=[{"type": "message", "role": "system", "content": "Be brief."}])
    r1 = await oa.responses.create(model="chat", input=QUESTIONS[0], conversation=conv.id, max_output_tokens=TOKENS,
                                   **GREEDY)  # fmt: skip
    r2 = await oa.responses.create(model="chat", input=QUESTIONS[1], conversation=conv.id, max_output_tokens=TOKENS,
                                   **GREEDY)  # fmt: skip
    said = [("system", "Be brief."), ("user", QUESTIONS[0]), ("assistant", r1.output_text), ("user", QUESTIONS[1])]
    assert r2.output_text == await twin(oa, history(*said))
    assert r2.usage is not None
    assert r2.usage.input_tokens - r2.usage.input_tokens_details.cached_tokens <= 16
    assert (await oa.conversations.retrieve(conv.id)).id == conv.id
    with pytest.raises(openai.BadRequestError):
        await oa.responses.create(model="chat", input="x", conversation=conv.id, previous_response_id=r1.id)
    await oa.conversations.delete(conv.id)
    with pytest.raises(openai.NotFoundError):
        await oa.responses.create(model="chat", input="x", conversation=conv.id)
    for r in (r1, r2):
        await oa.responses.delete(r.id)


# --- isolation: disconnects, busy chains, capacity, slow readers ---------------------------------------------


class _Open:
    """A streamed request left open once its first text arrived: its response and the rest of its lines."""

    def __init__(self, response: httpx.Response, lines: AsyncIterator[str]) -> None:
        self.response = response
        self.lines = lines

    async def rest(self) -> list[str]:
        return [line async for line in self.lines]

    async def aclose(self) -> None:
        await self.response.aclose()


async def _stream_until_first_delta(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> _Open:
    request = http.build_request("POST", url, json={**body, "stream": True})
    response = await http.send(request, stream=True)
    assert response.status_code == 200, await response.aread()
    lines = response.aiter_lines()
    async for line in lines:
        if "output_text.delta" in line or ('"content":"' in line and "chat.completion.chunk" in line):
            return _Open(response, lines)
    raise AssertionError("the stream ended before any text")


async def _settled(gateway: OpenAIGateway) -> None:
    """Until the gateway has finished cleaning up after a request whose client left (no event to await)."""
    state = gateway.app.state.gateway
    for _ in range(2000):
        if state.chains.claimed == 0 and state._turns == 0 and not state._closing:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the gateway did not settle")


async def test_a_client_that_disconnects_mid_stream_rolls_its_turn_back(
    gateway: OpenAIGateway, oa: AsyncOpenAI, client: Client
) -> None:
    live_before = await probe(client)
    r1 = await oa.responses.create(model="chat", input=QUESTIONS[0], max_output_tokens=TOKENS, **GREEDY)
    async with httpx.AsyncClient() as http:
        body = {"model": "chat", "input": QUESTIONS[1], "previous_response_id": r1.id, "max_output_tokens": 200}
        response = await _stream_until_first_delta(http, f"{gateway.base_url}/responses", body)
        await response.aclose()  # the client goes away mid-reply
    await _settled(gateway)
    # The chain is still at r1: the cancelled turn is not in its history, and it goes on live.
    r2 = await oa.responses.create(
        model="chat", input=QUESTIONS[2], previous_response_id=r1.id, max_output_tokens=TOKENS, **GREEDY
    )
    said = [("user", QUESTIONS[0]), ("assistant", r1.output_text), ("user", QUESTIONS[2])]
    assert r2.output_text == await twin(oa, history(*said))
    assert r2.usage is not None
    assert r2.usage.input_tokens - r2.usage.input_tokens_details.cached_tokens <= 16
    async with httpx.AsyncClient() as http:
        body = {"model": "chat", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 200}
        response = await _stream_until_first_delta(http, f"{gateway.base_url}/chat/completions", body)
        await response.aclose()
    await _settled(gateway)
    for r in (r1, r2):
        await oa.responses.delete(r.id)
    assert await probe(client) == live_before


async def test_a_second_turn_on_a_running_chain_is_409_and_a_slow_reader_stalls_no_one(
    gateway: OpenAIGateway, oa: AsyncOpenAI
) -> None:
    r1 = await oa.responses.create(model="chat", input=QUESTIONS[0], max_output_tokens=TOKENS, **GREEDY)
    async with httpx.AsyncClient() as http:
        body = {"model": "chat", "input": QUESTIONS[1], "previous_response_id": r1.id, "max_output_tokens": 64}
        slow = await _stream_until_first_delta(http, f"{gateway.base_url}/responses", body)
        with pytest.raises(openai.ConflictError):
            await oa.responses.create(model="chat", input="x", previous_response_id=r1.id, max_output_tokens=2)
        # While the slow reader reads nothing more, other conversations are served whole.
        other = await oa.responses.create(model="chat", input=QUESTIONS[3], max_output_tokens=TOKENS, **GREEDY)
        assert other.output_text == await twin(oa, history(("user", QUESTIONS[3])))
        rest = await slow.rest()
        await slow.aclose()
    assert any("response.incomplete" in line or "response.completed" in line for line in rest)
    for r in (r1, other):
        await oa.responses.delete(r.id)


async def test_at_capacity_a_turn_is_429_with_retry_after(client: Client) -> None:
    async with OpenAIGateway(client, port=0, options=GatewayOptions(max_turns=1)) as gw, httpx.AsyncClient() as http:
        body = {"model": "chat", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 64}
        running = await _stream_until_first_delta(http, f"{gw.base_url}/chat/completions", body)
        refused = await http.post(f"{gw.base_url}/responses", json={"model": "chat", "input": "x"})
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        await running.aclose()
        await _settled(gw)
        ok = await http.post(f"{gw.base_url}/responses", json={"model": "chat", "input": "x", "max_output_tokens": 1})
        assert ok.status_code == 200


async def test_a_turn_past_its_deadline_is_504_and_the_chain_goes_on(client: Client) -> None:
    async with OpenAIGateway(client, port=0, options=GatewayOptions(timeout_s=0.05)) as gw:
        oa = AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
        # A reply that cannot end early: the demo may end a free reply within 50 ms on a quiet machine, but this
        # format needs at least 300 numbers.
        long_reply = {"type": "json_schema", "json_schema": {"name": "many", "strict": True, "schema": {
            "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 300}}}
        with pytest.raises(openai.APIStatusError) as late:
            await oa.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": "go on"}], max_tokens=2000,
                response_format=long_reply, **GREEDY,  # type: ignore[arg-type]
            )
        assert late.value.status_code == 504
        await oa.close()


async def test_metrics_count_requests_tokens_and_first_tokens(gateway: OpenAIGateway, oa: AsyncOpenAI) -> None:
    await oa.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=3, **GREEDY)
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{gateway.url}/metrics")).text
    assert 'tnc_openai_requests_total{endpoint="/v1/chat/completions",status="200"} 1.0' in text
    assert 'tnc_openai_tokens_total{endpoint="/v1/chat/completions",kind="completion"} 3.0' in text
    assert 'tnc_openai_time_to_first_token_seconds_count{endpoint="/v1/chat/completions"} 1.0' in text


# --- state beyond one gateway: restarts, dead replicas ---------------------------------------------------------


async def test_a_gateway_restart_in_the_middle_of_a_chain_resumes_it(
    client: Client, triton_server: LocalTriton, tmp_path: Path
) -> None:
    path = tmp_path / "responses.sqlite3"
    options = GatewayOptions(detach_on_close=True)
    async with OpenAIGateway(client, port=0, store=await SQLiteStore.open(path), options=options) as gw:
        oa = AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
        r1 = await oa.responses.create(model="chat", input=QUESTIONS[0], max_output_tokens=TOKENS, **GREEDY)
        r2 = await oa.responses.create(
            model="chat", input=QUESTIONS[1], previous_response_id=r1.id, max_output_tokens=TOKENS, **GREEDY
        )
        await oa.close()
    # A new process would have a new client: so does this gateway.
    async with (
        Client(triton_server.grpc_url, timeout_s=120) as fresh,
        OpenAIGateway(fresh, port=0, store=await SQLiteStore.open(path), options=options) as gw,
    ):
        oa = AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
        r3 = await oa.responses.create(
            model="chat", input=QUESTIONS[2], previous_response_id=r2.id, max_output_tokens=TOKENS, **GREEDY
        )
        said = [("user", QUESTIONS[0]), ("assistant", r1.output_text), ("user", QUESTIONS[1]),
                ("assistant", r2.output_text), ("user", QUESTIONS[2])]  # fmt: skip
        assert r3.output_text == await twin(oa, history(*said))
        # Resumed on the sequence the first gateway left on the server: only the new message was prefilled.
        assert r3.usage is not None
        assert r3.usage.input_tokens - r3.usage.input_tokens_details.cached_tokens <= 16
        assert (await oa.responses.retrieve(r1.id)).output_text == r1.output_text
        for r in (r1, r2, r3):
            await oa.responses.delete(r.id)
        await oa.close()


def _chat_server() -> LocalTriton:
    return LocalTriton(model_control_mode="explicit", load_models=["chat"], stop_grace_s=0)


@pytest.fixture
def two_replicas() -> Iterator[list[LocalTriton]]:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        servers = list(pool.map(lambda _: _chat_server().start(), range(2)))
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()
            assert server.processes() == []


@pytest.mark.slow
async def test_a_replica_killed_under_a_chain_is_replayed_on_the_other(two_replicas: list[LocalTriton]) -> None:
    urls = [s.grpc_url for s in two_replicas]
    async with Client(urls, timeout_s=120) as fleet, OpenAIGateway(fleet, port=0) as gw:
        oa = AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
        r1 = await oa.responses.create(model="chat", input=QUESTIONS[0], max_output_tokens=TOKENS, **GREEDY)
        r2 = await oa.responses.create(
            model="chat", input=QUESTIONS[1], previous_response_id=r1.id, max_output_tokens=TOKENS, **GREEDY
        )
        chat = gw.app.state.gateway.chains._live[r2.id][0]
        holder = await fleet.replica_for("chat", chat.sequence_id)
        victim = next(s for s in two_replicas if s.grpc_url == holder)
        victim.kill()
        r3 = await oa.responses.create(
            model="chat", input=QUESTIONS[2], previous_response_id=r2.id, max_output_tokens=TOKENS, **GREEDY
        )
        said = [("user", QUESTIONS[0]), ("assistant", r1.output_text), ("user", QUESTIONS[1]),
                ("assistant", r2.output_text), ("user", QUESTIONS[2])]  # fmt: skip
        assert r3.output_text == await twin(oa, history(*said))
        assert await fleet.replica_for("chat", gw.app.state.gateway.chains._live[r3.id][0].sequence_id) != holder
        await oa.close()


# --- the command line ----------------------------------------------------------------------------------------


def _cli(*args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "triton_npu_client", "openai", *args], capture_output=True, text=True, timeout=60,
        **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--port", "70000"], "--port: expected 0..65535"),
        (["--api-key", "two words"], "--api-key"),
        (["--api-key-env", "TNC_NO_SUCH_VARIABLE"], "--api-key-env TNC_NO_SUCH_VARIABLE"),
        (["--max-turns", "0"], "--max-turns"),
        (["--url", "grpc://127.0.0.1:1", "--checkpoint", "/nonexistent"], "--checkpoint"),
    ],
)
def test_cli_mistakes_are_one_line_before_any_server(args: list[str], words: str) -> None:
    done = _cli(*args, "--store", "memory")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert words in lines[0]
    assert "starting tritonserver" not in done.stdout


def test_cli_refuses_a_store_file_it_did_not_make_and_leaves_it_intact(tmp_path: Path) -> None:
    precious = tmp_path / "notes.txt"
    precious.write_bytes(b"my notes, not a database\n" * 10)
    digest = hashlib.sha256(precious.read_bytes()).hexdigest()
    done = _cli("--store", str(precious))
    assert done.returncode == 2
    assert str(precious) in done.stderr
    assert hashlib.sha256(precious.read_bytes()).hexdigest() == digest
    assert "starting tritonserver" not in done.stdout


def test_cli_serves_a_running_server_and_stops_on_ctrl_c(triton_server: LocalTriton, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    store = tmp_path / "r.sqlite3"
    with subprocess.Popen(
        [sys.executable, "-m", "triton_npu_client", "openai", "--url", triton_server.grpc_url, "--port", "0",
         "--store", str(store), "--api-key-env", "TNC_TEST_KEY"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**env, "TNC_TEST_KEY": "sekret"},
    ) as proc:  # fmt: skip
        try:
            assert proc.stdout is not None
            first = proc.stdout.readline()
            assert first.startswith("OpenAI API on http://127.0.0.1:"), first
            base = first.split()[-1]
            r = httpx.post(f"{base}/embeddings", json={"model": "minilm", "input": "hello"},
                           headers={"Authorization": "Bearer sekret"}, timeout=60)  # fmt: skip
            assert r.status_code == 200
            assert len(r.json()["data"][0]["embedding"]) == 384
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 130, err
    assert "sekret" not in out + err
    assert store.exists()


# --- traces ----------------------------------------------------------------------------------------------------


async def test_a_request_is_a_span_in_the_callers_trace_with_the_chat_turn_under_it(gateway: OpenAIGateway) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from triton_npu_client import _trace as trace_module

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace_module.use_tracer_provider(provider)
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    try:
        async with httpx.AsyncClient() as http:
            r = await http.post(
                f"{gateway.base_url}/chat/completions",
                json={"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
            )
        assert r.status_code == 200
    finally:
        trace_module.use_tracer_provider(None)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    request, turn = spans["openai.chat.completions"], spans["triton.chat.turn"]
    assert request.context is not None
    assert turn.parent is not None
    assert f"{request.context.trace_id:032x}" == trace_id  # joined the caller's trace
    assert turn.parent.span_id == request.context.span_id  # the SDK's turn hangs under the request


# --- the server's own limits (chat_small: two conversation slots, the idle one evicted at once) -----------------


async def test_at_the_servers_conversation_cap_a_turn_is_503_with_retry_after(
    gateway: OpenAIGateway, client: Client
) -> None:
    # Both slots held by replies that cannot end soon (MIN_TOKENS): a generating conversation is never evicted.
    held = [client.chat("chat_small", min_tokens=1200, max_tokens=1200) for _ in range(2)]
    streams = [chat.send("go on") for chat in held]
    for stream in streams:
        await anext(stream)
    try:
        async with httpx.AsyncClient() as http:
            refused = await http.post(
                f"{gateway.base_url}/chat/completions",
                json={"model": "chat_small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            )
    finally:
        for stream, chat in zip(streams, held, strict=True):
            await stream.aclose()
            await chat.aclose()
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "server_at_capacity"
    await _settled(gateway)


async def test_a_chain_whose_conversation_the_server_evicted_is_replayed_exactly(oa: AsyncOpenAI) -> None:
    args: dict[str, Any] = {"model": "chat_small", "max_output_tokens": TOKENS, **GREEDY}
    r1 = await oa.responses.create(input=QUESTIONS[0], **args)
    # Two other conversations take both slots; r1's, idle longest, is evicted for them.
    others = [await oa.responses.create(input=q, **args) for q in QUESTIONS[3:5]]
    r2 = await oa.responses.create(input=QUESTIONS[1], previous_response_id=r1.id, **args)
    said = [("user", QUESTIONS[0]), ("assistant", r1.output_text), ("user", QUESTIONS[1])]
    expected = await oa.chat.completions.create(
        model="chat_small",
        messages=history(*said),
        max_tokens=TOKENS,
        **GREEDY,  # type: ignore[arg-type]
    )
    assert r2.output_text == expected.choices[0].message.content
    r3 = await oa.responses.create(input=QUESTIONS[2], previous_response_id=r2.id, **args)  # live again
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{oa.base_url}".replace("/v1/", "/metrics"))).text
    assert 'tnc_openai_replays_total{why="lost"} 1.0' in text  # r2's replay, not r3's live turn
    for r in (r1, r2, r3, *others):
        await oa.responses.delete(r.id)


async def test_at_the_servers_cap_the_gateway_closes_its_oldest_open_chain_to_make_room(
    oa: AsyncOpenAI, client: Client
) -> None:
    live, _ = await probe(client)
    cap = 64  # the chat model's max_sequences; its evict_min_idle_ms (60 s) keeps idle conversations that long
    args: dict[str, Any] = {"model": "chat", "max_output_tokens": 1, **GREEDY}
    gate = asyncio.Semaphore(8)

    async def chain(i: int) -> str:
        async with gate:
            return (await oa.responses.create(input=f"chain {i}", **args)).id

    heads = await asyncio.gather(*(chain(i) for i in range(cap - live)))  # every slot taken
    first = await oa.responses.retrieve(heads[0])
    newest = await oa.responses.create(input="one more user", **args)  # refused at the cap, then given room
    assert newest.status == "incomplete"  # one token: the cap of max_output_tokens
    # The oldest chain was the one closed: its next turn replays it, exactly (and makes room again).
    oldest = await oa.responses.create(input="and you?", previous_response_id=heads[0], **args)
    said = history(("user", "chain 0"), ("assistant", first.output_text), ("user", "and you?"))
    assert oldest.output_text == await twin(oa, said, 1)  # the twin, too, is given room
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{str(oa.base_url).removesuffix('/v1/')}/metrics")).text
    assert "tnc_openai_chains_closed_for_room_total 3.0" in text
    assert 'tnc_openai_replays_total{why="not_live"} 1.0' in text
    for response_id in (*heads, newest.id, oldest.id):
        await oa.responses.delete(response_id)
    assert (await probe(client))[0] == live


async def test_another_keys_delete_of_a_busy_response_is_404_and_leaves_the_owner_alone(client: Client) -> None:
    options = GatewayOptions(api_keys=("key-a", "key-b"))
    async with OpenAIGateway(client, port=0, options=options) as gw, httpx.AsyncClient() as http:
        a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
        r1 = (await http.post(f"{gw.base_url}/responses", headers=a,
                              json={"model": "chat", "input": "hi", "max_output_tokens": 2})).json()  # fmt: skip
        body = {"model": "chat", "input": "go on", "previous_response_id": r1["id"], "max_output_tokens": 64}
        http.headers.update(a)
        running = await _stream_until_first_delta(http, f"{gw.base_url}/responses", body)
        foreign = await http.delete(f"{gw.base_url}/responses/{r1['id']}", headers=b)
        own = await http.delete(f"{gw.base_url}/responses/{r1['id']}", headers=a)
        await running.aclose()
        await _settled(gw)
    assert foreign.status_code == 404  # indistinguishable from an unknown id, busy or not
    assert own.status_code == 409  # the owner is told it is busy


class _GatedStore(MemoryStore):
    """A store whose forget_chat_state waits for the test: a commit held open at will."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    async def forget_chat_state(self, id: str, /) -> bool:
        self.entered.set()
        await self.gate.wait()
        return await super().forget_chat_state(id)


async def test_a_client_that_leaves_while_its_finished_turn_is_stored_still_gets_it_stored(client: Client) -> None:
    store = _GatedStore()
    async with OpenAIGateway(client, port=0, store=store) as gw, httpx.AsyncClient() as http:
        oa = AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0)
        store.gate.set()
        r1 = await oa.responses.create(model="chat", input=QUESTIONS[0], max_output_tokens=TOKENS, **GREEDY)
        store.gate.clear()
        body = {"model": "chat", "input": QUESTIONS[1], "previous_response_id": r1.id, "max_output_tokens": TOKENS,
                "temperature": 0}  # fmt: skip
        payload = json.dumps(body).encode()
        _, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(
            b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        await writer.drain()
        await store.entered.wait()  # the reply is complete on the server; the gateway is storing it
        writer.close()  # the client goes away now
        await writer.wait_closed()
        metrics = f"{gw.url}/metrics"
        for _ in range(2000):  # until the gateway has seen it leave (no event to await)
            if 'endpoint="/v1/responses",status="499"' in (await http.get(metrics)).text:
                break
            await asyncio.sleep(0.005)
        else:
            raise AssertionError("the gateway never saw the client leave")
        store.gate.set()
        await _settled(gw)
        # The turn was not rolled back: it was stored, and r1 is no longer its sequence's head, so naming r1
        # again forks from r1's own history (the left turn is not in it).
        r2 = await oa.responses.create(
            model="chat", input=QUESTIONS[2], previous_response_id=r1.id, max_output_tokens=TOKENS, **GREEDY
        )
        said = [("user", QUESTIONS[0]), ("assistant", r1.output_text), ("user", QUESTIONS[2])]
        expected = await oa.chat.completions.create(model="chat", messages=history(*said), max_tokens=TOKENS, **GREEDY)  # type: ignore[arg-type]
        assert r2.output_text == expected.choices[0].message.content
        assert r2.usage is not None
        assert expected.usage is not None
        assert r2.usage.input_tokens == expected.usage.prompt_tokens
        await oa.close()
