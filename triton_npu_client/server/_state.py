"""Per-sequence state: which slot each live sequence holds, and the state tensors on the device.

Triton tells a model about START and END but never about an idle timeout (the sequence batcher frees
its own slot silently), so :class:`SequenceSlots` also sweeps sequences by age, and may evict the
longest-idle sequence to make room for a new one. It is the one owner of "which sequence holds which
slot": every release (END, sweep, eviction, a restart by START) goes through :meth:`SequenceSlots.release`,
which tells the model through ``on_release``. The clock is injected: tests drive it without sleeping.

Two interchangeable state classes: :class:`RunningMoments` (torch tensors on any device) and
:class:`NumpyMoments` (host numpy arrays, for CPU instances: no torch import at all).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from .._protocol import SEQUENCE_CAPACITY, SEQUENCE_UNKNOWN
from ._controls import CorrelationId, SequenceControls

if TYPE_CHECKING:
    import torch

__all__ = ["BatchPlan", "NumpyMoments", "Refusal", "RunningMoments", "SequenceSlots"]

Clock = Callable[[], float]


@dataclass(frozen=True, kw_only=True, slots=True)
class Refusal:
    """Why one request gets an error response instead of a step.

    ``reason`` is ``"capacity"`` (cap of live sequences reached: try later), ``"unknown"`` (a step for
    a sequence this instance does not hold), ``"duplicate"`` (two steps of one sequence in a batch),
    ``"no_id"`` or ``"bad_input"``; ``message`` is what the client reads. The messages of
    ``"capacity"`` and ``"unknown"`` begin with their stable marker from ``triton_npu_client._protocol``.
    """

    reason: str
    message: str


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchPlan:
    """One execute's requests resolved to state slots.

    ``rows`` are the positions (in the request list) that take a step, ``slots`` their state slots
    (unique: one step per sequence per batch), ``fresh`` whether each starts its sequence. ``closes``
    maps the position of an END-only request (END and no data: no step) to the slot whose state it
    reports before the slot is freed, or None when there is none to report (START and END together).
    ``ending`` lists the sequences :meth:`SequenceSlots.finish` frees. ``errors`` maps a request
    position to the :class:`Refusal` its error response carries; positions in none of these are
    dummies (READY false) answered without touching state.
    """

    rows: tuple[int, ...] = ()
    slots: tuple[int, ...] = ()
    fresh: tuple[bool, ...] = ()
    ending: tuple[CorrelationId, ...] = ()
    closes: dict[int, int | None] = field(default_factory=dict)
    errors: dict[int, Refusal] = field(default_factory=dict)


class SequenceSlots:
    """Maps live correlation ids to slots ``0..capacity-1`` and sweeps the ones idle too long.

    ``idle_timeout_s`` is the model's ``max_sequence_idle_microseconds``; a sequence is swept once it
    has been idle for ``idle_timeout_s + grace_s``. The grace keeps us from freeing a sequence whose
    next step Triton accepted just inside its own timeout but has not yet handed to us.

    ``evict_min_idle_s`` (None: never): at the cap, a START takes the slot of the sequence idle longest,
    if it has been idle at least that long and is not in the same plan (a running step is passed to
    :meth:`plan` too, so a generating sequence is never evicted). Its next step is refused as unknown.

    ``on_release(key, slot)`` runs for every slot freed, whatever freed it, before the slot can be
    given again: the one place a model drops what it keeps per sequence.
    """

    def __init__(
        self,
        *,
        capacity: int,
        idle_timeout_s: float,
        grace_s: float = 0.5,
        clock: Clock = time.monotonic,
        capacity_note: str = "parameter max_sequences",
        evict_min_idle_s: float | None = None,
        on_release: Callable[[CorrelationId, int], None] | None = None,
    ):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if evict_min_idle_s is not None and not evict_min_idle_s >= 0:
            raise ValueError(f"evict_min_idle_s must be >= 0 or None, got {evict_min_idle_s}")
        self.capacity = capacity
        self.idle_timeout_s = idle_timeout_s
        self.grace_s = grace_s
        self.evict_min_idle_s = evict_min_idle_s
        self.on_release = on_release
        self.evicted = 0  # sequences evicted since creation, for logs and tests
        self._clock = clock
        # What sets the cap, for the refusal message (a count parameter, or a memory budget).
        self.capacity_note = capacity_note
        self._slot: dict[CorrelationId, int] = {}
        # Least recently seen first: every touch moves a sequence to the end, so with a monotonic clock
        # the times only grow along the order and the sweep stops at the first sequence not yet idle.
        self._last_seen: OrderedDict[CorrelationId, float] = OrderedDict()
        # Lowest slots first: keeps the live region of the state tensors dense.
        self._free = list(range(capacity - 1, -1, -1))
        # Why recently freed sequences went (swept, evicted), oldest first and bounded: so that a late step
        # of one is told what happened to it, not only that it is unknown.
        self._gone: OrderedDict[CorrelationId, str] = OrderedDict()

    def __repr__(self) -> str:
        return f"SequenceSlots(live={self.live}, capacity={self.capacity}, idle_timeout_s={self.idle_timeout_s})"

    @property
    def live(self) -> int:
        """Sequences holding a slot now."""
        return len(self._slot)

    def __contains__(self, key: CorrelationId) -> bool:
        return key in self._slot

    def slot_of(self, key: CorrelationId) -> int | None:
        return self._slot.get(key)

    def held(self) -> dict[CorrelationId, int]:
        """Every live sequence and its slot (a copy)."""
        return dict(self._slot)

    def touch(self, key: CorrelationId) -> None:
        """Mark ``key`` as seen now (a step of it ended): its idle time counts from here."""
        if key in self._last_seen:
            self._last_seen[key] = self._clock()
            self._last_seen.move_to_end(key)

    def sweep(self, *, keep: Iterable[CorrelationId] = ()) -> list[CorrelationId]:
        """Free every sequence idle longer than the timeout plus grace (except ``keep``); return them."""
        deadline = self._clock() - (self.idle_timeout_s + self.grace_s)
        kept = set(keep)
        stale: list[CorrelationId] = []
        # Work in proportion to the idle sequences (and kept ones among them), not to all live ones.
        for key, seen in self._last_seen.items():
            if seen >= deadline:
                break
            if key not in kept:
                stale.append(key)
        for key in stale:
            self.release(key, why=f"was idle longer than {self.idle_timeout_s:g} s")
        return stale

    def release(self, key: CorrelationId, *, why: str | None = None) -> bool:
        """Free ``key``'s slot (END, swept, evicted, restarted) and tell ``on_release``; False when it held none.

        ``why`` (swept or evicted) is remembered for the refusal of the sequence's next step.
        """
        slot = self._slot.pop(key, None)
        if slot is None:
            return False
        del self._last_seen[key]
        if why is not None:
            self._gone[key] = why
            while len(self._gone) > 4 * self.capacity + 64:
                self._gone.popitem(last=False)
        if self.on_release is not None:
            # Before the slot can be handed out again: the model's per-slot state must be gone by then.
            self.on_release(key, slot)
        self._free.append(slot)
        return True

    def evict_idlest(self, protected: Iterable[CorrelationId] = (), *, why: str) -> bool:
        """Free the sequence idle longest, if it has idled at least ``evict_min_idle_s`` and is not ``protected``.

        For a model whose memory, not its count of sequences, runs out (a paged KV cache): the same rule as an
        eviction at the cap, the longest-idle sequence gives way first. False when none may (or eviction is off).
        """
        if self.evict_min_idle_s is None:
            return False
        now = self._clock()
        kept = set(protected)
        for key, seen in self._last_seen.items():
            if seen > now - self.evict_min_idle_s:
                return False
            if key not in kept:
                self.evicted += 1
                self.release(key, why=f"{why} ({now - seen:.3g} s idle)")
                return True
        return False

    def _evict(self, now: float, protected: set[CorrelationId]) -> bool:
        """Free the slot of the longest-idle sequence idle at least ``evict_min_idle_s`` (not protected)."""
        if self.evict_min_idle_s is None:
            return False
        deadline = now - self.evict_min_idle_s
        for key, seen in self._last_seen.items():
            if seen > deadline:
                return False  # oldest first: nobody after it has idled long enough either
            if key not in protected:
                self.evicted += 1
                self.release(
                    key,
                    why=f"was evicted after {now - seen:.3g} s idle to make room for a new sequence (cap of "
                    f"{self.capacity} live sequences)",
                )
                return True
        return False

    def plan(self, controls: Sequence[SequenceControls], *, has_data: Sequence[bool] | None = None) -> BatchPlan:
        """Sweep, then give each request of one execute its slot: admit STARTs, look up the others.

        ``has_data[i]`` False marks request ``i`` as END-only (it carries END and no data input; the
        caller refuses a request without data and without END before planning): it takes no step and
        no new slot, reports its sequence's state as it stands (see :attr:`BatchPlan.closes`) and frees
        it at :meth:`finish`. None means every request carries data.

        Refusals become per-request error messages (cap full, unknown sequence, a second step of one
        sequence in the same batch); they never stop the other requests.
        """
        now = self._clock()
        protected = {c.correlation_id for c in controls if c.ready}
        self.sweep(keep=protected)
        rows: list[int] = []
        slots: list[int] = []
        fresh: list[bool] = []
        ending: list[CorrelationId] = []
        closes: dict[int, int | None] = {}
        errors: dict[int, Refusal] = {}
        seen: set[CorrelationId] = set()
        for row, ctl in enumerate(controls):
            if not ctl.ready:
                continue
            key = ctl.correlation_id
            if key in (0, ""):
                errors[row] = Refusal(
                    reason="no_id", message="request has no correlation id (0 or empty): this model needs a sequence"
                )
                continue
            if key in seen:
                errors[row] = Refusal(
                    reason="duplicate",
                    message=f"sequence {key!r} has two steps in one batch; steps of a sequence must be sequential",
                )
                continue
            slot = self._slot.get(key)
            if has_data is not None and not has_data[row]:
                if slot is None and not ctl.start:
                    errors[row] = self._unknown(key)
                    continue
                # START and END with no data opens and closes an empty sequence: nothing to report, and
                # a live one of that id is restarted, i.e. dropped.
                seen.add(key)
                closes[row] = None if ctl.start else slot
                if slot is not None:
                    self._last_seen[key] = now
                    self._last_seen.move_to_end(key)
                    ending.append(key)
                continue
            if ctl.start:
                if slot is not None:
                    # A START for a live id restarts it (Triton ended the old one early): released, so the model
                    # drops the old state, then taken again (the same slot: the free list is last in, first out).
                    self.release(key)
                    slot = None
                if slot is None:
                    if not self._free:
                        self._evict(now, protected)
                    if not self._free:
                        errors[row] = Refusal(
                            reason="capacity",
                            message=f"{SEQUENCE_CAPACITY} sequence {key!r} refused: this model instance already "
                            f"holds its cap of {self.capacity} live sequences ({self.capacity_note}); "
                            "retry later or end other sequences",
                        )
                        continue
                    slot = self._free.pop()
                    self._slot[key] = slot
                    self._gone.pop(key, None)
            elif slot is None:
                errors[row] = self._unknown(key)
                continue
            seen.add(key)
            self._last_seen[key] = now
            self._last_seen.move_to_end(key)
            rows.append(row)
            slots.append(slot)
            fresh.append(ctl.start)
            if ctl.end:
                ending.append(key)
        return BatchPlan(
            rows=tuple(rows),
            slots=tuple(slots),
            fresh=tuple(fresh),
            ending=tuple(ending),
            closes=closes,
            errors=errors,
        )

    def _unknown(self, key: CorrelationId) -> Refusal:
        why = self._gone.get(key)
        if why is None:
            evicting = "" if self.evict_min_idle_s is None else ", was evicted to make room for another"
            why = f"never started, ended{evicting}, or was idle longer than {self.idle_timeout_s:g} s"
        return Refusal(
            reason="unknown",
            message=f"{SEQUENCE_UNKNOWN} sequence {key!r} is unknown to this model instance: it {why}; send the "
            "START flag to begin a new one",
        )

    def finish(self, plan: BatchPlan) -> None:
        """Free the slots of the sequences that ended in ``plan`` (after their step is computed)."""
        for key in plan.ending:
            self.release(key)


class RunningMoments:
    """Running count, mean and M2 (Welford) of vectors, one row per slot, on one device.

    Preallocated ``[capacity, dim]`` tensors; :meth:`step` gathers the rows of one batch, updates them
    and scatters them back as a few whole-batch tensor operations, never a per-sequence Python loop.
    Variance is the population variance (``M2 / count``), so a one-step sequence has variance 0.
    """

    def __init__(
        self, *, capacity: int, dim: int, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
    ):
        import torch  # here, not at module level: CPU instances use NumpyMoments and never load torch

        self.capacity = capacity
        self.dim = dim
        self.device = torch.device(device)
        self.dtype = torch.float32 if dtype is None else dtype
        # self.dtype, never the argument: None must mean float32, not whatever torch's default is now.
        self.count = torch.zeros(capacity, dtype=self.dtype, device=self.device)
        self.mean = torch.zeros(capacity, dim, dtype=self.dtype, device=self.device)
        self.m2 = torch.zeros(capacity, dim, dtype=self.dtype, device=self.device)

    def __repr__(self) -> str:
        return f"RunningMoments(capacity={self.capacity}, dim={self.dim}, device={self.device}, dtype={self.dtype})"

    def step(
        self, slots: torch.Tensor, x: torch.Tensor, fresh: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step for every slot in ``slots`` (unique, int64 ``[k]``) with vectors ``x`` ``[k, dim]``.

        ``fresh`` (bool ``[k]``) marks sequences that start here: their old state is ignored.
        Returns the new ``(count [k], mean [k, dim], var [k, dim])`` on the device.
        """
        keep = (~fresh).to(self.dtype)
        count = self.count.index_select(0, slots) * keep + 1
        mean = self.mean.index_select(0, slots) * keep[:, None]
        m2 = self.m2.index_select(0, slots) * keep[:, None]
        x = x.to(device=self.device, dtype=self.dtype)
        delta = x - mean
        mean = mean + delta / count[:, None]
        m2 = m2 + delta * (x - mean)
        self.count.index_copy_(0, slots, count)
        self.mean.index_copy_(0, slots, mean)
        self.m2.index_copy_(0, slots, m2)
        return count, mean, m2 / count[:, None]

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The state of ``slots`` (int64 ``[k]``) as it stands, no step: ``(count, mean, var)`` like :meth:`step`.

        What an END-only request reports; read only slots held now (a freed row keeps its last sequence's
        values). A row with count 0 reads var 0, not a division by zero.
        """
        count = self.count.index_select(0, slots)
        return count, self.mean.index_select(0, slots), self.m2.index_select(0, slots) / count.clamp(min=1)[:, None]


class NumpyMoments:
    """:class:`RunningMoments` on the host in numpy: same state, same step, same float32 arithmetic.

    What a CPU instance uses, so that its stub never imports torch. :meth:`step` takes and returns
    numpy arrays; the operations and their order match :class:`RunningMoments` one for one.
    """

    device = "cpu"

    def __init__(self, *, capacity: int, dim: int, dtype: type[np.floating[Any]] = np.float32):
        self.capacity = capacity
        self.dim = dim
        self.dtype = np.dtype(dtype)
        self.count = np.zeros(capacity, dtype=self.dtype)
        self.mean = np.zeros((capacity, dim), dtype=self.dtype)
        self.m2 = np.zeros((capacity, dim), dtype=self.dtype)

    def __repr__(self) -> str:
        return f"NumpyMoments(capacity={self.capacity}, dim={self.dim}, dtype={self.dtype})"

    def step(
        self, slots: NDArray[np.integer[Any]], x: NDArray[Any], fresh: NDArray[np.bool_]
    ) -> tuple[NDArray[Any], NDArray[Any], NDArray[Any]]:
        """One step for every slot in ``slots`` (unique ints ``[k]``) with vectors ``x`` ``[k, dim]``.

        ``fresh`` (bool ``[k]``) marks sequences that start here: their old state is ignored.
        Returns new arrays ``(count [k], mean [k, dim], var [k, dim])``, never views of the state.
        """
        slots = np.asarray(slots, dtype=np.int64)
        keep = (~np.asarray(fresh, dtype=np.bool_)).astype(self.dtype)
        # Fancy indexing copies: the gathered rows are ours to update before the scatter back.
        count = self.count[slots] * keep + self.dtype.type(1)
        mean = self.mean[slots] * keep[:, None]
        m2 = self.m2[slots] * keep[:, None]
        x = np.asarray(x, dtype=self.dtype)
        delta = x - mean
        mean = mean + delta / count[:, None]
        m2 = m2 + delta * (x - mean)
        self.count[slots] = count
        self.mean[slots] = mean
        self.m2[slots] = m2
        return count, mean, m2 / count[:, None]

    def read(self, slots: NDArray[np.integer[Any]]) -> tuple[NDArray[Any], NDArray[Any], NDArray[Any]]:
        """The state of ``slots`` as it stands, no step: new arrays ``(count, mean, var)`` like :meth:`step`.

        What an END-only request reports; read only slots held now (a freed row keeps its last sequence's
        values). A row with count 0 reads var 0, not a division by zero.
        """
        slots = np.asarray(slots, dtype=np.int64)
        count = self.count[slots]
        return count, self.mean[slots], self.m2[slots] / np.maximum(count, self.dtype.type(1))[:, None]
