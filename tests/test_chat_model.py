"""The `chat` server model (and its stateless twin) inside a real Triton, through the SDK's sequence sessions.

These check the server's promises with the project's demo weights: the KV cache is exact across turns,
batched decoding equals decoding alone, a cancelled turn stops on the server and is rolled back, context
overflow drops the oldest turns, a second concurrent turn supersedes the first, and END and the idle sweep free
the cache, as the model itself reports it (KV_BYTES, LIVE). Then isolation: with other conversations generating,
one that cancels and closes (or goes on) at once, sends a tiny temperature or oversized inputs harms nobody; the
history digest's three branches; eviction on ``chat_small``. The client's chat API is tested in
test_chat_client.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from triton_npu_client import (
    Call,
    Client,
    InvalidArgumentError,
    LocalTriton,
    Model,
    SequenceBusyError,
    SequenceCapacityError,
    SequenceIdleWarning,
    SequenceLost,
    SequenceSession,
    TritonError,
)
from triton_npu_client._model import build_request
from triton_npu_client._protocol import EMPTY, INVALID_INPUT, SEQUENCE_UNKNOWN, history_digest

REPO = Path(__file__).resolve().parents[1] / "server_models"
DEADLINE_S = 60.0  # a bound on waiting for an event, never a synchronisation delay


def _per_position() -> int:
    config = json.loads((REPO / "chat" / "demo_gpt2" / "config.json").read_text())
    return 2 * int(config["n_layer"]) * int(config["n_embd"]) * 4  # float32 keys and values, every layer


PER_POSITION = _per_position()


@dataclass
class Turn:
    reply: bytes = b""
    responses: int = 0
    finish: str = ""
    tokens: int = 0
    prompt: int = 0
    context: int = 0
    dropped: int = 0
    live: int = 0
    kv_bytes: int = 0
    digest: str = ""
    pieces: list[bytes] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.reply.decode("utf-8", errors="replace")


def inputs(*messages: tuple[str, str], **options: int | float | str | list[str] | list[bytes]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    if messages:
        out["ROLE"] = np.array([r.encode() for r, _ in messages], dtype=np.object_)
        out["TEXT"] = np.array([t.encode() for _, t in messages], dtype=np.object_)
    for name, value in options.items():
        key = name.upper()
        if key == "STOP":
            assert isinstance(value, list)
            out[key] = np.array([s.encode() if isinstance(s, str) else s for s in value], dtype=np.object_)
        elif key == "DIGEST":
            assert isinstance(value, str)
            out[key] = np.array([value.encode()], dtype=np.object_)
        elif key in ("TEMPERATURE", "TOP_P"):
            out[key] = np.array([value], np.float32)
        elif key == "SEED":
            out[key] = np.array([value], np.int64)
        else:
            out[key] = np.array([value], np.int32)
    return out


def record(turn: Turn, result: object) -> None:
    r = result  # an InferResult
    piece = bytes(r["PIECE"][0, 0])  # type: ignore[index]
    turn.pieces.append(piece)
    turn.reply += piece
    turn.responses += 1
    if "FINISH" not in r.outputs:  # type: ignore[attr-defined]
        return  # a response in mid-turn carries its piece alone
    turn.finish = bytes(r["FINISH"][0, 0]).decode()  # type: ignore[index]
    for name, attr in [("TOKENS", "tokens"), ("PROMPT_TOKENS", "prompt"), ("CONTEXT_TOKENS", "context"),
                       ("DROPPED", "dropped"), ("LIVE", "live"), ("KV_BYTES", "kv_bytes")]:
        setattr(turn, attr, int(r[name][0, 0]))  # type: ignore[index]
    if "DIGEST" in r.outputs:  # type: ignore[attr-defined]
        turn.digest = bytes(r["DIGEST"][0, 0]).decode()  # type: ignore[index]


async def turn(seq: SequenceSession, *messages: tuple[str, str], end: bool = False, **options: object) -> Turn:
    out = Turn()
    async for result in seq.stream(inputs(*messages, **options), end=end):  # type: ignore[arg-type]
        record(out, result)
    return out


async def probe(model: Model) -> Turn:
    """A one-turn conversation (START and END on one request): what the instance holds, including the probe."""
    async with model.sequence() as seq:
        return await turn(seq, ("user", "Hi."), end=True, max_tokens=1)


@pytest.fixture
async def chat(triton_server: LocalTriton) -> AsyncIterator[Model]:
    async with Client(triton_server.grpc_url, timeout_s=120) as client:
        yield await client.model("chat")


QUESTIONS = ["Where are you going this morning?", "What did your sister say?", "Shall we walk to the village?"]
SYSTEM = "You are a polite young lady in a country house."


async def test_turn_three_equals_the_whole_history_sent_as_a_first_turn(chat: Model) -> None:
    """The KV cache is exact: greedy turn 3 gives the same tokens as a fresh conversation sent the full history."""
    history = [("system", SYSTEM)]
    async with chat.sequence() as seq:
        replies = []
        for i, q in enumerate(QUESTIONS):
            messages = [("system", SYSTEM), ("user", q)] if i == 0 else [("user", q)]
            replies.append(await turn(seq, *messages))
            history.append(("user", q))
            history.append(("assistant", replies[-1].reply.decode("utf-8", errors="replace")))
    assert all(r.finish in ("stop", "length") and r.tokens > 0 for r in replies)
    async with chat.sequence() as fresh:
        again = await turn(fresh, *history[:-1])
    assert again.reply == replies[2].reply
    assert again.tokens == replies[2].tokens
    assert again.context == replies[2].context
    # Turn 3 prefilled only its new tokens; the fresh conversation took the first one's blocks of the same
    # history by reference (shared prefixes) and prefilled only what lies past its last full block.
    assert replies[2].prompt < again.context / 4
    assert again.prompt < again.context / 4


async def test_the_stateless_twin_gives_the_same_reply_for_the_same_history(triton_server: LocalTriton) -> None:
    """chat_stateless, sent the whole history each time, agrees token for token with chat keeping it."""
    async with Client(triton_server.grpc_url, timeout_s=120) as client:
        chat, twin = await client.model("chat"), await client.model("chat_stateless")
        history: list[tuple[str, str]] = [("system", SYSTEM)]
        async with chat.sequence() as seq:
            for i, q in enumerate(QUESTIONS[:2]):
                messages = [("system", SYSTEM), ("user", q)] if i == 0 else [("user", q)]
                kept = await turn(seq, *messages)
                history.append(("user", q))
                out = Turn()
                async for result in twin.stream(inputs(*history)):
                    record(out, result)
                assert out.reply == kept.reply
                if i:
                    assert out.prompt > kept.prompt  # the twin prefilled the whole history again
                history.append(("assistant", kept.reply.decode("utf-8", errors="replace")))


async def test_sixteen_concurrent_conversations_equal_each_alone(chat: Model) -> None:
    """16 conversations decoding together give each one's solo greedy tokens; distinct prompts never mix."""
    systems = [f"You are guest number {i}. Your name is {name}." for i, name in enumerate(
        ["Emma", "Harriet", "Jane", "Frank", "Anne", "Fanny", "Edmund", "Mary",
         "Henry", "Julia", "Maria", "Tom", "Elinor", "Marianne", "Edward", "Lucy"])]

    async def conversation(system: str) -> tuple[bytes, bytes]:
        async with chat.sequence() as seq:
            first = await turn(seq, ("system", system), ("user", "Who are you?"), max_tokens=24)
            second = await turn(seq, ("user", "And where do you live?"), max_tokens=24)
            return first.reply, second.reply

    alone = [await conversation(s) for s in systems]
    together = await asyncio.gather(*(conversation(s) for s in systems))
    assert list(together) == alone
    assert len({a for a, _ in alone}) > 1, "every conversation gave the same reply: the check above proves nothing"


