"""What a chat turn costs the client, through ChatSession and through a plain sequence stream, now and before.

    .venv/bin/python bench/chat_turns.py                  # now only: ChatSession.send beside seq.stream
    .venv/bin/python bench/chat_turns.py --before REF     # and the package at git REF, in the same rounds
    .venv/bin/python bench/chat_turns.py --quick          # a smoke run: small and fast, numbers not meaningful

``--chats`` conversations on the packaged `chat` model each make one turn of exactly ``--tokens`` tokens
(MIN_TOKENS = MAX_TOKENS), all at once, one response per token. Two ways to send the same turn:

- **ChatSession.send**: the chat layer (history, options, the turn's stop by a CANCEL request when cut short:
  each response is read through a shielded task of its own on a model that has CANCEL);
- **seq.stream**: a plain sequence session's stream step with the same inputs (no chat layer).

Each contender runs in a fresh process with the package of its tree first on ``PYTHONPATH`` (``--before REF``:
extracted with ``git archive``, as bench/score.py does), starting its own server from that tree's
``server_models/``, so the model is the tree's too. Rounds alternate who goes first. Per contender, the medians
over rounds of: the client's CPU per token (all its threads; the server's processes are not counted), the time
between tokens seen by the client, and tokens/s over the wall time of the turns.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from score import before_tree, child_env  # bench/score.py (a script's own folder is sys.path[0])

CHILD = """
import asyncio, json, sys, time
import numpy as np
import triton_npu_client
from triton_npu_client import Client, LocalTriton
how, chats, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
TEXT = "Tell me about the sea."

async def by_chat(model):
    chat = model.chat()
    try:
        start, gaps, last = time.perf_counter(), [], None
        async for _ in chat.send(TEXT, max_tokens=tokens, min_tokens=tokens):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
        return gaps
    finally:
        await chat.aclose()

async def by_stream(model):
    inputs = {"ROLE": np.array([b"user"], dtype=object), "TEXT": np.array([TEXT.encode()], dtype=object),
              "MAX_TOKENS": np.array([tokens], np.int32), "MIN_TOKENS": np.array([tokens], np.int32)}
    async with model.sequence() as seq:
        gaps, last = [], None
        async for result in seq.stream(inputs):
            if not bytes(result["PIECE"][0, 0]):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
        return gaps

async def main(url):
    async with Client(url, timeout_s=120) as client:
        model = await client.model("chat")
        turn = by_chat if how == "chat" else by_stream
        await asyncio.gather(*[turn(model) for _ in range(2)])  # warm-up: the connection and the first passes
        cpu, wall = time.process_time(), time.perf_counter()
        gaps = await asyncio.gather(*[turn(model) for _ in range(chats)])
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    made = sum(len(g) + 1 for g in gaps)
    every = sorted(x for g in gaps for x in g)
    return {"cpu_us": cpu / made * 1e6, "gap_ms": every[len(every) // 2] * 1e3, "tokens_s": made / wall,
            "tokens": made, "package": triton_npu_client.__file__}

with LocalTriton(model_control_mode="explicit", load_models=["chat"]) as server:
    print(json.dumps(asyncio.run(main(server.grpc_url))))
"""


def run_child(tree: Path | None, how: str, chats: int, tokens: int, cwd: Path) -> dict[str, Any]:
    # cwd: not the checkout, whose package `python -c` would import first whatever PYTHONPATH says.
    done = subprocess.run(
        [sys.executable, "-c", CHILD, how, str(chats), str(tokens)],
        capture_output=True, text=True, env=child_env(tree), cwd=cwd, timeout=600, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"the {how} child failed:\n{done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    expected = (tree or Path(__file__).resolve().parents[1]).resolve()
    if not Path(result["package"]).resolve().is_relative_to(expected):
        raise SystemExit(f"the child imported {result['package']}, not the package under {expected}")
    if result["tokens"] != chats * tokens:
        raise SystemExit(f"the {how} child made {result['tokens']} tokens, not {chats * tokens}")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chats", type=int, default=None, help="conversations at once (default 16; --quick: 2)")
    p.add_argument("--tokens", type=int, default=None, help="tokens each turn makes (default 64; --quick: 4)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 3; --quick: 1)")
    p.add_argument("--before", default="none", help="also measure the package at this git ref (default: none)")
    p.add_argument("--quick", action="store_true", help="a smoke run: --chats 2 --tokens 4 --rounds 1")
    ns = p.parse_args()
    chats = ns.chats or (2 if ns.quick else 16)
    tokens = ns.tokens or (4 if ns.quick else 64)
    rounds = ns.rounds or (1 if ns.quick else 3)
    with tempfile.TemporaryDirectory(prefix="tnc-chat-turns-") as folder:
        before = before_tree(ns.before, Path(folder))
        if before is not None:  # the model as it was too: LocalTriton serves the server_models/ beside its package
            root = Path(__file__).resolve().parents[1]
            archive = subprocess.run(["git", "-C", str(root), "archive", ns.before, "server_models"],
                                     capture_output=True, check=True).stdout  # fmt: skip
            subprocess.run(["tar", "-x", "-C", str(before)], input=archive, check=True)
        contenders: list[tuple[str, Path | None, str]] = [("now", None, "chat"), ("now", None, "stream")]
        if before is not None:
            contenders += [(f"before ({ns.before})", before, "chat"), (f"before ({ns.before})", before, "stream")]
        got: dict[tuple[str, str], list[dict[str, Any]]] = {(c, h): [] for c, _, h in contenders}
        for r in range(rounds):
            order = contenders[r % len(contenders):] + contenders[: r % len(contenders)]
            for code, tree, how in order:
                got[(code, how)].append(run_child(tree, how, chats, tokens, Path(folder)))
                print(f"  round {r + 1}: {code}, {how}: {got[(code, how)][-1]['cpu_us']:.0f} us CPU a token",
                      flush=True)  # fmt: skip
    print(f"\n## A chat turn's cost to the client: {chats} conversations x {tokens} tokens, a response per token "
          f"(medians of {rounds} rounds, order rotating)\n")  # fmt: skip
    print("| code | turn sent by | client CPU us / token | ms between tokens | tokens/s | rounds (CPU us / token) |")
    print("|---|---|---:|---:|---:|---|")
    names = {"chat": "ChatSession.send", "stream": "seq.stream"}
    medians: dict[tuple[str, str], float] = {}
    for (code, how), runs in got.items():
        cpu = statistics.median(r["cpu_us"] for r in runs)
        medians[(code, how)] = cpu
        gap = statistics.median(r["gap_ms"] for r in runs)
        rate = statistics.median(r["tokens_s"] for r in runs)
        each = ", ".join(f"{r['cpu_us']:.0f}" for r in runs)
        print(f"| {code} | {names[how]} | {cpu:.0f} | {gap:.2f} | {rate:,.0f} | {each} |")
    print(f"\nnow, ChatSession.send vs seq.stream, client CPU a token: "
          f"**{medians[('now', 'chat')] / medians[('now', 'stream')]:.2f}x**")  # fmt: skip
    if before is not None:
        label = f"before ({ns.before})"
        print(f"ChatSession.send now vs before, client CPU a token: "
              f"**{medians[('now', 'chat')] / medians[(label, 'chat')]:.2f}x**")  # fmt: skip
    print(f"\nRun: `.venv/bin/python bench/chat_turns.py --chats {chats} --tokens {tokens} --rounds {rounds}"
          f"{'' if before is None else ' --before ' + ns.before}`")  # fmt: skip


if __name__ == "__main__":
    main()
