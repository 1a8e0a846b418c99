"""The block manager: the one owner of the KV cache's blocks (pool, reference counts, free runs, prefix index, copies).

Why paged. A slot per conversation reserves ``max_ctx`` positions from START whatever the conversation's length,
so a memory budget holds few conversations; here a conversation holds ``ceil(length / block_size)`` blocks and
grows one block at a time. Why shared: 32 conversations that open with the same 500-token system prompt would
store and prefill it 32 times; here the full blocks of a token prefix are registered under the prefix itself and
a conversation whose history starts the same way takes them by reference (vLLM's automatic prefix caching).

**Layout.** Per layer, keys and values are ``[kv_heads, num_blocks + 1, block_size, head_dim]``. The last block is
the *null block*: never handed out, it is what a block table is padded with and where padding rows of a batch
write, so attention (``_attention``) reads any table in the same few operations. Blocks are taken in consecutive
runs where the free list allows: a conversation's history then lies end to end, which the attention's gather reads
as one stretch of memory.

**Sharing and copy-on-write.** A full block is registered under ``(its parent's registration, its token ids)``:
an exact key (dict equality, no hash that could collide), so a block is reused only by a conversation whose
whole prefix up to that block is the same token ids. A shared block is never written: a conversation that
rewinds into one (a rolled-back turn, a re-rendered template) gets a private copy first. A block nobody holds
keeps its registration until its memory is needed (least recently freed first), so the next conversation with
the same system prompt still finds it.

Who calls what. The scheduler reserves positions when it plans a pass (:meth:`BlockManager.reserve` raises
:class:`CacheFull` and changes nothing when the pool is short: what then happens is the scheduler's decision), the
runner reads block tables and writes keys and values where they say, and the scheduler commits what a forward
wrote (:meth:`BlockManager.commit`). Bookkeeping is on the host: it decides ownership, never a device value.

torch is imported inside the functions, never at module level.
"""

from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["BlockManager", "BlockTable", "CacheFull", "DecoderLike", "PagedKVCache"]

class DecoderLike(Protocol):
    """What a cache needs to know of a decoder (GPT-2, the Llama family)."""

    @property
    def cache_shape(self) -> tuple[int, int, int]: ...  # (layers, kv_heads, head_dim)

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...


