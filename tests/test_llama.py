"""The Llama-family decoder (Llama, Qwen2, Mistral) on the paged KV cache, against transformers (on CPU).

Each reference is a random tiny checkpoint written by tests/_checkpoints.py (transformers' own
``save_pretrained``) and read back twice: by transformers' ``*ForCausalLM.from_pretrained`` and by
:func:`load_llama`. Every comparison is against transformers run on the whole sequence without a cache, or
against our own decoder run the same way (a fresh table holding the whole sequence).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from _checkpoints import write_tiny_llama
from safetensors.torch import load_file, save_file

from triton_npu_client.server import GPT2, Llama, LlamaConfig, RopeScaling, load_decoder, load_llama
from triton_npu_client.server.chat._blocks import BlockTable, PagedKVCache
from triton_npu_client.server.chat._llama import RotaryTable, rope_frequencies
from triton_npu_client.server.chat._tables import forward_tables

TOL = 1e-4
LLAMA3 = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# name -> (family, write_tiny_llama options). Between them: every family, each rope type that changes the
# arithmetic (llama3, linear in the legacy "type" spelling, yarn), tied and untied embeddings, every bias,
# a head_dim that is not hidden/heads, both config.json formats (legacy rope_scaling and rope_parameters).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-llama3": ("llama", {"rope_scaling": LLAMA3}),
    "llama-linear-tied-bias": (
        "llama",
        {"rope_scaling": {"type": "linear", "factor": 4.0}, "rope_theta": 500_000.0, "tie_word_embeddings": True,
         "attention_bias": True, "mlp_bias": True, "head_dim": 32},
    ),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen2-yarn": ("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 128}}),
    "mistral": ("mistral", {"legacy_rope": False, "num_key_value_heads": 1}),
}
MODEL_CLASSES: dict[str, Any] = {
    "llama": transformers.LlamaForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
    "mistral": transformers.MistralForCausalLM,
}


@dataclasses.dataclass
class Reference:
    folder: Path
    hf: Any  # the transformers model
    model: Llama

    def hf_logits(self, ids: list[int]) -> torch.Tensor:
        """transformers' logits [len(ids), vocab] for the whole sequence, no cache."""
        with torch.no_grad():
            logits: torch.Tensor = self.hf(torch.tensor([ids]), use_cache=False).logits[0].float()
        return logits


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Reference]:
    out = {}
    for seed, (name, (family, options)) in enumerate(VARIANTS.items()):
        folder = write_tiny_llama(tmp_path_factory.mktemp(name), family, seed=seed, **options)
        hf = MODEL_CLASSES[family].from_pretrained(folder, dtype=torch.float32).eval()
        out[name] = Reference(folder, hf, load_llama(folder))
    return out


@pytest.fixture(params=list(VARIANTS))
def ref(request: pytest.FixtureRequest, references: dict[str, Reference]) -> Reference:
    return references[request.param]


def cache_for(model: Llama, blocks: int = 64) -> PagedKVCache:
    return PagedKVCache.for_model(model, num_blocks=blocks, block_size=16)


def prompt(seed: int, length: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=g).tolist()


def uncached(model: Llama, ids: list[int]) -> torch.Tensor:
    """Our logits [vocab] for the last of ``ids``, run as one whole sequence in a fresh table."""
    cache = cache_for(model)
    return forward_tables(model, cache, [cache.new_table()], torch.tensor([ids]))[0]


def step(model: Llama, cache: PagedKVCache, tables: list[BlockTable], rows: list[list[int]],
         positions: list[int] | None = None) -> torch.Tensor:
    return forward_tables(model, cache, tables, torch.tensor(rows), positions)


def test_config_and_properties(references: dict[str, Reference]) -> None:
    """What config.json says, as the engine reads it off any decoder."""
    model = references["llama-linear-tied-bias"].model
    assert model.config.model_type == "llama"
    assert model.config.head_dim == 32  # given, not hidden_size / heads = 16
    assert model.cache_shape == (2, 2, 32)
    assert (model.config.qkv_bias, model.config.o_bias, model.config.mlp_bias) == (True, True, True)
    assert model.lm_head is model.embed_tokens
    assert model.config.rope.rope_type == "linear"
    assert model.config.rope.theta == 500_000.0
    assert model.vocab_size == model.config.vocab_size == references["mistral"].hf.config.vocab_size
    assert model.max_positions == 512
    assert (model.device, model.dtype) == (torch.device("cpu"), torch.float32)
    qwen = references["qwen2-tied"].model
    assert (qwen.config.qkv_bias, qwen.config.o_bias, qwen.config.mlp_bias) == (True, False, False)
    mistral = references["mistral"].model
    assert mistral.cache_shape == (2, 1, 16)
    assert mistral.config.sliding_window == 4096  # transformers' Mistral default, far past max_positions
    assert mistral.lm_head is not mistral.embed_tokens


