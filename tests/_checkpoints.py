"""Tiny random Llama-family checkpoints written as Hugging Face folders, without any download.

:func:`write_tiny_llama` writes what a deployed Llama 3, Qwen2 or Mistral checkpoint folder holds, at toy size:
``config.json`` and ``model.safetensors`` (or shards with their index) saved by ``transformers``' own
``*ForCausalLM.save_pretrained``, ``generation_config.json`` whose ``eos_token_id`` is the list of end-of-turn
ids, a byte-level BPE ``tokenizer.json`` trained here on a built-in corpus with the family's special tokens,
and ``tokenizer_config.json`` with the bos/eos tokens and a chat template.

By default ``config.json`` keeps the rope settings the way the checkpoints on the Hub do (``rope_theta`` at the
top level and ``rope_scaling``), not the ``rope_parameters`` transformers 5 writes; both load in transformers.
The Llama and Mistral tokenizers prepend their bos token on a plain encode, as the real ones do (Qwen2's does
not); chat templates put it in the text themselves.

Runnable: ``python -m tests._checkpoints DIR [--family llama|qwen2|mistral] [--shards N] [--seed S]``.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["FAMILIES", "SPECIALS", "default_chat_template", "write_tiny_llama"]

FAMILIES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class Specials:
    """A family's special tokens: all of them (in id order, from 0), bos/eos/pad, and the end-of-turn list."""

    tokens: tuple[str, ...]
    bos: str | None
    eos: str  # tokenizer_config.json's eos_token: what ends an assistant turn
    pad: str | None
    end_of_turn: tuple[str, ...]  # generation_config.json's eos_token_id list
    template: str  # the name in tests/_templates.py


SPECIALS = {
    "llama": Specials(
        tokens=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad=None,
        end_of_turn=("<|end_of_text|>", "<|eot_id|>"),
        template="LLAMA3",
    ),
    "qwen2": Specials(
        tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        end_of_turn=("<|im_end|>", "<|endoftext|>"),
        template="CHATML",
    ),
    "mistral": Specials(
        tokens=("<unk>", "<s>", "</s>", "[INST]", "[/INST]"),
        bos="<s>",
        eos="</s>",
        pad=None,
        end_of_turn=("</s>",),
        template="MISTRAL",
    ),
}