async def test_cancelling_a_turn_stops_it_on_the_server_and_rolls_it_back(chat: Model) -> None:
    """Leave a long turn after 3 pieces: the server stops within a few steps; the turn leaves no trace."""
    base = await probe(chat)
    async with chat.sequence() as seq:
        first = await turn(seq, ("system", SYSTEM), ("user", QUESTIONS[0]), max_tokens=16)
        victim = Turn()
        async with contextlib.aclosing(
            seq.stream(inputs(("user", QUESTIONS[1]), max_tokens=1000, min_tokens=1000))
        ) as responses:
            async for result in responses:
                record(victim, result)
                if victim.responses == 3:
                    break
        # The cancelled conversation holds its first turn, the cancelled prompt and the tokens generated before
        # the server stopped. Read until two probes agree (the server is no longer adding positions).
        deadline = time.monotonic() + DEADLINE_S
        previous = None
        while True:
            now = await probe(chat)
            held = (now.kv_bytes - base.kv_bytes) // PER_POSITION
            if held == previous or time.monotonic() > deadline:
                break
            previous = held
        assert held == previous, "the cancelled turn kept generating"
        generated = held - first.context - victim.prompt
        assert victim.tokens <= generated < victim.tokens + 200, f"{generated} tokens generated, {victim.tokens} read"
        after = await turn(seq, ("user", QUESTIONS[2]), max_tokens=16)
    async with chat.sequence() as ref:
        await turn(ref, ("system", SYSTEM), ("user", QUESTIONS[0]), max_tokens=16)
        want = await turn(ref, ("user", QUESTIONS[2]), max_tokens=16)
    assert after.reply == want.reply
    assert after.context == want.context


