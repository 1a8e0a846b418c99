"""Tool calling through the gateway (issue 30, items 5 and 6 for tools): Chat Completions ``tools`` / ``tool_calls``
and Responses ``function_call`` / ``function_call_output`` items, through the real clients (openai, LangChain,
openai-agents, LiteLLM, at the versions constraints.txt pins), against the packaged demo model and a real Triton.

The demo model writes gibberish when free, so it calls a tool only when ``tool_choice`` forces one (``required`` or
a named function); the server then constrains the reply to a call valid for the function's schema, which every test
checks with jsonschema. The tools' arguments are enums and small integers: the tests are about calls, not strings.
The turn after a tool result continues on the device: its ``cached_tokens`` are the whole earlier conversation.

First the request readers (no server): what each shape becomes, and the 400 naming the field for each fault.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import httpx2 as httpx
import jsonschema  # type: ignore[import-untyped]
import openai
import pytest
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

# The clients' tests' guard (nothing beyond loopback, tracing and telemetry off) and their fixtures.
from test_openai_clients import http_client, litellm, offline, replays  # noqa: F401

from triton_npu_client import Client, LocalTriton
from triton_npu_client._gateway import GatewayOptions, OpenAIGateway, SQLiteStore
from triton_npu_client._gateway._errors import APIError
from triton_npu_client._gateway._schema import (
    Limits,
    chat_request,
    conversation_items_request,
    response_request,
)
from triton_npu_client._gateway._tools import from_records, history_key, records

# Before the libraries are imported: openai-agents reads it when its trace provider is made.
os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"

import agents
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_openai import ChatOpenAI

agents.set_tracing_disabled(True)

WEATHER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"enum": ["Bath", "Leeds", "York"]}, "days": {"type": "integer", "minimum": 1,
                                                                         "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}  # fmt: skip
DICE_PARAMETERS: dict[str, Any] = {
    "type": "object", "properties": {"sides": {"enum": [6, 20]}}, "required": ["sides"], "additionalProperties": False,
}  # fmt: skip
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather in a city, for some days",
                 "parameters": WEATHER_PARAMETERS},
}  # fmt: skip
DICE: dict[str, Any] = {
    "type": "function",
    "function": {"name": "roll_dice", "description": "Roll a die", "parameters": DICE_PARAMETERS},
}
TOOLS: list[Any] = [WEATHER, DICE]
#: The same tools as Responses takes them (flat).
FLAT: list[Any] = [{"type": "function", **t["function"]} for t in TOOLS]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = "What is the weather in Bath?"
RESULT = "12 C and rain"
TOKENS = 8
#: An openai-agents run fails on an incomplete response: its text turns end at a stop string, one a call of these
#: tools never holds (a stop string would cut a call too), which the demo model's greedy replies reach within a few
#: tokens (they open '"I am sure,').
AGENT_STOP = ["sure"]
AGENT_TOKENS = 64


def check_call(name: str, arguments: str, allowed: set[str] | None = None) -> dict[str, Any]:
    """The call is of an allowed tool and its arguments validate against that tool's parameters."""
    assert name in (allowed or set(SCHEMAS)), name
    parsed = json.loads(arguments)
    jsonschema.validate(parsed, SCHEMAS[name])
    return dict(parsed)


def check_id(call_id: str) -> None:
    assert call_id.startswith("call_"), call_id
    assert len(call_id) == 29, call_id
    assert call_id[5:].isalnum(), call_id


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


# --- the request readers ---------------------------------------------------------------------------------------


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "chat", "messages": [{"role": "user", "content": QUESTION}], **extra}


CALL: dict[str, Any] = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Bath", "days": 2}'},
}


def test_chat_tools_tool_choice_and_tool_messages_are_read_into_the_sdks_values() -> None:
    req = chat_request(chat_body(tools=TOOLS, tool_choice=named("get_weather"), parallel_tool_calls=False), Limits())
    tools = req.generation.tools
    assert tools is not None
    assert [(t.name, t.description, t.parameters) for t in tools] == [
        ("get_weather", "The weather in a city, for some days", WEATHER_PARAMETERS),
        ("roll_dice", "Roll a die", DICE_PARAMETERS),
    ]
    assert req.generation.tool_choice == named("get_weather")
    assert req.parallel_tool_calls is False
    assert req.generation.calls_possible
    options = req.generation.options()
    assert options["tools"] == tools
    assert options["tool_choice"] == named("get_weather")
    # A result after the call it answers; the assistant's content may be null (or absent) with calls.
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": RESULT}]}]  # fmt: skip
    req = chat_request({"model": "chat", "messages": messages, "tools": TOOLS}, Limits())
    _, assistant, result = req.messages
    assert (assistant.role, assistant.text) == ("assistant", "")
    assert [(c.id, c.name, c.arguments) for c in assistant.tool_calls] == [
        ("call_1", "get_weather", '{"city": "Bath", "days": 2}')
    ]
    assert (result.role, result.text, result.tool_call_id) == ("tool", RESULT, "call_1")
    assert req.generation.tool_choice is None  # not given: the model's default (auto)
    # Without tools, auto and none ask for nothing and reach the SDK as nothing.
    plain = chat_request(chat_body(tools=[], tool_choice="none", parallel_tool_calls=True), Limits())
    assert "tools" not in plain.generation.options()
    assert "tool_choice" not in plain.generation.options()
    assert not plain.generation.calls_possible


