"""A GPT-2 decoder in plain torch with a preallocated, slot-indexed KV cache, for batched chat decoding.

The weights come from a Hugging Face checkpoint folder (``config.json`` and ``model.safetensors``) and
the model is a frozen set of tensors driven by :func:`forward`, not an ``nn.Module``: a serving loop
needs no autograd, hooks or module tree, and plain tensors move to any torch device (``npu:0`` with
torch_npu, ``cuda:0``, ``cpu``) the same way.

torch is imported inside the functions, never at module level, so that ``import
triton_npu_client.server`` stays torch-free for CPU instances that keep their state in numpy.

Serving shape: a :class:`KVCache` holds ``slots`` conversations side by side. One :func:`forward` call
runs one step for several slots at once (one row per slot): either a prompt prefill (many tokens)
or a decode step (one token per row), each row starting at its own position.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._files import read_json_config

if TYPE_CHECKING:
    import torch

__all__ = ["GPT2", "GPT2Config", "GPT2Layer", "KVCache", "forward", "load_gpt2"]

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


@dataclass(frozen=True)
class KVCache:
    """Per-layer keys and values for ``slots`` conversations, allocated once on the model's device.

    ``keys[l]`` and ``values[l]`` are [slots, heads, max_ctx, head_dim]. Slot first, so that one
    conversation's history is one contiguous block that a step writes in place and a batch of
    consecutive slots reads as a view; heads before positions, so that attention reads each head's
    [positions, head_dim] as a contiguous matrix, the layout batched matmul and fused attention
    kernels take without a transpose copy.

    ``lengths[s]`` is how many positions slot ``s`` holds. It lives on the host: each step needs it
    to check bounds and to build the mask, and a device tensor would cost a device-to-host sync per
    step. Entries at or beyond a slot's length are stale (a previous occupant's, or never written) and
    :func:`forward` masks them out, so :meth:`reset` only sets the length to 0 and never clears memory.
    """

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    lengths: list[int]

    @property
    def slots(self) -> int:
        return len(self.lengths)

    @property
    def max_ctx(self) -> int:
        return int(self.keys[0].shape[2])

    @classmethod
    def allocate(cls, model: GPT2, slots: int, max_ctx: int | None = None) -> KVCache:
        """Allocate the cache for ``slots`` conversations of up to ``max_ctx`` positions (default: n_positions)."""
        import torch

        config = model.config
        max_ctx = config.n_positions if max_ctx is None else max_ctx
        if not 0 < max_ctx <= config.n_positions:
            raise ValueError(f"max_ctx must be in 1..{config.n_positions} (n_positions), not {max_ctx}")
        if slots < 1:
            raise ValueError(f"slots must be at least 1, not {slots}")
        shape = (slots, config.n_head, max_ctx, config.head_dim)

        def block() -> torch.Tensor:
            # zeros, not empty: stale entries are masked, but masked garbage could still be NaN/inf,
            # and 0 * NaN in an attention product would poison the row.
            return torch.zeros(shape, device=model.device, dtype=model.dtype)

        return cls(
            keys=tuple(block() for _ in range(config.n_layer)),
            values=tuple(block() for _ in range(config.n_layer)),
            lengths=[0] * slots,
        )

    def reset(self, slot: int) -> None:
        """Free ``slot`` for a new conversation: its old entries become stale and invisible."""
        self.lengths[slot] = 0


def _gelu(x: torch.Tensor, activation: str) -> torch.Tensor:
    import torch.nn.functional as F

    return F.gelu(x, approximate="tanh" if activation in _TANH_GELU else "none")


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: Sequence[int],
    slot_index: torch.Tensor,
    starts: Sequence[int],
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of ``q`` [rows, heads, T, dim] over the cached keys and values of each row's slot.

    The history is read in place, never copied: attention takes a *view* of the cache block.
    - Consecutive ascending slots (a batch filling slots 0..B-1, a one-slot prefill): one view of
      those slots.
    - Slots spread over a range at most twice the batch: one view of the whole range. The rows of
      slots outside the batch are padding: their queries are zeros, they may see their position 0
      only (so no softmax row is empty), and their output is dropped. Wasted work is bounded by the
      batch's own.
    - Slots spread wider: one attention call per row on that slot's own view.
    Returns [rows, heads, T, dim] in the order of ``slots``.
    """
    import torch
    import torch.nn.functional as F

    rows, steps = int(q.shape[0]), int(q.shape[2])
    width = int(mask.shape[-1])
    first, last = min(slots), max(slots)
    span = last - first + 1
    if list(slots) == list(range(first, first + rows)):
        return F.scaled_dot_product_attention(
            q, keys[first : last + 1, :, :width], values[first : last + 1, :, :width], attn_mask=mask, scale=scale
        )
    if span <= 2 * rows:
        index = slot_index - first
        q_span = q.new_zeros((span, *q.shape[1:])).index_copy_(0, index, q)
        mask_span = torch.zeros((span, 1, steps, width), dtype=torch.bool, device=q.device)
        mask_span[:, :, :, 0] = True
        mask_span.index_copy_(0, index, mask)
        out = F.scaled_dot_product_attention(
            q_span, keys[first : last + 1, :, :width], values[first : last + 1, :, :width], attn_mask=mask_span,
            scale=scale,
        )
        return out.index_select(0, index)
    pieces: list[torch.Tensor] = []
    for row, (slot, start) in enumerate(zip(slots, starts, strict=True)):
        end = start + steps
        pieces.append(
            F.scaled_dot_product_attention(
                q[row : row + 1], keys[slot : slot + 1, :, :end], values[slot : slot + 1, :, :end],
                attn_mask=mask[row : row + 1, :, :, :end], scale=scale,
            )
        )
    return torch.cat(pieces)


