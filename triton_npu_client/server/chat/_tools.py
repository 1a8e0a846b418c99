"""Tool calls on the output side: each family's tool-call markup found in a reply, whole or streamed, as typed values.

A model asked to call a tool writes the call as text in its own family's format:

- ``llama3_json`` (Llama 3.1, 3.2, 3.3: Meta's JSON tool calling): the reply *is* the call, a JSON object
  ``{"name": ..., "parameters": {...}}`` (``"arguments"`` is taken too), optionally after ``<|python_tag|>``; several
  calls are separated by ``;``. Text before a ``<|python_tag|>`` is content.
- ``hermes`` (NousResearch Hermes 2 Pro / 3, Qwen2.5): one block per call,
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, after optional text (the content).
- ``mistral`` (Mistral 7B v0.3, Mistral Nemo): ``[TOOL_CALLS]`` and a JSON array of ``{"name", "arguments"}`` (Nemo may
  add an ``"id"``); after optional text (the content). The later ``[TOOL_CALLS]name{arguments}`` form (one marker per
  call) is read too.

:func:`parse_tool_calls` reads a whole reply; :class:`ToolCallStream` reads it piece by piece and returns only the
content that can no longer turn out to be a call; both give the same calls and the same content. :data:`TOOL_FORMATS`
is the one table of formats: how each is recognised in a checkpoint (:func:`detect_tool_format`), how it is parsed,
and what a forced call must look like (:func:`forced_tool_call`).

**The rules, and where they follow vLLM's parsers** (``llama3_json``, ``hermes``, ``mistral``):

- The content is the text before the first call's marker; text after or between calls is dropped, as vLLM drops it.
- A call needs a ``name`` (a non-empty string) and its arguments (``arguments``, or ``parameters`` for Llama): a JSON
  object, or a string holding one (decoded, as vLLM's Hermes parser does). Arguments come back as JSON text written by
  ``json.dumps(..., ensure_ascii=False)``, vLLM's spelling.
- **Malformed markup is content.** When anything inside the call section is not a valid call (JSON that does not
  parse, a missing name or arguments, arguments that are not an object), the whole reply is returned as content and
  no call, as vLLM's parsers return it. Differences: vLLM's Mistral parser returns only the text after
  ``[TOOL_CALLS]`` then, and its Mistral ``name{...}`` form passes malformed arguments on as a call; here both are the
  whole reply as content, so a caller always gets either valid calls or the model's text unchanged.
- **Llama 3 JSON is a reply that starts with the call** (after whitespace), or text and then ``<|python_tag|>``.
  vLLM's non-streaming parser also takes a JSON object found anywhere in the reply (``Sure: {"name": ...}``) and drops
  the text around it; its streaming parser does not. Here both modes follow the streaming rule, so that a streamed
  reply can show its text at once instead of holding back everything after any ``{``. Built-in tool calls
  (``<|python_tag|>brave_search.call(query="...")``) are not JSON and stay content.
- **Ids.** vLLM draws random ids; here an id is derived from a hash of the caller's ``salt``, the call's position, name
  and arguments: the same reply parsed twice gets the same ids, and a caller that salts with something unique per turn
  (a conversation id and turn number) gets ids unique across the conversation. Mistral templates require ids of 9
  letters and digits: a Mistral call gets such an id, and keeps the one the model wrote when that one is valid (vLLM
  discards it); the others get ``call_`` and 24 letters and digits.

Nothing here imports torch or jinja2.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, NamedTuple

__all__ = [
    "TOOL_FORMATS",
    "NO_TOOLS",
    "ForcedToolCall",
    "MessageTools",
    "ParsedReply",
    "StreamEnd",
    "ToolCall",
    "ToolCallStream",
    "ToolFormat",
    "check_tools",
    "detect_tool_format",
    "forced_grammar",
    "forced_tool_call",
    "parse_tool_calls",
    "parse_tool_choice",
    "parse_tool_meta",
    "parse_tools_input",
]

FormatName = Literal["llama3_json", "hermes", "mistral"]

_ALNUM: Final = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_MISTRAL_ID: Final = re.compile(r"[A-Za-z0-9]{9}")
_JSON: Final = json.JSONDecoder()
_PYTHON_TAG: Final = "<|python_tag|>"
_TOOL_CALL: Final = "<tool_call>"
_TOOL_CALL_END: Final = "</tool_call>"
_TOOL_CALLS: Final = "[TOOL_CALLS]"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call of a function: its ``name``, its ``arguments`` as JSON text of an object (OpenAI's shape), an ``id``.

    Raises ``ValueError`` when ``arguments`` is not JSON text of an object, or ``name`` is empty.
    """

    name: str
    arguments: str
    id: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a tool call's name must be a non-empty string, got {self.name!r:.80}")
        if not isinstance(self.arguments, str):
            kind = type(self.arguments).__name__
            raise ValueError(f"a tool call's arguments must be JSON text (a string), got {kind}")
        try:
            value = json.loads(self.arguments)
        except ValueError:
            raise ValueError(f"tool call {self.name!r}: arguments are not JSON: {self.arguments!r:.120}") from None
        except RecursionError:
            raise ValueError(f"tool call {self.name!r}: arguments are nested too deeply to read") from None
        if not isinstance(value, dict):
            raise ValueError(f"tool call {self.name!r}: arguments must be a JSON object, got {self.arguments!r:.120}")
        # A template walks the arguments recursively: a call that could not be rendered is no call.
        _check_nesting(value, f"tool call {self.name!r}: arguments")
        if self.id is not None and not isinstance(self.id, str):
            raise ValueError(f"tool call {self.name!r}: id must be a string, got {self.id!r:.80}")

    def arguments_object(self) -> dict[str, Any]:
        """The arguments decoded: what a chat template is given (templates write them with ``tojson``)."""
        value: dict[str, Any] = json.loads(self.arguments)
        return value

    def to_openai(self) -> dict[str, Any]:
        """``{"id", "type": "function", "function": {"name", "arguments"}}``, ``id`` left out when there is none."""
        out: dict[str, Any] = {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if self.id is not None:
            out = {"id": self.id, **out}
        return out

    @classmethod
    def from_openai(cls, value: Mapping[str, Any]) -> ToolCall:
        """From OpenAI's shape. ``arguments`` may be JSON text or already an object (transformers' docs pass a dict)."""
        if not isinstance(value, Mapping):
            raise ValueError(f"a tool call must be an object, got {type(value).__name__}")
        function = value.get("function")
        if not isinstance(function, Mapping):
            raise ValueError(f"a tool call needs a 'function' object with name and arguments, got {value!r:.120}")
        if value.get("type", "function") != "function":
            raise ValueError(f"only function tool calls are supported, got type {value.get('type')!r:.40}")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, Mapping):
            arguments = json.dumps(dict(arguments), ensure_ascii=False)
        return cls(name=function.get("name"), arguments=arguments, id=value.get("id"))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class ParsedReply:
    """A reply split into its ``content`` (the text that is not a call; ``""`` when none) and its ``tool_calls``."""

    content: str
    tool_calls: tuple[ToolCall, ...] = ()