def test_responses_function_call_items_become_one_assistant_message_and_records_one_per_item() -> None:
    items = [
        {"role": "user", "content": QUESTION},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Looking.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Bath", "days": 2}', "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "roll_dice", "arguments": '{"sides": 6}'},
        {"type": "function_call_output", "call_id": "call_1", "output": RESULT},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "4"}],
         "status": "completed"},
    ]  # fmt: skip
    req = response_request(
        {"model": "chat", "input": items, "tools": FLAT, "tool_choice": {"type": "function", "name": "roll_dice"}},
        Limits(),
    )
    assert [m.role for m in req.messages] == ["user", "assistant", "tool", "tool"]
    assistant = req.messages[1]
    assert assistant.text == "Looking."
    assert [c.id for c in assistant.tool_calls] == ["call_1", "call_2"]
    assert [(m.tool_call_id, m.text) for m in req.messages[2:]] == [("call_1", RESULT), ("call_2", "4")]
    assert req.item_of == (0, 1, 4, 5)
    assert len(req.records) == len(req.items) == 6
    assert from_records(req.records) == req.messages  # the records, one per item, join into the same messages
    assert [i["type"] for i in req.items] == ["message", "message", "function_call", "function_call",
                                              "function_call_output", "function_call_output"]  # fmt: skip
    assert req.items[5]["output"] == "4"
    assert req.generation.tool_choice == named("roll_dice")  # the SDK's shape
    assert req.tool_choice_echo == {"type": "function", "name": "roll_dice"}  # the request's own
    assert req.tools_echo[0] == {"type": "function", "name": "get_weather", "description": WEATHER["function"][
        "description"], "parameters": WEATHER_PARAMETERS, "strict": None}  # fmt: skip
    assert req.parallel_tool_calls is True  # OpenAI's default, echoed
    # The same items added to a conversation.
    added = conversation_items_request({"items": items[2:]}, Limits())
    assert [r[0] for r in added.records] == ["assistant", "assistant", "tool", "tool"]


