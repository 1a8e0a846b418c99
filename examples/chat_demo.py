"""A scripted chat against the `chat` model, each turn timed next to what a stateless chat server gives.

Run it with ``python examples/chat_demo.py [--url grpc://...]`` (no URL: it starts the embedded server);
``examples/quickstart.py`` runs it too, as part of the main job. The model is the project's tiny demo
GPT-2 (trained in minutes on Jane Austen): its replies read as English-like text, not as answers.

For every turn it prints the reply as it streams, then two rows:
- **kept**: `client.chat()`, the conversation's KV cache kept on the server, so a turn sends and prefills
  only its new message;
- **resent**: the same turn sent to `chat_stateless` (same weights, keeps nothing) with the whole history,
  as chat over Triton is served today: the server prefills everything again, every turn.
Both get the same messages and seed and give the same reply; the demo checks it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time

import numpy as np

from triton_npu_client import ChatMessage, Client, LocalTriton, Model

SYSTEM = "You are Miss Emma Woodhouse of Hartfield, talking with a friend."
TURNS = [
    "Good morning! Where are you going today?",
    "What did your father say about the weather?",
    "Shall we walk to Highbury after breakfast?",
    "Who is coming to dinner on Thursday?",
    "Have you had a letter from your sister?",
]
MAX_TOKENS = 40
# Sampled, with a seed per turn: greedy decoding makes a model this small repeat itself ("I am sure, I am
# sure..."). The same seed gives the same reply, so both ways of serving the turn can still be compared.
TEMPERATURE, TOP_P = 0.8, 0.9


async def resend(twin: Model, history: list[ChatMessage], seed: int) -> tuple[str, float, int]:
    """One turn on the stateless twin with the whole history: (reply, time to first piece, tokens prefilled)."""
    inputs = {
        "ROLE": np.array([m.role.encode() for m in history], dtype=np.object_),
        "TEXT": np.array([m.text.encode() for m in history], dtype=np.object_),
        "MAX_TOKENS": np.array([MAX_TOKENS], np.int32),
        "TEMPERATURE": np.array([TEMPERATURE], np.float32),
        "TOP_P": np.array([TOP_P], np.float32),
        "SEED": np.array([seed], np.int64),
    }
    start = time.perf_counter()
    first: float | None = None
    reply = b""
    prompt = 0
    async for result in twin.stream(inputs):
        piece = bytes(result["PIECE"][0, 0])
        if piece and first is None:
            first = time.perf_counter() - start
        reply += piece
        if "PROMPT_TOKENS" in result.outputs:
            prompt = int(result["PROMPT_TOKENS"][0, 0])
    return reply.decode("utf-8", errors="replace"), first or 0.0, prompt


async def run_demo(client: Client, *, turns: int = len(TURNS)) -> None:
    """The scripted conversation on ``client`` (a gRPC client on a server with `chat` and `chat_stateless`)."""
    twin = await client.model("chat_stateless")
    print(
        f"\nA chat with the demo model ({turns} turns, temperature {TEMPERATURE}, top_p {TOP_P}, a seed per turn, "
        f"up to {MAX_TOKENS} tokens a reply)"
    )
    print(f"system: {SYSTEM}")
    rows = []
    async with client.chat(
        "chat", system=SYSTEM, max_tokens=MAX_TOKENS, temperature=TEMPERATURE, top_p=TOP_P
    ) as chat:
        for seed, text in enumerate(TURNS[:turns], start=1):
            print(f"\nuser: {text}\nmodel: ", end="", flush=True)
            async for piece in chat.send(text, seed=seed):
                print(piece, end="", flush=True)
            print()
            reply = chat.last_reply
            assert reply is not None
            # The same turn the stateless way: everything the conversation holds, sent and prefilled again.
            history = [*chat.messages[:-1]]
            again, resent_ttft, resent_prompt = await resend(twin, history, seed)
            if again != reply.text:
                raise SystemExit(f"the stateless twin replied differently: {again!r} != {reply.text!r}")
            kept_ttft = reply.time_to_first_token_s or 0.0
            print(
                f"  kept:   {kept_ttft * 1e3:6.1f} ms to first token, {reply.prompt_tokens:4d} tokens prefilled, "
                f"{reply.tokens_per_s:5.0f} tokens/s, {reply.context_tokens} tokens held on the server"
            )
            print(
                f"  resent: {resent_ttft * 1e3:6.1f} ms to first token, {resent_prompt:4d} tokens prefilled "
                f"(whole history, every turn)"
            )
            rows.append((kept_ttft, resent_ttft))
    last_kept, last_resent = rows[-1]
    print(
        f"\nTurn {len(rows)}: the first token came {last_resent / max(last_kept, 1e-9):.1f}x sooner with the history "
        "kept on the server."
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="grpc://host:port of a running server (default: start one)")
    parser.add_argument("--turns", type=int, default=len(TURNS))
    args = parser.parse_args()
    async with contextlib.AsyncExitStack() as stack:
        url = args.url
        if url is None:
            server = await stack.enter_async_context(LocalTriton())
            url = server.grpc_url
        client = await stack.enter_async_context(Client(url, timeout_s=120))
        await run_demo(client, turns=args.turns)


if __name__ == "__main__":
    asyncio.run(main())