class StreamEnd(NamedTuple):
    """:meth:`ToolCallStream.finish`'s answer: ``rest``, the content not yet returned by ``feed`` (to show now), and
    ``reply``, the whole reply parsed (``reply.content`` is everything ``feed`` returned followed by ``rest``)."""

    rest: str
    reply: ParsedReply


@dataclass(frozen=True, slots=True)
class ForcedToolCall:
    """What a forced call must be, as plain data for a grammar: ``prefix`` + JSON valid for ``schema`` + ``suffix``.

    ``prefix`` and ``suffix`` may be control tokens of the checkpoint (``[TOOL_CALLS]``; ``<tool_call>`` in Hermes and
    Qwen2.5 vocabularies): encode them with ``CheckpointTokenizer.encode_controls``, not as text.
    """

    prefix: str
    schema: dict[str, Any]
    suffix: str


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """A family's tool-call format; see :data:`TOOL_FORMATS`.

    - ``markers``: text that starts the call section wherever it appears; ``markup``: every piece of markup the
      parser reads (the markers and closing tags: a reply's text must hold them, special tokens or not);
      ``starts_with_json``: a reply whose first non-space character is ``{`` is a call too.
    - ``template_signs`` / ``token_signs``: text in a chat template / added tokens of a tokenizer that show a
      checkpoint uses this format; ``model_types``: config.json's ``model_type`` whose checkpoints use it when
      neither says (the fallback).
    - ``id_length``: the length of the ids its calls get (9 for Mistral's templates; 0: ``call_`` and 24 characters).
    - ``prefix``, ``suffix``, ``arguments_key``, ``many``: a forced call's shape (:func:`forced_tool_call`);
      ``parse``: the call section's parser.
    """

    name: FormatName
    markers: tuple[str, ...]
    markup: tuple[str, ...]
    starts_with_json: bool
    template_signs: tuple[str, ...]
    token_signs: tuple[str, ...]
    model_types: tuple[str, ...]
    id_length: int
    prefix: str  # what a forced call starts with
    suffix: str  # what follows its JSON
    arguments_key: str  # the key the family's prompt asks the arguments under
    parse: Callable[[str], list[_RawCall] | None]  # the call section (after the content) -> calls, None: malformed
    many: bool  # a forced call's JSON holds a list of calls (Mistral's array) rather than one

    def __repr__(self) -> str:
        return f"ToolFormat({self.name!r})"


