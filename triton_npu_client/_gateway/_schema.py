"""Request bodies of the OpenAI API, checked and turned into frozen values before anything costs a token.

Each endpoint's body is read by one function (:func:`chat_request`, :func:`embedding_request`,
:func:`response_request`, :func:`conversation_request`, :func:`conversation_items_request`,
:func:`conversation_update_request`; the item routes' queries by :func:`item_list_query` and :func:`item_query`).
The rules, the same for all:

- **Known parameters only.** A parameter this gateway implements is checked (type, range, caps); one it does not
  implement (``logit_bias``, legacy ``functions``, hosted tools, images, audio, ...) is refused
  with a 400 that names it, never ignored; a parameter OpenAI does not define is refused the way OpenAI refuses it.
  A refused parameter given at its neutral value (``logit_bias: {}``, ``functions: []``) is accepted: it asks for
  nothing.
- **Caps before cost.** Message counts, text bytes, stop strings and embedding inputs are capped here (see
  :class:`Limits`), so an absurd request is refused before it reaches a replica.
- **Text only.** Content is a string or a list of text parts; any other part type is refused. Embeddings also take
  token arrays, the encoder's own ids (:mod:`._tokens`).
- **Tools** are function tools (:mod:`._tools` reads them, their ``tool_choice``, and the calls and results in
  messages and items); a tool result must answer a call of the assistant message it follows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from .._errors import ChatOptionError
from .._sessions import ChatMessage, ResponseFormat, Tool, as_response_format
from ._errors import APIError, invalid, refused
from ._errors import kind_of as _kind
from ._errors import shown as _shown
from ._tools import (
    MessageRecord,
    ToolChoice,
    call_of_item,
    chat_tool_calls,
    check_tool_results,
    merged,
    output_of_item,
    read_tool_choice,
    read_tools,
    records,
    tool_name,
)

__all__ = [
    "ChatRequest",
    "ConversationRequest",
    "EmbeddingRequest",
    "Generation",
    "Limits",
    "ResponseRequest",
    "chat_request",
    "ConversationItemsRequest",
    "ItemListQuery",
    "conversation_items_request",
    "conversation_request",
    "conversation_update_request",
    "embedding_request",
    "item_list_query",
    "item_query",
    "format_echo",
    "response_request",
]

_INT32_MAX: Final = 2**31 - 1
_INT64_MAX: Final = 2**63 - 1


@attrs.frozen(kw_only=True)
class Limits:
    """What one request may carry; beyond it the request is refused with a 400 (413 for the body itself)."""

    max_body_bytes: int = 4 * 1024 * 1024
    max_messages: int = 512
    max_text_bytes: int = 65536  # one message's text, as the chat model's max_message_bytes
    max_stops: int = 16
    max_stop_bytes: int = 256
    max_embedding_inputs: int = 2048
    max_embedding_text_bytes: int = 65536
    # One token array's ids: OpenAI's own cap on an embedding input (LangChain sends chunks of up to 8191).
    max_embedding_token_ids: int = 8192
    max_metadata_pairs: int = 16
    max_conversation_items: int = 20  # items one POST /v1/conversations/{id}/items adds, OpenAI's cap
    max_tokens: int = 32768
    max_tools: int = 128  # OpenAI's cap on the tools of one request
    max_tool_bytes: int = 262144  # the tools' definitions as JSON
    max_tool_calls: int = 128  # the calls of one assistant message


@attrs.frozen(kw_only=True)
class Generation:
    """The generation options of one turn, as the SDK's chat takes them (``None``: the model's default)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    response_format: ResponseFormat | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logprobs: int | None = None  # alternatives per token with each token's log-probability (None: none asked)
    tools: tuple[Tool, ...] | None = None  # the functions the model may call (None: none given)
    tool_choice: ToolChoice | None = None  # the SDK's shape (None: not given, the model's default, auto)

    @property
    def calls_possible(self) -> bool:
        """Whether the reply may be tool calls: tools are given, and tool_choice is not ``none``."""
        return bool(self.tools) and self.tool_choice != "none"

    def options(self) -> dict[str, Any]:
        """Keyword arguments for ``ChatSession.send``: only the options given. No output cap given is no cap (the
        SDK's ``max_tokens=0``): the reply may run to the end of the context, as OpenAI's do, and the response says
        ``max_output_tokens: null`` because none applied."""
        given = {k: v for k, v in attrs.asdict(self, recurse=False).items() if v is not None}
        if not self.tools:
            # No tools: a tool_choice of none or auto asks for nothing (required and named ones need tools).
            given.pop("tools", None)
            given.pop("tool_choice", None)
        given.setdefault("max_tokens", 0)
        return given


