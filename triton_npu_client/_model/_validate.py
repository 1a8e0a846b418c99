"""The one validator: the rules an input must meet, for one sample (a row) and for a batch, written once.

Every path that sends inputs goes through here: ``model.infer`` (sample form), ``model.infer_batch`` (batch form)
and scoring jobs (a row at a time, or a whole chunk of rows as a batch). So a row refused by ``score()`` is refused
the same way, with the same typed error, by ``infer``, and a batch that ``infer_batch`` accepts is a batch that
``score()`` sends.

The rules:

- **Names.** Every input the model requires is given; an optional one may be left out; a name the model does not
  have is refused (:class:`UnknownInputError`). A bare value (not a mapping) stands for the only input of a
  one-input model.
- **Dtypes.** A value is converted to the input's dtype only when nothing is lost (see ``_wire.coerce``), unless
  ``allow_lossy``.
- **Shapes.** A sample has the input's dims (``-1``: any length). A scalar stands for a one-element vector when
  the dims are ``[1]`` or ``[-1]`` (the usual ``TEXT dims [1]``), in a row and, as a column of scalars, in a batch.
- **The batch dimension.** A batch carries it first, the same on every input, from 1 to ``max_batch_size``; a
  model without one (``max_batch_size 0``) takes no batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import BatchSizeError, InputShapeError, MissingInputError, UnknownInputError, UsageError
from .._wire import coerce
from ._spec import ModelSpec, TensorSpec

__all__ = ["Arrays", "fmt_shape", "shape_matches", "validate_batch", "validate_row"]

Arrays = dict[str, npt.NDArray[Any]]


def shape_matches(shape: tuple[int, ...], dims: tuple[int, ...]) -> bool:
    """``shape`` fits the config's ``dims`` (``-1`` matches any length)."""
    if len(shape) != len(dims):
        return False
    for s, d in zip(shape, dims, strict=True):  # noqa: SIM110 - a plain loop is cheaper than all() per call
        if d != s and d != -1:
            return False
    return True


