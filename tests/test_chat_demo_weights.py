"""The committed demo chat checkpoint: the contract's files, config and tokenizer, and a model that learned.

No server: the checkpoint is loaded the way the chat server model loads it (``load_gpt2``) and run
through the server's decoder (``forward_tables``). The thresholds compare the model with chance and
with the corpus; no generated text is written down here.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from tools.train_chat_model import (
    DEFAULT_OUT,
    SPECIAL_TOKENS,
    corpus_files,
    corpus_split,
    greedy_reply,
    held_out_sequences,
    reply_loss,
)
from triton_npu_client.server import GPT2, PagedKVCache, forward_tables, load_gpt2

CHECKPOINT = DEFAULT_OUT
FILES = ("config.json", "model.safetensors", "tokenizer.json")
PROMPTS = (
    "What is his name?",
    "Shall we walk in the garden this morning?",
    "I have had a letter from my sister.",
    "Do you think it will rain tomorrow?",
    "Tell me about your family.",
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(CHECKPOINT / "tokenizer.json"))


@pytest.fixture(scope="module")
def model() -> GPT2:
    return load_gpt2(CHECKPOINT)


def _words(text: str) -> list[str]:
    return [w.lower() for w in re.findall(r"[A-Za-z]+", text)]


def test_files_exist_and_fit_in_10_mb() -> None:
    sizes = {name: (CHECKPOINT / name).stat().st_size for name in FILES}
    assert all(size > 0 for size in sizes.values()), sizes
    assert sum(sizes.values()) <= 10 * 1000 * 1000, sizes
    # The docs beside the weights say plainly what they are.
    assert "tiny demo model" in (CHECKPOINT / "TRAINING.md").read_text(encoding="utf-8")


def test_config_matches_the_contract(tokenizer: Tokenizer) -> None:
    config = json.loads((CHECKPOINT / "config.json").read_text())
    assert config["model_type"] == "gpt2"
    assert config["architectures"] == ["GPT2LMHeadModel"]
    shape = (config["n_layer"], config["n_head"], config["n_embd"], config["n_positions"], config["n_ctx"])
    assert shape == (4, 4, 192, 1536, 1536)
    assert config["vocab_size"] == tokenizer.get_vocab_size() <= 4096
    assert config["activation_function"] == "gelu_new"
    end = tokenizer.token_to_id("<|end|>")
    assert config["bos_token_id"] == config["eos_token_id"] == end


def test_weights_are_float16_and_load_as_the_server_loads_them(model: GPT2, tokenizer: Tokenizer) -> None:
    with safe_open(str(CHECKPOINT / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        dtypes = {f.get_slice(key).get_dtype() for key in keys}
    assert dtypes == {"F16"}
    assert {"transformer.wte.weight", "transformer.wpe.weight", "transformer.h.3.mlp.c_proj.weight"} <= keys
    assert not any("lm_head" in key for key in keys)  # tied to wte, as in GPT-2

    vocab = tokenizer.get_vocab_size()
    assert model.dtype == torch.float32
    assert tuple(model.wte.shape) == (vocab, 192)
    assert tuple(model.wpe.shape) == (1536, 192)
    assert len(model.layers) == 4
    # Conv1D layout [in, out]: query, key and value side by side on the output axis.
    assert tuple(model.layers[0].attn_weight.shape) == (192, 3 * 192)
    assert tuple(model.layers[0].fc_weight.shape) == (192, 4 * 192)


def test_tokenizer_has_the_special_tokens_as_single_unsplit_ids(tokenizer: Tokenizer) -> None:
    ids = [tokenizer.token_to_id(token) for token in SPECIAL_TOKENS]
    assert None not in ids
    assert len(set(ids)) == len(SPECIAL_TOKENS)
    for token, token_id in zip(SPECIAL_TOKENS, ids, strict=True):
        assert tokenizer.encode(token, add_special_tokens=False).ids == [token_id]
    user = tokenizer.token_to_id("<|user|>")
    encoded = tokenizer.encode("Hello<|user|>there", add_special_tokens=False).ids
    assert encoded.count(user) == 1
    # Special tokens are not text: decoding skips them.
    assert tokenizer.decode(encoded) == "Hellothere"

    raw = json.loads((CHECKPOINT / "tokenizer.json").read_text(encoding="utf-8"))
    assert raw["model"]["type"] == "BPE"
    assert raw["pre_tokenizer"]["type"] == "ByteLevel"
    assert raw["pre_tokenizer"]["add_prefix_space"] is False
    assert raw["decoder"]["type"] == "ByteLevel"
    assert raw["post_processor"] is None  # nothing adds tokens around an encoded message
    added = {entry["content"]: entry["special"] for entry in raw["added_tokens"]}
    assert added == dict.fromkeys(SPECIAL_TOKENS, True)


@pytest.mark.parametrize(
    "text",
    [
        "It is a truth universally acknowledged.",
        "naïve café — 日本語",
        "emoji 🎉, tabs\tand\nnew lines",
        "  two leading spaces, one trailing ",
        "Ωμέγα ∑ ½ £20,000",
    ],
)
def test_tokenizer_round_trips_text(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert ids
    assert all(0 <= i < tokenizer.get_vocab_size() for i in ids)
    assert tokenizer.decode(ids) == text
    # Byte-level: no input is mapped to an unknown token, so no byte is lost.
    assert len(text.encode("utf-8")) >= len(ids)


def test_held_out_loss_is_far_below_chance_and_below_token_frequencies(model: GPT2, tokenizer: Tokenizer) -> None:
    train, held = corpus_split()
    seen = {p for book in train for p in book}
    # The held-out slice really was held out (short lines such as "Yes." recur anywhere in a novel).
    assert not [p for book in held for p in book if len(p) > 80 and p in seen]

    total, count = 0.0, 0
    reply_tokens: list[int] = []
    for ids, start in held_out_sequences(tokenizer, held, per_book=10):
        cache = PagedKVCache.for_model(model, num_blocks=-(-len(ids) // 16))
        with torch.no_grad():
            logits = forward_tables(model, cache, [cache.new_table()], torch.tensor([ids]), all_logits=True)[0]
        summed, n = reply_loss(logits, ids, start)
        total, count = total + summed, count + n
        reply_tokens += ids[start:]
    assert count > 500
    loss = total / count
    vocab = tokenizer.get_vocab_size()
    assert loss < 0.6 * math.log(vocab)
    # Stricter: it beats the best model that knows only how often each token occurs (the entropy of
    # these very replies' token frequencies), so it uses the context.
    frequencies = Counter(reply_tokens)
    unigram = -sum(c * math.log(c / count) for c in frequencies.values()) / count
    assert loss < unigram - 0.5, (loss, unigram)


def test_greedy_replies_are_made_of_corpus_words_and_end(model: GPT2, tokenizer: Tokenizer) -> None:
    known = {w for path in corpus_files() for w in _words(path.read_text(encoding="utf-8"))}
    words: list[str] = []
    ended = 0
    for prompt in PROMPTS:
        text, stopped = greedy_reply(model, tokenizer, [("user", prompt)], max_tokens=120)
        words += _words(text)
        ended += stopped
    assert len(words) >= 3 * len(PROMPTS)
    share = sum(w in known for w in words) / len(words)
    assert share >= 0.8, (share, words)
    # The model learned the template's other half: a reply stops with <|end|> (the server's "stop").
    assert ended > len(PROMPTS) // 2, ended