async def test_context_overflow_drops_the_oldest_turns(chat: Model) -> None:
    """Turns past the context drop the oldest messages (the system message stays) instead of failing."""
    long_message = " ".join(["The weather was fine and the walk to the village was pleasant."] * 20)
    async with chat.sequence() as seq:
        first = await turn(seq, ("system", SYSTEM), ("user", long_message), max_tokens=8)
        contexts, dropped = [first.context], 0
        for _ in range(12):
            t = await turn(seq, ("user", long_message), max_tokens=8)
            contexts.append(t.context)
            dropped += t.dropped
            if t.dropped:
                break
        assert dropped > 0, f"context grew to {contexts} without dropping anything"
        # Room was made for the whole reply: the prompt plus MAX_TOKENS fit in the context.
        assert max(contexts) <= 1280
        assert contexts[-1] + 8 <= 1280 + 1
        # A message that cannot fit even alone is refused clearly, and the conversation goes on.
        with pytest.raises(InvalidArgumentError, match=r"context holds 1280"):
            await turn(seq, ("user", " ".join([long_message] * 6)))
        assert (await turn(seq, ("user", "Thank you."), max_tokens=4)).tokens > 0


async def test_a_second_concurrent_turn_supersedes_the_first_and_never_interleaves(chat: Model) -> None:
    """A turn sent while the conversation's previous one streams stops the first (rolled back, told it was
    superseded) and runs as if the first had never been sent."""
    options = {"max_tokens": 400, "min_tokens": 400}
    async with chat.sequence() as seq:
        await turn(seq, ("system", SYSTEM), ("user", QUESTIONS[0]), max_tokens=8)
        first = Turn()
        superseded: BaseException | None = None
        second = Turn()
        try:
            async with contextlib.aclosing(seq.stream(inputs(("user", QUESTIONS[1]), **options))) as responses:
                async for result in responses:
                    record(first, result)
                    if first.responses == 1:
                        # Straight through the caller, on the same sequence id, without START: what a second client
                        # holding this id (or a buggy one) would send.
                        call = chat.caller.call(Call(
                            request=build_request(chat.spec, inputs(("user", QUESTIONS[2]), max_tokens=16), None),
                            timeout_s=60, route="own", many=True, sequence_id=seq.sequence_id,
                        ))
                        async with contextlib.aclosing(call):
                            async for result2 in call:
                                record(second, result2)
        except SequenceBusyError as err:
            superseded = err
        assert isinstance(superseded, SequenceBusyError), superseded
        assert "superseded" in str(superseded)
        assert first.finish == ""  # it never finished
        assert second.finish in ("stop", "length")
    async with chat.sequence() as ref:
        await turn(ref, ("system", SYSTEM), ("user", QUESTIONS[0]), max_tokens=8)
        want = await turn(ref, ("user", QUESTIONS[2]), max_tokens=16)
    assert second.reply == want.reply
    assert second.context == want.context


