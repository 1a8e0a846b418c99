"""A chat engine: GPT-2 conversations whose KV caches stay on the device, decoded together, streamed piece by piece.

It plugs into :class:`~.._generate.StepLoop` as its three callbacks:

- ``admit`` (a turn arrives): parse it, fit it into the context, prefill only the tokens the
  conversation's cache does not hold yet, keep the logits of the last position;
- ``step`` (one pass): sample one token for every generating conversation, then run *one* batched
  decode forward for all that go on; a turn that arrived meanwhile joins at the next pass;
- ``on_exit``: free the conversation on END; a turn that did not finish normally is rolled back.

**What a conversation is.** Its history is a list of token ids (``Conversation.ids``) built by the
chat template: each message is ``<|role|> text <|end|>``, and a turn's prompt ends with
``<|assistant|>``. The KV cache of its slot holds the keys and values of a prefix of some token list
(``Conversation.cached``, mirrored on the host as ids, never as tensors). At every turn the engine
prefills from the first position where the cache and the wanted history differ, so every rule below
costs a rewind plus a prefill of what changed, and usually nothing but the new turn:

- After a reply the history holds the *text the client received* re-encoded (``encode(text)``), then
  ``<|end|>``: a conversation replayed from its text as the first turn of a fresh one gives exactly
  the same tokens. When the generated ids are the text's own encoding (the usual case) the cache
  already holds them and only ``<|end|>`` is prefilled next turn.
- A cancelled or failed turn is rolled back: the history is what it was before the turn (neither the
  user message nor the partial reply stay); the cache is rewound lazily at the next turn.
- Context overflow: when the history, the new messages and ``max_tokens`` do not fit in ``max_ctx``,
  the oldest messages are dropped (leading system messages are kept) and the rest is prefilled
  again; a turn too long even alone is refused with a clear error. If a reply still reaches the end
  of the context it finishes with ``"context"``.
- History digest: each conversation keeps ``digest`` (a chain over its committed turns, see ``_digest``)
  and can undo its last committed turn once. A turn that carries the client's digest proceeds when it
  matches, rolls the last turn back first when it matches the digest before it (the client never saw
  that turn end), and is refused as an unknown sequence otherwise.

Isolation: :meth:`ChatEngine.parse` (execute threads) checks every input against :class:`InputLimits` on
its raw byte length before decoding it, and tokenises the messages, so the loop's thread never touches
an oversized input and never tokenises a request's messages. ``step`` and ``admit`` may be called again on
part of a batch after they raised (the StepLoop then looks for the stream that fails): ``step`` changes
nothing it cannot undo before its last operation that may raise, and ``admit`` is idempotent.

The engine knows nothing of Triton: responses and refusals are built by callbacks the model gives
(``respond``, ``refuse``), so it is tested as plain Python. torch and tokenizers are imported lazily.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

from .._controls import CorrelationId, SequenceControls
from .._digest import EMPTY, history_digest
from .._generate import ExitReason, StepOutput, Stream
from .._markers import SEQUENCE_UNKNOWN
from .._state import SequenceSlots
from ._gpt2 import GPT2, KVCache
from ._gpt2 import forward as gpt2_forward

if TYPE_CHECKING:
    import torch

__all__ = [
    "ChatEngine",
    "ChatMessage",
    "ChatResponse",
    "ChatTokenizer",
    "ChatTurn",
    "Conversation",
    "Finish",
    "GREEDY_BELOW",
    "InputLimits",
    "TurnOptions",
    "kv_bytes_per_position",
]

ROLES: Final = ("system", "user", "assistant")
Finish = Literal["", "stop", "stop_string", "length", "context", "closed"]
RefusalKind = Literal["invalid", "capacity", "unknown"]

#: A ``TEMPERATURE`` below this is greedy (vLLM's epsilon): dividing logits by a smaller one overflows them
#: to inf and sampling fails, while the distribution is already argmax to float precision.
GREEDY_BELOW: Final = 1e-5
#: The longest stream interval a turn may ask for (STREAM_INTERVAL_MS): past a minute a "stream" is one response.
STREAM_INTERVAL_MAX_MS: Final = 60000


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

    def __post_init__(self) -> None:
        for name in ("max_messages", "max_message_bytes", "max_request_bytes", "max_stops", "max_stop_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    text: str


@dataclass(frozen=True, kw_only=True, slots=True)
class TurnOptions:
    """How one turn generates. ``temperature`` below :data:`GREEDY_BELOW` is greedy (0, the default); ``top_k`` 0
    is off. ``stream_interval_s``: how often the turn's mid-reply pieces may go out (None: the engine's default)."""

    max_tokens: int
    min_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[bytes, ...] = ()
    stream_interval_s: float | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.max_tokens < 1:
            problems.append(f"MAX_TOKENS must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            problems.append(f"MIN_TOKENS must be in 0..MAX_TOKENS ({self.max_tokens}), got {self.min_tokens}")
        if not 0 <= self.temperature < math.inf:  # also refuses NaN
            problems.append(f"TEMPERATURE must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # also refuses NaN
            problems.append(f"TOP_P must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            problems.append(f"TOP_K must be >= 0, got {self.top_k}")
        if any(not s for s in self.stop):
            problems.append("STOP strings must not be empty")
        longest = STREAM_INTERVAL_MAX_MS / 1000
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


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for every byte value, inverted: character -> byte.

    Byte-level tokenizers (GPT-2's scheme) spell each byte as a visible character: the printable
    Latin-1 bytes as themselves, the other 68 (controls, space, soft hyphen...) as U+0100 onwards, in
    byte order.
    """
    visible = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in visible}
    extra = 0
    for b in range(256):
        if b not in table.values():
            table[chr(256 + extra)] = b
            extra += 1
    return table


