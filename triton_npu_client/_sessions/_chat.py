"""Chat sessions: one conversation with a decoupled, sequence-batched chat model, its history kept on the server.

::

    async with client.chat("chat", system="You are terse.", max_tokens=200) as chat:
        async for piece in chat.send("hello", temperature=0.7, seed=1):   # str pieces as they stream
            print(piece, end="", flush=True)
        print(chat.last_reply.tokens_per_s)
        reply = await chat.ask("and then?")                             # the whole reply at once
        print(reply.text, reply.finish_reason)

- **Where the history lives.** On the server (its KV cache): each turn sends only what is new, the user's
  message (the first turn also the system message and any ``history=``). The client keeps the sequence id,
  the token counts and :attr:`ChatSession.messages`, the completed messages, so a conversation can be replayed
  into a fresh chat: ``client.chat(name, history=old.messages)`` (system messages may sit inside a history).
- **Options** (``max_tokens``, ``min_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``,
  ``stream_interval_ms``) given when the chat is opened are its defaults; each turn may override them. Only options
  given are sent (the server has its own defaults). They are checked before anything is sent
  (:class:`ChatOptionError` names the option).
- **Tools.** ``tools=`` (:class:`Tool` values or OpenAI's tool definitions) and ``tool_choice=`` are options like
  the others (the chat's defaults, or a turn's). A reply that calls has :attr:`ChatReply.tool_calls` (its
  ``finish_reason`` ``"tool_calls"``; its text the content before the calls); answer with the results as the next
  turn, ``chat.send([ChatMessage.tool_result(call, "...") for call in reply.tool_calls])``. The history keeps the
  assistant's calls and the results (``TOOL_META`` carries their fields, a replay of :attr:`~ChatSession.messages`
  included), and the digest covers them.
- **Streaming interval.** ``stream_interval_ms`` asks the server to merge a turn's pieces into at most one response
  per that many milliseconds (the first piece and the last response go at once): fewer, larger pieces cost the
  server, Triton and this client less per token, so many conversations at once decode faster. 0 streams every
  token; not given, the model's own ``stream_interval_ms`` parameter (0 in the shipped configs) decides.
- **Pieces.** The server streams raw bytes that may split a multi-byte UTF-8 character; they are decoded
  incrementally per turn (invalid bytes become U+FFFD), and no empty string is ever yielded.
- **Cancelling a turn** (cancelling the task, or leaving the loop early) cancels it on the server, which rolls
  it back: the turn is not added to :attr:`~ChatSession.messages` and the chat goes on. To cancel at once on
  ``break``, iterate inside ``contextlib.aclosing(chat.send(...))``; a loop left without it is closed only when
  the generator is collected, and until then a new turn is refused with :class:`ChatBusyError`.
- **A turn that times out** (the chat's ``timeout_s``, or the turn's own) is rolled back the same way: it raises
  :class:`RequestTimeout` (a :class:`TimeoutError`), is not added to the messages, and the chat goes on.
- **The history digest.** Both sides chain a digest over the committed turns (``_protocol``'s). Every turn but
  a START sends the client's (when the model takes ``DIGEST``), so a turn the server finished but the
  client never saw end (cancelled or timed out at its last response) is rolled back there too. A final
  response whose digest differs from the client's raises :class:`ChatHistoryMismatch` (never expected); that
  turn is not kept, and the next turn makes the server drop it as well.
- **One turn at a time.** A turn started while another streams on the same chat raises :class:`ChatBusyError`
  at once (nothing is queued).
- **Losses.** When the server no longer holds the conversation (eviction at the slot cap, idle timeout,
  restart, reload), :class:`SequenceLost` propagates and the chat is lost, unless it was opened with
  ``replay_on_loss=True``: then a turn lost before it yielded anything sends the recorded
  :attr:`~ChatSession.messages` and its user message as the first turn of a fresh sequence (a new id), which
  rebuilds exactly the same tokens; :attr:`~ChatSession.replays` counts it and :attr:`ChatReply.replayed`
  marks the turn. A loss after a turn yielded pieces propagates, and the next turn replays.
- **Closing** the chat (leaving its block) sends END with no inputs, once: the server frees the conversation.
  A turn still streaming (read by another task, or left without closing its loop) is cancelled first and END
  leaves at once; its reader gets :class:`SequenceClosedError`.
- **Resuming** (a gateway across its restarts). :attr:`ChatSession.state` is a :class:`ChatState`: the id, the
  committed messages, the digest and the counts, JSON-able (``to_dict``/``from_dict``). :meth:`ChatSession.detach`
  closes the chat here without END (the server keeps the conversation until the model's idle timeout), and
  ``client.chat(name, resume=state)``, in any process, goes on with it: no START, the first turn sends only the
  new user message and the state's digest. The server checks that digest as for any turn: equal, the turn
  proceeds; equal to the one before its last turn (the state is one turn behind: a turn ended there after the
  state was saved), it undoes that turn and proceeds from the state; anything else, or a conversation it no longer
  holds, is :class:`SequenceLost`, and ``replay_on_loss`` replays ``state.messages`` into a fresh sequence. Never
  are two histories mixed; but one state's conversation serves one chat at a time (a lost one ENDs its id).
"""

from __future__ import annotations

import codecs
import contextlib
import json
import math
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Final, Self, TypedDict, Unpack, cast

import attrs
import numpy as np

from .._call import USE_CLIENT_DEFAULT, UseClientDefault
from .._errors import (
    ChatBusyError,
    ChatHistoryMismatch,
    ChatMessageError,
    ChatOptionError,
    InternalServerError,
    SequenceClosedError,
    SequenceLost,
    SequenceUsageError,
)
from .._model import ModelSpec
from .._protocol import EMPTY, digest_role, history_digest
from .._protocol import chat as proto
from .._trace import AVAILABLE as TRACING
from .._trace import Span
from .._trace import start as start_span
from .._wire import InferResult
from ._constraint import ResponseFormat, as_response_format
from ._sequence import (
    DEFAULT_END_TIMEOUT_S,
    MAX_INT_ID,
    MAX_STR_ID_CHARS,
    SequenceSession,
    SessionTarget,
    open_sequence,
)
from ._tools import (
    Tool,
    ToolCall,
    ToolChoice,
    as_tool_choice,
    as_tools,
    calls_from_wire,
    choice_name,
    choice_wire,
    tools_wire,
)

__all__ = [
    "ChatMessage",
    "ChatOpenArgs",
    "ChatOptionArgs",
    "ChatOptions",
    "ChatReply",
    "ChatSession",
    "ChatState",
    "PieceDecoder",
    "TokenLogprob",
    "TopLogprob",
    "defer_chat",
    "open_chat",
]

ROLES: Final = ("system", "user", "assistant", "tool")
_INT32_MAX: Final = 2**31 - 1
#: The most alternatives per token the server gives with a log-probability (OpenAI's top_logprobs cap).
MAX_TOP_LOGPROBS: Final = 20
_INT64_MIN: Final = -(2**63)
_INT64_MAX: Final = 2**63 - 1


# --- values --------------------------------------------------------------------------------------


def _check_role(_: object, __: object, value: Any) -> None:
    if value not in ROLES:
        raise ChatMessageError(f"a chat message's role is one of {', '.join(ROLES)}; given {value!r}")


