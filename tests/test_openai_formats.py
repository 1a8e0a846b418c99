"""Structured outputs, penalties and the output cap through the gateway, driven by the real ``openai`` client.

``chat.completions.parse`` and ``responses.parse`` (a pydantic model turned into a strict JSON schema by the openai
package), ``response_format`` ``json_object`` / ``json_schema`` and Responses' ``text.format``, against the demo
chat model, whose free text is near gibberish: a reply that validates does so because the server constrained it.
"""

from __future__ import annotations

import json
from typing import Any

import httpx2 as httpx
import jsonschema
import openai
import pytest
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

from triton_npu_client._gateway import OpenAIGateway


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=99)


#: At least 12 people: a reply far longer than the engine's default cap of 64 tokens.
CROWD: dict[str, Any] = {
    "type": "array",
    "items": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False},
    "minItems": 12, "maxItems": 12,
}  # fmt: skip


# The fixtures client, gateway (an embedded OpenAIGateway) and oa (AsyncOpenAI on it) are conftest.py's.


async def test_chat_completions_parse_gives_a_valid_object(oa: AsyncOpenAI) -> None:
    for seed in range(4):
        done = await oa.chat.completions.parse(
            model="chat", messages=[{"role": "user", "content": "Who is she?"}], response_format=Person,
            temperature=1.0, seed=seed, max_tokens=80,
        )  # fmt: skip
        message = done.choices[0].message
        assert isinstance(message.parsed, Person)
        assert done.choices[0].finish_reason == "stop"


async def test_responses_parse_and_text_format_echo(oa: AsyncOpenAI) -> None:
    done = await oa.responses.parse(model="chat", input="Who is she?", text_format=Person, max_output_tokens=80)
    assert isinstance(done.output_parsed, Person)
    assert done.text.format is not None
    assert done.text.format.type == "json_schema"
    plain = await oa.responses.create(model="chat", input="Hello?", max_output_tokens=4)
    assert plain.text.format is not None
    assert plain.text.format.type == "text"


async def test_json_object_and_a_streamed_json_schema(oa: AsyncOpenAI) -> None:
    done = await oa.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "Tell me."}], max_tokens=40,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert (done.choices[0].message.content or "").startswith("{")
    stream = await oa.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "Count."}], stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "crowd", "schema": CROWD, "strict": True}},
    )  # fmt: skip
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    jsonschema.validate(json.loads(text), CROWD)


async def test_no_cap_given_is_no_cap_and_the_response_says_so(oa: AsyncOpenAI) -> None:
    """A reply the constraint makes longer than the engine's default cap (64 tokens) runs to its end: completed,
    max_output_tokens null; a cap given is the one shown, and a reply cut by it is incomplete."""
    fmt = {"format": {"type": "json_schema", "name": "crowd", "schema": CROWD, "strict": True}}
    done = await oa.responses.create(model="chat", input="Count them.", text=fmt)  # type: ignore[arg-type]
    assert done.status == "completed"
    assert done.max_output_tokens is None
    assert done.usage is not None
    assert done.usage.output_tokens > 64
    jsonschema.validate(json.loads(done.output_text), CROWD)
    cut = await oa.responses.create(model="chat", input="Count them.", text=fmt, max_output_tokens=10)  # type: ignore[arg-type]
    assert cut.status == "incomplete"
    assert cut.max_output_tokens == 10
    assert cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"