def test_records_keep_every_tool_field_and_the_history_key_compares_arguments_by_value() -> None:
    req = chat_request(
        {"model": "chat", "messages": [
            {"role": "user", "content": QUESTION}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": RESULT}]},
        Limits(),
    )  # fmt: skip
    recs = records(req.messages)
    assert recs[0] == ("user", QUESTION)  # a message without tool fields is a pair, as a store from before tools has
    assert recs[1] == ("assistant", "", {"tool_calls": [{"id": "call_1", "name": "get_weather",
                                                         "arguments": '{"city": "Bath", "days": 2}'}]})  # fmt: skip
    assert recs[2] == ("tool", RESULT, {"tool_call_id": "call_1"})
    assert from_records(json.loads(json.dumps(recs))) == req.messages  # through the store's JSON and back
    key = history_key("", "chat", req.messages[:2])

    def with_arguments(arguments: str) -> str:
        call = {**CALL, "function": {"name": "get_weather", "arguments": arguments}}
        messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": RESULT}]  # fmt: skip
        read = chat_request({"model": "chat", "messages": messages}, Limits())
        return history_key("", "chat", read.messages[:2])

    assert with_arguments('{"city":"Bath",  "days":2}') == key  # the same JSON value: the model renders the same
    assert with_arguments('{"days": 2, "city": "Bath"}') != key  # keys in another order render differently
    assert history_key("someone else", "chat", req.messages[:2]) != key


CHAT_FAULTS: list[tuple[str, dict[str, Any], str]] = [
    ("tools", {"tools": "get_weather"}, "array"),
    ("tools[0].type", {"tools": [{"type": "web_search"}]}, "function tools only"),
    ("tools[0].function", {"tools": [{"type": "function"}]}, "name"),
    ("tools[0].function.name", {"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "64"),
    ("tools[0].function.parameters", {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "JSON schema"),
    ("tools[0].function.parameters", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]}, "'object'"),
    ("tools[0].function.strict", {"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
     "boolean"),
    ("tools[1].function.name", {"tools": [WEATHER, WEATHER]}, "unique"),
    ("tool_choice", {"tools": TOOLS, "tool_choice": "sometimes"}, "'required'"),
    ("tool_choice", {"tool_choice": "required"}, "needs tools"),
    ("tool_choice.function.name", {"tools": TOOLS, "tool_choice": named("fly")}, "not one of the tools"),
    ("tool_choice.type", {"tools": TOOLS, "tool_choice": {"type": "allowed_tools"}}, "functions only"),
    ("parallel_tool_calls", {"tools": TOOLS, "parallel_tool_calls": "yes"}, "boolean"),
    ("functions", {"functions": [{"name": "f"}]}, "give tools"),
    ("function_call", {"function_call": {"name": "f"}}, "give tools"),
    ("messages[1].tool_call_id", {"messages": [{"role": "user", "content": "x"},
                                               {"role": "tool", "tool_call_id": "call_1", "content": "y"}]},
     "must follow"),
    ("messages[2].tool_call_id", {"messages": [{"role": "user", "content": "x"},
                                               {"role": "assistant", "tool_calls": [CALL]},
                                               {"role": "tool", "tool_call_id": "call_9", "content": "y"}]},
     "'call_9'"),
    ("messages[1].tool_call_id", {"messages": [{"role": "user", "content": "x"},
                                               {"role": "tool", "content": "y"}]}, "names the call"),
    ("messages[1].tool_calls[0].function.arguments", {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{not json"}}]},
        {"role": "user", "content": "y"}]}, "not JSON"),
    ("messages[1].tool_calls[0].function.arguments", {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1]"}}]},
        {"role": "user", "content": "y"}]}, "an object"),
    ("messages[1].tool_calls[0].id", {"messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{**CALL, "id": ""}]},
        {"role": "user", "content": "y"}]}, "call id"),
    ("messages[0].role", {"messages": [{"role": "function", "name": "f", "content": "x"}]}, "'tool'"),
    ("messages[2].name", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [CALL]},
                                       {"role": "tool", "tool_call_id": "call_1", "content": "y", "name": ""}]},
     "non-empty"),
    ("messages[1].role", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [CALL]}]},
     "tool's result"),
]  # fmt: skip
RESPONSES_FAULTS: list[tuple[str, dict[str, Any], str]] = [
    ("tools[0].type", {"tools": [{"type": "web_search"}]}, "function tools only"),
    ("tools[0].function", {"tools": [WEATHER]}, "unknown field"),  # Chat Completions' shape
    ("tools[0].defer_loading", {"tools": [{**FLAT[0], "defer_loading": True}]}, "defer_loading"),
    ("tool_choice.name", {"tools": FLAT, "tool_choice": {"type": "function", "name": "fly"}}, "not one of the tools"),
    ("tool_choice.type", {"tools": FLAT, "tool_choice": {"type": "mcp", "server_label": "x"}}, "functions only"),
    ("input[1].arguments", {"input": [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c",
                                                                        "name": "f", "arguments": "nope"}]},
     "not JSON"),
    ("input[0].output", {"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "a string"),
    ("input[0].output[0].type", {"input": [{"type": "function_call_output", "call_id": "c", "output": [
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}, "text only"),
    ("input[0].role", {"input": [{"role": "tool", "content": "x"}]}, "function_call_output"),
    ("input[1].type", {"input": [{"role": "user", "content": "x"}, {"type": "reasoning", "summary": []}]},
     "function_call_output only"),
]  # fmt: skip


@pytest.mark.parametrize(("param", "extra", "words"), CHAT_FAULTS, ids=[f"{p}-{w}" for p, _, w in CHAT_FAULTS])
def test_each_chat_tool_fault_is_a_400_naming_its_field(param: str, extra: dict[str, Any], words: str) -> None:
    with pytest.raises(APIError) as err:
        chat_request(chat_body(**extra), Limits())
    assert err.value.status == 400
    assert err.value.param == param
    assert words in err.value.message


@pytest.mark.parametrize(("param", "extra", "words"), RESPONSES_FAULTS, ids=[p for p, _, _ in RESPONSES_FAULTS])
def test_each_responses_tool_fault_is_a_400_naming_its_field(param: str, extra: dict[str, Any], words: str) -> None:
    with pytest.raises(APIError) as err:
        response_request({"model": "chat", "input": QUESTION, **extra}, Limits())
    assert err.value.status == 400
    assert err.value.param == param
    assert words in err.value.message


def test_tool_caps_are_checked_before_anything_runs() -> None:
    many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    with pytest.raises(APIError, match="at most 128 tools"):
        chat_request(chat_body(tools=many), Limits())
    huge = [{"type": "function", "function": {"name": "f", "description": "x" * 300_000}}]
    with pytest.raises(APIError, match="bytes of tool definitions"):
        chat_request(chat_body(tools=huge), Limits())


# --- the openai client ------------------------------------------------------------------------------------------

# The fixtures client, gateway (an embedded OpenAIGateway) and oa (AsyncOpenAI on it) are conftest.py's.


@pytest.mark.parametrize("choice", ["named", "required"])
async def test_a_forced_call_is_valid_and_streamed_it_is_the_same_call(oa: AsyncOpenAI, choice: str) -> None:
    tool_choice: Any = named("roll_dice") if choice == "named" else "required"
    allowed = {"roll_dice"} if choice == "named" else set(SCHEMAS)
    ask: dict[str, Any] = {"model": "chat", "messages": [{"role": "user", "content": QUESTION}], "tools": TOOLS,
                           "tool_choice": tool_choice, "temperature": 0}  # fmt: skip
    done = await oa.chat.completions.create(**ask)
    choice_ = done.choices[0]
    assert choice_.finish_reason == "tool_calls"
    assert choice_.message.content is None  # only calls
    calls = choice_.message.tool_calls
    assert calls is not None
    assert len(calls) == 1  # a forced call is one call
    for call in calls:
        assert call.type == "function"
        check_id(call.id)
        check_call(call.function.name, call.function.arguments, allowed)
    # The SDK's stream helper accumulates the deltas into the same calls, ids and all (they come from the prompt).
    async with oa.chat.completions.stream(**ask) as stream:
        final = await stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls
    assert streamed is not None
    assert [(c.id, c.function.name, c.function.arguments) for c in streamed] == [
        (c.id, c.function.name, c.function.arguments) for c in calls
    ]
    assert final.choices[0].finish_reason == "tool_calls"
    # The raw chunks are as OpenAI streams them: the call's head with empty arguments, then the arguments.
    chunks = [c async for c in await oa.chat.completions.create(**ask, stream=True)]
    deltas = [d.model_dump(exclude_none=True) for c in chunks for ch in c.choices for d in ch.delta.tool_calls or ()]
    head = calls[0]
    assert deltas == [
        {"index": 0, "id": head.id, "type": "function", "function": {"name": head.function.name, "arguments": ""}},
        {"index": 0, "function": {"arguments": head.function.arguments}},
    ]
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["tool_calls"]
    assert not "".join(ch.delta.content or "" for c in chunks for ch in c.choices)  # no markup as text


async def test_n_choices_each_make_a_valid_call_whole_and_streamed(oa: AsyncOpenAI) -> None:
    ask: dict[str, Any] = {"model": "chat", "messages": [{"role": "user", "content": QUESTION}], "tools": TOOLS,
                           "tool_choice": "required", "temperature": 1.0, "seed": 11, "n": 3}  # fmt: skip
    done = await oa.chat.completions.create(**ask)
    assert sorted(c.index for c in done.choices) == [0, 1, 2]
    whole = {}
    for c in done.choices:
        assert c.finish_reason == "tool_calls"
        assert c.message.tool_calls
        call = c.message.tool_calls[0]
        check_call(call.function.name, call.function.arguments)
        whole[c.index] = (call.function.name, call.function.arguments)
    async with oa.chat.completions.stream(**ask) as stream:
        final = await stream.get_final_completion()
    streamed = {c.index: (c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments)  # type: ignore[index]
                for c in final.choices}  # fmt: skip
    assert streamed == whole


async def test_the_turn_after_a_tool_result_continues_on_the_device(oa: AsyncOpenAI) -> None:
    """The result goes back with the whole history, as Chat Completions does: the gateway continues the chat that
    made the call, so the server prefills only the result; the reply equals the stateless twin's."""
    ask = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "Is it raining in Leeds?"}]
    first = await oa.chat.completions.create(  # type: ignore[call-overload]
        model="chat",
        messages=ask,
        tools=TOOLS,
        tool_choice=named("get_weather"),
        temperature=0,
    )
    message = first.choices[0].message
    assert message.tool_calls
    call = message.tool_calls[0]
    check_call(call.function.name, call.function.arguments)
    result = {"role": "tool", "tool_call_id": call.id, "content": RESULT}
    history = [*ask, message.model_dump(exclude_none=True), result]
    second = await oa.chat.completions.create(
        model="chat",
        messages=history,
        tools=TOOLS,
        max_tokens=TOKENS,
        temperature=0,
    )
    assert second.choices[0].finish_reason == "length"
    assert second.choices[0].message.content
    assert first.usage is not None
    assert second.usage is not None
    assert second.usage.prompt_tokens_details is not None
    # What the server held already: the first turn's prompt and reply (all but the reply's last token, which no pass
    # has read yet): this turn prefilled only the result and its template's framing. (A named call's tokens are
    # what the template renders for it; a call under "required" may be tokenized otherwise, and the server then
    # prefills again from the first token that differs.)
    held = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert second.usage.prompt_tokens_details.cached_tokens == held
    assert second.usage.prompt_tokens - held <= 40
    # The stateless twin (nothing is parked now: that reply made no call) gives the same text on the same prompt.
    twin = await oa.chat.completions.create(
        model="chat",
        messages=history,
        tools=TOOLS,
        max_tokens=TOKENS,
        temperature=0,
    )
    assert twin.choices[0].message.content == second.choices[0].message.content
    assert twin.usage is not None
    assert twin.usage.prompt_tokens == second.usage.prompt_tokens


async def test_a_history_that_differs_from_the_parked_chat_leaves_it_for_the_one_that_matches(
    oa: AsyncOpenAI,
) -> None:
    """Other arguments sent back are another history: that request starts afresh, and the chat that made the call
    stays parked for the request that sends its history back exactly (which goes on live: a fresh chat could share
    the prompt's blocks with it, never the call the other history changed)."""
    ask = [{"role": "user", "content": "Weather for York?"}]
    first = await oa.chat.completions.create(  # type: ignore[call-overload]
        model="chat",
        messages=ask,
        tools=TOOLS,
        tool_choice=named("get_weather"),
        temperature=0,
    )
    message = first.choices[0].message.model_dump(exclude_none=True)
    call_id = message["tool_calls"][0]["id"]
    other = json.loads(json.dumps(message))
    arguments = json.loads(message["tool_calls"][0]["function"]["arguments"])
    other["tool_calls"][0]["function"]["arguments"] = json.dumps({**arguments, "days": 7 - arguments["days"] % 7})
    for sent in (other, message):
        history = [*ask, sent, {"role": "tool", "tool_call_id": call_id, "content": RESULT}]
        last = await oa.chat.completions.create(
            model="chat",
            messages=history,
            tools=TOOLS,
            max_tokens=2,
            temperature=0,
        )
    assert first.usage is not None
    assert last.usage is not None
    assert last.usage.prompt_tokens_details is not None
    held = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert last.usage.prompt_tokens_details.cached_tokens == held


async def test_responses_function_call_and_output_over_previous_response_id_go_on_live(
    gateway: OpenAIGateway, oa: AsyncOpenAI
) -> None:
    r1 = await oa.responses.create(model="chat", input=QUESTION, tools=FLAT,
                                   tool_choice={"type": "function", "name": "get_weather"}, temperature=0)  # fmt: skip
    assert r1.status == "completed"
    assert [i.type for i in r1.output] == ["function_call"]  # only the call: no message item
    item = r1.output[0]
    assert item.type == "function_call"
    assert item.id is not None
    assert item.id.startswith("fc_")
    assert item.status == "completed"
    check_id(item.call_id)
    check_call(item.name, item.arguments, {"get_weather"})
    assert [t.name for t in r1.tools] == ["get_weather", "roll_dice"]  # type: ignore[union-attr]
    assert r1.tool_choice.type == "function"  # type: ignore[union-attr]
    assert r1.parallel_tool_calls is True
    replayed = await replays(gateway)
    r2 = await oa.responses.create(
        model="chat", previous_response_id=r1.id, tools=FLAT, max_output_tokens=TOKENS, temperature=0,
        input=[{"type": "function_call_output", "call_id": item.call_id, "output": RESULT}],
    )  # fmt: skip
    assert r2.output_text
    assert await replays(gateway) == replayed  # live: the chain's chat took the result
    assert r1.usage is not None
    assert r2.usage is not None
    held = r1.usage.input_tokens + r1.usage.output_tokens - 1
    assert r2.usage.input_tokens_details.cached_tokens == held
    listed = (await oa.responses.input_items.list(r2.id)).data
    assert [(i.type, i.call_id, i.output) for i in listed] == [("function_call_output", item.call_id, RESULT)]  # type: ignore[union-attr]
    # Streamed, the call comes as OpenAI's events; the same call (its id derives from the prompt).
    stream = await oa.responses.create(
        model="chat", input=QUESTION, tools=FLAT, stream=True,
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
    )  # fmt: skip
    events = [e async for e in stream]
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    added, delta, args_done, item_done, completed = events[2:]
    assert added.item.type == "function_call"  # type: ignore[union-attr]
    assert (added.item.arguments, added.item.status) == ("", "in_progress")  # type: ignore[union-attr]
    assert delta.delta == args_done.arguments == item.arguments  # type: ignore[union-attr]
    assert (item_done.item.call_id, item_done.item.name) == (item.call_id, item.name)  # type: ignore[union-attr]
    assert completed.response.output[0].id == item_done.item.id  # type: ignore[union-attr]
    # Every field the gateway wrote into the output items goes back as input: the whole history replayed, the same
    # reply as the live turn's.
    replay = [{"role": "user", "content": QUESTION}, *[i.model_dump(exclude_none=True) for i in r1.output],
              {"type": "function_call_output", "call_id": item.call_id, "output": RESULT}]  # fmt: skip
    r3 = await oa.responses.create(model="chat", input=replay, tools=FLAT, max_output_tokens=TOKENS,  # type: ignore[arg-type]
                                   temperature=0)  # fmt: skip
    assert r3.output_text == r2.output_text
    for r in (r1, r2, r3, completed.response):  # type: ignore[union-attr]
        await oa.responses.delete(r.id)


async def test_with_tools_under_auto_the_demo_model_answers_in_text_streamed_as_text(oa: AsyncOpenAI) -> None:
    """tool_choice auto (the default): the model may answer in text, and the demo model does. A Chat Completions
    stream opens with null content (the reply might have been calls) and its content deltas are the text; a
    Responses stream opens the message item with the first text."""
    ask: dict[str, Any] = {"model": "chat", "tools": TOOLS, "max_tokens": TOKENS, "temperature": 0,
                           "messages": [{"role": "user", "content": "Tell me a story."}]}  # fmt: skip
    done = await oa.chat.completions.create(**ask)
    assert done.choices[0].message.tool_calls is None
    assert done.choices[0].finish_reason == "length"
    chunks = [c async for c in await oa.chat.completions.create(**ask, stream=True)]
    assert chunks[0].choices[0].delta.content is None
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == done.choices[0].message.content
    stream = await oa.responses.create(
        model="chat", input="Tell me a story.", tools=FLAT, max_output_tokens=TOKENS, temperature=0, stream=True
    )
    kinds = [e.type async for e in stream]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # fmt: skip
    assert "response.function_call_arguments.delta" not in kinds


async def test_conversation_items_hold_the_calls_and_their_outputs(oa: AsyncOpenAI) -> None:
    conv = await oa.conversations.create(items=[{"type": "message", "role": "system", "content": "Be brief."}])
    r1 = await oa.responses.create(model="chat", input="Rain in Bath?", conversation=conv.id, tools=FLAT,
                                   tool_choice={"type": "function", "name": "get_weather"}, temperature=0)  # fmt: skip
    call = r1.output[-1]
    assert call.type == "function_call"
    check_call(call.name, call.arguments)
    r2 = await oa.responses.create(
        model="chat", conversation=conv.id, tools=FLAT, max_output_tokens=TOKENS, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": RESULT}],
    )  # fmt: skip
    assert r1.usage is not None
    assert r2.usage is not None
    assert r2.usage.input_tokens_details.cached_tokens == r1.usage.input_tokens + r1.usage.output_tokens - 1  # live
    listed = (await oa.conversations.items.list(conv.id, order="asc")).data
    assert [i.type for i in listed] == ["message", "message", "function_call", "function_call_output", "message"]
    assert listed[2].id == call.id
    assert (listed[3].call_id, listed[3].output) == (call.call_id, RESULT)  # type: ignore[union-attr]
    # Items added through the items API (a call and its output, as a client copies them) are replayed exactly.
    await oa.conversations.items.create(conv.id, items=[
        {"type": "function_call", "call_id": "call_a", "name": "roll_dice", "arguments": '{"sides": 6}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "4"},
    ])  # fmt: skip
    r3 = await oa.responses.create(model="chat", conversation=conv.id, input="And then?", max_output_tokens=TOKENS,
                                   temperature=0)  # fmt: skip
    assert r3.output_text
    await oa.conversations.delete(conv.id)
    for r in (r1, r2, r3):
        await oa.responses.delete(r.id)


async def test_a_gateway_restart_between_the_call_and_its_result_resumes_the_chain(
    client: Client, triton_server: LocalTriton, tmp_path: Path
) -> None:
    """The call's response is stored in SQLite (its messages as records with the call) and its chat detached; a new
    gateway on the same store resumes the server's sequence for the result: only the result is prefilled."""
    path = tmp_path / "responses.sqlite3"
    options = GatewayOptions(detach_on_close=True)
    ask: dict[str, Any] = {"model": "chat", "tools": FLAT, "temperature": 0}
    async with (
        OpenAIGateway(client, port=0, store=await SQLiteStore.open(path), options=options) as gw,
        AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0) as oa,
    ):
        named_weather = {"type": "function", "name": "get_weather"}
        r1 = await oa.responses.create(**ask, input="Cold in York?", tool_choice=named_weather)
    call = r1.output[0]
    assert call.type == "function_call"
    async with (
        Client(triton_server.grpc_url, timeout_s=120) as fresh,
        OpenAIGateway(fresh, port=0, store=await SQLiteStore.open(path), options=options) as gw,
        AsyncOpenAI(base_url=gw.base_url, api_key="x", max_retries=0) as oa,
    ):
        output = [{"type": "function_call_output", "call_id": call.call_id, "output": RESULT}]
        r2 = await oa.responses.create(**ask, previous_response_id=r1.id, input=output, max_output_tokens=TOKENS)
        assert r1.usage is not None
        assert r2.usage is not None
        assert r2.usage.input_tokens_details.cached_tokens == r1.usage.input_tokens + r1.usage.output_tokens - 1
        # The stateless twin: the same history replayed whole gives the same reply.
        replay = [{"role": "user", "content": "Cold in York?"}, call.model_dump(exclude_none=True), *output]
        twin = await oa.responses.create(**ask, input=replay, max_output_tokens=TOKENS)
        assert twin.output_text == r2.output_text
        for r in (r1, r2, twin):
            await oa.responses.delete(r.id)


async def test_bad_tools_are_400s_naming_the_field_through_the_client(oa: AsyncOpenAI) -> None:
    base: dict[str, Any] = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for extra, param in [
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": named("fly")}, "tool_choice.function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            await oa.chat.completions.create(**base, **extra)  # type: ignore[arg-type]
        assert err.value.body["param"] == param  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as err:
        await oa.responses.create(model="chat", input="hi", tools=FLAT,
                                  tool_choice={"type": "function", "name": "fly"})  # fmt: skip
    assert err.value.body["param"] == "tool_choice.name"  # type: ignore[index]
    plain = await oa.responses.create(model="chat", input="hi", max_output_tokens=2)
    orphan = [{"type": "function_call_output", "call_id": "call_x", "output": "x"}]
    with pytest.raises(openai.BadRequestError) as err:  # a result for no call of the response it continues
        await oa.responses.create(model="chat", previous_response_id=plain.id, input=orphan)  # type: ignore[arg-type]
    assert err.value.body["param"] == "input[0].call_id"  # type: ignore[index]
    ok = await oa.chat.completions.create(**base)
    assert ok.usage is not None
    assert ok.usage.completion_tokens > 0


# --- LangChain ----------------------------------------------------------------------------------------------------


@tool
def get_weather(city: Literal["Bath", "Leeds", "York"], days: Literal[1, 2, 3]) -> str:
    """The weather in a city, for some days."""
    return f"{city}: {RESULT}, for {days} days"


def chat_openai(gateway: OpenAIGateway, http: httpx.AsyncClient, **options: Any) -> ChatOpenAI:
    return ChatOpenAI(model="chat", base_url=gateway.base_url, api_key="unused", temperature=0,  # type: ignore[arg-type]
                      max_retries=0, http_async_client=http, **options)  # fmt: skip


@pytest.mark.parametrize("choice", ["get_weather", "any"])
async def test_langchain_bind_tools_and_a_tool_loop(
    gateway: OpenAIGateway,
    http_client: httpx.AsyncClient,  # noqa: F811
    choice: str,
) -> None:
    """``bind_tools`` with a named tool and with ``any`` (sent as required): the AIMessage's tool call is valid; the
    ToolMessage goes back and the next reply comes, continuing on the device."""
    schema = convert_to_openai_tool(get_weather, strict=True)["function"]["parameters"]
    # strict: the arguments' schema allows no other keys (a free object would let the demo model babble in it).
    llm = chat_openai(gateway, http_client).bind_tools([get_weather], tool_choice=choice, strict=True)
    question = HumanMessage(f"Sun in York? ({choice})")
    ai = await llm.ainvoke([question])
    assert isinstance(ai, AIMessage)
    assert len(ai.tool_calls) == 1
    call = ai.tool_calls[0]
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], schema)
    check_id(call["id"] or "")
    assert ai.response_metadata["finish_reason"] == "tool_calls"
    result = await get_weather.ainvoke(call)
    assert isinstance(result, ToolMessage)
    # The same tools (the server renders them at the top of the conversation: other tools would be another prompt).
    answer = await chat_openai(gateway, http_client, max_tokens=TOKENS).bind_tools([get_weather], strict=True).ainvoke(
        [question, ai, result]
    )  # fmt: skip
    assert isinstance(answer, AIMessage)
    assert answer.text
    assert not answer.tool_calls
    assert ai.usage_metadata is not None
    assert answer.usage_metadata is not None
    held = ai.usage_metadata["input_tokens"] + ai.usage_metadata["output_tokens"] - 1
    cached = answer.usage_metadata["input_token_details"]["cache_read"]
    if choice == "get_weather":  # a named call's tokens are what the template renders for it: all of them held
        assert cached == held
    else:  # "required" may tokenize the call otherwise: the server prefills again from the first token that differs
        assert ai.usage_metadata["input_tokens"] <= cached <= held


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=99)


