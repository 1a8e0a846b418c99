"""A turn's time to first token, stage by stage: from the client's send to the first piece it receives.

Run from the repository root (starts its own server; nothing else is needed)::

    .venv/bin/python bench/chat_ttft.py [--rounds 5] [--turns 10] [--tokens 16]
    .venv/bin/python bench/chat_ttft.py --quick        # a smoke run: small and fast, numbers not meaningful

One server serves two entries that ``write_chat_model`` generates, configured as the packaged `chat` (one torch
thread): the GPT-2 demo (``server_models/chat/demo_gpt2``) and bench/chat_cache.py's tiny random Llama (the demo's
shape: 4 layers of 192). Its stubs run with ``TNC_STEP_TRACE`` set, so the chat model marks each request's way
(``triton_npu_client/server/_timing.py``): when ``execute`` took it, parsed it, handed it to the step loop, when a
pass took it, admitted and prefilled it, made its first step, and sent its first response. The client notes, on the
same clock (CLOCK_MONOTONIC, one for every process of the machine), when it sent each turn and when its first piece
arrived. One conversation at a time (a person chatting): a short first turn (a system and a user message), then
turns of one question each up to ``--turns``, each reply ``--tokens`` tokens (MIN_TOKENS = MAX_TOKENS); each round
a new conversation per model, the models alternating.

The stages of the table, per model, medians over the rounds, for the first turn and for turn ``--turns``:

- **client → execute**: the client's send to Triton calling the model's ``execute`` (the client's serialisation,
  gRPC, Triton's sequence batcher, the backend's hand-over to the stub);
- **parse + template**: ``execute`` reading the request and rendering the whole conversation's template
  (``ChatEngine.parse``, on the execute thread);
- **wait for the loop**: from the hand-over to the step loop's next pass taking the turn;
- **cancel check**: the loop asking Triton whether the new request was cancelled (a round trip) before admitting it;
- **admit + prefill**: the engine's ``admit`` for the pass's new turns: the slot, a re-render if the history changed,
  the prefill forward;
- **first step**: sampling the first token, then the decode forward of the next token, before the step returns
  the first piece;
- **send queue**: the first response waiting for the send thread;
- **send() → client**: the Python backend's ``send()`` (the stub hands the response to Triton's process), Triton's
  gRPC send, the client's receipt of the first piece; beside it, how long ``send()`` itself took (the client may
  hold the piece before it returns).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from triton_npu_client import Client, LocalTriton, Model, write_chat_model
from triton_npu_client.server._timing import TRACE_ENV

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "server_models" / "chat" / "demo_gpt2"
SYSTEM = "You are Emma Woodhouse, answering a friend at Hartfield."
# The questions bench/chat.py asks (its own list: both benchmarks time the same conversations).
from chat import QUESTIONS  # noqa: E402

# (label, server mark it starts at, server mark it ends at); "send" and "first" are the client's.
STAGES = [
    ("client → execute", "send", "execute"),
    ("parse + template", "execute", "parsed"),
    ("wait for the loop", "parsed", "taken"),
    ("cancel check", "taken", "admit_start"),
    ("admit + prefill", "admit_start", "admit_end"),
    ("first step (sample + next token's forward)", "admit_end", "step_end"),
    ("send queue", "step_end", "send_start"),
    ("send() → client", "send_start", "first"),
]
NOT_PREFILL = ("client → execute", "parse + template", "wait for the loop", "cancel check", "send queue",
               "send() → client")  # fmt: skip
# Not a stage of its own: the part of "send() → client" the send thread waits in send() (Triton's process takes the
# response and answers; the client may have the piece before send() returns).
SEND_CALL = ("of which send() itself", "send_start", "send_end")


@attrs.frozen
class Turn:
    model: str
    key: int
    index: int  # 1-based turn of its conversation
    send: float  # the client's send, time.monotonic()
    first: float  # the client's receipt of the first piece
    prompt_tokens: int
    context_tokens: int


async def conversation(model: Model, name: str, turns: int, tokens: int, key: int) -> list[Turn]:
    """One conversation of ``turns`` turns on ``model``, its sequence id ``key``: each turn's client times."""
    out = []

    def inputs(pairs: list[tuple[str, str]]) -> dict[str, Any]:
        return {
            "ROLE": np.array([r.encode() for r, _ in pairs], dtype=np.object_),
            "TEXT": np.array([t.encode() for _, t in pairs], dtype=np.object_),
            "MAX_TOKENS": np.array([tokens], np.int32),
            "MIN_TOKENS": np.array([tokens], np.int32),
        }

    async with model.sequence(sequence_id=key) as seq:
        for i in range(turns):
            question = ("user", QUESTIONS[i % len(QUESTIONS)])
            sent = time.monotonic()
            first = None
            last: Any = None
            async for response in seq.stream(inputs([("system", SYSTEM), question] if i == 0 else [question])):
                if first is None and bytes(response["PIECE"][0, 0]):
                    first = time.monotonic()
                last = response
            assert first is not None and last is not None, "a turn without text"  # noqa: PT018
            prompt, held = int(last["PROMPT_TOKENS"][0, 0]), int(last["CONTEXT_TOKENS"][0, 0])
            out.append(
                Turn(
                    model=name, key=key, index=i + 1, send=sent, first=first, prompt_tokens=prompt,
                    context_tokens=held,
                )
            )
    return out


