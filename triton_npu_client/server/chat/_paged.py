"""A paged KV cache: fixed-size blocks in one pool per layer, a block table per conversation, equal prefixes shared.

Why paged. A slot per conversation reserves ``max_ctx`` positions from START whatever the conversation's length,
so a memory budget holds few conversations; here a conversation holds ``ceil(length / block_size)`` blocks and
grows one block at a time. Why shared: 32 conversations that open with the same 500-token system prompt would
store and prefill it 32 times; here the full blocks of a token prefix are registered under the prefix itself and
a conversation whose history starts the same way takes them by reference (vLLM's automatic prefix caching).

**Layout.** Per layer, keys and values are ``[kv_heads, num_blocks, block_size, head_dim]``: per head, the blocks
lie end to end, so a run of consecutive blocks is one contiguous ``[kv_heads, n * block_size, head_dim]`` view
(one matmul per head scores a lone conversation's whole run, as a slot cache would), and a range of blocks read by
several rows is ``[n, block_size, head_dim]`` per head (one batched matmul scores each block against its own
rows). Attention never gathers a conversation's history into a copy: it scores the queries against each block
where it lies (:meth:`PagedKVCache.attend`); only the queries are copied, laid out per block.

**Sharing and copy-on-write.** A full block is registered under ``(its parent's registration, its token ids)``:
an exact key (dict equality, no hash that could collide), so a block is reused only by a conversation whose
whole prefix up to that block is the same token ids. A shared block is never written: a conversation that
rewinds into one (a rolled-back turn, a re-rendered template) gets a private copy first. A block nobody holds
keeps its registration until its memory is needed (least recently freed first), so the next conversation with
the same system prompt still finds it.

**Bookkeeping is on the host** (block tables, reference counts, the prefix index): every step needs it to
build the write positions and masks, and device-side tables would cost a device-to-host sync per step.

torch is imported inside the functions, never at module level.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["AttentionPlan", "BlockTable", "CacheFull", "DecoderLike", "PagedKVCache"]

#: Blocks of a class (private or shared) further apart than this are scored in separate ranges: a gap of unused
#: blocks between two ranges would otherwise be scored (and discarded) with them.
_GAP_BLOCKS = 8


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


@dataclass(frozen=True, slots=True)
class _Range:
    """Blocks ``lo .. lo + n - 1`` scored against the rows ``owner`` names ([n * M]), except where ``blocked``.

    A slot with no row names row 0 and is blocked whole: it adds nothing to row 0's maximum, sum or output.
    """

    lo: int
    n: int
    width: int  # M: row slots per block (1 for private blocks, the most sharers for shared ones)
    owner: Any  # torch.Tensor [n * M] long, on the device
    blocked: Any  # torch.Tensor [1, n, M, 1, T, block_size] bool: True may NOT attend
    flat: Any  # a lone row's (M = 1) mask as [T, n * block_size], the layout of a run's scores; None otherwise
    # A shared range (M > 1) is scored as one run against its readers' queries: ``readers`` [S] rows, ``run_blocked``
    # [1, S, 1, T, n * block_size] (kv heads, readers, group, T, positions of the run). None for a private range.
    readers: Any = None
    run_blocked: Any = None


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """One forward's positions and masks, made once by :meth:`PagedKVCache.plan` and read by every layer."""

    tables: tuple[BlockTable, ...]
    starts: tuple[int, ...]
    steps: int
    ids: tuple[tuple[int, ...], ...] | None
    write_index: Any  # torch.Tensor [rows * T * kv_heads] long: rows of the pool viewed as [-1, head_dim]
    ranges: tuple[_Range, ...]

    @property
    def rows(self) -> int:
        return len(self.tables)