def forward(
    model: GPT2,
    cache: KVCache,
    slots: Sequence[int],
    tokens: torch.Tensor,
    positions: Sequence[int] | None = None,
    *,
    all_logits: bool = False,
) -> torch.Tensor:
    """Run one step: append ``tokens`` [rows, T] to the conversations in ``slots`` (one slot per row).

    Prefill is one row with the whole prompt (T = prompt length); a decode step is many rows with
    T = 1. Row ``b`` is written at positions ``positions[b]`` .. ``positions[b] + T - 1`` of slot
    ``slots[b]`` and attends to everything the slot holds before them plus itself. ``positions``
    defaults to each slot's length (append); a smaller position rewinds the slot, dropping what
    followed. Afterwards ``cache.lengths[slots[b]] == positions[b] + T``.

    Returns float logits [rows, vocab] for each row's last token, or [rows, T, vocab] with
    ``all_logits``. Raises ``ValueError`` for repeated slots, mismatched shapes or positions past the
    slot's length or the cache's capacity.
    """
    import torch
    import torch.nn.functional as F

    config = model.config
    if tokens.dim() != 2 or tokens.shape[0] != len(slots) or tokens.shape[1] == 0:
        raise ValueError(f"tokens must be [len(slots)={len(slots)}, T>=1], not {list(tokens.shape)}")
    # Two rows on one slot would write the same cache positions in one step: the result is undefined.
    if len(set(slots)) != len(slots):
        raise ValueError(f"slots repeat in one step: {list(slots)}")
    rows, steps = int(tokens.shape[0]), int(tokens.shape[1])
    starts = [cache.lengths[s] for s in slots] if positions is None else [int(p) for p in positions]
    if len(starts) != rows:
        raise ValueError(f"{len(starts)} positions for {rows} rows")
    for slot, start in zip(slots, starts, strict=True):
        if not 0 <= slot < cache.slots:
            raise ValueError(f"slot {slot} is not in 0..{cache.slots - 1}")
        # A start past the length would leave a hole of stale entries that the mask lets through.
        if not 0 <= start <= cache.lengths[slot]:
            raise ValueError(f"position {start} for slot {slot} is not in 0..{cache.lengths[slot]} (its length)")
        if start + steps > cache.max_ctx:
            raise ValueError(f"slot {slot}: positions up to {start + steps} exceed max_ctx {cache.max_ctx}")

    device = model.device
    tokens = tokens.to(device=device, dtype=torch.long)
    slot_index = torch.tensor(list(slots), device=device, dtype=torch.long)
    # Absolute position of every new token: [rows, T]. Rows differ in where they start, so each row
    # has its own position embeddings and its own cache positions.
    pos = torch.tensor(starts, device=device, dtype=torch.long)[:, None] + torch.arange(steps, device=device)
    # Attention only needs the cache up to the longest row's end; the rest of max_ctx is not read.
    width = max(starts) + steps
    # The one mask for both jobs: a token at absolute position p sees cache positions 0..p. That is
    # causal order within the new tokens, and it hides every position at or past the row's new
    # length, i.e. stale entries of a reused slot and the padding a shorter row gets from sharing
    # `width` with a longer one. Every token sees at least position 0, so no softmax row is empty.
    # [rows, 1 (broadcast over heads), T, width]; True means "may attend".
    mask = (torch.arange(width, device=device)[None, None, :] <= pos[:, :, None])[:, None]
    # Advanced indices on dims 0 and 2 of a [slots, heads, ctx, dim] block select [rows, T] pairs
    # (slot of the row, position of the token) and take values shaped [rows, T, heads, dim].
    write_slot = slot_index[:, None].expand(rows, steps)

    heads, head_dim = config.n_head, config.head_dim
    x = model.wte[tokens] + model.wpe[pos]  # [rows, T, n_embd]
    for layer, keys, values in zip(model.layers, cache.keys, cache.values, strict=True):
        h = F.layer_norm(x, (config.n_embd,), layer.ln_1_weight, layer.ln_1_bias, config.layer_norm_epsilon)
        qkv = torch.addmm(layer.attn_bias, h.reshape(-1, config.n_embd), layer.attn_weight)
        q, k, v = qkv.view(rows, steps, 3, heads, head_dim).unbind(2)  # each [rows, T, heads, dim]
        # In place, only the new positions: the history already in the cache is never copied or moved.
        keys[write_slot, :, pos] = k
        values[write_slot, :, pos] = v
        attended = _attend(
            q.transpose(1, 2),  # [rows, heads, T, dim]
            keys, values, slots, slot_index, starts, mask, 1.0 / math.sqrt(head_dim),
        )
        attended = attended.transpose(1, 2).reshape(-1, config.n_embd)
        x = x + torch.addmm(layer.attn_proj_bias, attended, layer.attn_proj_weight).view(rows, steps, -1)
        h = F.layer_norm(x, (config.n_embd,), layer.ln_2_weight, layer.ln_2_bias, config.layer_norm_epsilon)
        inner = torch.addmm(layer.fc_bias, h.reshape(-1, config.n_embd), layer.fc_weight)
        inner = _gelu(inner, config.activation_function)
        x = x + torch.addmm(layer.mlp_proj_bias, inner, layer.mlp_proj_weight).view(rows, steps, -1)

    for slot, start in zip(slots, starts, strict=True):
        cache.lengths[slot] = start + steps
    # The vocabulary projection is the largest matmul of a decode step; a step that only samples the
    # next token projects the last position alone.
    if not all_logits:
        x = x[:, -1]
    x = F.layer_norm(x, (config.n_embd,), model.ln_f_weight, model.ln_f_bias, config.layer_norm_epsilon)
    return (x @ model.wte.T).float()