@attrs.frozen(kw_only=True)
class ChatRequest:
    model: str
    messages: tuple[ChatMessage, ...]
    generation: Generation
    stream: bool
    include_usage: bool
    user: str | None
    n: int = 1  # choices: each its own conversation on the same history (seed + i when a seed is given)
    parallel_tool_calls: bool | None = None  # as given (the model's calls are not cut to one: docs/openai.md)


@attrs.frozen(kw_only=True)
class EmbeddingRequest:
    model: str
    texts: tuple[str, ...]  # empty when the input is token arrays
    #: The input as token arrays (the encoder's own ids), or None when it is text.
    token_ids: tuple[tuple[int, ...], ...] | None = None
    single: bool  # input was one string or one token array (the response still lists one embedding)
    base64: bool
    user: str | None


@attrs.frozen(kw_only=True)
class ResponseRequest:
    model: str
    #: This turn's input as messages (the last one is the user's or a tool result), and as the API lists them
    #: (input_items); a record per item (the conversation's), and the index of each message's first item.
    messages: tuple[ChatMessage, ...]
    items: tuple[dict[str, Any], ...]
    records: tuple[MessageRecord, ...]
    item_of: tuple[int, ...]
    instructions: str | None
    previous_response_id: str | None
    conversation: str | None
    generation: Generation
    stream: bool
    store: bool
    metadata: dict[str, str]
    user: str | None
    truncation: str
    #: What the response echoes: the tools (flat, as Responses lists them), tool_choice, parallel_tool_calls.
    tools_echo: tuple[dict[str, Any], ...] = ()
    tool_choice_echo: ToolChoice = "auto"
    parallel_tool_calls: bool = True


@attrs.frozen(kw_only=True)
class ConversationRequest:
    items: tuple[dict[str, Any], ...]
    records: tuple[MessageRecord, ...]  # one per item
    metadata: dict[str, str]


@attrs.frozen(kw_only=True)
class ConversationItemsRequest:
    """``POST /v1/conversations/{id}/items``: the items to append, as given, and a record of each."""

    items: tuple[dict[str, Any], ...]
    records: tuple[MessageRecord, ...]


@attrs.frozen(kw_only=True)
class ItemListQuery:
    """``GET /v1/conversations/{id}/items``: a page of ``limit`` items after the item ``after``, in ``order``."""

    limit: int
    order: str  # "asc" (oldest first) or "desc"
    after: str | None


# --- small readers ----------------------------------------------------------------------------------------------


def _str(body: Mapping[str, Any], key: str, *, required: bool = False, max_bytes: int = 256) -> str | None:
    value = body.get(key)
    if value is None:
        if required:
            raise APIError(400, f"Missing required parameter: '{key}'.", param=key, code="missing_required_parameter")
        return None
    if not isinstance(value, str):
        raise invalid(key, f"{key}: expected a string, given {_kind(value)}", code="invalid_type")
    if len(value.encode("utf-8", "surrogatepass")) > max_bytes:
        raise invalid(key, f"{key}: at most {max_bytes} bytes, given {len(value.encode('utf-8', 'surrogatepass'))}")
    return value


def _bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(key, f"{key}: expected a boolean, given {_kind(value)}", code="invalid_type")
    return value