async def test_penalties_reach_the_model(oa: AsyncOpenAI) -> None:
    """presence_penalty and frequency_penalty (and vLLM's repetition_penalty as an extra body field) are taken and
    change a greedy reply; out of range they are a 400 naming them."""
    ask: dict[str, Any] = {"model": "chat", "messages": [{"role": "user", "content": "Tell me about the garden."}],
                           "max_tokens": 24, "temperature": 0}
    plain = await oa.chat.completions.create(**ask)
    penalised = await oa.chat.completions.create(**ask, presence_penalty=2.0, frequency_penalty=2.0,
                                                 extra_body={"repetition_penalty": 1.5})
    again = await oa.chat.completions.create(**ask, presence_penalty=2.0, frequency_penalty=2.0,
                                             extra_body={"repetition_penalty": 1.5})
    assert penalised.choices[0].message.content != plain.choices[0].message.content
    assert penalised.choices[0].message.content == again.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as err:
        await oa.chat.completions.create(**ask, presence_penalty=3)
    assert err.value.body["param"] == "presence_penalty"  # type: ignore[index]


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
        ({"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
        ({"response_format": "json"}, "response_format", "object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wibble"}}}},
         None, "does not compile"),
    ],
)
async def test_a_bad_format_is_a_400_and_harms_nothing(
    gateway: OpenAIGateway, oa: AsyncOpenAI, extra: dict[str, Any], param: str | None, words: str
) -> None:
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    async with httpx.AsyncClient() as http:
        r = await http.post(f"{gateway.base_url}/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    if param is not None:
        assert error["param"] == param
    assert words in error["message"]
    ok = await oa.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert ok.usage is not None
    assert ok.usage.completion_tokens > 0


async def test_chat_logprobs_whole_and_streamed(oa: AsyncOpenAI) -> None:
    ask: dict[str, Any] = {"model": "chat", "messages": [{"role": "user", "content": "Where?"}], "max_tokens": 8,
                           "temperature": 0, "logprobs": True, "top_logprobs": 3}
    done = await oa.chat.completions.create(**ask)
    choice = done.choices[0]
    assert choice.logprobs is not None
    assert choice.logprobs.content is not None
    content = choice.logprobs.content
    assert done.usage is not None
    assert len(content) == done.usage.completion_tokens
    assert b"".join(bytes(t.bytes or []) for t in content).decode() == choice.message.content
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token for t in content)  # greedy: the best
    stream = await oa.chat.completions.create(**ask, stream=True)
    streamed = [t async for c in stream if c.choices and c.choices[0].logprobs
                for t in (c.choices[0].logprobs.content or [])]  # fmt: skip
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(t.token, round(t.logprob, 4)) for t in content]
    plain = await oa.chat.completions.create(**{**ask, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


async def test_responses_logprobs_with_include(oa: AsyncOpenAI) -> None:
    done = await oa.responses.create(model="chat", input="Where?", max_output_tokens=6, temperature=0,
                                     include=["message.output_text.logprobs"], top_logprobs=2)
    part = done.output[0].content[0]  # type: ignore[union-attr]
    assert part.type == "output_text"
    assert part.logprobs
    assert "".join(t.token for t in part.logprobs) == part.text
    assert all(len(t.top_logprobs) == 2 for t in part.logprobs)
    # Without include the part carries an empty list, as OpenAI's do.
    bare = await oa.responses.create(model="chat", input="Where?", max_output_tokens=3)
    assert bare.output[0].content[0].logprobs == []  # type: ignore[union-attr]


async def test_n_choices_each_equal_their_own_request_whole_and_streamed(oa: AsyncOpenAI) -> None:
    """n = 3, sampled with a seed: choice i is the reply a request of its own with seed + i gets; streamed, each
    index's deltas join to the same texts; usage counts the prompt once and every choice's tokens."""
    ask: dict[str, Any] = {"model": "chat", "messages": [{"role": "user", "content": "Where is the house?"}],
                           "max_tokens": 10, "temperature": 1.0}
    done = await oa.chat.completions.create(**ask, n=3, seed=40)
    texts = [c.message.content for c in sorted(done.choices, key=lambda c: c.index)]
    assert [c.index for c in done.choices] == [0, 1, 2]
    alone = [(await oa.chat.completions.create(**ask, seed=40 + i)).choices[0].message.content for i in range(3)]
    assert texts == alone
    assert len(set(texts)) > 1  # the seeds differ, so (almost surely) do the replies
    single = await oa.chat.completions.create(**ask, seed=40)
    assert done.usage is not None
    assert single.usage is not None
    assert done.usage.prompt_tokens == single.usage.prompt_tokens
    stream = await oa.chat.completions.create(**ask, n=3, seed=40, stream=True, stream_options={"include_usage": True})
    parts: dict[int, str] = {0: "", 1: "", 2: ""}
    finishes = 0
    usage = None
    async for c in stream:
        usage = c.usage or usage
        for choice in c.choices:
            parts[choice.index] += choice.delta.content or ""
            finishes += choice.finish_reason is not None
    assert [parts[i] for i in range(3)] == texts
    assert finishes == 3
    assert usage is not None
    assert usage.completion_tokens == done.usage.completion_tokens


# --- issue 30's friction list: what clients send by default ------------------------------------------------------


async def test_parallel_tool_calls_without_tools_asks_for_nothing(oa: AsyncOpenAI) -> None:
    """LangChain and openai-agents send parallel_tool_calls=True with no tools: taken on both APIs."""
    done = await oa.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                            parallel_tool_calls=True)
    assert done.usage is not None
    assert done.usage.completion_tokens > 0
    r = await oa.responses.create(model="chat", input="hi", max_output_tokens=3, parallel_tool_calls=True)
    assert r.status in ("completed", "incomplete")


async def test_responses_stream_options_include_usage(oa: AsyncOpenAI) -> None:
    """AIPerf sends stream_options.include_usage on Responses: the stream's response.completed carries usage."""
    stream = await oa.responses.create(model="chat", input="hi", max_output_tokens=3, stream=True,
                                       stream_options={"include_usage": True})  # type: ignore[call-overload]
    final = [e async for e in stream if e.type in ("response.completed", "response.incomplete")]
    assert len(final) == 1
    assert final[0].response.usage is not None
    assert final[0].response.usage.output_tokens > 0
    with pytest.raises(openai.BadRequestError) as err:
        await oa.responses.create(model="chat", input="hi", stream=True,
                                  stream_options={"include_usage": True, "wibble": 1})  # type: ignore[call-overload]
    assert err.value.body["param"] == "stream_options"  # type: ignore[index]


async def test_every_output_item_goes_back_as_input(oa: AsyncOpenAI) -> None:
    """A client that replays its history sends the output items it got (output_text parts with annotations and
    logprobs, ids and statuses): taken as they are, the next turn answers, and equals its stateless twin."""
    first = await oa.responses.create(model="chat", input="Where is the house?", max_output_tokens=6, temperature=0,
                                      include=["message.output_text.logprobs"], top_logprobs=1)
    replay = [{"role": "user", "content": "Where is the house?"},
              *[item.model_dump(exclude_none=True) for item in first.output],
              {"role": "user", "content": "Who lives there?"}]  # fmt: skip
    assert replay[1]["content"][0]["logprobs"]  # the part carries its logprobs
    second = await oa.responses.create(model="chat", input=replay, max_output_tokens=6, temperature=0)  # type: ignore[arg-type]
    twin = await oa.chat.completions.create(model="chat", max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": "Where is the house?"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Who lives there?"}])  # fmt: skip
    assert second.output_text == twin.choices[0].message.content


async def test_a_body_nested_past_what_json_reads_is_a_400(gateway: OpenAIGateway, oa: AsyncOpenAI) -> None:
    """A hostile body nested 100,000 deep (well under the body cap) is not JSON here: a 400, and the gateway goes on."""
    body = b'{"model": "chat", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    async with httpx.AsyncClient() as http:
        r = await http.post(f"{gateway.base_url}/chat/completions", content=body,
                            headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_json"
    ok = await oa.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert ok.usage is not None
    assert ok.usage.completion_tokens > 0
