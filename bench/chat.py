"""Chat benchmarks: what keeping each conversation's KV cache on the server buys, measured side by side.

Run from the repository root (starts its own server on server_models/ unless --url is given)::

    .venv/bin/python bench/chat.py [--repeats 3] [--tokens 64] [--chats 32] [--turns 10] [--interval-ms 50]
    .venv/bin/python bench/chat.py --quick        # a smoke run: small and fast, numbers not meaningful

The measurements, each the median of ``--repeats`` rounds, contenders alternating within a round:

1. **Per-token decode latency vs history length.** One conversation holds 16 tokens of history, another
   about 1,024; each then generates ``--tokens`` tokens (MIN_TOKENS = MAX_TOKENS, so both run the same
   number of steps). Per-token latency is the time between the first and the last piece over the
   steps between them, seen by the client. Goal: 1,024 costs at most 1.3x 16.
2. **End to end against the engine alone.** ``--chats`` conversations generate ``--tokens`` tokens each at
   the same time, against one conversation alone, end to end (client, gRPC, Triton, the Python stub);
   tokens/s counts every generated token over the wall time of the turn. Each twice: a response per token,
   and with the client asking for ``--interval-ms`` (STREAM_INTERVAL_MS: fewer, larger responses). Beside them,
   in the same rounds, the same engine code in this process with no Triton (its decode passes' rate). Goals:
   end to end at ``--chats`` at least 0.8x the engine alone, and at least 8x one conversation. With the engine
   alone, bench/chat_compile.py's table too: the decode pass compiled (``torch.compile``) against eager, at 1 and
   ``--chats`` rows.
   The CPU each process spends per 1,000 tokens at ``--chats`` (the Python stub, tritonserver, this client)
   says where the difference goes; it is read from /proc, for a server on this machine.
   And at ``--chats`` conversations, in the same rounds, every turn constrained by a JSON schema (``CONSTRAINT``:
   a list of at least 40 people, so no reply completes before its ``--tokens``) against the same turns
   unconstrained. Goal: at least 0.85x the tokens/s.
3. **Time to first token at turn ``--turns``.** A conversation on `chat` (history on the server: each
   turn sends only its new message) against a client that resends the whole history every turn to
   `chat_stateless` (the same model and weights, keeping nothing). Both see the same messages and the
   same replies; the time to the first piece of the last turn is compared. Goal: at least 5x faster.

Then bench/chat_cache.py's two tables (``--no-cache`` skips them): conversations held within one ``max_cache_mb``,
paged vs the slot design, and first-turn TTFT with a shared system prompt, on the GPT-2 demo and a tiny Llama.

Prints the tables, the ratios against their goals, and how it was run. Each measurement is a function
(``per_token_latency``, ``aggregate``, ``engine_alone``, ``ttft_at_turn``, ...) that ``main`` calls per round
and prints as a table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import statistics
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import peer_llamacpp  # bench/peer_llamacpp.py, for --peer (a script's own folder is sys.path[0])

from triton_npu_client import Client, LocalTriton, Model

PARAGRAPH = (
    "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition, seemed to "
    "unite some of the best blessings of existence; and had lived nearly twenty-one years in the world with "
    "very little to distress or vex her. "
)
CHECKPOINT = Path(__file__).resolve().parents[1] / "server_models" / "chat" / "demo_gpt2"
#: What the tables measured (the packaged `chat` model unless --checkpoint or --llama); set by main.
SUBJECT = "the GPT-2 demo (server_models/chat)"
MAX_CTX = 1280  # the served `chat` model's max_ctx
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


def messages(*pairs: tuple[str, str]) -> dict[str, np.ndarray[Any, Any]]:
    return {
        "ROLE": np.array([r.encode() for r, _ in pairs], dtype=np.object_),
        "TEXT": np.array([t.encode() for _, t in pairs], dtype=np.object_),
    }


def fixed(tokens: int) -> dict[str, np.ndarray[Any, Any]]:
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



#: What the constrained turns must write: a JSON list of people, at least 40 of them, so that every reply runs to its
#: MAX_TOKENS as the unconstrained ones do (a list that could close early would decode fewer rows per pass).
PEOPLE_SCHEMA: dict[str, Any] = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                              "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "minItems": 40,
}


def constraint_input(schema: dict[str, Any] | None) -> dict[str, np.ndarray[Any, Any]]:
    """CONSTRAINT for a JSON schema (None: not sent)."""
    if schema is None:
        return {}
    body = json.dumps({"type": "json_schema", "schema": schema, "strict": True})
    return {"CONSTRAINT": np.array([body.encode()], dtype=object)}


def interval_input(interval_ms: int | None) -> dict[str, np.ndarray[Any, Any]]:
    """STREAM_INTERVAL_MS when asked for (None: not sent, the model's default: a response per token)."""
    return {} if interval_ms is None else {"STREAM_INTERVAL_MS": np.array([interval_ms], np.int32)}


@attrs.frozen
class Throughput:
    tokens_per_s: float
    responses: int  # responses that carried text, all conversations together
    cpu: dict[str, float]  # CPU seconds per process over the generating turns (empty when not measured)
    tokens: int


async def aggregate(
    chat: Model,
    chats: int,
    tokens: int,
    *,
    interval_ms: int | None = None,
    procs: Processes | None = None,
    schema: dict[str, Any] | None = None,
) -> Throughput:
    """``chats`` conversations (opened beforehand) generating ``tokens`` tokens each at once, end to end.

    ``interval_ms``: the STREAM_INTERVAL_MS the client asks for. With ``procs``, the CPU each process spent
    while the turns generated. ``schema``: every measured turn constrained by it.
    """
    sessions = [chat.sequence() for _ in range(chats)]
    try:
        for i, seq in enumerate(sessions):
            await timed(seq.stream({**messages(("user", QUESTIONS[i % len(QUESTIONS)])), **fixed(1)}))
        before = procs.cpu() if procs is not None else {}
        start = time.perf_counter()
        turns = await asyncio.gather(
            *(
                timed(
                    seq.stream(
                        {
                            **messages(("user", "Go on.")), **fixed(tokens), **interval_input(interval_ms),
                            **constraint_input(schema),
                        }
                    )
                )
                for seq in sessions
            )
        )
        wall = time.perf_counter() - start
        after = procs.cpu() if procs is not None else {}
        generated = sum(t.tokens for t in turns)
        return Throughput(
            tokens_per_s=generated / wall,
            responses=sum(t.pieces for t in turns),
            cpu={k: after[k] - before[k] for k in after if k in before},
            tokens=generated,
        )
    finally:
        for seq in sessions:
            await seq.aclose()


# -- where the CPU goes: the processes of a server on this machine --------------------------------------------


_TICK = None


def _cpu_s(stat_path: Path) -> float:
    """utime + stime of a process or thread, in seconds (from its /proc stat line)."""
    global _TICK
    if _TICK is None:
        import os

        _TICK = os.sysconf("SC_CLK_TCK")
    fields = stat_path.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


class Processes:
    """The processes serving ``model`` at a local gRPC port: tritonserver, the model's Python stub, and this one.

    :meth:`cpu` reads each one's CPU seconds so far, and the stub's busiest thread (its decode loop) apart.
    """

    def __init__(self, server: int, stub: int) -> None:
        import os

        self.pids = {"stub": stub, "tritonserver": server, "client": os.getpid()}

    @classmethod
    def find(cls, grpc_url: str, model: str) -> Processes | None:
        """The server listening on ``grpc_url``'s port and its stub for ``model``; None if not on this machine."""
        port = grpc_url.rsplit(":", 1)[-1].strip("/")
        server = stub = None
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"tritonserver") and f"--grpc-port={port}".encode() in argv:
                server = int(entry.name)
        if server is None:
            return None
        needle = f"/{model}/1/model.py".encode()
        for entry in Path("/proc").iterdir():
            try:
                if not entry.name.isdigit() or needle not in (entry / "cmdline").read_bytes():
                    continue
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            if ppid == server:
                stub = int(entry.name)
        return None if stub is None else cls(server, stub)

    def cpu(self) -> dict[str, float]:
        out = {name: _cpu_s(Path(f"/proc/{pid}/stat")) for name, pid in self.pids.items()}
        for task in Path(f"/proc/{self.pids['stub']}/task").iterdir():
            with contextlib.suppress(OSError):
                out[f"stub thread {task.name}"] = _cpu_s(task / "stat")
        return out


