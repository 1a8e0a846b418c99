"""Sampling a batch of rows on the device in one pass of tensor operations, reproducible per turn.

Every row has its own temperature, top-k, top-p, minimum reply length and seed, as device tensors; one call samples
every row. Greedy rows (temperature below :data:`GREEDY_BELOW`) take the argmax; the others run an exponential race:
with ``E_j`` drawn from Exp(1), ``argmax_j p_j / E_j`` is a draw from ``p``. That is what ``torch.multinomial`` does
without its device-to-host synchronisation (vLLM-Ascend samples this way for that reason).

The noise is counter-based: ``E_j`` is a hash of (the turn's seed, the position the token will take, ``j``), not a
generator's next numbers. A turn therefore draws the same tokens whatever batch it runs in, whatever ran before, and
after a pass that raised and ran again; a rolled-back turn replayed with its seed gives the same reply. The hash works
on 32-bit values held in int64 tensors, multiplied by constants below 2**31, so no product overflows (no undefined
behaviour in a compiled graph) and every device computes the same bits.

torch is imported inside the functions, never at module level.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import torch

__all__ = [
    "GREEDY_BELOW", "Penalties", "SamplingFlags", "allowed_ids", "exponential_noise", "logprob_rows", "penalize",
    "sample",
]

#: A temperature below this is greedy (vLLM's epsilon): dividing logits by a smaller one overflows them to inf.
GREEDY_BELOW: Final = 1e-5
_MASK32: Final = 0xFFFFFFFF
# Odd multipliers below 2**31: a 32-bit value times one of them stays below 2**63.
_M1: Final = 0x7FEB352D
_M2: Final = 0x4C6CA68B
_M3: Final = 0x2545F491


@dataclass(frozen=True, slots=True)
class SamplingFlags:
    """What a batch needs of the sampler, known on the host when the batch is planned; each a graph variant.

    ``sampled``: some row is not greedy. ``filtered``: some sampled row has top-k or top-p. ``min_tokens``: some row
    may not end yet (its stop ids are masked). ``constrained``: some row has a constraint (a token bitmask per row).
    ``penalized``: some row has a presence, frequency or repetition penalty (its token counts are read).
    ``logprobs``: the most alternatives some row asks for (0: the chosen token's only; -1: no row asks).
    """

    sampled: bool = False
    filtered: bool = False
    min_tokens: bool = False
    constrained: bool = False
    penalized: bool = False
    logprobs: int = -1


def logprob_rows(logits: torch.Tensor, ids: torch.Tensor, top: int) -> torch.Tensor:
    """``[rows, 2 + 2 * top]`` float64: each row's chosen id, its log-probability, then its ``top`` most likely ids
    and theirs, from the log-softmax of ``logits`` (the model's own distribution, before temperature, penalties and
    masks: what vLLM returns by default). One tensor, so that the host reads it in the pass's one copy."""
    import torch

    lp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    chosen = lp.gather(1, ids.clamp_min(0)[:, None])
    parts = [ids[:, None].to(torch.float64), chosen.to(torch.float64)]
    if top > 0:
        values, where = lp.topk(top, dim=-1)
        parts += [where.to(torch.float64), values.to(torch.float64)]
    return torch.cat(parts, dim=1)


@dataclass(frozen=True, slots=True)
class Penalties:
    """The penalties of a batch's rows, all ``[rows]`` but the counts: ``counts`` ``[rows, vocab]`` (how often each id
    is in the reply so far), ``seen`` ``[rows, vocab]`` bool (each id in the prompt), ``presence``, ``frequency``,
    ``repetition`` (1: off)."""

    counts: torch.Tensor
    seen: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor


def penalize(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """The logits with the rows' penalties applied (vLLM's order: repetition, then frequency and presence).

    Repetition (Hugging Face's): a token in the prompt or the reply has its logit divided by ``r`` where positive and
    multiplied by it where not. Frequency and presence (OpenAI's): ``count * frequency + (count > 0) * presence`` is
    subtracted. A row with every penalty off is left as it is (``r`` 1, both 0).
    """
    import torch

    counts = p.counts.to(logits.dtype)
    used = p.counts > 0
    rep = p.repetition[:, None]
    repeated = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(used | p.seen, repeated, logits)
    return logits - counts * p.frequency[:, None] - used.to(logits.dtype) * p.presence[:, None]


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche of ``x`` (int64 holding values in 0..2**32-1)."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK32
    x = x ^ (x >> 16)
    x = (x * _M3) & _MASK32
    return x ^ (x >> 15)


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) draws ``[rows, vocab]`` (float32), a pure function of each row's seed and position and the token id."""
    import torch

    seeds = seeds.to(torch.int64)
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    key = _mix(_mix(lo ^ _mix(hi)) ^ (positions.to(torch.int64) & _MASK32))  # [rows]
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = _mix(_mix(key[:, None] ^ ids[None, :]) ^ (key[:, None] >> 7))
    # 23 bits, centred in their interval: u in (0, 1) exactly, so -log(u) is finite and positive. (With 24 bits the
    # top value, 2**24 - 0.5, is not a float32 and rounded to 2**24: u was 1.0 for one id in 2**24, its noise 0, and
    # that id won every race it was in, whatever its probability, or NaN where it was masked out.)
    u = ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    return -torch.log(u)


def allowed_ids(masks: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[rows, vocab]`` bool from ``masks`` ``[rows, words]`` int32, bit ``i % 32`` of word ``i // 32`` for id ``i``.

    One batched shift-and-mask on the device: the host sends 1 bit per id (4 KiB a row for a 128k vocabulary).
    """
    import torch

    shifts = torch.arange(32, dtype=torch.int32, device=masks.device)
    bits = (masks[:, :, None] >> shifts) & 1
    return bits.reshape(masks.shape[0], -1)[:, :vocab].to(torch.bool)


def sample(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    below_min: torch.Tensor,
    stop_ids: torch.Tensor,
    flags: SamplingFlags,
    masks: torch.Tensor | None = None,
    penalties: Penalties | None = None,
) -> torch.Tensor:
    """One token id per row of ``logits`` ``[rows, vocab]`` (int64, on the device); -1 where its logits are not finite.

    ``temperature``, ``top_k`` (0: off), ``top_p`` (1: off), ``seeds`` and ``positions`` (where the token goes) are
    ``[rows]``; ``below_min`` ``[rows]`` bool masks ``stop_ids`` for rows whose reply may not end yet. ``masks``
    (with ``flags.constrained``): ``[rows, words]`` int32 token bitmasks, every bit set for an unconstrained row; a
    row draws only among the ids its mask allows (-1 when it allows none the other rules leave). ``penalties`` (with
    ``flags.penalized``): applied first, to greedy and sampled rows alike.
    """
    import torch

    # A row whose logits are not a distribution (NaN, or inf) gets -1: the host finds it in the same copy.
    valid = torch.isfinite(logits).all(dim=-1)
    if flags.penalized and penalties is not None:
        logits = penalize(logits, penalties)
    if flags.min_tokens and stop_ids.numel():
        blocked = torch.zeros_like(logits, dtype=torch.bool)
        blocked[:, stop_ids] = True
        logits = logits.masked_fill(blocked & below_min[:, None], float("-inf"))
    if flags.constrained and masks is not None:
        allowed = allowed_ids(masks, int(logits.shape[-1]))
        logits = logits.masked_fill(~allowed, float("-inf"))
        # A row left with nothing to draw from fails alone (its constraint and MIN_TOKENS disagree).
        valid = valid & (logits > float("-inf")).any(dim=-1)
    chosen = logits.argmax(dim=-1)
    if flags.sampled:
        greedy = temperature < GREEDY_BELOW
        scores = logits / temperature.clamp_min(GREEDY_BELOW)[:, None]
        vocab = int(logits.shape[-1])
        if flags.filtered:
            ordered, order = torch.sort(scores, dim=-1, descending=True)
            rank = torch.arange(vocab, device=logits.device)
            k = torch.where(top_k > 0, top_k, vocab)
            probs = torch.softmax(ordered, dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays) and the top k.
            outside = ((probs.cumsum(-1) - probs) >= top_p[:, None]) | (rank[None, :] >= k[:, None])
            noise = exponential_noise(seeds, positions, vocab).gather(1, order)
            race = (probs / noise).masked_fill(outside, -1.0)
            picks = order.gather(1, race.argmax(dim=-1, keepdim=True))[:, 0]
        else:
            probs = torch.softmax(scores, dim=-1)
            picks = (probs / exponential_noise(seeds, positions, vocab)).argmax(dim=-1)
        chosen = torch.where(greedy, chosen, picks)
        valid = valid & (greedy | torch.isfinite(probs).all(dim=-1))
    return torch.where(valid, chosen, torch.full_like(chosen, -1))
