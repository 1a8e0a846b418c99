"""The server toolkit's GPT-2 decoder on the paged KV cache against Hugging Face transformers' GPT-2 (on CPU).

The reference is a random tiny ``GPT2LMHeadModel`` saved with ``save_pretrained`` and read back by
:func:`load_gpt2`; every comparison is against transformers run on the whole sequence without a cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from triton_npu_client.server import GPT2, GPT2Config, PagedKVCache, forward_tables, load_gpt2

TOL = 1e-4
VOCAB = 97


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[transformers.GPT2LMHeadModel, Path]:
    """A random tiny GPT-2 (fixed seed) and the folder it was saved to."""
    torch.manual_seed(1234)
    config = transformers.GPT2Config(
        n_layer=2,
        n_head=4,
        n_embd=64,
        vocab_size=VOCAB,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        # Ten times the default spread, so that logits spread wide and an error in any part of
        # the block (even the GELU approximation) shows above the tolerance.
        initializer_range=0.2,
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    # Fresh models have zero biases and unit LayerNorm scales, which would hide a bias or scale read
    # from the wrong key: move every parameter off its initial value.
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    folder = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


@pytest.fixture(scope="module")
def model(reference: tuple[transformers.GPT2LMHeadModel, Path]) -> GPT2:
    return load_gpt2(reference[1], "cpu", torch.float32)


def hf_logits(reference: tuple[transformers.GPT2LMHeadModel, Path], ids: list[int]) -> torch.Tensor:
    """transformers' logits [len(ids), vocab] for the whole sequence, no cache."""
    with torch.no_grad():
        out = reference[0](torch.tensor([ids]), use_cache=False)
    return out.logits[0].float()


def new_cache(model: GPT2, blocks: int = 64, block_size: int = 4) -> PagedKVCache:
    """Small blocks, so that even these short prompts span several and cross block boundaries mid-step."""
    return PagedKVCache.for_model(model, num_blocks=blocks, block_size=block_size)


def prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (length,), generator=g).tolist()


