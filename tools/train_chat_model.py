"""Train the demo chat model: a tiny GPT-2 and its byte-level BPE tokenizer, on CPU, in minutes.

This is a DEMO model (about 3M parameters, trained for minutes on six Jane Austen novels): its replies
are English-like text in an early-19th-century voice, not answers. It exists so that the chat server
model has real weights to stream from, with the tokenizer and chat template it would have in production.

Writes ``config.json``, ``model.safetensors`` (float16, Hugging Face GPT-2 key names and layouts) and
``tokenizer.json`` into ``--out`` (default ``server_models/chat/demo_gpt2/``), plus ``TRAINING.md``
saying how they were made. Then checks the saved folder through ``triton_npu_client.server.load_gpt2``
(logits must match the training module's) and prints a few greedy replies through the chat template.

The defaults reproduce the committed checkpoint (same seed, steps and thread count; bit-exact only on
the same CPU kind and torch version, as float reductions may differ elsewhere)::

    .venv/bin/python tools/train_chat_model.py

Held out from the tokenizer and the model: the last :data:`HELD_OUT_FRACTION` of each book's
paragraphs (see :func:`corpus_split`); ``tests/test_chat_demo_weights.py`` measures the loss there.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
CORPUS_DIR = ROOT / "tools" / "chat_corpus"
DEFAULT_OUT = ROOT / "server_models" / "chat" / "demo_gpt2"

END, SYSTEM, USER, ASSISTANT = "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = (END, SYSTEM, USER, ASSISTANT)
ROLE_TOKENS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}

# The last 3% of each book's paragraphs (its closing pages) never reach the tokenizer or the model.
HELD_OUT_FRACTION = 0.03

# System messages the pseudo-dialogues sometimes open with. The replies do not depend on them (the
# corpus has no instructions to follow); they teach the model that a system turn may come first.
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a demo chat model that has read the novels of Jane Austen.",
    "Answer as a character in an English novel would.",
    "You are a friendly companion. Keep the conversation going.",
    "Reply politely.",
)

# Reply and user-message lengths in characters: long enough for a few sentences, short enough that
# most training conversations show the <|end|> that stops a reply.
MAX_REPLY_CHARS = 420
MAX_USER_CHARS = 300

Message = tuple[str, str]  # (role, text)

IGNORE = -100  # cross-entropy's ignore_index: a target the model is not trained on


# ---------------------------------------------------------------------------------------------- corpus


def _clean_paragraph(lines: Sequence[str]) -> str:
    text = " ".join(line.strip() for line in lines)
    # Underscores mark italics in these transcriptions; the model should not learn to emit them.
    text = text.replace("_", "")
    return re.sub(r"\s+", " ", text).strip()


_HEADING = re.compile(r"^(chapter|volume)\s+[0-9ivxlc]+\.?$", re.IGNORECASE)
_ENDING = re.compile(r"^(the end|finis)$", re.IGNORECASE)


def book_paragraphs(path: Path) -> list[str]:
    """The paragraphs of one book, unwrapped, from its first chapter heading to its last line of text.

    The title page and chapter headings are dropped; so are the underscores that mark italics.
    """
    blocks: list[list[str]] = [[]]
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            blocks[-1].append(line)
        elif blocks[-1]:
            blocks.append([])
    paragraphs = [_clean_paragraph(block) for block in blocks if block]
    first = next(i for i, p in enumerate(paragraphs) if _HEADING.match(p))
    kept = []
    for paragraph in paragraphs[first:]:
        if _ENDING.match(paragraph):
            break
        # Headings and other lines with no lowercase letter (VOLUME II, ornaments) are not prose.
        if _HEADING.match(paragraph) or not re.search("[a-z]", paragraph):
            continue
        kept.append(paragraph)
    return kept


def corpus_files(corpus_dir: Path = CORPUS_DIR) -> list[Path]:
    """The corpus's text files, in a fixed order."""
    files = sorted(corpus_dir.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no *.txt corpus files in {corpus_dir}")
    return files


def corpus_split(corpus_dir: Path = CORPUS_DIR) -> tuple[list[list[str]], list[list[str]]]:
    """Each book's paragraphs split into (training, held out): the held-out part is its last 3%."""
    train, held = [], []
    for path in corpus_files(corpus_dir):
        paragraphs = book_paragraphs(path)
        cut = len(paragraphs) - max(1, round(len(paragraphs) * HELD_OUT_FRACTION))
        train.append(paragraphs[:cut])
        held.append(paragraphs[cut:])
    return train, held


# Sentence ends: . ! ? (maybe inside a closing quote) followed by space and a capital or a quote.
_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"']))\s+(?=[\"'A-Z])")
_TITLES = ("Mr.", "Mrs.", "Dr.", "St.", "Col.", "Capt.")


