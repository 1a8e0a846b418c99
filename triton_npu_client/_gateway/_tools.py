"""Tool calling at the gateway: OpenAI's tool definitions, ``tool_choice`` and the tool fields of messages and items,
read into the SDK's values (:class:`~triton_npu_client.Tool`, :class:`~triton_npu_client.ToolCall`,
:class:`~triton_npu_client.ChatMessage`); how a message is kept in the store (a *record*); and the key a Chat
Completions chat is parked under between a reply's calls and the request that brings their results.

The two APIs spell the same things differently:

- **Tools.** Chat Completions: ``{"type": "function", "function": {"name", "description", "parameters", "strict"}}``;
  Responses: the same fields flat, ``{"type": "function", "name", ...}``. Both become ``Tool(name, description,
  parameters)``; ``strict`` is taken and echoed (a forced call is always valid for its schema: see docs/openai.md).
- **tool_choice.** ``"auto"``, ``"none"``, ``"required"``, or a named function: ``{"type": "function", "function":
  {"name"}}`` (Chat Completions) or ``{"type": "function", "name"}`` (Responses). The SDK takes Chat Completions'.
- **Calls.** An assistant message's ``tool_calls`` (Chat Completions) or ``function_call`` items (Responses, one per
  call, after the message item of the same reply when it has text); results are ``tool`` messages or
  ``function_call_output`` items. A reply's content and its calls are one assistant message to the model.

**Records.** The store keeps a conversation as plain JSON: a message without tool fields as ``(role, text)`` (what
every record of a store from before tools is), one with them as ``(role, text, {"tool_calls": [{"id", "name",
"arguments"}], "tool_call_id", "name"})``. A conversation keeps one record per item, so a reply with text and two
calls is three records; :func:`from_records` joins an assistant record that has only calls (no text) to the
assistant message before it, which makes them one message again, as the chat holds it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, TypeAlias

from .._sessions import ChatMessage, Tool, ToolCall
from ._errors import invalid, refused
from ._errors import kind_of as _kind
from ._errors import shown as _shown
from ._store import MessageRecord

__all__ = [
    "MessageRecord",
    "ToolChoice",
    "call_of_item",
    "chat_tool_calls",
    "check_tool_results",
    "from_records",
    "history_key",
    "merged",
    "output_of_item",
    "record",
    "records",
    "read_tool_choice",
    "read_tools",
    "tool_name",
]

#: The SDK's ``tool_choice``: ``"auto"``, ``"none"``, ``"required"`` or ``{"type": "function", "function": {"name"}}``.
ToolChoice: TypeAlias = str | dict[str, Any]

#: OpenAI's rule for a function's name.
_NAME: Final = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CHOICES: Final = ("auto", "none", "required")
#: Fields of a function tool that ask for something this gateway does not do, with the value that asks for nothing.
_TOOL_NEUTRAL: Final[dict[str, tuple[object, ...]]] = {
    "defer_loading": (None, False),
    "allowed_callers": (None,),
    "async": (None, False),
    "output_schema": (None,),
}


# --- tool definitions -----------------------------------------------------------------------------------------------


def _function(where: str, fields: Mapping[str, Any], known: frozenset[str]) -> tuple[Tool, dict[str, Any]]:
    """One function's fields (``name``, ``description``, ``parameters``, ``strict``) as a Tool and its echo."""
    for key, value in fields.items():
        if key in known:
            continue
        if key in _TOOL_NEUTRAL and value in _TOOL_NEUTRAL[key]:
            continue
        if key in _TOOL_NEUTRAL:
            raise refused(f"{where}.{key}", f"the function tool field {key!r}")
        raise invalid(f"{where}.{key}", f"{where}: unknown field {key!r} (a function has name, description, "
                      "parameters and strict)", code="unknown_parameter")  # fmt: skip
    name = fields.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise invalid(
            f"{where}.name",
            f"{where}.name: expected a function name of 1 to 64 letters, digits, '_' or '-', given {_shown(name)}",
        )
    description = fields.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid(f"{where}.description", f"{where}.description: expected a string, given {_kind(description)}")
    parameters = fields.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise invalid(
                f"{where}.parameters", f"{where}.parameters: expected a JSON schema object, given {_kind(parameters)}"
            )
        if parameters.get("type", "object") != "object":
            raise invalid(
                f"{where}.parameters",
                f"{where}.parameters: a function's arguments are an object: the schema's type must be 'object', "
                f"given {_shown(parameters.get('type'))}",
            )
    strict = fields.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid(f"{where}.strict", f"{where}.strict: expected a boolean, given {_kind(strict)}")
    echo = {"type": "function", "name": name, "description": description, "parameters": parameters, "strict": strict}
    return Tool(name, description=description, parameters=parameters), echo