def decode_alone(model: GPT2, ids: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill ``ids`` in a fresh cache, then ``steps`` greedy steps: (new tokens, each step's logits)."""
    cache = new_cache(model)
    table = cache.new_table()
    logits = forward_tables(model, cache, [table], torch.tensor([ids]))[0]
    tokens, seen = [], [logits]
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        logits = forward_tables(model, cache, [table], torch.tensor([[tokens[-1]]]))[0]
        seen.append(logits)
    return tokens, seen


def test_config_reads_hugging_face_json(reference: tuple[transformers.GPT2LMHeadModel, Path], tmp_path: Path) -> None:
    """config.json gives the shape; old checkpoints' n_ctx stands in for n_positions; unknown variants are refused."""
    config = GPT2Config.from_file(reference[1])
    assert (config.n_layer, config.n_head, config.n_embd, config.n_positions, config.vocab_size) == (2, 4, 64, 64, 97)
    assert config.head_dim == 16
    assert config.layer_norm_epsilon == reference[0].config.layer_norm_epsilon
    raw = json.loads((reference[1] / "config.json").read_text())
    del raw["n_positions"]
    raw["n_ctx"] = 32
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert GPT2Config.from_file(tmp_path / "config.json").n_positions == 32
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        GPT2Config.from_dict({**raw, "scale_attn_by_inverse_layer_idx": True})


def test_full_sequence_logits_match_transformers(
    reference: tuple[transformers.GPT2LMHeadModel, Path], model: GPT2
) -> None:
    """A prompt prefilled in one step gives transformers' logits at every position."""
    ids = prompt(1, 17)
    cache = new_cache(model)
    table = cache.new_table()
    ours = forward_tables(model, cache, [table], torch.tensor([ids]), all_logits=True)[0]
    assert ours.shape == (17, VOCAB)
    assert (ours - hf_logits(reference, ids)).abs().max().item() < TOL
    assert table.length == 17
    assert table.ids == ids
    assert len(table.blocks) == 5  # 17 positions in blocks of 4


def test_loads_keys_without_the_transformer_prefix(
    reference: tuple[transformers.GPT2LMHeadModel, Path], model: GPT2, tmp_path: Path
) -> None:
    """A GPT2Model-style checkpoint (no ``transformer.`` prefix) loads to the same weights."""
    weights = load_file(str(reference[1] / "model.safetensors"))
    assert any(k.startswith("transformer.") for k in weights)
    save_file({k.removeprefix("transformer."): v for k, v in weights.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_bytes((reference[1] / "config.json").read_bytes())
    bare = load_gpt2(tmp_path)
    assert torch.equal(bare.wte, model.wte)
    assert all(torch.equal(a.attn_weight, b.attn_weight) for a, b in zip(bare.layers, model.layers, strict=True))
    del weights["transformer.h.1.mlp.c_fc.bias"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match=r"h\.1\.mlp\.c_fc\.bias"):
        load_gpt2(tmp_path)


def test_prefill_then_greedy_decode_matches_transformers_and_keeps_the_cache_in_place(
    reference: tuple[transformers.GPT2LMHeadModel, Path], model: GPT2
) -> None:
    """Each cached decode step gives transformers' no-cache logits and the same greedy token; no reallocation."""
    ids = prompt(2, 9)
    cache = new_cache(model)
    table = cache.new_table()
    pointers = [t.data_ptr() for t in (*cache.keys, *cache.values)]
    shapes = [t.shape for t in (*cache.keys, *cache.values)]

    ours_seq, ref_seq = list(ids), list(ids)
    logits = forward_tables(model, cache, [table], torch.tensor([ids]))[0]
    for _ in range(12):
        ref = hf_logits(reference, ref_seq)[-1]
        assert (logits - ref).abs().max().item() < TOL
        ours_seq.append(int(logits.argmax()))
        ref_seq.append(int(ref.argmax()))
        assert ours_seq == ref_seq
        logits = forward_tables(model, cache, [table], torch.tensor([[ours_seq[-1]]]))[0]
    assert table.length == len(ours_seq)
    assert [t.data_ptr() for t in (*cache.keys, *cache.values)] == pointers
    assert [t.shape for t in (*cache.keys, *cache.values)] == shapes


# Where the conversations' blocks lie changes how attention reads them: packed in order, interleaved (each
# conversation's blocks scattered among the others'), or far apart (separate ranges).
@pytest.mark.parametrize("layout", ["packed", "interleaved", "apart"])
def test_batched_decode_equals_each_conversation_decoded_alone(model: GPT2, layout: str) -> None:
    """Four conversations of different prompt lengths, one batched step per token, give each one's solo tokens and
    logits, wherever their blocks lie in the pool."""
    prompts = [prompt(10 + i, n) for i, n in enumerate([3, 11, 1, 6])]
    steps = 8
    cache = new_cache(model, blocks=96)
    if layout == "apart":
        # Hold blocks between the conversations, so their blocks lie more than a gap apart.
        holders = [cache.new_table() for _ in range(4)]
    tables = [cache.new_table() for _ in prompts]
    firsts = []
    for i, (table, ids) in enumerate(zip(tables, prompts, strict=True)):
        if layout == "apart":
            cache.reserve(holders[i], 0, 4 * 12)
        firsts.append(forward_tables(model, cache, [table], torch.tensor([ids]))[0])
    last = torch.stack(firsts)
    batched_tokens: list[list[int]] = [[] for _ in prompts]
    batched_logits = [last]
    for _ in range(steps):
        chosen = last.argmax(dim=-1)
        for row, token in enumerate(chosen.tolist()):
            batched_tokens[row].append(token)
        last = forward_tables(model, cache, tables, chosen[:, None])
        batched_logits.append(last)
    assert [t.length for t in tables] == [len(p) + steps for p in prompts]
    if layout == "interleaved":
        owner = {b: i for i, t in enumerate(tables) for b in t.blocks}
        assert any(owner.get(b + 1, i) != i for i, t in enumerate(tables) for b in t.blocks[:-1])

    for row, ids in enumerate(prompts):
        alone_tokens, alone_logits = decode_alone(model, ids, steps)
        assert batched_tokens[row] == alone_tokens
        diff = max((b[row] - a).abs().max().item() for b, a in zip(batched_logits, alone_logits, strict=True))
        assert diff < TOL


def test_a_reused_block_does_not_show_its_previous_owner(
    reference: tuple[transformers.GPT2LMHeadModel, Path], model: GPT2
) -> None:
    """Blocks freed by one conversation and taken by the next keep stale keys past the new length: never seen.

    It decodes beside a long conversation, so the same ranges hold both.
    """
    cache = new_cache(model, blocks=15)  # exactly what the two take: the next one must reuse the first's blocks
    first, other = cache.new_table(), cache.new_table()
    forward_tables(model, cache, [first], torch.tensor([prompt(20, 30)]))
    forward_tables(model, cache, [other], torch.tensor([prompt(21, 25)]))
    old_blocks = set(first.blocks)
    cache.release(first)
    assert first.length == 0
    assert cache.used_blocks == 7

    ids = prompt(22, 6)
    again = cache.new_table()
    logits = forward_tables(model, cache, [again], torch.tensor([ids]))[0]
    assert set(again.blocks) <= old_blocks
    seq = list(ids)
    other_logits = forward_tables(model, cache, [other], torch.tensor([[5]]))[0]
    for _ in range(5):
        assert (logits - hf_logits(reference, seq)[-1]).abs().max().item() < TOL
        seq.append(int(logits.argmax()))
        both = forward_tables(model, cache, [again, other], torch.tensor([[seq[-1]], [int(other_logits.argmax())]]))
        logits, other_logits = both[0], both[1]
    assert again.length == len(seq)


def test_rewind_and_bad_steps(reference: tuple[transformers.GPT2LMHeadModel, Path], model: GPT2) -> None:
    """A position below the length rewinds the table; repeated tables and holes past the length are refused."""
    cache = new_cache(model)
    table, empty = cache.new_table(), cache.new_table()
    ids = prompt(30, 10)
    forward_tables(model, cache, [table], torch.tensor([ids]))
    logits = forward_tables(model, cache, [table], torch.tensor([[7, 8]]), positions=[4])[0]
    assert table.length == 6
    assert table.ids == [*ids[:4], 7, 8]
    assert (logits - hf_logits(reference, [*ids[:4], 7, 8])[-1]).abs().max().item() < TOL
    with pytest.raises(ValueError, match="twice"):
        forward_tables(model, cache, [table, table], torch.tensor([[1], [2]]))
    with pytest.raises(ValueError, match="length"):
        forward_tables(model, cache, [empty], torch.tensor([[1]]), positions=[1])
    with pytest.raises(ValueError, match="max_positions"):
        forward_tables(model, cache, [table], torch.tensor([list(range(60))]))
    assert (table.length, empty.length) == (6, 0)


def test_blocks_are_taken_in_runs_and_a_table_grows_in_place(model: GPT2) -> None:
    """Attention scores consecutive blocks as one range: a prefill takes a consecutive run of free blocks even in
    a fragmented pool, and a growing table takes the block right after its last one when it is free."""
    cache = new_cache(model, blocks=40)
    tables = [cache.new_table() for _ in range(10)]
    for table in tables:
        cache.reserve(table, 0, 4 * 3)  # 3 blocks each: 0..29
    for table in tables[::2]:
        cache.release(table)  # free: 0-2, 6-8, 12-14, ... and 30-39
    big = cache.new_table()
    cache.reserve(big, 0, 4 * 5)
    assert big.blocks == list(range(30, 35))  # the first run of 5, not the five lowest free blocks
    small = cache.new_table()
    forward_tables(model, cache, [small], torch.tensor([prompt(40, 4)]))
    assert small.blocks == [0]
    forward_tables(model, cache, [small], torch.tensor([[5]]))
    assert small.blocks == [0, 1]  # grown in place
