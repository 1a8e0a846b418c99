"""Several chats at once on the `chat` model, each a few turns long; tokens per second per chat and in all.

    python examples/chat_concurrent.py --chats 8 --turns 3
    python examples/chat_concurrent.py --url grpc://127.0.0.1:8001 --chats 32

Without ``--url`` it starts an embedded ``tritonserver`` serving only the packaged ``chat`` model. Every chat
keeps its history on the server (each turn sends only the new user message); the server decodes the turns
of all chats that are generating together, one batched forward pass per token. Exit status 0 means every
turn of every chat completed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import sys
import tempfile
import time
from pathlib import Path

import attrs

from triton_npu_client import ChatReply, Client, LocalTriton, default_model_repository

MODEL = "chat"
QUESTIONS = (
    "Good morning! How are you today?",
    "What do you think of the weather?",
    "Shall we take a walk in the garden?",
    "Who is coming to dinner tonight?",
    "What news from town?",
    "Tell me about your family.",
)


@attrs.frozen
class ChatRun:
    """One chat's turns: its replies and the wall time it took."""

    replies: tuple[ChatReply, ...]
    elapsed_s: float

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.replies)


async def one_chat(client: Client, k: int, turns: int, max_tokens: int, temperature: float) -> ChatRun:
    started = time.perf_counter()
    replies = []
    # A seed per chat: the chats sample different replies, and a rerun samples the same ones.
    async with client.chat(
        MODEL, system="You are a polite companion.", max_tokens=max_tokens, temperature=temperature, seed=k
    ) as chat:
        for turn in range(turns):
            replies.append(await chat.ask(QUESTIONS[(k + turn) % len(QUESTIONS)]))
    return ChatRun(tuple(replies), time.perf_counter() - started)


async def run(url: str | None, chats: int, turns: int, max_tokens: int, temperature: float) -> int:
    async with contextlib.AsyncExitStack() as stack:
        if url is None:
            repository = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="chat-concurrent-")))
            shutil.copytree(default_model_repository() / MODEL, repository / MODEL)
            server = await stack.enter_async_context(LocalTriton(repository))
            url = server.grpc_url
        client = await stack.enter_async_context(Client(url, timeout_s=300))
        await client.model(MODEL)  # fetch the config once, before the clock starts
        started = time.perf_counter()
        runs = await asyncio.gather(*(one_chat(client, k, turns, max_tokens, temperature) for k in range(chats)))
        elapsed = time.perf_counter() - started
    for k, chat in enumerate(runs):
        ttfts = [r.time_to_first_token_s for r in chat.replies if r.time_to_first_token_s is not None]
        first = f"{1000 * sum(ttfts) / len(ttfts):.0f} ms" if ttfts else "-"
        print(
            f"chat {k}: {len(chat.replies)} turns, {chat.tokens} tokens in {chat.elapsed_s:.2f} s, "
            f"{chat.tokens / chat.elapsed_s:.1f} tokens/s, mean time to first token {first}"
        )
    total = sum(chat.tokens for chat in runs)
    done = sum(len(chat.replies) for chat in runs)
    print(
        f"all: {chats} chats, {done}/{chats * turns} turns, {total} tokens in {elapsed:.2f} s, "
        f"{total / elapsed:.1f} tokens/s aggregate"
    )
    return 0 if done == chats * turns else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--url", default=None, help="grpc://HOST:PORT serving the chat model (default: embedded)")
    parser.add_argument("--chats", type=int, default=8, help="chats at once (default 8)")
    parser.add_argument("--turns", type=int, default=3, help="turns per chat (default 3)")
    parser.add_argument("--max-tokens", type=int, default=48, help="most tokens per reply (default 48)")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (default 0.8)")
    args = parser.parse_args()
    return asyncio.run(run(args.url, args.chats, args.turns, args.max_tokens, args.temperature))


if __name__ == "__main__":
    sys.exit(main())
