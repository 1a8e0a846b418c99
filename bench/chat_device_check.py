"""Check the chat engine on an accelerator: decoders and the paged KV cache on the device, batched decode vs CPU.

Run from the repository root with torch, safetensors, tokenizers and jinja2 (no tritonclient, no Triton); the
tiny Llama-family checkpoints are written with ``transformers``::

    PYTHONPATH=. python bench/chat_device_check.py [--device auto|npu|cuda|cpu] [--conversations 16] [--tokens 32]
        [--families llama,qwen2,mistral] [--checkpoint DIR ...]

Checkpoints: the GPT-2 demo (server_models/chat/demo_gpt2) and a tiny random checkpoint of each Llama family in
``--families`` (tests/_checkpoints.py's ``write_tiny_llama``, into a temporary folder); or only the folders given
with ``--checkpoint`` (any that ``load_decoder`` reads; ``python -m tests._checkpoints DIR --family qwen2`` writes
one where transformers is not installed on the device's machine). Each loads with ``load_decoder`` (float32) on
the device a model instance would pick (NPU, else CUDA, else CPU; ``--device`` forces one) and, as the
reference, on the CPU. The check asserts every weight and every KV-cache block lives on the device, and drives the
real :class:`ChatEngine` on a :class:`PagedKVCache` (prefixes shared, as the chat model runs it) in a pass-by-pass
StepLoop: N conversations at once (batched decode; conversations share a system prompt five ways, so batches also
read shared blocks), then one alone. Checks, each printed:

- greedy tokens on the device equal CPU's. On an accelerator a float difference may flip an argmax where
  two logits nearly tie: such a position is reported (conversation, position, the CPU top-2 gap) and
  passes only when the gap is within twice the largest logit difference; on CPU every token must match;
- the logits of the same token sequences (teacher-forced: the CPU reply fed back), a prefill per prompt (taking
  a registered system prompt's blocks) and then batched decode through the paged cache, differ by at most
  ``--logit-atol`` between the device and CPU;
- the engine's greedy tokens are the argmax of that plain batched forward (CPU), and a conversation decoded
  alone gives the tokens it gets in the batch;
- the batched run took shared blocks by reference (more conversations than system prompts).

Then a table per checkpoint: device, conversations, tokens/s batched, tokens/s one conversation, time to first
token (one conversation alone; median in the batch).

Without an accelerator (or with ``--device cpu``) both sides are the CPU: a smoke check of this script, the
decoders and the paged engine (every check runs, the comparisons are CPU against CPU), not of a device.
Exits 1 on a failed check, 2 when the device is absent or a tiny checkpoint cannot be written.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

# bench/ is a folder of scripts, not a package: device_check.py holds the tritonclient-free toolkit import; the
# repository root holds tests/_checkpoints.py (the tiny Llama-family checkpoints).
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from device_check import import_toolkit

from triton_npu_client.server.chat._families import FAMILIES as _FAMILY_TABLE

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "server_models" / "chat" / "demo_gpt2"
# The Llama-family model types, from the engine's one table of families.
FAMILIES = tuple(t for t, (module, _) in _FAMILY_TABLE.items() if module == "_llama")
FINAL = 1  # stands in for pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
BLOCK_SIZE = 16  # the chat model's default kv_block_size
# Long enough to fill at least one 16-position block in every tokenizer here: conversations with the same system
# prompt share its blocks.
SYSTEMS = [
    "You are a polite young lady in a country house. You answer every guest kindly and at some length.",
    "You are an old sailor who has seen every port. You tell long stories about the sea and its storms.",
    "You are a careful gardener; answer briefly. You know every flower, tree and vegetable of the county.",
    "You are the village schoolmaster. You turn every question into a short lesson about the river.",
    "You are a cheerful cook. You talk about bread, soup and pies whatever the question may be.",
]
QUESTIONS = [
    "Where are you going this morning?",
    "What did your sister say?",
    "Shall we walk to the village?",
    "Is it going to rain before dinner?",
    "Who was at the ball last night?",
    "What will you do tomorrow?",
    "Why is the road so muddy?",
]


def messages(i: int) -> tuple[list[str], list[str]]:
    """Conversation ``i``'s first turn: a system message and a user message, distinct for every i < 35."""
    return ["system", "user"], [SYSTEMS[i % len(SYSTEMS)], QUESTIONS[i % len(QUESTIONS)]]