def _int(body: Mapping[str, Any], key: str, low: int, high: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(key, f"{key}: expected an integer, given {_kind(value)}", code="invalid_type")
    if not low <= value <= high:
        raise invalid(key, f"{key}: expected an integer in {low}..{high}, given {value}")
    return value


def _number(body: Mapping[str, Any], key: str, low: float, high: float, *, open_low: bool = False) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid(key, f"{key}: expected a number, given {_shown(value)}", code="invalid_type")
    if value > high or value < low or (open_low and value == low):
        bound = f"({low}, {high}]" if open_low else f"[{low}, {high}]"
        raise invalid(key, f"{key}: expected a number in {bound}, given {value}")
    return float(value)


def _utf8(param: str, text: str, limit: int) -> str:
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise invalid(param, f"{param}: the text is not valid UTF-8 (a lone surrogate)") from None
    if size > limit:
        raise invalid(param, f"{param}: at most {limit} bytes of text, given {size}", code="string_above_max_length")
    return text


# Parameters OpenAI defines that this gateway does not implement, with the value that asks for nothing.
_NEUTRAL: Final[dict[str, Any]] = {
    "functions": [],
    "logit_bias": {},
    "background": False,
    "max_tool_calls": None,
    "modalities": ["text"],
    "include": [],
}
_REFUSED_WHAT: Final[dict[str, str]] = {
    "functions": "legacy function calling (give tools and tool_choice)",
    "function_call": "legacy function calling (give tools and tool_choice)",
    "max_tool_calls": "a cap on tool calls",
    "response_format": "a response format other than text",
    "text": "a text format other than plain text",
    "logit_bias": "logit biases",
    "audio": "audio output",
    "modalities": "modalities other than text",
    "prediction": "predicted outputs",
    "reasoning": "reasoning options",
    "reasoning_effort": "reasoning options",
    "web_search_options": "web search",
    "background": "background responses",
    "include": "extra output data (include)",
    "prompt": "prompt templates",
    "service_tier": "service tiers",
    "verbosity": "verbosity",
    "dimensions": "a number of dimensions other than the model's",
    "stream_options": "stream options",
}


def _neutral(key: str, value: Any) -> bool:
    if key == "function_call":
        return value in ("none", "auto", None)
    if key == "response_format":
        return bool(value == {"type": "text"})
    if key == "text":
        return value in ({"format": {"type": "text"}}, {})
    if key == "service_tier":
        return value in ("auto", "default")
    return key in _NEUTRAL and bool(value == _NEUTRAL[key])


def _check_keys(body: Mapping[str, Any], known: frozenset[str]) -> None:
    for key, value in body.items():
        if key in known:
            continue
        if value is None or _neutral(key, value):
            continue
        if key in _REFUSED_WHAT:
            raise refused(key, _REFUSED_WHAT[key])
        raise APIError(400, f"Unrecognized request argument supplied: {key}", param=key, code="unknown_parameter")


def _stop(body: Mapping[str, Any], limits: Limits) -> tuple[str, ...] | None:
    value = body.get("stop")
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop", f"stop: expected a non-empty string or an array of them, given {_shown(value)}")
    if len(stops) > limits.max_stops:
        raise invalid("stop", f"stop: at most {limits.max_stops} strings, given {len(stops)}")
    for s in stops:
        _utf8("stop", s, limits.max_stop_bytes)
    return tuple(stops)


def _metadata(body: Mapping[str, Any], limits: Limits) -> dict[str, str]:
    value = body.get("metadata")
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise invalid("metadata", f"metadata: expected an object of string values, given {_kind(value)}")
    if len(value) > limits.max_metadata_pairs:
        raise invalid("metadata", f"metadata: at most {limits.max_metadata_pairs} pairs, given {len(value)}")
    for k, v in value.items():
        _utf8("metadata", k, 64)
        _utf8("metadata", v, 512)
    return dict(value)


_ROLES: Final = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _content(param: str, content: object, limits: Limits, part_types: frozenset[str]) -> str:
    """A message's content as one text: a string, or a list of text parts (joined without separator)."""
    if isinstance(content, str):
        return _utf8(param, content, limits.max_text_bytes)
    if not isinstance(content, list):
        raise invalid(param, f"{param}: expected a string or an array of text parts, given {_kind(content)}")
    texts: list[str] = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise invalid(where, f"{where}: expected a content part object, given {_kind(part)}")
        kind = part.get("type")
        if kind not in part_types:
            raise refused(f"{where}.type", f"content of type {kind!r} (text only: {', '.join(sorted(part_types))})")
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"{where}.text", f"{where}.text: expected a string, given {_kind(text)}")
        # What the gateway writes into an output part is taken back as input (a client replays its history as the
        # items it got): annotations and logprobs describe the text, and ask for nothing.
        for key in ("annotations", "logprobs"):
            if part.get(key) is not None and not isinstance(part[key], list):
                raise invalid(f"{where}.{key}", f"{where}.{key}: expected an array, given {_kind(part[key])}")
        extra = set(part) - {"type", "text", "annotations", "logprobs"}
        if extra:
            raise refused(f"{where}.{sorted(extra)[0]}", "content part fields other than type and text")
        texts.append(text)
    return _utf8(param, "".join(texts), limits.max_text_bytes)