async def test_langchain_with_structured_output_function_calling(gateway: OpenAIGateway) -> None:
    """with_structured_output's function_calling method binds the schema as a tool and forces it: a Person (strict:
    the schema allows no other keys, which the demo model would otherwise fill)."""
    llm = ChatOpenAI(
        model="chat",
        base_url=gateway.base_url,
        api_key="unused",  # type: ignore[arg-type]
        max_retries=0,
        temperature=0.8,
        seed=3,
    )
    person = await llm.with_structured_output(Person, method="function_calling", strict=True).ainvoke("Who is she?")
    assert isinstance(person, Person)


# --- openai-agents ------------------------------------------------------------------------------------------------


def agents_model(oa: AsyncOpenAI, api: str) -> agents.Model:
    if api == "responses":
        return agents.OpenAIResponsesModel("chat", oa)
    return agents.OpenAIChatCompletionsModel("chat", oa)


def settings(**extra: Any) -> agents.ModelSettings:
    return agents.ModelSettings(temperature=0, max_tokens=AGENT_TOKENS, extra_body={"stop": AGENT_STOP}, **extra)


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
async def test_agents_function_tool_runs_with_valid_arguments(oa: AsyncOpenAI, api: str) -> None:
    """tool_choice required: the first turn calls the tool (with arguments valid for its schema), agents reset
    tool_choice after the call, so the second turn answers with text and the run finishes."""
    ran: list[dict[str, Any]] = []

    @agents.function_tool
    def weather(city: Literal["Bath", "Leeds", "York"], days: Literal[1, 2, 3]) -> str:
        """The weather in a city, for some days."""
        ran.append({"city": city, "days": days})
        return f"{city}: {RESULT}"

    agent = agents.Agent(name="forecaster", instructions="Use the tools.", model=agents_model(oa, api),
                         tools=[weather], model_settings=settings(tool_choice="required"))  # fmt: skip
    result = await agents.Runner.run(agent, QUESTION)
    assert len(ran) == 1
    jsonschema.validate(ran[0], weather.params_json_schema)
    assert isinstance(result.final_output, str)
    assert result.final_output
    calls = [i for i in result.new_items if isinstance(i, agents.ToolCallItem)]
    outputs = [i for i in result.new_items if isinstance(i, agents.ToolCallOutputItem)]
    assert len(calls) == len(outputs) == 1
    assert outputs[0].output == f"{ran[0]['city']}: {RESULT}"
    assert result.context_wrapper.usage.requests == 2
    if api == "responses":
        await oa.responses.delete(result.last_response_id or "")