class Sender:
    """Stands in for a Triton response sender: records responses and when the first one came."""

    def __init__(self) -> None:
        self.responses: list[Any] = []
        self.done = False
        self.first_at: float | None = None

    def send(self, response: Any = None, flags: int = 0) -> None:
        if response is not None:
            if self.first_at is None:
                self.first_at = time.perf_counter()
            self.responses.append(response)
        self.done = self.done or bool(flags & FINAL)

    def is_cancelled(self) -> bool:
        return False


@dataclasses.dataclass
class EngineRun:
    """Greedy reply ids per conversation, how long the run took, and what the cache did."""

    ids: list[list[int]]
    seconds: float
    first_token_s: list[float]
    cache_note: str
    shared_hits: int

    def tokens_s(self) -> float:
        return sum(map(len, self.ids)) / self.seconds


def on_device(name: str, tensors: list[torch.Tensor], device: torch.device) -> str:
    """Assert every tensor lives on ``device``; a one-line summary."""
    wrong = [i for i, t in enumerate(tensors) if t.device != device]
    assert not wrong, (
        f"{name}: {len(wrong)} of {len(tensors)} tensors not on {device} (first on {tensors[wrong[0]].device})"
    )
    return f"{name}: {len(tensors)} tensors on {device}"


def tensors_of(value: Any) -> list[torch.Tensor]:
    """Every tensor a loaded decoder holds: its dataclass fields, their tuples of layers, the rotary table."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in tensors_of(item)]
    if dataclasses.is_dataclass(value):
        return [t for f in dataclasses.fields(value) for t in tensors_of(getattr(value, f.name))]
    if hasattr(value, "__dict__"):
        return [t for item in vars(value).values() for t in tensors_of(item)]
    return []


def new_cache(tk: Any, model: Any, conversations: int, max_ctx: int) -> Any:
    """A paged cache with room for every conversation's whole context, prefixes shared (the chat model's default)."""
    blocks = conversations * -(-max_ctx // BLOCK_SIZE)
    return tk.PagedKVCache.for_model(model, num_blocks=blocks, block_size=BLOCK_SIZE, share_prefixes=True)


def run_engine(
    tk: Any, model: Any, tokenizer: Any, device: torch.device, conversations: list[int], *, tokens: int, max_ctx: int
) -> EngineRun:
    """The conversations' first turns, all submitted at once, through ChatEngine in a StepLoop driven here."""
    cache = new_cache(tk, model, len(conversations), max_ctx)
    # The blocks a conversation may take (the pool holds one more: the null block, what padding reads and writes).
    shape = list(cache.keys[0].shape)
    shape[1] = cache.num_blocks
    cache_note = on_device(f"KV cache blocks {shape} per layer", [*cache.keys, *cache.values], device)
    engine = tk.ChatEngine(
        model,
        tokenizer,
        cache,
        tk.SequenceSlots(capacity=len(conversations), idle_timeout_s=3600.0),
        respond=lambda response: response,
        refuse=lambda kind, message: ("refused", kind, message),
        max_ctx=max_ctx,
        default_max_tokens=tokens,
    )
    loop = tk.StepLoop(
        step=engine.step,
        admit=engine.admit,
        on_exit=engine.on_exit,
        final_flag=FINAL,
        error_response=lambda message: ("error", message),
        start=False,
    )
    turns, senders = [], []
    start = time.perf_counter()
    for key, i in enumerate(conversations, 1):
        roles, texts = messages(i)
        # MIN_TOKENS = MAX_TOKENS: every reply has exactly `tokens` tokens, so runs compare token for token.
        turn = engine.parse(start=True, end=True, roles=roles, texts=texts, max_tokens=tokens, min_tokens=tokens)
        sender = Sender()
        refusal = loop.submit(key, sender, turn)
        assert refusal is None, refusal
        turns.append(turn)
        senders.append(sender)
    for _ in range(tokens + 10):
        if all(s.done for s in senders):
            break
        loop.run_pass()
    seconds = time.perf_counter() - start
    for i, (turn, sender) in enumerate(zip(turns, senders, strict=True)):
        last = sender.responses[-1] if sender.responses else None
        assert sender.done, f"conversation {i} did not finish"
        assert getattr(last, "finish", None) == "length", f"conversation {i} ended with {last!r}"
        assert len(turn.reply_ids) == tokens, f"conversation {i}: {len(turn.reply_ids)} tokens, not {tokens}"
    # Every turn carried END: the conversations are gone and so is every block they held.
    assert cache.used_blocks == 0, f"{cache.used_blocks} KV blocks still held after every conversation ended"
    firsts = [s.first_at - start for s in senders if s.first_at is not None]
    return EngineRun(
        ids=[list(t.reply_ids) for t in turns],
        seconds=seconds,
        first_token_s=firsts,
        cache_note=cache_note,
        shared_hits=cache.shared_hits,
    )