_CHAT_FUNCTION_KEYS: Final = frozenset({"name", "description", "parameters", "strict"})
_FLAT_KEYS: Final = frozenset({"type", "name", "description", "parameters", "strict"})


def read_tools(
    param: str, value: object, *, flat: bool, max_tools: int, max_bytes: int
) -> tuple[tuple[Tool, ...], tuple[dict[str, Any], ...]]:
    """``tools`` (Chat Completions' nested shape, or Responses' ``flat`` one) as Tools, and as the Responses API
    echoes them (flat, every field present). Function tools only; a name given twice is refused."""
    if value is None:
        return (), ()
    if not isinstance(value, list):
        raise invalid(param, f"{param}: expected an array of function tools, given {_kind(value)}")
    if len(value) > max_tools:
        raise invalid(param, f"{param}: at most {max_tools} tools, given {len(value)}")
    try:
        size = len(json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    except (TypeError, ValueError):  # pragma: no cover - it came from JSON
        size = max_bytes + 1
    if size > max_bytes:
        raise invalid(param, f"{param}: at most {max_bytes} bytes of tool definitions, given {size}")
    out: list[Tool] = []
    echoes: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(tool, dict):
            raise invalid(where, f"{where}: expected a tool object, given {_kind(tool)}")
        _only_functions(where, tool.get("type"), "tools of type {!r} (function tools only)")
        if flat:
            fields = {k: v for k, v in tool.items() if k != "type"}
            made, echo = _function(where, fields, _FLAT_KEYS - {"type"})
        else:
            extra = sorted(set(tool) - {"type", "function"})
            if extra:
                raise invalid(f"{where}.{extra[0]}", f"{where}: unknown field {extra[0]!r} (a tool has type and "
                              "function)", code="unknown_parameter")  # fmt: skip
            function = tool.get("function")
            if not isinstance(function, dict):
                raise invalid(f"{where}.function", f"{where}.function: expected an object with the function's name, "
                              f"given {_kind(function)}")  # fmt: skip
            made, echo = _function(f"{where}.function", function, _CHAT_FUNCTION_KEYS)
        if made.name in seen:
            field = f"{where}.name" if flat else f"{where}.function.name"
            raise invalid(field, f"{field}: two tools are named {made.name!r}; names must be unique")
        seen.add(made.name)
        out.append(made)
        echoes.append(echo)
    return tuple(out), tuple(echoes)


def _only_functions(where: str, kind: object, refusal: str) -> None:
    """A ``type`` that is not ``function``: another kind OpenAI has (a string) is refused as unsupported
    (``refusal``, formatted with it), anything else is invalid."""
    if kind == "function":
        return
    if isinstance(kind, str):
        raise refused(f"{where}.type", refusal.format(kind))
    raise invalid(f"{where}.type", f"{where}.type: expected 'function', given {_shown(kind)}")


def read_tool_choice(
    param: str, value: object, names: Sequence[str], *, flat: bool
) -> tuple[ToolChoice | None, ToolChoice]:
    """``tool_choice`` checked against the tools' ``names``: the SDK's value (None when not given) and the echo (in
    the request's own shape; ``"auto"`` when not given, OpenAI's default). A choice that forces a call needs tools,
    and a named one one of them."""
    if value is None:
        return None, "auto"
    if isinstance(value, str):
        if value not in _CHOICES:
            raise invalid(param, f"{param}: expected 'auto', 'none', 'required' or a function, given {_shown(value)}")
        if value == "required" and not names:
            raise invalid(param, f"{param}: 'required' needs tools to call, and the request gives none")
        return value, value
    if not isinstance(value, dict):
        raise invalid(param, f"{param}: expected 'auto', 'none', 'required' or a function, given {_kind(value)}")
    _only_functions(param, value.get("type"), "tool_choice of type {!r} (functions only)")
    if flat:
        extra = sorted(set(value) - {"type", "name"})
        name = value.get("name")
        field = f"{param}.name"
    else:
        extra = sorted(set(value) - {"type", "function"})
        function = value.get("function")
        if not isinstance(function, dict) or set(function) - {"name"}:
            raise invalid(f"{param}.function", f"{param}.function: expected {{'name': ...}}, given {_shown(function)}")
        name = function.get("name")
        field = f"{param}.function.name"
    if extra:
        raise invalid(f"{param}.{extra[0]}", f"{param}: unknown field {extra[0]!r}", code="unknown_parameter")
    if not isinstance(name, str) or not name:
        raise invalid(field, f"{field}: expected a function's name, given {_shown(name)}")
    if name not in names:
        known = ", ".join(names) if names else "the request gives none"
        raise invalid(field, f"{field}: {name!r} is not one of the tools ({known})")
    echo: ToolChoice = {"type": "function", "name": name} if flat else {"type": "function", "function": {"name": name}}
    return {"type": "function", "function": {"name": name}}, echo


# --- calls and results --------------------------------------------------------------------------------------------


def _arguments(where: str, value: object) -> str:
    """A call's ``arguments``: JSON text of an object, as the model wrote it."""
    if not isinstance(value, str):
        raise invalid(where, f"{where}: expected JSON text of an object (a string), given {_kind(value)}")
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):
        raise invalid(where, f"{where}: expected JSON text of an object, given text that is not JSON") from None
    if not isinstance(parsed, dict):
        raise invalid(where, f"{where}: expected JSON text of an object, given JSON {_kind(parsed)}")
    return value


