"""Chat benchmarks: what keeping each conversation's KV cache on the server buys, measured side by side.

Run from the repository root (starts its own server on server_models/ unless --url is given)::

    .venv/bin/python bench/chat.py [--repeats 3] [--tokens 64] [--chats 32] [--turns 10]

Three measurements, each the median of ``--repeats`` rounds, contenders alternating within a round:

1. **Per-token decode latency vs history length.** One conversation holds 16 tokens of history, another
   about 1,024; each then generates ``--tokens`` tokens (MIN_TOKENS = MAX_TOKENS, so both run the same
   number of steps). Per-token latency is the time between the first and the last piece over the
   steps between them, seen by the client. Goal: 1,024 costs at most 1.3x 16.
2. **Aggregate decode throughput.** ``--chats`` conversations generate ``--tokens`` tokens each at the
   same time, against one conversation alone; tokens/s counts every generated token over the wall time
   of the turn. Goal: at least 8x.
3. **Time to first token at turn ``--turns``.** A conversation on `chat` (history on the server: each
   turn sends only its new message) against a client that resends the whole history every turn to
   `chat_stateless` (the same model and weights, keeping nothing). Both see the same messages and the
   same replies; the time to the first piece of the last turn is compared. Goal: at least 5x faster.

Prints the tables, the ratios against their goals, and how it was run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import platform
import statistics
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import attrs
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from triton_npu_client import Client, LocalTriton, Model

PARAGRAPH = (
    "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition, seemed to "
    "unite some of the best blessings of existence; and had lived nearly twenty-one years in the world with "
    "very little to distress or vex her. "
)
CHECKPOINT = Path(__file__).resolve().parents[1] / "server_models" / "chat" / "demo_gpt2"
QUESTIONS = [
    "Where are you going this morning?",
    "What did your sister say about the letter?",
    "Shall we walk to the village after breakfast?",
    "Who is coming to dinner on Thursday?",
    "Have you read the new novel from London?",
    "Why was Mr. Knightley so grave yesterday?",
    "Do you think it will rain before the evening?",
    "What will you wear to the ball?",
    "How long will your cousin stay with us?",
    "Is it true that the Westons are to be married?",
    "What news from the vicarage?",
    "Can you play the pianoforte?",
]


@attrs.frozen
class TurnStats:
    tokens: int
    ttft_s: float
    total_s: float
    first_to_last_s: float
    pieces: int
    context: int
    reply: str


def messages(*pairs: tuple[str, str]) -> dict[str, np.ndarray]:
    return {
        "ROLE": np.array([r.encode() for r, _ in pairs], dtype=np.object_),
        "TEXT": np.array([t.encode() for _, t in pairs], dtype=np.object_),
    }


def fixed(tokens: int) -> dict[str, np.ndarray]:
    """Exactly ``tokens`` tokens: the reply may neither stop early nor run on."""
    return {"MAX_TOKENS": np.array([tokens], np.int32), "MIN_TOKENS": np.array([tokens], np.int32)}


async def timed(responses: AsyncIterator[object]) -> TurnStats:
    start = time.perf_counter()
    first = last = None
    pieces = 0
    reply = b""
    result = None
    async for result in responses:
        now = time.perf_counter()
        piece = bytes(result["PIECE"][0, 0])  # type: ignore[index]
        if piece:
            first = now if first is None else first
            last = now
            pieces += 1
            reply += piece
    assert result is not None, "no response"
    assert first is not None and last is not None, "no text"  # noqa: PT018
    return TurnStats(
        tokens=int(result["TOKENS"][0, 0]),  # type: ignore[index]
        ttft_s=first - start,
        total_s=time.perf_counter() - start,
        first_to_last_s=last - first,
        pieces=pieces,
        context=int(result["CONTEXT_TOKENS"][0, 0]),  # type: ignore[index]
        reply=reply.decode("utf-8", errors="replace"),
    )


def text_of_tokens(n: int) -> str:
    """Text that the demo tokenizer encodes to about ``n`` tokens (cut at ``n`` ids, decoded)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(CHECKPOINT / "tokenizer.json"))
    ids = tok.encode(PARAGRAPH * (1 + n // 20), add_special_tokens=False).ids[:n]
    return str(tok.decode(ids))


async def per_token_latency(chat: Model, history_tokens: int, tokens: int) -> tuple[float, int]:
    """(seconds per decode step, history length) for one conversation with about ``history_tokens`` of history."""
    async with chat.sequence() as seq:
        # The first turn's framing (<|user|> ... <|end|> <|assistant|>, one reply token) adds 4 positions.
        opening = await timed(seq.stream({**messages(("user", text_of_tokens(history_tokens - 4))), **fixed(1)}))
        turn = await timed(seq.stream({**messages(("user", "Go on.")), **fixed(tokens)}))
        return turn.first_to_last_s / max(turn.pieces - 1, 1), opening.context


async def aggregate(chat: Model, chats: int, tokens: int) -> float:
    """Tokens/s of ``chats`` conversations generating ``tokens`` tokens each at once (opened beforehand)."""
    sessions = [chat.sequence() for _ in range(chats)]
    try:
        for i, seq in enumerate(sessions):
            await timed(seq.stream({**messages(("user", QUESTIONS[i % len(QUESTIONS)])), **fixed(1)}))
        start = time.perf_counter()
        turns = await asyncio.gather(
            *(timed(seq.stream({**messages(("user", "Go on.")), **fixed(tokens)})) for seq in sessions)
        )
        wall = time.perf_counter() - start
        return sum(t.tokens for t in turns) / wall
    finally:
        for seq in sessions:
            await seq.aclose()


async def ttft_at_turn(chat: Model, twin: Model, turns: int, tokens: int) -> tuple[float, float, int]:
    """(TTFT of the last turn with the history on the server, TTFT resending it to the twin, history tokens)."""
    system = ("system", "You are Emma Woodhouse, answering a friend at Hartfield.")
    history: list[tuple[str, str]] = [system]
    kept_ttft = resent_ttft = 0.0
    context = 0
    async with chat.sequence() as seq:
        for i in range(turns):
            question = ("user", QUESTIONS[i % len(QUESTIONS)])
            new = [system, question] if i == 0 else [question]
            kept = await timed(seq.stream({**messages(*new), **fixed(tokens)}))
            history.append(question)
            if i == turns - 1:
                # The same last turn, history resent in full to the stateless twin.
                resent = await timed(twin.stream({**messages(*history), **fixed(tokens)}))
                kept_ttft, resent_ttft, context = kept.ttft_s, resent.ttft_s, kept.context
            history.append(("assistant", kept.reply))
    return kept_ttft, resent_ttft, context


def in_process(tokens: int, chats: int) -> dict[str, float]:
    """The engine alone (no Triton, no gRPC, no client), one torch thread as the server's instance uses.

    Returns ms per pass for 1 and ``chats`` conversations, and ms per one-row forward at 16 and 1,024 positions:
    the floor the server-side numbers above stand on.
    """
    import torch

    from triton_npu_client.server import (
        ChatEngine,
        ChatTokenizer,
        KVCache,
        SequenceSlots,
        StepLoop,
        gpt2_forward,
        load_gpt2,
    )

    torch.set_num_threads(1)
    model = load_gpt2(CHECKPOINT)
    tokenizer = ChatTokenizer(CHECKPOINT)

    class Sender:
        done = False

        def send(self, response: object = None, flags: int = 0) -> None:
            self.done = self.done or bool(flags & 1)

        def is_cancelled(self) -> bool:
            return False

    out: dict[str, float] = {}
    for rows in (1, chats):
        cache = KVCache.allocate(model, slots=rows, max_ctx=1280)
        engine = ChatEngine(
            model, tokenizer, cache, SequenceSlots(capacity=rows, idle_timeout_s=600),
            respond=lambda r: r, refuse=lambda kind, message: (kind, message),
        )
        loop: StepLoop[object] = StepLoop(
            step=engine.step, admit=engine.admit, on_exit=engine.on_exit, final_flag=1,  # type: ignore[arg-type]
            error_response=lambda m: m, start=False,
        )
        senders = [Sender() for _ in range(rows)]
        for key, sender in enumerate(senders, start=1):
            turn = engine.parse(start=True, end=False, roles=["user"], texts=[QUESTIONS[key % len(QUESTIONS)]],
                                max_tokens=tokens, min_tokens=tokens)
            loop.submit(key, sender, turn)
        loop.run_pass()  # admission (prefill) and the first token
        start, passes = time.perf_counter(), 0
        while not all(s.done for s in senders):
            loop.run_pass()
            passes += 1
        out[f"pass_{rows}"] = (time.perf_counter() - start) / passes * 1e3
    for history in (16, 1024):
        cache = KVCache.allocate(model, slots=1, max_ctx=1280)
        gpt2_forward(model, cache, [0], torch.randint(0, 4000, (1, history)))
        token = torch.tensor([[5]])
        start = time.perf_counter()
        for _ in range(100):
            gpt2_forward(model, cache, [0], token)
            cache.lengths[0] -= 1  # the same position again: the history stays this long
        out[f"forward_{history}"] = (time.perf_counter() - start) / 100 * 1e3
    return out


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


async def main(args: argparse.Namespace) -> int:
    async with contextlib.AsyncExitStack() as stack:
        url = args.url
        if url is None:
            server = await stack.enter_async_context(LocalTriton())
            url = server.grpc_url
        client = await stack.enter_async_context(Client(url, timeout_s=300))
        chat, twin = await client.model("chat"), await client.model("chat_stateless")
        # Warm up both models (first calls pay lazy initialisation).
        await per_token_latency(chat, 16, 8)
        await ttft_at_turn(chat, twin, 2, 8)

        short: list[float] = []
        long: list[float] = []
        lengths = {16: 0, 1024: 0}
        one: list[float] = []
        many: list[float] = []
        kept: list[float] = []
        resent: list[float] = []
        history = 0
        for _ in range(args.repeats):
            s, lengths[16] = await per_token_latency(chat, 16, args.tokens)
            lo, lengths[1024] = await per_token_latency(chat, 1024, args.tokens)
            short.append(s)
            long.append(lo)
            one.append(await aggregate(chat, 1, args.tokens))
            many.append(await aggregate(chat, args.chats, args.tokens))
            k, r, history = await ttft_at_turn(chat, twin, args.turns, args.tokens)
            kept.append(k)
            resent.append(r)

    med = statistics.median
    print("## Per-token decode latency vs history (one conversation, client-side time between pieces)\n")
    print("| history tokens | ms per token (median) | rounds |")
    print("|---|---|---|")
    print(f"| {lengths[16]} | {med(short) * 1e3:.2f} | {', '.join(f'{x * 1e3:.2f}' for x in short)} |")
    print(f"| {lengths[1024]} | {med(long) * 1e3:.2f} | {', '.join(f'{x * 1e3:.2f}' for x in long)} |")
    lat = ratio(med(long), med(short))
    verdict = "met" if lat <= 1.3 else "NOT met"
    print(f"\nratio {lengths[1024]} vs {lengths[16]}: **{lat:.2f}x** (goal <= 1.3x: {verdict})\n")

    print(f"## Aggregate decode throughput ({args.tokens} tokens per conversation)\n")
    print("| conversations at once | tokens/s (median) | rounds |")
    print("|---|---|---|")
    print(f"| 1 | {med(one):.0f} | {', '.join(f'{x:.0f}' for x in one)} |")
    print(f"| {args.chats} | {med(many):.0f} | {', '.join(f'{x:.0f}' for x in many)} |")
    agg = ratio(med(many), med(one))
    print(f"\nratio {args.chats} vs 1: **{agg:.1f}x** (goal >= 8x: {'met' if agg >= 8 else 'NOT met'})\n")

    print(f"## Time to first token at turn {args.turns} ({history} tokens of history, {args.tokens}-token replies)\n")
    print("| client | TTFT ms (median) | rounds |")
    print("|---|---|---|")
    kept_rounds = ", ".join(f"{x * 1e3:.1f}" for x in kept)
    print(f"| history kept on the server (`chat`) | {med(kept) * 1e3:.1f} | {kept_rounds} |")
    print(
        f"| history resent every turn (`chat_stateless`) | {med(resent) * 1e3:.1f} | "
        f"{', '.join(f'{x * 1e3:.1f}' for x in resent)} |"
    )
    speed = ratio(med(resent), med(kept))
    print(f"\nkept vs resent: **{speed:.1f}x faster** (goal >= 5x: {'met' if speed >= 5 else 'NOT met'})\n")
    if not args.no_in_process:
        alone = in_process(args.tokens, args.chats)
        print("## The engine alone, in process (no Triton, gRPC or client; one torch thread)\n")
        print("| measurement | ms | ratio |")
        print("|---|---|---|")
        print(f"| one-row forward, 16 positions of history | {alone['forward_16']:.2f} | |")
        print(
            f"| one-row forward, 1,024 positions of history | {alone['forward_1024']:.2f} | "
            f"{ratio(alone['forward_1024'], alone['forward_16']):.2f}x |"
        )
        print(f"| pass (sample + decode), 1 conversation | {alone['pass_1']:.2f} | |")
        per_token = ratio(alone["pass_1"] * args.chats, alone[f"pass_{args.chats}"])
        print(
            f"| pass (sample + decode), {args.chats} conversations | {alone[f'pass_{args.chats}']:.2f} | "
            f"{per_token:.1f}x the tokens/s of one |\n"
        )
    print(
        f"Run: `{' '.join(['.venv/bin/python', 'bench/chat.py', *sys.argv[1:]])}` on {platform.node()} "
        f"({platform.processor() or platform.machine()}), Python {platform.python_version()}, "
        f"{args.repeats} rounds, medians."
    )
    return 0


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server (default: start one on server_models/)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64, help="tokens each measured turn generates")
    p.add_argument("--chats", type=int, default=32)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--no-in-process", action="store_true", help="skip the engine-alone table")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse())))