def cpu_per_1k(runs: Sequence[Throughput]) -> dict[str, float]:
    """CPU seconds per 1,000 generated tokens, per process, over ``runs``; "stub decode thread" is the stub's
    busiest thread (its StepLoop: the decode), "stub other threads" the rest of the stub."""
    tokens = sum(r.tokens for r in runs)
    total: dict[str, float] = {}
    for run in runs:
        for name, seconds in run.cpu.items():
            total[name] = total.get(name, 0.0) + seconds
    if not tokens or not total:
        return {}
    threads = {k: v for k, v in total.items() if k.startswith("stub thread ")}
    busiest = max(threads.values(), default=0.0)
    out = {k: v / tokens * 1e3 for k, v in total.items() if k in ("stub", "tritonserver", "client")}
    out["stub decode thread"] = busiest / tokens * 1e3
    out["stub other threads"] = max(out["stub"] - out["stub decode thread"], 0.0)  # /proc ticks: 10 ms
    return out


# -- the engine alone: the same engine code in this process, no Triton -----------------------------------------


@attrs.frozen
class EngineRun:
    turn_rate: float  # tokens/s of the whole turns (admission, prefill, decode)
    pass_rate: float  # tokens/s of the decode passes alone
    pass_cpu_per_1k: float  # CPU seconds per 1,000 tokens of the decode passes


