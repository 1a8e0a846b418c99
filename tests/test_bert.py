"""The server toolkit's BERT encoder and sentence pooling against Hugging Face transformers' BertModel (on CPU).

The reference is a random tiny ``BertModel`` saved with ``save_pretrained`` and read back by :func:`load_bert`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from triton_npu_client.server.encoder._bert import BertConfig, encode, load_bert, mean_pool, sentence_embeddings

TOL = 1e-4
VOCAB = 101


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[transformers.BertModel, Path]:
    torch.manual_seed(4321)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=48,
        type_vocab_size=2,
        initializer_range=0.2,  # logits spread wide, so any wrong part of a block shows above the tolerance
    )
    model = transformers.BertModel(config, add_pooling_layer=True).eval()
    with torch.no_grad():
        for param in model.parameters():  # off their initial values: a bias read from the wrong key shows
            param.add_(0.1 * torch.randn_like(param))
    folder = tmp_path_factory.mktemp("bert")
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


def batch(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded random ids [rows, max(lengths)] and their mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), width), generator=g)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


def test_hidden_states_match_transformers_on_a_padded_batch(reference: tuple[transformers.BertModel, Path]) -> None:
    hf, folder = reference
    ours = load_bert(folder)
    ids, mask = batch([7, 19, 1, 12])
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask).last_hidden_state
    got = encode(ours, ids, mask)
    real = mask.bool()
    assert (got[real] - want[real]).abs().max().item() < TOL


def test_sentence_embeddings_are_the_normalised_mean_of_real_tokens(
    reference: tuple[transformers.BertModel, Path],
) -> None:
    """Mean over real tokens only, then L2 norm: each row equals the same sentence embedded alone, unpadded."""
    hf, folder = reference
    ours = load_bert(folder)
    lengths = [5, 16, 9]
    ids, mask = batch(lengths, seed=3)
    got = sentence_embeddings(ours, ids, mask)
    assert torch.allclose(got.norm(dim=1), torch.ones(len(lengths)), atol=1e-6)
    for row, n in enumerate(lengths):
        with torch.no_grad():
            alone = hf(input_ids=ids[row : row + 1, :n]).last_hidden_state.mean(dim=1)
        alone = torch.nn.functional.normalize(alone, dim=1)[0]
        assert torch.nn.functional.cosine_similarity(got[row], alone, dim=0).item() > 1 - TOL
        assert (got[row] - alone).abs().max().item() < TOL


def test_mean_pool_ignores_padding() -> None:
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])
    assert mean_pool(hidden, torch.tensor([[1, 1, 0]])).tolist() == [[2.0, 3.0]]


def test_loads_keys_with_the_bert_prefix(reference: tuple[transformers.BertModel, Path], tmp_path: Path) -> None:
    """Task-head checkpoints name the encoder's weights bert.*: they load the same."""
    _, folder = reference
    weights = load_file(str(folder / "model.safetensors"))
    save_file({f"bert.{k}": v.contiguous() for k, v in weights.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    ids, mask = batch([6, 3])
    assert torch.equal(encode(load_bert(tmp_path), ids, mask), encode(load_bert(folder), ids, mask))
    del weights["embeddings.word_embeddings.weight"]
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match=r"embeddings\.word_embeddings\.weight"):
        load_bert(tmp_path)


def test_config_refuses_what_it_does_not_implement(reference: tuple[transformers.BertModel, Path]) -> None:
    raw = json.loads((reference[1] / "config.json").read_text())
    assert BertConfig.from_dict(raw).head_dim == 16
    with pytest.raises(ValueError, match="position_embedding_type"):
        BertConfig.from_dict({**raw, "position_embedding_type": "relative_key"})
    with pytest.raises(ValueError, match="hidden_act"):
        BertConfig.from_dict({**raw, "hidden_act": "relu"})
    ids = torch.ones(1, 49, dtype=torch.long)
    with pytest.raises(ValueError, match="exceed max_position_embeddings 48"):
        encode(load_bert(reference[1]), ids)