def _call_id(where: str, value: object) -> str:
    if not isinstance(value, str) or not value or len(value) > 256:
        raise invalid(where, f"{where}: expected a call id (a non-empty string of at most 256 characters), "
                      f"given {_shown(value)}")  # fmt: skip
    return value


def _call_name(where: str, value: object) -> str:
    if not isinstance(value, str) or not value or len(value) > 256:
        raise invalid(where, f"{where}: expected the function's name, given {_shown(value)}")
    return value


def chat_tool_calls(where: str, value: object, max_calls: int) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls`` (Chat Completions): ``[{"id", "type": "function", "function": {"name",
    "arguments"}}]`` (an ``index``, which a streamed reply's deltas carry, is taken)."""
    if not isinstance(value, list):
        raise invalid(where, f"{where}: expected an array of tool calls, given {_kind(value)}")
    if len(value) > max_calls:
        raise invalid(where, f"{where}: at most {max_calls} calls, given {len(value)}")
    out = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise invalid(at, f"{at}: expected a tool call object, given {_kind(call)}")
        extra = sorted(k for k in set(call) - {"id", "type", "function", "index"} if call[k] is not None)
        if extra:
            raise invalid(f"{at}.{extra[0]}", f"{at}: unknown field {extra[0]!r}", code="unknown_parameter")
        if call.get("type", "function") != "function":
            raise refused(f"{at}.type", f"tool calls of type {call.get('type')!r} (function calls only)")
        function = call.get("function")
        if not isinstance(function, dict):
            raise invalid(f"{at}.function", f"{at}.function: expected an object with name and arguments, "
                          f"given {_kind(function)}")  # fmt: skip
        extra = sorted(set(function) - {"name", "arguments"})
        if extra:
            raise invalid(f"{at}.function.{extra[0]}", f"{at}.function: unknown field {extra[0]!r}",
                          code="unknown_parameter")  # fmt: skip
        out.append(ToolCall(
            id=_call_id(f"{at}.id", call.get("id")),
            name=_call_name(f"{at}.function.name", function.get("name")),
            arguments=_arguments(f"{at}.function.arguments", function.get("arguments")),
        ))  # fmt: skip
    return tuple(out)


#: Fields of a function_call / function_call_output item that describe it (what the gateway writes, or a client's
#: copy of OpenAI's output carries), with the values that ask for nothing.
_ITEM_NEUTRAL: Final[dict[str, tuple[object, ...]]] = {
    "namespace": (None,),
    "async": (None, False),
    "created_by": (None,),
}


def _item_fields(where: str, item: Mapping[str, Any], known: frozenset[str]) -> None:
    for key, value in item.items():
        if key in known or value is None:
            continue
        if key == "status" and value in ("completed", "in_progress", "incomplete"):
            continue
        if key == "caller" and isinstance(value, dict) and value.get("type") == "direct":
            continue
        if key in _ITEM_NEUTRAL and value in _ITEM_NEUTRAL[key]:
            continue
        raise refused(f"{where}.{key}", f"the item field {key!r} (given {_shown(value)})")


def call_of_item(where: str, item: Mapping[str, Any]) -> ToolCall:
    """A Responses ``function_call`` item (``call_id``, ``name``, ``arguments``; ``id`` and ``status`` as the
    gateway writes them) as a call."""
    _item_fields(where, item, frozenset({"type", "id", "call_id", "name", "arguments"}))
    return ToolCall(
        id=_call_id(f"{where}.call_id", item.get("call_id")),
        name=_call_name(f"{where}.name", item.get("name")),
        arguments=_arguments(f"{where}.arguments", item.get("arguments")),
    )


def output_of_item(
    where: str, item: Mapping[str, Any], text_of: Callable[[str, object], str]
) -> tuple[str, str, str | None]:
    """A Responses ``function_call_output`` item: its ``call_id``, its output as text (a string or text parts, read
    by ``text_of(param, output)``, which caps it as any content) and the tool's ``name`` if given."""
    _item_fields(where, item, frozenset({"type", "id", "call_id", "output", "name"}))
    call_id = _call_id(f"{where}.call_id", item.get("call_id"))
    output = item.get("output")
    if isinstance(output, str | list):
        text = text_of(f"{where}.output", output)
    else:
        raise invalid(f"{where}.output", f"{where}.output: expected a string or an array of text parts, "
                      f"given {_kind(output)}")  # fmt: skip
    return call_id, text, tool_name(f"{where}.name", item.get("name"))


def tool_name(where: str, value: object) -> str | None:
    """A tool result's optional ``name`` (the function's)."""
    if value is not None and (not isinstance(value, str) or not value):
        raise invalid(where, f"{where}: expected the function's name (a non-empty string), given {_shown(value)}")
    return value


def check_tool_results(messages: Sequence[ChatMessage]) -> tuple[int, str] | None:
    """The first tool message that answers no call, and why; None when each one answers a call of the assistant
    message it follows (only other results between them), as OpenAI requires."""
    for i, m in enumerate(messages):
        if m.role != "tool":
            continue
        j = i - 1
        while j >= 0 and messages[j].role == "tool":
            j -= 1
        calls = messages[j].tool_calls if j >= 0 and messages[j].role == "assistant" else ()
        if not calls:
            return i, "a tool result must follow the assistant message whose tool_calls it answers"
        if m.tool_call_id not in {c.id for c in calls}:
            ids = ", ".join(repr(c.id) for c in calls)
            return i, f"the call id {m.tool_call_id!r} is none of the calls it follows ({ids})"
    return None


# --- records ------------------------------------------------------------------------------------------------------


def _fields(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def record(m: ChatMessage) -> MessageRecord:
    """``m`` as the store keeps it: ``(role, text)``, with its tool fields as a third element when it has any."""
    fields = _fields(m)
    return (m.role, m.text, fields) if fields else (m.role, m.text)


def records(messages: Sequence[ChatMessage]) -> tuple[MessageRecord, ...]:
    return tuple(record(m) for m in messages)


def _message(rec: Sequence[Any]) -> ChatMessage:
    role, text = rec[0], rec[1]
    fields: Mapping[str, Any] = rec[2] if len(rec) > 2 else {}
    calls = tuple(ToolCall(id=c["id"], name=c["name"], arguments=c["arguments"]) for c in fields.get("tool_calls", ()))
    return ChatMessage(role, text, tool_calls=calls, tool_call_id=fields.get("tool_call_id"), name=fields.get("name"))


def merged(messages: Sequence[ChatMessage]) -> list[tuple[int, ChatMessage]]:
    """``messages`` with each assistant message that has only calls (no text) joined to the assistant message right
    before it: a reply's content and calls are one message, listed as several items. Each with the index of its
    first part."""
    out: list[tuple[int, ChatMessage]] = []
    for i, m in enumerate(messages):
        if out and m.role == "assistant" and m.tool_calls and not m.text and out[-1][1].role == "assistant":
            first, before = out[-1]
            out[-1] = (first, ChatMessage(
                "assistant", before.text, tool_calls=(*before.tool_calls, *m.tool_calls),
                tool_call_id=before.tool_call_id, name=before.name,
            ))  # fmt: skip
            continue
        out.append((i, m))
    return out


def from_records(recs: Sequence[Sequence[Any]]) -> tuple[ChatMessage, ...]:
    """Records (one per item, or one per message) as the conversation's messages (see :func:`merged`)."""
    return tuple(m for _, m in merged([_message(r) for r in recs]))


def _canonical_arguments(text: str) -> Any:
    # Compared as the template renders them (decoded: spacing aside), keys in their order.
    try:
        return json.loads(text, object_pairs_hook=lambda pairs: [list(p) for p in pairs])
    except (ValueError, RecursionError):
        return text


def history_key(owner: str, model: str, messages: Sequence[ChatMessage]) -> str:
    """The key of a chat whose history is ``messages`` (every field the model renders; a call's arguments by their
    JSON value), for ``owner`` on ``model``: equal histories, equal keys."""
    rows = [
        [m.role, m.text, [[c.id, c.name, _canonical_arguments(c.arguments)] for c in m.tool_calls], m.tool_call_id,
         m.name]
        for m in messages
    ]  # fmt: skip
    blob = json.dumps([owner, model, rows], ensure_ascii=True, separators=(",", ":"))
    return "chatcmpl:" + hashlib.sha256(blob.encode()).hexdigest()
