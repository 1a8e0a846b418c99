"""The model runner and its sampler, without Triton: fixed-shape decode passes, compiled whole, reproducible draws.

A tiny random Llama (tests/_checkpoints.py) stands in for a checkpoint: rotary tables, grouped-query attention and
RMSNorm all run, which is what a compiled pass must carry without a graph break.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests._checkpoints import write_tiny_llama
from triton_npu_client.server import DecodeBatch, ModelRunner, PagedKVCache, PrefillRow, RowSampling, load_decoder
from triton_npu_client.server.chat._runner import BUCKETS, CPU_COMPILE_OPTIONS, bucket
from triton_npu_client.server.chat._sampling import SamplingFlags, exponential_noise, sample


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_decoder(write_tiny_llama(tmp_path_factory.mktemp("runner_llama"), "llama", seed=3))


def rig(
    model: Any, prompts: list[list[int]], sampling: RowSampling | None = None
) -> tuple[ModelRunner, Any, list[Any]]:
    """A runner whose slots 0.. hold ``prompts`` prefilled (their first token sampled), and their tables."""
    cache = PagedKVCache.for_model(model, num_blocks=64, block_size=4)
    runner = ModelRunner(model, cache, slots=8, max_ctx=128, vocab=model.vocab_size)
    tables = []
    for slot, ids in enumerate(prompts):
        table = cache.new_table()
        cache.reserve(table, 0, len(ids))
        row = PrefillRow(slot=slot, blocks=tuple(table.blocks), start=0, ids=tuple(ids),
                         sampling=sampling or RowSampling())
        token = runner.prefill([row])[0]
        cache.commit(table, 0, ids)
        runner.join(row, token, table.blocks)
        tables.append(table)
    return runner, cache, tables


def grow(cache: Any, runner: ModelRunner, tables: list[Any]) -> DecodeBatch:
    """Reserve every table's next position and name the blocks the rows grew into, as the scheduler does."""
    appended = []
    for slot, table in enumerate(tables):
        had = len(table.blocks)
        cache.reserve(table, table.length, table.length + 1)
        appended += [(slot, i, table.blocks[i]) for i in range(had, len(table.blocks))]
    width = max(cache.blocks_for(t.length + 1) for t in tables)
    return DecodeBatch(slots=tuple(range(len(tables))), width=width, flags=SamplingFlags(), appended=tuple(appended))


def test_buckets() -> None:
    assert [bucket(n) for n in (1, 2, 3, 5, 9, 17, 33, 64, 65, 130)] == [1, 2, 4, 8, 16, 32, 64, 64, 128, 192]
    assert BUCKETS[-1] == 64


def test_decoding_together_equals_each_alone_and_padding_changes_nothing(model: Any) -> None:
    prompts = [[5, 9, 13], list(range(20, 31)), [7] * 6]
    together, cache, tables = rig(model, prompts)
    runs: list[list[int]] = [[] for _ in prompts]
    for _ in range(9):
        batch = grow(cache, together, tables)
        for row, token in enumerate(together.decode(batch)):
            runs[row].append(token)
        for _slot, table in enumerate(tables):
            cache.commit(table, table.length, [0])
    alone = []
    for ids in prompts:
        runner, c, [t] = rig(model, [ids])
        got = []
        for _ in range(9):
            got += runner.decode(grow(c, runner, [t]))
            c.commit(t, t.length, [0])
        alone.append(got)
    assert runs == alone  # 3 rows ran padded to a bucket of 4: the padding row wrote only the null block


# Inductor's own import of torch.jit warns in torch 2.13; the suite turns warnings into errors.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_the_decode_pass_compiles_as_one_graph_with_equal_logits(model: Any) -> None:
    """torch.compile(fullgraph=True) raises on any graph break; the compiled pass gives the eager logits and ids."""
    runner, cache, tables = rig(model, [[5, 9, 13], list(range(20, 31)), [7] * 6])
    batch = grow(cache, runner, tables)
    rows = runner._rows(batch.slots)
    tables_t = runner.tables[rows, : batch.width]
    keys = runner._key_positions[: batch.width * cache.block_size]
    runner.seeds[: len(tables)] = torch.tensor([1, 2, 3])
    runner.temperature[: len(tables)] = torch.tensor([0.0, 0.8, 1.3])  # greedy beside sampled rows
    runner.top_k[: len(tables)] = 5
    flags = SamplingFlags(sampled=True, filtered=True, min_tokens=True)
    logits, ids = runner.pass_outputs(rows, tables_t, keys, flags)
    # With the runner's own inductor options (what compile_decode=cpu compiles with).
    compiled = torch.compile(runner.pass_outputs, fullgraph=True, dynamic=False, options=dict(CPU_COMPILE_OPTIONS))
    got_logits, got_ids = compiled(rows, tables_t, keys, flags)
    assert torch.allclose(got_logits, logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_ids, ids)
    assert int(ids[0]) == int(logits[0].argmax())


