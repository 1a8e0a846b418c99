"""Paged attention in a fixed number of device operations per layer, whatever the blocks' layout.

One forward's rows (conversations) each append ``T`` tokens. What a layer needs is a plain value,
:class:`Attention`, of device tensors the runner builds once per forward:

- ``write``: where each new position's keys and values go, one index per (row, token, kv head) into the pool seen as
  rows of ``head_dim``;
- ``tables``: each row's block table padded to one width with the null block (``[rows, width]``);
- ``positions``: each new token's absolute position (``[rows, T]``); a query at position ``p`` sees keys ``0..p``.

:func:`attend` then writes the keys and values (two ``index_copy_``), gathers every row's blocks with one
``index_select`` per pool (a conversation's blocks are mostly consecutive, so this reads long stretches of memory),
and scores queries against them with two batched matrix products and one masked softmax. The same operations run
for one row or sixty-four, a prefill or a decode step, a shared prefix or none: nothing is planned on the host, so a
decode pass of fixed shapes can be compiled or captured as one graph (``_runner``).

Why gather rather than score blocks where they lie (the previous design): the in-place scoring needed a plan per
forward on the host (which blocks are consecutive, which rows share them) and a matrix product per range of blocks
and per head, in Python. The gather costs one copy of each row's history per layer, which on a CPU is a few
hundred microseconds at 32 conversations of 300 tokens and on an accelerator is what paged kernels do anyway.

torch is imported inside the functions, never at module level.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["Attention", "attend", "write_index"]


@dataclass(frozen=True, slots=True)
class Attention:
    """One forward's attention inputs, on the device; read by every layer (see the module docstring)."""

    write: torch.Tensor  # [rows * T * kv_heads] long
    tables: torch.Tensor  # [rows, width] long: block ids, padded with the null block
    positions: torch.Tensor  # [rows, T] long
    key_positions: torch.Tensor  # [width * block_size] long: 0, 1, ..., the position of each gathered key


def write_index(
    tables: torch.Tensor, positions: torch.Tensor, *, kv_heads: int, pool_blocks: int, block_size: int
) -> torch.Tensor:
    """Pool rows (of the pool viewed as ``[-1, head_dim]``) where each (row, token, kv head) is written, on the device.

    The pool is ``[kv_heads, pool_blocks, block_size, head_dim]``: head ``h``, block ``b``, offset ``o`` is row
    ``(h * pool_blocks + b) * block_size + o``.
    """
    import torch

    blocks = torch.gather(tables, 1, torch.div(positions, block_size, rounding_mode="floor"))  # [rows, T]
    offsets = torch.remainder(positions, block_size)
    heads = torch.arange(kv_heads, device=tables.device, dtype=tables.dtype)
    rows = (heads * pool_blocks + blocks[:, :, None]) * block_size + offsets[:, :, None]  # [rows, T, kv_heads]
    return rows.reshape(-1)


def attend(
    keys: torch.Tensor,
    values: torch.Tensor,
    meta: Attention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Write ``k``, ``v`` into the pools ``keys``/``values``; return every query's attention over its history.

    ``keys``/``values`` are one layer's ``[kv_heads, pool_blocks, block_size, head_dim]``; ``q`` is
    ``[rows, T, heads, dim]``, ``k`` and ``v`` ``[rows, T, kv_heads, dim]`` (rotary already applied). Returns
    ``[rows, T, heads * dim]`` in ``q``'s dtype. Grouped-query attention: query head ``h`` reads kv head
    ``h // (heads // kv_heads)``.
    """
    import torch

    rows, steps, heads, dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    width = meta.tables.shape[1]
    block_size = keys.shape[2]
    span = width * block_size
    keys.view(-1, dim).index_copy_(0, meta.write, k.reshape(-1, dim).to(keys.dtype))
    values.view(-1, dim).index_copy_(0, meta.write, v.reshape(-1, dim).to(values.dtype))
    flat = meta.tables.reshape(-1)
    # [kv_heads, rows * width, bs, dim] -> per (kv head, row) its history: [kv_heads * rows, span, dim]
    kh = keys.index_select(1, flat).view(kv_heads * rows, span, dim)
    vh = values.index_select(1, flat).view(kv_heads * rows, span, dim)
    # Queries per (kv head, row): its group's heads and the row's tokens, [kv_heads * rows, group * T, dim].
    qh = (q * scale).to(keys.dtype).view(rows, steps, kv_heads, group, dim).permute(2, 0, 3, 1, 4)
    qh = qh.reshape(kv_heads * rows, group * steps, dim)
    scores = torch.bmm(qh, kh.transpose(1, 2)).float().view(kv_heads, rows, group, steps, span)
    # Causal and past the row's end in one mask: a key is seen when its position is at most the query's. Padding
    # (the null block, stale positions of a reused block) lies past it, and every query sees at least itself.
    hidden = meta.key_positions[None, None, :] > meta.positions[:, :, None]  # [rows, T, span]
    scores = scores.masked_fill(hidden[None, :, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(values.dtype).view(kv_heads * rows, group * steps, span)
    out = torch.bmm(weights, vh).view(kv_heads, rows, group, steps, dim)
    return out.permute(1, 3, 0, 2, 4).reshape(rows, steps, heads * dim).to(q.dtype)