def server_marks(trace: Path) -> dict[int, list[dict[str, Any]]]:
    """The trace's request records by sequence id, in the order the instance received them."""
    found: dict[int, list[dict[str, Any]]] = {}
    for line in trace.read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "request" and isinstance(record.get("key"), int):
            found.setdefault(record["key"], []).append(record)
    for records in found.values():
        records.sort(key=lambda r: r["serial"])
    return found


def stage_times(turn: Turn, marks: dict[str, Any]) -> dict[str, float]:
    """Each stage's milliseconds for ``turn`` (its server ``marks`` beside the client's two)."""
    at = {**marks, "send": turn.send, "first": turn.first}
    stages = {label: (at[end] - at[start]) * 1e3 for label, start, end in (*STAGES, SEND_CALL)}
    stages["TTFT (client)"] = (turn.first - turn.send) * 1e3
    return stages


def llama_checkpoint(folder: Path) -> Path:
    import chat_cache  # bench/chat_cache.py: its tiny random Llama (the demo's shape)

    return Path(chat_cache.write_tiny_llama(folder, "demo"))


async def main(args: argparse.Namespace) -> int:
    med = statistics.median
    rng = random.Random(args.seed)
    turns: list[Turn] = []
    async with contextlib.AsyncExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-chat-ttft-")))
        trace = work / "trace.jsonl"
        repository = work / "repository"
        checkpoints = {"GPT-2 demo": DEMO, "tiny Llama (demo shape)": llama_checkpoint(work / "tiny_llama")}
        names = {}
        for label, folder in checkpoints.items():
            names[label] = write_chat_model(
                repository, folder, name="gpt2" if folder == DEMO else "llama", max_ctx=1280, dtype="float32",
                device="cpu", max_cache_mb=256, cpu_threads=args.cpu_threads,
            )  # fmt: skip
        server = await stack.enter_async_context(LocalTriton(repository, env={TRACE_ENV: str(trace)}))
        client = await stack.enter_async_context(Client(server.grpc_url, timeout_s=300))
        models = {label: await client.model(name) for label, name in names.items()}
        for label, model in models.items():  # warm-up: first calls pay lazy initialisation
            await conversation(model, label, 2, 4, rng.randrange(1, 2**62))
        labels = list(models)
        for r in range(args.rounds):
            for label in labels if r % 2 == 0 else labels[::-1]:
                turns += await conversation(models[label], label, args.turns, args.tokens, rng.randrange(1, 2**62))
        # Every turn has had its FINAL response, so its record is written (before the folder goes).
        marks = server_marks(trace)
    table: dict[tuple[str, int], list[dict[str, float]]] = {}
    context: dict[tuple[str, int], list[int]] = {}
    for turn in turns:
        if turn.index not in (1, args.turns):
            continue
        records = marks.get(turn.key, [])
        if len(records) < turn.index:
            raise SystemExit(f"the trace has {len(records)} requests of sequence {turn.key}, not turn {turn.index}")
        table.setdefault((turn.model, turn.index), []).append(stage_times(turn, records[turn.index - 1]))
        context.setdefault((turn.model, turn.index), []).append(turn.context_tokens)
    print(
        f"## Time to first token, stage by stage (one conversation at a time, medians of {args.rounds} "
        f"conversations per model, {args.tokens}-token replies, {args.cpu_threads} torch thread(s))\n"
    )
    for label in labels:
        first, last = table[(label, 1)], table[(label, args.turns)]
        print(
            f"### {label}: turn 1 (a system and a user message, {med(context[(label, 1)]):.0f} positions after it) "
            f"and turn {args.turns} ({med(context[(label, args.turns)]):.0f} positions)\n"
        )
        print(f"| stage | turn 1, ms | share | turn {args.turns}, ms | share |")
        print("|---|---|---|---|---|")
        total = (med(s["TTFT (client)"] for s in first), med(s["TTFT (client)"] for s in last))
        for stage, _, _ in STAGES:
            a, b = med(s[stage] for s in first), med(s[stage] for s in last)
            print(f"| {stage} | {a:.2f} | {a / total[0]:.0%} | {b:.2f} | {b / total[1]:.0%} |")
            if stage == "send() → client":
                a, b = (med(s[SEND_CALL[0]] for s in runs) for runs in (first, last))
                print(f"| ... {SEND_CALL[0]} | ({a:.2f}) | | ({b:.2f}) | |")
        outside = [med(sum(s[k] for k in NOT_PREFILL) for s in runs) for runs in (first, last)]
        print(f"| **not the engine** (the stages above but admit + prefill and first step) | {outside[0]:.2f} | "
              f"{outside[0] / total[0]:.0%} | {outside[1]:.2f} | {outside[1] / total[1]:.0%} |")  # fmt: skip
        sums = [sum(med(s[stage] for s in runs) for stage, _, _ in STAGES) for runs in (first, last)]
        # Medians do not add up: a slow turn is slow in one stage, so the TTFT's median can exceed their sum.
        print(f"| sum of the stage medians | {sums[0]:.2f} | | {sums[1]:.2f} | |")
        print(f"| TTFT as the client saw it (median) | {total[0]:.2f} | | {total[1]:.2f} | |\n")
    print(
        f"Run: `{' '.join(['.venv/bin/python', 'bench/chat_ttft.py', *sys.argv[1:]])}` on {platform.node()}, "
        f"Python {platform.python_version()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end."
    )
    return 0


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=None, help="conversations per model (default 5; --quick: 1)")
    p.add_argument(
        "--turns", type=int, default=None, help="turns per conversation, the last timed (default 10; --quick: 3)"
    )
    p.add_argument("--tokens", type=int, default=None, help="tokens per reply (default 16; --quick: 4)")
    p.add_argument("--cpu-threads", default="1", help="the entries' cpu_threads (default 1, as the packaged chat)")
    p.add_argument("--seed", type=int, default=0, help="the sequence ids' seed")
    p.add_argument("--quick", action="store_true", help="a smoke run: --rounds 1 --turns 3 --tokens 4")
    args = p.parse_args(argv)
    defaults = {"rounds": (5, 1), "turns": (10, 3), "tokens": (16, 4)}
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.cpu_threads != "auto":
        args.cpu_threads = int(args.cpu_threads)
    return args


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse())))