async def test_agents_sqlite_session_replays_the_calls_and_outputs_the_gateway_wrote(
    oa: AsyncOpenAI, tmp_path: Path
) -> None:
    """The session keeps a tool turn's items as the gateway returned them (the function_call item with its id and
    status, the output, the answer) and sends them all back as the next run's input: taken as they are."""

    @agents.function_tool
    def weather(city: Literal["Bath", "Leeds", "York"]) -> str:
        """The weather in a city."""
        return f"{city}: {RESULT}"

    session = agents.SQLiteSession("forecast", str(tmp_path / "session.sqlite3"))
    try:
        agent = agents.Agent(name="forecaster", model=agents.OpenAIResponsesModel("chat", oa), tools=[weather],
                             model_settings=settings(tool_choice="required"))  # fmt: skip
        first = await agents.Runner.run(agent, QUESTION, session=session)
        second = await agents.Runner.run(agent, "And tomorrow?", session=session)
        items = await session.get_items()
    finally:
        session.close()
    kinds = [i.get("type", "message") for i in items]
    assert kinds[:4] == ["message", "function_call", "function_call_output", "message"]
    call = items[1]
    assert call["status"] == "completed"  # type: ignore[typeddict-item]
    assert call["id"].startswith("fc_")  # type: ignore[typeddict-item]
    assert first.final_output
    assert second.final_output
    for result in (first, second):
        await oa.responses.delete(result.last_response_id or "")


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
async def test_agents_handoff_hands_the_run_to_the_other_agent(oa: AsyncOpenAI, api: str) -> None:
    """An agent whose only tool is a handoff, forced to call it: the other agent answers."""
    model = agents_model(oa, api)
    helper = agents.Agent(name="helper", instructions="You are terse.", model=model, model_settings=settings())
    desk = agents.Agent(name="desk", instructions="Hand over.", model=model, handoffs=[helper],
                        model_settings=settings(tool_choice="required"))  # fmt: skip
    result = await agents.Runner.run(desk, QUESTION)
    assert result.last_agent is helper
    assert isinstance(result.final_output, str)
    assert result.final_output
    handoffs = [i for i in result.new_items if isinstance(i, agents.HandoffCallItem)]
    assert [h.raw_item.name for h in handoffs] == ["transfer_to_helper"]
    if api == "responses":
        await oa.responses.delete(result.last_response_id or "")