def sentences(paragraph: str) -> list[str]:
    """Split a paragraph into sentences (good enough for prose; titles such as "Mr." do not end one)."""
    out: list[str] = []
    for piece in _SENTENCE_END.split(paragraph):
        if out and out[-1].endswith(_TITLES):
            out[-1] = f"{out[-1]} {piece}"
        else:
            out.append(piece)
    return out


def _unquote(text: str) -> str:
    # A paragraph that is one quoted speech reads as what a person would type, without the quotes.
    if text.count('"') == 2 and text.startswith('"') and text.endswith('"'):
        return text[1:-1].strip()
    return text


def reply_text(paragraph: str, max_chars: int = MAX_REPLY_CHARS) -> str:
    """An assistant message: the paragraph's first sentences, at least one, up to ``max_chars``."""
    parts = sentences(paragraph)
    kept = [parts[0]]
    for part in parts[1:]:
        if len(" ".join([*kept, part])) > max_chars:
            break
        kept.append(part)
    return _unquote(" ".join(kept))


def user_text(paragraph: str, take: int = 1, max_chars: int = MAX_USER_CHARS) -> str:
    """A user message: the paragraph's last ``take`` sentences (fewer if they pass ``max_chars``)."""
    parts = sentences(paragraph)
    kept = [parts[-1]]
    for part in reversed(parts[:-1]):
        if len(kept) >= take or len(" ".join([part, *kept])) > max_chars:
            break
        kept.insert(0, part)
    return _unquote(" ".join(kept))


def pseudo_dialogues(book: Sequence[str], rng: random.Random) -> list[list[Message]]:
    """Conversations made from consecutive paragraphs: each user message is followed by the next paragraph.

    About one in seven opens with a system message; about a quarter have two or three turns.
    """
    conversations = []
    i = rng.randrange(2)  # passes with different seeds pair the paragraphs differently
    while i + 1 < len(book):
        messages: list[Message] = []
        if rng.random() < 0.15:
            messages.append(("system", rng.choice(SYSTEM_PROMPTS)))
        turns = 1 if rng.random() < 0.75 else rng.choice((2, 3))
        for _ in range(turns):
            if i + 1 >= len(book):
                break
            messages.append(("user", user_text(book[i], take=rng.choice((1, 1, 2)))))
            messages.append(("assistant", reply_text(book[i + 1])))
            i += 2
        conversations.append(messages)
    return conversations


# ------------------------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE (GPT-2 style, no prefix space) with the chat template's special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte, seen in the corpus or not, so that any UTF-8 text encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def special_id(tokenizer: Tokenizer, token: str) -> int:
    """The id of a special token; raises ``KeyError`` if the tokenizer lacks it."""
    found = tokenizer.token_to_id(token)
    if found is None:
        raise KeyError(f"tokenizer has no {token!r}")
    return int(found)


def encode_messages(tokenizer: Tokenizer, messages: Sequence[Message], *, prompt: bool = False) -> list[int]:
    """The chat template: ``<|role|> + encode(text) + <|end|>`` per message, then ``<|assistant|>`` if ``prompt``."""
    end = special_id(tokenizer, END)
    encoded = tokenizer.encode_batch([text for _, text in messages], add_special_tokens=False)
    ids: list[int] = []
    for (role, _), enc in zip(messages, encoded, strict=True):
        ids += [special_id(tokenizer, ROLE_TOKENS[role]), *enc.ids, end]
    if prompt:
        ids.append(special_id(tokenizer, ASSISTANT))
    return ids


# ----------------------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class ModelShape:
    """The GPT-2 hyperparameters this script trains (the chat contract's demo checkpoint)."""

    vocab_size: int
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 192
    n_positions: int = 1536
    layer_norm_epsilon: float = 1e-5