class ChatTokenizer:
    """A byte-level BPE ``tokenizer.json`` (the ``tokenizers`` library) plus the chat template's special tokens."""

    SPECIAL: Final = ("<|end|>", "<|system|>", "<|user|>", "<|assistant|>")

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(path)
        self._tok = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
        # Text is text: a user who types "<|end|>" gets those characters, never the special token (which would
        # let a message forge the end of a turn or another role's message).
        self._tok.encode_special_tokens = True
        vocab = self._tok.get_vocab(with_added_tokens=True)
        missing = [t for t in self.SPECIAL if t not in vocab]
        if missing:
            raise ValueError(f"{path}: the tokenizer lacks the chat template's special tokens {missing}")
        self.end_id = vocab["<|end|>"]
        self.role_ids = {role: vocab[f"<|{role}|>"] for role in ROLES}
        # A reply ends at <|end|>, or where the model starts another message on its own.
        self.stop_ids = frozenset({self.end_id, *self.role_ids.values()})
        self.vocab_size = max(vocab.values()) + 1
        alphabet = _byte_alphabet()
        special = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        # Each token's raw bytes, so that a reply streams as bytes with no decode step that could
        # split a character; special tokens carry no text.
        self.token_bytes: list[bytes] = [b""] * self.vocab_size
        for token, index in vocab.items():
            if token in special:
                continue
            try:
                self.token_bytes[index] = bytes(alphabet[c] for c in token)
            except KeyError:
                raise ValueError(f"{path}: token {token!r} is not byte-level BPE") from None

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_message(self, message: ChatMessage) -> list[int]:
        return [self.role_ids[message.role], *self.encode(message.text), self.end_id]

    def decode(self, ids: Iterable[int]) -> bytes:
        return b"".join(self.token_bytes[i] for i in ids)


@dataclass(frozen=True, slots=True)
class _Committed:
    """A conversation's history as it was before its last committed turn: what undoing that turn restores."""

    ids: list[int]
    spans: list[tuple[int, int]]
    pinned: int
    digest: str