async def test_end_frees_the_conversations_cache(chat: Model) -> None:
    """The model's own report: a live conversation holds KV bytes for its positions; END gives them back."""
    base = await probe(chat)
    async with chat.sequence() as seq:
        t = await turn(seq, ("system", SYSTEM), ("user", QUESTIONS[0]), max_tokens=8)
        during = await probe(chat)
        assert during.live == base.live + 1
        assert during.kv_bytes - base.kv_bytes == t.context * PER_POSITION
    after = await probe(chat)  # the session's END went out when the block was left
    assert (after.live, after.kv_bytes) == (base.live, base.kv_bytes)


async def test_the_idle_sweep_frees_the_cache(tmp_path: Path) -> None:
    """A conversation left idle past the timeout is swept: its cache is freed and its next turn is SequenceLost.

    The copy holds 2 conversations at most: past that, a START is refused with the cap and what sets it.
    """
    repo = tmp_path / "models"
    shutil.copytree(REPO / "chat", repo / "chat", ignore=shutil.ignore_patterns("__pycache__"))
    config = repo / "chat" / "config.pbtxt"
    text = config.read_text()
    text = text.replace("max_sequence_idle_microseconds: 600000000", "max_sequence_idle_microseconds: 1000000")
    grace = '"sweep_grace_us" value: { string_value: '
    text = text.replace(grace + '"500000" }', grace + '"1" }')
    text = text.replace('"max_sequences" value: { string_value: "64" }', '"max_sequences" value: { string_value: "2" }')
    assert "1000000" in text
    config.write_text(text)
    async with LocalTriton(repo) as server, Client(server.grpc_url, timeout_s=60) as client:
        chat = await client.model("chat")
        idle = chat.sequence()
        t = await turn(idle, ("user", QUESTIONS[0]), max_tokens=8)
        held = await probe(chat)
        assert held.live == 2
        assert held.kv_bytes >= t.context * PER_POSITION
        deadline = time.monotonic() + DEADLINE_S
        while (now := await probe(chat)).live > 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)  # waiting out a real idle timeout: polling, not synchronising
        assert now.live == 1
        assert now.kv_bytes == now.context * PER_POSITION  # only the probe's own positions
        with pytest.raises(SequenceLost), pytest.warns(SequenceIdleWarning):
            await turn(idle, ("user", QUESTIONS[1]), max_tokens=4)
        await idle.aclose()
        async with chat.sequence() as first, chat.sequence() as second, chat.sequence() as third:
            await turn(first, ("user", QUESTIONS[0]), max_tokens=2)
            await turn(second, ("user", QUESTIONS[0]), max_tokens=2)
            with pytest.raises(SequenceCapacityError, match=r"cap of 2 live sequences \(parameter max_sequences=2\)"):
                await turn(third, ("user", QUESTIONS[0]), max_tokens=2)


# --- isolation: one conversation never harms another ---------------------------------------------------------

_ids = itertools.count(int(time.time() * 1000) % 10**9 * 1000 + 1)  # sequence ids unique in the server's life