def teacher_forced_logits(
    tk: Any, model: Any, tokenizer: Any, conversations: list[int], replies: list[list[int]], *, max_ctx: int
) -> torch.Tensor:
    """Logits [conversations, tokens, vocab] (on the host) that chose each reply token, given ``replies``.

    Prefill each prompt into its own block table (taking the blocks of a system prompt an earlier one registered,
    as the engine does), then decode every conversation together, feeding the given reply tokens: the same token
    sequences through the same paged-cache paths on every device, whatever each device would have chosen.
    """
    cache = new_cache(tk, model, len(conversations), max_ctx)
    tables = [cache.new_table() for _ in conversations]
    first = []
    for table, i in zip(tables, conversations, strict=True):
        roles, texts = messages(i)
        prompt = tokenizer.render(list(zip(roles, texts, strict=True)), add_generation_prompt=True)
        held = min(cache.adopt_prefix(table, prompt), len(prompt) - 1)
        todo = torch.tensor([prompt[held:]], dtype=torch.long)
        first.append(tk.forward_tables(model, cache, [table], todo, [held])[0])
    steps = [torch.stack(first)]
    for t in range(len(replies[0]) - 1):
        fed = torch.tensor([[reply[t]] for reply in replies], dtype=torch.long)
        steps.append(tk.forward_tables(model, cache, tables, fed))
    return torch.stack(steps, dim=1).to("cpu")


def greedy(logits: torch.Tensor, stop_ids: frozenset[int]) -> list[list[int]]:
    """The engine's choice below MIN_TOKENS: argmax with the tokens that would end the reply masked."""
    masked = logits.clone()
    masked[..., sorted(stop_ids)] = float("-inf")
    return [list(map(int, row)) for row in masked.argmax(dim=-1).tolist()]


def compare_tokens(
    what: str,
    got: list[list[int]],
    want: list[list[int]],
    ref_logits: torch.Tensor,
    *,
    flips_allowed: bool,
    slack: float,
) -> bool:
    """Print whether two runs chose the same greedy tokens; a near-tie flip passes where ``flips_allowed``.

    ``ref_logits`` are the reference's teacher-forced logits: at the first differing position both runs saw
    the same history, so the reference's gap between its token and the other one says whether it was a tie.
    """
    differing = [(c, next(p for p, (a, b) in enumerate(zip(g, w, strict=True)) if a != b))
                 for c, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]  # fmt: skip
    total = f"{len(want)} conversation{'s' * (len(want) != 1)} x {len(want[0])} tokens"
    if not differing:
        print(f"{what}: equal ({total})")
        return True
    ok = flips_allowed
    for c, p in differing:
        gap = float(ref_logits[c, p, want[c][p]] - ref_logits[c, p, got[c][p]])
        tie = gap <= slack
        ok &= tie
        why = "a near tie flipped by float differences" if tie else "NOT a near tie"
        print(f"{what}: conversation {c} first differs at token {p} ({got[c][p]} vs {want[c][p]}); "
              f"reference top-2 gap {gap:.3g} vs allowed {slack:.3g}: {why}")  # fmt: skip
    verdict = "allowed on an accelerator" if ok else "FAIL"
    print(f"{what}: {len(differing)} of {len(want)} conversations differ ({total}): {verdict}")
    return ok


