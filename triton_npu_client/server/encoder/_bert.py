"""A BERT encoder in plain torch, with the mean pooling and normalisation of sentence embeddings.

Groundwork for the scoring models (sentence-transformers' all-MiniLM-L6-v2 is a 6-layer BERT): the weights
come from a Hugging Face checkpoint folder (``config.json`` + ``model.safetensors``) and the model is a frozen
set of tensors driven by :func:`encode`, as ``_gpt2`` is, so it moves to any torch device (``npu:0``,
``cuda:0``, ``cpu``) the same way and needs no ``transformers`` at run time.

torch is imported inside the functions, never at module level (see ``_gpt2``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._files import read_json_config

if TYPE_CHECKING:
    import torch

__all__ = ["BERT", "BertConfig", "BertLayer", "encode", "load_bert", "mean_pool", "sentence_embeddings"]

_GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


@dataclass(frozen=True)
class BertConfig:
    """The shape of a BERT encoder, as read from a Hugging Face ``config.json``."""

    num_hidden_layers: int
    num_attention_heads: int
    hidden_size: int
    intermediate_size: int
    max_position_embeddings: int
    vocab_size: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}"
            )
        if self.hidden_act not in _GELU:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r} (supported: {', '.join(_GELU)})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> BertConfig:
        """Read the fields this encoder needs; refuse options that would change its arithmetic."""
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"unsupported position_embedding_type {raw['position_embedding_type']!r}")
        if raw.get("is_decoder"):
            raise ValueError("unsupported: is_decoder=true (this is an encoder)")
        return cls(
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=int(raw["num_attention_heads"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            vocab_size=int(raw["vocab_size"]),
            type_vocab_size=int(raw.get("type_vocab_size", 2)),
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
            hidden_act=str(raw.get("hidden_act", "gelu")),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> BertConfig:
        """Read ``config.json``; ``path`` is the file or the checkpoint folder holding it."""
        return cls.from_dict(read_json_config(path))


@dataclass(frozen=True)
class BertLayer:
    """One encoder block. Linear weights are stored [out, in] (torch's ``nn.Linear`` layout): ``F.linear``."""

    qkv_weight: torch.Tensor  # [3 * hidden, hidden]: query, key and value stacked, one matmul for the three
    qkv_bias: torch.Tensor
    attn_out_weight: torch.Tensor
    attn_out_bias: torch.Tensor
    attn_ln_weight: torch.Tensor
    attn_ln_bias: torch.Tensor
    inter_weight: torch.Tensor
    inter_bias: torch.Tensor
    out_weight: torch.Tensor
    out_bias: torch.Tensor
    out_ln_weight: torch.Tensor
    out_ln_bias: torch.Tensor


@dataclass(frozen=True)
class BERT:
    """A loaded BERT encoder: its config and weights, all on one device in one dtype. See :func:`load_bert`."""

    config: BertConfig
    word_embeddings: torch.Tensor
    position_embeddings: torch.Tensor
    token_type_embeddings: torch.Tensor
    emb_ln_weight: torch.Tensor
    emb_ln_bias: torch.Tensor
    layers: tuple[BertLayer, ...]

    @property
    def device(self) -> torch.device:
        return self.word_embeddings.device

    @property
    def dtype(self) -> torch.dtype:
        return self.word_embeddings.dtype


def load_bert(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> BERT:
    """Load a Hugging Face BERT checkpoint folder (``config.json`` + ``model.safetensors``).

    Keys are accepted with or without the ``bert.`` prefix (``BertModel`` and task-head checkpoints); the
    pooler and any head are ignored (sentence embeddings pool the last hidden state). ``dtype`` defaults to
    float32. Raises ``KeyError`` naming a missing weight.
    """
    import torch
    from safetensors.torch import load_file

    path = Path(path)
    config = BertConfig.from_file(path)
    dtype = torch.float32 if dtype is None else dtype
    raw = load_file(str(path / "model.safetensors"), device="cpu")
    weights = {key.removeprefix("bert."): value for key, value in raw.items()}

    def take(key: str) -> torch.Tensor:
        if key not in weights:
            raise KeyError(f"{path / 'model.safetensors'} has no weight {key!r} (nor 'bert.{key}')")
        return weights[key].to(device=device, dtype=dtype).contiguous()

    def layer(i: int) -> BertLayer:
        p = f"encoder.layer.{i}."
        parts = ("query", "key", "value")
        return BertLayer(
            qkv_weight=torch.cat([take(f"{p}attention.self.{n}.weight") for n in parts]).contiguous(),
            qkv_bias=torch.cat([take(f"{p}attention.self.{n}.bias") for n in parts]).contiguous(),
            attn_out_weight=take(f"{p}attention.output.dense.weight"),
            attn_out_bias=take(f"{p}attention.output.dense.bias"),
            attn_ln_weight=take(f"{p}attention.output.LayerNorm.weight"),
            attn_ln_bias=take(f"{p}attention.output.LayerNorm.bias"),
            inter_weight=take(f"{p}intermediate.dense.weight"),
            inter_bias=take(f"{p}intermediate.dense.bias"),
            out_weight=take(f"{p}output.dense.weight"),
            out_bias=take(f"{p}output.dense.bias"),
            out_ln_weight=take(f"{p}output.LayerNorm.weight"),
            out_ln_bias=take(f"{p}output.LayerNorm.bias"),
        )

    return BERT(
        config=config,
        word_embeddings=take("embeddings.word_embeddings.weight"),
        position_embeddings=take("embeddings.position_embeddings.weight"),
        token_type_embeddings=take("embeddings.token_type_embeddings.weight"),
        emb_ln_weight=take("embeddings.LayerNorm.weight"),
        emb_ln_bias=take("embeddings.LayerNorm.bias"),
        layers=tuple(layer(i) for i in range(config.num_hidden_layers)),
    )


def encode(
    model: BERT,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    token_type_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The last hidden state [rows, T, hidden] of ``input_ids`` [rows, T] (right-padded rows, mask 1 = token).

    Padding positions are masked out of attention; their own outputs are computed but meaningless, and
    :func:`mean_pool` leaves them out. Raises ``ValueError`` for a sequence longer than the position table.
    """
    import torch
    import torch.nn.functional as F

    config = model.config
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [rows, T>=1], not {list(input_ids.shape)}")
    rows, steps = int(input_ids.shape[0]), int(input_ids.shape[1])
    if steps > config.max_position_embeddings:
        raise ValueError(f"{steps} tokens exceed max_position_embeddings {config.max_position_embeddings}")
    device = model.device
    input_ids = input_ids.to(device=device, dtype=torch.long)
    if attention_mask is None:
        attention_mask = torch.ones(rows, steps, dtype=torch.bool, device=device)
    keep = attention_mask.to(device=device).bool()
    types = (
        torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids.to(device=device, dtype=torch.long)
    )
    positions = torch.arange(steps, device=device)
    x = model.word_embeddings[input_ids] + model.position_embeddings[positions][None]
    x = x + model.token_type_embeddings[types]
    hidden, eps = config.hidden_size, config.layer_norm_eps
    x = F.layer_norm(x, (hidden,), model.emb_ln_weight, model.emb_ln_bias, eps)
    # [rows, 1, 1, T]: every query may attend to the row's real tokens only. A row of padding alone still
    # sees nothing but is never pooled; give it its first position so that softmax stays finite.
    mask = keep.clone()
    mask[:, 0] = True
    mask = mask[:, None, None, :]
    heads, head_dim = config.num_attention_heads, config.head_dim
    approximate = _GELU[config.hidden_act]
    for layer in model.layers:
        qkv = F.linear(x, layer.qkv_weight, layer.qkv_bias).view(rows, steps, 3, heads, head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))  # each [rows, heads, T, dim]
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(head_dim))
        attended = attended.transpose(1, 2).reshape(rows, steps, hidden)
        x = F.layer_norm(
            x + F.linear(attended, layer.attn_out_weight, layer.attn_out_bias),
            (hidden,), layer.attn_ln_weight, layer.attn_ln_bias, eps,
        )
        inner = F.gelu(F.linear(x, layer.inter_weight, layer.inter_bias), approximate=approximate)
        x = F.layer_norm(
            x + F.linear(inner, layer.out_weight, layer.out_bias),
            (hidden,), layer.out_ln_weight, layer.out_ln_bias, eps,
        )
    return x


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The mean of each row's real-token vectors: [rows, T, H] and [rows, T] -> [rows, H] (mean pooling)."""
    weights = attention_mask.to(hidden.dtype)[:, :, None]
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)


def sentence_embeddings(model: BERT, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean-pooled, L2-normalised embeddings [rows, H] (all-MiniLM-L6-v2's Transformer -> Pooling -> Normalize)."""
    import torch.nn.functional as F

    pooled = mean_pool(encode(model, input_ids, attention_mask), attention_mask.to(model.device))
    return F.normalize(pooled, p=2.0, dim=1)