class _RawCall(NamedTuple):
    name: str
    arguments: str
    id: str | None


def _arguments(value: object) -> str | None:
    """Arguments as JSON text of an object: an object, or a string holding one; None for anything else."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def _call(obj: object, keys: tuple[str, ...], *, with_id: bool = False) -> _RawCall | None:
    """A decoded call object: a non-empty string name and arguments under the first of ``keys`` present."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    key = next((k for k in keys if k in obj), None)
    if not isinstance(name, str) or not name or key is None:
        return None
    arguments = _arguments(obj[key])
    if arguments is None:
        return None
    emitted = obj.get("id") if with_id else None
    return _RawCall(name, arguments, emitted if isinstance(emitted, str) else None)


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _parse_llama(section: str) -> list[_RawCall] | None:
    """``{...}`` or ``{...}; {...}``: every object a call; text after the last call (no ``;``) is dropped."""
    calls: list[_RawCall] = []
    at = _skip_space(section, 0)
    while True:
        try:
            obj, at = _JSON.raw_decode(section, at)
        except ValueError:
            return None
        # Meta's prompt asks for "parameters"; vLLM takes "arguments" first when a model writes that.
        call = _call(obj, ("arguments", "parameters"))
        if call is None:
            return None
        calls.append(call)
        at = _skip_space(section, at)
        if not section.startswith(";", at):
            return calls
        at = _skip_space(section, at + 1)


# A closed block, or an unclosed last one (a reply cut at its stop token).
_HERMES_BLOCK: Final = re.compile(
    f"{re.escape(_TOOL_CALL)}(.*?){re.escape(_TOOL_CALL_END)}|{re.escape(_TOOL_CALL)}(.*)", re.S
)


def _parse_hermes(section: str) -> list[_RawCall] | None:
    """``<tool_call>JSON</tool_call>`` blocks (the last may be unclosed: a reply cut at its stop token)."""
    calls: list[_RawCall] = []
    for m in _HERMES_BLOCK.finditer(section):
        body = m.group(1) if m.group(1) is not None else m.group(2)
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        call = _call(obj, ("arguments",))
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _parse_mistral(section: str) -> list[_RawCall] | None:
    """``[TOOL_CALLS] [{...}, ...]`` (v0.3, Nemo), or ``[TOOL_CALLS]name{...}`` repeated (later tokenizers)."""
    body = section[len(_TOOL_CALLS) :]
    at = _skip_space(body, 0)
    if body.startswith("[", at):
        try:
            value, _ = _JSON.raw_decode(body, at)
        except ValueError:
            return None
        if not isinstance(value, list) or not value:
            return None
        calls = [_call(item, ("arguments",), with_id=True) for item in value]
        return None if any(c is None for c in calls) else [c for c in calls if c is not None]
    out: list[_RawCall] = []
    for piece in body.split(_TOOL_CALLS):
        brace = piece.find("{")
        name = piece[:brace].strip() if brace >= 0 else ""
        if not name:
            return None
        try:
            obj, _ = _JSON.raw_decode(piece, brace)
        except ValueError:
            return None
        arguments = _arguments(obj)
        if arguments is None:
            return None
        out.append(_RawCall(name, arguments, None))
    return out


