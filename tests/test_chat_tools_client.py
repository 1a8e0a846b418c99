"""Tool calling through the SDK (``tools=``, ``tool_choice=``, :class:`ToolCall`, tool results) and ``triton-npu chat
--tools``: the values on their own, then against the real Triton serving the demo chat model.

The demo checkpoint has a Hermes-style ``tool_use`` template and writes near gibberish, so it calls a tool only when
``tool_choice`` forces one (``"required"`` or a named function): a call whose arguments validate does so because the
server constrained it. Replies are compared with other replies of the same server (greedy), never with fixed text.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
from test_cli_chat import TRIPWIRE, running

from triton_npu_client import (
    ChatMessage,
    ChatMessageError,
    ChatOptionError,
    ChatOptions,
    ChatReply,
    ChatState,
    Client,
    InvalidArgumentError,
    LocalTriton,
    Tool,
    ToolCall,
)
from triton_npu_client._protocol import EMPTY, digest_role, history_digest
from triton_npu_client._protocol import chat as proto
from triton_npu_client._sessions._chat import _check_messages_fit, _check_options_fit, as_turn
from triton_npu_client.cli import main as cli_main

MODEL = "chat"
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = Tool("get_weather", description="The weather in a city, for some days", parameters=WEATHER_PARAMETERS)
ROLL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "roll_dice",
        "parameters": {
            "type": "object",
            "properties": {"sides": {"type": "integer", "minimum": 2, "maximum": 20}},
            "required": ["sides"],
            "additionalProperties": False,
        },
    },
}
TOOLS: list[Tool | dict[str, Any]] = [WEATHER, ROLL]
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "roll_dice": ROLL["function"]["parameters"]}
# The demo's small vocabulary spells the markup in many tokens: a forced call takes 40 to 80.
CALL_TOKENS = 200
CALL = ToolCall(id="call_1", name="get_weather", arguments='{"city": "Bath", "days": 2}')


def check_calls(reply: ChatReply, allowed: set[str]) -> None:
    """A forced turn's reply: calls only (no text: the server never sends a call's markup), each of an allowed tool
    and valid for its schema."""
    assert reply.tool_calls, f"a forced turn made no call: {reply!r}"
    assert reply.finish_reason == "tool_calls"
    assert reply.text == ""
    for call in reply.tool_calls:
        assert call.name in allowed, call
        jsonschema.validate(call.arguments_dict(), SCHEMAS[call.name])
        assert call.id.startswith("call_"), call


# --- pure: the values -------------------------------------------------------------------------------------------


def test_a_tool_call_holds_json_text_of_an_object_and_speaks_openai() -> None:
    assert CALL.arguments_dict() == {"city": "Bath", "days": 2}
    openai = CALL.to_openai()
    assert openai == {"id": "call_1", "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city": "Bath", "days": 2}'}}  # fmt: skip
    assert ToolCall.from_openai(openai) == CALL
    # An object for arguments (as some clients build them) becomes JSON text.
    built = ToolCall.from_openai({"id": "c", "function": {"name": "f", "arguments": {"a": [1, "é"]}}})
    assert built.arguments_dict() == {"a": [1, "é"]}
    for arguments in ("[1, 2]", "not json", '"text"', 3):
        with pytest.raises(ChatMessageError, match="arguments"):
            ToolCall(id="c", name="f", arguments=arguments)  # type: ignore[arg-type]
    with pytest.raises(ChatMessageError, match="name"):
        ToolCall(id="c", name="", arguments="{}")
    with pytest.raises(ChatMessageError, match="id"):
        ToolCall(id="", name="f", arguments="{}")
    with pytest.raises(ChatMessageError, match="function"):
        ToolCall.from_openai({"id": "c", "type": "code", "function": {"name": "f", "arguments": "{}"}})


def test_a_tool_speaks_openai_and_keeps_a_copy_of_its_schema() -> None:
    schema: dict[str, Any] = {"type": "object", "properties": {"q": {"type": "string"}}}
    tool = Tool("search", description="Search.", parameters=schema)
    schema["properties"]["q"]["type"] = "integer"  # the caller's dict changes; the tool's does not
    assert tool.to_openai() == {"type": "function", "function": {
        "name": "search", "description": "Search.", "parameters": {"type": "object", "properties": {
            "q": {"type": "string"}}}}}  # fmt: skip
    assert Tool.from_openai(tool.to_openai()) == tool
    assert Tool("now").to_openai() == {"type": "function", "function": {"name": "now"}}  # no None fields
    strict = {"type": "function", "function": {"name": "now", "strict": True}}
    assert Tool.from_openai(strict) == Tool("now")


@pytest.mark.parametrize(
    ("tools", "needle"),
    [
        ("get_weather", "a list of Tool values"),
        ({"type": "function", "function": {"name": "f"}}, "a list of Tool values"),
        ([{"type": "function", "function": {"name": "f"}}, Tool("f")], "two named 'f'"),
        ([{"type": "code", "function": {"name": "f"}}], '"type": "function"'),
        ([{"type": "function", "function": {"name": ""}}], "a tool's name"),
        ([{"type": "function", "function": {"name": "f", "parameters": "object"}}], "a JSON schema"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"default": object()}}}], "JSON data"),
        ([{"type": "function", "function": {"name": "f", "returns": {}}}], "'returns'"),
        ([{"type": "function", "function": {"name": "f", "description": 3}}], "description"),
    ],
)
def test_bad_tools_are_refused_naming_the_option(tools: Any, needle: str) -> None:
    with pytest.raises(ChatOptionError, match=re.escape(needle)) as caught:
        ChatOptions(tools=tools)
    assert caught.value.option == "tools"


def test_tool_choice_takes_the_words_a_named_function_or_a_tool() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for given, kept in [("auto", "auto"), ("none", "none"), ("required", "required"), (named, named),
                        (WEATHER, named)]:  # fmt: skip
        assert ChatOptions(tools=TOOLS, tool_choice=given).tool_choice == kept  # type: ignore[arg-type]
    for bad in ["any", "get_weather", {"type": "function"}, {"function": {"name": "f"}}, 3,
                {"type": "function", "function": {"name": "f"}, "extra": 1}]:  # fmt: skip
        with pytest.raises(ChatOptionError) as caught:
            ChatOptions(tool_choice=bad)  # type: ignore[arg-type]
        assert caught.value.option == "tool_choice"
    # A named function must be among the tools, once both are known.
    with pytest.raises(ChatOptionError, match=r"a function among the tools \(get_weather, roll_dice\)") as caught:
        ChatOptions(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "fly"}})
    assert caught.value.option == "tool_choice"
    # A chat's default choice may name a function its turns bring; a turn whose tools lack it is refused.
    default = ChatOptions(tool_choice=WEATHER)
    assert default.override(tools=TOOLS).tools == (WEATHER, Tool.from_openai(ROLL))
    with pytest.raises(ChatOptionError, match="tool_choice"):
        default.override(tools=[ROLL])
    # A choice that forces a call needs tools at the turn (an empty list is none).
    for forcing in (ChatOptions(tool_choice="required"), default, ChatOptions(tools=[], tool_choice="required")):
        with pytest.raises(ChatOptionError, match="without tools") as caught:
            forcing.check_turn()
        assert caught.value.option == "tool_choice"
    ChatOptions(tool_choice="none").check_turn()  # asks for nothing: fine without tools


def test_the_tool_inputs_are_sent_only_when_set() -> None:
    options = ChatOptions(tools=TOOLS, tool_choice=WEATHER)
    inputs = options.inputs()
    assert json.loads(inputs[proto.TOOLS][0]) == [WEATHER.to_openai(), ROLL]
    assert json.loads(inputs[proto.TOOL_CHOICE][0]) == {"type": "function", "function": {"name": "get_weather"}}
    assert ChatOptions(tools=TOOLS, tool_choice="required").inputs()[proto.TOOL_CHOICE][0] == b"required"
    assert not {proto.TOOLS, proto.TOOL_CHOICE} & set(ChatOptions().inputs())
    # An empty list clears a chat's tools for a turn: nothing is sent.
    assert proto.TOOLS not in ChatOptions(tools=TOOLS).override(tools=[]).inputs()


def test_a_message_carries_tool_fields_where_they_belong() -> None:
    assistant = ChatMessage("assistant", "", tool_calls=[CALL.to_openai()])  # OpenAI's mappings are taken too
    assert assistant.tool_calls == (CALL,)
    with pytest.raises(ChatMessageError, match="tool_calls belong to an assistant message"):
        ChatMessage("user", "hi", tool_calls=(CALL,))
    with pytest.raises(ChatMessageError, match="tool_call_id belongs to a tool message"):
        ChatMessage("assistant", "hi", tool_call_id="call_1")
    with pytest.raises(ChatMessageError, match="role"):
        ChatMessage("function", "hi")
    result = ChatMessage.tool_result(CALL, {"temperature": 21})
    assert result == ChatMessage("tool", '{"temperature": 21}', tool_call_id="call_1", name="get_weather")
    assert ChatMessage.tool_result("call_9", "sunny") == ChatMessage("tool", "sunny", tool_call_id="call_9")
    with pytest.raises(ChatMessageError, match="answers a ToolCall"):
        ChatMessage.tool_result("", "sunny")
    # TOOL_META and the digest: a plain message has none and digests as its role (as before tools).
    plain = ChatMessage("user", "hi")
    assert (plain.has_tool_fields, plain.tool_meta(), plain.digest_key) == (False, "", ("user", "hi"))
    assert json.loads(assistant.tool_meta()) == {
        "tool_calls": [{"id": "call_1", "name": "get_weather", "arguments": CALL.arguments}]
    }
    assert json.loads(result.tool_meta()) == {"tool_call_id": "call_1", "name": "get_weather"}
    calls = [("call_1", "get_weather", CALL.arguments)]
    assert assistant.digest_key == (digest_role("assistant", tool_calls=calls), "")
    assert result.digest_key[0] == digest_role("tool", tool_call_id="call_1", name="get_weather")


def test_a_turn_is_a_string_a_message_or_messages_ending_with_user_or_tool() -> None:
    assert as_turn("hi") == (ChatMessage("user", "hi"),)
    results = [ChatMessage.tool_result("a", "1"), ChatMessage.tool_result("b", "2")]
    assert as_turn(results) == tuple(results)
    assert as_turn([("system", "Be brief."), ("user", "hi")]) == (ChatMessage("system", "Be brief."),
                                                                  ChatMessage("user", "hi"))  # fmt: skip
    for bad, needle in [([], "at least one message"), ([ChatMessage("assistant", "x")], "last message"),
                        (ChatMessage("system", "x"), "last message"), (3, "a str, a ChatMessage"),
                        (["hi"], r"message\[0\]")]:  # fmt: skip
        with pytest.raises(ChatMessageError, match=needle):
            as_turn(bad)  # type: ignore[arg-type]


def test_the_state_round_trips_tool_fields_and_old_states_still_load() -> None:
    messages = (ChatMessage("user", "Weather?"), ChatMessage("assistant", "", tool_calls=(CALL,)),
                ChatMessage.tool_result(CALL, "sunny"), ChatMessage("assistant", "Fine."))  # fmt: skip
    state = ChatState(model=MODEL, sequence_id=7, messages=messages, pinned=0, digest="ab", turns=2,
                      context_tokens=90)  # fmt: skip
    data = json.loads(json.dumps(state.to_dict()))
    assert ChatState.from_dict(data) == state
    assert data["messages"][0] == {"role": "user", "text": "Weather?"}  # a plain message: as before tools
    assert data["messages"][2] == {"role": "tool", "text": "sunny", "tool_call_id": "call_1", "name": "get_weather"}
    old = {"model": MODEL, "sequence_id": 7, "messages": [{"role": "user", "text": "a"},
           {"role": "assistant", "text": "b"}], "pinned": 0, "digest": "", "turns": 1, "context_tokens": 5}  # fmt: skip
    assert ChatState.from_dict(old).messages == (ChatMessage("user", "a"), ChatMessage("assistant", "b"))
    for bad_message, needle in [
        ({"role": "assistant", "text": "", "tool_calls": [{"id": "c", "name": "f"}]}, "'id', 'name', 'arguments'"),
        ({"role": "assistant", "text": "", "tool_calls": [{"id": "c", "name": "f", "arguments": "[]"}]}, "object"),
        ({"role": "user", "text": "a", "tool_call_id": "c"}, "belongs to a tool message"),
        ({"role": "user", "text": "a", "calls": []}, "keys"),
    ]:
        with pytest.raises(ChatMessageError, match=re.escape(needle)):
            ChatState.from_dict({**old, "messages": [bad_message]})


class _Spec:
    """A model config from before tools: no tool inputs (the fit checks read only ``name`` and ``input``)."""

    name = "old_chat"

    def input(self, name: str) -> object:
        return None if name in (proto.TOOLS, proto.TOOL_CHOICE, proto.TOOL_META) else object()


def test_a_model_without_the_tool_inputs_refuses_tools_before_anything_is_sent() -> None:
    _check_options_fit(_Spec(), ChatOptions())  # type: ignore[arg-type]
    _check_messages_fit(_Spec(), [ChatMessage("user", "hi"), ChatMessage("assistant", "a")])  # type: ignore[arg-type]
    with pytest.raises(ChatOptionError, match="takes no TOOLS input") as caught:
        _check_options_fit(_Spec(), ChatOptions(tools=TOOLS))  # type: ignore[arg-type]
    assert caught.value.option == "tools"
    with pytest.raises(ChatOptionError, match="takes no TOOL_CHOICE input"):
        _check_options_fit(_Spec(), ChatOptions(tool_choice="none"))  # type: ignore[arg-type]
    for message in (ChatMessage.tool_result("c", "x"), ChatMessage("assistant", "", tool_calls=(CALL,))):
        with pytest.raises(ChatMessageError, match="takes no TOOL_META input"):
            _check_messages_fit(_Spec(), [message, ChatMessage("user", "hi")])  # type: ignore[arg-type]


# --- against the server -------------------------------------------------------------------------------------------


async def test_a_forced_call_validates_and_its_result_continues_on_the_device(client: Client) -> None:
    """Forced calls (required; a named function, as a dict and as a Tool) give ToolCall values whose arguments are
    valid for their schema, with no text; the result turn continues the conversation on the device: it prefills
    only the result in the template's framing (and the call as the template renders it), far less than the first
    turn's prompt (the tools and the system turn). The
    history holds the calls and the results as they were sent and received."""
    async with client.chat(MODEL, system="You help.", tools=TOOLS, max_tokens=CALL_TOKENS) as chat:
        streamed = [p async for p in chat.send("Weather in Bath?", tool_choice="required", temperature=0.8, seed=5)]
        first = chat.last_reply
        assert first is not None
        assert streamed == []  # nothing of the call's markup was streamed as text
        check_calls(first, {"get_weather", "roll_dice"})
        results = [ChatMessage.tool_result(c, {"ok": True}) for c in first.tool_calls]
        answered = await chat.ask(results, max_tokens=8)
        assert answered.tokens > 0
        assert answered.tool_calls == ()
        assert answered.finish_reason != "tool_calls"
        # Against the first turn's whole prompt (input_tokens): its own prefill may have come from prefix blocks
        # other conversations left.
        assert 0 < answered.prompt_tokens < first.input_tokens // 4, (answered.prompt_tokens, first.input_tokens)
        assert answered.input_tokens > first.input_tokens + first.tokens // 2  # conditioned on the whole history
        named = await chat.ask("Roll.", tool_choice={"type": "function", "function": {"name": "roll_dice"}})
        check_calls(named, {"roll_dice"})
        as_tool = await chat.ask([ChatMessage.tool_result(named.tool_calls[0], "4"), ChatMessage("user", "Bath?")],
                                 tool_choice=WEATHER)  # fmt: skip
        check_calls(as_tool, {"get_weather"})
        assert chat.messages[2:5] == (
            ChatMessage("assistant", "", tool_calls=first.tool_calls), *results,
            ChatMessage("assistant", answered.text),
        )  # fmt: skip
        assert chat.messages[-3:] == (ChatMessage.tool_result(named.tool_calls[0], "4"), ChatMessage("user", "Bath?"),
                                      ChatMessage("assistant", "", tool_calls=as_tool.tool_calls))  # fmt: skip
        # Every call id of the conversation is distinct (the server salts them with the prompt).
        ids = [c.id for r in (first, named, as_tool) for c in r.tool_calls]
        assert len(set(ids)) == len(ids)


async def test_the_digest_agrees_over_many_tool_turns(client: Client) -> None:
    """Six turns mixing forced calls, results, user messages and tool_choice none: every turn commits (the server's
    digest equals the client's, or ChatHistoryMismatch would be raised), and the client's chain is the protocol's
    over the messages as the history holds them."""
    async with client.chat(MODEL, tools=TOOLS, max_tokens=CALL_TOKENS) as chat:
        digest = EMPTY
        sent: list[ChatMessage] = []

        async def turn(message: Any, **options: Any) -> ChatReply:
            nonlocal digest
            reply = await chat.ask(message, **options)
            new = as_turn(message)
            calls = tuple((c.id, c.name, c.arguments) for c in reply.tool_calls)
            digest = history_digest(digest, [m.digest_key for m in new], reply.text, calls)
            sent.extend((*new, ChatMessage("assistant", reply.text, tool_calls=reply.tool_calls)))
            return reply

        call = await turn("Weather?", tool_choice="required")
        check_calls(call, {"get_weather", "roll_dice"})
        await turn([ChatMessage.tool_result(c, "cloudy") for c in call.tool_calls], max_tokens=6)
        call = await turn("Roll.", tool_choice=Tool.from_openai(ROLL))
        await turn(ChatMessage.tool_result(call.tool_calls[0].id, "6"), tool_choice="required")
        await turn([ChatMessage.tool_result(c, '{"x": 1}') for c in chat.last_reply.tool_calls],  # type: ignore[union-attr]
                   tool_choice="none", max_tokens=6)  # fmt: skip
        await turn("Thanks.", max_tokens=6, tools=[])  # no tools this turn: the history's calls render all the same
        assert chat.turns == 6
        assert chat.state.digest == digest
        assert chat.messages == tuple(sent)


async def test_replaying_the_messages_gives_the_live_chats_next_reply(client: Client) -> None:
    """After a call and its result, chat.messages replayed into a fresh chat (history=, one START carrying the
    calls in TOOL_META) gives the next reply the live chat gets, greedy: a forced call (ids included: salted with
    the same prompt) and a text reply."""
    options: dict[str, Any] = {"tools": TOOLS, "max_tokens": CALL_TOKENS}
    async with client.chat(MODEL, system="You help.", **options) as live:
        call = await live.ask("Weather in Bath?", tool_choice="required")
        await live.ask([ChatMessage.tool_result(c, "sunny") for c in call.tool_calls], max_tokens=6)
        history = live.messages
        live_call = await live.ask("And in Ely?", tool_choice=WEATHER)
        live_text = await live.ask(ChatMessage.tool_result(live_call.tool_calls[0], "rain"), max_tokens=10)
    check_calls(live_call, {"get_weather"})
    async with client.chat(MODEL, history=history, **options) as replay:
        replay_call = await replay.ask("And in Ely?", tool_choice=WEATHER)
        replay_text = await replay.ask(ChatMessage.tool_result(replay_call.tool_calls[0], "rain"), max_tokens=10)
    assert replay_call.tool_calls == live_call.tool_calls
    assert replay_text.text == live_text.text
    assert replay_text.tokens == live_text.tokens > 0
    assert replay_text.context_tokens == live_text.context_tokens


async def test_a_detached_tool_call_is_answered_from_its_state_in_another_chat(client: Client) -> None:
    """A chat detached right after a call; its state, through JSON, resumes in a new chat (no START: the server
    checks the state's digest, which covers the call), which sends the result; the reply equals the one a replay
    of the state's messages gets, on the same conversation."""
    async with client.chat(MODEL, tools=TOOLS, max_tokens=CALL_TOKENS) as chat:
        call = await chat.ask("Roll a die.", tool_choice="required")
        state = await chat.detach()
    check_calls(call, {"get_weather", "roll_dice"})
    restored = ChatState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert restored == state
    assert restored.messages[-1].tool_calls == call.tool_calls
    results = [ChatMessage.tool_result(c, "3") for c in call.tool_calls]
    async with client.chat(MODEL, resume=restored, tools=TOOLS) as resumed:
        answered = await resumed.ask(results, max_tokens=10)
        assert resumed.sequence_id == state.sequence_id
    async with client.chat(MODEL, history=state.messages, tools=TOOLS) as replay:
        replayed = await replay.ask(results, max_tokens=10)
    assert answered.text == replayed.text
    assert answered.tokens > 0
    # The same conversation on both (the replay's prefill may come from shared prefix blocks: not compared).
    assert answered.input_tokens == replayed.input_tokens
    assert answered.context_tokens == replayed.context_tokens


async def test_tool_errors_are_typed_and_harm_nothing(client: Client) -> None:
    """Refused before sending (typed, named): a named function not among the turn's tools, a forcing choice
    without tools, a turn ending with an assistant message. Refused by the server before any token: a parameters
    schema that does not compile (InvalidArgumentError naming TOOLS). The chat then goes on."""
    bad_schema = Tool("broken", parameters={"type": "wibble"})
    async with client.chat(MODEL, tools=TOOLS, max_tokens=6) as chat:
        with pytest.raises(ChatOptionError) as caught:
            chat.send("hi", tool_choice={"type": "function", "function": {"name": "fly"}})
        assert caught.value.option == "tool_choice"
        with pytest.raises(ChatOptionError, match="without tools"):
            chat.send("hi", tools=[], tool_choice="required")
        with pytest.raises(ChatMessageError, match="last message"):
            chat.send([ChatMessage("user", "hi"), ChatMessage("assistant", "x")])
        with pytest.raises(InvalidArgumentError, match="TOOLS"):
            await chat.ask("hi", tools=[bad_schema], tool_choice="required")
        assert chat.turns == 0
        reply = await chat.ask("hi")
        assert reply.tokens > 0
        assert chat.turns == 1


async def test_a_history_with_calls_replays_without_a_mismatch_and_tool_free_chats_digest_as_before(
    client: Client,
) -> None:
    """A history given at the open that holds a call and its result (fields sent in TOOL_META) commits; a chat
    without tools sends no tool input and its digest is the plain chain (role, text pairs)."""
    history = [ChatMessage("user", "Weather?"), ChatMessage("assistant", "", tool_calls=(CALL,)),
               ChatMessage.tool_result(CALL, "sunny"), ChatMessage("assistant", "Good.")]  # fmt: skip
    async with client.chat(MODEL, history=history, max_tokens=6) as chat:
        reply = await chat.ask("And tomorrow?")  # ChatHistoryMismatch if the two sides' digests differed
        assert reply.tokens > 0
        assert chat.state.digest == history_digest(EMPTY, [m.digest_key for m in (*history, chat.messages[-2])],
                                                   reply.text)  # fmt: skip
    async with client.chat(MODEL, max_tokens=6) as plain:
        first = await plain.ask("hi")
    pairs = [("user", "hi")]
    assert plain.state.digest == history_digest(EMPTY, pairs, first.text)


# --- the terminal ---------------------------------------------------------------------------------------------------


CALL_LINE = re.compile(r"^\u2192 (\w+)\((\{.*\})\)  \[(call_\w+)\]$", re.M)


def test_the_cli_shows_calls_and_sends_results(triton_server: LocalTriton, tmp_path: Path) -> None:
    """--tools FILE with --tool-choice NAME: each reply is a call, shown on stdout as one line; a line while it
    waits is refused; /result answers it and the next reply is the one the SDK gets for the same conversation."""
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER.to_openai(), ROLL]))
    url = triton_server.grpc_url
    with running("--url", url, "--tools", str(tools), "--tool-choice", "get_weather", "--max-tokens",
                 str(CALL_TOKENS)) as cli:  # fmt: skip
        cli.write("Weather in Bath?\n")
        cli.until(lambda o: b"/result TEXT answers get_weather" in o.err, "the call's notice")
        cli.write("Thanks.\n/result sunny\n")
        cli.until(lambda o: len(CALL_LINE.findall(o.out.decode())) == 2, "the second call")
        cli.write("/result\n/quit\n")  # an empty result is still a result
        code = cli.finish()
    assert code == 0, cli.err
    err = cli.err.decode()
    assert "triton-npu chat: 1 tool call awaits a result: /result TEXT answers get_weather" in err
    assert "finished: tool_calls" in err

    async def sdk() -> tuple[ChatReply, ChatReply, ChatReply]:
        async with Client(url, timeout_s=120) as c, c.chat(MODEL, tools=[WEATHER, ROLL], tool_choice=WEATHER,
                                                          max_tokens=CALL_TOKENS) as chat:  # fmt: skip
            one = await chat.ask("Weather in Bath?")
            two = await chat.ask(ChatMessage.tool_result(one.tool_calls[0], "sunny"))
            three = await chat.ask(ChatMessage.tool_result(two.tool_calls[0], ""))
            return one, two, three

    expected = asyncio.run(sdk())
    lines = [f"\u2192 {c.name}({c.arguments})  [{c.id}]" for r in expected for c in r.tool_calls]
    assert cli.out.decode() == "".join(f"{line}\n" for line in lines)