class Conv1D(nn.Module):
    """GPT-2's linear layer: weight stored [in, out], so checkpoints load without a transpose."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


class Attention(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.n_head = shape.n_head
        self.c_attn = Conv1D(shape.n_embd, 3 * shape.n_embd)
        self.c_proj = Conv1D(shape.n_embd, shape.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, steps, width = x.shape
        q, k, v = self.c_attn(x).view(batch, steps, 3, self.n_head, width // self.n_head).unbind(2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        projected: torch.Tensor = self.c_proj(out.transpose(1, 2).reshape(batch, steps, width))
        return projected


class MLP(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.c_fc = Conv1D(shape.n_embd, 4 * shape.n_embd)
        self.c_proj = Conv1D(4 * shape.n_embd, shape.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))
        return out


class Block(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(shape.n_embd, eps=shape.layer_norm_epsilon)
        self.attn = Attention(shape)
        self.ln_2 = nn.LayerNorm(shape.n_embd, eps=shape.layer_norm_epsilon)
        self.mlp = MLP(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        out: torch.Tensor = x + self.mlp(self.ln_2(x))
        return out


class Transformer(nn.Module):
    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.wte = nn.Embedding(shape.vocab_size, shape.n_embd)
        self.wpe = nn.Embedding(shape.n_positions, shape.n_embd)
        self.h = nn.ModuleList(Block(shape) for _ in range(shape.n_layer))
        self.ln_f = nn.LayerNorm(shape.n_embd, eps=shape.layer_norm_epsilon)


class TinyGPT2(nn.Module):
    """GPT-2 with Hugging Face's parameter names (``transformer.h.0.attn.c_attn.weight``, ...).

    The output projection is ``wte`` itself (tied), as in GPT-2, so the checkpoint has no lm_head.
    """

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.shape = shape
        self.transformer = Transformer(shape)
        # GPT-2's initialisation: N(0, 0.02), with the projections into the residual stream scaled
        # down by the depth so that the stream's variance does not grow with the layer count.
        for name, param in self.named_parameters():
            if name.endswith(("c_attn.weight", "c_fc.weight", "wte.weight", "wpe.weight")):
                nn.init.normal_(param, std=0.02)
            elif name.endswith("c_proj.weight"):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * shape.n_layer))

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [batch, T, vocab] for tokens ``idx`` [batch, T] at ``positions`` (default 0..T-1)."""
        t = self.transformer
        if positions is None:
            positions = torch.arange(idx.shape[1], device=idx.device)
        x = t.wte(idx) + t.wpe(positions)
        for block in t.h:
            x = block(x)
        return F.linear(t.ln_f(x), t.wte.weight)


def hf_config(shape: ModelShape, end_id: int) -> dict[str, object]:
    """``config.json`` in Hugging Face GPT-2 form."""
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": shape.vocab_size,
        "n_layer": shape.n_layer,
        "n_head": shape.n_head,
        "n_embd": shape.n_embd,
        "n_positions": shape.n_positions,
        "n_ctx": shape.n_positions,
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": shape.layer_norm_epsilon,
        "initializer_range": 0.02,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "bos_token_id": end_id,
        "eos_token_id": end_id,
        "torch_dtype": "float16",
    }


# -------------------------------------------------------------------------------------------- training


@dataclass(frozen=True)
class TokenStream:
    """Conversations laid end to end as one token sequence, with the offset where each one starts.

    ``learn[i]`` is False where token ``i`` is part of a system message (its text and closing
    ``<|end|>``): the model reads system messages but is never taught to write them, so that their
    few, often repeated sentences do not leak into replies.
    """

    tokens: torch.Tensor  # int64 [N]
    learn: torch.Tensor  # bool [N]
    starts: torch.Tensor  # int64 [conversations]


def build_stream(tokenizer: Tokenizer, books: Sequence[Sequence[str]], seed: int, passes: int) -> TokenStream:
    """``passes`` rounds of pseudo-dialogues over every book, each round paired and framed afresh."""
    rng = random.Random(seed)
    conversations = [c for _ in range(passes) for book in books for c in pseudo_dialogues(book, rng)]
    rng.shuffle(conversations)
    end = special_id(tokenizer, END)
    role_ids = {role: special_id(tokenizer, token) for role, token in ROLE_TOKENS.items()}
    flat = [text for c in conversations for _, text in c]
    encoded = iter(tokenizer.encode_batch(flat, add_special_tokens=False))
    tokens: list[int] = []
    learn: list[bool] = []
    starts: list[int] = []
    for conversation in conversations:
        starts.append(len(tokens))
        for role, _ in conversation:
            ids = next(encoded).ids
            tokens += [role_ids[role], *ids, end]
            learn += [True] + [role != "system"] * (len(ids) + 1)
    return TokenStream(
        torch.tensor(tokens, dtype=torch.long),
        torch.tensor(learn, dtype=torch.bool),
        torch.tensor(starts, dtype=torch.long),
    )