#: The tool-call formats, one per family, in the order :func:`detect_tool_format` tries them (Hermes 3 is a Llama 3.1
#: fine-tune whose vocabulary keeps ``<|python_tag|>``: its template's ``<tool_call>`` must win over that token).
TOOL_FORMATS: Final[dict[str, ToolFormat]] = {
    "mistral": ToolFormat(
        name="mistral",
        markers=(_TOOL_CALLS,),
        markup=(_TOOL_CALLS,),
        starts_with_json=False,
        template_signs=(_TOOL_CALLS,),
        token_signs=(_TOOL_CALLS,),
        model_types=("mistral",),
        id_length=9,
        prefix=_TOOL_CALLS,
        suffix="",
        arguments_key="arguments",
        parse=_parse_mistral,
        many=True,
    ),
    "hermes": ToolFormat(
        name="hermes",
        markers=(_TOOL_CALL,),
        markup=(_TOOL_CALL, _TOOL_CALL_END),
        starts_with_json=False,
        template_signs=(_TOOL_CALL,),
        token_signs=(_TOOL_CALL,),
        model_types=("qwen2",),
        id_length=0,
        prefix=f"{_TOOL_CALL}\n",
        suffix=f"\n{_TOOL_CALL_END}",
        arguments_key="arguments",
        parse=_parse_hermes,
        many=False,
    ),
    "llama3_json": ToolFormat(
        name="llama3_json",
        markers=(_PYTHON_TAG,),
        markup=(_PYTHON_TAG,),
        starts_with_json=True,
        # Llama 3.1/3.3 write <|python_tag|>; 3.2's template only asks for the JSON, in these words.
        template_signs=(_PYTHON_TAG, "dictionary of argument name and its value"),
        token_signs=(_PYTHON_TAG,),
        model_types=("llama",),
        id_length=0,
        prefix="",
        suffix="",
        arguments_key="parameters",
        parse=_parse_llama,
        many=False,
    ),
}


def detect_tool_format(
    chat_template: str, added_tokens: Iterable[str] = (), model_type: str | None = None
) -> ToolFormat | None:
    """The format a checkpoint writes tool calls in: first by what its chat template (the one used with tools) writes
    or asks for, then by its tokenizer's added tokens, then by its ``model_type``; None when none tells."""
    tokens = set(added_tokens)
    for fmt in TOOL_FORMATS.values():
        if any(sign in chat_template for sign in fmt.template_signs):
            return fmt
    for fmt in TOOL_FORMATS.values():
        if tokens.intersection(fmt.token_signs):
            return fmt
    for fmt in TOOL_FORMATS.values():
        if model_type in fmt.model_types:
            return fmt
    return None


def _id(fmt: ToolFormat, salt: str, index: int, call: _RawCall, taken: set[str]) -> str:
    if fmt.id_length and call.id is not None and _MISTRAL_ID.fullmatch(call.id) and call.id not in taken:
        return call.id  # the model's own (a Mistral template pairs results with calls by id), unless repeated
    digest = hashlib.sha256(f"{salt}\0{index}\0{call.name}\0{call.arguments}".encode()).digest()
    number = int.from_bytes(digest, "big")
    chars = []
    for _ in range(fmt.id_length or 24):
        number, r = divmod(number, len(_ALNUM))
        chars.append(_ALNUM[r])
    return "".join(chars) if fmt.id_length else "call_" + "".join(chars)


