"""The chat engine's scheduler: conversations whose KV caches stay on the device, decoded together, streamed.

It owns conversations and turns and decides everything about them; the block manager (``_blocks``) owns blocks and
the model runner (``_runner``) computes, each handed a plain value. It plugs into :class:`~.._generate.StepLoop` as
its three callbacks:

- ``admit`` (a turn arrives): fit it into the context, reserve and prefill only the tokens the conversation's
  cache does not hold yet (nor a registered prefix another conversation already computed); the runner samples the
  turn's first token and writes its decode row;
- ``step`` (one pass): every due turn takes its sampled token (the reply grows, stops are checked), then *one*
  decode pass samples the next token of all that go on; a turn that arrived meanwhile joins at the next pass;
- ``on_exit``: the turn ends, and its conversation is freed on END.

Every way a turn ends goes through :meth:`ChatEngine.finish` and gives it one :data:`TurnStatus`: stop, stop_string,
length and context keep the turn in the history; closed, cancelled, superseded, failed, refused and shutdown leave
the history as it was before it. A generating turn is never evicted (eviction takes idle conversations only): the
next turn of an evicted conversation is refused.

The decoder is any of the chat folder's (GPT-2, the Llama family: ``_decoders.load_decoder``) and the KV cache
is paged (``_paged``): each conversation holds blocks in proportion to its length, and equal prefixes (a system
prompt, a replayed history) are computed once and shared.

**What a conversation is.** Its history is a list of messages (``Conversation.messages``: role and text) that
the checkpoint's own chat template (``_template.CheckpointTokenizer.render``) turns into token ids. Its block
table holds the keys and values of a prefix of some token list (``BlockTable.ids``). At every turn the engine
renders the whole conversation plus the new messages and prefills from the first position where the table and
the rendering differ, so every rule below costs a rewind plus a prefill of what changed, and usually nothing
but the new turn. That also makes any template exact: one that renders earlier turns differently once a new
turn follows (drops old reasoning, moves a system prompt) is met by a rewind to the first differing token.

- After a reply the history holds the *text the client received* as the assistant's message: a conversation
  replayed from its text as the first turn of a fresh one gives exactly the same tokens. When the generated
  ids are what the template renders for that text (the usual case) the table already holds them and only the
  template's end of turn is prefilled next turn.
- A cancelled or failed turn is rolled back: the history is what it was before the turn (neither the
  user message nor the partial reply stay); the cache is rewound lazily at the next turn.
- Context overflow: when the history, the new messages and ``max_tokens`` do not fit in ``max_ctx``,
  the oldest messages are dropped (leading system messages are kept; what remains starts at a user
  message, as strict templates require) and the rest is prefilled again; a turn too long even alone is
  refused with a clear error. If a reply still reaches the end of the context it finishes with ``"context"``.
- Memory: a conversation that needs a block when the pool has none makes the longest-idle conversation (not
  generating, idle at least ``evict_min_idle_s``) give way; if none may, a new turn is refused as over
  capacity and a generating reply finishes with ``"context"``.
- History digest: each conversation keeps ``digest`` (a chain over its committed turns, see ``_protocol``)
  and can undo its last committed turn once. A turn that carries the client's digest proceeds when it
  matches, rolls the last turn back first when it matches the digest before it (the client never saw
  that turn end), and is refused as an unknown sequence otherwise.

Isolation: :meth:`ChatEngine.parse` (execute threads) checks every input against :class:`InputLimits` on
its raw byte length before decoding it, and renders the conversation (the template and the tokenizer) against
a snapshot of its committed history, so the loop's thread, which decodes for every conversation, renders only
when that history changed in between (rare: a turn that ended meanwhile, a digest roll back). ``step`` and
``admit`` may be called again on part of a batch after they raised (the StepLoop then looks for the stream that
fails): ``step`` changes nothing it cannot undo before its last operation that may raise, and ``admit`` is
idempotent.

The engine knows nothing of Triton: responses and refusals are built by callbacks the model gives
(``respond``, ``refuse``), so it is tested as plain Python. torch and tokenizers are imported lazily.
"""

from __future__ import annotations

import bisect
import codecs
import hashlib
import itertools
import json
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal

from ..._protocol import EMPTY, SEQUENCE_CAPACITY, SEQUENCE_UNKNOWN, digest_role, history_digest
from ..._protocol import chat as proto
from .._controls import CorrelationId, SequenceControls
from .._generate import ExitReason, StepOutput, Stream
from .._state import SequenceSlots
from ._blocks import BlockManager, BlockTable, CacheFull
from ._constraints import Constraints, ConstraintSpec, TurnMatcher, fill_masks, parse_constraint
from ._runner import Compile, DecodeBatch, ModelRunner, PrefillRow, RowSampling
from ._sampling import GREEDY_BELOW, SamplingFlags
from ._template import ChatMessage as TemplateMessage
from ._tools import (
    NO_TOOLS,
    MessageTools,
    ToolCall,
    ToolCallStream,
    ToolChoice,
    forced_grammar,
    forced_tool_call,
    parse_tool_choice,
    parse_tool_meta,
    parse_tools_input,
)

if TYPE_CHECKING:
    from ._decoders import Decoder
    from ._template import CheckpointTokenizer


__all__ = [
    "ChatEngine",
    "ChatMessage",
    "ChatResponse",
    "ChatTurn",
    "Conversation",
    "Decoder",
    "Finish",
    "GREEDY_BELOW",
    "InputLimits",
    "TurnOptions",
    "TurnStatus",
]

ROLES: Final = ("system", "user", "assistant", "tool")
Finish = Literal["", "stop", "stop_string", "length", "context", "closed"]
#: A turn's one status: waiting (parsed, not admitted), running (admitted), then exactly one way it ended. The first
#: four ends keep the turn in the history (the reply as the client received it); every other end rolls it back.
TurnStatus = Literal[
    "waiting", "running",
    "stop", "stop_string", "length", "context",
    "closed", "cancelled", "superseded", "failed", "refused", "shutdown",
]  # fmt: skip
KEPT: Final[frozenset[str]] = frozenset({"stop", "stop_string", "length", "context"})
#: The step loop's exit reasons as turn ends ("done" is the end the step itself decided).
_EXITS: Final[dict[str, TurnStatus]] = {
    "cancelled": "cancelled", "superseded": "superseded", "failed": "failed", "shutdown": "shutdown",
}  # fmt: skip
RefusalKind = Literal["invalid", "capacity", "unknown"]
#: The most alternatives a token's log-probability may come with (OpenAI's top_logprobs cap).
MAX_TOP_LOGPROBS: Final = 20