def test_whole_prompt_logits_match_transformers(ref: Reference) -> None:
    """Every position's logits within 1e-4 of transformers', at positions past the scaled ropes' original context."""
    model = ref.model
    ids = prompt(1, 150, model.vocab_size)
    cache = cache_for(model)
    table = cache.new_table()
    ours = forward_tables(model, cache, [table], torch.tensor([ids]), all_logits=True)[0]
    theirs = ref.hf_logits(ids)
    assert ours.shape == theirs.shape == (150, model.vocab_size)
    assert ours.dtype == torch.float32
    assert torch.allclose(ours, theirs, atol=TOL, rtol=0), float((ours - theirs).abs().max())
    assert table.length == 150
    if model.config.rope.rope_type != "default":
        # The scaling shows: the same weights with unscaled frequencies miss transformers by far more than TOL.
        unscaled = dataclasses.replace(model.config, rope=RopeScaling(theta=model.config.rope.theta))
        inv_freq, _ = rope_frequencies(unscaled)
        plain = dataclasses.replace(model, rotary=RotaryTable(inv_freq, 1.0, model.dtype, model.max_positions))
        cache = cache_for(plain)
        wrong = forward_tables(plain, cache, [cache.new_table()], torch.tensor([ids]), all_logits=True)[0]
        assert float((wrong - theirs).abs().max()) > 100 * TOL


def test_cached_greedy_decode_equals_uncached(ref: Reference) -> None:
    """Prefill, then one token at a time through the paged cache: each step's logits equal the whole sequence's."""
    model = ref.model
    ids = prompt(2, 21, model.vocab_size)
    cache = cache_for(model)
    table = cache.new_table()
    logits = forward_tables(model, cache, [table], torch.tensor([ids]))[0]
    generated: list[int] = []
    for _ in range(12):
        assert torch.allclose(logits, uncached(model, ids + generated), atol=TOL, rtol=0)
        generated.append(int(logits.argmax()))
        logits = forward_tables(model, cache, [table], torch.tensor([[generated[-1]]]))[0]
    assert table.length == len(ids) + len(generated)
    assert len(set(generated)) > 2, generated  # greedy decoding of these weights is not one token repeated
    # And transformers' greedy choice at every step is the same token.
    hf = ref.hf_logits(ids + generated)
    assert hf[len(ids) - 1 : -1].argmax(-1).tolist() == generated


def test_decode_across_the_rotary_table_growth(references: dict[str, Reference]) -> None:
    """Positions past the first cos/sin table (256) continue it exactly: cached steps from 250 to 262."""
    ref = references["llama-llama3"]
    model = load_llama(ref.folder)  # a fresh table, grown by this test only
    ids = prompt(3, 250, model.vocab_size)
    cache = cache_for(model)
    table = cache.new_table()
    forward_tables(model, cache, [table], torch.tensor([ids[:10]]))
    assert model.rotary.length == 256
    forward_tables(model, cache, [table], torch.tensor([ids[10:]]))
    tokens = list(ids)
    for token in prompt(4, 12, model.vocab_size):
        tokens.append(token)
        logits = forward_tables(model, cache, [table], torch.tensor([[token]]))[0]
    assert model.rotary.length > 256
    assert torch.allclose(logits, ref.hf_logits(tokens)[-1], atol=TOL, rtol=0)


def test_batched_rows_equal_each_alone(ref: Reference) -> None:
    """Rows of different lengths at different positions, in one step, equal each row run alone."""
    model = ref.model
    vocab = model.vocab_size
    prompts = [prompt(10, 5, vocab), prompt(11, 23, vocab), prompt(12, 40, vocab)]
    cache = cache_for(model)
    tables = [cache.new_table() for _ in prompts]
    for table, ids in zip(tables, prompts, strict=True):
        forward_tables(model, cache, [table], torch.tensor([ids]))
    histories = [list(ids) for ids in prompts]
    # Three decode steps of one token per row, then one step of three tokens per row.
    for round_ in range(4):
        width = 3 if round_ == 3 else 1
        new = [prompt(20 + 7 * round_ + row, width, vocab) for row in range(len(prompts))]
        batched = forward_tables(model, cache, tables, torch.tensor(new), all_logits=True)
        assert batched.shape == (3, width, vocab)
        for row, tokens in enumerate(new):
            histories[row] += tokens
            alone = cache_for(model)
            alone_table = alone.new_table()
            expected = forward_tables(model, alone, [alone_table], torch.tensor([histories[row]]), all_logits=True)[0]
            assert torch.allclose(batched[row], expected[-width:], atol=TOL, rtol=0)
    assert [t.length for t in tables] == [len(h) for h in histories]