def _split(fmt: ToolFormat, text: str) -> tuple[str, str] | None:
    """(content, call section) by where the call section starts; None when the reply holds no call markup."""
    if fmt.starts_with_json:
        first = _skip_space(text, 0)
        rest = text[first:]
        if rest.startswith("{"):
            return "", rest  # the whitespace before the call is not content worth showing
        for marker in fmt.markers:
            if rest.startswith(marker):
                return "", rest[len(marker) :]
    found = [(i, m) for m in fmt.markers if (i := text.find(m)) >= 0]
    if not found:
        return None
    at, marker = min(found)
    # Hermes and Mistral sections keep their marker (their parsers read the blocks); Llama's tag only opens it.
    section = text[at + len(marker) :] if fmt.starts_with_json else text[at:]
    return text[:at], section


def parse_tool_calls(text: str, fmt: ToolFormat, *, salt: str = "") -> ParsedReply:
    """A whole reply's tool calls in ``fmt`` and its content; malformed call markup leaves the whole text as content.

    ``salt`` goes into the ids (see the module docstring). The reply's text must hold the markers' text: a marker that
    is a special token (``[TOOL_CALLS]``, ``<|python_tag|>``) has to be decoded into it (``CheckpointTokenizer.
    tool_marker_ids``), as vLLM turns ``skip_special_tokens`` off for these parsers.
    """
    split = _split(fmt, text)
    if split is None:
        return ParsedReply(text)
    content, section = split
    try:
        calls = fmt.parse(section)
    except RecursionError:  # a model's JSON nested past what Python reads: malformed, like any other
        return ParsedReply(text)
    if not calls:
        return ParsedReply(text)
    out: list[ToolCall] = []
    taken: set[str] = set()
    for i, c in enumerate(calls):
        try:
            out.append(ToolCall(c.name, c.arguments, _id(fmt, salt, i, c, taken)))
        except ValueError:  # arguments nested deeper than a template may walk: malformed too
            return ParsedReply(text)
        taken.add(str(out[-1].id))
    return ParsedReply(content, tuple(out))


class ToolCallStream:
    """A reply's tool calls, read as its text arrives: :meth:`feed` returns the content that is safe to show.

    Text that may still turn out to be part of a call is held back: a tail that could be the start of a marker
    (``<tool_c`` for Hermes), everything from a marker on, and for Llama 3 JSON a reply that starts with ``{`` or with
    the start of ``<|python_tag|>`` (whitespace before it too, until a non-space character decides). Text held back
    that was not a call after all (a ``<tool`` that went on as ``<tools>``; malformed markup) is returned by a later
    ``feed`` or by :meth:`finish`. So the content shown is always a prefix of :func:`parse_tool_calls`' content for the
    whole reply, and ``finish`` returns the rest and the calls. Each piece costs time in its own length and the
    markers' (nothing is rescanned); not thread-safe: one stream per reply.
    """

    def __init__(self, fmt: ToolFormat, *, salt: str = "") -> None:
        self.format = fmt
        self._salt = salt
        self._shown: list[str] = []  # the text returned as content so far
        self._pending = ""  # the text after it, held back while it may start a marker (short: under a marker's length)
        self._section: list[str] | None = None  # once a call section has started: the text from there on
        self._finished = False

    @property
    def text(self) -> str:
        """The reply so far."""
        return "".join(self._shown) + self._pending + "".join(self._section or ())

    def feed(self, piece: str) -> str:
        """Add the next piece of the reply; return the content that became safe to show (often ``""``)."""
        if self._finished:
            raise RuntimeError("this tool-call stream has finished")
        if self._section is not None:
            self._section.append(piece)
            return ""
        pending = self._pending + piece
        safe, section = self._safe(pending, at_start=not self._shown)
        out = pending[:safe]
        if section:
            self._section = [pending[safe:]]
            self._pending = ""
        else:
            self._pending = pending[safe:]
        if out:
            self._shown.append(out)
        return out

    def finish(self) -> StreamEnd:
        """The reply is complete: the content not yet shown, and the whole reply parsed."""
        if self._finished:
            raise RuntimeError("this tool-call stream has finished")
        self._finished = True
        shown = "".join(self._shown)
        reply = parse_tool_calls(self.text, self.format, salt=self._salt)
        if not reply.content.startswith(shown):  # the hold-back rules guarantee it; a failure is a bug here
            raise AssertionError(f"the stream showed {shown!r:.80} but the reply's content is {reply.content!r:.80}")
        return StreamEnd(reply.content[len(shown) :], reply)

    def _safe(self, pending: str, *, at_start: bool) -> tuple[int, bool]:
        """How much of ``pending`` can no longer be part of a call, and whether a call section starts right after."""
        fmt = self.format
        if fmt.starts_with_json and at_start:
            rest = pending[_skip_space(pending, 0) :]
            if not rest:
                return 0, False  # only whitespace yet: a call may still come
            if rest.startswith("{") or any(rest.startswith(m) for m in fmt.markers):
                return 0, True
            if any(m.startswith(rest) for m in fmt.markers):
                return 0, False
        # A marker: everything from it on is the call section. ``pending`` holds all the text that may contain one:
        # what was shown never ended inside a possible marker's start (below).
        found = [i for m in fmt.markers if (i := pending.find(m)) >= 0]
        if found:
            return min(found), True
        # A tail that is a proper prefix of a marker is held: it may complete into one.
        for keep in range(min(max(map(len, fmt.markers)) - 1, len(pending)), 0, -1):
            if any(m.startswith(pending[-keep:]) for m in fmt.markers):
                return len(pending) - keep, False
        return len(pending), False


