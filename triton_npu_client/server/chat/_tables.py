"""One forward on block tables, reserved and committed in the same call: what tests and tools use.

In the engine, reserving blocks is the scheduler's (``_chat``) and computing is the runner's (``_runner``); a test of a
decoder's arithmetic, a device check or a benchmark wants both in one call, on tables it holds itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ._attention import Attention, write_index
from ._decoders import Decoder, forward

if TYPE_CHECKING:
    import torch

    from ._blocks import BlockManager, BlockTable

__all__ = ["forward_tables"]


def forward_tables(
    model: Decoder,
    blocks: BlockManager,
    tables: Sequence[BlockTable],
    tokens: torch.Tensor,
    positions: Sequence[int] | None = None,
    *,
    all_logits: bool = False,
    last: Sequence[int] | None = None,
) -> torch.Tensor:
    """Reserve, run and commit one forward of ``tokens`` ``[rows, T]`` on ``tables``: for tests and tools.

    What the scheduler does around the runner, in one call: positions default to each table's length (append), a
    smaller one rewinds. Returns float logits ``[rows, vocab]`` of each row's last token (``last[r]``, for rows padded
    to one T) or ``[rows, T, vocab]`` with ``all_logits``. Raises ``ValueError`` for mismatched shapes, a repeated
    table, token ids outside the vocabulary or positions past the model's, :class:`~._blocks.CacheFull` when the pool
    lacks blocks (rows before the failing one keep their reservations; reserving again takes nothing).
    """
    import torch

    if tokens.dim() != 2 or tokens.shape[0] != len(tables) or tokens.shape[1] == 0:
        raise ValueError(f"tokens must be [len(tables)={len(tables)}, T>=1], not {list(tokens.shape)}")
    rows, steps = int(tokens.shape[0]), int(tokens.shape[1])
    if len({id(t) for t in tables}) != rows:
        raise ValueError("a conversation appears twice in one forward: its positions would be written twice")
    starts = [t.length for t in tables] if positions is None else [int(p) for p in positions]
    if len(starts) != rows:
        raise ValueError(f"{len(starts)} positions for {rows} rows")
    end = max(starts) + steps
    if min(starts) < 0 or end > model.max_positions:
        raise ValueError(
            f"positions {min(starts)}..{end - 1} are not in 0..{model.max_positions - 1} (the model's max_positions)"
        )
    host = tokens.cpu()
    low, high = int(host.min()), int(host.max())
    if low < 0 or high >= model.vocab_size:
        raise ValueError(f"token ids must be in 0..{model.vocab_size - 1}, got {low}..{high}")
    for table, start in zip(tables, starts, strict=True):
        blocks.reserve(table, start, start + steps)
    model.prepare(end)
    device = model.device
    width = max(blocks.blocks_for(s + steps) for s in starts)
    table_t = torch.tensor([blocks.block_row(t, width) for t in tables], device=device)
    pos = torch.tensor(starts, device=device)[:, None] + torch.arange(steps, device=device)
    _, kv_heads, _ = model.cache_shape
    meta = Attention(
        write=write_index(table_t, pos, kv_heads=kv_heads, pool_blocks=blocks.null_block + 1,
                          block_size=blocks.block_size),
        tables=table_t,
        positions=pos,
        key_positions=torch.arange(width * blocks.block_size, device=device),
    )  # fmt: skip
    last_t = None if last is None else torch.tensor(list(last), device=device)
    logits = forward(
        model, blocks.keys, blocks.values, tokens.to(device=device, dtype=torch.long), meta,
        last=last_t, all_logits=all_logits,
    )  # fmt: skip
    for table, start, ids in zip(tables, starts, host.tolist(), strict=True):
        blocks.commit(table, start, ids)
    return logits