def test_bad_tool_flags_are_one_line_before_any_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing, non-JSON or badly shaped --tools file, a --tool-choice without --tools or naming a function the
    file lacks: one line, exit 2, and no server started ($TRITONSERVER is a tripwire, as in test_cli_chat)."""
    tripwire = tmp_path / "tritonserver"
    tripwire.write_text(TRIPWIRE)
    tripwire.chmod(0o755)
    marker = tmp_path / "started"
    monkeypatch.setenv("TRITONSERVER", str(tripwire))
    monkeypatch.setenv("TNC_TEST_TRIPWIRE", str(marker))
    files = {"broken.json": "[{", "object.json": '{"type": "function"}', "shape.json": '[{"type": "code"}]',
             "good.json": json.dumps([ROLL])}  # fmt: skip
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    cases = [
        (["--tools", str(tmp_path / "missing.json")], "cannot read the file"),
        (["--tools", str(tmp_path / "broken.json")], "not JSON"),
        (["--tools", str(tmp_path / "object.json")], "expected a JSON array of tools, given a JSON dict"),
        (["--tools", str(tmp_path / "shape.json")], "chat option 'tools'"),
        (["--tool-choice", "required"], "--tool-choice says how the model uses its tools: it needs --tools FILE"),
        (["--tools", str(tmp_path / "good.json"), "--tool-choice", "fly"], "chat option 'tool_choice'"),
    ]
    for args, needle in cases:
        code = cli_main(["chat", *args])
        out, err = capsys.readouterr()
        assert (code, out) == (2, ""), err
        assert err.startswith("triton-npu chat: ")
        assert needle in err
        assert err.count("\n") == 1
    assert not marker.exists(), "a server was started for a mistake"