# -- forced calls ------------------------------------------------------------------------------------------------------


def check_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-style tools checked and copied as plain JSON data: ``{"type": "function", "function": {"name",
    "description"?, "parameters"?}}`` each, names unique. ``ValueError`` naming the first one that is not."""
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise ValueError(f"tools must be a list of tool objects, got {type(tools).__name__}")
    out: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, tool in enumerate(tools):
        try:
            plain = json.loads(json.dumps(tool))
        except (TypeError, ValueError) as e:
            raise ValueError(f"tools[{i}] is not JSON data: {e}") from None
        function = plain.get("function") if isinstance(plain, dict) else None
        if not isinstance(plain, dict) or plain.get("type") != "function" or not isinstance(function, dict):
            raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}, got {plain!r:.120}')
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string, got {name!r:.80}")
        if name in names:
            raise ValueError(f"tools[{i}]: two tools are named {name!r}")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ValueError(f"tools[{i}] ({name}): parameters must be a JSON schema object, got {parameters!r:.80}")
        out.append(plain)
    return out


def _chosen(tools: list[dict[str, Any]], tool_choice: object) -> list[dict[str, Any]] | None:
    """The tools a forced call may call; None when the choice forces nothing ("auto", "none")."""
    if tool_choice in ("auto", "none", None):
        return None
    if tool_choice == "required":
        if not tools:
            raise ValueError('tool_choice "required" needs at least one tool')
        return tools
    name: object = tool_choice
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str) or isinstance(tool_choice, str):
        raise ValueError(
            'tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}, '
            f"got {tool_choice!r:.120}"
        )
    chosen = [t for t in tools if t["function"]["name"] == name]
    if not chosen:
        known = ", ".join(t["function"]["name"] for t in tools) or "none"
        raise ValueError(f"tool_choice names {name!r}, which is not one of the tools ({known})")
    return chosen


def forced_tool_call(tools: Sequence[Mapping[str, Any]], tool_choice: object, fmt: ToolFormat) -> ForcedToolCall | None:
    """What a reply must be when ``tool_choice`` forces a call: ``"required"`` (any of the tools) or
    ``{"type": "function", "function": {"name": NAME}}`` (that one); None for ``"auto"`` and ``"none"``.

    The schema is of one call object, ``{"name": {"const": NAME}, ARGUMENTS_KEY: the tool's parameters}`` (an
    ``anyOf`` over the tools for ``"required"``), for Llama 3 JSON (key ``parameters``, no prefix) and Hermes (key
    ``arguments``, between ``<tool_call>\\n`` and ``\\n</tool_call>``); for Mistral an array of exactly one such
    object (with an optional 9-character ``id``) after ``[TOOL_CALLS]``: a forced call is one call. The call objects
    allow no other keys, so a constrained model cannot pad a call with keys the parser would ignore.
    """
    chosen = _chosen(check_tools(tools), tool_choice)
    if chosen is None:
        return None
    variants = []
    for tool in chosen:
        function = tool["function"]
        # No parameters: the arguments are {} (OpenAI's reading), not any object a model might pad forever.
        parameters = function.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}
        properties: dict[str, Any] = {"name": {"const": function["name"]}, fmt.arguments_key: parameters}
        if fmt.many and fmt.id_length:
            properties["id"] = {"type": "string", "pattern": f"^[A-Za-z0-9]{{{fmt.id_length}}}$"}
        variants.append(
            {
                "type": "object",
                "properties": properties,
                "required": ["name", fmt.arguments_key],
                "additionalProperties": False,
            }
        )
    call: dict[str, Any] = variants[0] if len(variants) == 1 else {"anyOf": variants}
    # One call, as in the other formats: a model that babbles would otherwise fill the array until its cap, and a
    # reply cut there is no call at all.
    schema = {"type": "array", "items": call, "minItems": 1, "maxItems": 1} if fmt.many else call
    return ForcedToolCall(prefix=fmt.prefix, schema=schema, suffix=fmt.suffix)


# -- the chat model's tool inputs (TOOLS, TOOL_CHOICE, TOOL_META) -----------------------------------------------------

ToolChoice = Literal["auto", "none", "required"] | dict[str, Any]
_CHOICES: Final = ("auto", "none", "required")


def _json_input(raw: bytes | str, name: str, what: str) -> Any:
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes | bytearray) else str(raw)
        return json.loads(text)
    except (UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"{name}: expected {what}, given text that is not JSON ({err})") from None
    except RecursionError:
        raise ValueError(f"{name}: expected {what}, given JSON nested too deeply to read") from None


#: The deepest nesting a tool definition or a call's arguments may have. Far below Python's recursion limit: the
#: template and its marking walk them recursively, on an execute thread and again on the loop's thread, and real
#: schemas and arguments nest a few levels.
MAX_TOOL_NESTING: Final = 64


def _check_nesting(value: object, where: str) -> None:
    """``ValueError`` naming ``where`` when ``value`` nests lists and objects deeper than :data:`MAX_TOOL_NESTING`
    (walked without recursion, so the check itself never runs out of stack)."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > MAX_TOOL_NESTING:
                raise ValueError(f"{where}: nested deeper than {MAX_TOOL_NESTING} levels")
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)