def _message(where: str, item: object, limits: Limits, part_types: frozenset[str], *, responses: bool) -> ChatMessage:
    """One message: Chat Completions' (``tool`` results and an assistant's ``tool_calls`` too) or a Responses
    message item (its calls and their results are items of their own: :func:`_items`)."""
    if not isinstance(item, dict):
        raise invalid(where, f"{where}: expected a message object, given {_kind(item)}")
    role = item.get("role")
    if role == "function":
        raise refused(f"{where}.role", "messages of role 'function' (legacy function calling: send the result as a "
                      "message of role 'tool' with its tool_call_id)")  # fmt: skip
    if role == "tool" and responses:
        raise invalid(f"{where}.role", f"{where}.role: a tool's result is a function_call_output item (type, call_id, "
                      "output), not a message")  # fmt: skip
    if role not in _ROLES and role != "tool":
        raise invalid(f"{where}.role", f"{where}.role: expected one of {', '.join([*_ROLES, 'tool'])}, given "
                      f"{_shown(role)}")  # fmt: skip
    allowed = {"role", "content", "type", "id", "status"} if responses else {"role", "content"}
    if not responses and role == "assistant":
        allowed.add("tool_calls")
    if role == "tool":
        allowed |= {"tool_call_id", "name"}
    for key in item:
        if key not in allowed and item[key] is not None:
            if key == "function_call":
                raise refused(f"{where}.function_call", "legacy function calling (give the call in tool_calls)")
            raise refused(f"{where}.{key}", f"the message field {key!r}")
    calls: tuple[Any, ...] = ()
    if item.get("tool_calls") is not None:
        calls = chat_tool_calls(f"{where}.tool_calls", item["tool_calls"], limits.max_tool_calls)
    content = item.get("content")
    text = "" if content is None and calls else _content(f"{where}.content", content, limits, part_types)
    if role == "tool":
        call_id = item.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise invalid(f"{where}.tool_call_id", f"{where}.tool_call_id: a tool result names the call it answers "
                          f"(its id), given {_shown(call_id)}")  # fmt: skip
        return ChatMessage("tool", text, tool_call_id=call_id, name=tool_name(f"{where}.name", item.get("name")))
    return ChatMessage(_ROLES[role], text, tool_calls=calls)


def _messages(where: str, value: object, limits: Limits, part_types: frozenset[str]) -> list[ChatMessage]:
    """Chat Completions' ``messages``; a tool result must answer a call of the assistant message it follows."""
    if not isinstance(value, list) or not value:
        raise invalid(where, f"{where}: expected a non-empty array of messages, given {_kind(value)}")
    if len(value) > limits.max_messages:
        raise invalid(where, f"{where}: at most {limits.max_messages} messages, given {len(value)}")
    messages = [_message(f"{where}[{i}]", m, limits, part_types, responses=False) for i, m in enumerate(value)]
    found = check_tool_results(messages)
    if found is not None:
        param = f"{where}[{found[0]}].tool_call_id"
        raise invalid(param, f"{param}: {found[1]}")
    return messages


def _body(body: object) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise invalid(None, f"the request body must be a JSON object, given {_kind(body)}", code="invalid_json")
    return body


# --- the endpoints -------------------------------------------------------------------------------------------------

#: OpenAI's penalties, and vLLM's repetition_penalty (what clients send it as an extra body field).
_PENALTY_KEYS: Final = ("presence_penalty", "frequency_penalty", "repetition_penalty")


def _response_format(param: str, value: object) -> ResponseFormat | None:
    """A ``response_format`` (Chat Completions) or ``text.format`` (Responses, whose json_schema is flat) value."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid(param, f"{param}: expected an object with a 'type', given {_kind(value)}")
    kind = value.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise invalid(param, f"{param}.type: expected 'text', 'json_object' or 'json_schema', given {_shown(kind)}")
    if kind == "json_schema":
        holder = value.get("json_schema", value)
        if not isinstance(holder, dict) or not isinstance(holder.get("schema"), dict):
            raise invalid(param, f"{param}: a json_schema format needs 'schema', a JSON schema object")
    try:
        return as_response_format(value)
    except ChatOptionError as err:
        raise invalid(param, f"{param}: expected {err.expected}, given {_shown(err.given)}") from None


def format_echo(fmt: ResponseFormat | None) -> dict[str, Any]:
    """``text.format`` as a response shows it: the format the turn ran under."""
    if fmt is None:
        return {"type": "text"}
    if fmt.kind == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "name": fmt.name or "response", "schema": fmt.schema, "strict": fmt.strict,
            "description": None}  # fmt: skip


#: The most choices one Chat Completions request may ask for (each is a conversation on the server).
_MAX_CHOICES: Final = 16
#: OpenAI's cap on top_logprobs (the chat model's too).
_TOP_LOGPROBS: Final = 20
#: The one ``include`` value there is something for here.
_LOGPROBS_INCLUDE: Final = "message.output_text.logprobs"


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """Chat Completions: ``logprobs: true`` asks for each token's, ``top_logprobs`` for that many alternatives."""
    wanted = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", 0, _TOP_LOGPROBS)
    if top is not None and not wanted:
        raise invalid("top_logprobs", "top_logprobs: only with logprobs: true")
    return (top or 0) if wanted else None


