"""The model runner: turns a batch value into sampled token ids on the device, and decides nothing.

The scheduler (``_chat``) owns conversations and turns, the block manager (``_blocks``) owns blocks; the runner
reads the values they hand it (:class:`PrefillRow`, :class:`DecodeBatch`) and returns one token id per row. It
never reserves a block, ends a turn or reads a conversation (``tests/test_layers.py`` keeps it from importing them).

**Device-resident decode state.** Every conversation slot (the scheduler's ``SequenceSlots`` index) has a row of
device tensors: the token to feed next, its position, the block table (padded with the null block), the sampling
parameters and how many tokens the turn has sampled. A turn writes its row once, when its prefill ends
(:meth:`ModelRunner.join`); a decode pass then only names the slots that run (``DecodeBatch.slots``) and the blocks
they grew into, and after the pass the runner advances the rows in place. One host copy per pass: the sampled ids.

**Fixed shapes.** A decode pass pads its rows to a bucket (1, 2, 4, 8, 16, 32, 64, ... rows; padding rows read and
write only the null block) and reads ``width`` blocks per row, so its sequence of device operations depends on the
bucket alone: :meth:`ModelRunner.decode_pass` is what ``torch.compile(fullgraph=True)`` compiles on a CPU (one graph
per bucket, the width symbolic) and what CUDA graphs capture (width fixed at the context's blocks). See docs/chat.md.

torch is imported inside the functions, never at module level.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

from ._attention import Attention, write_index
from ._decoders import Decoder, forward
from ._sampling import GREEDY_BELOW, Penalties, SamplingFlags, logprob_rows, sample

if TYPE_CHECKING:
    import torch

    from ._blocks import BlockManager

__all__ = [
    "BUCKETS", "CPU_COMPILE_OPTIONS", "Compile", "DecodeBatch", "ModelRunner", "PrefillRow", "RowSampling", "bucket",
]

#: Batch sizes a decode pass is padded to (then multiples of the largest).
BUCKETS: Final = (1, 2, 4, 8, 16, 32, 64)
Compile = Literal["off", "cpu", "cuda-graphs"]
#: Inductor's options for the CPU compile. Inductor inlines a pointwise expression into each of its readers until it
#: exceeds ``realize_opcount_threshold`` operations (50 on a CPU), and re-generates an inlined value for every use:
#: the sampler's hash (``_sampling._mix``: each round reads its value twice, four times a round) then costs 16x
#: more code generation per round. At 30 (inductor's default for GPUs) a sampled pass of the GPT-2 demo at 3 rows
#: compiles in 24 s instead of 76 s and runs as fast (2.21 vs 2.30 ms a pass): ``bench/chat_compile.py --rows 3
#: --history 30 --sampled [--inductor-defaults]``, cold inductor cache, 2 cores.
CPU_COMPILE_OPTIONS: Final = (("realize_opcount_threshold", 30),)


def bucket(rows: int) -> int:
    """The padded batch size of a decode pass of ``rows`` rows."""
    for size in BUCKETS:
        if rows <= size:
            return size
    top = BUCKETS[-1]
    return -(-rows // top) * top


@dataclass(frozen=True, slots=True)
class RowSampling:
    """How one turn samples (already checked by the scheduler: finite, in range)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_tokens: int = 0
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logprobs: int = -1  # alternatives wanted with each token's log-probability (0: none; -1: no log-probabilities)

    @property
    def penalized(self) -> bool:
        return self.presence != 0 or self.frequency != 0 or self.repetition != 1

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0


@dataclass(frozen=True, slots=True)
class PrefillRow:
    """Prefill ``ids`` at positions ``start ..`` of a table whose blocks are ``blocks`` (reserved already).

    ``mask``: a constrained turn's token bitmask for its first token (int32 ``[words]``, host memory); None: any id.
    ``context``: with a repetition penalty, the whole prompt's ids (what the penalty counts as seen).
    """

    slot: int
    blocks: tuple[int, ...]
    start: int
    ids: tuple[int, ...]
    sampling: RowSampling
    mask: Any = None
    context: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """One decode pass: the slots that run (their rows joined before), the blocks to read, what sampling needs.

    ``appended``: (slot, index, block) for each block a row grew into since its row was written. ``masks``: with
    ``flags.constrained``, the rows' token bitmasks (int32 ``[len(slots), words]``, host memory, every bit set for an
    unconstrained row).
    """

    slots: tuple[int, ...]
    width: int
    flags: SamplingFlags
    appended: tuple[tuple[int, int, int], ...] = ()
    masks: Any = None