def parse_tools_input(raw: bytes | str) -> tuple[dict[str, Any], ...]:
    """The ``TOOLS`` input: a JSON array of OpenAI tool definitions, checked (:func:`check_tools`); ``ValueError``
    naming the input."""
    value = _json_input(raw, "TOOLS", "a JSON array of tools")
    if not isinstance(value, list):
        raise ValueError(f"TOOLS: expected a JSON array of tools, given a JSON {type(value).__name__}")
    _check_nesting(value, "TOOLS")
    try:
        return tuple(check_tools(value))
    except ValueError as err:
        raise ValueError(f"TOOLS: {err}") from None


def parse_tool_choice(raw: bytes | str, tools: Sequence[Mapping[str, Any]] | None) -> ToolChoice:
    """The ``TOOL_CHOICE`` input: ``auto``, ``none``, ``required`` or ``{"type": "function", "function": {"name"}}``
    (JSON text), checked against ``tools`` (a choice that forces a call needs them, and a named one among them)."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes | bytearray) else str(raw)
    choice: ToolChoice
    if text.strip() in _CHOICES:
        choice = text.strip()  # type: ignore[assignment]
    else:
        value = _json_input(raw, "TOOL_CHOICE", 'auto, none, required or {"type": "function", ...}')
        if value in _CHOICES or isinstance(value, dict):
            choice = value
        else:
            raise ValueError(
                f'TOOL_CHOICE: expected auto, none, required or {{"type": "function", "function": {{"name": ...}}}}, '
                f"given {text!r:.120}"
            )
    if choice in ("auto", "none"):
        return choice
    try:
        _chosen([dict(t) for t in tools or ()], choice)
    except ValueError as err:
        raise ValueError(f"TOOL_CHOICE: {err}") from None
    return choice


@dataclass(frozen=True, slots=True)
class MessageTools:
    """One message's tool-use fields (a ``TOOL_META`` entry)."""

    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None

    @property
    def empty(self) -> bool:
        return not self.tool_calls and self.tool_call_id is None and self.name is None


