"""The chat model's raw-client promises on a Llama-family checkpoint (a tiny random Qwen2) inside a real Triton.

test_chat_model.py checks them on the GPT-2 demo; here the same engine runs the Llama-family decoder with the
checkpoint's own chat template (ChatML) and end-of-turn ids, on the paged KV cache with shared prefixes. One
server for the module, on a temporary repository holding two entries that ``write_chat_model`` generated from
the checkpoint: ``tiny_chat`` (sequence batching: the server keeps each conversation) and its stateless twin
``tiny_chat_stateless`` (the same entry without ``sequence_batching``, as server_models/chat_stateless differs
from server_models/chat: each request carries the whole conversation, prefilled from scratch, nothing shared).

- a conversation's turn 3 equals the whole history sent to the twin (reply, tokens, context);
- 8 conversations decoding together (two groups sharing a system prompt) equal each one alone on the twin;
- a cancelled turn rolls back: the next turn equals the conversation that never had it (digest included);
- END frees every block: LIVE and KV_BYTES (read with a one-request probe) are exact while conversations share a
  system prompt's blocks (counted once) and return to their baseline once they end.

The Llama, Qwen2 and Mistral decoders themselves are checked against transformers in test_llama.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from _checkpoints import write_tiny_llama

from triton_npu_client import Client, LocalTriton, Model, SequenceSession, write_chat_model
from triton_npu_client.server import CheckpointTokenizer

CHAT, TWIN = "tiny_chat", "tiny_chat_stateless"
BLOCK = 16  # the packaged config's kv_block_size (the generated entries keep it)
SEQUENCE_BATCHING = re.compile(r"^sequence_batching \{\n.*?^\}\n", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Tiny:
    server: LocalTriton
    checkpoint: Path
    per_position: int  # KV-cache bytes of one position (float32 keys and values, every layer)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tiny]:
    folder = tmp_path_factory.mktemp("chat_llama")
    checkpoint = write_tiny_llama(folder / "tiny-qwen2", "qwen2")
    repository = folder / "repository"
    # 4 MiB: 512 blocks of 16 positions, room for every conversation here (the default would zero 1 GiB per entry).
    for name in (CHAT, TWIN):
        write_chat_model(repository, checkpoint, name=name, device="cpu", max_cache_mb=4)
    config = repository / TWIN / "config.pbtxt"
    text, removed = SEQUENCE_BATCHING.subn("", config.read_text())
    assert removed == 1, "the generated config has no single sequence_batching block to remove"
    config.write_text(text)
    raw = json.loads((checkpoint / "config.json").read_text())
    head_dim = raw["hidden_size"] // raw["num_attention_heads"]
    per_position = 2 * raw["num_hidden_layers"] * raw["num_key_value_heads"] * head_dim * 4
    # The entries are complete: no auto-complete stub per model (each one loads torch).
    server = LocalTriton(repository, stop_grace_s=0, auto_complete_config=False)
    with server:
        yield Tiny(server=server, checkpoint=checkpoint, per_position=per_position)
    assert server.processes() == [], "tritonserver or stub processes outlived the module"


@pytest.fixture
async def models(tiny: Tiny) -> AsyncIterator[tuple[Model, Model]]:
    async with Client(tiny.server.grpc_url, timeout_s=120) as client:
        yield await client.model(CHAT), await client.model(TWIN)


@dataclass
class Turn:
    reply: bytes = b""
    responses: int = 0
    finish: str = ""
    tokens: int = 0
    prompt: int = 0
    context: int = 0
    live: int = 0
    kv_bytes: int = 0
    digest: str = ""

    @property
    def text(self) -> str:
        # What the server keeps as the assistant's message: the bytes the client received, decoded the same way.
        return self.reply.decode("utf-8", errors="replace")


def inputs(*messages: tuple[str, str], **options: int) -> dict[str, npt.NDArray[Any]]:
    out = {
        "ROLE": np.array([r.encode() for r, _ in messages], dtype=np.object_),
        "TEXT": np.array([t.encode() for _, t in messages], dtype=np.object_),
    }
    for name, value in options.items():
        out[name.upper()] = np.array([value], np.int32)
    return out


def record(turn: Turn, result: object) -> None:
    r = result  # an InferResult
    turn.reply += bytes(r["PIECE"][0, 0])  # type: ignore[index]
    turn.responses += 1
    if "FINISH" not in r.outputs:  # type: ignore[attr-defined]
        return  # a response in mid-turn carries its piece alone
    turn.finish = bytes(r["FINISH"][0, 0]).decode()  # type: ignore[index]
    for name, attr in [("TOKENS", "tokens"), ("PROMPT_TOKENS", "prompt"), ("CONTEXT_TOKENS", "context"),
                       ("LIVE", "live"), ("KV_BYTES", "kv_bytes")]:  # fmt: skip
        setattr(turn, attr, int(r[name][0, 0]))  # type: ignore[index]
    turn.digest = bytes(r["DIGEST"][0, 0]).decode()  # type: ignore[index]


async def turn(seq: SequenceSession, *messages: tuple[str, str], end: bool = False, **options: int) -> Turn:
    out = Turn()
    async for result in seq.stream(inputs(*messages, **options), end=end):
        record(out, result)
    return out


async def stateless(twin: Model, *messages: tuple[str, str], **options: int) -> Turn:
    """The whole conversation in one request to the twin, which keeps nothing: the reply a conversation alone gets."""
    out = Turn()
    async for result in twin.stream(inputs(*messages, **options)):
        record(out, result)
    return out


async def probe(chat: Model) -> Turn:
    """A one-request conversation (START and END): LIVE and KV_BYTES of what the instance holds, the probe included."""
    async with chat.sequence() as seq:
        return await turn(seq, ("user", "Hi."), end=True, max_tokens=1)


SYSTEM = "You are a helpful assistant. Answer briefly and kindly, the way a quiet morning comes over the hills."
QUESTIONS = ["Where are you going?", "What is the capital of France?", "Tell me a story about a dragon."]
MAX_TOKENS = 12


async def test_turn_three_equals_the_whole_history_sent_to_the_stateless_twin(models: tuple[Model, Model]) -> None:
    """The paged cache is exact across turns: greedy turn 3 equals the twin prefilling the whole history."""
    chat, twin = models
    history = [("system", SYSTEM)]
    replies = []
    async with chat.sequence() as seq:
        for i, q in enumerate(QUESTIONS):
            messages = [("system", SYSTEM), ("user", q)] if i == 0 else [("user", q)]
            replies.append(await turn(seq, *messages, max_tokens=MAX_TOKENS))
            history += [("user", q), ("assistant", replies[-1].text)]
    assert all(r.finish in ("stop", "length") for r in replies), [r.finish for r in replies]
    assert replies[2].tokens > 0, "turn 3 generated nothing: the comparison below proves little"
    again = await stateless(twin, *history[:-1], max_tokens=MAX_TOKENS)
    assert (again.reply, again.tokens, again.context) == (replies[2].reply, replies[2].tokens, replies[2].context)
    # The twin prefilled the whole history; the conversation only what turn 3 added.
    assert again.prompt > 2 * replies[2].prompt


async def test_eight_concurrent_conversations_equal_each_alone(models: tuple[Model, Model]) -> None:
    """8 conversations, two turns each, decoding together (two groups of four share a system prompt, so batches
    read shared blocks too) give each one's replies alone on the twin; then their END frees every block."""
    chat, twin = models
    systems = [SYSTEM, "You are an old sailor who has seen every port of the sea."]
    firsts = ["Who are you?", "Where do you live?", "What did you eat today?", "Is it going to rain?"]
    plans = [(systems[i % 2], firsts[i // 2]) for i in range(8)]
    second = "And what will you do tomorrow?"
    base = await probe(chat)

    async def conversation(system: str, question: str) -> tuple[Turn, Turn]:
        async with chat.sequence() as seq:
            a = await turn(seq, ("system", system), ("user", question), max_tokens=MAX_TOKENS)
            b = await turn(seq, ("user", second), max_tokens=MAX_TOKENS)
            return a, b

    together = await asyncio.gather(*(conversation(s, q) for s, q in plans))
    after = await probe(chat)  # every session's END went out before gather returned
    assert (after.live, after.kv_bytes) == (base.live, base.kv_bytes)
    for (system, question), (a, b) in zip(plans, together, strict=True):
        alone_a = await stateless(twin, ("system", system), ("user", question), max_tokens=MAX_TOKENS)
        assert (a.reply, a.tokens, a.context) == (alone_a.reply, alone_a.tokens, alone_a.context)
        history = [("system", system), ("user", question), ("assistant", a.text), ("user", second)]
        alone_b = await stateless(twin, *history, max_tokens=MAX_TOKENS)
        assert (b.reply, b.tokens, b.context) == (alone_b.reply, alone_b.tokens, alone_b.context)
    assert len({a.reply for a, _ in together}) > 1, "every conversation gave the same reply: the check proves little"


async def test_a_cancelled_turn_rolls_back(models: tuple[Model, Model]) -> None:
    """Leave a long turn after 3 pieces; the next turn equals the conversation that never had the cancelled one."""
    chat, _ = models
    async with chat.sequence() as seq:
        first = await turn(seq, ("system", SYSTEM), ("user", QUESTIONS[0]), max_tokens=MAX_TOKENS)
        victim = Turn()
        # MIN_TOKENS: the turn cannot end by itself before it is left; STREAM_INTERVAL_MS 0: a response per token.
        request = inputs(("user", QUESTIONS[1]), max_tokens=200, min_tokens=200, stream_interval_ms=0)
        async with contextlib.aclosing(seq.stream(request)) as responses:  # type: ignore[type-var]  # a generator
            async for result in responses:
                record(victim, result)
                if victim.responses == 3:
                    break
        assert victim.finish == "", "the victim turn ended before it was cancelled"
        after = await turn(seq, ("user", QUESTIONS[2]), max_tokens=MAX_TOKENS)
    async with chat.sequence() as ref:
        again = await turn(ref, ("system", SYSTEM), ("user", QUESTIONS[0]), max_tokens=MAX_TOKENS)
        want = await turn(ref, ("user", QUESTIONS[2]), max_tokens=MAX_TOKENS)
    assert again.reply == first.reply
    assert (after.reply, after.tokens, after.context) == (want.reply, want.tokens, want.context)
    assert after.digest == want.digest  # the history holds neither the cancelled question nor its partial reply


async def test_end_frees_every_block_including_a_shared_system_prompt(tiny: Tiny, models: tuple[Model, Model]) -> None:
    """Two conversations with one system prompt: the second takes its full blocks by reference, KV_BYTES counts
    them once, they outlive the first conversation's END, and the second's END gives everything back."""
    chat, _ = models
    per = tiny.per_position
    tokenizer = CheckpointTokenizer(tiny.checkpoint)
    # A system prompt no other test sends: none of its blocks is cached from an earlier conversation.
    system = "You are the village schoolmaster. Answer every question with a short lesson about the river."
    prompts = [[("system", system), ("user", q)] for q in QUESTIONS[:2]]
    ids = [tokenizer.render(p, add_generation_prompt=True) for p in prompts]
    common = next(i for i, (x, y) in enumerate(zip(*ids, strict=False)) if x != y)
    shared = common // BLOCK * BLOCK
    assert shared >= 2 * BLOCK, f"the system prompt fills {shared // BLOCK} blocks: too few to test sharing"
    base = await probe(chat)
    async with chat.sequence() as first:
        a = await turn(first, *prompts[0], max_tokens=MAX_TOKENS)
        assert a.prompt == len(ids[0])
        async with chat.sequence() as second:
            b = await turn(second, *prompts[1], max_tokens=MAX_TOKENS)
            assert b.prompt == len(ids[1]) - shared  # the system prompt's full blocks were taken, not computed
            both = await probe(chat)
            assert both.live == base.live + 2
            assert both.kv_bytes - base.kv_bytes == (a.context + b.context - shared) * per
            await first.aclose()
            alone = await probe(chat)
            assert alone.live == base.live + 1
            assert alone.kv_bytes - base.kv_bytes == b.context * per  # the shared blocks stayed, now b's alone
    after = await probe(chat)
    assert (after.live, after.kv_bytes) == (base.live, base.kv_bytes)