def test_a_pass_that_fails_leaves_the_decode_rows_as_they_were(model: Any) -> None:
    runner, cache, tables = rig(model, [[5, 9, 13], [8, 8, 8, 8, 8]])
    batch = grow(cache, runner, tables)
    before = [t.clone() for t in (runner.tokens, runner.positions, runner.sampled)]
    runner.temperature[1] = float("nan")  # a fault on the device, in row 1 alone
    flags = SamplingFlags(sampled=True)
    with pytest.raises(ValueError, match=r"sampling rows \[1\] failed"):
        runner.decode(DecodeBatch(slots=batch.slots, width=batch.width, flags=flags, appended=batch.appended))
    after = (runner.tokens, runner.positions, runner.sampled)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    # Row 0 alone goes on, and advances.
    assert len(runner.decode(DecodeBatch(slots=(0,), width=batch.width, flags=flags))) == 1
    assert int(runner.positions[0]) == int(before[1][0]) + 1


def test_draws_depend_on_seed_and_position_only() -> None:
    seeds, positions = torch.tensor([7, 7, 8, 7]), torch.tensor([3, 3, 3, 4])
    noise = exponential_noise(seeds, positions, 4096)
    assert torch.equal(noise[0], noise[1])  # same seed, same position: the same draws, in any row
    assert not torch.equal(noise[0], noise[2])
    assert not torch.equal(noise[0], noise[3])
    assert torch.equal(exponential_noise(seeds[:1], positions[:1], 4096)[0], noise[0])  # alone equals batched
    big = exponential_noise(torch.arange(40), torch.zeros(40, dtype=torch.long), 4096)
    assert bool((big > 0).all())
    assert bool(torch.isfinite(big).all())
    assert abs(float(big.mean()) - 1.0) < 0.02  # Exp(1): mean 1 (163,840 draws: standard error 0.0025)


def test_the_race_draws_from_the_distribution() -> None:
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = torch.log(p).expand(3000, 4).clone()
    logits[:, 3] = -1e9
    n = logits.shape[0]
    picks = sample(
        logits, temperature=torch.ones(n), top_k=torch.zeros(n, dtype=torch.long), top_p=torch.ones(n),
        seeds=torch.arange(n), positions=torch.full((n,), 9), below_min=torch.zeros(n, dtype=torch.bool),
        stop_ids=torch.tensor([], dtype=torch.long), flags=SamplingFlags(sampled=True),
    )  # fmt: skip
    freq = torch.bincount(picks, minlength=4).float() / n
    assert torch.allclose(freq[:3], p[:3], atol=0.04), freq  # standard error about 0.009
    assert int(freq[3] * n) == 0
    # top-k 1 and top-p 0.4 both keep only the likeliest token.
    for k, top in ((1, 1.0), (0, 0.4)):
        kept = sample(
            logits, temperature=torch.ones(n), top_k=torch.full((n,), k), top_p=torch.full((n,), top),
            seeds=torch.arange(n), positions=torch.full((n,), 9), below_min=torch.zeros(n, dtype=torch.bool),
            stop_ids=torch.tensor([], dtype=torch.long), flags=SamplingFlags(sampled=True, filtered=True),
        )  # fmt: skip
        assert set(kept.tolist()) == {0}


def test_runner_refuses_an_unknown_compile_mode(model: Any, tmp_path: Path) -> None:
    cache = PagedKVCache.for_model(model, num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match="compile must be off, cpu or cuda-graphs"):
        ModelRunner(model, cache, slots=1, max_ctx=16, vocab=model.vocab_size, compile="npu")  # type: ignore[arg-type]