def test_explicit_positions_rewind_a_row(references: dict[str, Reference]) -> None:
    """A row started before its table's end replaces what followed: as if the dropped tokens were never fed."""
    model = references["qwen2-tied"].model
    vocab = model.vocab_size
    ids, other = prompt(30, 20, vocab), prompt(31, 9, vocab)
    cache = cache_for(model)
    table, neighbour = cache.new_table(), cache.new_table()
    forward_tables(model, cache, [table], torch.tensor([ids]))
    forward_tables(model, cache, [neighbour], torch.tensor([other]))
    replacement = prompt(32, 2, vocab)
    out = forward_tables(model, cache, [table, neighbour], torch.tensor([replacement, [5, 6]]), [12, 9])
    assert table.length == 14
    assert neighbour.length == 11
    assert torch.allclose(out[0], uncached(model, ids[:12] + replacement), atol=TOL, rtol=0)
    assert torch.allclose(out[1], uncached(model, [*other, 5, 6]), atol=TOL, rtol=0)


def test_shared_prefix_blocks_give_the_logits_of_a_whole_prefill(references: dict[str, Reference]) -> None:
    """A second conversation opening with the same 40 tokens takes their two full blocks by reference."""
    model = references["llama-llama3"].model
    vocab = model.vocab_size
    system = prompt(40, 40, vocab)
    cache = cache_for(model)
    first = cache.new_table()
    forward_tables(model, cache, [first], torch.tensor([system + prompt(41, 5, vocab)]))
    second = cache.new_table()
    ids = system + prompt(42, 7, vocab)
    held = cache.adopt_prefix(second, ids)
    assert held == 32
    assert cache.shared_hits == 2
    out = forward_tables(model, cache, [second], torch.tensor([ids[held:]]))
    assert torch.allclose(out[0], uncached(model, ids), atol=TOL, rtol=0)
    assert second.length == len(ids)