def fmt_shape(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _scalar_stands_for_vector(dims: tuple[int, ...]) -> bool:
    return len(dims) == 1 and dims[0] in (1, -1)


def _keyed(spec: ModelSpec, given: object) -> Mapping[str, object]:
    """A row as a mapping by input name, with unknown names refused."""
    if not isinstance(given, Mapping):
        if len(spec.inputs) != 1:
            raise UsageError(
                f"model {spec.name!r} has {len(spec.inputs)} inputs ({', '.join(t.name for t in spec.inputs)}): "
                f"give the inputs as a mapping from input name to value, not a {type(given).__name__}",
                model=spec.name,
            )
        return {spec.inputs[0].name: given}
    for name in given:
        if spec.input(name) is None:
            known = ", ".join(t.name for t in spec.inputs)
            raise UnknownInputError(
                f"model {spec.name!r} has no input {name!r} (inputs: {known})", input_name=name, model=spec.name
            )
    return given


def _present(spec: ModelSpec, given: Mapping[str, object]) -> list[TensorSpec]:
    """The model's inputs that ``given`` has, in the model's order; a required one missing is refused."""
    present = []
    for tensor in spec.inputs:
        if tensor.name in given:
            present.append(tensor)
        elif not tensor.optional:
            have = ", ".join(map(repr, given)) or "none"
            raise MissingInputError(
                f"model {spec.name!r}: missing input {tensor.name!r} ({tensor.dtype}{fmt_shape(tensor.dims)}); "
                f"given: {have}",
                input_name=tensor.name,
                model=spec.name,
            )
    return present


def validate_row(spec: ModelSpec, row: object, *, allow_lossy: bool = False, literal: bool = False) -> Arrays:
    """One sample's inputs, checked and converted: an array per given input, without a batch dim.

    ``row``: a mapping from input name to value, or a bare value for a one-input model. Raises a typed
    :class:`InputError` (or :class:`UsageError`) naming the input, what the model expects and what was given.
    ``literal``: the values were read from a file that writes numbers as text or as its own column types (JSONL,
    CSV, Parquet): they convert as Python numbers do (a float rounds into FP32), not as a caller's typed array.
    """
    given = _keyed(spec, row)
    arrays: Arrays = {}
    for tensor in _present(spec, given):
        arr = coerce(given[tensor.name], tensor.dtype, allow_lossy=allow_lossy, literal=literal, name=tensor.name,
                     model=spec.name)
        dims = tensor.dims
        if arr.ndim == 0 and _scalar_stands_for_vector(dims):
            arr = arr.reshape(1)
        if not shape_matches(arr.shape, dims):
            raise InputShapeError(
                f"input {tensor.name!r}: expected shape {fmt_shape(dims)}, given {fmt_shape(arr.shape)}",
                input_name=tensor.name,
                model=spec.name,
            )
        arrays[tensor.name] = arr
    return arrays


def validate_batch(
    spec: ModelSpec,
    batch: Mapping[str, object],
    *,
    allow_lossy: bool = False,
    rows: bool = False,
    literal: bool = False,
) -> Arrays:
    """A batch's inputs, checked and converted: an array per given input, the batch dim first.

    ``batch``: a mapping from input name to the stacked samples (an array, or anything numpy can stack, such as
    a list of rows' values). Every input carries the same batch size, from 1 to the model's ``max_batch_size``.
    ``rows``: each column holds rows' values as :func:`validate_row` takes them, so a column of scalars is a
    scalar per row for a ``[1]`` or ``[-1]`` input (a scoring job's columns). Without it a batch is read as
    stacked samples only: an array of shape ``[n]`` for a ``[-1]`` input is one sample missing its batch dim,
    not ``n`` samples, and is refused rather than guessed. ``literal``: as for :func:`validate_row`.
    Raises as :func:`validate_row` does, and :class:`BatchSizeError` for the batch dim.
    """
    given = _keyed(spec, batch)
    arrays: Arrays = {}
    sizes: dict[str, int] = {}
    for tensor in _present(spec, given):
        if not spec.batched:
            raise BatchSizeError(
                f"input {tensor.name!r}: model {spec.name!r} has no batch dimension (max_batch_size 0); "
                "use the sample form",
                input_name=tensor.name,
                model=spec.name,
            )
        arr = coerce(given[tensor.name], tensor.dtype, allow_lossy=allow_lossy, literal=literal, name=tensor.name,
                     model=spec.name)
        dims = tensor.dims
        if rows and arr.ndim == 1 and _scalar_stands_for_vector(dims):
            arr = arr.reshape(-1, 1)  # a column of scalars: the row rule, row by row
        if arr.ndim != len(dims) + 1:
            raise BatchSizeError(
                f"input {tensor.name!r}: batch form expects shape [batch]+{fmt_shape(dims)}, "
                f"given {fmt_shape(arr.shape)}",
                input_name=tensor.name,
                model=spec.name,
            )
        size = arr.shape[0]
        if not 1 <= size <= spec.max_batch_size:
            raise BatchSizeError(
                f"input {tensor.name!r}: batch size {size} outside [1, {spec.max_batch_size}] "
                f"(model {spec.name!r} max_batch_size={spec.max_batch_size})",
                input_name=tensor.name,
                model=spec.name,
            )
        if not shape_matches(arr.shape[1:], dims):
            raise InputShapeError(
                f"input {tensor.name!r}: expected shape [batch]+{fmt_shape(dims)}, given {fmt_shape(arr.shape)}",
                input_name=tensor.name,
                model=spec.name,
            )
        sizes[tensor.name] = size
        arrays[tensor.name] = arr
    if len(set(sizes.values())) > 1:
        told = ", ".join(f"{n}={s}" for n, s in sizes.items())
        raise BatchSizeError(
            f"model {spec.name!r}: inputs disagree on the batch size ({told})",
            input_name=next(iter(sizes)),
            model=spec.name,
        )
    return arrays


def add_batch_dim(spec: ModelSpec, arrays: Arrays) -> Arrays:
    """A validated sample as a batch of one, for a model with a batch dim (unchanged otherwise)."""
    if not spec.batched:
        return arrays
    return {name: arr[np.newaxis, ...] for name, arr in arrays.items()}