class EngineAlone:
    """The chat engine in this process (no Triton, no gRPC, no client), one torch thread as the server's instance.

    The model is loaded once. :meth:`turns` runs the turns that end to end runs; :meth:`forward_ms` times one
    row's forward at a history length. Only :meth:`rig` and :meth:`forward_ms` touch the engine core's own API (the
    cache, the forward): a new engine core changes only them.
    """

    def __init__(self) -> None:
        import torch

        from triton_npu_client.server import CheckpointTokenizer, load_decoder

        torch.set_num_threads(1)
        self.model = load_decoder(CHECKPOINT)
        self.tokenizer = CheckpointTokenizer(CHECKPOINT)

    def rig(self, rows: int) -> tuple[Any, Any]:
        """(engine, StepLoop) for ``rows`` conversations, the loop driven pass by pass."""
        from triton_npu_client.server import ChatEngine, PagedKVCache, SequenceSlots, StepLoop

        # As the served `chat` model: blocks of 16 positions, equal prefixes shared; room for every row's context.
        cache = PagedKVCache.for_model(self.model, num_blocks=rows * MAX_CTX // 16 + 1, block_size=16)
        engine = ChatEngine(
            self.model, self.tokenizer, cache, SequenceSlots(capacity=rows, idle_timeout_s=600),
            respond=lambda r: r, refuse=lambda kind, message: (kind, message), max_ctx=MAX_CTX,
        )
        loop: StepLoop[Any] = StepLoop(
            step=engine.step, admit=engine.admit, on_exit=engine.on_exit, final_flag=1,
            error_response=lambda m: m, start=False,
        )
        return engine, loop

    def turns(self, rows: int, tokens: int) -> EngineRun:
        """The same turns as :func:`aggregate`'s, in process: ``rows`` conversations opened with a question (one
        token), then a turn of ``tokens`` tokens each at once; timed from its submission (admission, prefill
        and decode) and over its decode passes alone (after the pass that admits the turns)."""

        class Sender:
            done = False

            def send(self, response: object = None, flags: int = 0) -> None:
                self.done = self.done or bool(flags & 1)

            def is_cancelled(self) -> bool:
                return False

        engine, loop = self.rig(rows)

        def submit(key: int, start: bool, text: str, n: int) -> Sender:
            sender = Sender()
            turn = engine.parse(
                key=key, start=start, end=False, roles=["user"], texts=[text], max_tokens=n, min_tokens=n
            )
            loop.submit(key, sender, turn)
            return sender

        def finish(senders: list[Sender]) -> int:
            passes = 0
            while not all(s.done for s in senders):
                loop.run_pass()
                passes += 1
            return passes

        finish([submit(key, True, QUESTIONS[key % len(QUESTIONS)], 1) for key in range(1, rows + 1)])
        submitted = time.perf_counter()
        senders = [submit(key, False, "Go on.", tokens) for key in range(1, rows + 1)]
        loop.run_pass()  # admission (prefill) and the first token
        start, cpu = time.perf_counter(), time.thread_time()
        passes = finish(senders)
        end, cpu = time.perf_counter(), time.thread_time() - cpu
        return EngineRun(
            turn_rate=rows * tokens / (end - submitted),
            pass_rate=rows * passes / (end - start),
            pass_cpu_per_1k=cpu / (rows * passes) * 1e3,
        )

    def forward_ms(self, history: int) -> float:
        """ms per one-row forward with ``history`` positions of history."""
        import torch

        from triton_npu_client.server import PagedKVCache, forward_tables

        cache = PagedKVCache.for_model(self.model, num_blocks=MAX_CTX // 16 + 1, block_size=16)
        table = cache.new_table()
        cache.reserve(table, 0, history + 1)
        forward_tables(self.model, cache, [table], torch.randint(0, self.tokenizer.vocab_size, (1, history)))
        token = torch.tensor([[5]])
        start = time.perf_counter()
        for _ in range(100):
            # The same position again: the history stays this long.
            forward_tables(self.model, cache, [table], token, [history])
        return (time.perf_counter() - start) / 100 * 1e3


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def verdict(value: float, goal: float, *, at_most: bool = False) -> str:
    return "met" if (value <= goal if at_most else value >= goal) else "NOT met"


def rounds(values: Sequence[float], fmt: str = "{:.0f}") -> str:
    return ", ".join(fmt.format(v) for v in values)


@attrs.define
class Results:
    """Every round's figures, by measurement."""

    short: list[float] = attrs.Factory(list)
    long: list[float] = attrs.Factory(list)
    lengths: dict[int, int] = attrs.Factory(lambda: {16: 0, 1024: 0})
    # (conversations, interval_ms or None) -> runs
    served: dict[tuple[int, int | None], list[Throughput]] = attrs.Factory(dict)
    # --chats conversations, every turn JSON-schema constrained (a response per token)
    constrained: list[Throughput] = attrs.Factory(list)
    # conversations -> one run per round
    alone: dict[int, list[EngineRun]] = attrs.Factory(dict)
    kept: list[float] = attrs.Factory(list)
    resent: list[float] = attrs.Factory(list)
    history: int = 0
    forward: dict[int, float] = attrs.Factory(dict)


async def measure(args: argparse.Namespace, chat: Model, twin: Model, procs: Processes | None) -> Results:
    res = Results()
    engine = None if args.no_in_process else EngineAlone()
    counts = (1, args.chats)
    intervals: tuple[int | None, ...] = (None, args.interval_ms)
    for _ in range(args.repeats):
        s, res.lengths[16] = await per_token_latency(chat, 16, args.tokens)
        lo, res.lengths[1024] = await per_token_latency(chat, 1024, args.tokens)
        res.short.append(s)
        res.long.append(lo)
        for n in counts:
            if engine is not None:
                res.alone.setdefault(n, []).append(engine.turns(n, args.tokens))
            for interval in intervals:
                run = await aggregate(chat, n, args.tokens, interval_ms=interval, procs=procs if n > 1 else None)
                res.served.setdefault((n, interval), []).append(run)
                if n > 1 and interval is None:
                    # Right after its unconstrained twin, in the same round: the same turns, every row constrained.
                    res.constrained.append(await aggregate(chat, n, args.tokens, schema=PEOPLE_SCHEMA))
        k, r, res.history = await ttft_at_turn(chat, twin, args.turns, args.tokens)
        res.kept.append(k)
        res.resent.append(r)
    if engine is not None:
        res.forward = {h: engine.forward_ms(h) for h in (16, 1024)}
    return res


def print_latency(res: Results) -> None:
    med = statistics.median
    print("## Per-token decode latency vs history (one conversation, client-side time between pieces)\n")
    print("| history tokens | ms per token (median) | rounds |")
    print("|---|---|---|")
    for length, values in ((res.lengths[16], res.short), (res.lengths[1024], res.long)):
        print(f"| {length} | {med(values) * 1e3:.2f} | {rounds([x * 1e3 for x in values], '{:.2f}')} |")
    lat = ratio(med(res.long), med(res.short))
    print(
        f"\nratio {res.lengths[1024]} vs {res.lengths[16]}: **{lat:.2f}x** "
        f"(goal <= 1.3x: {verdict(lat, 1.3, at_most=True)})\n"
    )


def print_throughput(args: argparse.Namespace, res: Results) -> None:
    med = statistics.median
    n, iv = args.chats, args.interval_ms

    def served(count: int, interval: int | None) -> float:
        return med(r.tokens_per_s for r in res.served[(count, interval)])

    def passes(count: int) -> float:
        return med(r.pass_rate for r in res.alone[count])

    def label(interval: int | None) -> str:
        return "a response per token" if interval is None else f"STREAM_INTERVAL_MS {interval}"

    print(f"## End to end vs the engine alone ({args.tokens} tokens per conversation)\n")
    print(
        "Each turn timed from its request to its last response; the engine alone runs the same turns in this "
        "process (no Triton), timed over its decode passes (its pass rate: the goal's yardstick) and over the "
        "whole turns (admission and prefill too, as end to end).\n"
    )
    print("| contender | conversations | tokens/s (median) | rounds | responses per conversation | vs pass rate |")
    print("|---|---|---|---|---|---|")
    for count in (1, n):
        if count in res.alone:
            values = [r.pass_rate for r in res.alone[count]]
            print(
                f"| engine alone, decode passes | {count} | {med(values):.0f} | {rounds(values)} | - | 1.00x |"
            )
            values = [r.turn_rate for r in res.alone[count]]
            print(
                f"| engine alone, whole turns | {count} | {med(values):.0f} | {rounds(values)} | - | "
                f"{ratio(med(values), passes(count)):.2f}x |"
            )
        for interval in (None, iv):
            runs = res.served[(count, interval)]
            values = [r.tokens_per_s for r in runs]
            per_conv = statistics.mean(r.responses for r in runs) / count
            versus = f"{ratio(med(values), passes(count)):.2f}x" if count in res.alone else "-"
            print(
                f"| end to end, {label(interval)} | {count} | {med(values):.0f} | {rounds(values)} | "
                f"{per_conv:.1f} | {versus} |"
            )
    print()
    for interval in (iv, None):
        scale = ratio(served(n, interval), served(1, interval))
        print(
            f"end to end, {label(interval)}: {n} vs 1 conversation: **{scale:.1f}x** "
            f"(goal >= 8x: {verdict(scale, 8)})"
        )
        if n in res.alone:
            share = ratio(served(n, interval), passes(n))
            whole = ratio(served(n, interval), med(r.turn_rate for r in res.alone[n]))
            print(
                f"end to end, {label(interval)}: {n} conversations vs the engine alone's pass rate: "
                f"**{share:.2f}x** (goal >= 0.8x: {verdict(share, 0.8)}); vs its whole turns: {whole:.2f}x"
            )
    if n in res.alone:
        print(f"engine alone: {n} vs 1 conversation: {ratio(passes(n), passes(1)):.1f}x (decode passes)")
    print()
    split = {interval: cpu_per_1k(res.served[(n, interval)]) for interval in (None, iv)}
    if not all(split.values()):
        print(f"(CPU per process not measured: the server at {args.url} is not on this machine)\n")
        return
    print(f"### Where the CPU goes: {n} conversations, CPU seconds per 1,000 tokens (all rounds)\n")
    print(f"| process | {label(None)} | {label(iv)} |")
    print("|---|---|---|")
    rows = [
        ("Python stub (the `chat` instance)", "stub"),
        ("... its decode thread (the StepLoop)", "stub decode thread"),
        ("... its other threads (sending, cancellation checks, execute)", "stub other threads"),
        ("tritonserver", "tritonserver"),
        ("this client (gRPC, decoding the responses)", "client"),
    ]
    for title, key in rows:
        print(f"| {title} | {split[None][key]:.3f} s | {split[iv][key]:.3f} s |")
    totals = [sum(split[i][k] for k in ("stub", "tritonserver", "client")) for i in (None, iv)]
    print(f"| all three | {totals[0]:.3f} s | {totals[1]:.3f} s |")
    if n in res.alone:
        alone_cpu = med(r.pass_cpu_per_1k for r in res.alone[n])
        print(f"| the engine alone, in process (its decode passes) | {alone_cpu:.3f} s | {alone_cpu:.3f} s |")
    print()


def print_constrained(args: argparse.Namespace, res: Results) -> None:
    med = statistics.median
    n = args.chats
    plain = [r.tokens_per_s for r in res.served[(n, None)]]
    bound = [r.tokens_per_s for r in res.constrained]
    print(f"## Constrained decoding: {n} conversations, every turn under a JSON schema ({args.tokens} tokens each)\n")
    print("| turns | tokens/s (median) | rounds | tokens generated per round |")
    print("|---|---|---|---|")
    print(f"| unconstrained | {med(plain):.0f} | {rounds(plain)} | {res.served[(n, None)][0].tokens} |")
    print(f"| every row JSON-schema constrained | {med(bound):.0f} | {rounds(bound)} | {res.constrained[0].tokens} |")
    share = ratio(med(bound), med(plain))
    print(f"\nconstrained vs unconstrained: **{share:.2f}x** (goal >= 0.85x: {verdict(share, 0.85)})\n")


def print_ttft(args: argparse.Namespace, res: Results) -> None:
    med = statistics.median
    print(
        f"## Time to first token at turn {args.turns} ({res.history} tokens of history, "
        f"{args.tokens}-token replies)\n"
    )
    print("| client | TTFT ms (median) | rounds |")
    print("|---|---|---|")
    kept = rounds([x * 1e3 for x in res.kept], "{:.1f}")
    print(f"| history kept on the server (`chat`) | {med(res.kept) * 1e3:.1f} | {kept} |")
    print(
        f"| history resent every turn (`chat_stateless`) | {med(res.resent) * 1e3:.1f} | "
        f"{rounds([x * 1e3 for x in res.resent], '{:.1f}')} |"
    )
    speed = ratio(med(res.resent), med(res.kept))
    print(f"\nkept vs resent: **{speed:.1f}x faster** (goal >= 5x: {verdict(speed, 5)})\n")


def print_engine_alone(args: argparse.Namespace, res: Results) -> None:
    if not res.forward:
        return
    med = statistics.median
    n = args.chats
    print("## The engine alone, in process (no Triton, gRPC or client; one torch thread)\n")
    print("| measurement | ms | ratio |")
    print("|---|---|---|")
    print(f"| one-row forward, 16 positions of history | {res.forward[16]:.2f} | |")
    print(
        f"| one-row forward, 1,024 positions of history | {res.forward[1024]:.2f} | "
        f"{ratio(res.forward[1024], res.forward[16]):.2f}x |"
    )
    one, many = (med(r.pass_rate for r in res.alone[c]) for c in (1, n))
    print(f"| pass (sample + decode), 1 conversation | {1e3 / one:.2f} | |")
    print(
        f"| pass (sample + decode), {n} conversations | {n * 1e3 / many:.2f} | "
        f"{ratio(many, one):.1f}x the tokens/s of one |\n"
    )


def checkpoint_repository(work: Path, checkpoint: Path) -> Path:
    """A repository serving ``checkpoint`` as `chat` and `chat_stateless`, configured as the packaged pair.

    Both entries come from ``write_chat_model`` with the packaged `chat` model's max_ctx, KV-cache budget and one
    torch thread (the engine alone's; a generated entry's own default is "auto"); the twin then loses sequence
    batching and prefix sharing, as server_models/chat_stateless differs from chat.
    """
    import re

    from triton_npu_client import write_chat_model

    repository = work / "repository"
    for name, budget in (("chat", 512), ("chat_stateless", 256)):
        write_chat_model(
            repository, checkpoint, name=name, max_ctx=MAX_CTX, dtype="float32", device="cpu", max_cache_mb=budget,
            cpu_threads=1,
        )
    twin = repository / "chat_stateless" / "config.pbtxt"
    text, removed = re.subn(r"^sequence_batching \{\n.*?^\}\n", "", twin.read_text(), flags=re.MULTILINE | re.DOTALL)
    shared = '"share_prefixes" value: { string_value: "true" }'
    if removed != 1 or shared not in text:
        raise RuntimeError(f"{twin}: the generated config is not the packaged chat config")
    twin.write_text(text.replace(shared, '"share_prefixes" value: { string_value: "false" }'))
    return repository


async def main(args: argparse.Namespace) -> int:
    global CHECKPOINT, SUBJECT
    async with contextlib.AsyncExitStack() as stack:
        if args.llama or args.checkpoint is not None:
            import tempfile

            import chat_cache  # bench/chat_cache.py: its tiny Llama, as wide and deep as the GPT-2 demo

            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-chat-")))
            if args.checkpoint is None:
                CHECKPOINT = chat_cache.write_tiny_llama(work / "tiny_llama", args.llama_shape)
                shape = chat_cache.describe_shape(args.llama_shape)
                SUBJECT = f"a random Llama (bench/chat_cache.py's {args.llama_shape!r} shape: {shape})"
            else:
                CHECKPOINT = Path(args.checkpoint)  # made absolute by parse()
                SUBJECT = str(CHECKPOINT)
            if args.url is not None:
                raise SystemExit("--url serves its own models: --checkpoint and --llama start a server of their own")
            server = await stack.enter_async_context(LocalTriton(checkpoint_repository(work, CHECKPOINT)))
            args.url = server.grpc_url
        elif args.url is None:
            server = await stack.enter_async_context(LocalTriton())
            args.url = server.grpc_url
        print(f"Measured: {SUBJECT}.\n")
        client = await stack.enter_async_context(Client(args.url, timeout_s=300))
        chat, twin = await client.model("chat"), await client.model("chat_stateless")
        procs = Processes.find(args.url, "chat")
        # Warm up both models (first calls pay lazy initialisation).
        await per_token_latency(chat, 16, 8)
        await ttft_at_turn(chat, twin, 2, 8)
        res = await measure(args, chat, twin, procs)

    print_latency(res)
    print_throughput(args, res)
    print_constrained(args, res)
    print_ttft(args, res)
    print_engine_alone(args, res)
    if not args.no_in_process and not args.no_compile:
        import chat_compile  # bench/chat_compile.py: the compiled decode pass against eager, in this process

        rows = sorted({1, args.chats})
        passes, rounds = (5, 1) if args.quick else (30, args.repeats)
        chat_compile.print_table(CHECKPOINT, chat_compile.measure(CHECKPOINT, rows, 300, passes, rounds), 300)
    if not args.no_cache:
        import chat_cache  # bench/chat_cache.py: the paged KV cache's tables, on a server of its own

        await chat_cache.sections(chat_cache.parse(["--quick"] if args.quick else ["--rounds", str(args.repeats)]))
    if args.peer is not None:
        # Servers of its own (ours at each --threads, llama-server beside it); this module's functions measure ours.
        await peer_llamacpp.compare(args, sys.modules[__name__])
    print(
        f"Run: `{' '.join(['.venv/bin/python', 'bench/chat.py', *sys.argv[1:]])}` on {platform.node()} "
        f"({platform.processor() or platform.machine()}), Python {platform.python_version()}, "
        f"{args.repeats} rounds, medians."
    )
    return 0


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server (default: start one on server_models/)")
    p.add_argument("--repeats", type=int, default=None, help="rounds (default 3; --quick: 1)")
    p.add_argument("--tokens", type=int, default=None, help="tokens each measured turn makes (default 64; --quick: 8)")
    p.add_argument("--chats", type=int, default=None, help="conversations at once (default 32; --quick: 4)")
    p.add_argument("--turns", type=int, default=None, help="the turn whose TTFT is compared (default 10; --quick: 3)")
    p.add_argument(
        "--interval-ms", type=int, default=50,
        help="the STREAM_INTERVAL_MS the client asks for in the second end-to-end run (default 50)",
    )
    p.add_argument("--quick", action="store_true", help="a smoke run: --repeats 1 --tokens 8 --chats 4 --turns 3")
    p.add_argument("--no-in-process", action="store_true", help="skip the engine alone (its table and ratios)")
    p.add_argument(
        "--no-compile", action="store_true",
        help="skip the compiled decode pass's table (bench/chat_compile.py: it compiles a graph per batch size)",
    )  # fmt: skip
    p.add_argument("--no-cache", action="store_true", help="skip bench/chat_cache.py's tables")
    p.add_argument(
        "--checkpoint", default=None,
        help="measure this checkpoint folder (served as chat and chat_stateless, configured as the packaged pair)",
    )
    p.add_argument("--llama", action="store_true", help="measure a tiny random Llama of the GPT-2 demo's shape")
    import chat_cache  # bench/chat_cache.py: the random Llama's shapes

    p.add_argument(
        "--llama-shape", choices=sorted(chat_cache.LLAMA_SHAPES), default=None,
        help="--llama's shape (bench/chat_cache.py's LLAMA_SHAPES): demo (default), tests or smollm2-135m",
    )  # fmt: skip
    p.add_argument(
        "--peer", type=peer_llamacpp.parse_peer, default=None, metavar="llama-server=PATH",
        help="then compare with llama.cpp's llama-server (that binary) on the same checkpoint: bench/peer_llamacpp.py",
    )  # fmt: skip
    p.add_argument(
        "--threads", type=peer_llamacpp.parse_threads, default=(1, 2), metavar="N[,N...]",
        help="--peer's thread counts: llama-server --threads/--threads-batch and our cpu_threads (default 1,2)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.llama_shape is not None and not args.llama:
        p.error("--llama-shape needs --llama")
    args.llama_shape = args.llama_shape or "demo"
    if args.peer is not None and args.url is not None:
        p.error("--peer starts servers of its own (ours with cpu_threads set): it cannot use --url")
    if args.checkpoint is not None:
        args.checkpoint = str(Path(args.checkpoint).resolve())
    defaults = {"repeats": (3, 1), "tokens": (64, 8), "chats": (32, 4), "turns": (10, 3)}
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse())))
