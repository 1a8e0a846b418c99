"""Sequence controls of one request: correlation id, START, END, READY.

Read from control input tensors when the config declares them, else from ``request.correlation_id()``
and ``request.flags()`` (a bitmask: START=1, END=2, tested bitwise). The caller passes plain values
(numpy arrays, ints), so this stays testable without Triton.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._config import SequenceBatching

__all__ = ["FLAG_END", "FLAG_START", "SequenceControls", "read_controls"]

FLAG_START = 1
FLAG_END = 2

CorrelationId = int | str


@dataclass(frozen=True, kw_only=True, slots=True)
class SequenceControls:
    """What the sequence batcher says about one request.

    ``ready`` is False only for the direct strategy's padding: a dummy slot (id 0 / "") that must be
    answered without touching any state.
    """

    correlation_id: CorrelationId
    start: bool = False
    end: bool = False
    ready: bool = True


def _scalar(array: NDArray[Any]) -> object:
    flat = np.asarray(array).reshape(-1)
    if flat.size != 1:
        raise ValueError(f"a control tensor must hold one value, got shape {np.asarray(array).shape}")
    return flat[0]


def _truthy(array: NDArray[Any]) -> bool:
    # int32_false_true / fp32_false_true / bool_false_true: "false" is always 0 / 0.0 / False.
    return bool(_scalar(array))


def _corrid(value: object, *, string_ids: bool) -> CorrelationId:
    if isinstance(value, bytes | np.bytes_):
        return bytes(value).decode("utf-8")
    if isinstance(value, str):
        return value
    if string_ids:
        return str(value)
    return int(value)  # type: ignore[call-overload,no-any-return]


def read_controls(
    batching: SequenceBatching,
    *,
    correlation_id: CorrelationId,
    flags: int,
    tensors: Mapping[str, NDArray[Any] | None],
) -> SequenceControls:
    """Controls of one request; ``tensors`` maps control input names to their arrays (None: absent)."""

    def tensor(kind: str) -> NDArray[Any] | None:
        name = batching.control_inputs.get(kind)
        return None if name is None else tensors.get(name)

    start_t, end_t, ready_t, corrid_t = tensor("start"), tensor("end"), tensor("ready"), tensor("corrid")
    start = _truthy(start_t) if start_t is not None else bool(flags & FLAG_START)
    end = _truthy(end_t) if end_t is not None else bool(flags & FLAG_END)
    corrid = _corrid(_scalar(corrid_t), string_ids=batching.string_ids) if corrid_t is not None else correlation_id
    # Without a READY control, only a real request reaches execute; id 0 / "" never is one.
    ready = _truthy(ready_t) if ready_t is not None else corrid not in (0, "")
    return SequenceControls(correlation_id=corrid, start=start, end=end, ready=ready)