class CacheFull(RuntimeError):
    """The pool has fewer free blocks than a reservation needs; nothing was changed."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"the KV cache needs {needed} free blocks but has {free}")
        self.needed = needed
        self.free = free


@dataclass(eq=False)
class BlockTable:
    """One conversation's blocks: position ``p`` lives in block ``blocks[p // block_size]`` at ``p % block_size``.

    ``ids`` are the token ids whose keys and values the table holds (``len(ids)`` is its length; -1 where a caller
    gave no ids); ``keys[i]`` is full block ``i``'s registration key, for as many full blocks as are registered
    or known equal to a registered one.
    """

    blocks: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.ids)


class BlockManager:
    """The KV blocks of one model instance and who holds them; see the module docstring. One thread uses it."""

    def __init__(
        self,
        *,
        layers: int,
        kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        device: Any = "cpu",
        dtype: Any = None,
        share_prefixes: bool = True,
    ) -> None:
        import torch

        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        dtype = torch.float32 if dtype is None else dtype
        # One block more than can be taken: the null block (see the module docstring).
        shape = (kv_heads, num_blocks + 1, block_size, head_dim)
        # zeros, not empty: masked garbage could still be NaN or inf, and 0 * NaN in the value product poisons a row.
        self.keys = tuple(torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers))
        self.values = tuple(torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers))
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.null_block = num_blocks
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.device = self.keys[0].device
        self.share_prefixes = share_prefixes
        self.block_bytes = 2 * layers * kv_heads * block_size * head_dim * self.keys[0].element_size()
        self._refs = [0] * num_blocks
        # Free blocks holding nothing registered, sorted: the lowest are taken first, in consecutive runs where
        # possible, so live blocks stay packed at the low end of the pool and the ranges attention scores stay few
        # and dense.
        self._free = list(range(num_blocks))
        # Free blocks that keep a registration, least recently freed first: taken only when _free is empty.
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._index: dict[tuple[int, tuple[int, ...]], tuple[int, int]] = {}  # (parent key, ids) -> (block, key)
        self._registered: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> its index entry
        self._keys = itertools.count(1)  # registration keys; 0 is the empty prefix
        # Counters, for tests, logs and benchmarks.
        self.shared_hits = 0  # blocks taken by reference instead of being computed
        self._surplus = 0  # sum over blocks of (holders - 1): positions counted twice by summing tables' lengths
        self.copies = 0  # copy-on-write copies

    @classmethod
    def for_model(
        cls, model: DecoderLike, *, num_blocks: int, block_size: int = 16, share_prefixes: bool = True
    ) -> BlockManager:
        layers, kv_heads, head_dim = model.cache_shape
        return cls(
            layers=layers, kv_heads=kv_heads, head_dim=head_dim, num_blocks=num_blocks, block_size=block_size,
            device=model.device, dtype=model.dtype, share_prefixes=share_prefixes,
        )

    @staticmethod
    def bytes_per_block(model: DecoderLike, block_size: int = 16) -> int:
        import torch

        layers, kv_heads, head_dim = model.cache_shape
        return 2 * layers * kv_heads * block_size * head_dim * torch.empty((), dtype=model.dtype).element_size()

    def __repr__(self) -> str:
        return f"BlockManager(blocks={self.num_blocks}, used={self.used_blocks}, block_size={self.block_size})"

    # -- accounting -------------------------------------------------------------------------------------

    @property
    def used_blocks(self) -> int:
        """Blocks some table holds (a shared block counts once)."""
        return self.num_blocks - len(self._free) - len(self._cached)

    @property
    def free_blocks(self) -> int:
        """Blocks a reservation may take (free ones, and unheld ones that only keep a registration)."""
        return len(self._free) + len(self._cached)

    @property
    def shared_positions(self) -> int:
        """Positions that summing every table's length counts more than once (a block held by k tables, k - 1 times).

        Only full blocks are ever shared, so each extra holder of one counts ``block_size`` positions again.
        """
        return self._surplus * self.block_size

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.block_bytes

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    # -- tables -----------------------------------------------------------------------------------------

    def new_table(self) -> BlockTable:
        return BlockTable()

    def release(self, table: BlockTable) -> None:
        """Drop every block of ``table`` (END, eviction); the table is empty afterwards."""
        for block in table.blocks:
            self._unref(block)
        table.blocks.clear()
        table.ids.clear()
        table.keys.clear()

    def needed(self, table: BlockTable, start: int, end: int) -> int:
        """Free blocks :meth:`reserve` would take to make positions ``start .. end - 1`` of ``table`` writable."""
        bs = self.block_size
        kept, want, have = self.blocks_for(start), self.blocks_for(end), len(table.blocks)
        # Blocks the table holds past `start` are written again: its own are reused, shared ones replaced.
        fresh = sum(1 for block in table.blocks[kept:want] if self._refs[block] > 1) + max(want - have, 0)
        # The block holding `start` keeps its first positions: a shared one is copied, not written.
        if start % bs and kept <= have and self._refs[table.blocks[kept - 1]] > 1:
            fresh += 1
        return fresh

    def reserve(self, table: BlockTable, start: int, end: int) -> None:
        """Make positions ``start .. end - 1`` of ``table`` writable, dropping what it held from ``start`` on.

        Takes blocks for the new positions, reuses the table's own blocks past ``start`` (their stale entries lie
        past its length, where attention never looks) and copies a shared block that ``start`` falls inside.
        Raises :class:`CacheFull` (changing nothing) when the pool lacks the blocks, ``ValueError`` for a ``start``
        past the table's length. Reserving what is already reserved takes nothing.
        """
        if not 0 <= start <= table.length:
            raise ValueError(f"position {start} is not in 0..{table.length} (the conversation's length)")
        if end < start:
            raise ValueError(f"end {end} is before start {start}")
        if start == table.length and len(table.blocks) * self.block_size >= end:
            # Appending into blocks it holds (a decode step reserved before its forward): nothing to do. Blocks
            # past a table's length are never registered or shared (only full blocks within it are).
            return
        need = self.needed(table, start, end)
        if need > self.free_blocks:
            raise CacheFull(need, self.free_blocks)
        bs = self.block_size
        kept, want = self.blocks_for(start), self.blocks_for(end)
        for block in table.blocks[want:]:
            self._unref(block)
        del table.blocks[want:]
        for i in range(kept, len(table.blocks)):
            block = table.blocks[i]
            if self._refs[block] > 1:
                self._unref(block)
                table.blocks[i] = self._take()
            else:
                self._unregister(block)  # about to be written: nobody may take it as it was
        del table.ids[start:]
        del table.keys[start // bs :]
        if start % bs:
            last = table.blocks[kept - 1]
            if self._refs[last] > 1:
                copy = self._take()
                for pool in (*self.keys, *self.values):
                    pool[:, copy, : start % bs] = pool[:, last, : start % bs]
                self._unref(last)
                table.blocks[kept - 1] = copy
                self.copies += 1
            else:
                self._unregister(last)  # its tail is about to change: nobody may take it as it was
        if len(table.blocks) < want:
            after = table.blocks[-1] if table.blocks else None
            table.blocks.extend(self._take_run(want - len(table.blocks), after=after))

    def adopt_prefix(self, table: BlockTable, ids: Sequence[int], *, keep_last: bool = True) -> int:
        """Take registered blocks of ``ids``' longest registered prefix where ``table`` holds less of it.

        Returns how many leading positions of ``ids`` the table now holds. ``keep_last``: never take the last
        position of ``ids`` (its logits are what the caller needs, so it must be computed). Takes no free block.
        """
        bs = self.block_size
        held = _common_prefix(table.ids, ids)
        if not self.share_prefixes:
            return held
        limit = (len(ids) - 1 if keep_last else len(ids)) // bs
        found: list[tuple[int, int]] = []
        parent = 0
        for i in range(limit):
            entry = self._index.get((parent, tuple(ids[i * bs : (i + 1) * bs])))
            if entry is None:
                break
            found.append(entry)
            parent = entry[1]
        if len(found) * bs <= held:
            return held
        for block, _ in found:
            self._ref(block)  # before the old ones go: a block may be in both lists
        for block in table.blocks:
            self._unref(block)
        self.shared_hits += sum(1 for i, (b, _) in enumerate(found) if i >= len(table.blocks) or table.blocks[i] != b)
        table.blocks[:] = [b for b, _ in found]
        table.keys[:] = [k for _, k in found]
        table.ids[:] = ids[: len(found) * bs]
        return table.length

    def commit(self, table: BlockTable, start: int, ids: Sequence[int]) -> None:
        """A forward wrote ``ids`` at positions ``start ..`` of ``table``: it holds them now; full blocks register."""
        del table.ids[start:]
        table.ids.extend(ids)
        self._register(table)

    def block_row(self, table: BlockTable, width: int) -> list[int]:
        """The table's blocks padded to ``width`` with the null block (what attention reads past a row's end)."""
        blocks = table.blocks[:width]
        return blocks + [self.null_block] * (width - len(blocks))

    # -- internals --------------------------------------------------------------------------------------

    def _register(self, table: BlockTable) -> None:
        if not self.share_prefixes:
            return
        bs = self.block_size
        while len(table.keys) < table.length // bs:
            i = len(table.keys)
            chunk = tuple(table.ids[i * bs : (i + 1) * bs])
            if -1 in chunk:
                return  # positions written without their ids: nothing can be matched against them
            parent = table.keys[-1] if table.keys else 0
            entry = self._index.get((parent, chunk))
            block = table.blocks[i]
            if entry is None:
                key = next(self._keys)
                self._index[(parent, chunk)] = (block, key)
                self._registered[block] = (parent, chunk)
                table.keys.append(key)
            else:
                # The same prefix is registered on another block already: ours stays private, and its key is
                # that one's, so the blocks after it chain to the registered prefix.
                table.keys.append(entry[1])

    def _unregister(self, block: int) -> None:
        entry = self._registered.pop(block, None)
        if entry is not None:
            del self._index[entry]

    def _take_run(self, count: int, *, after: int | None) -> list[int]:
        """``count`` blocks, consecutive where the free list has such a run: right after ``after`` (the table's last
        block, so a conversation grows in place), else the lowest run. Attention scores consecutive blocks as one
        range; a conversation scattered among others' blocks costs a range per piece, or scores the gaps."""
        import numpy as np

        free = self._free
        at: int | None = None
        if after is not None:
            i = bisect.bisect_left(free, after + 1)
            if i + count <= len(free) and free[i] == after + 1 and free[i + count - 1] == after + count:
                at = i
        if at is None and count > 1 and len(free) >= count:
            ids = np.asarray(free, dtype=np.int64)
            runs = np.nonzero(ids[count - 1 :] - ids[: len(ids) - count + 1] == count - 1)[0]
            at = int(runs[0]) if len(runs) else None
        if at is None:
            return [self._take() for _ in range(count)]
        taken = free[at : at + count]
        del free[at : at + count]
        for block in taken:
            self._refs[block] = 1
        return taken

    def _take(self) -> int:
        if self._free:
            block = self._free.pop(0)
        else:
            block, _ = self._cached.popitem(last=False)
            self._unregister(block)
        self._refs[block] = 1
        return block

    def _ref(self, block: int) -> None:
        if self._refs[block] == 0:
            self._cached.pop(block, None)
        else:
            self._surplus += 1
        self._refs[block] += 1

    def _unref(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] > 0:
            self._surplus -= 1
        else:
            if block in self._registered:
                self._cached[block] = None
            else:
                bisect.insort(self._free, block)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


#: The name the block manager had when it also planned and computed attention; tests and tools still use it.
PagedKVCache = BlockManager