def test_sharded_checkpoint_equals_unsharded(tmp_path: Path) -> None:
    one = write_tiny_llama(tmp_path / "one", "qwen2", seed=5)
    two = write_tiny_llama(tmp_path / "two", "qwen2", seed=5, shards=3)
    assert not (two / "model.safetensors").exists()
    index = json.loads((two / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    a, b = load_llama(one), load_llama(two)
    ids = torch.tensor([prompt(6, 17, a.vocab_size)])
    for model in (a, b):
        assert isinstance(model, Llama)
    cache_a, cache_b = cache_for(a), cache_for(b)
    logits_a = forward_tables(a, cache_a, [cache_a.new_table()], ids, all_logits=True)
    logits_b = forward_tables(b, cache_b, [cache_b.new_table()], ids, all_logits=True)
    assert torch.equal(logits_a, logits_b)
    # transformers reads the same shards to the same model.
    hf: Any = transformers.Qwen2ForCausalLM.from_pretrained(two, dtype=torch.float32)
    hf.eval()
    with torch.no_grad():
        assert torch.allclose(hf(ids, use_cache=False).logits, logits_b, atol=TOL, rtol=0)


def test_keys_without_the_model_prefix_and_missing_weights(tmp_path: Path) -> None:
    """A bare *Model checkpoint (no "model." prefix) loads; a missing weight is a KeyError naming it."""
    folder = write_tiny_llama(tmp_path / "ck", "mistral", seed=7)
    full = load_llama(folder)
    weights = load_file(str(folder / "model.safetensors"))
    bare = {key.removeprefix("model."): value for key, value in weights.items()}
    save_file(bare, str(folder / "model.safetensors"))
    stripped = load_llama(folder)
    assert torch.equal(stripped.layers[1].qkv_weight, full.layers[1].qkv_weight)
    assert torch.equal(stripped.lm_head, full.lm_head)
    del bare["layers.1.self_attn.k_proj.weight"]
    save_file(bare, str(folder / "model.safetensors"))
    with pytest.raises(KeyError, match=r"layers\.1\.self_attn\.k_proj\.weight"):
        load_llama(folder)


def test_dtype_casts_on_load(tmp_path: Path) -> None:
    """A bfloat16 checkpoint loads as float32 by default (exactly its values), or in the dtype asked for."""
    folder = write_tiny_llama(tmp_path / "bf16", "llama", seed=8, dtype="bfloat16")
    saved = load_file(str(folder / "model.safetensors"))
    assert saved["model.norm.weight"].dtype == torch.bfloat16
    default = load_llama(folder)
    assert default.dtype == torch.float32
    assert torch.equal(default.norm_weight, saved["model.norm.weight"].float())
    half = load_llama(folder, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16
    cache = cache_for(half)
    ids = prompt(9, 12, half.vocab_size)
    logits = forward_tables(half, cache, [cache.new_table()], torch.tensor([ids]))
    assert logits.dtype == torch.float32
    hf: Any = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    hf.eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
    # bfloat16 keeps 8 bits of mantissa: the same arithmetic, a looser bound. transformers' own bfloat16 logits are
    # about 0.09 from float32 here; ours about as far, summed over blocks in a different order.
    assert torch.allclose(logits[0], theirs, atol=0.2, rtol=0)


def test_load_decoder_dispatches_on_model_type(references: dict[str, Reference], tmp_path: Path) -> None:
    for name in ("llama-llama3", "qwen2-tied", "mistral"):
        assert isinstance(load_decoder(references[name].folder), Llama)
    gpt2 = tmp_path / "gpt2"
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=32)
    transformers.GPT2LMHeadModel(config).save_pretrained(gpt2, safe_serialization=True)
    assert isinstance(load_decoder(gpt2), GPT2)
    raw = json.loads((gpt2 / "config.json").read_text())
    raw["model_type"] = "gemma"
    (gpt2 / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"'gemma' is not supported; supported are gpt2, llama, mistral, qwen2"):
        load_decoder(gpt2)


def _config(**changes: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 256,
        "rope_theta": 10000.0, "hidden_act": "silu",
    }
    raw.update(changes)
    return {key: value for key, value in raw.items() if value is not None}


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
         r"unsupported rope type 'longrope': supported are default, linear, dynamic, llama3, yarn"),
        ({"rope_scaling": {"type": "su"}}, r"unsupported rope type 'su'"),
        ({"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}}, r"unsupported rope type 'mrope'"),
        ({"rope_scaling": {"rope_type": "linear"}}, r"rope_scaling of type 'linear' needs a number 'factor', not None"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"needs a number 'low_freq_factor'"),
        ({"partial_rotary_factor": 0.5}, r"unsupported partial_rotary_factor 0.5"),
        ({"hidden_act": "gelu"}, r"unsupported hidden_act 'gelu'"),
        ({"model_type": "gemma"}, r"model_type 'gemma' is not one of llama, qwen2, mistral"),
        ({"num_key_value_heads": 3}, r"num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
        ({"quantization_config": {"quant_method": "awq"}}, r"quantized checkpoints are not supported .*'awq'"),
        ({"hidden_size": 66}, r"hidden_size 66 is not a multiple of num_attention_heads 4"),
    ],
)
def test_configs_this_decoder_does_not_implement_are_refused(changes: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        LlamaConfig.from_dict(_config(**changes))


def test_sliding_window_caps_max_positions() -> None:
    """Within one window sliding attention is full attention: the served context stops at the window."""
    mistral = LlamaConfig.from_dict(_config(model_type="mistral", sliding_window=128))
    assert (mistral.sliding_window, mistral.max_positions) == (128, 128)
    assert LlamaConfig.from_dict(_config(model_type="mistral")).sliding_window == 4096  # transformers' default
    assert LlamaConfig.from_dict(_config(model_type="mistral", sliding_window=None)).max_positions == 256
    qwen = _config(model_type="qwen2", sliding_window=64, max_window_layers=1)
    assert LlamaConfig.from_dict(qwen).sliding_window is None  # use_sliding_window is false
    assert LlamaConfig.from_dict({**qwen, "use_sliding_window": True}).max_positions == 64
    # Every layer below max_window_layers: no layer slides.
    assert LlamaConfig.from_dict({**qwen, "use_sliding_window": True, "max_window_layers": 2}).sliding_window is None
    # dynamic (NTK) rope below max_position_embeddings is the default rope.
    dynamic = LlamaConfig.from_dict(_config(rope_scaling={"rope_type": "dynamic", "factor": 4.0}))
    assert torch.equal(rope_frequencies(dynamic)[0], rope_frequencies(LlamaConfig.from_dict(_config()))[0])


def test_bad_steps_are_refused_before_anything_is_written(references: dict[str, Reference]) -> None:
    model = references["mistral"].model
    cache = cache_for(model)
    table = cache.new_table()
    forward_tables(model, cache, [table], torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match=r"tokens must be \[len\(tables\)=1, T>=1\], not \[2, 1\]"):
        forward_tables(model, cache, [table], torch.tensor([[1], [2]]))
    with pytest.raises(ValueError, match=r"token ids must be in 0\.\.\d+, got 5\.\.100000"):
        forward_tables(model, cache, [table], torch.tensor([[5, 100_000]]))
    with pytest.raises(ValueError, match=r"positions 510\.\.512 are not in 0\.\.511"):
        forward_tables(model, cache, [table], torch.tensor([[1, 2, 3]]), [510])
    assert table.length == 3


@pytest.fixture(autouse=True)
def _no_grad() -> Iterator[None]:
    with torch.no_grad():
        yield


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    # Toy matrices gain nothing from threads, and on a busy machine torch's worker threads wait on each other:
    # a decode step took ten times longer with two threads than with one.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
