"""Tool calling's values: :class:`Tool` (a function the model may call), :class:`ToolCall` (a call a reply made) and
the ``tool_choice`` option, as the chat model's ``TOOLS``, ``TOOL_CHOICE``, ``TOOL_META`` and ``TOOL_CALLS`` carry
them (``_protocol/chat.py`` spells the wire shapes).

The server renders the tools with the checkpoint's chat template, reads the reply for calls in the checkpoint's own
format and hands them back as ``[{"id", "name", "arguments"}]``; ``tool_choice`` ``"required"`` or a named function
constrains the reply to a call whose arguments are valid for the function's ``parameters``. This module only builds
and checks the values; whether a schema compiles is the server's to say (an
:class:`~triton_npu_client.InvalidArgumentError` naming ``TOOLS``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, Final, Literal, TypeAlias

import attrs

from .._errors import ChatMessageError, ChatOptionError

__all__ = ["Tool", "ToolCall", "ToolChoice", "as_tool_choice", "as_tools"]

#: ``tool_choice`` as a chat keeps it: ``"auto"`` (the model may call), ``"none"`` (tools shown, the reply is text),
#: ``"required"`` (one or more calls) or OpenAI's ``{"type": "function", "function": {"name": N}}`` (a call of N).
ToolChoice: TypeAlias = Literal["auto", "none", "required"] | dict[str, Any]
CHOICES: Final = ("auto", "none", "required")
_FUNCTION_KEYS: Final = frozenset({"name", "description", "parameters", "strict"})


def _plain_json(value: object, what: str) -> Any:
    """A JSON-data copy of ``value`` (the value stays frozen in spirit: later edits of the caller's dict change
    nothing), ``ValueError`` saying why it is not JSON data."""
    try:
        text = json.dumps(value, ensure_ascii=False)
        text.encode("utf-8")  # a lone surrogate would fail only when sent
        return json.loads(text)
    except (TypeError, ValueError, RecursionError) as err:  # UnicodeEncodeError is a ValueError
        raise ValueError(f"{what} is not JSON data ({err})") from None


# --- a call ------------------------------------------------------------------------------------------


def _check_call_id(_: object, __: object, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ChatMessageError(f"a tool call's id is a non-empty str; given {value!r:.80}")


def _check_call_name(_: object, __: object, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ChatMessageError(f"a tool call's name is a non-empty str; given {value!r:.80}")


def _check_arguments(instance: ToolCall, _: object, value: Any) -> None:
    if not isinstance(value, str):
        raise ChatMessageError(
            f"tool call {instance.name!r}: arguments are JSON text of an object (a str); given {type(value).__name__}"
        )
    try:
        decoded = json.loads(value)
    except (ValueError, RecursionError):
        raise ChatMessageError(f"tool call {instance.name!r}: arguments are not JSON: {value!r:.120}") from None
    if not isinstance(decoded, dict):
        raise ChatMessageError(f"tool call {instance.name!r}: arguments must be a JSON object; given {value!r:.120}")


@attrs.frozen
class ToolCall:
    """One call a reply made (:attr:`ChatReply.tool_calls`), or one an assistant message of a history holds:
    ``id`` (the server makes it; a tool result names it), ``name`` (the function's) and ``arguments``, the JSON text
    of an object, exactly as the server sent it (the history digest covers that text, so it is kept, not re-encoded).
    Checked when made (:class:`ChatMessageError`)."""

    id: str = attrs.field(validator=_check_call_id)
    name: str = attrs.field(validator=_check_call_name)
    arguments: str = attrs.field(validator=_check_arguments)

    def arguments_dict(self) -> dict[str, Any]:
        """The arguments decoded (a fresh dict each time)."""
        value: dict[str, Any] = json.loads(self.arguments)
        return value

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's shape: ``{"id", "type": "function", "function": {"name", "arguments"}}``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    @classmethod
    def from_openai(cls, value: Mapping[str, Any]) -> ToolCall:
        """From OpenAI's shape (:meth:`to_openai`'s); ``arguments`` may also be an object, kept as compact JSON."""
        if not isinstance(value, Mapping):
            raise ChatMessageError(f"a tool call is a mapping (OpenAI's shape); given {type(value).__name__}")
        function = value.get("function")
        if value.get("type", "function") != "function" or not isinstance(function, Mapping):
            raise ChatMessageError(
                'a tool call is {"id", "type": "function", "function": {"name", "arguments"}}; '
                f"given {value!r:.120}"
            )
        arguments = function.get("arguments")
        if isinstance(arguments, Mapping):
            try:
                arguments = json.dumps(_plain_json(arguments, "arguments"), ensure_ascii=False)
            except ValueError as err:
                raise ChatMessageError(f"tool call {function.get('name')!r}: {err}") from None
        return cls(id=value.get("id"), name=function.get("name"), arguments=arguments)  # type: ignore[arg-type]

    @property
    def wire(self) -> dict[str, str]:
        """The call as ``TOOL_META`` and ``TOOL_CALLS`` spell it: ``{"id", "name", "arguments"}``."""
        return {"id": self.id, "name": self.name, "arguments": self.arguments}


def calls_from_wire(raw: bytes) -> tuple[ToolCall, ...]:
    """A ``TOOL_CALLS`` output (``b""``: none) as values; ``ValueError`` when it breaks the protocol."""
    if not raw:
        return ()
    value = json.loads(raw.decode("utf-8"))
    if not isinstance(value, list) or not all(isinstance(c, dict) for c in value):
        raise ValueError(f"TOOL_CALLS is not a JSON array of calls: {raw[:120]!r}")
    try:
        return tuple(ToolCall(id=c.get("id"), name=c.get("name"), arguments=c.get("arguments")) for c in value)
    except ChatMessageError as err:
        raise ValueError(f"TOOL_CALLS: {err.message}") from None


# --- a tool ------------------------------------------------------------------------------------------


def _check_tool_name(_: object, __: object, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ChatOptionError("tools", "a tool's name, a non-empty str", value)


def _check_description(_: object, __: object, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise ChatOptionError("tools", "a tool's description, a str or None", value)


def _to_parameters(value: Any) -> Any:
    # Checked here, on the value as given; kept as a JSON-data copy (what TOOLS sends, and what a forced call's
    # arguments are valid for).
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ChatOptionError("tools", "a tool's parameters, a JSON schema (a mapping) or None", value)
    try:
        return _plain_json(value, "the parameters schema")
    except ValueError as err:
        raise ChatOptionError("tools", f"a tool's parameters as JSON data ({err})", type(value).__name__) from None


@attrs.frozen
class Tool:
    """A function the model may call: its ``name`` (unique among a turn's tools), a ``description`` the template
    shows the model, and ``parameters``, the JSON schema of its arguments (an object schema; ``None``: it takes none,
    and a forced call's arguments are ``{}``). Checked when made (:class:`ChatOptionError` naming ``tools``)."""

    name: str = attrs.field(validator=_check_tool_name)
    description: str | None = attrs.field(default=None, kw_only=True, validator=_check_description)
    parameters: dict[str, Any] | None = attrs.field(default=None, kw_only=True, converter=_to_parameters)

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's tool definition, ``{"type": "function", "function": {"name", "description"?, "parameters"?}}``
        (what ``TOOLS`` carries: fields that are ``None`` are left out)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}

    @classmethod
    def from_openai(cls, value: Mapping[str, Any]) -> Tool:
        """From OpenAI's tool definition (:meth:`to_openai`'s shape; ``strict`` is taken and ignored: every forced
        call is enforced). :class:`ChatOptionError` naming ``tools`` otherwise."""
        function = value.get("function") if isinstance(value, Mapping) else None
        if not isinstance(value, Mapping) or value.get("type") != "function" or not isinstance(function, Mapping):
            shown = dict(value) if isinstance(value, Mapping) else value
            raise ChatOptionError("tools", 'a Tool or {"type": "function", "function": {"name", ...}}', shown)
        unknown = sorted(str(k) for k in function if k not in _FUNCTION_KEYS)
        if unknown or set(value) - {"type", "function"}:
            extra = unknown or sorted(str(k) for k in set(value) - {"type", "function"})
            expected = "a tool of type and function; a function of name, description, parameters (and strict)"
            raise ChatOptionError("tools", expected, f"the key {extra[0]!r}")
        name: Any = function.get("name")  # checked by the constructor
        return cls(name, description=function.get("description"), parameters=function.get("parameters"))


def as_tools(value: Iterable[Tool | Mapping[str, Any]] | None) -> tuple[Tool, ...] | None:
    """``value`` as :class:`Tool` values: each item one already or OpenAI's tool definition; names unique. ``None``
    stays ``None`` (not set); an empty list is no tools (it clears a chat's default). :class:`ChatOptionError`
    naming ``tools`` otherwise. (A bare mapping or string is refused: iterating it would read its keys.)"""
    if value is None:
        return None
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise ChatOptionError("tools", "a list of Tool values or OpenAI tool definitions", type(value).__name__)
    tools = tuple(t if isinstance(t, Tool) else Tool.from_openai(t) for t in value)
    seen: set[str] = set()
    for tool in tools:
        if tool.name in seen:
            raise ChatOptionError("tools", "tools of distinct names", f"two named {tool.name!r}")
        seen.add(tool.name)
    try:
        tools_wire(tools).encode("utf-8")
    except UnicodeEncodeError as err:  # a name or description with a lone surrogate: the server takes UTF-8 only
        raise ChatOptionError("tools", "text encodable as UTF-8", str(err)) from None
    return tools


def as_tool_choice(value: str | Mapping[str, Any] | Tool | None) -> ToolChoice | None:
    """``value`` as a chat keeps ``tool_choice``: ``"auto"``, ``"none"``, ``"required"``, or a named function from
    OpenAI's ``{"type": "function", "function": {"name": N}}`` or a :class:`Tool` (its name), as a fresh dict of
    OpenAI's shape. :class:`ChatOptionError` naming ``tool_choice`` otherwise."""
    if value is None:
        return None
    if isinstance(value, Tool):
        return {"type": "function", "function": {"name": value.name}}
    if isinstance(value, str):
        if value in CHOICES:
            return value  # type: ignore[return-value]
    elif isinstance(value, Mapping):
        function = value.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if value.get("type") == "function" and isinstance(name, str) and name and set(value) == {"type", "function"}:
            return {"type": "function", "function": {"name": name}}
    shown = dict(value) if isinstance(value, Mapping) else value
    raise ChatOptionError(
        "tool_choice", 'auto, none, required, a Tool or {"type": "function", "function": {"name": ...}}', shown
    )


def choice_name(choice: ToolChoice | None) -> str | None:
    """The function a choice names (None for the three words and for no choice)."""
    if isinstance(choice, dict):
        name: str = choice["function"]["name"]
        return name
    return None


def choice_wire(choice: ToolChoice) -> str:
    """The ``TOOL_CHOICE`` input's text: the word, or the named function as compact JSON."""
    return choice if isinstance(choice, str) else json.dumps(choice, separators=(",", ":"), ensure_ascii=False)


def tools_wire(tools: Iterable[Tool]) -> str:
    """The ``TOOLS`` input's text: a JSON array of OpenAI tool definitions."""
    return json.dumps([t.to_openai() for t in tools], separators=(",", ":"), ensure_ascii=False)
