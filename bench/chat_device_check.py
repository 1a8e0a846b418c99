"""Check the chat engine on an accelerator: weights and KV cache on the device, batched greedy decode vs CPU.

Run from the repository root with torch, safetensors and tokenizers (no tritonclient, no Triton)::

    PYTHONPATH=. python bench/chat_device_check.py [--device auto|npu|cuda|cpu] [--conversations 16] [--tokens 32]

It loads the demo checkpoint (server_models/chat/demo_gpt2) on the device a model instance would pick
(NPU, else CUDA, else CPU; ``--device`` forces one), asserts every weight and every KV-cache tensor lives
there, and drives the real :class:`ChatEngine` in a pass-by-pass StepLoop (as the model does inside
Triton): N conversations at once (batched decode), then one alone. The same runs on CPU are the
reference (when the device is the CPU there is no second run). Checks, each printed:

- greedy tokens on the device equal CPU's. On an accelerator a float difference may flip an argmax where
  two logits nearly tie: such a position is reported (conversation, position, the CPU top-2 gap) and
  passes only when the gap is within twice the largest logit difference; on CPU every token must match;
- the logits of the same token sequences (teacher-forced: the CPU reply fed back) differ by at most
  ``--logit-atol`` between the device and CPU;
- the engine's greedy tokens are the argmax of a plain batched forward (CPU), and a conversation decoded
  alone gives the tokens it gets in the batch.

Then a table: device, conversations, tokens/s batched, tokens/s one conversation, time to first token
(one conversation alone; median in the batch). Exits 1 on a failed check, 2 when the device is absent.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

# bench/ is a folder of scripts, not a package: device_check.py holds the tritonclient-free toolkit import.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from device_check import import_toolkit

CHECKPOINT = Path(__file__).resolve().parents[1] / "server_models" / "chat" / "demo_gpt2"
FINAL = 1  # stands in for pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
SYSTEMS = [
    "You are a polite young lady in a country house.",
    "You are an old sailor who has seen every port.",
    "You are a careful gardener; answer briefly.",
    "You are the village schoolmaster.",
    "You are a cheerful cook.",
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
    """Greedy reply ids per conversation, and how long the run took."""

    ids: list[list[int]]
    seconds: float
    first_token_s: list[float]
    cache_note: str

    def tokens_s(self) -> float:
        return sum(map(len, self.ids)) / self.seconds


def on_device(name: str, tensors: list[torch.Tensor], device: torch.device) -> str:
    """Assert every tensor lives on ``device``; a one-line summary."""
    wrong = [i for i, t in enumerate(tensors) if t.device != device]
    assert not wrong, (
        f"{name}: {len(wrong)} of {len(tensors)} tensors not on {device} (first on {tensors[wrong[0]].device})"
    )
    return f"{name}: {len(tensors)} tensors on {device}"


def weights(model: Any) -> list[torch.Tensor]:
    layers = [getattr(layer, f.name) for layer in model.layers for f in dataclasses.fields(layer)]
    return [model.wte, model.wpe, model.ln_f_weight, model.ln_f_bias, *layers]


def run_engine(
    tk: Any, model: Any, tokenizer: Any, device: torch.device, conversations: list[int], *, tokens: int, max_ctx: int
) -> EngineRun:
    """The conversations' first turns, all submitted at once, through ChatEngine in a StepLoop driven here."""
    cache = tk.KVCache.allocate(model, slots=len(conversations), max_ctx=max_ctx)
    cache_note = on_device(f"KV cache {list(cache.keys[0].shape)} per layer", [*cache.keys, *cache.values], device)
    engine = tk.ChatEngine(
        model,
        tokenizer,
        cache,
        tk.SequenceSlots(capacity=len(conversations), idle_timeout_s=3600.0),
        respond=lambda response: response,
        refuse=lambda kind, message: ("refused", kind, message),
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
    firsts = [s.first_at - start for s in senders if s.first_at is not None]
    return EngineRun(
        ids=[list(t.reply_ids) for t in turns], seconds=seconds, first_token_s=firsts, cache_note=cache_note
    )


def teacher_forced_logits(
    tk: Any, model: Any, tokenizer: Any, conversations: list[int], replies: list[list[int]], *, max_ctx: int
) -> torch.Tensor:
    """Logits [conversations, tokens, vocab] (on the host) that chose each reply token, given ``replies``.

    Prefill each prompt in its own slot, then decode every conversation together, feeding the given
    reply tokens: the same token sequences on every device, whatever each device would have chosen.
    """
    cache = tk.KVCache.allocate(model, slots=len(conversations), max_ctx=max_ctx)
    first = []
    for slot, i in enumerate(conversations):
        roles, texts = messages(i)
        prompt = [t for r, x in zip(roles, texts, strict=True) for t in tokenizer.encode_message(tk.ChatMessage(r, x))]
        prompt.append(tokenizer.role_ids["assistant"])
        first.append(tk.gpt2_forward(model, cache, [slot], torch.tensor([prompt], dtype=torch.long))[0])
    steps = [torch.stack(first)]
    for t in range(len(replies[0]) - 1):
        fed = torch.tensor([[reply[t]] for reply in replies], dtype=torch.long)
        steps.append(tk.gpt2_forward(model, cache, list(range(len(conversations))), fed))
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


def check(tk: Any, device: torch.device, args: argparse.Namespace, *, with_reference: bool) -> bool:
    """Load, run and compare; print the checks and the table. ``with_reference``: also run on CPU and compare."""
    tokenizer = tk.ChatTokenizer(args.checkpoint)
    cpu = torch.device("cpu")
    targets = [Target(name=str(device), device=device, model=tk.load_gpt2(args.checkpoint, device=device))]
    if with_reference:
        targets.append(Target(name="cpu (ref)", device=cpu, model=tk.load_gpt2(args.checkpoint, device=cpu)))
    print(on_device("weights", weights(targets[0].model), device))
    conversations = list(range(args.conversations))
    if device.type != "cpu":
        run_engine(tk, targets[0].model, tokenizer, device, [0], tokens=2, max_ctx=args.max_ctx)  # warm-up
    runs = [
        (
            t,
            run_engine(tk, t.model, tokenizer, t.device, conversations, tokens=args.tokens, max_ctx=args.max_ctx),
            run_engine(tk, t.model, tokenizer, t.device, [0], tokens=args.tokens, max_ctx=args.max_ctx),
        )
        for t in targets
    ]
    first, ref = runs[0], runs[-1]  # the device's runs, and the CPU reference's (the same on a CPU-only run)
    print(first[1].cache_note)

    # Every target scores the reference's replies, so each position has the same history everywhere.
    replies = ref[1].ids
    ref_logits = teacher_forced_logits(tk, ref[0].model, tokenizer, conversations, replies, max_ctx=args.max_ctx)
    worst = 0.0
    if with_reference:
        logits = teacher_forced_logits(tk, first[0].model, tokenizer, conversations, replies, max_ctx=args.max_ctx)
        worst = float((logits - ref_logits).abs().max())
    # Argmax flips are tolerated only off the CPU, and only at near ties (see compare_tokens).
    flips = device.type != "cpu"

    ok = True
    print()
    if with_reference:
        what = f"greedy tokens, {first[0].name} vs {ref[0].name}"
        ok &= compare_tokens(what, first[1].ids, ref[1].ids, ref_logits, flips_allowed=flips, slack=2 * worst)
    else:
        print("greedy tokens, device vs cpu: the device is the CPU (no second run to compare)")
    what = f"engine on {ref[0].name} vs argmax of a plain batched forward"
    plain = greedy(ref_logits, tokenizer.stop_ids)
    ok &= compare_tokens(what, ref[1].ids, plain, ref_logits, flips_allowed=False, slack=0)
    for t, batch, alone in runs:
        what = f"one conversation alone vs in the batch, {t.name}"
        tolerant = flips and t is first[0]
        ok &= compare_tokens(what, alone.ids, batch.ids[:1], ref_logits, flips_allowed=tolerant, slack=2 * worst)
    if with_reference:
        within = worst <= args.logit_atol
        ok &= within
        verdict = "ok" if within else "FAIL"
        limit = f"allowed {args.logit_atol:g}"
        print(f"max |logit difference| {first[0].name} vs cpu, same tokens: {worst:.3g} ({limit}): {verdict}")

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", default="auto", help="auto (NPU, else CUDA, else CPU), npu, cuda or cpu")
    parser.add_argument("--conversations", type=int, default=16, help="conversations decoded together (16)")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per reply (32)")
    parser.add_argument("--max-ctx", type=int, default=512, help="KV-cache positions per conversation (512)")
    parser.add_argument("--logit-atol", type=float, default=1e-2, help="largest logit difference allowed (0.01)")
    parser.add_argument("--checkpoint", type=Path, default=CHECKPOINT, help="checkpoint folder (the demo one)")
    args = parser.parse_args()
    if args.conversations < 1 or args.tokens < 1:
        parser.error("--conversations and --tokens must be positive")

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
    ok = check(tk, device, args, with_reference=device.type != "cpu")
    print("\nOK" if ok else "\nFAIL: a check failed (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