class PagedKVCache:
    """The block pool of one model instance; see the module docstring. Not thread-safe: one loop thread uses it."""

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
        shape = (kv_heads, num_blocks, block_size, head_dim)
        # zeros, not empty: masked garbage could still be NaN or inf, and 0 * NaN in the value product poisons a row.
        self.keys = tuple(torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers))
        self.values = tuple(torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers))
        self.block_size = block_size
        self.num_blocks = num_blocks
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
    ) -> PagedKVCache:
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
        return f"PagedKVCache(blocks={self.num_blocks}, used={self.used_blocks}, block_size={self.block_size})"

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

    # -- one forward ------------------------------------------------------------------------------------

    def plan(
        self,
        tables: Sequence[BlockTable],
        starts: Sequence[int] | None,
        tokens: int | Any,
    ) -> AttentionPlan:
        """Reserve and lay out one forward: row ``r`` appends ``T`` tokens to ``tables[r]`` at ``starts[r]``.

        ``tokens`` is the [rows, T] token tensor (on the host; its ids are kept for prefix sharing) or just
        ``T``. ``starts`` defaults to each table's length (append); a smaller start rewinds. Raises
        ``ValueError`` for a table repeated in one forward or a bad start, :class:`CacheFull` from the
        reservation (rows before the failing one keep theirs: reserving again takes nothing).
        """
        import numpy as np
        import torch

        if isinstance(tokens, int):
            steps, ids = tokens, None
        else:
            steps = int(tokens.shape[1])
            ids = tuple(tuple(row) for row in tokens.tolist())
        rows = len(tables)
        if steps < 1 or rows < 1:
            raise ValueError(f"a forward needs rows >= 1 and T >= 1, got {rows} rows of {steps}")
        if len({id(t) for t in tables}) != rows:
            raise ValueError("a conversation appears twice in one forward: its positions would be written twice")
        starts = [t.length for t in tables] if starts is None else [int(s) for s in starts]
        if len(starts) != rows:
            raise ValueError(f"{len(starts)} starts for {rows} rows")
        for table, start in zip(tables, starts, strict=True):
            self.reserve(table, start, start + steps)
        bs, kv_heads = self.block_size, self.kv_heads
        device = self.device

        # Every (block, row) pair attention reads: the blocks each row sees, up to its last new position.
        counts = [(s + steps + bs - 1) // bs for s in starts]
        block_of = np.array([b for t, n in zip(tables, counts, strict=True) for b in t.blocks[:n]], dtype=np.int64)
        firsts = np.cumsum([0, *counts[:-1]])
        row_of = np.repeat(np.arange(rows, dtype=np.int64), counts)
        index_of = np.arange(len(block_of), dtype=np.int64) - np.repeat(firsts, counts)
        # Where each new position's keys go, one pool row per kv head: ((head * num_blocks + block) * bs + offset).
        pos = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(steps, dtype=np.int64)  # [rows, T]
        write_blocks = block_of[firsts[:, None] + pos // bs]  # [rows, T]
        heads = np.arange(kv_heads, dtype=np.int64)
        write = ((heads * self.num_blocks + write_blocks[:, :, None]) * bs + (pos % bs)[:, :, None]).reshape(-1)
        query_pos = torch.as_tensor(pos, device=device)  # [rows, T]
        ranges: list[_Range] = []
        if len(np.unique(block_of)) == len(block_of):
            # No block read twice (the usual decode, a prefill): one class of private blocks, no grouping needed.
            order = np.argsort(block_of, kind="stable")
            classes = [(block_of[order], row_of[order][:, None], index_of[order][:, None])]
        else:
            # A block read by several rows (a shared prefix) is scored once against all of them; a private block
            # against its one row. Separate classes, so private blocks do not pay for the widest sharing.
            order = np.lexsort((row_of, block_of))
            block_of, row_of, index_of = block_of[order], row_of[order], index_of[order]
            unique, first, counts = np.unique(block_of, return_index=True, return_counts=True)
            classes = []
            for shared in (False, True):
                chosen = np.nonzero(counts > 1 if shared else counts == 1)[0]
                if not len(chosen):
                    continue
                width = int(counts[chosen].max())
                owner = np.zeros((len(chosen), width), dtype=np.int64)
                at = np.full((len(chosen), width), -1, dtype=np.int64)
                sizes, firsts = counts[chosen], first[chosen]
                for c in range(width):
                    sel = sizes > c
                    owner[sel, c] = row_of[firsts[sel] + c]
                    at[sel, c] = index_of[firsts[sel] + c]
                classes.append((unique[chosen], owner, at))
        for blocks, owner_of, at_of in classes:
            width = owner_of.shape[1]
            # Split where the blocks of a class leave a gap: unused blocks between them would be scored too, against
            # every row of the class (a shared range: never worth it).
            cuts = np.nonzero(np.diff(blocks) > (_GAP_BLOCKS if width == 1 else 1))[0] + 1
            for part in np.split(np.arange(len(blocks)), cuts):
                lo, hi = int(blocks[part[0]]), int(blocks[part[-1]])
                n = hi - lo + 1
                slots = blocks[part] - lo
                owner = np.zeros((n, width), dtype=np.int64)  # a slot no row reads names row 0, blocked whole
                at = np.full((n, width), -1, dtype=np.int64)  # the block's index in the row's table
                owner[slots], at[slots] = owner_of[part], at_of[part]
                owner_t = torch.as_tensor(owner, device=device)
                at_t = torch.as_tensor(at, device=device)
                # Key position of each (block, slot, offset); a query at absolute position p sees keys at 0..p,
                # which is causal order within the new tokens and hides what lies past a row's length.
                key_pos = at_t[:, :, None] * bs + torch.arange(bs, device=device)  # [n, M, bs]
                q = query_pos[owner_t]  # [n, M, T]
                blocked = (key_pos[:, :, None, :] > q[:, :, :, None]) | (at_t < 0)[:, :, None, None]
                flat = blocked[:, 0].permute(1, 0, 2).reshape(steps, n * bs) if rows == 1 and width == 1 else None
                readers = run_blocked = None
                if width > 1:
                    # Every reader's queries against the whole run at once (a view of the pool per head), instead
                    # of a copy of all of them per block: what a shared prefix read by many rows wants.
                    valid = at >= 0
                    who = np.unique(owner[valid])
                    index = np.searchsorted(who, owner)  # row -> its place among the readers
                    run_pos = np.full((len(who), n, bs), -1, dtype=np.int64)
                    block_slot = np.broadcast_to(np.arange(n)[:, None], owner.shape)
                    run_pos[index[valid], block_slot[valid]] = at[valid][:, None] * bs + np.arange(bs)
                    run_t = torch.as_tensor(run_pos.reshape(len(who), n * bs), device=device)
                    readers = torch.as_tensor(who, device=device)
                    seen_by = query_pos.index_select(0, readers)  # [S, T]
                    run_blocked = ((run_t[:, None, :] < 0) | (run_t[:, None, :] > seen_by[:, :, None]))[None, :, None]
                ranges.append(
                    _Range(
                        lo=lo, n=n, width=width, owner=owner_t.reshape(-1), blocked=blocked[None, :, :, None],
                        flat=flat, readers=readers, run_blocked=run_blocked,
                    )
                )  # fmt: skip
        return AttentionPlan(
            tables=tuple(tables),
            starts=tuple(starts),
            steps=steps,
            ids=ids,
            write_index=torch.as_tensor(write, device=device),
            ranges=tuple(ranges),
        )

    def attend(self, layer: int, plan: AttentionPlan, q: Any, k: Any, v: Any, scale: float) -> Any:
        """Write ``k``, ``v`` at the plan's positions of ``layer``; return each query's attention over its history.

        ``q`` [rows, T, heads, dim], ``k`` and ``v`` [rows, T, kv_heads, dim] (rotary already applied); returns
        [rows, T, heads * dim]. Each range of blocks is scored in place against the queries of the rows that
        read it; a softmax over every block of a row comes from their maxima and sums (flash-decoding's merge).
        """
        import torch

        keys, values = self.keys[layer], self.values[layer]
        rows, steps, heads, dim = (int(x) for x in q.shape)
        kv_heads = int(k.shape[2])
        group = heads // kv_heads
        gt = group * steps
        keys.view(-1, dim).index_copy_(0, plan.write_index, k.reshape(-1, dim).to(keys.dtype))
        values.view(-1, dim).index_copy_(0, plan.write_index, v.reshape(-1, dim).to(values.dtype))
        # [rows, kv_heads, group * T, dim]
        qr = (q * scale).to(keys.dtype).view(rows, steps, kv_heads, group, dim).permute(0, 2, 3, 1, 4)
        qr = qr.reshape(rows, kv_heads, gt, dim)
        if rows == 1 and all(rng.flat is not None for rng in plan.ranges):
            return self._attend_alone(plan, qr[0], keys, values, steps, group).to(q.dtype)
        bs = self.block_size
        scores: list[Any] = []
        row_max = torch.full((rows, kv_heads, gt), -math.inf, device=q.device)
        for rng in plan.ranges:
            n, width = rng.n, rng.width
            if rng.readers is not None:
                readers = int(rng.readers.shape[0])
                qs = qr.index_select(0, rng.readers).transpose(0, 1).reshape(kv_heads, readers * gt, dim)
                kb = keys[:, rng.lo : rng.lo + n].view(kv_heads, n * bs, dim)
                s = torch.bmm(qs, kb.transpose(1, 2)).float().view(kv_heads, readers, group, steps, n * bs)
                s.masked_fill_(rng.run_blocked, -math.inf)
                run_max = s.amax(dim=-1).transpose(0, 1).reshape(readers, kv_heads, gt)
                row_max.scatter_reduce_(0, rng.readers[:, None, None].expand_as(run_max), run_max, reduce="amax")
                scores.append(s)
                continue
            # Queries laid out per block, per head: [kv_heads, n, M * group * T, dim]
            qb = qr.index_select(0, rng.owner).view(n, width, kv_heads, gt, dim).permute(2, 0, 1, 3, 4)
            qb = qb.reshape(kv_heads, n, width * gt, dim)
            # Per head, the range's blocks are [n, bs, dim] views of the pool: a block against its own rows.
            s = torch.stack(
                [torch.bmm(qb[h], keys[h, rng.lo : rng.lo + n].transpose(1, 2)) for h in range(kv_heads)]
            ).float().view(kv_heads, n, width, group, steps, bs)
            s.masked_fill_(rng.blocked, -math.inf)
            pair_max = s.amax(dim=-1).permute(1, 2, 0, 3, 4).reshape(n * width, kv_heads, gt)  # pair-major
            row_max.scatter_reduce_(0, rng.owner[:, None, None].expand_as(pair_max), pair_max, reduce="amax")
            scores.append(s)
        sums = torch.zeros((rows, kv_heads, gt), device=q.device)
        out = torch.zeros((rows, kv_heads, gt, dim), device=q.device)
        for rng, s in zip(plan.ranges, scores, strict=True):
            n, width = rng.n, rng.width
            if rng.readers is not None:
                readers = int(rng.readers.shape[0])
                m = row_max.index_select(0, rng.readers).transpose(0, 1).view(kv_heads, readers, group, steps, 1)
                e = (s - m).exp_()  # [kv_heads, S, group, T, n * bs]
                sums.index_add_(0, rng.readers, e.sum(dim=-1).transpose(0, 1).reshape(readers, kv_heads, gt))
                vb = values[:, rng.lo : rng.lo + n].view(kv_heads, n * bs, dim)
                o = torch.bmm(e.to(values.dtype).view(kv_heads, readers * gt, n * bs), vb)
                out.index_add_(0, rng.readers, o.view(kv_heads, readers, gt, dim).transpose(0, 1).float())
                continue
            m = row_max.index_select(0, rng.owner).view(n, width, kv_heads, group, steps).permute(2, 0, 1, 3, 4)
            e = (s - m[..., None]).exp_()  # [kv_heads, n, M, group, T, bs]
            pair_sum = e.sum(dim=-1).permute(1, 2, 0, 3, 4).reshape(n * width, kv_heads, gt)
            sums.index_add_(0, rng.owner, pair_sum)
            weights = e.to(values.dtype).view(kv_heads, n, width * gt, bs)
            o = torch.stack([torch.bmm(weights[h], values[h, rng.lo : rng.lo + n]) for h in range(kv_heads)])
            o = o.view(kv_heads, n, width, gt, dim).permute(1, 2, 0, 3, 4).reshape(n * width, kv_heads, gt, dim)
            out.index_add_(0, rng.owner, o.float())
        result = (out / sums[:, :, :, None]).view(rows, kv_heads, group, steps, dim)
        return result.permute(0, 3, 1, 2, 4).reshape(rows, steps, heads * dim).to(q.dtype)

    def _attend_alone(self, plan: AttentionPlan, qr: Any, keys: Any, values: Any, steps: int, group: int) -> Any:
        """One row (a prefill, a lone decode): every block is its own, each run of blocks one matmul per head.

        ``qr`` is [kv_heads, group * T, dim]; a run of consecutive blocks is a [kv_heads, n * bs, dim] view of the
        pool, so a conversation whose blocks lie in one run is scored as a slot cache would score it.
        """
        import torch

        kv_heads, gt, dim = (int(x) for x in qr.shape)
        bs = self.block_size
        scores = []
        for rng in plan.ranges:
            kb = keys[:, rng.lo : rng.lo + rng.n].view(kv_heads, rng.n * bs, dim)
            s = torch.bmm(qr, kb.transpose(1, 2)).float().view(kv_heads, group, steps, rng.n * bs)
            scores.append(s.masked_fill_(rng.flat, -math.inf))
        p = torch.softmax(scores[0] if len(scores) == 1 else torch.cat(scores, dim=-1), dim=-1).to(values.dtype)
        out = None
        at = 0
        for rng in plan.ranges:
            width = rng.n * bs
            vb = values[:, rng.lo : rng.lo + rng.n].view(kv_heads, width, dim)
            o = torch.bmm(p[..., at : at + width].reshape(kv_heads, gt, width), vb).float()
            out = o if out is None else out + o
            at += width
        assert out is not None
        return out.view(kv_heads, group, steps, dim).permute(2, 0, 1, 3).reshape(1, steps, kv_heads * group * dim)

    def commit(self, plan: AttentionPlan) -> None:
        """The forward went through: each table now holds its new positions; full blocks are registered."""
        for r, (table, start) in enumerate(zip(plan.tables, plan.starts, strict=True)):
            del table.ids[start:]
            table.ids.extend(plan.ids[r] if plan.ids is not None else [-1] * plan.steps)
            self._register(table)

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