# --- LiteLLM ------------------------------------------------------------------------------------------------------


async def test_litellm_tools_whole_and_streamed_give_valid_calls(
    gateway: OpenAIGateway,
    litellm: Any,  # noqa: F811
) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    call: dict[str, Any] = {"model": "openai/chat", "api_base": gateway.base_url, "api_key": "unused",
                            "messages": messages, "temperature": 0, "tools": TOOLS,
                            "tool_choice": named("get_weather")}  # fmt: skip
    done = await litellm.acompletion(**call)
    assert done.choices[0].finish_reason == "tool_calls"
    calls = done.choices[0].message.tool_calls
    assert len(calls) == 1
    check_call(calls[0].function.name, calls[0].function.arguments, {"get_weather"})
    check_id(calls[0].id)
    stream = await litellm.acompletion(**call, stream=True)
    chunks = [chunk async for chunk in stream]
    built = litellm.stream_chunk_builder(chunks, messages=messages)
    streamed = built.choices[0].message.tool_calls
    assert [(c.id, c.function.name, c.function.arguments) for c in streamed] == [
        (c.id, c.function.name, c.function.arguments) for c in calls
    ]
    assert built.choices[0].finish_reason == "tool_calls"


# --- issue 30's friction list: the tools line -----------------------------------------------------------------


