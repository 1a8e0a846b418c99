"""Every decoder family on one forward scaffold, and one loader that picks the family from ``config.json``.

A family (``_gpt2``, ``_llama``) says how to embed tokens, run one layer given an attention function, and project the
last hidden states to logits (:class:`Decoder`); :func:`forward` is the rest, the same for all: embed, every layer
with the paged attention of ``_attention`` on that layer's pool, the rows' last positions, the logits. The forward
reserves nothing and decides nothing: the block tables, write positions and masks come in as one
:class:`~._attention.Attention` value, so the same function serves a prefill, a batched decode step, and a decode
step compiled or captured as one graph.

:func:`load_decoder` reads the model type and hands the folder to the loader ``_families`` names, so a caller needs
neither to know the family nor to import torch itself.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .._files import read_json_config
from ._attention import Attention, attend
from ._families import FAMILIES, MODEL_TYPES

if TYPE_CHECKING:
    import torch

__all__ = ["AttendFn", "Decoder", "forward", "load_decoder"]

#: What a layer calls for its attention: (q, k, v, scale) -> [rows, T, heads * dim].
AttendFn = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor", float], "torch.Tensor"]


class Decoder(Protocol):
    """What the scaffold, the runner and the scheduler need of a decoder family."""

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_positions(self) -> int: ...

    @property
    def cache_shape(self) -> tuple[int, int, int]: ...  # (layers, kv_heads, head_dim)

    def prepare(self, positions: int) -> None:
        """Make any table indexed by position (rotary cos/sin) hold ``positions`` entries; before a forward."""

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Hidden states ``[rows, T, hidden]`` of ``tokens`` at ``positions``, and what every layer reads of them."""

    def layer(self, index: int, x: torch.Tensor, context: Any, attention: AttendFn) -> torch.Tensor:
        """Layer ``index`` on ``x``; ``attention`` writes this layer's keys and values and reads its history."""

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Float logits ``[rows, vocab]`` of the final hidden states ``x`` ``[rows, hidden]``."""


def forward(
    model: Decoder,
    keys: tuple[torch.Tensor, ...],
    values: tuple[torch.Tensor, ...],
    tokens: torch.Tensor,
    meta: Attention,
    *,
    last: torch.Tensor | None = None,
    all_logits: bool = False,
) -> torch.Tensor:
    """One forward of ``tokens`` ``[rows, T]`` (at ``meta.positions``) over the pools ``keys``/``values`` per layer.

    Returns float logits ``[rows, vocab]`` of each row's last token (``last[r]``: row ``r``'s own last index, for
    rows padded to one T), or ``[rows, T, vocab]`` with ``all_logits``. Pure device work: every input is on the
    model's device and nothing here copies to the host.
    """
    x, context = model.embed(tokens, meta.positions)
    for index in range(len(keys)):
        pool_k, pool_v = keys[index], values[index]

        def attention(
            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, pool_k: Any = pool_k, pool_v: Any = pool_v
        ) -> torch.Tensor:
            return attend(pool_k, pool_v, meta, q, k, v, scale)

        x = model.layer(index, x, context, attention)
    if all_logits:
        rows, steps = x.shape[0], x.shape[1]
        return model.logits(x.reshape(rows * steps, -1)).view(rows, steps, -1)
    if last is not None:
        import torch

        x = x[torch.arange(x.shape[0], device=x.device), last]
    else:
        x = x[:, -1]
    return model.logits(x)


def load_decoder(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> Decoder:
    """Load the checkpoint folder ``path`` with the decoder its ``config.json`` names (``model_type``).

    The family's loader comes from ``_families.FAMILIES``. ``dtype`` defaults to float32. Raises ``ValueError``
    naming the model type and the supported ones for any other, ``FileNotFoundError`` when there is no ``config.json``.
    """
    model_type = read_json_config(path).get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ValueError(
            f"{Path(path)}: config.json's model_type {model_type!r} is not supported; supported are "
            f"{', '.join(sorted(MODEL_TYPES))}"
        )
    module, loader = family
    load: Any = getattr(importlib.import_module(f".{module}", __package__), loader)
    decoder: Decoder = load(path, device, dtype)
    return decoder