@dataclass(eq=False)
class Conversation:
    """One conversation's history (token ids, message boundaries, digest) and what its slot's cache holds."""

    ids: list[int] = field(default_factory=list)
    # (start, end) of each message in ids, oldest first; the leading `pinned` ones (system) are never dropped.
    spans: list[tuple[int, int]] = field(default_factory=list)
    pinned: int = 0
    # The ids whose keys and values the slot's cache holds, in order (len == cache.lengths[slot]).
    cached: list[int] = field(default_factory=list)
    digest: str = EMPTY
    undo: _Committed | None = None  # the history before the last committed turn; None once used or when none

    def roll_back(self) -> None:
        """Undo the last committed turn (the cache is rewound lazily, at the next prefill)."""
        assert self.undo is not None
        self.ids, self.spans, self.pinned, self.digest = (
            self.undo.ids, self.undo.spans, self.undo.pinned, self.undo.digest
        )
        self.undo = None


@dataclass(eq=False)
class ChatTurn:
    """One request: a turn (messages to add, then a reply) or a close; the StepLoop's job, mutated by the engine."""

    start: bool
    end: bool
    messages: tuple[ChatMessage, ...]
    options: TurnOptions | None  # None: END with no messages, a close
    # Each message's template ids, made by parse on an execute thread (None: admit encodes them).
    encoded: tuple[list[int], ...] | None = None
    digest: str | None = None  # the client's digest of the history it believes the server holds; None: unchecked
    # Set by admit.
    slot: int = -1
    history: list[int] = field(default_factory=list)  # the conversation's ids after this turn's prompt
    spans: list[tuple[int, int]] = field(default_factory=list)
    pinned: int = 0
    prompt_tokens: int = 0
    dropped: int = 0
    logits: torch.Tensor | None = None  # of the last position: what the next token is sampled from
    generator: torch.Generator | None = None
    # Set by step.
    reply_ids: list[int] = field(default_factory=list)
    reply: bytearray = field(default_factory=bytearray)
    sent: int = 0  # bytes of `reply` already streamed
    sent_at: float | None = None  # when the last piece went out (None: none yet)
    finish: Finish = ""


def kv_bytes_per_position(model: GPT2) -> int:
    """Bytes one position of one conversation takes in the KV cache (keys and values, every layer)."""
    config = model.config
    return 2 * config.n_layer * config.n_embd * model.wte.element_size()