def _response_logprobs(body: Mapping[str, Any]) -> int | None:
    """Responses: ``include: ["message.output_text.logprobs"]`` asks for them, ``top_logprobs`` for alternatives."""
    include = body.get("include")
    if include is None:
        include = []
    if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
        raise invalid("include", f"include: expected an array of strings, given {_kind(include)}")
    for value in include:
        if value != _LOGPROBS_INCLUDE:
            raise refused("include", f"extra output data other than {_LOGPROBS_INCLUDE} (given {_shown(value)})")
    top = _int(body, "top_logprobs", 0, _TOP_LOGPROBS)
    if _LOGPROBS_INCLUDE in include or top:
        return top or 0
    return None


def _penalties(body: Mapping[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key in ("presence_penalty", "frequency_penalty"):
        out[key] = _number(body, key, -2.0, 2.0)
    out["repetition_penalty"] = _number(body, "repetition_penalty", 0.0, 10.0, open_low=True)
    return out


_CHAT_KEYS: Final = frozenset(
    {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "user",
     "stream", "stream_options", "metadata", "store", "response_format", "logprobs", "top_logprobs", "n",
     "tools", "tool_choice", "parallel_tool_calls", *_PENALTY_KEYS}
)  # fmt: skip
_CHAT_PARTS: Final = frozenset({"text"})


def _max_tokens(body: Mapping[str, Any], keys: Sequence[str], limits: Limits) -> int | None:
    given = [(k, _int(body, k, 1, limits.max_tokens)) for k in keys]
    values = [(k, v) for k, v in given if v is not None]
    if len(values) > 1 and len({v for _, v in values}) > 1:
        raise invalid(keys[0], f"{' and '.join(keys)} differ ({values[0][1]} and {values[1][1]}); give one")
    return values[0][1] if values else None


def _tool_options(
    body: Mapping[str, Any], limits: Limits, *, flat: bool
) -> tuple[tuple[Tool, ...], tuple[dict[str, Any], ...], ToolChoice | None, ToolChoice, bool | None]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls``: the tools, their echo, the SDK's choice and its echo,
    and parallel_tool_calls as given."""
    tools, echo = read_tools(
        "tools", body.get("tools"), flat=flat, max_tools=limits.max_tools, max_bytes=limits.max_tool_bytes
    )
    choice, choice_echo = read_tool_choice("tool_choice", body.get("tool_choice"), [t.name for t in tools], flat=flat)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls", f"parallel_tool_calls: expected a boolean, given {_kind(parallel)}",
                      code="invalid_type")  # fmt: skip
    return tools, echo, choice, choice_echo, parallel


def _last_is_the_callers(param: str, messages: Sequence[ChatMessage], what: str) -> None:
    if messages[-1].role not in ("user", "tool"):
        raise invalid(param, f"the last {what} must be the user's or a tool's result (the reply follows it), given "
                      f"role {messages[-1].role!r}")  # fmt: skip


def chat_request(raw: object, limits: Limits) -> ChatRequest:
    """``POST /v1/chat/completions``: the whole conversation each request; the last message is the user's or a
    tool's result."""
    body = _body(raw)
    _check_keys(body, _CHAT_KEYS)
    model = _str(body, "model", required=True)
    assert model is not None
    messages = _messages("messages", body.get("messages"), limits, _CHAT_PARTS)
    _last_is_the_callers(f"messages[{len(messages) - 1}].role", messages, "message")
    tools, _, choice, _, parallel = _tool_options(body, limits, flat=False)
    stream = _bool(body, "stream", False)
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise invalid("stream_options", "stream_options: only with stream: true")
        if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
            raise refused("stream_options", f"stream options other than include_usage (given {_shown(options)})")
        include_usage = _bool(options, "include_usage", False)
    if body.get("store") not in (None, False):
        raise refused("store", "storing chat completions (use /v1/responses, which stores)")
    _metadata(body, limits)
    return ChatRequest(
        model=model,
        messages=tuple(messages),
        generation=_generation(
            body,
            ("max_completion_tokens", "max_tokens"),
            limits,
            _response_format("response_format", body.get("response_format")),
            _chat_logprobs(body),
            tools=tools,
            tool_choice=choice,
        ),
        stream=stream,
        include_usage=include_usage,
        user=_str(body, "user"),
        n=_int(body, "n", 1, _MAX_CHOICES) or 1,
        parallel_tool_calls=parallel,
    )


def _generation(
    body: Mapping[str, Any],
    max_keys: Sequence[str],
    limits: Limits,
    response_format: ResponseFormat | None = None,
    logprobs: int | None = None,
    *,
    tools: tuple[Tool, ...] = (),
    tool_choice: ToolChoice | None = None,
) -> Generation:
    return Generation(
        tools=tools or None,
        tool_choice=tool_choice,
        max_tokens=_max_tokens(body, max_keys, limits),
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0, open_low=True),
        seed=_int(body, "seed", -_INT64_MAX - 1, _INT64_MAX),
        stop=_stop(body, limits),
        response_format=response_format,
        logprobs=logprobs,
        **_penalties(body),
    )


_EMBED_KEYS: Final = frozenset({"model", "input", "encoding_format", "user"})


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_array(where: str, row: object, limits: Limits) -> tuple[int, ...]:
    if not isinstance(row, list) or not row:
        raise invalid(where, f"{where}: an empty token array has no embedding")
    if len(row) > limits.max_embedding_token_ids:
        raise invalid(where, f"{where}: at most {limits.max_embedding_token_ids} token ids, given {len(row)}")
    for j, value in enumerate(row):
        if not _is_id(value) or not 0 <= value <= _INT64_MAX:
            shown = _shown(value)
            raise invalid(f"{where}[{j}]", f"{where}[{j}]: expected a token id (an integer >= 0), given {shown}")
    return tuple(row)


def embedding_request(raw: object, limits: Limits) -> EmbeddingRequest:
    """``POST /v1/embeddings``: ``input`` a string, an array of strings, a token array (integers) or an array of token
    arrays. Token ids are the encoder's own (its tokenizer's vocabulary): the gateway cannot tell another
    tokenizer's ids from them, so the encoder checks them against its vocabulary (see ``Gateway.embeddings``)."""
    body = _body(raw)
    _check_keys(body, _EMBED_KEYS)
    model = _str(body, "model", required=True)
    assert model is not None
    value = body.get("input")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64", None):
        raise invalid("encoding_format", f"encoding_format: expected 'float' or 'base64', given {_shown(encoding)}")
    expected = "a string, an array of strings, a token array or an array of token arrays"
    if isinstance(value, list) and value and _is_id(value[0]):
        # One token array, as OpenAI reads an array of integers: one input.
        row = _token_array("input", value, limits)
        return EmbeddingRequest(model=model, texts=(), token_ids=(row,), single=True, base64=encoding == "base64",
                                user=_str(body, "user"))  # fmt: skip
    single = isinstance(value, str)
    texts = [value] if single else value
    if not isinstance(texts, list) or not texts:
        raise invalid("input", f"input: expected {expected} (non-empty), given {_kind(value)}")
    if len(texts) > limits.max_embedding_inputs:
        raise invalid("input", f"input: at most {limits.max_embedding_inputs} inputs, given {len(texts)}")
    if isinstance(texts[0], list):
        for i, row in enumerate(texts):
            if not isinstance(row, list):
                raise invalid(f"input[{i}]", f"input[{i}]: expected a token array like input[0], given {_kind(row)}")
        rows = tuple(_token_array(f"input[{i}]", row, limits) for i, row in enumerate(texts))
        return EmbeddingRequest(model=model, texts=(), token_ids=rows, single=False, base64=encoding == "base64",
                                user=_str(body, "user"))  # fmt: skip
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise invalid(f"input[{i}]", f"input[{i}]: expected a string like input[0], given {_kind(text)}")
        if not text:
            raise invalid(f"input[{i}]", f"input[{i}]: an empty string has no embedding")
        _utf8(f"input[{i}]", text, limits.max_embedding_text_bytes)
    return EmbeddingRequest(
        model=model, texts=tuple(texts), single=single, base64=encoding == "base64", user=_str(body, "user")
    )


_RESPONSE_KEYS: Final = frozenset(
    {"model", "input", "instructions", "previous_response_id", "conversation", "max_output_tokens", "temperature",
     "top_p", "seed", "stop", "stream", "store", "metadata", "user", "truncation", "prompt_cache_key",
     "safety_identifier", "stream_options", "text", "top_logprobs", "include", "tools", "tool_choice",
     "parallel_tool_calls", *_PENALTY_KEYS}
)  # fmt: skip
_INPUT_PARTS: Final = frozenset({"input_text", "output_text", "text"})


@attrs.frozen(kw_only=True)
class _Input:
    """Input items as the model reads them (``messages``: a reply's text and calls joined into one assistant
    message), as the API lists them (``items``, no ids yet), one record per item, and each message's first item."""

    messages: tuple[ChatMessage, ...]
    items: tuple[dict[str, Any], ...]
    records: tuple[MessageRecord, ...]
    item_of: tuple[int, ...]


def _items(where: str, value: object, limits: Limits) -> _Input:
    """Input items (a string is one user message): messages, ``function_call`` items (an assistant's calls) and
    ``function_call_output`` items (a tool's results). What the gateway writes into an output item (ids, statuses,
    an output_text part's annotations and logprobs) is taken back as it is."""
    if isinstance(value, str):
        text = _utf8(where, value, limits.max_text_bytes)
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
        return _Input(messages=(ChatMessage("user", text),), items=(item,), records=(("user", text),), item_of=(0,))
    if not isinstance(value, list) or not value:
        raise invalid(where, f"{where}: expected a string or a non-empty array of input items, given {_kind(value)}")
    if len(value) > limits.max_messages:
        raise invalid(where, f"{where}: at most {limits.max_messages} items, given {len(value)}")

    def text_of(param: str, content: object) -> str:
        return _content(param, content, limits, _INPUT_PARTS)

    each: list[ChatMessage] = []
    items: list[dict[str, Any]] = []
    for i, given in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(given, dict):
            raise invalid(at, f"{at}: expected an input item object, given {_kind(given)}")
        kind = given.get("type", "message")
        if kind == "message":
            m = _message(at, given, limits, _INPUT_PARTS, responses=True)
            part = "output_text" if m.role == "assistant" else "input_text"
            items.append({"type": "message", "role": given["role"], "content": [{"type": part, "text": m.text}]})
        elif kind == "function_call":
            call = call_of_item(at, given)
            m = ChatMessage("assistant", "", tool_calls=(call,))
            items.append({"type": "function_call", "call_id": call.id, "name": call.name,
                          "arguments": call.arguments, "status": "completed"})  # fmt: skip
        elif kind == "function_call_output":
            call_id, text, name = output_of_item(at, given, text_of)
            m = ChatMessage("tool", text, tool_call_id=call_id, name=name)
            item = {"type": "function_call_output", "call_id": call_id, "output": text, "status": "completed"}
            if name is not None:
                item["name"] = name
            items.append(item)
        else:
            raise refused(f"{at}.type", f"input items of type {kind!r} (messages, function_call and "
                          "function_call_output only)")  # fmt: skip
        each.append(m)
    joined = merged(each)
    return _Input(
        messages=tuple(m for _, m in joined),
        items=tuple(items),
        records=records(each),
        item_of=tuple(i for i, _ in joined),
    )


def _text_format(value: object) -> ResponseFormat | None:
    """Responses' ``text``: ``{"format": {...}}`` (and a ``verbosity`` of medium, the only one there is here)."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"format", "verbosity"}:
        raise invalid("text", f"text: expected an object with a 'format', given {_shown(value)}")
    if value.get("verbosity") not in (None, "medium"):
        raise refused("text.verbosity", "verbosity other than medium")
    return _response_format("text.format", value.get("format"))


def response_request(raw: object, limits: Limits) -> ResponseRequest:
    """``POST /v1/responses``: this turn's input; the history comes from ``previous_response_id`` or
    ``conversation``."""
    body = _body(raw)
    _check_keys(body, _RESPONSE_KEYS)
    model = _str(body, "model", required=True)
    assert model is not None
    if body.get("input") is None:
        raise APIError(400, "Missing required parameter: 'input'.", param="input", code="missing_required_parameter")
    given = _items("input", body.get("input"), limits)
    _last_is_the_callers("input", given.messages, "input item")
    tools, tools_echo, choice, choice_echo, parallel = _tool_options(body, limits, flat=True)
    stream = _bool(body, "stream", False)
    previous = _str(body, "previous_response_id")
    conversation = body.get("conversation")
    if isinstance(conversation, dict):
        conversation = conversation.get("id")
    if conversation is not None and not isinstance(conversation, str):
        raise invalid(
            "conversation", f"conversation: expected an id string or {{'id': ...}}, given {_kind(conversation)}"
        )
    if previous is not None and conversation is not None:
        raise invalid("conversation", "previous_response_id and conversation cannot both be given; give one")
    truncation = body.get("truncation", "disabled")
    if truncation not in ("disabled", "auto", None):
        raise invalid("truncation", f"truncation: expected 'auto' or 'disabled', given {_shown(truncation)}")
    options = body.get("stream_options")
    if options is not None:
        # include_usage: Responses' stream always ends with the usage (response.completed), so it asks for nothing.
        if not stream:
            raise invalid("stream_options", "stream_options: only with stream: true")
        if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
            raise refused("stream_options", f"stream options other than include_usage (given {_shown(options)})")
        _bool(options, "include_usage", False)
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise refused("instructions", "instructions other than a string")
        _utf8("instructions", instructions, limits.max_text_bytes)
    for key in ("prompt_cache_key", "safety_identifier"):
        _str(body, key)
    return ResponseRequest(
        model=model,
        messages=given.messages,
        items=given.items,
        records=given.records,
        item_of=given.item_of,
        instructions=instructions,
        previous_response_id=previous,
        conversation=conversation,
        generation=_generation(
            body,
            ("max_output_tokens",),
            limits,
            _text_format(body.get("text")),
            _response_logprobs(body),
            tools=tools,
            tool_choice=choice,
        ),
        stream=stream,
        store=_bool(body, "store", True),
        metadata=_metadata(body, limits),
        user=_str(body, "user"),
        truncation=truncation or "disabled",
        tools_echo=tools_echo,
        tool_choice_echo=choice_echo,
        parallel_tool_calls=True if parallel is None else parallel,
    )


def conversation_request(raw: object, limits: Limits) -> ConversationRequest:
    """``POST /v1/conversations``: optional initial ``items`` (as input items) and ``metadata``."""
    body = _body(raw if raw is not None else {})
    _check_keys(body, frozenset({"items", "metadata"}))
    value = body.get("items")
    if value is None or value == []:
        return ConversationRequest(items=(), records=(), metadata=_metadata(body, limits))
    given = _items("items", value, limits)
    return ConversationRequest(items=given.items, records=given.records, metadata=_metadata(body, limits))


def conversation_items_request(raw: object, limits: Limits) -> ConversationItemsRequest:
    """``POST /v1/conversations/{id}/items``: ``items``, 1 to ``max_conversation_items`` of them, read as input
    items are (an output item the gateway wrote is taken back as it is)."""
    body = _body(raw)
    _check_keys(body, frozenset({"items"}))
    value = body.get("items")
    if isinstance(value, list) and len(value) > limits.max_conversation_items:
        raise invalid("items", f"items: at most {limits.max_conversation_items} items a request, given {len(value)}")
    if isinstance(value, str) or value is None:
        raise invalid("items", f"items: expected a non-empty array of items, given {_kind(value)}")
    given = _items("items", value, limits)
    return ConversationItemsRequest(items=given.items, records=given.records)


def conversation_update_request(raw: object, limits: Limits) -> dict[str, str]:
    """``POST /v1/conversations/{id}``: the new ``metadata`` (required: it is all there is to update)."""
    body = _body(raw)
    _check_keys(body, frozenset({"metadata"}))
    if body.get("metadata") is None:
        raise APIError(
            400, "Missing required parameter: 'metadata'.", param="metadata", code="missing_required_parameter"
        )
    return _metadata(body, limits)


_MAX_PAGE: Final = 100


def _include_query(params: Mapping[str, str]) -> None:
    # The openai client sends a list as include[]=a&include[]=b: every value counts (Starlette's getlist).
    getlist = getattr(params, "getlist", None)
    for key in ("include", "include[]"):
        values = getlist(key) if getlist is not None else [params[key]] if key in params else []
        for value in values:
            if value != _LOGPROBS_INCLUDE:
                raise refused("include", f"extra item data other than {_LOGPROBS_INCLUDE} (given {_shown(value)})")


def item_query(params: Mapping[str, str]) -> None:
    """The query of the other item routes: ``include`` only (the log-probabilities, which items carry already)."""
    for key in params:
        if key not in ("include", "include[]"):
            raise APIError(400, f"Unrecognized query parameter: {key}", param=key, code="unknown_parameter")
    _include_query(params)


def item_list_query(params: Mapping[str, str]) -> ItemListQuery:
    """The query of ``GET /v1/conversations/{id}/items``: ``limit`` (1..100, default 20), ``order`` (``desc``, the
    default, newest first, or ``asc``), ``after`` (an item id: the page starts past it, in that order) and
    ``include`` (only the log-probabilities, which the items carry already when their response had them)."""
    for key in params:
        if key not in ("limit", "order", "after", "include", "include[]"):
            raise APIError(400, f"Unrecognized query parameter: {key}", param=key, code="unknown_parameter")
    raw_limit = params.get("limit", "20")
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= _MAX_PAGE:
        raise invalid("limit", f"limit: expected an integer in 1..{_MAX_PAGE}, given {_shown(raw_limit)}")
    order = params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("order", f"order: expected 'asc' or 'desc', given {_shown(order)}")
    _include_query(params)
    after = params.get("after") or None
    return ItemListQuery(limit=int(raw_limit), order=order, after=after)