def _check_text(_: object, __: object, value: Any) -> None:
    if not isinstance(value, str):
        raise ChatMessageError(f"a chat message's text is a str; given {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:  # lone surrogates: the server takes UTF-8 only
        raise ChatMessageError(f"a chat message's text must be encodable as UTF-8: {err}") from None


def _to_tool_calls(value: Any) -> tuple[ToolCall, ...]:
    # Checked here, on the value as given: ToolCall values, or OpenAI's call mappings (a message's tool_calls as the
    # openai client gives them).
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise ChatMessageError(
            f"a chat message's tool_calls is a sequence of ToolCall values; given {type(value).__name__}"
        )
    return tuple(c if isinstance(c, ToolCall) else ToolCall.from_openai(c) for c in value)


def _check_optional_str(field: str) -> Callable[[object, object, Any], None]:
    def check(_: object, __: object, value: Any) -> None:
        if value is not None and (not isinstance(value, str) or not value):
            raise ChatMessageError(f"a chat message's {field} is a non-empty str or None; given {value!r:.80}")

    return check


@attrs.frozen
class ChatMessage:
    """One message of a conversation: ``role`` ("system", "user", "assistant" or "tool") and its ``text``, and the
    fields tool use adds (keywords, empty for a plain message):

    ``tool_calls``: an assistant message's calls (:class:`ToolCall` values, or OpenAI's call mappings), its ``text``
    then the content before them (often ``""``); ``tool_call_id``: a ``tool`` message's, the id of the call whose
    result its ``text`` is (:meth:`tool_result` makes one); ``name``: the function's name on a tool result (some
    templates show it). Checked when made (:class:`ChatMessageError`): calls only on an assistant message, a call id
    only on a tool message.
    """

    role: str = attrs.field(validator=_check_role)
    text: str = attrs.field(validator=_check_text)
    tool_calls: tuple[ToolCall, ...] = attrs.field(default=(), kw_only=True, converter=_to_tool_calls)
    tool_call_id: str | None = attrs.field(default=None, kw_only=True, validator=_check_optional_str("tool_call_id"))
    name: str | None = attrs.field(default=None, kw_only=True, validator=_check_optional_str("name"))

    def __attrs_post_init__(self) -> None:
        if self.tool_calls and self.role != "assistant":
            raise ChatMessageError(f"tool_calls belong to an assistant message; given on a {self.role} message")
        if self.tool_call_id is not None and self.role != "tool":
            raise ChatMessageError(f"tool_call_id belongs to a tool message; given on a {self.role} message")

    @classmethod
    def tool_result(cls, call: ToolCall | str, text: Any, *, name: str | None = None) -> ChatMessage:
        """The ``tool`` message answering ``call`` (a :class:`ToolCall`, or its id) with ``text``: a str, or any
        JSON data (sent as its JSON text). ``name`` defaults to the call's function name (given a ToolCall)."""
        if isinstance(call, ToolCall):
            call_id, name = call.id, call.name if name is None else name
        elif isinstance(call, str) and call:
            call_id = call
        else:
            raise ChatMessageError(f"a tool result answers a ToolCall or its id (a non-empty str); given {call!r:.80}")
        if not isinstance(text, str):
            try:
                text = json.dumps(text, ensure_ascii=False)
            except (TypeError, ValueError, RecursionError) as err:
                raise ChatMessageError(f"a tool result's text is a str or JSON data ({err})") from None
        return cls("tool", text, tool_call_id=call_id, name=name)

    @property
    def has_tool_fields(self) -> bool:
        """Whether the message carries tool-use fields (``TOOL_META`` sends them)."""
        return bool(self.tool_calls) or self.tool_call_id is not None or self.name is not None

    def tool_meta(self) -> str:
        """The message's ``TOOL_META`` entry: ``""`` for one without tool fields, else a JSON object of them."""
        if not self.has_tool_fields:
            return ""
        return json.dumps(self.tool_fields(), separators=(",", ":"), ensure_ascii=False)

    def tool_fields(self) -> dict[str, Any]:
        """The tool-use fields that are set, as plain data (what ``TOOL_META`` and a state's dict write)."""
        fields: dict[str, Any] = {}
        if self.tool_calls:
            fields["tool_calls"] = [c.wire for c in self.tool_calls]
        if self.tool_call_id is not None:
            fields["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            fields["name"] = self.name
        return fields

    @property
    def digest_key(self) -> tuple[str, str]:
        """What the history digest takes for this message: its role as ``digest_role`` spells it, and its text."""
        calls = tuple((c.id, c.name, c.arguments) for c in self.tool_calls)
        role = digest_role(self.role, tool_calls=calls, tool_call_id=self.tool_call_id, name=self.name)
        return (role, self.text)


def as_messages(
    history: Iterable[ChatMessage | tuple[str, str]] | None, *, what: str = "history"
) -> tuple[ChatMessage, ...]:
    """``history`` as :class:`ChatMessage` values: each item is one already, or a ``(role, text)`` pair (``what``
    names the argument in an error)."""
    if history is None:
        return ()
    if isinstance(history, str | bytes):
        raise ChatMessageError(f"{what} is a sequence of ChatMessage values or (role, text) pairs, given a string")
    out: list[ChatMessage] = []
    for i, item in enumerate(history):
        if isinstance(item, ChatMessage):
            out.append(item)
        elif isinstance(item, tuple) and len(item) == 2:
            out.append(ChatMessage(item[0], item[1]))
        else:
            raise ChatMessageError(
                f"{what}[{i}]: expected a ChatMessage or a (role, text) pair, given {type(item).__name__}"
            )
    return tuple(out)


def as_turn(message: str | ChatMessage | Sequence[ChatMessage | tuple[str, str]]) -> tuple[ChatMessage, ...]:
    """A turn's new messages from what :meth:`ChatSession.send` takes: a str (a user message), one
    :class:`ChatMessage`, or a sequence of them (or of ``(role, text)`` pairs); the last is a user message or a tool
    result, as the server requires."""
    if isinstance(message, str):
        messages: tuple[ChatMessage, ...] = (ChatMessage("user", message),)
    elif isinstance(message, ChatMessage):
        messages = (message,)
    elif isinstance(message, Sequence) and not isinstance(message, bytes):
        messages = as_messages(cast(Sequence[ChatMessage | tuple[str, str]], message), what="message")
    else:
        raise ChatMessageError(
            f"a turn's message is a str, a ChatMessage or a sequence of them; given {type(message).__name__}"
        )
    if not messages:
        raise ChatMessageError("a turn sends at least one message (a user message or a tool result)")
    if messages[-1].role not in ("user", "tool"):
        raise ChatMessageError(
            f"a turn's last message is a user message or a tool result (role user or tool); given {messages[-1].role}"
        )
    return messages


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool | np.bool_)


def _check_max_tokens(_: object, __: object, value: Any) -> None:
    if value is not None and not (_is_int(value) and 0 <= int(value) <= _INT32_MAX):
        raise ChatOptionError("max_tokens", "an int >= 1, or 0 for no cap (to the end of the context)", value)


def _check_min_tokens(_: object, __: object, value: Any) -> None:
    if value is not None and not (_is_int(value) and 0 <= int(value) <= _INT32_MAX):
        raise ChatOptionError("min_tokens", "an int >= 0", value)


def _check_temperature(_: object, __: object, value: Any) -> None:
    # NaN fails every comparison, so it is refused here too.
    if value is not None and not (_is_number(value) and 0 <= float(value) < math.inf):
        raise ChatOptionError("temperature", "a number >= 0 (0: greedy)", value)


def _check_top_p(_: object, __: object, value: Any) -> None:
    if value is not None and not (_is_number(value) and 0 < float(value) <= 1):
        raise ChatOptionError("top_p", "a number in (0, 1]", value)


def _check_top_k(_: object, __: object, value: Any) -> None:
    if value is not None and not (_is_int(value) and 0 <= int(value) <= _INT32_MAX):
        raise ChatOptionError("top_k", "an int >= 0 (0: off)", value)


def _check_seed(_: object, __: object, value: Any) -> None:
    if value is not None and not (_is_int(value) and _INT64_MIN <= int(value) <= _INT64_MAX):
        raise ChatOptionError("seed", "an int in the int64 range", value)


def _check_stream_interval(_: object, __: object, value: Any) -> None:
    if value is not None and not (_is_int(value) and 0 <= int(value) <= proto.STREAM_INTERVAL_MAX_MS):
        longest = proto.STREAM_INTERVAL_MAX_MS
        raise ChatOptionError("stream_interval_ms", f"an int in 0..{longest} (0: every token)", value)


def _check_penalty(name: str) -> Callable[[object, object, Any], None]:
    def check(_: object, __: object, value: Any) -> None:
        if value is not None and not (_is_number(value) and -2 <= float(value) <= 2):
            raise ChatOptionError(name, "a number in -2..2 (0: off)", value)

    return check


def _check_repetition(_: object, __: object, value: Any) -> None:
    if value is not None and not (_is_number(value) and 0 < float(value) <= 10):
        raise ChatOptionError("repetition_penalty", "a number in (0, 10] (1: off)", value)


def _check_logprobs(_: object, __: object, value: Any) -> None:
    if value is not None and not (_is_int(value) and 0 <= int(value) <= MAX_TOP_LOGPROBS):
        raise ChatOptionError("logprobs", f"an int in 0..{MAX_TOP_LOGPROBS} (alternatives per token)", value)


def _to_stop(value: Iterable[str] | None) -> Any:
    # Checked here, on the value as given (a validator would see it converted). A bare string is refused:
    # tuple("###") would silently be three stops.
    if value is None:
        return None
    stops = tuple(value) if isinstance(value, Iterable) and not isinstance(value, str | bytes) else None
    if stops is None or not all(isinstance(s, str) and s for s in stops):
        raise ChatOptionError("stop", "a list of non-empty strings", value)
    return stops


class ChatOptionArgs(TypedDict, total=False):
    """The generation options by keyword, each optional: what a chat takes as its defaults and a turn
    (:meth:`ChatSession.send`, :meth:`~ChatSession.ask`) as its own. ``None`` leaves an option as it is (the chat's
    default, else the server's). Checked as :class:`ChatOptions` (their value) checks them."""

    max_tokens: int | None
    min_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: Sequence[str] | None
    stream_interval_ms: int | None
    response_format: ResponseFormat | Mapping[str, Any] | None
    presence_penalty: float | None
    frequency_penalty: float | None
    repetition_penalty: float | None
    logprobs: int | None
    tools: Sequence[Tool | Mapping[str, Any]] | None
    tool_choice: str | Mapping[str, Any] | Tool | None


_OPTION_NAMES: Final = ChatOptionArgs.__optional_keys__


def _refuse_unknown(given: Mapping[str, object], names: frozenset[str]) -> None:
    """A keyword not among ``names`` is a TypeError, as Python raises for a signature that spells its keywords."""
    unknown = sorted(set(given) - names)
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r} for a chat (it takes: {', '.join(sorted(names))})")