class ChatEngine:
    """Conversations on one GPT-2 and one KV cache; the callbacks of a StepLoop. See the module docstring.

    ``respond(response)`` turns a :class:`ChatResponse` into what the sender sends; ``refuse(kind,
    message)`` builds an error response (``kind``: "invalid", "capacity" or "unknown"). ``slots`` (the
    live-conversation map) must have ``capacity`` equal to the cache's slots. ``stateless``: each request is
    a whole conversation (started and ended by itself), as for a model without sequence batching.
    Every method but the constructor runs on the loop's thread.
    """

    def __init__(
        self,
        model: GPT2,
        tokenizer: ChatTokenizer,
        cache: KVCache,
        slots: SequenceSlots,
        *,
        respond: Callable[[ChatResponse], Any],
        refuse: Callable[[RefusalKind, str], Any],
        default_max_tokens: int = 64,
        stream_interval_s: float = 0.0,
        limits: InputLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_thread: Callable[[], None] | None = None,
    ) -> None:
        if slots.on_release is not None:
            raise ValueError("slots already has an on_release hook: one SequenceSlots serves one engine")
        if slots.capacity != cache.slots:
            raise ValueError(f"slots.capacity {slots.capacity} != cache slots {cache.slots}")
        if tokenizer.vocab_size > model.config.vocab_size:
            raise ValueError(
                f"the tokenizer has {tokenizer.vocab_size} ids but the model only {model.config.vocab_size}"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.cache = cache
        self.slots = slots
        self.default_max_tokens = default_max_tokens
        self.stream_interval_s = stream_interval_s
        self.limits = InputLimits() if limits is None else limits
        self._clock = clock
        self._respond = respond
        self._refuse = refuse
        self._on_thread = on_thread
        self._thread_ready: int | None = None
        self._conversations: dict[int, Conversation] = {}
        # The slots are the one truth of which conversation holds which slot: whatever frees one (END, the idle
        # sweep, an eviction, a restart by START) comes through here, and the conversation and its cache go.
        slots.on_release = self._on_release
        self._per_position = kv_bytes_per_position(model)
        # Counters, for tests and logs.
        self.prefilled_tokens = 0
        self.decode_passes = 0
        self.rows_decoded = 0

    # -- what the outputs report ----------------------------------------------------------------------

    @property
    def max_ctx(self) -> int:
        return self.cache.max_ctx

    @property
    def live(self) -> int:
        return self.slots.live

    @property
    def kv_bytes(self) -> int:
        """KV-cache bytes that live conversations hold (positions in use)."""
        return sum(self.cache.lengths[s] for s in self.slots.held().values()) * self._per_position

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
    ) -> ChatTurn:
        """Build one request's job from its inputs, its messages tokenised; ``ValueError`` naming the input.

        Sizes are checked against :attr:`limits` on raw byte lengths before anything is decoded.
        ``stream_interval_ms`` (STREAM_INTERVAL_MS) overrides the engine's stream interval for this turn.
        """
        if stream_interval_ms is not None and not 0 <= int(stream_interval_ms) <= STREAM_INTERVAL_MAX_MS:
            raise ValueError(
                f"STREAM_INTERVAL_MS must be in 0..{STREAM_INTERVAL_MAX_MS} milliseconds, got {int(stream_interval_ms)}"
            )
        limits = self.limits
        roles = list(roles or ())
        texts = list(texts or ())
        stop = list(stop)
        if len(texts) > limits.max_messages:
            raise ValueError(f"TEXT has {len(texts)} messages; at most {limits.max_messages} (parameter max_messages)")
        if len(roles) != len(texts):
            raise ValueError(f"ROLE has {len(roles)} entries but TEXT has {len(texts)}: one role per message")
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
        client_digest = None
        if digest is not None:
            if _size(digest) > 64:
                raise ValueError(f"DIGEST must be a history digest (at most 64 characters), got {_size(digest)} bytes")
            client_digest = _text(digest, "DIGEST")
        if not roles:
            if not end:
                raise ValueError("a turn needs ROLE and TEXT (at least one user message); only END may come without")
            return ChatTurn(start=start, end=end, messages=(), options=None, digest=client_digest)
        messages = []
        for i, (role, text) in enumerate(zip(roles, texts, strict=True)):
            role_s = _text(role, f"ROLE[{i}]")
            if role_s not in ROLES:
                raise ValueError(f"ROLE[{i}] must be one of {', '.join(ROLES)}, got {role_s!r}")
            messages.append(ChatMessage(role_s, _text(text, f"TEXT[{i}]")))
        if messages[-1].role != "user":
            raise ValueError(f"the last message of a turn must have ROLE user, got {messages[-1].role!r}")
        options = TurnOptions(
            max_tokens=self.default_max_tokens if max_tokens is None else int(max_tokens),
            min_tokens=0 if min_tokens is None else int(min_tokens),
            temperature=0.0 if temperature is None else float(temperature),
            top_p=1.0 if top_p is None else float(top_p),
            top_k=0 if top_k is None else int(top_k),
            seed=None if seed is None else int(seed),
            stop=tuple(s.encode("utf-8") if isinstance(s, str) else bytes(s) for s in stop),
            stream_interval_s=None if stream_interval_ms is None else int(stream_interval_ms) / 1000,
        )
        # Tokenised here, on the execute thread: the loop's thread, which decodes for every conversation, never
        # spends time on one request's text.
        encoded = tuple(self.tokenizer.encode_message(m) for m in messages)
        return ChatTurn(
            start=start, end=end, messages=tuple(messages), options=options, encoded=encoded, digest=client_digest
        )

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
        for row, refusal in plan.errors.items():
            if row >= len(new):
                continue
            if refusal.reason == "unknown" and new[row].job.options is None:
                # Closing a conversation the server no longer holds (swept, evicted) is done already: an END is
                # never refused.
                verdicts[row] = self._respond(self._response(b"", "closed", 0, 0, 0, 0))
                continue
            kind: RefusalKind = refusal.reason if refusal.reason in ("capacity", "unknown") else "invalid"  # type: ignore[assignment]
            verdicts[row] = self._refuse(kind, refusal.message)
        for row, slot in zip(plan.rows, plan.slots, strict=True):
            if row >= len(new):
                continue
            stream = new[row]
            turn = stream.job
            conv = self._conversations.get(slot)
            if conv is None:
                conv = self._conversations[slot] = Conversation()
            turn.slot = slot
            if not turn.start and turn.digest is not None and turn.digest != conv.digest:
                if conv.undo is not None and turn.digest == conv.undo.digest:
                    # The client never saw the last turn end (it cancelled, or timed out, after the server
                    # finished it): both sides agree once it is undone.
                    conv.roll_back()
                else:
                    verdicts[row] = self._refuse(
                        "unknown",
                        f"{SEQUENCE_UNKNOWN} sequence {stream.key!r}: the conversation's history differs from the "
                        "client's (history digests differ); start a new conversation, replaying the history",
                    )
                    if turn.end:
                        self._release(stream.key)  # Triton ends the sequence with this request whatever we answer
                    continue
            try:
                self._prefill(turn, conv)
            except _TurnRefused as err:
                verdicts[row] = self._refuse("invalid", str(err))
                if turn.end:
                    self._release(stream.key)
        # END with no messages: report the conversation as it stands, then free it (no step).
        for row, closing in plan.closes.items():
            if row >= len(new):
                continue
            context = 0 if closing is None else self.cache.lengths[closing]
            conv = None if closing is None else self._conversations.get(closing)
            digest = EMPTY if conv is None else conv.digest
            self._release(new[row].key)
            verdicts[row] = self._respond(self._response(b"", "closed", 0, 0, context, 0, digest=digest))
        return verdicts

    def step(self, due: Sequence[Stream[ChatTurn]]) -> list[StepOutput]:
        """One token for every due turn, then one batched forward for the turns that go on.

        Safe to call again on any part of ``due`` after it raised: the generators sampling advanced and the
        replies are put back as they were, and nothing else changes before the forward's last write.
        """
        import torch

        self._enter_thread()
        turns = [s.job for s in due]
        logits = torch.stack([t.logits for t in turns if t.logits is not None])
        if len(logits) != len(turns):
            raise RuntimeError("a turn in the step has no logits: it was never prefilled")
        # What the turns had before this step, put back if it raises: the generators sampling advances, the replies.
        generators = [(t.generator, t.generator.get_state()) for t in turns if t.generator is not None]
        before = [(len(t.reply_ids), bytes(t.reply[t.sent :])) for t in turns]
        try:
            self._advance(logits, turns)
        except BaseException:
            for generator, state in generators:
                generator.set_state(state)
            for turn, (n_ids, tail) in zip(turns, before, strict=True):
                del turn.reply_ids[n_ids:]
                turn.reply[turn.sent :] = tail
                turn.finish = ""
            raise
        # Nothing below raises: the step is decided.
        return self._emit(turns)

    def _advance(self, logits: torch.Tensor, turns: list[ChatTurn]) -> list[ChatTurn]:
        """Sample a token for each turn, extend its reply, then decode the turns that go on; return those."""
        tokens = self._sample(logits, turns)
        going: list[ChatTurn] = []
        for turn, token in zip(turns, tokens, strict=True):
            options = turn.options
            assert options is not None
            if token in self.tokenizer.stop_ids:
                turn.finish = "stop"
            else:
                turn.reply_ids.append(token)
                turn.reply += self.tokenizer.token_bytes[token]
                cut = _find_stop(turn.reply, options.stop, turn.sent)
                if cut is not None:
                    del turn.reply[cut:]
                    turn.finish = "stop_string"
                elif len(turn.reply_ids) >= options.max_tokens:
                    turn.finish = "length"
                elif self.cache.lengths[turn.slot] >= self.cache.max_ctx:
                    turn.finish = "context"
            if not turn.finish:
                going.append(turn)
        if going:
            self._decode(going)
        return going

    def _emit(self, turns: list[ChatTurn]) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        for turn in turns:
            options = turn.options
            assert options is not None
            if turn.finish:
                piece = bytes(turn.reply[turn.sent :])
                turn.sent = len(turn.reply)
                self._commit(turn)
                outputs.append(StepOutput(response=self._turn_response(turn, piece), done=True))
                continue
            # Hold back a tail that may be the start of a stop string: it is sent once it is known not to be.
            safe = len(turn.reply) - _held_back(turn.reply, options.stop)
            piece = b""
            if safe > turn.sent and self._may_send(turn):
                piece = bytes(turn.reply[turn.sent : safe])
                turn.sent = safe
            outputs.append(StepOutput(response=self._turn_response(turn, piece) if piece else None))
        return outputs

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

    def on_exit(self, stream: Stream[ChatTurn], reason: ExitReason) -> None:
        """A turn left the loop: free its conversation on END. One that did not finish was never committed.

        Its conversation's idle time counts from here, so an eviction never takes one that just answered.
        """
        turn = stream.job
        turn.logits = None
        turn.generator = None
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
        self._conversations.pop(slot, None)
        self.cache.reset(slot)

    def _prefill(self, turn: ChatTurn, conv: Conversation) -> None:
        """Fit the turn into the context, then prefill what the slot's cache lacks; keep the last logits."""
        import torch

        options = turn.options
        assert options is not None
        if turn.encoded is not None:
            new = list(turn.encoded)
        else:
            new = [self.tokenizer.encode_message(m) for m in turn.messages]
        # The messages this turn may drop, oldest first: the conversation's, then all but the last of its own.
        pinned_spans = conv.spans[: conv.pinned]
        pinned = [conv.ids[a:b] for a, b in pinned_spans]
        droppable = [conv.ids[a:b] for a, b in conv.spans[conv.pinned :]]
        extra_pinned = 0
        if not conv.spans:
            # A conversation's leading system messages stay whatever else is dropped.
            while extra_pinned < len(turn.messages) - 1 and turn.messages[extra_pinned].role == "system":
                extra_pinned += 1
        pinned += new[:extra_pinned]
        droppable += new[extra_pinned:-1]
        last = new[-1]
        fixed = sum(map(len, pinned)) + len(last) + 1  # + <|assistant|>
        if fixed + 1 > self.max_ctx:
            raise _TurnRefused(
                f"the turn needs {fixed} tokens (system messages, the user message and the reply's start) but the "
                f"context holds {self.max_ctx}; shorten the message"
            )
        room = self.max_ctx - fixed - min(options.max_tokens, self.max_ctx - fixed)
        kept_from = 0
        total = sum(map(len, droppable))
        while total > room and kept_from < len(droppable):
            total -= len(droppable[kept_from])
            kept_from += 1
        turn.dropped = kept_from
        messages = [*pinned, *droppable[kept_from:], last]
        ids: list[int] = []
        spans: list[tuple[int, int]] = []
        for m in messages:
            spans.append((len(ids), len(ids) + len(m)))
            ids += m
        turn.history = [*ids, self.tokenizer.role_ids["assistant"]]
        turn.spans = spans
        turn.pinned = len(pinned)

        # Prefill from the first position where the cache differs from the wanted history.
        slot = turn.slot
        common = _common_prefix(conv.cached, turn.history)
        if common == len(turn.history):
            common -= 1  # the last position's logits are needed again
        todo = turn.history[common:]
        tokens = torch.tensor([todo], dtype=torch.long)
        logits = gpt2_forward(self.model, self.cache, [slot], tokens, [common])
        conv.cached[common:] = todo
        self.prefilled_tokens += len(todo)
        turn.prompt_tokens = len(todo)
        turn.logits = logits[0]
        if not options.greedy:
            generator = torch.Generator(device=self.model.device)
            generator.manual_seed(options.seed if options.seed is not None else int.from_bytes(os.urandom(8), "little"))
            turn.generator = generator

    def _sample(self, logits: torch.Tensor, turns: Sequence[ChatTurn]) -> list[int]:
        """One token per row: argmax for greedy turns, else temperature / top-k / top-p with the turn's generator."""
        import torch

        early = [row for row, t in enumerate(turns) if t.options and len(t.reply_ids) < t.options.min_tokens]
        if early:
            # Below MIN_TOKENS a reply may not end: the tokens that would end it are never chosen.
            rows = torch.tensor(early, device=logits.device)
            stops = torch.tensor(sorted(self.tokenizer.stop_ids), device=logits.device)
            logits = logits.clone()
            logits[rows[:, None], stops[None, :]] = float("-inf")
        chosen = logits.argmax(dim=-1)
        sampled = [(row, t) for row, t in enumerate(turns) if t.options is not None and not t.options.greedy]
        for row, turn in sampled:
            self._sample_row(logits, chosen, row, turn)
        # The one device-to-host copy per pass: the host needs the ids to stream text and check stops.
        return [int(t) for t in chosen.tolist()]

    def _sample_row(self, logits: torch.Tensor, chosen: torch.Tensor, row: int, turn: ChatTurn) -> None:
        import torch

        options = turn.options
        assert options is not None
        scores = logits[row] / options.temperature
        if options.top_k:
            kth = torch.topk(scores, min(options.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if options.top_p < 1.0:
            ordered, order = torch.sort(probs, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            outside = (ordered.cumsum(0) - ordered) >= options.top_p
            probs = probs.scatter(0, order, ordered.masked_fill(outside, 0.0))
        chosen[row] = torch.multinomial(probs, 1, generator=turn.generator)[0]

    def _decode(self, turns: list[ChatTurn]) -> None:
        import torch

        slots = [t.slot for t in turns]
        conversations = [self._conversations[s] for s in slots]  # before the forward: a missing one changes nothing
        tokens = torch.tensor([[t.reply_ids[-1]] for t in turns], dtype=torch.long)
        logits = gpt2_forward(self.model, self.cache, slots, tokens)
        for row, (turn, conv) in enumerate(zip(turns, conversations, strict=True)):
            turn.logits = logits[row]
            conv.cached.append(turn.reply_ids[-1])
        self.decode_passes += 1
        self.rows_decoded += len(turns)

    def _commit(self, turn: ChatTurn) -> None:
        """A finished turn becomes history: its messages, then the reply as the text the client received."""
        conv = self._conversations.get(turn.slot)
        if conv is None:
            return
        text = bytes(turn.reply).decode("utf-8", errors="replace")
        reply = [*self.tokenizer.encode(text), self.tokenizer.end_id]
        start = len(turn.history) - 1  # the <|assistant|> token opens the reply's message
        conv.undo = _Committed(ids=conv.ids, spans=conv.spans, pinned=conv.pinned, digest=conv.digest)
        # The messages as received and the reply as the client reads it: the strings the client's chain uses.
        conv.digest = history_digest(conv.digest, [(m.role, m.text) for m in turn.messages], text)
        conv.ids = turn.history + reply
        conv.spans = [*turn.spans, (start, len(conv.ids))]
        conv.pinned = turn.pinned
        turn.logits = None

    def _turn_response(self, turn: ChatTurn, piece: bytes) -> Any:
        conv = self._conversations.get(turn.slot) if turn.finish else None
        return self._respond(
            self._response(
                piece,
                turn.finish,
                len(turn.reply_ids),
                turn.prompt_tokens,
                self.cache.lengths[turn.slot],
                turn.dropped,
                digest=EMPTY if conv is None else conv.digest,
            )
        )

    def _response(
        self, piece: bytes, finish: Finish, tokens: int, prompt: int, context: int, dropped: int, *, digest: str = EMPTY
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
        )


class _TurnRefused(ValueError):
    pass


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


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


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