class Raw:
    """One conversation driven straight through the caller: every request exactly as the test says."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.id = next(_ids)

    def call(
        self, *messages: tuple[str, str], start: bool = False, end: bool = False, **options: object
    ) -> AsyncIterator[object]:
        return self.model.caller.call(Call(  # type: ignore[return-value]
            request=build_request(self.model.spec, inputs(*messages, **options), None),  # type: ignore[arg-type]
            timeout_s=120, route="own", many=True, sequence_id=self.id, sequence_start=start, sequence_end=end,
        ))

    async def turn(self, *messages: tuple[str, str], start: bool = False, end: bool = False, **options: object) -> Turn:
        out = Turn()
        async with contextlib.aclosing(self.call(*messages, start=start, end=end, **options)) as responses:
            async for result in responses:
                record(out, result)
        return out

    async def close(self) -> Turn:
        return await self.turn(end=True)


OTHER_NAMES = ["Emma", "Harriet", "Jane", "Frank", "Anne", "Fanny"]
OTHER_TOKENS = 300  # long enough that the others are still generating while a test does its hostile thing


def other_messages(name: str) -> list[tuple[str, str]]:
    return [("system", f"You are {name}, a guest at the house."), ("user", "Tell me about your morning walk.")]


async def stateless(twin: Model, messages: list[tuple[str, str]], **options: object) -> Turn:
    """The reply a solo conversation of ``messages`` gets: chat_stateless keeps nothing and shares no batch state."""
    out = Turn()
    async for result in twin.stream(inputs(*messages, **options)):  # type: ignore[arg-type]
        record(out, result)
    return out


_SOLO: dict[str, Turn] = {}


class Others:
    """Six conversations generating greedy turns (START and END on one request) while a test acts on its own."""

    def __init__(self, chat: Model) -> None:
        self.chat = chat
        self.first_piece = [asyncio.Event() for _ in OTHER_NAMES]
        self.tasks: list[asyncio.Task[Turn]] = []

    async def _one(self, i: int, name: str) -> Turn:
        out = Turn()
        raw = Raw(self.chat)
        call = raw.call(*other_messages(name), start=True, end=True, max_tokens=OTHER_TOKENS,
                        min_tokens=OTHER_TOKENS)
        async with contextlib.aclosing(call) as responses:
            async for result in responses:
                record(out, result)
                self.first_piece[i].set()
        return out

    async def __aenter__(self) -> Others:
        self.tasks = [asyncio.create_task(self._one(i, n)) for i, n in enumerate(OTHER_NAMES)]
        # All generating before the test acts (a task that failed at once is reported by finish()).
        waits = [asyncio.ensure_future(e.wait()) for e in self.first_piece]
        await asyncio.wait([*waits], timeout=DEADLINE_S)
        for w in waits:
            w.cancel()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def finish(self, twin: Model) -> None:
        """Every other conversation finished with exactly its solo reply."""
        got = await asyncio.gather(*self.tasks)
        for name, out in zip(OTHER_NAMES, got, strict=True):
            want = _SOLO.get(name)
            if want is None:  # the same six every time: computed once per run (chat_stateless keeps nothing)
                want = await stateless(twin, other_messages(name), max_tokens=OTHER_TOKENS, min_tokens=OTHER_TOKENS)
                _SOLO[name] = want
            assert (out.finish, out.tokens) == ("length", OTHER_TOKENS), name
            assert out.reply == want.reply, f"{name}'s reply differs from its solo reply"


@pytest.fixture
async def models(triton_server: LocalTriton) -> AsyncIterator[tuple[Model, Model]]:
    async with Client(triton_server.grpc_url, timeout_s=120) as client:
        yield await client.model("chat"), await client.model("chat_stateless")


async def drain(call: AsyncIterator[object], out: Turn) -> None:
    async for result in call:
        record(out, result)


async def read_pieces(call: AsyncIterator[object], n: int) -> Turn:
    out = Turn()
    async for result in call:
        record(out, result)
        if out.responses == n:
            break
    return out


async def test_cancel_then_close_at_once_harms_nobody_and_frees_the_slot(models: tuple[Model, Model]) -> None:
    """What `async with` does on Ctrl-C: cancel the streaming turn and send END at once, six others generating.

    Today's main: the END freed the slot while the cancelled turn was still in the batch, and every other
    conversation's turn failed (KeyError). Now the END retires the turn, answers "closed", and LIVE and KV_BYTES
    return to the baseline.
    """
    chat, twin = models
    base = await probe(chat)
    victim = Raw(chat)
    await victim.turn(("system", SYSTEM), ("user", QUESTIONS[0]), start=True, max_tokens=8)
    async with Others(chat) as others:
        call = victim.call(("user", QUESTIONS[1]), max_tokens=1000, min_tokens=1000)
        await read_pieces(call, 3)
        await call.aclose()  # type: ignore[attr-defined]
        closed = await victim.close()
        await others.finish(twin)
    assert closed.finish == "closed"
    after = await probe(chat)
    assert (after.live, after.kv_bytes) == (base.live, base.kv_bytes)


async def test_close_while_a_turn_streams_is_never_refused(models: tuple[Model, Model]) -> None:
    """An END-only request while the turn streams (not cancelled): the turn stops (superseded), the slot is freed."""
    chat, _ = models
    base = await probe(chat)
    victim = Raw(chat)
    await victim.turn(("user", QUESTIONS[0]), start=True, max_tokens=8)
    call = victim.call(("user", QUESTIONS[1]), max_tokens=1000, min_tokens=1000)
    streamed = await read_pieces(call, 2)
    closed = await victim.close()
    with pytest.raises(SequenceBusyError, match="superseded"):
        await drain(call, streamed)
    assert streamed.finish == ""
    assert closed.finish == "closed"
    after = await probe(chat)
    assert (after.live, after.kv_bytes) == (base.live, base.kv_bytes)


async def test_cancel_then_next_turn_at_once_harms_nobody(models: tuple[Model, Model]) -> None:
    """Cancel a turn and send the next at once, six others generating: the next turn's reply is that of a
    conversation that never had the cancelled turn; the others get their solo replies."""
    chat, twin = models
    victim = Raw(chat)
    first = await victim.turn(("system", SYSTEM), ("user", QUESTIONS[0]), start=True, max_tokens=8)
    async with Others(chat) as others:
        call = victim.call(("user", QUESTIONS[1]), max_tokens=1000, min_tokens=1000)
        await read_pieces(call, 3)
        await call.aclose()  # type: ignore[attr-defined]
        after = await victim.turn(("user", QUESTIONS[2]), max_tokens=16)
        await others.finish(twin)
    await victim.close()
    want = await stateless(
        twin, [("system", SYSTEM), ("user", QUESTIONS[0]), ("assistant", first.text), ("user", QUESTIONS[2])],
        max_tokens=16,
    )
    assert after.reply == want.reply


async def test_a_tiny_temperature_is_greedy_and_harms_nobody(models: tuple[Model, Model]) -> None:
    """TEMPERATURE 1e-39 is a legal positive float: today's main made the logits inf, multinomial raised and every
    turn in the batch failed. Below the 1e-5 floor it is greedy."""
    chat, twin = models
    async with Others(chat) as others:
        tiny = await Raw(chat).turn(("user", QUESTIONS[0]), start=True, end=True, max_tokens=24,
                                    temperature=1e-39)
        await others.finish(twin)
    greedy = await stateless(twin, [("user", QUESTIONS[0])], max_tokens=24)
    assert tiny.reply == greedy.reply


HOSTILE: list[tuple[dict[str, object], str]] = [
    ({"text": "x" * 10_000_000}, "TEXT[0] has 10000000 bytes; at most 65536"),
    ({"stop": ["s" * 10_000] * 200}, "STOP has 200 strings; at most 16"),
    ({"stop": ["s" * 10_000]}, "STOP[0] has 10000 bytes; at most 256"),
    ({"temperature": float("nan")}, "TEMPERATURE must be a finite number >= 0, got nan"),
    ({"top_p": float("inf")}, "TOP_P must be in (0, 1], got inf"),
    ({"max_tokens": -5}, "MAX_TOKENS must be >= 1, or 0 for no cap, got -5"),
]


async def test_hostile_inputs_are_refused_as_invalid_input_and_harm_nobody(models: tuple[Model, Model]) -> None:
    """Each refused when the request is read, with the INVALID_INPUT marker naming the input; the others never notice.

    All six are sent while the same six conversations generate (one set of others serves every case).
    """
    chat, twin = models

    async def refused(hostile: dict[str, object]) -> InvalidArgumentError:
        options = dict(hostile)
        text = str(options.pop("text", QUESTIONS[0]))
        with pytest.raises(InvalidArgumentError) as caught:
            await Raw(chat).turn(("user", text), start=True, end=True, **options)
        return caught.value

    async with Others(chat) as others:
        errors = await asyncio.gather(*(refused(hostile) for hostile, _ in HOSTILE))
        await others.finish(twin)
    for error, (_, needle) in zip(errors, HOSTILE, strict=True):
        assert INVALID_INPUT in str(error)
        assert needle in str(error)


async def test_the_history_digest_detects_and_repairs_the_one_window(models: tuple[Model, Model]) -> None:
    """DIGEST: equal proceeds; the digest before the last turn undoes it (the client never saw it end); any
    other is refused as an unknown sequence. chat_stateless answers the digest of its one turn."""
    chat, twin = models
    conv = Raw(chat)
    messages = [("system", SYSTEM), ("user", QUESTIONS[0])]
    one = await conv.turn(*messages, start=True, max_tokens=12)
    d1 = history_digest(EMPTY, messages, one.text)
    assert one.digest == d1
    two = await conv.turn(("user", QUESTIONS[1]), max_tokens=12, digest=d1)
    d2 = history_digest(d1, [("user", QUESTIONS[1])], two.text)
    assert two.digest == d2
    # The server finished turn two but the client never saw its end: it still holds d1.
    three = await conv.turn(("user", QUESTIONS[2]), max_tokens=12, digest=d1)
    want = await stateless(twin, [*messages, ("assistant", one.text), ("user", QUESTIONS[2])], max_tokens=12)
    assert three.reply == want.reply
    assert three.digest == history_digest(d1, [("user", QUESTIONS[2])], three.text)
    # d2 is a history the server no longer holds (and "0" * 32 one it never held): refused, the sequence unknown.
    for stale in (d2, "0" * 32):
        with pytest.raises(TritonError) as caught:
            await conv.turn(("user", "Hello?"), max_tokens=4, digest=stale)
        assert SEQUENCE_UNKNOWN in str(caught.value)
        assert "history differs" in str(caught.value)
    # Refused, not dropped: the conversation goes on from where both sides agree, and a close reports its digest.
    four = await conv.turn(("user", "Hello?"), max_tokens=4, digest=three.digest)
    closed = await conv.close()
    assert closed.digest == four.digest == history_digest(three.digest, [("user", "Hello?")], four.text)
    # A turn without DIGEST is not checked (older clients); the stateless twin's digest is its one turn's.
    assert want.digest == history_digest(
        EMPTY, [*messages, ("assistant", one.text), ("user", QUESTIONS[2])], want.text
    )


async def test_eviction_on_chat_small_gives_a_new_conversation_the_longest_idle_slot(
    triton_server: LocalTriton,
) -> None:
    """chat_small holds 2 conversations and evicts at once: a client holding both slots without ever ending them
    no longer blocks a new conversation; the evicted one's next turn is SequenceLost; a generating one is never
    evicted, and when both generate a START is refused with the cap."""
    async with Client(triton_server.grpc_url, timeout_s=120) as client:
        small = await client.model("chat_small")
        per = PER_POSITION
        hog_a, hog_b = Raw(small), Raw(small)
        a = await hog_a.turn(("user", QUESTIONS[0]), start=True, max_tokens=6)
        b = await hog_b.turn(("user", QUESTIONS[1]), start=True, max_tokens=6)
        assert b.live == 2
        # Never ended. A new conversation still gets a slot: the longest idle one's (a).
        async with small.sequence() as newcomer:
            c = await turn(newcomer, ("user", QUESTIONS[2]), max_tokens=6)
            assert c.live == 2
            assert c.kv_bytes == (c.context + b.context) * per  # exactly b's and c's positions
            with pytest.raises(TritonError) as caught:
                await hog_a.turn(("user", "Are you there?"), max_tokens=4)
            assert SEQUENCE_UNKNOWN in str(caught.value)
            assert "evicted" in str(caught.value)
            # b generates a long turn; c idles: the next START takes c's slot, never b's (seen before c).
            long_b = hog_b.call(("user", "Go on."), max_tokens=400, min_tokens=400)
            b_long = await read_pieces(long_b, 1)
            d_conv = Raw(small)
            d = await d_conv.turn(("user", "Good day."), start=True, max_tokens=8)
            assert d.finish in ("stop", "length")
            with pytest.raises(SequenceLost):
                await turn(newcomer, ("user", "Still there?"), max_tokens=4)
            await drain(long_b, b_long)
            assert (b_long.finish, b_long.tokens) == ("length", 400)
        # Both remaining slots generating: a START is refused with the cap, nobody evicted.
        long_b2 = hog_b.call(("user", "More."), max_tokens=1000, min_tokens=1000)
        long_d = d_conv.call(("user", "More."), max_tokens=1000, min_tokens=1000)
        await read_pieces(long_b2, 1)
        await read_pieces(long_d, 1)
        with pytest.raises(SequenceCapacityError, match="cap of 2"):
            await Raw(small).turn(("user", "Hi."), start=True, end=True, max_tokens=2)
        await long_b2.aclose()  # type: ignore[attr-defined]
        await long_d.aclose()  # type: ignore[attr-defined]
        for conv in (hog_a, hog_b, d_conv):
            assert (await conv.close()).finish == "closed"  # an END is never refused, not even for an evicted one
        alone = await Raw(small).turn(("user", "Hi."), start=True, end=True, max_tokens=2)
        assert (alone.live, alone.kv_bytes) == (1, alone.context * per)
        assert a.tokens > 0


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}]


def tool_inputs(messages: list[tuple[str, str, str]], **options: object) -> dict[str, np.ndarray]:
    """ROLE, TEXT and TOOL_META as raw tensors (what a tritonclient user sends), TOOLS and TOOL_CHOICE as one entry."""
    out = inputs(*[(r, t) for r, t, _ in messages], **{k: v for k, v in options.items() if k != "tool_choice"})  # type: ignore[arg-type]
    out["TOOL_META"] = np.array([m.encode() for _, _, m in messages], dtype=np.object_)
    out["TOOLS"] = np.array([json.dumps(TOOLS).encode()], dtype=np.object_)
    if "tool_choice" in options:
        out["TOOL_CHOICE"] = np.array([str(options["tool_choice"]).encode()], dtype=np.object_)
    return out


async def test_tools_over_the_raw_protocol_and_the_stateless_twin(triton_server: LocalTriton) -> None:
    """Raw tensors through Triton: a forced call comes back in TOOL_CALLS (no PIECE text), its result goes back as a
    tool message with TOOL_META, and chat_stateless given the whole history with its TOOL_META gives the same reply."""
    import jsonschema  # type: ignore[import-untyped]

    async with Client(triton_server.grpc_url, timeout_s=120) as client:
        chat, twin = await client.model("chat"), await client.model("chat_stateless")
        first = [("system", SYSTEM, ""), ("user", "Is it raining in Bath?", "")]
        async with chat.sequence() as seq:
            calls_raw = b""
            one = Turn()
            async for result in seq.stream(tool_inputs(first, tool_choice="required", max_tokens=200)):
                record(one, result)
                if "TOOL_CALLS" in result.outputs:
                    calls_raw = bytes(result["TOOL_CALLS"][0, 0])
            assert one.finish == "stop"
            assert one.reply == b""
            calls = json.loads(calls_raw)
            assert [c["name"] for c in calls] == ["get_weather"]
            jsonschema.validate(json.loads(calls[0]["arguments"]), TOOLS[0]["function"]["parameters"])
            result_msg = ("tool", "Rain, 12 C.", json.dumps({"tool_call_id": calls[0]["id"]}))
            two = Turn()
            async for result in seq.stream(tool_inputs([result_msg], max_tokens=12, digest=one.digest)):
                record(two, result)
            assert two.finish in ("stop", "length")
            assert 0 < two.prompt < one.prompt / 2  # the result and its framing, not the history again
        history = [*first, ("assistant", "", json.dumps({"tool_calls": calls})), result_msg]
        again = Turn()
        async for result in twin.stream(tool_inputs(history, max_tokens=12)):
            record(again, result)
        assert again.reply == two.reply
