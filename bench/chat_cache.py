"""Chat KV-cache benchmarks: what the paged cache and prefix sharing buy, on the GPT-2 demo and a tiny random Llama.

Run from the repository root (starts its own server on a temporary repository; nothing else is needed)::

    .venv/bin/python bench/chat_cache.py [--rounds 3] [--conversations 32] [--system-tokens 500]
    .venv/bin/python bench/chat_cache.py --quick        # a smoke run: small and fast, numbers not meaningful

``bench/chat.py`` runs the same sections at its end (:func:`sections`). Two checkpoints side by side, each served
by two entries that ``triton_npu_client.write_chat_model`` generates (``share_prefixes`` false and true, dtype
float32, ``evict_min_idle_ms`` -1 so nothing is evicted, ``max_sequences`` 4096 so only the memory caps):
the GPT-2 demo (``server_models/chat/demo_gpt2``: 1,536 positions, so its ``max_ctx`` is 1,536, not 4,096) and a
tiny random Llama written by ``tests/_checkpoints.py`` with 4,096 positions (``max_ctx`` 4,096).

1. **Conversations held within one ``max_cache_mb``.** Conversations of a seeded length mix (lognormal, mean
   about 200 tokens, clipped to the context) are opened one after another on the entry without prefix sharing
   (every conversation's text is its own: the figure is what paging alone buys), each one turn whose prompt and
   reply (8 tokens) reach its drawn length, until the server refuses one as capacity ("the KV cache is full").
   Against the slot design this cache replaced, where each conversation held a whole ``max_ctx`` slot from START:
   its capacity is the formula the old ChatModel used (commit b1a3b0a, ``_chat_model.py``):
   ``min(max_sequences, floor(max_cache_mb MiB / (max_ctx * bytes per position)))``, with bytes per position
   ``2 * layers * kv_heads * head_dim * element size``. Goal: at least 4x.
2. **First-turn time to first token, a shared system prompt.** ``--conversations`` conversations open at once,
   each with the same ``--system-tokens`` system prompt and a short user message of its own; the time from its
   request to its first response, on the entry sharing prefixes against the one that does not. Each round uses a
   system prompt of its own (nothing cached from an earlier round) and alternates which entry goes first. Goal:
   the median at least 5x faster shared. The server's PROMPT_TOKENS (positions prefilled) show the prompt
   computed once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import re
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

from triton_npu_client import Client, LocalTriton, Model, TritonError, write_chat_model

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "server_models" / "chat" / "demo_gpt2"
REPLY_TOKENS = 8  # each capacity conversation's reply: MIN_TOKENS = MAX_TOKENS
MEAN_TOKENS = 200  # the length mix's mean before clipping
SIGMA = 1.0  # the lognormal's shape: a long tail of long conversations, most short
MIN_TOKENS = 24  # shortest conversation (a template's framing and the reply fit)
FULL = "the KV cache is full"
WORDS = tuple(
    " ".join(
        (
            "emma woodhouse handsome clever rich comfortable home happy disposition seemed unite some best blessings",
            "existence lived nearly twenty one years world very little distress vex her morning village letter sister",
            "walk breakfast dinner thursday novel london grave rain evening ball cousin stay westons married vicarage",
            "pianoforte garden river road house window candle winter summer friend answer question story quiet cold",
        )
    ).split()
)


# -- the checkpoints and the repository --------------------------------------------------------------------------


@attrs.frozen
class Subject:
    """One checkpoint as served: its two generated entries and the figures the slot formula needs."""

    label: str
    folder: Path
    max_ctx: int
    cache_mb: float
    bytes_per_position: int  # keys and values of every layer, one position (float32)
    max_sequences: int
    shared: str  # the entry with share_prefixes true
    unshared: str  # the entry with share_prefixes false

    @property
    def slot_capacity(self) -> int:
        """Conversations the slot design held in ``cache_mb`` (b1a3b0a's ChatModel: a max_ctx slot each)."""
        return slot_capacity(self.cache_mb, self.max_ctx, self.bytes_per_position, self.max_sequences)


def slot_capacity(cache_mb: float, max_ctx: int, bytes_per_position: int, max_sequences: int) -> int:
    """The old ChatModel's capacity: ``min(max_sequences, max_cache_mb MiB // (max_ctx * bytes per position))``."""
    return min(max_sequences, int(cache_mb * 2**20 // (max_ctx * bytes_per_position)))


def kv_bytes_per_position(folder: Path, element_size: int = 4) -> int:
    """Bytes one position takes in the KV cache, from config.json: 2 (keys, values) * layers * kv heads * head dim."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if config["model_type"] == "gpt2":
        layers, width = config["n_layer"], config["n_embd"]
    else:
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        layers, width = config["num_hidden_layers"], config.get("num_key_value_heads", heads) * head_dim
    return 2 * int(layers) * int(width) * element_size


def set_parameters(config: Path, **values: str) -> None:
    """Set model config ``parameters`` lines (replaced where present, added after the last one otherwise)."""
    lines = config.read_text(encoding="utf-8").splitlines()
    last = max(i for i, line in enumerate(lines) if line.startswith("parameters {"))
    for key, value in values.items():
        line = f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}'
        at = [i for i, old in enumerate(lines) if old.startswith(f'parameters {{ key: "{key}" ')]
        if at:
            lines[at[0]] = line
        else:
            last += 1
            lines.insert(last, line)
    config.write_text("\n".join(lines) + "\n", encoding="utf-8")


# The random Llama's shapes: "demo" as wide and deep as the GPT-2 demo (4 layers of 192, 4 heads; 2 key/value heads,
# as Llama's grouped-query attention has), "tests" the test helpers' default (2 layers of 64), "smollm2-135m"
# SmolLM2-135M's (HuggingFaceTB/SmolLM2-135M's config.json: 30 layers of 576, 9 heads over 3 key/value heads, tied
# embeddings, rope_theta 100,000, its 49,152-token vocabulary; random weights, a random BPE of that size).
# "vocab_size" is the tokenizer's (tests/_checkpoints.py's tokenizer_vocab); the rest go to the transformers config.
LLAMA_SHAPES: dict[str, dict[str, Any]] = {
    "demo": {
        "hidden_size": 192,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "tests": {},
    "smollm2-135m": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "tie_word_embeddings": True,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "vocab_size": 49152,
    },
}


def describe_shape(shape: str) -> str:
    """``shape`` in words: layers, width, heads, vocabulary."""
    config = {**_TESTS_DEFAULTS, **LLAMA_SHAPES[shape]}
    return (
        f"{config['num_hidden_layers']} layers of {config['hidden_size']}, {config['num_attention_heads']} heads "
        f"({config['num_key_value_heads']} key/value), vocabulary {config['vocab_size']:,}"
    )


# tests/_checkpoints.py's defaults, for describe_shape (its vocabulary: the tokenizer its corpus trains).
_TESTS_DEFAULTS = {
    "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 400,
}  # fmt: skip


def write_tiny_llama(folder: Path, shape: str = "demo") -> Path:
    """tests/_checkpoints.py's random Llama (Llama 3 template) with 4,096 positions, of ``shape``."""
    from transformers.utils import logging

    from tests._checkpoints import write_tiny_llama as write

    disable: Any = logging.disable_progress_bar  # untyped in transformers
    disable()
    settings = dict(LLAMA_SHAPES[shape])
    vocab = settings.pop("vocab_size", None)
    extra = {} if vocab is None else {"tokenizer_vocab": vocab}
    written = write(folder, "llama", max_position_embeddings=4096, **extra, **settings)
    found = json.loads((written / "config.json").read_text(encoding="utf-8"))["vocab_size"]
    if vocab is not None and found != vocab:
        raise RuntimeError(f"{shape}: the random tokenizer reached {found:,} tokens, not {vocab:,}")
    return written


def prepare(repository: Path, work: Path, *, cache_mb: float, max_sequences: int, llama_shape: str) -> list[Subject]:
    """The two checkpoints' entries in ``repository`` (the tiny Llama written into ``work``)."""
    checkpoints = {
        "GPT-2 demo": DEMO,
        f"tiny random Llama ({llama_shape} shape)": write_tiny_llama(work / "tiny_llama", llama_shape),
    }
    subjects = []
    for (label, folder), prefix in zip(checkpoints.items(), ("gpt2", "llama"), strict=True):
        names = {}
        for share in ("true", "false"):
            name = write_chat_model(
                repository, folder, name=f"{prefix}_share_{share}", dtype="float32", device="cpu",
                max_cache_mb=cache_mb,
            )  # fmt: skip
            set_parameters(
                repository / name / "config.pbtxt",
                share_prefixes=share,
                max_sequences=str(max_sequences),
                evict_min_idle_ms="-1",
            )
            names[share] = name
        found = re.search(r'key: "max_ctx" value: \{ string_value: "(\d+)"', _config(repository, names["true"]))
        assert found is not None, "the generated config sets max_ctx"
        max_ctx = int(found[1])
        subjects.append(
            Subject(
                label=label, folder=folder, max_ctx=max_ctx, cache_mb=cache_mb,
                bytes_per_position=kv_bytes_per_position(folder), max_sequences=max_sequences,
                shared=names["true"], unshared=names["false"],
            )
        )  # fmt: skip
    return subjects


def _config(repository: Path, name: str) -> str:
    return (repository / name / "config.pbtxt").read_text(encoding="utf-8")


# -- text of a given length ------------------------------------------------------------------------------------


class Texts:
    """Text the checkpoint's tokenizer encodes to about ``n`` tokens: random words, cut at ``n`` ids, decoded."""

    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))

    def words(self, n: int, rng: np.random.Generator) -> str:
        # Words tokenize to one or more ids: 2n words always reach n ids.
        text = " ".join(rng.choice(WORDS, size=2 * n + 4))
        ids = self._tok.encode(text, add_special_tokens=False).ids[:n]
        return str(self._tok.decode(ids)).strip()


def length_mix(count: int, rng: np.random.Generator, max_ctx: int) -> list[int]:
    """``count`` conversation lengths: lognormal with mean MEAN_TOKENS before clipping to [MIN_TOKENS, max_ctx]."""
    mu = math.log(MEAN_TOKENS) - SIGMA**2 / 2
    drawn = rng.lognormal(mu, SIGMA, size=count)
    return [int(min(max(round(x), MIN_TOKENS), max_ctx)) for x in drawn]


def _inputs(pairs: Sequence[tuple[str, str]], tokens: int) -> dict[str, np.ndarray[Any, Any]]:
    return {
        "ROLE": np.array([r.encode() for r, _ in pairs], dtype=np.object_),
        "TEXT": np.array([t.encode() for _, t in pairs], dtype=np.object_),
        "MAX_TOKENS": np.array([tokens], np.int32),
        "MIN_TOKENS": np.array([tokens], np.int32),
    }


def _scalar(result: Any, name: str) -> int:
    return int(result[name][0, 0])


# -- 1. conversations held within one max_cache_mb -------------------------------------------------------------


@attrs.frozen
class Capacity:
    held: int  # conversations admitted before the first refusal
    live: int  # LIVE: the server's count of conversations it holds, on the last admitted turn
    kv_bytes: int  # KV_BYTES on that turn: the bytes of every position held (shared ones once)
    positions: int  # sum of the held conversations' CONTEXT_TOKENS
    lengths: list[int]  # the drawn lengths of the held conversations
    cut_short: int  # held conversations whose reply ended for want of a block (FINISH "context")
    refused: str  # the refusal's message


async def capacity(model: Model, subject: Subject, seed: int, limit: int) -> Capacity:
    """Open conversations of the length mix one after another until one is refused as capacity (at most ``limit``).

    They stay open until all are counted, then close (END frees their blocks)."""
    rng = np.random.default_rng(seed)
    texts = Texts(subject.folder)
    from triton_npu_client.server import CheckpointTokenizer

    framing = len(CheckpointTokenizer(subject.folder).render([("user", "")], add_generation_prompt=True))
    sessions = []
    held: list[int] = []
    positions = cut = live = kv = 0
    refused = ""
    try:
        for length in length_mix(limit, rng, subject.max_ctx):
            prompt = max(length - REPLY_TOKENS - framing, 1)
            seq = model.sequence()
            sessions.append(seq)
            last = None
            try:
                async for response in seq.stream(_inputs([("user", texts.words(prompt, rng))], REPLY_TOKENS)):
                    last = response
            except TritonError as err:
                if FULL not in str(err):
                    raise
                refused = str(err)
                break
            assert last is not None
            held.append(length)
            positions += _scalar(last, "CONTEXT_TOKENS")
            cut += bytes(last["FINISH"][0, 0]) == b"context"
            live, kv = _scalar(last, "LIVE"), _scalar(last, "KV_BYTES")
    finally:
        for seq in sessions:
            with contextlib.suppress(TritonError):
                await seq.aclose()
    # KV_BYTES is the positions held times the bytes of one (no prefix is shared here): the server's own figure
    # checks the bytes per position the slot formula uses.
    if kv != positions * subject.bytes_per_position:
        raise RuntimeError(
            f"{subject.label}: KV_BYTES {kv} for {positions} positions disagrees with "
            f"{subject.bytes_per_position} bytes per position"
        )
    return Capacity(
        held=len(held), live=live, kv_bytes=kv, positions=positions, lengths=held, cut_short=cut, refused=refused
    )


# -- 2. first-turn TTFT with a shared system prompt -----------------------------------------------------------


@attrs.frozen
class Opening:
    ttft_s: float  # request to first response
    prompt_tokens: int  # PROMPT_TOKENS: positions this turn prefilled


async def _open(model: Model, system: str, user: str) -> tuple[Opening, Any]:
    seq = model.sequence()
    start = time.perf_counter()
    first = None
    last = None
    async for response in seq.stream(_inputs([("system", system), ("user", user)], 2)):
        first = time.perf_counter() if first is None else first
        last = response
    assert first is not None and last is not None, "no response"  # noqa: PT018
    return Opening(ttft_s=first - start, prompt_tokens=_scalar(last, "PROMPT_TOKENS")), seq


async def openings(model: Model, system: str, users: Sequence[str]) -> list[Opening]:
    """Open one conversation per user message, all at once, each with ``system`` first; then close them."""
    done = await asyncio.gather(*(_open(model, system, user) for user in users))
    for _, seq in done:
        await seq.aclose()
    return [opening for opening, _ in done]


def stub_pid(name: str) -> int | None:
    """The Python stub serving model ``name`` (its cmdline names the model file), None if not found."""
    needle = f"/{name}/1/model.py".encode()
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and needle in (entry / "cmdline").read_bytes():
                return int(entry.name)
    return None


def cpu_s(pid: int | None) -> float:
    """utime + stime of a process so far, in seconds (0 when unknown)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@attrs.frozen
class Round:
    openings: list[Opening]
    stub_cpu_s: float  # CPU the serving stub spent over the round (all its threads)

    @property
    def median_ms(self) -> float:
        return statistics.median(o.ttft_s for o in self.openings) * 1e3

    @property
    def mean_ms(self) -> float:
        return statistics.mean(o.ttft_s for o in self.openings) * 1e3

    @property
    def prefilled(self) -> int:
        return sum(o.prompt_tokens for o in self.openings)


@attrs.define
class Ttft:
    shared: list[Round] = attrs.Factory(list)
    unshared: list[Round] = attrs.Factory(list)
    system_tokens: int = 0


async def shared_ttft(
    client: Client, subject: Subject, conversations: int, system_tokens: int, rounds: int, seed: int
) -> Ttft:
    """``rounds`` rounds of ``conversations`` openings at once on each entry, sharing a system prompt."""
    from triton_npu_client.server import CheckpointTokenizer

    rng = np.random.default_rng(seed)
    texts = Texts(subject.folder)
    tokenizer = CheckpointTokenizer(subject.folder)
    entries = [(await client.model(name), stub_pid(name)) for name in (subject.shared, subject.unshared)]
    users = [f"Question {i}: {texts.words(12, rng)}?" for i in range(conversations)]
    res = Ttft()
    # Warm-up on both (first calls pay lazy initialisation), with a system prompt no round uses.
    for model, _ in entries:
        await openings(model, texts.words(system_tokens, rng), users[:2])
    for r in range(rounds):
        system = texts.words(system_tokens, rng)  # a prompt of its own per round: nothing cached from the last
        res.system_tokens = len(tokenizer.render([("system", system)], add_generation_prompt=False))
        order = [(entries[0], res.shared), (entries[1], res.unshared)]
        for (model, pid), into in order if r % 2 == 0 else order[::-1]:
            before = cpu_s(pid)
            done = await openings(model, system, users)
            into.append(Round(done, cpu_s(pid) - before))
    return res


# -- the run ---------------------------------------------------------------------------------------------------


@attrs.define
class Results:
    subjects: list[Subject]
    capacity: dict[str, Capacity] = attrs.Factory(dict)
    ttft: dict[str, Ttft] = attrs.Factory(dict)


def verdict(value: float, goal: float) -> str:
    return "met" if value >= goal else "NOT met"


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


async def measure(args: argparse.Namespace) -> Results:
    with tempfile.TemporaryDirectory(prefix="chat-cache-bench-") as tmp:
        work = Path(tmp)
        subjects = prepare(
            work / "repository", work, cache_mb=args.cache_mb, max_sequences=args.max_sequences,
            llama_shape=args.llama_shape,
        )  # fmt: skip
        res = Results(subjects)
        async with (
            LocalTriton(work / "repository", stop_grace_s=0) as server,
            Client(server.grpc_url, timeout_s=600) as client,
        ):
            for subject in subjects:
                model = await client.model(subject.unshared)
                res.capacity[subject.label] = await capacity(model, subject, args.seed, args.max_sequences)
                res.ttft[subject.label] = await shared_ttft(
                    client, subject, args.conversations, args.system_tokens, args.rounds, args.seed
                )
    return res


def print_capacity(res: Results) -> None:
    print(
        f"## Conversations held within one max_cache_mb (length mix: lognormal, mean {MEAN_TOKENS} before clipping)\n"
    )
    print(
        "| checkpoint | max_ctx | max_cache_mb | KV bytes per position | slot design (formula) | paged: held | "
        "mean length held (drawn / CONTEXT_TOKENS) | KV_BYTES held / max_cache_mb | paged vs slots |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for subject in res.subjects:
        cap = res.capacity[subject.label]
        pool = subject.cache_mb * 2**20
        mean = statistics.mean(cap.lengths) if cap.lengths else 0.0
        served, scale = ratio(cap.positions, cap.held), ratio(cap.held, subject.slot_capacity)
        print(
            f"| {subject.label} | {subject.max_ctx} | {subject.cache_mb:g} | {subject.bytes_per_position:,} | "
            f"{subject.slot_capacity} | {cap.held} (LIVE {cap.live}) | {mean:.0f} / {served:.0f} | "
            f"{cap.kv_bytes / 2**20:.1f} MiB / {pool / 2**20:.1f} MiB | **{scale:.1f}x** |"
        )
    print()
    for subject in res.subjects:
        cap = res.capacity[subject.label]
        scale = ratio(cap.held, subject.slot_capacity)
        print(
            f"{subject.label}: paged vs the slot design: **{scale:.1f}x** (goal >= 4x: {verdict(scale, 4)}); "
            f"{cap.positions:,} positions in {cap.held} conversations, {cap.cut_short} replies cut short; "
            f"then refused: {_refusal(cap.refused)}"
        )
    print(
        "\nThe slot design's figure is the formula the old ChatModel used (commit b1a3b0a, "
        "triton_npu_client/server/chat/_chat_model.py: capacity = min(max_sequences, "
        "max_cache_mb MiB // (max_ctx * bytes per position))); its code is gone. Paged: the entry without prefix "
        f"sharing, conversations opened one after another (prompt + a {REPLY_TOKENS}-token reply = the drawn "
        "length) until one was refused as capacity; nothing evicted (evict_min_idle_ms -1).\n"
    )


def _refusal(message: str) -> str:
    """The server's words from "the KV cache is full" to the first semicolon."""
    at = message.find(FULL)
    return "never (the limit of conversations was reached)" if at < 0 else f'"{message[at:].split(";")[0]}"'


def print_ttft(args: argparse.Namespace, res: Results) -> None:
    med = statistics.median
    n = args.conversations
    print(f"## First-turn time to first token: {n} conversations at once, one shared system prompt\n")
    print(
        "| checkpoint | system prompt tokens | prefix sharing | TTFT ms median | TTFT ms mean | medians per round | "
        "PROMPT_TOKENS, all conversations | stub CPU s per round |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for subject in res.subjects:
        t = res.ttft[subject.label]
        for label, runs in (("on", t.shared), ("off", t.unshared)):
            print(
                f"| {subject.label} | {t.system_tokens} | {label} | {med(r.median_ms for r in runs):.0f} | "
                f"{med(r.mean_ms for r in runs):.0f} | {', '.join(f'{r.median_ms:.0f}' for r in runs)} | "
                f"{med(r.prefilled for r in runs):,.0f} | {med(r.stub_cpu_s for r in runs):.2f} |"
            )
    print()
    for subject in res.subjects:
        t = res.ttft[subject.label]
        speed = ratio(med(r.median_ms for r in t.unshared), med(r.median_ms for r in t.shared))
        cpu = ratio(med(r.stub_cpu_s for r in t.unshared), med(r.stub_cpu_s for r in t.shared))
        each = sorted(o.prompt_tokens for o in t.shared[-1].openings)
        print(
            f"{subject.label}: shared vs not: **{speed:.1f}x faster** (goal >= 5x: {verdict(speed, 5)}); "
            f"by the stub's CPU: {cpu:.1f}x; PROMPT_TOKENS per conversation, shared, last round: largest "
            f"{each[-1]}, median {each[len(each) // 2]}, smallest {each[0]}"
        )
    print(
        "\nEach round has a system prompt of its own and alternates which entry goes first; TTFT is from a "
        "conversation's request to its first response, the median over the conversations, then over the rounds. "
        "PROMPT_TOKENS: positions the server prefilled (median round). Stub CPU: the serving Python stub's, read "
        "from /proc (a figure the machine's other load does not inflate as it does wall time).\n"
    )


def print_run(args: argparse.Namespace, command: str) -> None:
    import torch

    print(
        f"Run: `{command}` on {platform.node()} ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs), Python {platform.python_version()}, torch {torch.__version__}, CPU instances "
        f"(float32, one torch thread), seed {args.seed}, {args.rounds} rounds."
    )


async def sections(args: argparse.Namespace) -> Results:
    """Measure and print both sections (what bench/chat.py calls)."""
    res = await measure(args)
    print_capacity(res)
    print_ttft(args, res)
    return res


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=None, help="TTFT rounds (default 3; --quick: 1)")
    p.add_argument(
        "--conversations", type=int, default=None, help="TTFT conversations at once (default 32; --quick: 4)"
    )
    p.add_argument("--system-tokens", type=int, default=500, help="the shared system prompt's length (default 500)")
    p.add_argument(
        "--cache-mb", type=float, default=None, help="max_cache_mb of every entry (default 128; --quick: 24)"
    )
    p.add_argument(
        "--llama-shape",
        choices=sorted(LLAMA_SHAPES),
        default="demo",
        help="the tiny Llama's shape: demo (the GPT-2 demo's width and depth; default), tests (2 layers of 64) or "
        "smollm2-135m (SmolLM2-135M's: 30 layers of 576, a 49,152-token vocabulary)",
    )
    p.add_argument(
        "--max-sequences", type=int, default=1024,
        help="max_sequences of every entry (default 1024: the sequence batcher's max_candidate_sequences)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a smoke run: --rounds 1 --conversations 4, small caches")
    args = p.parse_args(argv)
    defaults = {"rounds": (3, 1), "conversations": (32, 4), "cache_mb": (128.0, 24.0)}
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


async def main(args: argparse.Namespace) -> int:
    await sections(args)
    print_run(args, " ".join([".venv/bin/python", "bench/chat_cache.py", *sys.argv[1:]]))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse())))
