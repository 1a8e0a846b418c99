"""A GPT-2 decoder in plain torch on the paged KV cache (``_paged``), for batched chat decoding.

The weights come from a Hugging Face checkpoint folder (``config.json`` and ``model.safetensors``) and
the model is a frozen set of tensors driven by :func:`forward`, not an ``nn.Module``: a serving loop
needs no autograd, hooks or module tree, and plain tensors move to any torch device (``npu:0`` with
torch_npu, ``cuda:0``, ``cpu``) the same way.

torch is imported inside the functions, never at module level, so that ``import
triton_npu_client.server`` stays torch-free for CPU instances that keep their state in numpy.

Serving shape: the family's three steps (``embed``, ``layer``, ``logits``) run on the shared forward scaffold of
``_decoders``, over the paged KV cache of ``_blocks``: one forward runs one step for several conversations at once
(one row each), a prompt prefill (many tokens) or a decode step (one token per row).
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

    from ._decoders import AttendFn

__all__ = ["GPT2", "GPT2Config", "GPT2Layer", "load_gpt2"]

# Hugging Face names for the tanh approximation of GELU that GPT-2 was trained with, and the exact one.
_TANH_GELU = frozenset({"gelu_new", "gelu_pytorch_tanh"})
_EXACT_GELU = frozenset({"gelu"})


@dataclass(frozen=True)
class GPT2Config:
    """The shape of a GPT-2 model, as read from a Hugging Face ``config.json``."""

    n_layer: int
    n_head: int
    n_embd: int
    n_positions: int
    vocab_size: int
    layer_norm_epsilon: float = 1e-5
    activation_function: str = "gelu_new"

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not a multiple of n_head {self.n_head}")
        if self.activation_function not in _TANH_GELU | _EXACT_GELU:
            raise ValueError(f"unsupported activation_function {self.activation_function!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> GPT2Config:
        """Read the fields this decoder needs; refuse options that would change its arithmetic."""
        # Variants this decoder does not implement: loading them silently would give wrong logits.
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if raw.get(flag):
                raise ValueError(f"unsupported GPT-2 option {flag}=true")
        if raw.get("scale_attn_weights", True) is False:
            raise ValueError("unsupported GPT-2 option scale_attn_weights=false")
        # Old checkpoints name the context length n_ctx; newer ones n_positions (and may keep both).
        n_positions = raw.get("n_positions", raw.get("n_ctx"))
        if n_positions is None:
            raise ValueError("config has neither n_positions nor n_ctx")
        return cls(
            n_layer=int(raw["n_layer"]),
            n_head=int(raw["n_head"]),
            n_embd=int(raw["n_embd"]),
            n_positions=int(n_positions),
            vocab_size=int(raw["vocab_size"]),
            layer_norm_epsilon=float(raw.get("layer_norm_epsilon", 1e-5)),
            activation_function=str(raw.get("activation_function", "gelu_new")),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> GPT2Config:
        """Read ``config.json``; ``path`` is the file or the checkpoint folder holding it."""
        return cls.from_dict(read_json_config(path))


@dataclass(frozen=True)
class GPT2Layer:
    """One transformer block's weights. Linear weights are [in, out] (GPT-2's Conv1D layout): ``x @ w``."""

    ln_1_weight: torch.Tensor
    ln_1_bias: torch.Tensor
    attn_weight: torch.Tensor  # [n_embd, 3 * n_embd]: query, key, value side by side
    attn_bias: torch.Tensor
    attn_proj_weight: torch.Tensor
    attn_proj_bias: torch.Tensor
    ln_2_weight: torch.Tensor
    ln_2_bias: torch.Tensor
    fc_weight: torch.Tensor
    fc_bias: torch.Tensor
    mlp_proj_weight: torch.Tensor
    mlp_proj_bias: torch.Tensor


@dataclass(frozen=True)
class GPT2:
    """A loaded GPT-2: its config and weights, all on one device in one dtype. See :func:`load_gpt2`."""

    config: GPT2Config
    wte: torch.Tensor  # [vocab, n_embd]; also the output projection (GPT-2 ties lm_head to it)
    wpe: torch.Tensor  # [n_positions, n_embd]
    layers: tuple[GPT2Layer, ...]
    ln_f_weight: torch.Tensor
    ln_f_bias: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.wte.device

    @property
    def dtype(self) -> torch.dtype:
        return self.wte.dtype

    @property
    def cache_shape(self) -> tuple[int, int, int]:
        """(layers, kv heads, head dim) of its KV cache."""
        return self.config.n_layer, self.config.n_head, self.config.head_dim

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_positions(self) -> int:
        return self.config.n_positions

    def prepare(self, positions: int) -> None:
        """Learned position embeddings end at ``n_positions``: there is nothing to grow."""
        if positions > self.config.n_positions:
            raise ValueError(f"positions up to {positions} exceed n_positions {self.config.n_positions}")

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return self.wte[tokens] + self.wpe[positions], None

    def layer(self, index: int, x: torch.Tensor, context: Any, attention: AttendFn) -> torch.Tensor:
        import torch
        import torch.nn.functional as F

        config = self.config
        layer = self.layers[index]
        rows, steps, width = x.shape
        heads, head_dim = config.n_head, config.head_dim
        h = F.layer_norm(x, (width,), layer.ln_1_weight, layer.ln_1_bias, config.layer_norm_epsilon)
        qkv = torch.addmm(layer.attn_bias, h.reshape(-1, width), layer.attn_weight)
        q, k, v = qkv.view(rows, steps, 3, heads, head_dim).unbind(2)  # each [rows, T, heads, dim]
        attended = attention(q, k, v, 1.0 / math.sqrt(head_dim)).reshape(-1, width)
        x = x + torch.addmm(layer.attn_proj_bias, attended, layer.attn_proj_weight).view(rows, steps, -1)
        h = F.layer_norm(x, (width,), layer.ln_2_weight, layer.ln_2_bias, config.layer_norm_epsilon)
        inner = _gelu(torch.addmm(layer.fc_bias, h.reshape(-1, width), layer.fc_weight), config.activation_function)
        return x + torch.addmm(layer.mlp_proj_bias, inner, layer.mlp_proj_weight).view(rows, steps, -1)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        config = self.config
        x = F.layer_norm(x, (config.n_embd,), self.ln_f_weight, self.ln_f_bias, config.layer_norm_epsilon)
        return (x @ self.wte.T).float()


# Our field name -> the Hugging Face key suffix under ``h.<i>.``.
_LAYER_KEYS = {
    "ln_1_weight": "ln_1.weight",
    "ln_1_bias": "ln_1.bias",
    "attn_weight": "attn.c_attn.weight",
    "attn_bias": "attn.c_attn.bias",
    "attn_proj_weight": "attn.c_proj.weight",
    "attn_proj_bias": "attn.c_proj.bias",
    "ln_2_weight": "ln_2.weight",
    "ln_2_bias": "ln_2.bias",
    "fc_weight": "mlp.c_fc.weight",
    "fc_bias": "mlp.c_fc.bias",
    "mlp_proj_weight": "mlp.c_proj.weight",
    "mlp_proj_bias": "mlp.c_proj.bias",
}


def load_gpt2(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> GPT2:
    """Load a Hugging Face GPT-2 checkpoint folder (``config.json`` + ``model.safetensors``).

    Keys are accepted with or without the ``transformer.`` prefix (``GPT2LMHeadModel`` and
    ``GPT2Model`` checkpoints); ``lm_head.weight``, when saved, is ignored because GPT-2 ties it to
    ``wte``. ``dtype`` defaults to float32. Raises ``KeyError`` naming a missing weight.
    """
    import torch
    from safetensors.torch import load_file

    path = Path(path)
    config = GPT2Config.from_file(path)
    dtype = torch.float32 if dtype is None else dtype
    # Loaded to host memory first: safetensors maps the file, and one .to() per tensor then both
    # places and casts it, whatever the device's own loading support is.
    raw = load_file(str(path / "model.safetensors"), device="cpu")
    weights = {key.removeprefix("transformer."): value for key, value in raw.items()}

    def take(key: str) -> torch.Tensor:
        if key not in weights:
            raise KeyError(f"{path / 'model.safetensors'} has no weight {key!r} (nor 'transformer.{key}')")
        return weights[key].to(device=device, dtype=dtype).contiguous()

    layers = tuple(
        GPT2Layer(**{field: take(f"h.{i}.{suffix}") for field, suffix in _LAYER_KEYS.items()})
        for i in range(config.n_layer)
    )
    return GPT2(
        config=config,
        wte=take("wte.weight"),
        wpe=take("wpe.weight"),
        layers=layers,
        ln_f_weight=take("ln_f.weight"),
        ln_f_bias=take("ln_f.bias"),
    )


def _gelu(x: torch.Tensor, activation: str) -> torch.Tensor:
    import torch.nn.functional as F

    return F.gelu(x, approximate="tanh" if activation in _TANH_GELU else "none")