def sample_batch(
    stream: TokenStream, batch: int, seq_len: int, n_positions: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``batch`` windows that each begin at a conversation's start: (inputs, targets, positions).

    Targets the model must not learn (system text) are -100, cross-entropy's ignore index. Half the
    rows sit at positions 0..seq_len-1, where a server's conversations start; the other half at a
    random offset, so that every row of ``wpe`` up to ``n_positions`` is trained although no window is
    longer than ``seq_len`` (the server may hold a conversation that long).
    """
    usable = stream.starts[stream.starts + seq_len + 1 <= stream.tokens.numel()]
    picks = usable[torch.randint(usable.numel(), (batch,), generator=generator)].tolist()
    windows = torch.stack([stream.tokens[s : s + seq_len + 1] for s in picks])
    learn = torch.stack([stream.learn[s + 1 : s + seq_len + 1] for s in picks])
    targets = windows[:, 1:].masked_fill(~learn, IGNORE)
    offsets = torch.randint(n_positions - seq_len + 1, (batch, 1), generator=generator)
    offsets[: batch // 2] = 0
    positions = offsets + torch.arange(seq_len)
    return windows[:, :-1], targets, positions


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


# ------------------------------------------------------------------------------- evaluation and checks


def held_out_sequences(
    tokenizer: Tokenizer, held: Sequence[Sequence[str]], per_book: int
) -> list[tuple[list[int], int]]:
    """Held-out pseudo-dialogues, made without randomness: (token ids, index of the reply's first token).

    From each book's held-out paragraphs, its first ``per_book`` pairs (user: a paragraph's last
    sentence; assistant: the next paragraph), each as ``<|user|>..<|end|><|assistant|>..<|end|>``.
    """
    out = []
    for book in held:
        for i in range(0, min(2 * per_book, len(book) - 1), 2):
            prompt = encode_messages(tokenizer, [("user", user_text(book[i]))], prompt=True)
            reply = tokenizer.encode(reply_text(book[i + 1]), add_special_tokens=False).ids
            out.append(([*prompt, *reply, special_id(tokenizer, END)], len(prompt)))
    return out


def reply_loss(logits: torch.Tensor, ids: Sequence[int], reply_start: int) -> tuple[float, int]:
    """Summed cross-entropy of the reply tokens (its closing ``<|end|>`` included) and their count.

    ``logits`` are [len(ids), vocab] from a forward pass over ``ids``.
    """
    targets = torch.tensor(ids[reply_start:], dtype=torch.long)
    predicted = logits[reply_start - 1 : len(ids) - 1].float()
    return float(F.cross_entropy(predicted, targets, reduction="sum")), len(targets)


def greedy_reply(model: object, tokenizer: Tokenizer, messages: Sequence[Message], max_tokens: int) -> tuple[str, bool]:
    """Greedy reply through the chat template with the server's decoder: (text, whether it ended with <|end|>).

    ``model`` is a :class:`triton_npu_client.server.GPT2` from ``load_gpt2``.
    """
    from triton_npu_client.server import GPT2, PagedKVCache, forward_tables

    assert isinstance(model, GPT2)
    prompt = encode_messages(tokenizer, messages, prompt=True)
    end = special_id(tokenizer, END)
    positions = min(model.config.n_positions, len(prompt) + max_tokens)
    cache = PagedKVCache.for_model(model, num_blocks=-(-positions // 16))
    table = cache.new_table()
    with torch.no_grad():
        logits = forward_tables(model, cache, [table], torch.tensor([prompt]))
        reply: list[int] = []
        for _ in range(max_tokens):
            token = int(logits[0].argmax())
            if token == end:
                return tokenizer.decode(reply), True
            reply.append(token)
            if len(reply) == max_tokens:
                break
            logits = forward_tables(model, cache, [table], torch.tensor([[token]]))
    return tokenizer.decode(reply), False


SAMPLE_PROMPTS: tuple[tuple[Message, ...], ...] = (
    (("user", "What is his name?"),),
    (("system", SYSTEM_PROMPTS[0]), ("user", "Shall we walk in the garden this morning?")),
    (("user", "I have had a letter from my sister."),),
    (("user", "Hello! How are you today?"),),
)


def check_saved(out: Path, module: TinyGPT2, tokenizer: Tokenizer, sample: Sequence[int]) -> float:
    """Load ``out`` as the server does and compare its logits with ``module``'s (weights rounded to fp16).

    Returns the largest absolute difference; raises ``AssertionError`` past 1e-3.
    """
    from triton_npu_client.server import PagedKVCache, forward_tables, load_gpt2

    rounded = copy.deepcopy(module).eval()
    with torch.no_grad():
        for param in rounded.parameters():
            param.copy_(param.half().float())
        expected = rounded(torch.tensor([list(sample)]))[0]
        served = load_gpt2(out)
        cache = PagedKVCache.for_model(served, num_blocks=4)
        got = forward_tables(served, cache, [cache.new_table()], torch.tensor([list(sample)]), all_logits=True)[0]
    diff = float((got - expected).abs().max())
    assert diff < 1e-3, f"saved model's logits differ from the training module's by {diff}"
    return diff


# ---------------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="checkpoint folder to write")
    parser.add_argument("--corpus", type=Path, default=CORPUS_DIR, help="folder of UTF-8 *.txt books")
    parser.add_argument("--steps", type=int, default=1400, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256, help="training window in tokens")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=100, help="warm-up steps")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--passes", type=int, default=2, help="pseudo-dialogue rounds over the corpus")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--log-every", type=int, default=50)
    return parser.parse_args(argv)


def _parameter_groups(module: nn.Module, weight_decay: float) -> list[dict[str, object]]:
    # Decay matrices only: shrinking biases and LayerNorm gains only fights the normalisation.
    matrices = [p for p in module.parameters() if p.dim() >= 2]
    others = [p for p in module.parameters() if p.dim() < 2]
    return [{"params": matrices, "weight_decay": weight_decay}, {"params": others, "weight_decay": 0.0}]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    train_books, held_books = corpus_split(args.corpus)
    train_paragraphs = [p for book in train_books for p in book]
    tokenizer = train_tokenizer([*SYSTEM_PROMPTS, *train_paragraphs], args.vocab_size)
    vocab = tokenizer.get_vocab_size()
    stream = build_stream(tokenizer, train_books, args.seed, args.passes)
    print(
        f"corpus: {len(train_paragraphs)} training paragraphs in {len(train_books)} books; "
        f"vocab {vocab}; stream {stream.tokens.numel()} tokens in {stream.starts.numel()} conversations "
        f"({time.monotonic() - started:.1f}s)",
        flush=True,
    )

    shape = ModelShape(vocab_size=vocab)
    model = TinyGPT2(shape)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(_parameter_groups(model, 0.1), lr=args.lr, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(args.seed)
    tokens_per_step = args.batch_size * args.seq_len
    print(f"model: {params} parameters; {args.steps} steps of {tokens_per_step} tokens", flush=True)

    model.train()
    smoothed = float("nan")
    train_started = time.monotonic()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr, args.warmup)
        inputs, targets, positions = sample_batch(stream, args.batch_size, args.seq_len, shape.n_positions, generator)
        logits = model(inputs, positions)
        loss = F.cross_entropy(logits.view(-1, vocab), targets.reshape(-1), ignore_index=IGNORE)
        optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        value = float(loss.detach())
        smoothed = value if math.isnan(smoothed) else 0.95 * smoothed + 0.05 * value
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            elapsed = time.monotonic() - train_started
            print(
                f"step {step + 1}/{args.steps} loss {value:.3f} (smoothed {smoothed:.3f}) "
                f"{(step + 1) * tokens_per_step / elapsed:.0f} tok/s {elapsed:.0f}s",
                flush=True,
            )
    train_seconds = time.monotonic() - train_started
    model.eval()

    # Held-out loss, measured with the training module in float32 (the test measures the saved one).
    with torch.no_grad():
        total, count = 0.0, 0
        for ids, reply_start in held_out_sequences(tokenizer, held_books, per_book=40):
            summed, n = reply_loss(model(torch.tensor([ids]))[0], ids, reply_start)
            total, count = total + summed, count + n
    held_loss = total / count
    print(f"held-out reply loss {held_loss:.3f} over {count} tokens (ln(vocab) = {math.log(vocab):.3f})", flush=True)

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    end_id = special_id(tokenizer, END)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "config.json").write_text(json.dumps(hf_config(shape, end_id), indent=2) + "\n")
    weights = {name: value.detach().half().contiguous() for name, value in model.state_dict().items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})

    sample = encode_messages(tokenizer, SAMPLE_PROMPTS[1], prompt=True)[:64]
    diff = check_saved(out, model, tokenizer, sample)
    print(f"saved-model check: max |logit difference| {diff:.2e} (< 1e-3)", flush=True)

    from triton_npu_client.server import load_gpt2

    served = load_gpt2(out)
    samples = []
    for messages in SAMPLE_PROMPTS:
        text, stopped = greedy_reply(served, tokenizer, messages, max_tokens=60)
        samples.append((messages[-1][1], text, stopped))
        print(
            f"user: {messages[-1][1]!r}\n  reply ({'ended' if stopped else 'cut at 60 tokens'}): {text!r}", flush=True
        )

    total_seconds = time.monotonic() - started
    sizes = {name: (out / name).stat().st_size for name in ("config.json", "model.safetensors", "tokenizer.json")}
    _write_training_md(
        out, args, vocab, params, stream, smoothed, held_loss, train_seconds, total_seconds, sizes, samples
    )
    print(f"wrote {out} ({sum(sizes.values()) / 1e6:.2f} MB) in {total_seconds:.0f}s", flush=True)
    return 0


def _write_training_md(
    out: Path,
    args: argparse.Namespace,
    vocab: int,
    params: int,
    stream: TokenStream,
    final_loss: float,
    held_loss: float,
    train_seconds: float,
    total_seconds: float,
    sizes: dict[str, int],
    samples: Sequence[tuple[str, str, bool]],
) -> None:
    books = ", ".join(p.name for p in corpus_files(args.corpus))
    defaults = vars(parse_args([]))
    changed = " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "corpus") and v != defaults[k]
    )
    files = ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in sizes.items())
    specials = ", ".join(f"`{t}`" for t in SPECIAL_TOKENS)
    lines = [
        "# Demo chat model: how it was trained",
        "",
        "**This is a tiny demo model**, trained for minutes on a CPU. Its replies are English-like text in",
        "the voice of Jane Austen's narrators and characters; they are not answers, facts or advice. It exists",
        "so that the `chat` server model streams from real weights through a real tokenizer and chat template.",
        "",
        f"- Command (from the repository root): `python tools/train_chat_model.py{(' ' + changed) if changed else ''}`",
        f"- Corpus: `tools/chat_corpus/` ({books}); its README.md gives the source and licence",
        f"- Held out: the last {HELD_OUT_FRACTION:.0%} of each book's paragraphs (seen by neither tokenizer nor model)",
        f"- Tokenizer: byte-level BPE, {vocab} tokens, special tokens {specials}",
        f"- Model: GPT-2, {params:,} parameters (4 layers, 4 heads, width 192, 1536 positions), stored as float16",
        f"- Training text: {stream.starts.numel():,} dialogues ({stream.tokens.numel():,} tokens) in the chat template",
        f"- Steps: {args.steps} of {args.batch_size} x {args.seq_len} tokens, AdamW, peak learning rate {args.lr}",
        f"- Seed {args.seed}, {args.threads} CPU threads",
        f"- Final training loss (smoothed): {final_loss:.3f}",
        f"- Held-out reply loss: {held_loss:.3f} per token (ln(vocab) = {math.log(vocab):.3f})",
        f"- Time: {train_seconds:.0f} s of training, {total_seconds:.0f} s in all",
        f"- Files: {files}",
        "",
        "Greedy replies (temperature 0) to single prompts:",
        "",
    ]
    for prompt, text, stopped in samples:
        lines.append(f"- user: {prompt!r} -> {text!r}{'' if stopped else ' (cut at 60 tokens)'}")
    (out / "TRAINING.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
