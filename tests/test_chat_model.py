"""The `chat` server model (and its stateless twin) inside a real Triton, through the SDK's sequence sessions.

These check the server's promises with the project's demo weights: the KV cache is exact across turns,
batched decoding equals decoding alone, a cancelled turn stops on the server and is rolled back, context
overflow drops the oldest turns, a second concurrent turn is refused, and END and the idle sweep free the
cache, as the model itself reports it (KV_BYTES, LIVE). The client's chat API is tested in test_chat_client.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from triton_npu_client import (
    Client,
    InvalidArgumentError,
    LocalTriton,
    Model,
    SequenceBusyError,
    SequenceCapacityError,
    SequenceIdleWarning,
    SequenceLost,
    SequenceSession,
)
from triton_npu_client._model import build_request

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
    pieces: list[bytes] = field(default_factory=list)


def inputs(*messages: tuple[str, str], **options: int | float | list[str]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    if messages:
        out["ROLE"] = np.array([r.encode() for r, _ in messages], dtype=np.object_)
        out["TEXT"] = np.array([t.encode() for _, t in messages], dtype=np.object_)
    for name, value in options.items():
        key = name.upper()
        if key == "STOP":
            assert isinstance(value, list)
            out[key] = np.array([s.encode() for s in value], dtype=np.object_)
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
    # Turn 3 prefilled only its new tokens; the fresh conversation prefilled the whole history.
    assert replies[2].prompt < again.prompt / 2


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


async def test_a_second_concurrent_turn_is_refused_and_never_interleaved(chat: Model) -> None:
    """A turn sent while the conversation's previous one streams is refused; the first goes on unchanged."""
    options = {"max_tokens": 400, "min_tokens": 400}
    async with chat.sequence() as seq:
        await turn(seq, ("system", SYSTEM), ("user", QUESTIONS[0]), max_tokens=8)
        first = Turn()
        refused: BaseException | None = None
        async with contextlib.aclosing(seq.stream(inputs(("user", QUESTIONS[1]), **options))) as responses:
            async for result in responses:
                record(first, result)
                if first.responses == 1:
                    # Straight through the caller, on the same sequence id, without START: what a second client
                    # holding this id (or a buggy one) would send.
                    second = chat.caller.call(
                        build_request(chat.spec, inputs(("user", QUESTIONS[2]), max_tokens=4), None),
                        timeout_s=60, route="own", many=True, sequence_id=seq.sequence_id,
                    )
                    try:
                        async for _ in second:
                            pass
                    except SequenceBusyError as err:
                        refused = err
                    finally:
                        await second.aclose()
        assert isinstance(refused, SequenceBusyError), refused
        assert re.search(r"sequence \d+ is busy", str(refused))
        assert (first.finish, first.tokens) == ("length", 400)
    async with chat.sequence() as ref:
        await turn(ref, ("system", SYSTEM), ("user", QUESTIONS[0]), max_tokens=8)
        want = await turn(ref, ("user", QUESTIONS[1]), **options)
    assert first.reply == want.reply


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
            with pytest.raises(SequenceCapacityError, match=r"cap of 2 live sequences \(parameters max_sequences=2 and "
                               r"max_cache_mb=1024"):
                await turn(third, ("user", QUESTIONS[0]), max_tokens=2)
