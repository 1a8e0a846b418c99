"""``response_format`` through the SDK and raw tritonclient, against a real Triton serving the demo chat model.

The demo model writes near gibberish, so a reply that validates does so because the server constrained it (the
engine's own tests, without Triton: tests/test_chat_constraints.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import numpy as np
import pytest
import tritonclient.grpc.aio as grpcclient

from triton_npu_client import ChatOptionError, ChatOptions, Client, InvalidArgumentError, LocalTriton, ResponseFormat
from triton_npu_client._protocol import chat as proto

MODEL = "chat"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 1,
                                                                        "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture
async def client(triton_server: LocalTriton) -> AsyncIterator[Client]:
    async with Client(triton_server.grpc_url, timeout_s=120) as c:
        yield c


# --- pure: the value ------------------------------------------------------------------------------


def test_openai_shapes_become_response_formats() -> None:
    from triton_npu_client._sessions._constraint import as_response_format

    nested = as_response_format({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON,
                                                                         "strict": True}})
    assert nested == ResponseFormat.json_schema(PERSON, strict=True, name="p")
    assert as_response_format({"type": "json_schema", "json_schema": {"schema": PERSON}}).strict is False  # type: ignore[union-attr]
    assert as_response_format({"type": "json_object"}) == ResponseFormat.json_object()
    assert as_response_format({"type": "text"}) is None
    assert as_response_format({"type": "regex", "pattern": "a+"}) == ResponseFormat.regex("a+")
    wire = json.loads(ResponseFormat.json_schema(PERSON).wire())
    assert wire == {"type": "json_schema", "schema": PERSON, "strict": True}
    assert json.loads(ResponseFormat.grammar('start: "x"').wire())["syntax"] == "lark"


@pytest.mark.parametrize(
    "value",
    [{"type": "xml"}, {"type": "json_schema"}, "json", 3, {"type": "regex", "pattern": ""},
     {"type": "grammar", "grammar": "x", "syntax": "ebnf"}],
)
def test_a_bad_response_format_is_refused_naming_it(value: Any) -> None:
    with pytest.raises(ChatOptionError, match="response_format"):
        ChatOptions(response_format=value)


def test_a_schema_that_is_not_json_is_refused() -> None:
    with pytest.raises(ChatOptionError, match="JSON-serialisable"):
        ResponseFormat.json_schema({"type": "object", "default": object()})


# --- against the server -----------------------------------------------------------------------------


async def test_json_schema_replies_validate_and_the_chat_goes_on(client: Client) -> None:
    """Three turns, each with its own format (a schema, OpenAI's mapping, a regex), in one conversation; then a turn
    without one. Each reply is valid for its format and the history holds them as the replies' text."""
    async with client.chat(MODEL, system="Answer.", max_tokens=80, temperature=0.9, seed=3) as chat:
        first = await chat.ask("Who is she?", response_format=ResponseFormat.json_schema(PERSON))
        jsonschema.validate(json.loads(first.text), PERSON)
        assert first.finish_reason == "stop"
        mapping = {"type": "json_schema", "json_schema": {"name": "colours", "strict": True, "schema": {
            "type": "array", "items": {"enum": ["red", "blue"]}, "minItems": 2, "maxItems": 2}}}
        second = await chat.ask("And the colours?", response_format=mapping)
        assert len(json.loads(second.text)) == 2
        third = await chat.ask("A date?", response_format=ResponseFormat.regex(r"20[0-9]{2}-[01][0-9]"))
        assert re.fullmatch(r"20[0-9]{2}-[01][0-9]", third.text)
        free = await chat.ask("Say more.", max_tokens=12)
        assert free.tokens > 0
        assert [m.text for m in chat.messages[2::2]] == [first.text, second.text, third.text, free.text]


async def test_a_format_set_on_the_chat_applies_to_every_turn_and_text_clears_it(client: Client) -> None:
    fmt = ResponseFormat.regex("(yes|no)")
    async with client.chat(MODEL, response_format=fmt, max_tokens=20) as chat:
        for q in ("Is it?", "Really?"):
            assert (await chat.ask(q)).text in ("yes", "no")
        cleared = await chat.ask("Tell me more.", response_format={"type": "text"}, max_tokens=20, min_tokens=20)
        assert cleared.tokens == 20
        assert cleared.text not in ("yes", "no")


async def test_a_constraint_that_does_not_compile_is_an_invalid_argument_and_harms_nothing(client: Client) -> None:
    """Refused before any token, naming CONSTRAINT and what is wrong; the same chat then goes on."""
    async with client.chat(MODEL, max_tokens=6) as chat:
        with pytest.raises(InvalidArgumentError, match=r"CONSTRAINT: the regex does not compile"):
            await chat.ask("hi", response_format=ResponseFormat.regex("[a-"))
        with pytest.raises(InvalidArgumentError, match=r"CONSTRAINT: the JSON schema does not compile"):
            await chat.ask("hi", response_format=ResponseFormat.json_schema({"type": "wibble"}))
        assert chat.turns == 0
        reply = await chat.ask("hi")
        assert reply.tokens > 0
        assert chat.turns == 1


async def test_raw_tritonclient_sends_a_constraint_too(triton_server: LocalTriton) -> None:
    """The CONSTRAINT input is plain protocol: a tritonclient stream on the stateless twin gets a valid reply."""
    client = grpcclient.InferenceServerClient(triton_server.grpc_url.removeprefix("grpc://"))
    constraint = json.dumps({"type": "json_schema", "schema": PERSON})

    def tensor(name: str, value: np.ndarray[Any, Any], dtype: str) -> grpcclient.InferInput:
        t = grpcclient.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        return t

    inputs = [
        tensor(proto.ROLE, np.array([[b"user"]], dtype=object), "BYTES"),
        tensor(proto.TEXT, np.array([[b"Who is she?"]], dtype=object), "BYTES"),
        tensor(proto.MAX_TOKENS, np.array([[80]], dtype=np.int32), "INT32"),
        tensor(proto.CONSTRAINT, np.array([[constraint.encode()]], dtype=object), "BYTES"),
    ]

    async def requests() -> AsyncIterator[dict[str, Any]]:
        yield {"model_name": "chat_stateless", "inputs": inputs}

    pieces = []
    finish = b""
    try:
        async for result, error in client.stream_infer(requests()):
            assert error is None, error
            pieces.append(result.as_numpy(proto.PIECE).reshape(-1)[0])
            finish = result.as_numpy(proto.FINISH).reshape(-1)[0] if result.get_output(proto.FINISH) else b""
            if finish:
                break
    finally:
        await client.close()
    assert finish == b"stop"
    jsonschema.validate(json.loads(b"".join(pieces)), PERSON)