# Minimal templates of each family's shape, used when tests/_templates.py (the templates the chat-template tests
# check against transformers) is not there.
_FALLBACK_TEMPLATES = {
    "LLAMA3": (
        "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
        "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
    "CHATML": (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    "MISTRAL": (
        "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
        "[INST] {{ message['content'] }} [/INST]{% elif message['role'] == 'assistant' %}"
        "{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    ),
}

_CORPUS = (
    "You are a helpful assistant. Answer briefly and kindly.",
    "The cat sat on the mat and looked at the sea.",
    "A quiet morning came over the hills, and the river ran cold.",
    "She said that the road was long, but the day was longer still.",
    "Where are you going? I am going home, to the old stone house.",
    "What is the capital of France? The capital of France is Paris.",
    "Tell me a story about a dragon who learned to read.",
    "Hello! How can I help you today? Thank you, that was helpful.",
    "Naïve café owners serve crème brûlée — 日本語 and emoji 🙂 too.",
    "system user assistant: the model answers the user's question.",
    "Numbers like 12, 345 and 6789 appear in text; so do symbols like {}, [] and ().",
)


# The default vocabulary; the built-in corpus alone runs out of merges at about 540, so above this _filler adds text
# (and the default's files stay what they always were).
_CORPUS_VOCAB = 400


def default_chat_template(family: str) -> str:
    """The family's template from tests/_templates.py when that module is there, else a minimal one of its shape."""
    name = SPECIALS[family].template
    # A sibling module: "tests._templates" when run as ``python -m tests._checkpoints``, "_templates" under pytest
    # (which puts tests/ itself on the path).
    try:
        templates = importlib.import_module(f"{__package__}._templates" if __package__ else "_templates")
    except ImportError:
        return _FALLBACK_TEMPLATES[name]
    value = getattr(templates, name, None)
    return value if isinstance(value, str) else _FALLBACK_TEMPLATES[name]


def _filler(vocab_size: int) -> list[str]:
    """Lines of seeded random lowercase words, enough for a BPE of ``vocab_size`` (the built-in corpus runs out at
    about 540 tokens; a benchmark of a real model's shape wants its vocabulary, e.g. SmolLM2's 49,152)."""
    import numpy as np

    rng = np.random.default_rng(0)
    distinct = 3 * vocab_size
    lengths = rng.integers(2, 10, size=distinct)
    letters = rng.integers(ord("a"), ord("z") + 1, size=int(lengths.sum()), dtype=np.uint8).tobytes().decode("ascii")
    ends = np.cumsum(lengths).tolist()
    words = [letters[end - n : end] for end, n in zip(ends, lengths.tolist(), strict=True)]
    # Zipf-distributed reuse: BPE merges only pairs that repeat, and a long tail of rarer words gives it new ones.
    picks = (np.minimum(rng.zipf(1.2, size=12 * vocab_size), distinct) - 1).tolist()
    return [" ".join(words[i] for i in picks[at : at + 64]) for at in range(0, len(picks), 64)]


def _tokenizer(specials: Specials, vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials.tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_CORPUS) * 20 + (_filler(vocab_size) if vocab_size > _CORPUS_VOCAB else []), trainer)
    if specials.bos is not None:
        bos = specials.bos
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    return tok


def _legacy_rope(config: dict[str, Any]) -> dict[str, Any]:
    """config.json with rope settings as the Hub's checkpoints keep them (rope_theta + rope_scaling)."""
    params = dict(config.pop("rope_parameters", None) or {})
    theta = params.pop("rope_theta", 10_000.0)
    config["rope_theta"] = theta
    config["rope_scaling"] = None if params.get("rope_type", "default") == "default" else params
    return config


def _shard(folder: Path, shards: int) -> None:
    """Split model.safetensors into ``shards`` files plus model.safetensors.index.json, as large checkpoints come."""
    from safetensors.torch import load_file, save_file

    single = folder / "model.safetensors"
    weights = load_file(str(single))
    names = sorted(weights)
    if not 1 < shards <= len(names):
        raise ValueError(f"shards must be in 2..{len(names)} (the weight count), not {shards}")
    weight_map: dict[str, str] = {}
    per = -(-len(names) // shards)
    for i in range(shards):
        part = names[i * per : (i + 1) * per]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({name: weights[name] for name in part}, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")
    single.unlink()


def write_tiny_llama(
    folder: str | Path,
    family: str = "llama",
    *,
    chat_template: str | None = None,
    seed: int = 0,
    shards: int = 1,
    dtype: str = "float32",
    legacy_rope: bool = True,
    tokenizer_vocab: int = _CORPUS_VOCAB,
    **config_overrides: Any,
) -> Path:
    """Write a random tiny ``family`` checkpoint (llama, qwen2 or mistral) into ``folder``; return the folder.

    The model: hidden 64, 2 layers, 4 heads over 2 key/value heads, 512 positions, the tokenizer's vocabulary
    (about 400), weights spread wide (initializer_range 0.25, then every parameter moved off its initial value,
    norms and biases included) so that logits differ clearly and greedy decoding does not repeat one token.
    ``config_overrides`` go to the transformers config (``rope_scaling={...}``, ``tie_word_embeddings=True``,
    ``attention_bias=True``, ``hidden_size=...``). ``shards`` > 1 writes that many safetensors files and their
    index; ``dtype`` ("float32", "bfloat16", "float16") is the saved weights' dtype. The same arguments give the
    same files. ``tokenizer_vocab`` is the BPE's vocabulary (and so the model's): above the default, seeded random
    words join the training text so that it reaches that size (49,152 for SmolLM2's shape, in a few seconds).
    """
    import torch
    import transformers

    if family not in SPECIALS:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, not {family!r}")
    specials = SPECIALS[family]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(specials, vocab_size=tokenizer_vocab)
    tok.save(str(folder / "tokenizer.json"))
    ids = {token: tok.token_to_id(token) for token in specials.tokens}

    settings: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": tok.get_vocab_size(),
        "max_position_embeddings": 512,
        "initializer_range": 0.25,
        "bos_token_id": ids.get(specials.bos) if specials.bos else None,
        "eos_token_id": ids[specials.eos],
        "pad_token_id": ids.get(specials.pad) if specials.pad else None,
        "tie_word_embeddings": False,
    }
    # Deep copies: transformers fills defaults into the rope dict it is given, and the caller's must stay as it was.
    settings.update(copy.deepcopy(config_overrides))
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[family]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config_class(**settings)).eval()
        # A fresh model has unit norms and zero biases, which would hide a norm or bias read from the wrong key.
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.1 * torch.randn_like(param))
    model.to(getattr(torch, dtype)).save_pretrained(folder, safe_serialization=True)

    config_path = folder / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if legacy_rope:
        config = _legacy_rope(config)
    config_path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    if shards > 1:
        _shard(folder, shards)

    generation = {
        "bos_token_id": settings["bos_token_id"],
        "eos_token_id": [ids[token] for token in specials.end_of_turn],
        "pad_token_id": settings["pad_token_id"],
    }
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
    added = {
        str(ids[token]): {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True,
        }
        for token in specials.tokens
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": specials.bos,
        "eos_token": specials.eos,
        "pad_token": specials.pad,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(config["max_position_embeddings"]),
        "chat_template": default_chat_template(family) if chat_template is None else chat_template,
    }
    if family == "mistral":
        tokenizer_config["unk_token"] = "<unk>"
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2), encoding="utf-8")
    return folder


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests._checkpoints", description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where to write the checkpoint (created if missing)")
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    parser.add_argument("--shards", type=int, default=1, help="safetensors files to split the weights into")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from transformers.utils import logging

    disable_progress_bar: Any = logging.disable_progress_bar  # untyped in transformers
    disable_progress_bar()
    print(write_tiny_llama(args.folder, args.family, seed=args.seed, shards=args.shards))


if __name__ == "__main__":
    main()