@dataclasses.dataclass
class Target:
    """Where one set of runs happens: its name in the output, its device, the model loaded there."""

    name: str
    device: torch.device
    model: Any


def check(tk: Any, checkpoint: Path, device: torch.device, args: argparse.Namespace) -> bool:
    """Load ``checkpoint`` on ``device`` and on the CPU, run and compare; print the checks and the table."""
    tokenizer = tk.CheckpointTokenizer(checkpoint)
    cpu = torch.device("cpu")
    targets = [
        Target(name=str(device), device=device, model=tk.load_decoder(checkpoint, device, torch.float32)),
        Target(name="cpu (ref)", device=cpu, model=tk.load_decoder(checkpoint, cpu, torch.float32)),
    ]
    model = targets[0].model
    family = type(model).__name__
    max_ctx = min(args.max_ctx, model.max_positions)
    print(f"\n== {family} ({checkpoint}), max_ctx {max_ctx} ==")
    print(on_device("weights", tensors_of(model), device))
    conversations = list(range(args.conversations))
    if device.type != "cpu":
        run_engine(tk, model, tokenizer, device, [0], tokens=2, max_ctx=max_ctx)  # warm-up
    runs = [
        (
            t,
            run_engine(tk, t.model, tokenizer, t.device, conversations, tokens=args.tokens, max_ctx=max_ctx),
            run_engine(tk, t.model, tokenizer, t.device, [0], tokens=args.tokens, max_ctx=max_ctx),
        )
        for t in targets
    ]
    first, ref = runs
    print(first[1].cache_note)

    # Every target scores the reference's replies, so each position has the same history everywhere.
    replies = ref[1].ids
    ref_logits = teacher_forced_logits(tk, ref[0].model, tokenizer, conversations, replies, max_ctx=max_ctx)
    logits = teacher_forced_logits(tk, first[0].model, tokenizer, conversations, replies, max_ctx=max_ctx)
    worst = float((logits - ref_logits).abs().max())
    # Argmax flips are tolerated only off the CPU, and only at near ties (see compare_tokens).
    flips = device.type != "cpu"

    ok = True
    print()
    what = f"greedy tokens, {first[0].name} vs {ref[0].name}"
    ok &= compare_tokens(what, first[1].ids, ref[1].ids, ref_logits, flips_allowed=flips, slack=2 * worst)
    what = f"engine on {ref[0].name} vs argmax of a plain batched forward"
    plain = greedy(ref_logits, tokenizer.stop_ids)
    ok &= compare_tokens(what, ref[1].ids, plain, ref_logits, flips_allowed=False, slack=0)
    for t, batch, alone in runs:
        what = f"one conversation alone vs in the batch, {t.name}"
        tolerant = flips and t is first[0]
        ok &= compare_tokens(what, alone.ids, batch.ids[:1], ref_logits, flips_allowed=tolerant, slack=2 * worst)
    within = worst <= float(args.logit_atol)
    ok &= within
    verdict = "ok" if within else "FAIL"
    print(f"max |logit difference| {first[0].name} vs cpu, same tokens (prefill + batched decode, paged): "
          f"{worst:.3g} (allowed {args.logit_atol:g}): {verdict}")  # fmt: skip
    if len(conversations) > len(SYSTEMS):
        for t, batch, _ in runs:
            shared = batch.shared_hits > 0
            ok &= shared
            print(f"shared prefix blocks taken in the batch, {t.name}: {batch.shared_hits}: "
                  f"{'ok' if shared else 'FAIL (conversations with one system prompt shared nothing)'}")  # fmt: skip

    head = f"{'device':10s} {'conversations':>13s} {'tokens/s batched':>16s} {'tokens/s one':>12s} "
    print(
        f"\n{head}{'first token ms (one)':>20s} {'first token ms (batch p50)':>26s}   ({args.tokens} tokens per reply)"
    )
    for t, batch, alone in runs:
        first_one, first_batch = alone.first_token_s[0] * 1e3, statistics.median(batch.first_token_s) * 1e3
        print(
            f"{t.name:10s} {len(batch.ids):>13d} {batch.tokens_s():>16,.0f} {alone.tokens_s():>12,.0f} "
            f"{first_one:>20.1f} {first_batch:>26.1f}"
        )
    return ok