class ModelRunner:
    """One decoder, its block pools and the device-resident decode rows of ``slots`` conversations.

    ``vocab`` is how many leading ids may be sampled (a model's vocabulary may be padded past its tokenizer's, as
    Qwen2's is); ``stop_ids`` are masked below a turn's MIN_TOKENS. ``compile``: "off" (eager), "cpu"
    (``torch.compile`` of the decode pass, one graph per bucket) or "cuda-graphs" (``torch.compile`` with
    ``mode="reduce-overhead"``: the bucket's pass captured once and replayed).
    """

    def __init__(
        self,
        model: Decoder,
        blocks: BlockManager,
        *,
        slots: int,
        max_ctx: int,
        vocab: int,
        stop_ids: Iterable[int] = (),
        compile: Compile = "off",
    ) -> None:
        import torch

        if compile not in ("off", "cpu", "cuda-graphs"):
            raise ValueError(f"compile must be off, cpu or cuda-graphs, got {compile!r}")
        self.model = model
        self.blocks = blocks
        self.max_ctx = max_ctx
        self.vocab = vocab
        self.compile: Compile = compile
        self.max_blocks = blocks.blocks_for(max_ctx)
        model.prepare(max_ctx)
        device = model.device
        self.device = device
        self.dummy = slots  # the padding rows' slot: position 0, every block the null block
        rows = slots + 1

        def zeros(*shape: int, dtype: Any = torch.long) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.tokens = zeros(rows)
        self.positions = zeros(rows)
        self.tables = torch.full((rows, self.max_blocks), blocks.null_block, dtype=torch.long, device=device)
        self.temperature = zeros(rows, dtype=torch.float32)
        self.top_k = zeros(rows)
        self.top_p = torch.ones(rows, dtype=torch.float32, device=device)
        self.seeds = zeros(rows)
        self.min_tokens = zeros(rows)
        self.sampled = zeros(rows)
        self.stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
        self._key_positions = torch.arange(self.max_blocks * blocks.block_size, device=device)
        self._rows_cache: tuple[tuple[int, ...], int, torch.Tensor] | None = None
        self._rows_count = rows
        #: After each prefill or decode call with log-probabilities asked: per row, (log-probability of the chosen id,
        #: the top ids and theirs); None when no row asked.
        self.last_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
        # Penalties' state, allocated at the first penalized turn (two [slots, vocab] tables: 1 MiB for 64 slots of
        # the demo's 4,096 ids, 40 MiB for a 128k vocabulary): each slot's counts of the ids in its reply so far and
        # the ids of its prompt, and its three penalties.
        self._counts: torch.Tensor | None = None
        self._seen: torch.Tensor | None = None
        self._presence: torch.Tensor | None = None
        self._frequency: torch.Tensor | None = None
        self._repetition: torch.Tensor | None = None
        self._compiled: dict[tuple[int, SamplingFlags], Any] = {}
        # Counters, for tests and logs.
        self.prefill_forwards = 0
        self.decode_passes = 0

    # -- prefill --------------------------------------------------------------------------------------------

    def prefill(self, rows: Sequence[PrefillRow]) -> list[int]:
        """One forward for ``rows`` (padded to their longest, each row's logits at its own last token); a sampled
        id per row. Raises ``ValueError`` naming the rows whose logits are not finite."""
        with _flush_to_zero():
            return self._prefill(rows)

    def _prefill(self, rows: Sequence[PrefillRow]) -> list[int]:
        import torch

        device = self.device
        steps = max(len(r.ids) for r in rows)
        bs = self.blocks.block_size
        width = max(self.blocks.blocks_for(r.start + steps) for r in rows)
        null = self.blocks.null_block
        tables = torch.tensor(
            [list(r.blocks[:width]) + [null] * (width - len(r.blocks[:width])) for r in rows], device=device
        )
        tokens = torch.tensor([list(r.ids) + [r.ids[-1]] * (steps - len(r.ids)) for r in rows], device=device)
        positions = torch.tensor([r.start for r in rows], device=device)[:, None] + torch.arange(steps, device=device)
        _, kv_heads, _ = self.model.cache_shape
        meta = Attention(
            write=write_index(tables, positions, kv_heads=kv_heads, pool_blocks=null + 1, block_size=bs),
            tables=tables,
            positions=positions,
            key_positions=self._key_positions[: width * bs],
        )
        last = torch.tensor([len(r.ids) - 1 for r in rows], device=device)
        logits = forward(self.model, self.blocks.keys, self.blocks.values, tokens, meta, last=last)
        self.prefill_forwards += 1
        samplings = [r.sampling for r in rows]
        constrained = [r.mask for r in rows if r.mask is not None]
        masks = None
        if constrained:
            words = len(constrained[0])
            masks = torch.tensor(
                [[-1] * words if r.mask is None else r.mask.tolist() for r in rows], dtype=torch.int32, device=device
            )
        penalties = None
        if any(s.penalized for s in samplings):
            seen = torch.zeros((len(rows), self.vocab), dtype=torch.bool, device=device)
            for i, r in enumerate(rows):
                if r.sampling.repetition != 1 and r.context:
                    seen[i, torch.tensor(r.context, device=device)] = True
            penalties = Penalties(
                counts=torch.zeros((len(rows), self.vocab), dtype=torch.int32, device=device),
                seen=seen,
                presence=torch.tensor([s.presence for s in samplings], device=device),
                frequency=torch.tensor([s.frequency for s in samplings], device=device),
                repetition=torch.tensor([s.repetition for s in samplings], device=device),
            )
        flags = SamplingFlags(
            sampled=any(not s.greedy for s in samplings),
            filtered=any(not s.greedy and s.filtered for s in samplings),
            min_tokens=any(s.min_tokens > 0 for s in samplings),
            constrained=masks is not None,
            penalized=penalties is not None,
            logprobs=max(s.logprobs for s in samplings),
        )
        ids = sample(
            logits[:, : self.vocab],
            temperature=torch.tensor([s.temperature for s in samplings], device=device),
            top_k=torch.tensor([s.top_k for s in samplings], device=device),
            top_p=torch.tensor([s.top_p for s in samplings], device=device),
            seeds=torch.tensor([s.seed for s in samplings], device=device),
            positions=torch.tensor([r.start + len(r.ids) for r in rows], device=device),
            below_min=torch.tensor([s.min_tokens > 0 for s in samplings], device=device),
            stop_ids=self.stop_ids,
            flags=flags,
            masks=masks,
            penalties=penalties,
        )
        if flags.logprobs < 0:
            self.last_logprobs = None
            return _checked(ids.tolist())
        return self._split(logprob_rows(logits[:, : self.vocab], ids, flags.logprobs))

    def _split(self, packed: torch.Tensor) -> list[int]:
        """The ids of a pass's packed output (``logprob_rows``), its log-probabilities kept in ``last_logprobs``."""
        host = packed.tolist()  # the pass's one device-to-host copy
        ids = _checked([int(r[0]) for r in host])
        top = (len(host[0]) - 2) // 2 if host else 0
        self.last_logprobs = [(r[1], [(int(i), v) for i, v in zip(r[2 : 2 + top], r[2 + top :], strict=True)])
                              for r in host]  # fmt: skip
        return ids

    def join(self, row: PrefillRow, token: int, blocks: Sequence[int]) -> None:
        """Write slot ``row.slot``'s decode row: ``token`` (sampled by its prefill) goes next, after ``row.ids``."""
        import torch

        slot, s = row.slot, row.sampling
        device = self.device
        self.tokens[slot] = token
        self.positions[slot] = row.start + len(row.ids)
        table = list(blocks[: self.max_blocks])
        self.tables[slot] = torch.tensor(
            table + [self.blocks.null_block] * (self.max_blocks - len(table)), device=device
        )
        self.temperature[slot] = s.temperature
        self.top_k[slot] = s.top_k
        self.top_p[slot] = s.top_p
        self.seeds[slot] = s.seed
        self.min_tokens[slot] = s.min_tokens
        self.sampled[slot] = 1
        if s.penalized or self._counts is not None:
            counts, seen, presence, frequency, repetition = self._penalty_state()
            counts[slot] = 0
            counts[slot, token] = 1  # the reply's first token, sampled by the prefill
            seen[slot] = False
            if s.repetition != 1 and row.context:
                seen[slot, torch.tensor(row.context, device=device)] = True
            presence[slot] = s.presence
            frequency[slot] = s.frequency
            repetition[slot] = s.repetition

    def _penalty_state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        import torch

        if self._counts is None:
            rows, device = self._rows_count, self.device
            self._counts = torch.zeros((rows, self.vocab), dtype=torch.int32, device=device)
            self._seen = torch.zeros((rows, self.vocab), dtype=torch.bool, device=device)
            self._presence = torch.zeros(rows, dtype=torch.float32, device=device)
            self._frequency = torch.zeros(rows, dtype=torch.float32, device=device)
            self._repetition = torch.ones(rows, dtype=torch.float32, device=device)
        assert self._seen is not None
        assert self._presence is not None
        assert self._frequency is not None
        assert self._repetition is not None
        return self._counts, self._seen, self._presence, self._frequency, self._repetition

    # -- decode ---------------------------------------------------------------------------------------------

    def decode(self, batch: DecodeBatch) -> list[int]:
        """One decode pass over ``batch.slots``; their sampled ids, in order. The rows advance only when every id
        is valid: after a raise, nothing of the decode state changed and the pass may run again on any part of it."""
        import torch

        n = len(batch.slots)
        rows = self._rows(batch.slots)
        if batch.appended:
            where = torch.tensor([(slot, index) for slot, index, _ in batch.appended], device=self.device)
            values = torch.tensor([block for _, _, block in batch.appended], device=self.device)
            self.tables[where[:, 0], where[:, 1]] = values
        width = self.max_blocks if self.compile == "cuda-graphs" else batch.width
        masks = self._masks(batch, int(rows.shape[0])) if batch.flags.constrained else None
        with _flush_to_zero():
            out = self.decode_pass(rows, width, batch.flags, masks)
        if batch.flags.logprobs < 0:
            live = out[:n]
            host = _checked(live.tolist())  # the pass's one device-to-host copy
            self.last_logprobs = None
        else:
            host = self._split(out[:n])
            live = out[:n, 0].to(self.tokens.dtype)
        self._advance(rows[:n], live, counted=batch.flags.penalized)
        self.decode_passes += 1
        return host

    def _masks(self, batch: DecodeBatch, size: int) -> torch.Tensor:
        """The batch's bitmasks on the device, padded to ``size`` rows (a padding row allows every id)."""
        import torch

        host = torch.from_numpy(batch.masks)
        if size > host.shape[0]:
            host = torch.cat([host, torch.full((size - host.shape[0], host.shape[1]), -1, dtype=torch.int32)])
        return host.to(self.device, non_blocking=True)

    def decode_pass(
        self, rows: torch.Tensor, width: int, flags: SamplingFlags, masks: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The fixed-shape pass for padded ``rows``: inputs gathered from the decode rows, one forward, sampling.

        ``masks`` (``[rows, words]`` int32 on the device) with ``flags.constrained``: the rows' token bitmasks."""
        tables = self.tables[rows, :width]
        key_positions = self._key_positions[: width * self.blocks.block_size]
        if self.compile == "off":
            return self._pass(rows, tables, key_positions, flags, masks)
        fn = self._compiled.get((int(rows.shape[0]), flags))
        if fn is None:
            fn = self._compile_pass(flags)
            self._compiled[(int(rows.shape[0]), flags)] = fn
        if self.compile == "cpu":
            import torch

            torch._dynamo.mark_dynamic(tables, 1)
            torch._dynamo.mark_dynamic(key_positions, 0)
        return fn(rows, tables, key_positions, masks)  # type: ignore[no-any-return]

    def _compile_pass(self, flags: SamplingFlags) -> Any:
        import torch

        def run(
            rows: torch.Tensor, tables: torch.Tensor, key_positions: torch.Tensor, masks: torch.Tensor | None
        ) -> torch.Tensor:
            return self._pass(rows, tables, key_positions, flags, masks)

        if self.compile == "cuda-graphs":
            return torch.compile(run, fullgraph=True, mode="reduce-overhead", dynamic=False)
        return torch.compile(run, fullgraph=True, options=dict(CPU_COMPILE_OPTIONS))

    def _pass(
        self,
        rows: torch.Tensor,
        tables: torch.Tensor,
        key_positions: torch.Tensor,
        flags: SamplingFlags,
        masks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        logits, ids = self.pass_outputs(rows, tables, key_positions, flags, masks)
        # With log-probabilities asked the pass returns them packed with the ids (one output, one copy to the host).
        return ids if flags.logprobs < 0 else logprob_rows(logits, ids, flags.logprobs)

    def pass_outputs(
        self,
        rows: torch.Tensor,
        tables: torch.Tensor,
        key_positions: torch.Tensor,
        flags: SamplingFlags,
        masks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode pass's logits and sampled ids (-1 where not finite), for padded ``rows``."""
        logits = self.pass_logits(rows, tables, key_positions)
        penalties = None
        if flags.penalized:
            counts, seen, presence, frequency, repetition = self._penalty_state()
            penalties = Penalties(
                counts=counts[rows], seen=seen[rows], presence=presence[rows], frequency=frequency[rows],
                repetition=repetition[rows],
            )  # fmt: skip
        return logits, sample(
            logits,
            temperature=self.temperature[rows],
            top_k=self.top_k[rows],
            top_p=self.top_p[rows],
            seeds=self.seeds[rows],
            positions=self.positions[rows] + 1,
            below_min=self.sampled[rows] < self.min_tokens[rows],
            stop_ids=self.stop_ids,
            flags=flags,
            masks=masks,
            penalties=penalties,
        )

    def pass_logits(self, rows: torch.Tensor, tables: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """The decode pass's logits ``[rows, vocab]`` (the sampleable ids): its forward, before sampling."""
        _, kv_heads, _ = self.model.cache_shape
        positions = self.positions[rows][:, None]
        meta = Attention(
            write=write_index(
                tables, positions, kv_heads=kv_heads, pool_blocks=self.blocks.null_block + 1,
                block_size=self.blocks.block_size,
            ),
            tables=tables,
            positions=positions,
            key_positions=key_positions,
        )  # fmt: skip
        logits = forward(self.model, self.blocks.keys, self.blocks.values, self.tokens[rows][:, None], meta)
        return logits[:, : self.vocab]

    def _advance(self, live: torch.Tensor, ids: torch.Tensor, *, counted: bool = False) -> None:
        if counted and self._counts is not None:
            import torch

            # A batch with a penalised row counts every row's new token; one without reads no counts, and a row's
            # counts are reset whenever a turn joins it, so only penalised turns ever read what was counted.
            self._counts.index_put_((live, ids), torch.ones_like(ids, dtype=torch.int32), accumulate=True)
        self.tokens.index_copy_(0, live, ids)
        self.positions.index_add_(0, live, self._ones(live))
        self.sampled.index_add_(0, live, self._ones(live))

    def _ones(self, like: torch.Tensor) -> torch.Tensor:
        import torch

        return torch.ones_like(like)

    def _rows(self, slots: tuple[int, ...]) -> torch.Tensor:
        """The padded rows tensor of ``slots`` (kept while the batch stays the same: the usual pass)."""
        import torch

        size = bucket(len(slots))
        cached = self._rows_cache
        if cached is not None and cached[0] == slots and cached[1] == size:
            return cached[2]
        rows = torch.tensor(list(slots) + [self.dummy] * (size - len(slots)), dtype=torch.long, device=self.device)
        self._rows_cache = (slots, size, rows)
        return rows


@contextlib.contextmanager
def _flush_to_zero() -> Iterator[None]:
    """Subnormal floats flushed to zero while a pass runs (a per-thread CPU mode, put back after).

    Without it a matrix product meeting subnormals (the exp of a very negative score, small activations) runs on
    the CPU's slow path: measured here, a 1-row decode pass of the GPT-2 demo took 3.69 ms, and 1.87 ms flushed.
    The values flushed are below 1e-38, far under what changes a logit. Put back after the pass: other code on the
    thread (numpy, hypothesis in the tests) may rely on IEEE subnormals.
    """
    import torch

    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def _checked(ids: list[int]) -> list[int]:
    if ids and min(ids) < 0:
        bad = [row for row, t in enumerate(ids) if t < 0]
        raise ValueError(f"sampling rows {bad} failed: their logits are not finite")
    return ids