@attrs.frozen(kw_only=True)
class ChatOptions:
    """Generation options of a chat or a turn; ``None`` leaves an option to the server's default.

    ``max_tokens`` >= 1; ``min_tokens`` >= 0, at most ``max_tokens`` (the reply may not end before that many
    tokens: for benchmarks and fixed-length replies); ``temperature`` >= 0 (0 = greedy); ``top_p`` in (0, 1];
    ``top_k`` >= 0 (0 = off); ``seed`` (same seed, same reply); ``stop``: strings the reply is cut before (an
    empty list sends none); ``stream_interval_ms`` in 0..60000: at most one response per that many milliseconds
    while the reply streams (0: one per token); ``response_format``: what the reply must be (a
    :class:`ResponseFormat`, or OpenAI's ``response_format`` mapping; ``{"type": "text"}`` clears it), enforced by
    the server token by token. ``max_tokens`` 0: no cap, the reply may run to the end of the context.
    ``presence_penalty`` and ``frequency_penalty`` in -2..2 (OpenAI's: subtracted from the logit of a token already
    in the reply, once / per time it appeared); ``repetition_penalty`` in (0, 10] (Hugging Face's: the logit of a
    token in the prompt or the reply divided by it where positive, multiplied where not; 1 is off).
    ``logprobs`` in 0..20: each reply token's log-probability (the model's own distribution, before temperature,
    penalties and ``response_format``) with that many most likely alternatives, on :attr:`ChatReply.logprobs`.
    ``tools``: the functions the model may call (:class:`Tool` values or OpenAI's tool definitions, names unique; an
    empty list is none, clearing a chat's default), rendered by the model's chat template: give the same ones every
    turn, and the server's cache keeps the conversation's prefix. ``tool_choice``: ``"auto"`` (the server's default:
    the model may call), ``"none"`` (the tools shown, the reply text), ``"required"`` (one or more calls) or a named
    function (OpenAI's ``{"type": "function", "function": {"name": N}}``, or a :class:`Tool`); ``"required"`` and a
    named function make the server constrain the reply to a call whose arguments are valid for the function's
    ``parameters``. A named function must be among the tools, and a choice that forces a call needs tools at the turn.
    Invalid values raise :class:`ChatOptionError` naming the option.
    """

    max_tokens: int | None = attrs.field(default=None, validator=_check_max_tokens)
    min_tokens: int | None = attrs.field(default=None, validator=_check_min_tokens)
    temperature: float | None = attrs.field(default=None, validator=_check_temperature)
    top_p: float | None = attrs.field(default=None, validator=_check_top_p)
    top_k: int | None = attrs.field(default=None, validator=_check_top_k)
    seed: int | None = attrs.field(default=None, validator=_check_seed)
    stop: tuple[str, ...] | None = attrs.field(default=None, converter=_to_stop)
    stream_interval_ms: int | None = attrs.field(default=None, validator=_check_stream_interval)
    response_format: ResponseFormat | None = attrs.field(default=None, converter=as_response_format)
    presence_penalty: float | None = attrs.field(default=None, validator=_check_penalty("presence_penalty"))
    frequency_penalty: float | None = attrs.field(default=None, validator=_check_penalty("frequency_penalty"))
    repetition_penalty: float | None = attrs.field(default=None, validator=_check_repetition)
    logprobs: int | None = attrs.field(default=None, validator=_check_logprobs)
    tools: tuple[Tool, ...] | None = attrs.field(default=None, converter=as_tools)
    tool_choice: ToolChoice | None = attrs.field(default=None, converter=as_tool_choice)

    def __attrs_post_init__(self) -> None:
        if self.min_tokens is not None and self.max_tokens and self.min_tokens > self.max_tokens:
            raise ChatOptionError("min_tokens", f"an int in 0..max_tokens ({self.max_tokens})", self.min_tokens)
        # Checked when both are known: a chat's default choice may name a function its turns bring.
        named = choice_name(self.tool_choice)
        if named is not None and self.tools is not None and named not in {t.name for t in self.tools}:
            known = ", ".join(t.name for t in self.tools) or "no tools"
            raise ChatOptionError("tool_choice", f"a function among the tools ({known})", self.tool_choice)

    def check_turn(self) -> None:
        """What only a turn's options (the chat's with the turn's own) can be checked for: a choice that forces a
        call (``"required"``, a named function) needs tools; the server would refuse the turn."""
        if self.tool_choice not in (None, "auto", "none") and not self.tools:
            raise ChatOptionError(
                "tool_choice", "auto or none for a turn without tools (give tools=)", self.tool_choice
            )

    def override(self, **given: Unpack[ChatOptionArgs]) -> ChatOptions:
        """These options with every one given (not ``None``) replaced; checked like the constructor."""
        _refuse_unknown(given, _OPTION_NAMES)
        changes: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
        return attrs.evolve(self, **changes) if changes else self

    def inputs(self) -> dict[str, np.ndarray[Any, Any]]:
        """The model inputs for the options that are set (dtypes as the chat model declares them)."""
        out: dict[str, np.ndarray[Any, Any]] = {}
        if self.max_tokens is not None:
            out[proto.MAX_TOKENS] = np.array([self.max_tokens], np.int32)
        if self.min_tokens is not None:
            out[proto.MIN_TOKENS] = np.array([self.min_tokens], np.int32)
        if self.temperature is not None:
            out[proto.TEMPERATURE] = np.array([self.temperature], np.float32)
        if self.top_p is not None:
            out[proto.TOP_P] = np.array([self.top_p], np.float32)
        if self.top_k is not None:
            out[proto.TOP_K] = np.array([self.top_k], np.int32)
        if self.seed is not None:
            out[proto.SEED] = np.array([self.seed], np.int64)
        if self.stop:
            out[proto.STOP] = np.array([s.encode() for s in self.stop], dtype=object)
        if self.stream_interval_ms is not None:
            out[proto.STREAM_INTERVAL_MS] = np.array([self.stream_interval_ms], np.int32)
        if self.response_format is not None:
            out[proto.CONSTRAINT] = np.array([self.response_format.wire().encode()], dtype=object)
        for name, value in (
            (proto.PRESENCE_PENALTY, self.presence_penalty), (proto.FREQUENCY_PENALTY, self.frequency_penalty),
            (proto.REPETITION_PENALTY, self.repetition_penalty),
        ):  # fmt: skip
            if value is not None:
                out[name] = np.array([value], np.float32)
        if self.logprobs is not None:
            out[proto.LOGPROBS] = np.array([self.logprobs], np.int32)
        # No tools (an empty list clears a chat's default) sends none: the template renders the plain conversation.
        if self.tools:
            out[proto.TOOLS] = np.array([tools_wire(self.tools).encode()], dtype=object)
        if self.tool_choice is not None:
            out[proto.TOOL_CHOICE] = np.array([choice_wire(self.tool_choice).encode()], dtype=object)
        return out