NO_TOOLS: Final = MessageTools()
_META_KEYS: Final = frozenset({"tool_calls", "tool_call_id", "name"})


def parse_tool_meta(raw: bytes | str, role: str, where: str) -> MessageTools:
    """A ``TOOL_META`` entry for a message of ``role`` (``where``: ``TOOL_META[i]``): ``""`` or a JSON object with
    ``tool_calls`` (an assistant's, ``[{"id", "name", "arguments"}]``), ``tool_call_id`` and ``name`` (a tool
    result's); ``ValueError`` naming the entry."""
    if not raw:
        return NO_TOOLS
    value = _json_input(raw, where, "a JSON object of tool fields")
    _check_nesting(value, where)
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a JSON object of tool fields, given a JSON {type(value).__name__}")
    unknown = sorted(set(value) - _META_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r:.40} (known: name, tool_call_id, tool_calls)")
    calls_raw = value.get("tool_calls") or []
    if calls_raw and role != "assistant":
        raise ValueError(f"{where}: tool_calls belong to an assistant message, given on a {role} message")
    if not isinstance(calls_raw, list):
        raise ValueError(f"{where}: tool_calls must be a list, given {type(calls_raw).__name__}")
    calls = []
    for k, c in enumerate(calls_raw):
        if not isinstance(c, dict):
            raise ValueError(f"{where}.tool_calls[{k}]: expected an object with id, name and arguments")
        try:
            calls.append(ToolCall(name=c.get("name"), arguments=c.get("arguments"), id=c.get("id")))  # type: ignore[arg-type]
        except ValueError as err:
            raise ValueError(f"{where}.tool_calls[{k}]: {err}") from None
    for key in ("tool_call_id", "name"):
        if value.get(key) is not None and not isinstance(value[key], str):
            raise ValueError(f"{where}: {key} must be a string, given {type(value[key]).__name__}")
    if value.get("tool_call_id") is not None and role != "tool":
        raise ValueError(f"{where}: tool_call_id belongs to a tool message, given on a {role} message")
    return MessageTools(tuple(calls), value.get("tool_call_id"), value.get("name"))


#: How a forced call's JSON is spaced (as ``json.dumps`` writes it: what models saw), in llguidance's schema option.
_CALL_LAYOUT: Final[dict[str, Any]] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def forced_grammar(
    forced: ForcedToolCall, pieces: Callable[[str], list[str | int]], *, alternative: dict[str, Any] | None = None
) -> str:
    """A forced call as a grammar in llguidance's Lark dialect: ``prefix``, the call's JSON, ``suffix``.

    ``pieces(text)`` splits the checkpoint's markup into text and control-token ids (``CheckpointTokenizer.
    split_controls``): a control token is written ``<[id]>`` (the one token, never its spelling in text), text as a
    string literal. ``alternative``: a JSON schema the reply may be instead of a call (``tool_choice`` auto with a
    JSON ``response_format``: the model chooses between its answer and a call).
    """

    def literal(text: str) -> str:
        out = []
        for piece in pieces(text):
            out.append(f"<[{piece}]>" if isinstance(piece, int) else json.dumps(piece))
        return " ".join(out)

    schema = {**forced.schema, "x-guidance": _CALL_LAYOUT}
    call = " ".join(p for p in (literal(forced.prefix), "call_json", literal(forced.suffix)) if p)
    lines = [f"start: {call}" if alternative is None else f"start: answer_json | {call}"]
    lines.append(f"call_json: %json {json.dumps(schema, ensure_ascii=False)}")
    if alternative is not None:
        answer = {**alternative, "x-guidance": _CALL_LAYOUT}
        lines.append(f"answer_json: %json {json.dumps(answer, ensure_ascii=False)}")
    return "\n".join(lines)