@dataclass(frozen=True, kw_only=True, slots=True)
class InputLimits:
    """Caps on what one request may carry, checked on raw byte lengths before anything is decoded.

    Every cap bounds work that grows with one request's input and would otherwise be done for it alone:
    decoding, tokenising (on an execute thread: it delays the next requests' arrival) and searching the reply
    for stop strings on every token. The defaults are the config parameters' defaults.
    """

    max_messages: int = 512  # ROLE/TEXT entries in one request (a replayed history is one request)
    max_message_bytes: int = 65536  # UTF-8 bytes of one TEXT entry
    max_request_bytes: int = 262144  # UTF-8 bytes of all TEXT entries of one request
    max_stops: int = 16  # STOP entries
    max_stop_bytes: int = 256  # bytes of one STOP entry
    max_constraint_bytes: int = 65536  # bytes of the CONSTRAINT input (a JSON schema, a regex, a grammar)
    max_tools_bytes: int = 65536  # bytes of the TOOLS input (the tools' definitions and schemas)

    def __post_init__(self) -> None:
        names = (
            "max_messages", "max_message_bytes", "max_request_bytes", "max_stops", "max_stop_bytes",
            "max_constraint_bytes", "max_tools_bytes",
        )  # fmt: skip
        for name in names:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message of a turn: its role, its text and its tool-use fields (TOOL_META)."""

    role: str
    text: str
    tools: MessageTools = NO_TOOLS

    def entry(self) -> Message:
        """The message as the history keeps it and the template renders it: a (role, text) pair when it has no tool
        fields; else a template message (an assistant's calls with empty text have no content, as OpenAI's null)."""
        t = self.tools
        if t.empty:
            return (self.role, self.text)
        content = None if t.tool_calls and not self.text else self.text
        return TemplateMessage(self.role, content, t.tool_calls, t.tool_call_id, t.name)

    @property
    def digest_key(self) -> tuple[str, str]:
        t = self.tools
        calls = tuple((c.id or "", c.name, c.arguments) for c in t.tool_calls)
        return (digest_role(self.role, tool_calls=calls, tool_call_id=t.tool_call_id, name=t.name), self.text)


@dataclass(frozen=True, kw_only=True, slots=True)
class TurnOptions:
    """How one turn generates. ``temperature`` below :data:`GREEDY_BELOW` is greedy (0, the default); ``top_k`` 0
    is off. ``stream_interval_s``: how often the turn's mid-reply pieces may go out (None: the engine's default).
    ``max_tokens`` 0: no cap, the reply may run to the end of the context (the history is fitted as for the
    engine's default cap). ``constraint``: what the reply must be (a JSON schema, a regex, a grammar)."""

    max_tokens: int
    min_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[bytes, ...] = ()
    stream_interval_s: float | None = None
    constraint: ConstraintSpec | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # each token's log-probability and this many alternatives (None: off)
    #: The tools the template renders (None: none), and whether the reply is read for calls (tools given and
    #: tool_choice not "none"). A forced call (tool_choice required or named) is in ``constraint``.
    tools: tuple[dict[str, Any], ...] | None = None
    tool_choice: ToolChoice = "auto"
    reads_calls: bool = False

    def __post_init__(self) -> None:
        problems = []
        if self.max_tokens < 0:
            problems.append(f"MAX_TOKENS must be >= 1, or 0 for no cap, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens > 0 and self.min_tokens > self.max_tokens):
            problems.append(f"MIN_TOKENS must be in 0..MAX_TOKENS ({self.max_tokens}), got {self.min_tokens}")
        if not 0 <= self.temperature < math.inf:  # also refuses NaN
            problems.append(f"TEMPERATURE must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # also refuses NaN
            problems.append(f"TOP_P must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            problems.append(f"TOP_K must be >= 0, got {self.top_k}")
        for name, value in (("PRESENCE_PENALTY", self.presence_penalty), ("FREQUENCY_PENALTY", self.frequency_penalty)):
            if not -2 <= value <= 2:  # also refuses NaN
                problems.append(f"{name} must be in -2..2, got {value}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            problems.append(f"LOGPROBS must be in 0..{MAX_TOP_LOGPROBS} (alternatives per token), got {self.logprobs}")
        if not 0 < self.repetition_penalty <= 10:
            problems.append(f"REPETITION_PENALTY must be in (0, 10] (1: off), got {self.repetition_penalty}")
        if any(not s for s in self.stop):
            problems.append("STOP strings must not be empty")
        longest = proto.STREAM_INTERVAL_MAX_MS / 1000
        if self.stream_interval_s is not None and not 0 <= self.stream_interval_s <= longest:  # also refuses NaN
            problems.append(f"stream_interval_s must be in 0..{longest:g} seconds, got {self.stream_interval_s}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True, kw_only=True, slots=True)
class ChatResponse:
    """One streamed response of a turn: the new bytes of the reply and where the conversation stands.

    ``piece`` may cut a multi-byte UTF-8 character (the client decodes incrementally). ``finish`` is
    empty while the turn streams and says why it ended on its last response. ``live``, ``kv_bytes`` and
    ``digest`` (the conversation's history digest after the turn) are filled on that last response only.
    """

    piece: bytes
    finish: Finish
    tokens: int
    prompt_tokens: int
    context_tokens: int
    dropped: int
    live: int
    kv_bytes: int
    digest: str = EMPTY
    #: The whole prompt this turn's reply is conditioned on (the conversation's rendered tokens), however much of it
    #: the cache held already: what an API bills as input. Filled on the last response.
    input_tokens: int = 0
    #: With LOGPROBS: the log-probabilities of the tokens this response completes, as JSON (``ChatEngine``).
    logprobs: str = ""
    #: On the last response of a turn whose reply made tool calls: ``[{"id", "name", "arguments"}]`` as JSON.
    tool_calls: str = ""


#: A message as the history keeps it: (role, text), or a template message with tool-use fields.
Message = tuple[str, str] | TemplateMessage
Messages = tuple[Message, ...]  # oldest first


def _role(message: Message) -> str:
    return message.role if isinstance(message, TemplateMessage) else message[0]


@dataclass(frozen=True, slots=True)
class _Committed:
    """A conversation's history as it was before its last committed turn: what undoing that turn restores."""

    messages: Messages
    pinned: int
    digest: str


@dataclass(frozen=True, slots=True)
class _Rendered:
    """A turn's prompt: the conversation's kept messages plus the turn's, and their ids in the chat template."""

    version: int  # the history version it was rendered from (-1: a START, no history)
    messages: Messages  # what the history becomes before the reply (oldest dropped to fit)
    pinned: int  # leading system messages, never dropped
    dropped: int
    ids: list[int]  # the template's ids, ending with its generation prompt


@dataclass(eq=False)
class Conversation:
    """One conversation: its messages, digest and block table (the cache's record of what it holds)."""

    table: BlockTable
    messages: Messages = ()
    pinned: int = 0  # the leading `pinned` messages (system) are never dropped
    digest: str = EMPTY
    # A new value whenever `messages` changes, unique across the engine's conversations (a START that restarts a
    # sequence must not match a prompt rendered against the conversation it replaced).
    version: int = 0
    undo: _Committed | None = None  # the history before the last committed turn; None once used or when none
    device_blocks: int = 0  # how many of the table's blocks the runner's decode row holds

    def roll_back(self, version: int) -> None:
        """Undo the last committed turn (the cache is rewound lazily, at the next prefill)."""
        assert self.undo is not None
        self.messages, self.pinned, self.digest = self.undo.messages, self.undo.pinned, self.undo.digest
        self.undo = None
        self.version = version


@dataclass(eq=False)
class ChatTurn:
    """One request: a turn (messages to add, then a reply) or a close; the StepLoop's job, mutated by the engine."""

    start: bool
    end: bool
    messages: tuple[ChatMessage, ...]
    options: TurnOptions | None  # None: END with no messages, a close
    # The prompt, rendered by parse on an execute thread against the history it saw (None: admit renders it).
    rendered: _Rendered | None = None
    digest: str | None = None  # the client's digest of the history it believes the server holds; None: unchecked
    # Set by admit.
    key: CorrelationId | None = None
    slot: int = -1
    prompt: _Rendered | None = None  # the prompt this turn runs with
    prompt_tokens: int = 0
    sampling: RowSampling | None = None
    # The turn's own constraint matcher (made by parse, advanced by every token the reply takes; None: none).
    matcher: TurnMatcher | None = None
    # The token sampled last (by the prefill, then by each decode pass), not yet part of the reply: the next step
    # takes it. None: not prefilled yet.
    next_token: int | None = None
    needs_pass: bool = False  # its reply took next_token: a decode pass must feed it before the next is taken
    # Set by step.
    reply_ids: list[int] = field(default_factory=list)
    # With LOGPROBS: the log-probabilities of the token sampled last (next_token's), then of each reply token, with
    # where each token's bytes end in `reply`, and how many entries went out.
    next_logprob: tuple[float, list[tuple[int, float]]] | None = None
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    token_ends: list[int] = field(default_factory=list)
    logprobs_sent: int = 0
    reply: bytearray = field(default_factory=bytearray)
    sent: int = 0  # bytes of `reply` already streamed (with tools: fed to `calls`, which says what is shown)
    # A turn whose reply is read for tool calls: the reader, fed the reply's text (decoded as it comes), and what it
    # found once the reply ended (the content the client got, the calls).
    calls: ToolCallStream | None = None
    text_decoder: Any = None
    content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    # Once the reply is inside a call (a marker seen, or a forced call), stop strings no longer cut it: a stop that
    # matched inside a call's JSON would leave broken markup (no call, and its text shown). `calls_scanned`: the
    # bytes of `reply` already looked at for a marker.
    in_calls: bool = False
    calls_scanned: int = 0
    sent_at: float | None = None  # when the last piece went out (None: none yet)
    status: TurnStatus = "waiting"
    ending: TurnStatus | None = None  # the end a step decided, until the step's outputs are emitted

    @property
    def finish(self) -> Finish:
        """What the last response's FINISH says: how a kept turn ended ("" while it runs or when it was not kept)."""
        return self.status if self.status in KEPT else ""  # type: ignore[return-value]

    @property
    def ended(self) -> bool:
        return self.status not in ("waiting", "running")


class ChatEngine:
    """Conversations on one decoder and one paged KV cache; the callbacks of a StepLoop. See the module docstring.

    ``respond(response)`` turns a :class:`ChatResponse` into what the sender sends; ``refuse(kind,
    message)`` builds an error response (``kind``: "invalid", "capacity" or "unknown"). ``slots`` is the
    live-conversation map (its capacity caps the conversations; the cache's blocks cap their memory).
    ``max_ctx`` caps one conversation's positions (default: the model's). Every method but the constructor and
    :meth:`parse` runs on the loop's thread.
    """

    def __init__(
        self,
        model: Decoder,
        tokenizer: CheckpointTokenizer,
        cache: BlockManager,
        slots: SequenceSlots,
        *,
        respond: Callable[[ChatResponse], Any],
        refuse: Callable[[RefusalKind, str], Any],
        max_ctx: int | None = None,
        default_max_tokens: int = 64,
        stream_interval_s: float = 0.0,
        limits: InputLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_thread: Callable[[], None] | None = None,
        compile: Compile = "off",
        constraint_cache: int = 64,
    ) -> None:
        if slots.on_release is not None:
            raise ValueError("slots already has an on_release hook: one SequenceSlots serves one engine")
        if tokenizer.vocab_size > model.vocab_size:
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the model only {model.vocab_size}")
        max_ctx = model.max_positions if max_ctx is None else max_ctx
        if not 0 < max_ctx <= model.max_positions:
            raise ValueError(f"max_ctx must be in 1..{model.max_positions} (the model's positions), not {max_ctx}")
        self.model = model
        self.tokenizer = tokenizer
        self.cache = cache
        self.slots = slots
        self.max_ctx = max_ctx
        self.default_max_tokens = default_max_tokens
        self.stream_interval_s = stream_interval_s
        self.limits = InputLimits() if limits is None else limits
        self._clock = clock
        self._respond = respond
        self._refuse = refuse
        self._on_thread = on_thread
        self._thread_ready: int | None = None
        self._conversations: dict[int, Conversation] = {}
        # Each live conversation's committed history, as parse (on execute threads) reads it to render a turn
        # ahead of admission: (version, messages, pinned). Written on the loop's thread only; a dict item read or
        # write is atomic, and admit re-renders a turn whose version is stale.
        self._histories: dict[CorrelationId, tuple[int, Messages, int]] = {}
        self._versions = itertools.count(1)
        # The slots are the one truth of which conversation is live: whatever frees one (END, the idle sweep, an
        # eviction, a restart by START) comes through here, and the conversation and its blocks go.
        slots.on_release = self._on_release
        self._per_position = cache.block_bytes // cache.block_size
        # The one owner of device work: prefill and decode passes, on the decode rows of every slot.
        self.runner = ModelRunner(
            model, cache, slots=slots.capacity, max_ctx=max_ctx, vocab=tokenizer.vocab_size,
            stop_ids=tokenizer.stop_ids, compile=compile,
        )  # fmt: skip
        # Each distinct constraint compiled once (an LRU); turns take copies of the compiled matchers.
        self.constraints = Constraints(tokenizer, capacity=constraint_cache)
        self._markers = tokenizer.tool_marker_ids
        # Counters, for tests and logs.
        self.prefilled_tokens = 0
        self.prefill_forwards = 0
        self.decode_passes = 0
        self.rows_decoded = 0

    # -- what the outputs report ----------------------------------------------------------------------

    @property
    def live(self) -> int:
        return self.slots.live

    @property
    def kv_bytes(self) -> int:
        """KV-cache bytes of the positions live conversations hold, a shared block counted once.

        Memory is taken by whole blocks, so a conversation's memory is up to ``block_size - 1`` positions more.
        """
        held = sum(self._conversations[s].table.length for s in self.slots.held().values() if s in self._conversations)
        return (held - self.cache.shared_positions) * self._per_position

    # -- parsing (execute threads) ---------------------------------------------------------------------

    def parse(
        self,
        *,
        start: bool,
        end: bool,
        roles: Sequence[bytes | str] | None,
        texts: Sequence[bytes | str] | None,
        max_tokens: int | None = None,
        min_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: Sequence[bytes | str] = (),
        digest: bytes | str | None = None,
        stream_interval_ms: int | None = None,
        constraint: bytes | str | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        repetition_penalty: float | None = None,
        logprobs: int | None = None,
        tools: bytes | str | None = None,
        tool_choice: bytes | str | None = None,
        tool_meta: Sequence[bytes | str] | None = None,
        key: CorrelationId | None = None,
    ) -> ChatTurn:
        """Build one request's job from its inputs, its prompt rendered; ``ValueError`` naming the input.

        ``key``: the conversation's sequence id, whose committed history the prompt is rendered against (None, or
        a START: the turn's messages alone).

        Sizes are checked against :attr:`limits` on raw byte lengths before anything is decoded.
        ``stream_interval_ms`` (STREAM_INTERVAL_MS) overrides the engine's stream interval for this turn.
        ``constraint`` (CONSTRAINT): what the reply must be (``_constraints``); compiled here, so a constraint that
        does not compile is this request's invalid input, before any token.
        ``tools`` (TOOLS), ``tool_choice`` (TOOL_CHOICE), ``tool_meta`` (TOOL_META, one entry per message): tool
        calling (``_tools``); a forced call (``required`` or a named function) becomes the turn's constraint.
        """
        try:
            return self._parse(
                start=start, end=end, roles=roles, texts=texts, max_tokens=max_tokens, min_tokens=min_tokens,
                temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop, digest=digest,
                stream_interval_ms=stream_interval_ms, constraint=constraint, presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty, logprobs=logprobs,
                tools=tools, tool_choice=tool_choice, tool_meta=tool_meta, key=key,
            )  # fmt: skip
        except RecursionError:
            # Some input nested past what Python walks (each input caps its own nesting; this is the net under
            # them): this request's invalid input, never an error that escapes execute and fails its batch.
            raise ValueError("an input (TOOLS, TOOL_META or CONSTRAINT) is nested too deeply to read") from None

    def _parse(
        self,
        *,
        start: bool,
        end: bool,
        roles: Sequence[bytes | str] | None,
        texts: Sequence[bytes | str] | None,
        max_tokens: int | None,
        min_tokens: int | None,
        temperature: float | None,
        top_p: float | None,
        top_k: int | None,
        seed: int | None,
        stop: Sequence[bytes | str],
        digest: bytes | str | None,
        stream_interval_ms: int | None,
        constraint: bytes | str | None,
        presence_penalty: float | None,
        frequency_penalty: float | None,
        repetition_penalty: float | None,
        logprobs: int | None,
        tools: bytes | str | None,
        tool_choice: bytes | str | None,
        tool_meta: Sequence[bytes | str] | None,
        key: CorrelationId | None,
    ) -> ChatTurn:
        if stream_interval_ms is not None and not 0 <= int(stream_interval_ms) <= proto.STREAM_INTERVAL_MAX_MS:
            longest = proto.STREAM_INTERVAL_MAX_MS
            raise ValueError(f"STREAM_INTERVAL_MS must be in 0..{longest} milliseconds, got {int(stream_interval_ms)}")
        limits = self.limits
        roles = list(roles or ())
        texts = list(texts or ())
        stop = list(stop)
        if len(texts) > limits.max_messages:
            raise ValueError(f"TEXT has {len(texts)} messages; at most {limits.max_messages} (parameter max_messages)")
        if len(roles) != len(texts):
            raise ValueError(f"ROLE has {len(roles)} entries but TEXT has {len(texts)}: one role per message")
        metas = list(tool_meta or ())
        if tool_meta is not None and len(metas) != len(roles):
            raise ValueError(f"TOOL_META has {len(metas)} entries but ROLE has {len(roles)}: one per message")
        if len(stop) > limits.max_stops:
            raise ValueError(f"STOP has {len(stop)} strings; at most {limits.max_stops} (parameter max_stops)")
        total = 0
        for i, text in enumerate(texts):
            size = _size(text)
            if size > limits.max_message_bytes:
                raise ValueError(
                    f"TEXT[{i}] has {size} bytes; at most {limits.max_message_bytes} (parameter max_message_bytes)"
                )
            total += size
        total += sum(_size(m) for m in metas)  # a message's tool fields are part of what the request carries
        if total > limits.max_request_bytes:
            raise ValueError(
                f"TEXT has {total} bytes in all; at most {limits.max_request_bytes} (parameter max_request_bytes)"
            )
        for i, s in enumerate(stop):
            if (size := _size(s)) > limits.max_stop_bytes:
                raise ValueError(
                    f"STOP[{i}] has {size} bytes; at most {limits.max_stop_bytes} (parameter max_stop_bytes)"
                )
        for i, role in enumerate(roles):
            if _size(role) > 16:  # longer than any role: not worth decoding
                raise ValueError(f"ROLE[{i}] must be one of {', '.join(ROLES)}, got {_size(role)} bytes")
        if constraint is not None and (size := _size(constraint)) > limits.max_constraint_bytes:
            raise ValueError(
                f"CONSTRAINT has {size} bytes; at most {limits.max_constraint_bytes} (parameter max_constraint_bytes)"
            )
        if tools is not None and (size := _size(tools)) > limits.max_tools_bytes:
            raise ValueError(f"TOOLS has {size} bytes; at most {limits.max_tools_bytes} (parameter max_tools_bytes)")
        if tool_choice is not None and (size := _size(tool_choice)) > 1024:
            raise ValueError(f"TOOL_CHOICE has {size} bytes; at most 1024 (a choice names one function)")
        client_digest = None
        if digest is not None:
            if _size(digest) > 64:
                raise ValueError(f"DIGEST must be a history digest (at most 64 characters), got {_size(digest)} bytes")
            client_digest = _text(digest, proto.DIGEST)
        if not roles:
            if not end:
                raise ValueError("a turn needs ROLE and TEXT (at least one user message); only END may come without")
            return ChatTurn(start=start, end=end, messages=(), options=None, digest=client_digest)
        messages = []
        for i, (role, text) in enumerate(zip(roles, texts, strict=True)):
            role_s = _text(role, f"ROLE[{i}]")
            if role_s not in ROLES:
                raise ValueError(f"ROLE[{i}] must be one of {', '.join(ROLES)}, got {role_s!r}")
            meta = parse_tool_meta(metas[i], role_s, f"TOOL_META[{i}]") if metas else NO_TOOLS
            messages.append(ChatMessage(role_s, _text(text, f"TEXT[{i}]"), meta))
        if messages[-1].role not in ("user", "tool"):
            raise ValueError(f"the last message of a turn must have ROLE user or tool, got {messages[-1].role!r}")
        tool_list = None if tools is None else parse_tools_input(tools)
        choice = "auto" if tool_choice is None else parse_tool_choice(tool_choice, tool_list)
        if tool_list is not None and (refusal := self.tokenizer.tools_refusal) is not None:
            raise ValueError(f"TOOLS: {refusal}")
        if tool_list is None and choice not in ("auto", "none"):
            raise ValueError("TOOL_CHOICE: a choice that forces a call needs TOOLS, and none were given")
        given = None if constraint is None else parse_constraint(constraint)
        spec = self._tool_constraint(tool_list, choice, given)
        options = TurnOptions(
            max_tokens=self.default_max_tokens if max_tokens is None else int(max_tokens),
            min_tokens=0 if min_tokens is None else int(min_tokens),
            temperature=0.0 if temperature is None else float(temperature),
            top_p=1.0 if top_p is None else float(top_p),
            top_k=0 if top_k is None else int(top_k),
            seed=None if seed is None else int(seed),
            stop=tuple(s.encode("utf-8") if isinstance(s, str) else bytes(s) for s in stop),
            stream_interval_s=None if stream_interval_ms is None else int(stream_interval_ms) / 1000,
            constraint=spec,
            presence_penalty=0.0 if presence_penalty is None else float(presence_penalty),
            frequency_penalty=0.0 if frequency_penalty is None else float(frequency_penalty),
            repetition_penalty=1.0 if repetition_penalty is None else float(repetition_penalty),
            logprobs=None if logprobs is None else int(logprobs),
            tools=tool_list,
            tool_choice=choice,
            reads_calls=tool_list is not None and choice != "none",
        )
        # Compiled here too (once per distinct constraint): the loop's thread only fills masks.
        try:
            matcher = None if options.constraint is None else self.constraints.matcher(options.constraint)
        except ValueError as err:
            if spec is given:
                raise
            # The grammar is the server's own; what can fail in it is a function's parameters schema.
            raise ValueError(f"TOOLS: a function's parameters (a JSON schema) do not compile: {err}") from None
        # Rendered here, on an execute thread: the loop's thread, which decodes for every conversation, does not
        # spend time on one request's text (unless the history changes before admission: then admit renders).
        history = None if start or key is None else self._histories.get(key)
        version, past, pinned = (-1, (), 0) if history is None else history
        rendered: _Rendered | None
        try:
            rendered = self._render(version, past, pinned, tuple(messages), options)
        except _TurnRefused:
            # Refused at admission, where a START still opens its conversation (Triton holds the sequence).
            rendered = None
        return ChatTurn(
            start=start, end=end, messages=tuple(messages), options=options, rendered=rendered, digest=client_digest,
            matcher=matcher,
        )  # fmt: skip

    def _tool_constraint(
        self, tools: tuple[dict[str, Any], ...] | None, choice: ToolChoice, spec: ConstraintSpec | None
    ) -> ConstraintSpec | None:
        """The turn's constraint once tools are counted: a forced call (``required``, a named function) is a grammar
        of the checkpoint's call markup around JSON valid for the functions' parameters, and replaces a
        ``response_format`` (the reply is the call); with ``auto`` and a JSON ``response_format`` the reply may be
        either that JSON or a call. Otherwise the constraint as given (a regex or grammar leaves no room for calls)."""
        fmt = self.tokenizer.tool_format
        if tools is None or fmt is None or choice == "none":
            return spec
        if choice == "auto":
            if spec is None or spec.kind not in ("json_schema", "json_object"):
                return spec
            forced = forced_tool_call(tools, "required", fmt)
            alternative = json.loads(spec.source)
        else:
            forced = forced_tool_call(tools, choice, fmt)
            alternative = None
        assert forced is not None
        grammar = forced_grammar(forced, self.tokenizer.split_controls, alternative=alternative)
        return ConstraintSpec("grammar", grammar, syntax="lark")

    # -- StepLoop callbacks (loop thread) -----------------------------------------------------------------

    def admit(self, new: Sequence[Stream[ChatTurn]], running: Sequence[Stream[ChatTurn]]) -> list[Any]:
        """Give each arriving turn its slot and prefill it; a refusal response for those that cannot run.

        Idempotent for a turn admitted again after a raise (the StepLoop's culprit search): a START restarts the
        slot, a digest that matched still matches, and the prefill finds the cache already holding the prompt.
        """
        self._enter_thread()
        # Running conversations are listed too, so neither the idle sweep nor an eviction frees one that generates.
        touch = [SequenceControls(correlation_id=s.key) for s in running]
        plan = self.slots.plan(
            [SequenceControls(correlation_id=s.key, start=s.job.start, end=s.job.end) for s in new] + touch,
            has_data=[s.job.options is not None for s in new] + [True] * len(touch),
        )
        verdicts: list[Any] = [None] * len(new)
        short: list[_Prefill] = []
        for row, refusal in plan.errors.items():
            if row >= len(new):
                continue
            if refusal.reason == "unknown" and new[row].job.options is None:
                # Closing a conversation the server no longer holds (swept, evicted) is done already: an END is
                # never refused.
                self.finish(new[row].job, "closed")
                verdicts[row] = self._respond(self._response(b"", "closed", 0, 0, 0, 0))
                continue
            kind: RefusalKind = refusal.reason if refusal.reason in ("capacity", "unknown") else "invalid"  # type: ignore[assignment]
            self.finish(new[row].job, "refused")
            verdicts[row] = self._refuse(kind, refusal.message)
        for row, slot in zip(plan.rows, plan.slots, strict=True):
            if row >= len(new):
                continue
            stream = new[row]
            turn = stream.job
            turn.key = stream.key
            conv = self._conversations.get(slot)
            if conv is None:
                conv = Conversation(table=self.cache.new_table(), version=next(self._versions))
                self._conversations[slot] = conv
            turn.slot = slot
            turn.status = "running"
            if not turn.start and turn.digest is not None and turn.digest != conv.digest:
                if conv.undo is not None and turn.digest == conv.undo.digest:
                    # The client never saw the last turn end (it cancelled, or timed out, after the server
                    # finished it): both sides agree once it is undone.
                    conv.roll_back(next(self._versions))
                    self._histories[stream.key] = (conv.version, conv.messages, conv.pinned)
                else:
                    self.finish(turn, "refused")
                    verdicts[row] = self._refuse(
                        "unknown",
                        f"{SEQUENCE_UNKNOWN} sequence {stream.key!r}: the conversation's history differs from the "
                        "client's (history digests differ); start a new conversation, replaying the history",
                    )
                    if turn.end:
                        self._release(stream.key)  # Triton ends the sequence with this request whatever we answer
                    continue
            try:
                pending = self._prefill(turn, conv, protected={s.key for s in (*new, *running)})
            except _TurnRefused as err:
                self.finish(turn, "refused")
                verdicts[row] = self._refuse(err.kind, str(err))
                if turn.end:
                    self._release(stream.key)
                continue
            if pending is not None:
                short.append(pending)
        # Short prompts (the usual next turn of a conversation) are prefilled together, a forward for many turns.
        self._prefill_together(short)
        # END with no messages: report the conversation as it stands, then free it (no step).
        for row, closing in plan.closes.items():
            if row >= len(new):
                continue
            conv = None if closing is None else self._conversations.get(closing)
            context = 0 if conv is None else conv.table.length
            digest = EMPTY if conv is None else conv.digest
            self._release(new[row].key)
            self.finish(new[row].job, "closed")
            verdicts[row] = self._respond(self._response(b"", "closed", 0, 0, context, 0, digest=digest))
        return verdicts

    def step(self, due: Sequence[Stream[ChatTurn]]) -> list[StepOutput]:
        """One decode pass for the due turns that wait for one, then each due turn takes its sampled token.

        The pass comes first and the pieces are returned right after the tokens they carry were taken: a piece goes
        out without waiting for the forward that computes the token after it, so a turn's first piece (its token was
        sampled by the prefill) leaves in the pass that admitted it, one forward sooner than a decode-then-emit step.

        Safe to call again on any part of ``due`` after it raised: a pass that raises changes nothing (the runner
        advances its rows only after a pass went through, and the tables take their tokens after it), and the
        replies are put back as they were when taking the tokens raises (blocks a turn reserved to grow stay
        reserved, and reserving them again takes nothing).
        """
        self._enter_thread()
        turns = [s.job for s in due]
        waiting = [t for t in turns if t.needs_pass]
        if waiting:
            self._decode(waiting)
        if any(t.next_token is None for t in turns):
            raise RuntimeError("a turn in the step has no sampled token: it was never prefilled")
        before = [
            (len(t.reply_ids), bytes(t.reply[t.sent :]), _consumed(t), t.in_calls, t.calls_scanned) for t in turns
        ]
        try:
            self._take(turns, protected={s.key for s in due})
        except BaseException:
            for turn, (n_ids, tail, consumed, in_calls, scanned) in zip(turns, before, strict=True):
                turn.in_calls, turn.calls_scanned = in_calls, scanned
                del turn.reply_ids[n_ids:]
                if turn.next_logprob is not None:
                    del turn.logprobs[n_ids:]
                    del turn.token_ends[n_ids:]
                turn.reply[turn.sent :] = tail
                turn.ending = None
                turn.needs_pass = False
                if turn.matcher is not None:
                    turn.matcher.rollback(turn.matcher.consumed - consumed)
            raise
        # Nothing below raises: the step is decided.
        return self._emit(turns)

    def _take(self, turns: list[ChatTurn], protected: set[CorrelationId]) -> None:
        """Extend each turn's reply with its sampled token; those that go on reserve a position for the next pass."""
        for turn in turns:
            options = turn.options
            assert options is not None
            token = turn.next_token
            assert token is not None
            table = self._table(turn)
            matcher = turn.matcher
            if token in self.tokenizer.stop_ids:
                turn.ending = "stop"
            else:
                if matcher is not None and not matcher.consume(token):
                    # The mask allowed it, so the matcher and the mask disagree: this turn fails (alone: the step
                    # loop runs the step again without it, and this step's other turns are put back first).
                    raise ValueError(f"the constraint refused token {token} that its mask allowed: {matcher.error}")
                turn.reply_ids.append(token)
                turn.reply += self._piece(token, first=len(turn.reply_ids) == 1, turn=turn)
                if turn.next_logprob is not None:
                    chosen, top = turn.next_logprob
                    turn.logprobs.append((token, chosen, top))
                    turn.token_ends.append(len(turn.reply))
                cut = None if self._in_calls(turn) else _find_stop(turn.reply, options.stop, turn.sent)
                if cut is not None:
                    del turn.reply[cut:]
                    turn.ending = "stop_string"
                elif matcher is not None and matcher.complete:
                    turn.ending = "stop"  # the constraint allows nothing more: the reply is whole
                elif options.max_tokens and len(turn.reply_ids) >= options.max_tokens:
                    turn.ending = "length"
                elif table.length >= self.max_ctx or not self._grow(table, protected):
                    # The end of the context, or no block to grow into (see the module docstring).
                    turn.ending = "context"
            if turn.ending is None:
                turn.needs_pass = True  # the next pass feeds it its token

    def _in_calls(self, turn: ChatTurn) -> bool:
        """Whether the reply has entered its tool calls (see ``ChatTurn.in_calls``): a forced call from its first
        token; under auto once a marker (or, for Llama 3 JSON, a reply starting with ``{``) is in it."""
        options = turn.options
        fmt = self.tokenizer.tool_format
        if turn.in_calls or options is None or not options.reads_calls or fmt is None:
            return turn.in_calls
        if options.tool_choice not in ("auto", "none"):
            turn.in_calls = True
            return True
        reply = turn.reply
        longest = max(len(m.encode()) for m in fmt.markers)
        start = max(0, turn.calls_scanned - longest + 1)  # a marker may straddle what was scanned and what is new
        window = bytes(reply[start:])
        turn.calls_scanned = len(reply)
        if any(m.encode() in window for m in fmt.markers) or (
            fmt.starts_with_json and bytes(reply[:256]).lstrip().startswith(b"{")  # its start decides, not its length
        ):
            turn.in_calls = True
        return turn.in_calls

    def _piece(self, token: int, *, first: bool, turn: ChatTurn) -> bytes:
        options = turn.options
        if options is not None and options.reads_calls and (marker := self._markers.get(token)) is not None:
            # A special token of the call markup ([TOOL_CALLS], <|python_tag|>) has no bytes, but the call reader
            # must see it; it never reaches the client as text (the reader holds everything from a marker on).
            return marker.encode()
        # A reply's first token may carry the SentencePiece space its decoder drops at the start of a text.
        return self.tokenizer.decode([token]) if first else self.tokenizer.token_bytes[token]

    def _emit(self, turns: list[ChatTurn]) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        for turn in turns:
            options = turn.options
            assert options is not None
            if turn.ending is not None:
                piece = self._shown(turn, len(turn.reply), final=turn.ending in KEPT)
                self.finish(turn, turn.ending)
                outputs.append(StepOutput(response=self._turn_response(turn, piece), done=True))
                continue
            # Hold back a tail that may be the start of a stop string: it is sent once it is known not to be.
            safe = len(turn.reply) - _held_back(turn.reply, options.stop)
            piece = b""
            if safe > turn.sent and self._may_send(turn):
                piece = self._shown(turn, safe, final=False)
            outputs.append(StepOutput(response=self._turn_response(turn, piece) if piece else None))
        return outputs

    def _shown(self, turn: ChatTurn, upto: int, *, final: bool) -> bytes:
        """What the client is shown of ``reply[sent:upto]`` (``sent`` moves to ``upto``): those bytes, or for a turn
        read for tool calls the content its reader lets go (never a call's markup). ``final``: the reply is whole
        (a kept end): the reader says what the reply was (``content``, ``tool_calls``), which the commit keeps."""
        new = bytes(turn.reply[turn.sent : upto])
        turn.sent = upto
        options = turn.options
        if options is None or not options.reads_calls or self.tokenizer.tool_format is None:
            return new
        if turn.calls is None:
            # Ids are salted with the prompt: unique per turn of a conversation, and the same for the same prompt
            # (a stateless replay of the history gets the very calls the conversation got).
            ids = b"" if turn.prompt is None else b",".join(str(i).encode() for i in turn.prompt.ids)
            turn.calls = ToolCallStream(self.tokenizer.tool_format, salt=hashlib.sha256(ids).hexdigest())
            turn.text_decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        text = turn.calls.feed(turn.text_decoder.decode(new, final=final))
        if not final:
            return text.encode()
        end = turn.calls.finish()
        turn.content = end.reply.content
        turn.tool_calls = end.reply.tool_calls
        return (text + end.rest).encode()

    def _may_send(self, turn: ChatTurn) -> bool:
        """Whether a turn's new bytes go out this pass: always the first piece; then no sooner than the interval.

        With an interval of 0 every pass sends. Above it, a turn's pieces in mid-reply are merged so that
        it sends at most one response per interval: each response costs the stub, Triton and the client about
        the same whatever its size, so under load fewer, larger pieces leave more of the CPU to decoding.
        The turn's own interval (STREAM_INTERVAL_MS) wins over the engine's ``stream_interval_s``.
        """
        options = turn.options
        interval = self.stream_interval_s
        if options is not None and options.stream_interval_s is not None:
            interval = options.stream_interval_s
        if interval <= 0 or turn.sent_at is None:
            turn.sent_at = self._clock()
            return True
        now = self._clock()
        if now - turn.sent_at < interval:
            return False
        turn.sent_at = now
        return True

    def finish(self, turn: ChatTurn, status: TurnStatus) -> None:
        """The one way a turn ends, whatever ended it: its status is set once; a kept end commits it to the history.

        Every other end (cancelled, superseded, failed, refused, shutdown) leaves the history as it was before the
        turn: the table's positions past it are rewound lazily, at the conversation's next prefill.
        """
        if turn.ended:
            return  # one end per turn: the loop's own exit after a step's end changes nothing
        turn.status = status
        turn.ending = None
        if status in KEPT:
            self._commit(turn)
        turn.next_token = None

    def on_exit(self, stream: Stream[ChatTurn], reason: ExitReason) -> None:
        """A turn left the loop: it ends (through :meth:`finish`), and its conversation is freed on END.

        Its conversation's idle time counts from here, so an eviction never takes one that just answered.
        """
        turn = stream.job
        if not turn.ended:
            self.finish(turn, _EXITS.get(reason, "failed"))
        turn.next_token = None
        if turn.end:
            self._release(stream.key)
        else:
            self.slots.touch(stream.key)

    # -- internals --------------------------------------------------------------------------------------

    def _enter_thread(self) -> None:
        # Device context is per thread: the loop's thread makes the device current once.
        ident = threading.get_ident()
        if self._thread_ready != ident:
            self._thread_ready = ident
            if self._on_thread is not None:
                self._on_thread()

    def _release(self, key: CorrelationId) -> None:
        self.slots.release(key)

    def _on_release(self, key: CorrelationId, slot: int) -> None:
        conv = self._conversations.pop(slot, None)
        self._histories.pop(key, None)
        if conv is not None:
            self.cache.release(conv.table)

    def _table(self, turn: ChatTurn) -> BlockTable:
        return self._conversations[turn.slot].table

    def _render(
        self, version: int, past: Messages, pinned: int, new: tuple[ChatMessage, ...], options: TurnOptions
    ) -> _Rendered:
        """The prompt of a turn adding ``new`` to the history ``past``: oldest messages dropped until it fits.

        What stays: the leading ``pinned`` system messages (and, in a first turn, the turn's own leading system
        messages), then the most recent messages from a user message on (strict templates require a user message
        after the system ones), then the turn's last message. Room is left for ``max_tokens`` of reply, or for
        what the context has left once the kept part is in. :class:`_TurnRefused` when even that does not fit.
        """
        added = tuple(m.entry() for m in new)
        extra = 0
        if not past:
            # A conversation's leading system messages stay whatever else is dropped.
            while extra < len(added) - 1 and _role(added[extra]) == "system":
                extra += 1
        kept = past[:pinned] + added[:extra]
        droppable = past[pinned:] + added[extra:-1]
        last = added[-1:]

        def render(messages: Messages) -> list[int]:
            try:
                return self.tokenizer.render(messages, add_generation_prompt=True, tools=options.tools)
            except ValueError as err:
                raise _TurnRefused("invalid", str(err)) from None

        # Room left for the reply: its cap, or with none the engine's default (the reply may then run on to the end).
        room = options.max_tokens or self.default_max_tokens
        ids = render(kept + droppable + last)
        if len(ids) + room <= self.max_ctx:
            return _Rendered(version=version, messages=kept + droppable + last, pinned=len(kept), dropped=0, ids=ids)
        fixed = len(render(kept + last))
        if fixed + 1 > self.max_ctx:
            raise _TurnRefused(
                "invalid",
                f"the turn needs {fixed} tokens (system messages, the user message and the reply's start) but the "
                f"context holds {self.max_ctx}; shorten the message",
            )
        limit = self.max_ctx - min(room, self.max_ctx - fixed)
        # Where the kept part may begin: at a user message, or after every droppable one.
        cuts = [k for k, m in enumerate(droppable) if _role(m) == "user" and k > 0] + [len(droppable)]
        if len(ids) <= limit:
            cuts = [0]
        # The fewest messages dropped that fit; lengths shrink as more is dropped, so a binary search finds it.
        lo, hi = 0, len(cuts) - 1
        found: tuple[int, list[int]] | None = None
        while lo <= hi:
            mid = (lo + hi) // 2
            trial = render(kept + droppable[cuts[mid] :] + last) if cuts[mid] else ids
            if len(trial) <= limit:
                found, hi = (cuts[mid], trial), mid - 1
            else:
                lo = mid + 1
        if found is None:
            found = (len(droppable), render(kept + last))
        k, ids = found
        messages = kept + droppable[k:] + last
        return _Rendered(version=version, messages=messages, pinned=len(kept), dropped=k, ids=ids)

    def _prefill(self, turn: ChatTurn, conv: Conversation, protected: set[CorrelationId]) -> _Prefill | None:
        """Render the turn (unless parse did, against this history), then prefill what the table lacks.

        A long prefill runs here and now, so that its full blocks are registered before the next turn of the same
        admission looks for a shared prefix; a short one is returned, to run with the others (``_prefill_together``).
        """
        options = turn.options
        assert options is not None
        rendered = turn.rendered
        version = -1 if turn.start else conv.version
        if rendered is None or rendered.version != version or (turn.start and conv.messages):
            rendered = self._render(version, conv.messages, conv.pinned, turn.messages, options)
        turn.prompt = rendered
        ids = rendered.ids
        table = conv.table
        # What the table holds of the prompt already, or can take from a registered prefix: never the last
        # position, whose logits are needed.
        start = min(self.cache.adopt_prefix(table, ids), len(ids) - 1)
        self._reserve(table, start, len(ids), protected, new=True)
        todo = ids[start:]
        if turn.sampling is None:
            # An unseeded turn draws its seed once: a retried admission or pass samples the same tokens.
            seed = options.seed if options.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
            turn.sampling = RowSampling(
                temperature=0.0 if options.greedy else options.temperature, top_k=options.top_k,
                top_p=options.top_p, seed=seed, min_tokens=options.min_tokens, presence=options.presence_penalty,
                frequency=options.frequency_penalty, repetition=options.repetition_penalty,
                logprobs=-1 if options.logprobs is None else options.logprobs,
            )  # fmt: skip
        turn.prompt_tokens = len(todo)
        pending = _Prefill(turn=turn, table=table, start=start, todo=todo)
        if len(todo) <= _SHORT_PREFILL:
            return pending
        self._run_prefill([pending], steps=len(todo))
        return None

    def _prefill_together(self, pending: list[_Prefill]) -> None:
        """Prefill short prompts in few forwards: rows of similar length padded to one T.

        A row's padding (its last token repeated) lies after its prompt, so causal attention keeps it out of the
        prompt's positions; its logits are taken at its own last token, and its table is cut back to its prompt
        after the forward. A row whose padding finds no free block runs alone, unpadded.
        """
        pending = sorted(pending, key=lambda p: len(p.todo))
        while pending:
            group = [pending.pop(0)]
            # Padding is wasted work: a group grows while its padded size stays within twice its real tokens.
            while pending and len(group) < _PREFILL_ROWS:
                width = len(pending[0].todo)
                if width * (len(group) + 1) > 2 * (sum(len(p.todo) for p in group) + width):
                    break
                group.append(pending.pop(0))
            steps = max(len(p.todo) for p in group)
            rows = []
            for p in group:
                try:
                    self.cache.reserve(p.table, p.start, p.start + steps)
                    rows.append(p)
                except CacheFull:
                    self._run_prefill([p], steps=len(p.todo))
            if rows:
                self._run_prefill(rows, steps=steps)

    def _run_prefill(self, rows: list[_Prefill], *, steps: int) -> None:
        """One forward for ``rows`` (positions reserved up to ``start + steps``), then commit and join each row."""
        matchers = [p.turn.matcher for p in rows]
        masks = fill_masks(matchers, self.constraints.words) if any(m is not None for m in matchers) else None
        values = [
            PrefillRow(
                slot=p.turn.slot, blocks=tuple(p.table.blocks), start=p.start, ids=tuple(p.todo),
                sampling=p.turn.sampling or RowSampling(),
                mask=None if masks is None or p.turn.matcher is None else masks[i],
                context=_context(p.turn),
            )
            for i, p in enumerate(rows)
        ]  # fmt: skip
        tokens = self.runner.prefill(values)
        self.prefill_forwards += 1
        _keep_logprobs([p.turn for p in rows], self.runner.last_logprobs)
        for p, value, token in zip(rows, values, tokens, strict=True):
            end = p.start + len(p.todo)
            self.cache.commit(p.table, p.start, p.todo)
            if steps > len(p.todo):
                self.cache.reserve(p.table, end, end)  # the padding goes
            self.runner.join(value, token, p.table.blocks)
            conv = self._conversations[p.turn.slot]
            conv.device_blocks = len(p.table.blocks)
            p.turn.next_token = token
            self.prefilled_tokens += len(p.todo)

    def _reserve(self, table: BlockTable, start: int, end: int, protected: set[CorrelationId], *, new: bool) -> None:
        """Reserve positions, making idle conversations give way when the pool is out of blocks."""
        while True:
            try:
                self.cache.reserve(table, start, end)
                return
            except CacheFull as full:
                if self.slots.evict_idlest(
                    protected,
                    why=f"was evicted after idling to make room in the KV cache ({self.cache.num_blocks} blocks)",
                ):
                    continue
                if not new:
                    raise
                raise _TurnRefused(
                    "capacity",
                    f"{SEQUENCE_CAPACITY} the KV cache is full: the turn needs {full.needed} more blocks of "
                    f"{self.cache.block_size} positions and {full.free} are free, and no conversation has idled long "
                    "enough to give way (parameter max_cache_mb); try again later",
                ) from None

    def _grow(self, table: BlockTable, protected: set[CorrelationId]) -> bool:
        """Room for one more position; False when the pool is out of blocks and nobody may give way."""
        try:
            self._reserve(table, table.length, table.length + 1, protected, new=False)
        except CacheFull:
            return False
        return True

    def _decode(self, turns: list[ChatTurn]) -> None:
        """One decode pass for ``turns`` (each reserved its next position): the runner samples their next tokens."""
        appended: list[tuple[int, int, int]] = []
        width = 1
        sampled = filtered = min_tokens = penalized = False
        logprobs = -1
        convs = [self._conversations[t.slot] for t in turns]  # before the pass: a missing one changes nothing
        for turn, conv in zip(turns, convs, strict=True):
            table = conv.table
            for index in range(conv.device_blocks, len(table.blocks)):
                appended.append((turn.slot, index, table.blocks[index]))
            width = max(width, self.cache.blocks_for(table.length + 1))
            s = turn.sampling
            if s is not None:
                sampled |= not s.greedy
                filtered |= not s.greedy and s.filtered
                min_tokens |= len(turn.reply_ids) < s.min_tokens
                penalized |= s.penalized
                logprobs = max(logprobs, s.logprobs)
        matchers = [t.matcher for t in turns]
        # Unconstrained batches (the usual) build no mask and run the pass without its masking.
        masks = fill_masks(matchers, self.constraints.words) if any(m is not None for m in matchers) else None
        batch = DecodeBatch(
            slots=tuple(t.slot for t in turns),
            width=width,
            flags=SamplingFlags(
                sampled=sampled, filtered=filtered, min_tokens=min_tokens, constrained=masks is not None,
                penalized=penalized, logprobs=logprobs,
            ),
            appended=tuple(appended),
            masks=masks,
        )
        tokens = self.runner.decode(batch)
        _keep_logprobs(turns, self.runner.last_logprobs)
        # The pass went through: each table holds its input token, and the rows know their blocks.
        for turn, conv, token in zip(turns, convs, tokens, strict=True):
            self.cache.commit(conv.table, conv.table.length, [turn.reply_ids[-1]])
            conv.device_blocks = len(conv.table.blocks)
            turn.next_token = token
            turn.needs_pass = False
        self.decode_passes += 1
        self.rows_decoded += len(turns)

    def _commit(self, turn: ChatTurn) -> None:
        """A finished turn becomes history: its kept messages, then the reply as the text the client received."""
        conv = self._conversations.get(turn.slot)
        if conv is None or turn.prompt is None:
            return
        text = bytes(turn.reply).decode("utf-8", errors="replace") if turn.content is None else turn.content
        conv.undo = _Committed(messages=conv.messages, pinned=conv.pinned, digest=conv.digest)
        # The messages as received and the reply as the client reads it: the strings the client's chain uses.
        calls = tuple((c.id or "", c.name, c.arguments) for c in turn.tool_calls)
        conv.digest = history_digest(conv.digest, [m.digest_key for m in turn.messages], text, calls)
        reply = ChatMessage("assistant", text, MessageTools(tool_calls=turn.tool_calls)).entry()
        conv.messages = (*turn.prompt.messages, reply)
        conv.pinned = turn.prompt.pinned
        conv.version = next(self._versions)
        if turn.key is not None:
            self._histories[turn.key] = (conv.version, conv.messages, conv.pinned)
        turn.next_token = None

    def _turn_response(self, turn: ChatTurn, piece: bytes) -> Any:
        conv = self._conversations.get(turn.slot)
        return self._respond(
            self._response(
                piece,
                turn.finish,
                len(turn.reply_ids),
                turn.prompt_tokens,
                0 if conv is None else conv.table.length,
                0 if turn.prompt is None else turn.prompt.dropped,
                digest=EMPTY if conv is None or not turn.finish else conv.digest,
                input_tokens=0 if turn.prompt is None else len(turn.prompt.ids),
                logprobs=self._logprobs_out(turn),
                tool_calls=_calls_json(turn.tool_calls) if turn.finish else "",
            )
        )

    def _logprobs_out(self, turn: ChatTurn) -> str:
        """The log-probabilities of the tokens whose bytes went out with this response, as JSON ("" when none).

        A token goes with the response that completes its bytes; the last response takes every token left (also
        one a stop string cut into). Each: ``{"id", "b" (its bytes, hex), "lp", "top": [[id, bytes hex, lp]...]}``.
        """
        if turn.options is None or turn.options.logprobs is None:
            return ""
        end = len(turn.logprobs) if turn.finish else bisect.bisect_right(turn.token_ends, turn.sent)
        if end <= turn.logprobs_sent:
            return ""
        table = self.tokenizer.token_bytes
        entries = [
            {"id": t, "b": table[t].hex(), "lp": lp, "top": [[i, table[i].hex(), v] for i, v in top]}
            for t, lp, top in turn.logprobs[turn.logprobs_sent : end]
        ]
        turn.logprobs_sent = end
        return json.dumps(entries, separators=(",", ":"))

    def _response(
        self,
        piece: bytes,
        finish: Finish,
        tokens: int,
        prompt: int,
        context: int,
        dropped: int,
        *,
        digest: str = EMPTY,
        input_tokens: int = 0,
        logprobs: str = "",
        tool_calls: str = "",
    ) -> ChatResponse:
        return ChatResponse(
            piece=piece,
            finish=finish,
            tokens=tokens,
            prompt_tokens=prompt,
            context_tokens=context,
            dropped=dropped,
            # Summed over every live conversation: worth it only where it is read, on a turn's last response.
            live=self.live if finish else 0,
            kv_bytes=self.kv_bytes if finish else 0,
            digest=digest,
            input_tokens=input_tokens if finish else 0,
            logprobs=logprobs,
            tool_calls=tool_calls,
        )


def _calls_json(calls: Sequence[ToolCall]) -> str:
    """A reply's calls as the TOOL_CALLS output: ``[{"id", "name", "arguments"}]`` ("" for none)."""
    if not calls:
        return ""
    return json.dumps([{"id": c.id, "name": c.name, "arguments": c.arguments} for c in calls], ensure_ascii=False)


def _keep_logprobs(turns: Sequence[ChatTurn], rows: list[tuple[float, list[tuple[int, float]]]] | None) -> None:
    """Each turn that asked for them keeps the log-probabilities of the token its pass just sampled."""
    for i, turn in enumerate(turns):
        row = None if rows is None else rows[i]
        options = turn.options
        if row is None or options is None or options.logprobs is None:
            turn.next_logprob = None
            continue
        chosen, top = row
        turn.next_logprob = (chosen, top[: options.logprobs])


#: Prompts this short (a conversation's next turn, usually) are prefilled together; longer ones alone, at once.
_SHORT_PREFILL: Final = 64
#: The most turns one batched prefill takes.
_PREFILL_ROWS: Final = 64


@dataclass(frozen=True, slots=True)
class _Prefill:
    """A turn ready to prefill: ``todo`` are the prompt's ids from position ``start`` of ``table`` on."""

    turn: ChatTurn
    table: BlockTable
    start: int
    todo: list[int]


class _TurnRefused(ValueError):
    def __init__(self, kind: RefusalKind, message: str) -> None:
        super().__init__(message)
        self.kind: RefusalKind = kind


def _context(turn: ChatTurn) -> tuple[int, ...]:
    """The prompt's ids where the turn's repetition penalty reads them (else nothing: they are not copied)."""
    s = turn.sampling
    if s is None or s.repetition == 1 or turn.prompt is None:
        return ()
    return tuple(turn.prompt.ids)


def _consumed(turn: ChatTurn) -> int:
    return 0 if turn.matcher is None else turn.matcher.consumed


def _size(value: bytes | str) -> int:
    """UTF-8 bytes of an input entry, read without decoding it (a str, from tests, is measured encoded)."""
    return len(value.encode("utf-8", "surrogatepass")) if isinstance(value, str) else len(value)


def _text(value: bytes | str, name: str) -> str:
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{name} is not valid UTF-8: {err}") from None


def _find_stop(reply: bytearray, stops: Sequence[bytes], sent: int) -> int | None:
    """Where the first stop string starts in ``reply`` (None: none); text already sent is not searched again."""
    best: int | None = None
    for stop in stops:
        # A stop string can only start in text not yet sent: the held-back tail guarantees it.
        at = reply.find(stop, max(0, sent - len(stop) + 1))
        if at != -1 and (best is None or at < best):
            best = at
    return best


def _held_back(reply: bytearray, stops: Sequence[bytes]) -> int:
    """How many trailing bytes of ``reply`` could be the beginning of a stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(reply)), longest, -1):
            if reply.endswith(stop[:size]):
                longest = size
                break
    return longest