async def test_friction_any_tool_no_longer_400s(
    gateway: OpenAIGateway,
    oa: AsyncOpenAI,
    http_client: httpx.AsyncClient,  # noqa: F811
    litellm: Any,  # noqa: F811
) -> None:
    """'Any tool': LangChain's bind_tools, an openai-agents @function_tool, a handoff (sent as a tool) and LiteLLM's
    tools= each got '400 tools: tool calling is not supported'. Each request now gets a call."""
    bound = chat_openai(gateway, http_client).bind_tools([get_weather], tool_choice="any", strict=True)
    ai = await bound.ainvoke(QUESTION)
    assert isinstance(ai, AIMessage)
    assert ai.tool_calls

    @agents.function_tool
    def weather(city: Literal["Bath", "Leeds"]) -> str:
        """The weather in a city."""
        return RESULT

    helper = agents.Agent(name="helper", model=agents.OpenAIChatCompletionsModel("chat", oa), model_settings=settings())
    cases: list[tuple[list[Any], list[Any]]] = [([weather], []), ([], [helper])]
    for agent_tools, handoffs in cases:
        agent = agents.Agent(name="desk", model=agents.OpenAIResponsesModel("chat", oa), tools=agent_tools,
                             handoffs=handoffs, model_settings=settings(tool_choice="required"),
                             tool_use_behavior="stop_on_first_tool")  # fmt: skip
        result = await agents.Runner.run(agent, QUESTION, max_turns=3)
        assert any(isinstance(i, agents.ToolCallItem | agents.HandoffCallItem) for i in result.new_items)
    done = await litellm.acompletion(model="openai/chat", api_base=gateway.base_url, api_key="unused",
                                     messages=[{"role": "user", "content": QUESTION}], tools=TOOLS,
                                     tool_choice="required")  # fmt: skip
    assert done.choices[0].message.tool_calls
