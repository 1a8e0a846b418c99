"""Serve your own checkpoint: a chat model generated from a Hugging Face folder, then a three-turn chat with it.

    python examples/chat_checkpoint.py                      # a tiny random Llama, written here
    python examples/chat_checkpoint.py --family qwen2       # ... or a tiny random Qwen2 / Mistral
    python examples/chat_checkpoint.py --checkpoint DIR     # your own folder instead

Without ``--checkpoint`` it first writes a tiny random Llama-family checkpoint (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with the family's chat template, generation_config.json) with the test
helpers (tests/_checkpoints.py), so it runs without any download. **Its weights are random: the replies are
gibberish**, real text in the family's tokens but meaning nothing; the point is the path, not the words.

Then ``write_chat_model`` generates the model repository entry from the folder (the packaged chat model's config
with the checkpoint's path, context length, dtype and device), ``LocalTriton`` serves it, and ``Client.chat``
holds a three-turn conversation whose history stays on the server. The same in one command:
``triton-npu chat --checkpoint DIR`` (interactive) or ``triton-npu serve --chat DIR`` (serve it).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

from triton_npu_client import Client, LocalTriton, write_chat_model

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ("Hello! Who are you?", "What can you do?", "Thank you, goodbye.")


def tiny_checkpoint(folder: Path, family: str) -> Path:
    """A tiny random ``family`` checkpoint written into ``folder`` by the test helpers (no download)."""
    sys.path.insert(0, str(ROOT))  # the helpers live in the source checkout's tests/
    from tests._checkpoints import write_tiny_llama

    return write_tiny_llama(folder, family=family)


async def chat(checkpoint: Path, repository: Path, max_tokens: int) -> None:
    name = write_chat_model(repository, checkpoint, name="my_chat", max_ctx=512)
    print(f"generated {repository / name}/config.pbtxt and 1/model.py for {checkpoint}")
    # The generated config is complete: Triton's auto-complete pass would only start one more stub.
    async with LocalTriton(repository, auto_complete_config=False) as server:
        print(f"serving model {name!r} at {server.grpc_url}")
        async with Client(server.grpc_url, timeout_s=120) as client, client.chat(
            name, system="You are a helpful assistant.", max_tokens=max_tokens
        ) as conversation:
            for question in QUESTIONS:
                reply = await conversation.ask(question)
                print(f"user:      {question}")
                print(f"assistant: {reply.text!r}")
                print(
                    f"           [{reply.prompt_tokens} prompt tokens prefilled, {reply.tokens} generated, "
                    f"{conversation.context_tokens} kept on the server; finished: {reply.finish_reason}]"
                )
    print("server stopped")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=None, help="a checkpoint folder (default: a tiny one)")
    parser.add_argument("--family", choices=("llama", "qwen2", "mistral"), default="llama")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="chat-checkpoint-") as folder:
        checkpoint = args.checkpoint
        if checkpoint is None:
            checkpoint = tiny_checkpoint(Path(folder) / f"tiny-{args.family}", args.family)
            print(f"wrote a tiny random {args.family} checkpoint (random weights: its replies are gibberish)")
        asyncio.run(chat(checkpoint, Path(folder) / "models", args.max_tokens))


if __name__ == "__main__":
    main()