def tiny_checkpoints(families: list[str], folder: Path) -> list[Path]:
    """A tiny random checkpoint of each family, written into ``folder`` (needs transformers)."""
    from tests._checkpoints import write_tiny_llama

    with contextlib.suppress(ImportError):  # quiet: the progress bar of save_pretrained is noise here
        from transformers.utils import logging

        disable_progress_bar: Any = logging.disable_progress_bar  # untyped in transformers
        disable_progress_bar()
    return [write_tiny_llama(folder / f"tiny-{family}", family) for family in families]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", default="auto", help="auto (NPU, else CUDA, else CPU), npu, cuda or cpu")
    parser.add_argument("--conversations", type=int, default=16, help="conversations decoded together (16)")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per reply (32)")
    parser.add_argument("--max-ctx", type=int, default=512, help="positions per conversation, at most the model's")
    parser.add_argument("--logit-atol", type=float, default=1e-2, help="largest logit difference allowed (0.01)")
    parser.add_argument(
        "--families",
        default=",".join(FAMILIES),
        help=f"tiny random checkpoints to write and check besides the GPT-2 demo (comma-separated of "
        f"{', '.join(FAMILIES)}; empty for none; default all)",
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        action="append",
        default=[],
        help="check this checkpoint folder instead of the demo and the tiny ones (repeatable)",
    )
    args = parser.parse_args()
    if args.conversations < 1 or args.tokens < 1:
        parser.error("--conversations and --tokens must be positive")
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"--families: expected some of {', '.join(FAMILIES)}, given {', '.join(unknown)}")

    tk = import_toolkit()
    assert "tritonclient" not in sys.modules, "the toolkit pulled in tritonclient"
    available = tk.probe_accelerators()
    try:
        choice = tk.choose_device(available=available, force=args.device)
    except (RuntimeError, ValueError) as err:
        print(f"FAIL: {err} (accelerators: {available})")
        return 2
    device = tk.activate(choice, cpu_threads=None)
    print(f"accelerators: {available}; chosen: {choice} -> {device}")
    if args.device == "auto" and torch.cuda.is_available() and choice.kind != "cuda" and available.npu == 0:
        print("FAIL: CUDA is available but device choice did not pick it")
        return 1
    if device.type == "cpu":
        print("the device is the CPU: a smoke check (every check runs, CPU against CPU), not a device check")

    with tempfile.TemporaryDirectory(prefix="chat-device-check-") as folder:
        checkpoints = list(args.checkpoint)
        if not checkpoints:
            try:
                checkpoints = [DEMO, *tiny_checkpoints(families, Path(folder))]
            except ImportError as err:
                print(f"FAIL: writing the tiny checkpoints needs transformers ({err}); write them elsewhere with "
                      "`python -m tests._checkpoints DIR --family F` and pass --checkpoint DIR")  # fmt: skip
                return 2
        results = {str(c): check(tk, c, device, args) for c in checkpoints}
    print()
    for name, passed in results.items():
        print(f"{'ok  ' if passed else 'FAIL'} {name}")
    ok = all(results.values())
    print("\nOK" if ok else "\nFAIL: a check failed (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