@attrs.frozen
class TopLogprob:
    """One alternative to a reply token: its text (its bytes decoded, U+FFFD where they cut a character), its raw
    ``bytes`` and its ``logprob``."""

    token: str
    bytes: bytes
    logprob: float


@attrs.frozen
class TokenLogprob:
    """One reply token's log-probability (:attr:`ChatReply.logprobs`), with its ``top`` most likely alternatives."""

    token: str
    bytes: bytes
    logprob: float
    top: tuple[TopLogprob, ...] = ()


def _logprob_entries(raw: bytes) -> list[TokenLogprob]:
    """A LOGPROBS output (the server's JSON entries) as values."""
    out = []
    for entry in json.loads(raw):
        b = bytes.fromhex(entry["b"])
        top = tuple(
            TopLogprob(bytes.fromhex(h).decode("utf-8", "replace"), bytes.fromhex(h), float(lp))
            for _, h, lp in entry["top"]
        )
        out.append(TokenLogprob(b.decode("utf-8", "replace"), b, float(entry["lp"]), top))
    return out


@attrs.frozen(kw_only=True)
class ChatReply:
    """One completed turn: the reply's text and what the server reported about it. ``str(reply)`` is the text.

    ``finish_reason``: ``"stop"`` (the model ended the reply), ``"stop_string"``, ``"length"`` (``max_tokens``
    reached), ``"context"`` (the conversation filled the model's context) or ``"tool_calls"`` (the reply made
    calls, whatever ended it: OpenAI's reading). ``tool_calls``: those calls (:class:`ToolCall` values, ids made by
    the server); ``text`` is then the content before them (often ``""``: the server never sends a call's markup).
    Answer them with :meth:`ChatMessage.tool_result` messages as the next turn. ``tokens``: generated this turn;
    ``prompt_tokens``: prefilled this turn; ``context_tokens``: held by the conversation afterwards;
    ``dropped``: messages the server dropped from the oldest end of the history to make room.
    ``input_tokens``: the whole prompt the reply was conditioned on (the history the server held plus what it
    prefilled: what an API bills as input); 0 from a model that does not report it (a config from before it).
    ``time_to_first_token_s``: from sending to the first text (``None`` for an empty reply);
    ``elapsed_s``: from sending to the last response. Both count from the turn's first send, so for a turn that
    was ``replayed`` (the conversation was lost and replayed into a fresh one: ``replay_on_loss``) they include
    the lost attempt and the replay's prefill: what the caller waited.
    """

    text: str
    finish_reason: str
    tokens: int
    prompt_tokens: int
    context_tokens: int
    dropped: int
    time_to_first_token_s: float | None
    elapsed_s: float
    replayed: bool = False
    input_tokens: int = 0
    #: With ``logprobs``: each reply token's log-probability (a stop string's tokens included), else None.
    logprobs: tuple[TokenLogprob, ...] | None = None
    tool_calls: tuple[ToolCall, ...] = ()

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second over the whole turn (prefill included); 0.0 for an instant one."""
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def __str__(self) -> str:
        return self.text


class PieceDecoder:
    """Raw reply bytes -> text, across pieces that may split a multi-byte UTF-8 character.

    :meth:`feed` returns the text complete so far (possibly ``""``); :meth:`flush` returns what an unfinished
    character at the end becomes (U+FFFD) and resets. Invalid bytes become U+FFFD, never an exception.
    """

    __slots__ = ("_decoder",)

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, piece: bytes) -> str:
        return self._decoder.decode(piece)

    def flush(self) -> str:
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text


# --- a chat's state, to resume it ----------------------------------------------------------------

_STATE_KEYS: Final = ("model", "sequence_id", "messages", "pinned", "digest", "turns", "context_tokens")
#: A message's keys in a state's dict: role and text always, the tool-use fields only when set (so a state without
#: tools reads, and is written, exactly as before them).
_MESSAGE_KEYS: Final = frozenset({"role", "text"})
_MESSAGE_TOOL_KEYS: Final = frozenset({"tool_calls", "tool_call_id", "name"})


def _message_dict(m: ChatMessage) -> dict[str, Any]:
    return {"role": m.role, "text": m.text, **m.tool_fields()}


def _message_from_dict(item: Mapping[str, Any]) -> ChatMessage:
    calls = item.get("tool_calls", ())
    if not isinstance(calls, list | tuple) or not all(isinstance(c, Mapping) for c in calls):
        raise ChatMessageError(
            f"tool_calls: expected a list of {{'id', 'name', 'arguments'}} mappings, given {calls!r:.80}"
        )
    for c in calls:
        if set(c) != {"id", "name", "arguments"}:
            raise ChatMessageError(
                f"tool_calls: expected {{'id', 'name', 'arguments'}} mappings, given keys {sorted(map(str, c))}"
            )
    return ChatMessage(
        item["role"], item["text"],
        tool_calls=tuple(ToolCall(id=c["id"], name=c["name"], arguments=c["arguments"]) for c in calls),
        tool_call_id=item.get("tool_call_id"), name=item.get("name"),
    )  # fmt: skip


_HEX: Final = frozenset("0123456789abcdef")
_DIGEST_MAX_CHARS: Final = 64  # the server's cap on a DIGEST input


def _state_error(key: str, expected: str, given: object) -> SequenceUsageError:
    shown = repr(given) if isinstance(given, int | str | None) and len(repr(given)) <= 80 else type(given).__name__
    return SequenceUsageError(f"chat state {key!r}: expected {expected}, given {shown}")


def _check_state_model(_: object, __: object, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise _state_error("model", "a model name (a non-empty str)", value)


def _check_state_id(_: object, __: object, value: Any) -> None:
    # The model's own rules (an int or a str id?) are checked when the resumed chat reaches it.
    if isinstance(value, bool) or not (
        (isinstance(value, int) and 0 < value <= MAX_INT_ID)
        or (isinstance(value, str) and 0 < len(value) <= MAX_STR_ID_CHARS)
    ):
        raise _state_error(
            "sequence_id", f"an int in 1..2**63-1 or a str of 1..{MAX_STR_ID_CHARS} characters", value
        )  # fmt: skip


def _to_state_messages(value: Any) -> tuple[ChatMessage, ...]:
    if not isinstance(value, tuple | list) or not all(isinstance(m, ChatMessage) for m in value):
        raise ChatMessageError(
            f"chat state 'messages': expected a sequence of ChatMessage values, given {type(value).__name__}"
        )
    return tuple(value)


def _check_count(key: str) -> Callable[[object, object, Any], None]:
    def check(_: object, __: object, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _state_error(key, "an int >= 0", value)

    return check


def _check_state_digest(_: object, __: object, value: Any) -> None:
    if not isinstance(value, str) or len(value) > _DIGEST_MAX_CHARS or not set(value) <= _HEX:
        raise _state_error("digest", f'a history digest ("" or at most {_DIGEST_MAX_CHARS} hex digits)', value)


@attrs.frozen(kw_only=True)
class ChatState:
    """What resuming a chat needs (:attr:`ChatSession.state`): ``client.chat(name, resume=state)`` continues the
    conversation the server still holds, sending only the next user message; its JSON-able form is
    :meth:`to_dict` / :meth:`from_dict`.

    ``model``: the chat model's name; ``sequence_id``: the conversation's id on the server; ``messages``:
    :attr:`ChatSession.messages`, the committed conversation (what a replay sends when the server no longer holds
    it); ``pinned``: how many leading system messages the server never drops; ``digest``: the history digest of
    the committed turns (``_protocol``'s ``history_digest``; ``""``: nothing committed on that sequence yet, so a
    resumed chat starts it afresh with ``messages``); ``turns`` and ``context_tokens`` as on the chat.
    Checked when made: a wrong value raises :class:`ChatMessageError` (``messages``) or
    :class:`SequenceUsageError` (the others), naming the field.
    """

    model: str = attrs.field(validator=_check_state_model)
    sequence_id: int | str = attrs.field(validator=_check_state_id)
    messages: tuple[ChatMessage, ...] = attrs.field(converter=_to_state_messages)
    pinned: int = attrs.field(validator=_check_count("pinned"))
    digest: str = attrs.field(validator=_check_state_digest)
    turns: int = attrs.field(validator=_check_count("turns"))
    context_tokens: int = attrs.field(validator=_check_count("context_tokens"))

    def __attrs_post_init__(self) -> None:
        # The server keeps its pinned messages at the front of the history: system messages, never dropped.
        if self.pinned > len(self.messages) or any(m.role != "system" for m in self.messages[: self.pinned]):
            raise _state_error(
                "pinned", f"the count of leading system messages kept (of {len(self.messages)} messages)", self.pinned
            )

    def to_dict(self) -> dict[str, Any]:
        """The state as plain JSON values (str, int, lists and dicts): ``json.dumps(state.to_dict())`` stores it.

        An integer ``sequence_id`` may need all 63 bits: a JSON reader that turns numbers into doubles (JavaScript)
        would corrupt it; Python's ``json`` keeps it exact.
        """
        return {
            "model": self.model,
            "sequence_id": self.sequence_id,
            "messages": [_message_dict(m) for m in self.messages],
            "pinned": self.pinned,
            "digest": self.digest,
            "turns": self.turns,
            "context_tokens": self.context_tokens,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ChatState:
        """The state :meth:`to_dict` gave. Every key is required and no other is taken (a state from a newer or
        older form is refused, not half read); each value is checked as the constructor checks it."""
        if not isinstance(data, Mapping):
            raise SequenceUsageError(f"a chat state is a mapping (ChatState.to_dict()), given {type(data).__name__}")
        missing = [k for k in _STATE_KEYS if k not in data]
        unknown = sorted(str(k) for k in data if k not in _STATE_KEYS)
        if missing or unknown:
            raise SequenceUsageError(
                "chat state: "
                + "; ".join(
                    ([f"missing key(s) {', '.join(map(repr, missing))}"] if missing else [])
                    + ([f"unknown key(s) {', '.join(map(repr, unknown))}"] if unknown else [])
                )
            )
        raw = data["messages"]
        if not isinstance(raw, list | tuple):
            raise ChatMessageError(f"chat state 'messages': expected a list of messages, given {type(raw).__name__}")
        messages: list[ChatMessage] = []
        for i, item in enumerate(raw):
            if not isinstance(item, Mapping) or not _MESSAGE_KEYS <= set(item) <= _MESSAGE_KEYS | _MESSAGE_TOOL_KEYS:
                raise ChatMessageError(
                    f"chat state 'messages'[{i}]: expected a {{'role': ..., 'text': ...}} mapping (and tool_calls, "
                    "tool_call_id, name where set), given "
                    + (f"keys {sorted(map(str, item))}" if isinstance(item, Mapping) else type(item).__name__)
                )
            try:
                messages.append(_message_from_dict(item))
            except ChatMessageError as err:
                raise ChatMessageError(f"chat state 'messages'[{i}]: {err.message}") from None
        return cls(
            model=data["model"], sequence_id=data["sequence_id"], messages=tuple(messages), pinned=data["pinned"],
            digest=data["digest"], turns=data["turns"], context_tokens=data["context_tokens"],
        )  # fmt: skip


class ChatOpenArgs(ChatOptionArgs, total=False):
    """What opening a chat takes by keyword, each optional (``model.chat``, ``client.chat``, :func:`open_chat`,
    :func:`defer_chat`): the generation options of :class:`ChatOptionArgs` (the chat's defaults), and

    ``system``: the system message, sent with the first turn, before ``history`` (messages to replay, as
    :class:`ChatMessage` values or ``(role, text)`` pairs). ``sequence_id``: the conversation's id (default: a new
    one). ``timeout_s`` bounds each turn (the client's default when not given; a turn may give its own);
    ``end_timeout_s`` bounds the END sent at the close. ``replay_on_loss``: when the server has lost the
    conversation, a turn replays :attr:`ChatSession.messages` into a fresh one instead of raising
    :class:`SequenceLost`. ``resume``: a :class:`ChatState` (:attr:`ChatSession.state`, perhaps of another process)
    whose conversation the server still holds: the chat goes on on its sequence id without START, its first turn
    sends only the new user message (and the state's digest, which the server checks), and its messages and counts
    start from the state; not with ``system``, ``history`` or ``sequence_id``. See the module docstring.
    """

    system: str | None
    history: Iterable[ChatMessage | tuple[str, str]] | None
    sequence_id: int | str | None
    timeout_s: float | UseClientDefault | None
    end_timeout_s: float
    replay_on_loss: bool
    resume: ChatState | None


_OPEN_NAMES: Final = ChatOpenArgs.__optional_keys__


# --- the session ---------------------------------------------------------------------------------


def _scalar(result: InferResult, name: str) -> Any:
    value = result.outputs.get(name)
    return None if value is None or value.size == 0 else value.reshape(-1)[0]


def _count(result: InferResult, name: str) -> int:
    value = _scalar(result, name)
    return 0 if value is None else int(value)


def _reply_calls(result: InferResult, model: str, sequence_id: int | str) -> tuple[ToolCall, ...]:
    """The calls a turn's last response carries in TOOL_CALLS (none: ``""``, or a model without the output)."""
    raw = _scalar(result, proto.TOOL_CALLS)
    if not isinstance(raw, bytes) or not raw:
        return ()
    try:
        return calls_from_wire(raw)
    except (ValueError, UnicodeDecodeError) as err:
        # The server's own output: what it kept is unknown, as for a turn that ends without a finish reason.
        raise InternalServerError(
            f"chat {sequence_id!r}: the turn's {proto.TOOL_CALLS} output breaks the protocol: {err}",
            model=model,
            sequence_id=sequence_id,
        ) from None


def _check_chat_model(model: SessionTarget) -> None:
    spec = model.spec
    if not model.caller.transport.can_stream:
        raise SequenceUsageError(
            f"chat on model {spec.name!r}: a chat model is decoupled, which Triton serves only over the gRPC "
            f"stream; this client speaks {model.caller.transport.protocol}: use a gRPC client (grpc://)",
            model=spec.name,
        )
    missing = [n for n in proto.REQUIRED_INPUTS if spec.input(n) is None] + [
        n for n in proto.REQUIRED_OUTPUTS if spec.output(n) is None
    ]
    if not spec.decoupled or spec.sequence is None or missing:
        lacks = (["decoupled"] if not spec.decoupled else []) + (["sequence batching"] if spec.sequence is None else [])
        raise SequenceUsageError(
            f"model {spec.name!r} is not a chat model (it lacks: {', '.join(lacks + missing)})", model=spec.name
        )


def _check_options_fit(spec: ModelSpec, options: ChatOptions) -> None:
    """A set option needs its input on the model: a model from before STREAM_INTERVAL_MS would refuse the request."""
    for option, name in (
        ("presence_penalty", proto.PRESENCE_PENALTY), ("frequency_penalty", proto.FREQUENCY_PENALTY),
        ("repetition_penalty", proto.REPETITION_PENALTY), ("logprobs", proto.LOGPROBS),
    ):  # fmt: skip
        if getattr(options, option) is not None and spec.input(name) is None:
            raise ChatOptionError(
                option, f"none: model {spec.name!r} takes no {name} input", getattr(options, option), model=spec.name
            )
    if options.response_format is not None and spec.input(proto.CONSTRAINT) is None:
        raise ChatOptionError(
            "response_format",
            f"none: model {spec.name!r} takes no {proto.CONSTRAINT} input (it cannot constrain its replies)",
            options.response_format.kind,
            model=spec.name,
        )
    if options.stream_interval_ms is not None and spec.input(proto.STREAM_INTERVAL_MS) is None:
        raise ChatOptionError(
            "stream_interval_ms",
            f"none: model {spec.name!r} takes no {proto.STREAM_INTERVAL_MS} input (its config streams as it is set)",
            options.stream_interval_ms,
            model=spec.name,
        )
    # A model from before tools: its config would refuse the inputs (and ROLE tool, below) as unknown.
    if options.tools and spec.input(proto.TOOLS) is None:
        raise ChatOptionError(
            "tools", f"none: model {spec.name!r} takes no {proto.TOOLS} input (it cannot call tools)",
            [t.name for t in options.tools], model=spec.name,
        )  # fmt: skip
    if options.tool_choice is not None and spec.input(proto.TOOL_CHOICE) is None:
        raise ChatOptionError(
            "tool_choice", f"none: model {spec.name!r} takes no {proto.TOOL_CHOICE} input (it cannot call tools)",
            options.tool_choice, model=spec.name,
        )  # fmt: skip


def _check_messages_fit(spec: ModelSpec, messages: Iterable[ChatMessage]) -> None:
    """Tool use in the messages (calls, results) needs the model's TOOL_META: without it the server would render
    an assistant's calls as its bare text and could not take a tool message at all."""
    if spec.input(proto.TOOL_META) is not None:
        return
    for m in messages:
        if m.role == "tool" or m.has_tool_fields:
            raise ChatMessageError(
                f"model {spec.name!r} takes no {proto.TOOL_META} input: it cannot take a message with tool use "
                f"(a {m.role} message{' with tool fields' if m.has_tool_fields else ''})",
                model=spec.name,
            )


def _check_resume_fits(spec: ModelSpec) -> None:
    """A chat resumes only where each turn's history digest is checked: without it a stale state's turn would be
    added to whatever history the server holds (a silent mix of two conversations). (The model's name was checked
    against the state's with the other settings.)"""
    if spec.input(proto.DIGEST) is None:
        raise SequenceUsageError(
            f"resume: model {spec.name!r} takes no {proto.DIGEST} input, so it cannot check that it holds the state's "
            "history; replay it instead (history=state.messages)",
            model=spec.name,
        )


@attrs.frozen(kw_only=True)
class _Settings:
    """What a chat takes that is checked without its model: options, the messages to send first, replay, and how
    its sequence is opened (its id: the state's when resumed)."""

    options: ChatOptions
    prefix: tuple[ChatMessage, ...]
    replay_on_loss: bool
    resume: ChatState | None
    sequence_id: int | str | None
    timeout_s: float | UseClientDefault | None
    end_timeout_s: float

    def open(self, model: SessionTarget) -> SequenceSession:
        return open_sequence(
            model, sequence_id=self.sequence_id, timeout_s=self.timeout_s, end_timeout_s=self.end_timeout_s
        )

    def session(self, seq: SequenceSession) -> ChatSession:
        return ChatSession(
            _resumed_sequence(seq, self.resume), options=self.options, prefix=self.prefix,
            replay_on_loss=self.replay_on_loss, resume=self.resume,
        )  # fmt: skip


def _settings(name: str, given: ChatOpenArgs) -> _Settings:
    _refuse_unknown(given, _OPEN_NAMES)
    chosen: dict[str, Any] = {k: v for k, v in given.items() if k in _OPTION_NAMES}
    options = ChatOptions(**chosen)
    system, history = given.get("system"), given.get("history")
    sequence_id, resume = given.get("sequence_id"), given.get("resume")
    replay_on_loss = given.get("replay_on_loss", False)
    if system is not None and not isinstance(system, str):
        raise ChatMessageError(f"system is a str; given {type(system).__name__}")
    prefix = ((ChatMessage("system", system),) if system is not None else ()) + as_messages(history)
    if not isinstance(replay_on_loss, bool):
        raise ChatOptionError("replay_on_loss", "a bool", replay_on_loss, model=name)
    if resume is not None:
        if not isinstance(resume, ChatState):
            raise ChatOptionError("resume", "a ChatState (chat.state, ChatState.from_dict)", resume, model=name)
        # The state holds the conversation and its id: another system message, history or id would contradict it.
        named = (("system", system), ("history", history), ("sequence_id", sequence_id))
        clashing = [k for k, v in named if v is not None]
        if clashing:
            raise SequenceUsageError(
                f"chat on model {name!r}: resume= takes the conversation and its id from the state; "
                f"{', '.join(f'{k}=' for k in clashing)} cannot be given with it",
                model=name,
            )
        if resume.model != name:
            raise SequenceUsageError(
                f"resume: the state is of a chat on model {resume.model!r}, not {name!r}", model=name
            )
        sequence_id = resume.sequence_id
    return _Settings(
        options=options, prefix=prefix, replay_on_loss=replay_on_loss, resume=resume, sequence_id=sequence_id,
        timeout_s=given.get("timeout_s", USE_CLIENT_DEFAULT),
        end_timeout_s=given.get("end_timeout_s", DEFAULT_END_TIMEOUT_S),
    )  # fmt: skip


def _resumed_sequence(seq: SequenceSession, resume: ChatState | None) -> SequenceSession:
    """``seq`` (on the state's id) adopted when the server holds committed turns there: no START, DIGEST from the
    first turn. A state with nothing committed (digest "") starts its id afresh, sending its messages."""
    if resume is not None and resume.digest != EMPTY:
        seq._adopt()
    return seq


def _check_model_fits(model: SessionTarget, settings: _Settings) -> None:
    """The checks of a chat model's config against the settings: it takes the options given (and resuming)."""
    _check_options_fit(model.spec, settings.options)
    _check_messages_fit(model.spec, settings.prefix if settings.resume is None else settings.resume.messages)
    if settings.resume is not None:
        _check_resume_fits(model.spec)


def open_chat(model: SessionTarget, **options: Unpack[ChatOpenArgs]) -> ChatSession:
    """A new chat on ``model`` (what ``model.chat(...)`` returns). Checks everything; no I/O until the first turn.

    The options are those of :class:`ChatOpenArgs`: the system message and history to send first, the generation
    options (the chat's defaults), timeouts, ``replay_on_loss`` and ``resume``. If the server no longer holds a
    resumed state's conversation, or holds another history there, the turn raises :class:`SequenceLost` (with
    ``replay_on_loss``, it replays the state's messages into a fresh sequence); see the module docstring.
    Raises :class:`SequenceUsageError` for a model that is not a chat model or a client that cannot stream
    (HTTP: Triton serves decoupled models over the gRPC stream only).
    """
    _check_chat_model(model)  # before the options: a model that is no chat model is the first thing to say
    settings = _settings(model.spec.name, options)
    _check_model_fits(model, settings)
    return settings.session(settings.open(model))


def defer_chat(
    name: str, fetch: Callable[[], Awaitable[SessionTarget]], **options: Unpack[ChatOpenArgs]
) -> ChatSession:
    """What ``client.chat(name, ...)`` returns: the chat :func:`open_chat` makes on the model that ``fetch()``
    gives, made without I/O. The options and messages are checked here; ``fetch`` runs (once) when the chat is
    entered or sends its first turn, and the checks that need the model's config (a chat model?) run then."""
    settings = _settings(name, options)

    async def opened() -> SequenceSession:
        model = await fetch()
        _check_chat_model(model)
        _check_model_fits(model, settings)
        return settings.open(model)

    return settings.session(SequenceSession._deferred(name, opened))


class ChatSession:
    """One conversation on a chat model; an async context manager. See the module docstring.

    Made by ``model.chat(...)`` (see :func:`open_chat`) or ``client.chat(name, ...)`` (see :func:`defer_chat`):
    the same type either way, used the same way (``async with ... as chat:``, or ``await chat.aclose()`` when
    done). One made by name reaches its model when it is entered or sends its first turn; until then
    :attr:`sequence_id` is not known yet.
    """

    def __init__(
        self,
        seq: SequenceSession,
        *,
        options: ChatOptions,
        prefix: tuple[ChatMessage, ...] = (),
        replay_on_loss: bool = False,
        resume: ChatState | None = None,
    ) -> None:
        self._seq = seq
        self._options = options
        self._messages: list[ChatMessage] = list(prefix)
        # Messages the server does not hold yet: they ride on the next turn (again after a cancelled first turn,
        # since the server rolls back everything a cancelled turn carried).
        self._pending: tuple[ChatMessage, ...] = prefix
        # Leading system messages: the server never drops them when the context overflows.
        self._pinned = next((i for i, m in enumerate(prefix) if m.role != "system"), len(prefix))
        self._replay_on_loss = replay_on_loss
        # The history digest of the committed turns, as the server computes it (the protocol's); sent with every
        # turn but a START, when the model takes it.
        self._digest = EMPTY
        self._streaming = False
        self._closed = False
        self._detached = False
        self._turns = 0
        self._replays = 0
        self._context_tokens = 0
        self._last_reply: ChatReply | None = None
        # The state this chat was resumed from: what `state` says until the chat has reached its model.
        self._resumed = resume
        if resume is not None:
            self._messages = list(resume.messages)
            # Nothing committed on the state's sequence (digest ""): the server holds none of its messages, and the
            # first turn, a START, sends them all (as a replay would, on the same id).
            self._pending = () if resume.digest != EMPTY else resume.messages
            self._pinned = resume.pinned
            self._digest = resume.digest
            self._turns = resume.turns
            self._context_tokens = resume.context_tokens

    def __repr__(self) -> str:
        state = (
            "detached" if self._detached
            else "lost" if self.is_lost and not self._closed
            else "open" if self.is_open
            else "closed"
        )  # fmt: skip
        return f"<Chat {self._seq.model} id={self._seq._known_id!r} turns={self._turns} {state}>"

    # -- state ----------------------------------------------------------------------------------------

    @property
    def model(self) -> str:
        return self._seq.model

    @property
    def sequence_id(self) -> int | str:
        """The conversation's sequence id on the server (a new one after each replay)."""
        return self._seq.sequence_id

    @property
    def options(self) -> ChatOptions:
        """The chat's default options (a turn's own options override them)."""
        return self._options

    @property
    def messages(self) -> tuple[ChatMessage, ...]:
        """The conversation as the server holds it: the system and ``history=`` messages, then each completed
        turn's user and assistant messages, less the oldest ones the server dropped to make room
        (:attr:`ChatReply.dropped`; leading system messages are never dropped). Cancelled turns are not in it.

        Pass it as ``history=`` to replay the conversation into a fresh chat (e.g. after :class:`SequenceLost`):
        the server rebuilds exactly the same tokens.
        """
        return tuple(self._messages)

    @property
    def turns(self) -> int:
        """Completed turns."""
        return self._turns

    @property
    def replays(self) -> int:
        """Times the conversation was lost and replayed into a fresh one (``replay_on_loss``)."""
        return self._replays

    @property
    def context_tokens(self) -> int:
        """Tokens the server holds for this conversation after the last completed turn."""
        return self._context_tokens

    @property
    def state(self) -> ChatState:
        """What resuming this conversation needs (``client.chat(name, resume=chat.state)``, maybe in another process,
        after :meth:`detach`): the committed conversation, so while a turn streams it is the state before that turn.

        A chat opened by name has it once it has reached its model (:class:`SequenceUsageError` before), unless it
        was itself resumed: then it is that state until its first turn. After a replay (``replay_on_loss``) its id
        is the fresh sequence's.
        """
        if self._resumed is not None and self._seq._known_id is None:
            return self._resumed
        return ChatState(
            model=self._seq.model, sequence_id=self._seq.sequence_id, messages=tuple(self._messages),
            pinned=self._pinned, digest=self._digest, turns=self._turns, context_tokens=self._context_tokens,
        )  # fmt: skip

    @property
    def last_reply(self) -> ChatReply | None:
        """The last completed turn's reply (``None`` before the first)."""
        return self._last_reply

    @property
    def is_streaming(self) -> bool:
        """Whether a turn is streaming now."""
        return self._streaming

    @property
    def is_open(self) -> bool:
        """Whether a turn may be sent (not closed, and not lost unless ``replay_on_loss`` replays it)."""
        return not self._closed and (self._seq.is_open or (self._replay_on_loss and self._seq.is_lost))

    @property
    def is_lost(self) -> bool:
        """Whether the server lost the conversation (replay :attr:`messages` into a new chat to go on; with
        ``replay_on_loss`` the next turn does it)."""
        return self._seq.is_lost

    # -- turns ----------------------------------------------------------------------------------------

    def send(
        self,
        message: str | ChatMessage | Sequence[ChatMessage | tuple[str, str]],
        *,
        timeout_s: float | None = None,
        **options: Unpack[ChatOptionArgs],
    ) -> AsyncGenerator[str, None]:
        """Send ``message`` and yield the reply as ``str`` pieces as they arrive.

        ``message``: a str (a user message), a :class:`ChatMessage`, or a sequence of them (say, the results of a
        reply's several tool calls, :meth:`ChatMessage.tool_result`); the last one is a user message or a tool
        result. Options given (:class:`ChatOptionArgs`) override the chat's defaults for this turn; ``timeout_s``
        bounds this turn instead of the chat's timeout. After the loop completes, :attr:`last_reply` holds the
        turn's :class:`ChatReply` (its ``tool_calls`` the calls the reply made). Checked at once, before anything is
        sent: the options (:class:`ChatOptionError`), the messages (:class:`ChatMessageError`), and that no other
        turn streams (:class:`ChatBusyError`).
        """
        turn = self._options.override(**options)
        turn.check_turn()
        if timeout_s is not None and not (_is_number(timeout_s) and 0 < float(timeout_s) < math.inf):
            raise ChatOptionError("timeout_s", "a number of seconds > 0", timeout_s, model=self._seq.model)
        messages = as_turn(message)
        self._refuse_busy()
        return self._turn(messages, turn, None if timeout_s is None else float(timeout_s))

    async def ask(
        self,
        message: str | ChatMessage | Sequence[ChatMessage | tuple[str, str]],
        *,
        timeout_s: float | None = None,
        **options: Unpack[ChatOptionArgs],
    ) -> ChatReply:
        """Send ``message`` and return the whole reply (see :meth:`send`)."""
        pieces = self.send(message, timeout_s=timeout_s, **options)
        async with contextlib.aclosing(pieces):
            async for _ in pieces:
                pass
        assert self._last_reply is not None  # a turn that returned normally was committed
        return self._last_reply

    def _refuse_busy(self) -> None:
        seq = self._seq
        if self._closed:
            raise SequenceClosedError(
                f"chat {seq._known_id!r} on model {seq.model!r} is closed; open a new one",
                model=seq.model,
                sequence_id=seq._known_id,
            )
        if self._streaming:
            raise ChatBusyError(
                f"chat {seq._known_id!r} on model {seq.model!r}: a turn is still streaming; "
                "one turn at a time (a loop left early closes its turn only when its generator is collected: "
                "iterate inside contextlib.aclosing(chat.send(...)) to close it at once)",
                model=seq.model,
                sequence_id=seq._known_id,
            )

    async def _turn(
        self, new: tuple[ChatMessage, ...], options: ChatOptions, timeout_s: float | None
    ) -> AsyncGenerator[str, None]:
        self._refuse_busy()  # again: another turn may have started since send() was called
        self._streaming = True
        try:
            await self._seq._bind()  # a chat made by name reaches its model here, unless it was entered
        except BaseException:
            self._streaming = False
            raise
        span = None
        if TRACING:
            seq = self._seq
            span = start_span(
                "triton.chat.turn", model=seq.model, version=seq.spec.version, sequence_id=seq.sequence_id
            )
        started = time.perf_counter()
        yielded = False
        replayed = False
        try:
            while True:
                self._seq._trace_parent = span  # the step's span hangs under the turn's
                try:
                    # Closed here, at once, when this turn is closed: left to the collector, the attempt (and its
                    # step, still holding the session) would end in a task of its own some time later.
                    attempt = self._attempt(new, options, timeout_s, started, replayed=replayed)
                    async with contextlib.aclosing(attempt):
                        async for text in attempt:
                            if not yielded and span is not None:
                                span.set_first_response()
                            yielded = True
                            yield text
                    break
                except SequenceLost:
                    # Only a turn that showed nothing yet can start again elsewhere; once only.
                    if self._closed or yielded or replayed or not self._replay_on_loss:
                        raise
                finally:
                    self._seq._trace_parent = None
                await self._renew()
                replayed = True
        except BaseException as err:
            if span is not None:
                self._end_span(span, replayed, err)
            raise
        finally:
            self._streaming = False
        if span is not None:
            self._end_span(span, replayed, None)

    def _end_span(self, span: Span, replayed: bool, err: BaseException | None) -> None:
        span.set("triton.sequence_id", str(self._seq.sequence_id))  # a replay's is a new one
        span.set("triton.chat.replayed", replayed)
        reply = self._last_reply
        if err is None and reply is not None:
            span.set("triton.chat.tokens", reply.tokens)
        span.finish(err)

    async def _attempt(
        self,
        new: tuple[ChatMessage, ...],
        options: ChatOptions,
        timeout_s: float | None,
        started: float,
        *,
        replayed: bool,
    ) -> AsyncGenerator[str, None]:
        """One try at a turn on the current sequence: send, yield its text, commit it at its final response."""
        seq = self._seq
        _check_options_fit(seq.spec, options)  # a turn's own options, on the model the chat reached
        outgoing = (*self._pending, *new)
        _check_messages_fit(seq.spec, outgoing)
        inputs: dict[str, object] = {
            proto.ROLE: np.array([m.role for m in outgoing], dtype=object),
            proto.TEXT: np.array([m.text.encode() for m in outgoing], dtype=object),
            **options.inputs(),
        }
        if any(m.has_tool_fields for m in outgoing):
            # Only then: a conversation without tool use sends exactly what it did before tools (and a replayed
            # history's calls and results reach the server with their ids, so it renders the same tokens).
            inputs[proto.TOOL_META] = np.array([m.tool_meta().encode() for m in outgoing], dtype=object)
        if not seq._starts_next and seq.spec.input(proto.DIGEST) is not None:
            # Not with START (the server's conversation is new); a resumed chat's first turn carries the state's. It
            # tells the server what the client holds: a turn the server finished but the client never saw end
            # (cancelled or timed out at its last response) is rolled back there too, and a history other than the
            # client's is refused (SequenceLost), never continued.
            inputs[proto.DIGEST] = np.array([self._digest.encode()], dtype=object)
        decoder = PieceDecoder()
        parts: list[str] = []
        logprobs: list[TokenLogprob] | None = None if options.logprobs is None else []
        first_at: float | None = None
        committed = False
        # The server rolls a turn back when it is cancelled or times out: neither is a loss.
        stream = cast(AsyncGenerator[InferResult, None], seq.stream(inputs, timeout_s=timeout_s, rolled_back=True))
        async with contextlib.aclosing(stream) as responses:
            async for result in responses:
                # Mid-turn responses carry PIECE alone; the last one also FINISH, the counts and DIGEST.
                finish = _scalar(result, proto.FINISH)
                finish_reason = finish.decode("utf-8", "replace") if isinstance(finish, bytes) else ""
                piece = _scalar(result, proto.PIECE)
                text = decoder.feed(piece) if isinstance(piece, bytes) and piece else ""
                if logprobs is not None and isinstance(lp := _scalar(result, proto.LOGPROBS), bytes) and lp:
                    logprobs.extend(_logprob_entries(lp))
                if finish_reason:
                    text += decoder.flush()
                if text:
                    parts.append(text)
                    if first_at is None:
                        first_at = time.perf_counter()
                if finish_reason:
                    reply_text = "".join(parts)
                    calls = _reply_calls(result, seq.model, seq.sequence_id)
                    digest = history_digest(
                        self._digest, [m.digest_key for m in outgoing], reply_text,
                        tuple((c.id, c.name, c.arguments) for c in calls),
                    )  # fmt: skip
                    theirs = _scalar(result, proto.DIGEST)
                    if isinstance(theirs, bytes) and theirs.decode("utf-8", "replace") != digest:
                        raise ChatHistoryMismatch(
                            f"chat {seq.sequence_id!r} on model {seq.model!r}: the server's history digest after "
                            f"this turn is {theirs.decode('utf-8', 'replace')!r}, the client's {digest!r}: the two "
                            "sides disagree on the conversation; the turn is not kept (the next turn rolls it back "
                            "on the server too)",
                            expected=digest,
                            given=theirs.decode("utf-8", "replace"),
                            model=seq.model,
                            sequence_id=seq.sequence_id,
                        )
                    # Recorded before the last text is handed out: the server holds the turn from here on,
                    # even if the caller leaves the loop at this piece.
                    now = time.perf_counter()
                    committed = True
                    self._commit(
                        new,
                        digest,
                        ChatReply(
                            text=reply_text,
                            # OpenAI's reading: a reply that called is answered by the calls' results, whatever
                            # ended it (the server says stop, or length after a complete call).
                            finish_reason="tool_calls" if calls else finish_reason,
                            tokens=_count(result, proto.TOKENS),
                            prompt_tokens=_count(result, proto.PROMPT_TOKENS),
                            context_tokens=_count(result, proto.CONTEXT_TOKENS),
                            dropped=_count(result, proto.DROPPED),
                            input_tokens=_count(result, proto.INPUT_TOKENS),
                            time_to_first_token_s=None if first_at is None else first_at - started,
                            elapsed_s=now - started,
                            replayed=replayed,
                            logprobs=None if logprobs is None else tuple(logprobs),
                            tool_calls=calls,
                        ),
                    )
                if text:
                    yield text
        if committed:
            return
        # The server's last response of a turn always names why it finished; a stream that ends without
        # one broke the contract, and what the server kept is unknown.
        raise InternalServerError(
            f"chat {seq.sequence_id!r}: the turn's responses ended without a finish reason",
            model=seq.model,
            sequence_id=seq.sequence_id,
        )

    async def _renew(self) -> None:
        """The server lost the conversation: go on in a fresh one that the next attempt fills with the history."""
        lost = self._seq
        self._seq = lost.renewed()
        self._pending = tuple(self._messages)
        self._digest = EMPTY
        self._replays += 1
        # Whatever the server may still hold for the lost id (Triton's sequence slot) is freed; bounded, best effort.
        await lost.aclose()

    def _commit(self, new: tuple[ChatMessage, ...], digest: str, reply: ChatReply) -> None:
        # Mirror the server's history exactly, so that replaying these messages rebuilds the same tokens: the
        # server drops its oldest messages (after the leading system ones) to make room for a turn. (The pending
        # messages sent with the turn are in the list already.) The reply is kept as the server keeps it: the
        # content received and the calls.
        del self._messages[self._pinned : self._pinned + reply.dropped]
        self._messages.extend((*new, ChatMessage("assistant", reply.text, tool_calls=reply.tool_calls)))
        self._pending = ()
        self._digest = digest
        self._turns += 1
        self._context_tokens = reply.context_tokens
        self._last_reply = reply

    # -- closing --------------------------------------------------------------------------------------

    async def detach(self) -> ChatState:
        """Close the chat here *without* ending the conversation on the server, and return its :attr:`state`.

        The server keeps the conversation (its KV cache) until the model's idle timeout, for a chat resumed from
        the state (``client.chat(name, resume=state)``, in this process or another) to go on with. A turn still
        streaming is cancelled (the server rolls it back; its reader gets :class:`SequenceClosedError`) and the
        state is the one before it. Afterwards turns raise :class:`SequenceClosedError` and :meth:`aclose` (leaving
        the ``async with`` block) sends nothing; detaching again returns the same state. Raises
        :class:`SequenceClosedError` for a chat closed already (its conversation is gone) and
        :class:`SequenceUsageError` for one opened by name that has not reached its model (nothing to keep).
        """
        if self._closed and not self._detached:
            seq = self._seq
            raise SequenceClosedError(
                f"chat {seq._known_id!r} on model {seq.model!r} is closed: its conversation was ended on the server "
                "(chat.state still gives its messages, to replay)",
                model=seq.model,
                sequence_id=seq._known_id,
            )
        state = self.state
        self._closed = True
        self._detached = True
        await self._seq._detach()
        return state

    async def aclose(self) -> None:
        """End the conversation on the server (END, no inputs; bounded, best effort). Idempotent.

        A turn still streaming (being read, or left without closing its loop) is cancelled and END leaves at
        once: the server rolls the turn back and frees the conversation. A resumed chat ends the conversation it
        resumed, even without a turn of its own; a detached one sends nothing.
        """
        self._closed = True
        if self._detached:
            return
        await self._seq.aclose()

    async def __aenter__(self) -> Self:
        await self._seq._bind()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
