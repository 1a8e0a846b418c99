"""Typed input builders: validate inputs against a :class:`ModelSpec` and encode them once."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .._errors import DuplicateInputError, UnknownOutputError, UsageError
from .._wire import EncodedInput, InferRequest, numpy_dtype, to_wire
from ._spec import ModelSpec
from ._validate import add_batch_dim, shape_matches, validate_batch, validate_row

__all__ = ["InputsArg", "Plans", "build_request", "checked_request"]

# What callers may pass as inputs besides keywords: a mapping, or (name, value) pairs (which may repeat a
# name by mistake: that is refused as a duplicate).
InputsArg = Mapping[str, object] | Iterable[tuple[str, object]] | None


# One planned input: name, Triton dtype, numpy dtype, dims from the config.
_Entry = tuple[str, str, np.dtype[Any], tuple[int, ...]]


class _Plan:
    """What validation found for one input signature, so the next call with that signature skips it.

    A signature is (batch form or not, the input names in call order, the outputs asked for). A plan exists only
    for numpy arrays that already had the model's dtype (no cast, no special encoding: not BYTES, not BF16), so a
    later call re-checks just that: the exact dtype and the shape against the dims. Anything else takes the full
    path, which raises the same errors as ever.
    """

    __slots__ = ("batch", "batched", "entries", "header", "header_shapes", "max_batch", "model", "outputs", "version")

    def __init__(self, spec: ModelSpec, batch: bool, entries: tuple[_Entry, ...], outputs: tuple[str, ...]) -> None:
        self.model = spec.name
        self.version = spec.version or ""
        self.batched = spec.batched
        self.max_batch = spec.max_batch_size
        self.batch = batch
        self.entries = entries
        self.outputs = outputs
        self.header: bytes | None = None
        self.header_shapes: tuple[tuple[int, ...], ...] = ()


# Plans by signature, for one model spec: a Model handle (and the sessions opened from it) share one.
Plans = dict[tuple[object, ...], _Plan]
_MAX_PLANS = 64


def _planned(plan: _Plan, given: Mapping[str, object]) -> InferRequest | None:
    """The request built by ``plan`` from ``given``, or None when a value does not fit it (take the full path)."""
    encoded = []
    shapes = []
    size: int | None = None
    for name, dtype, npdtype, dims in plan.entries:
        arr = given[name]
        if type(arr) is not np.ndarray or arr.dtype != npdtype:
            return None
        shape = arr.shape
        if plan.batch:
            if not shape or not shape_matches(shape[1:], dims):
                return None
            n = shape[0]
            if not 1 <= n <= plan.max_batch or (size is not None and n != size):
                return None
            size = n
        else:
            if shape != dims and not shape_matches(shape, dims):
                return None
            if plan.batched:
                shape = (1, *shape)
                arr = arr.reshape(shape)
                size = 1
        shapes.append(shape)
        encoded.append(EncodedInput(name=name, dtype=dtype, shape=shape, data=arr.tobytes(), array=arr))
    key = tuple(shapes)
    fresh = plan.header_shapes != key
    request = InferRequest(
        model=plan.model,
        version=plan.version,
        inputs=tuple(encoded),
        outputs=plan.outputs,
        batch_size=size,
        header=None if fresh else plan.header,
    )
    if fresh:
        plan.header, plan.header_shapes = request.grpc_header(), key
    return request


def _plan_for(request: InferRequest, given: Mapping[str, object], spec: ModelSpec, batch: bool) -> _Plan | None:
    entries: list[_Entry] = []
    for enc in request.inputs:
        value = given[enc.name]
        tensor = spec.input(enc.name)
        if tensor is None or type(value) is not np.ndarray or enc.dtype in ("BYTES", "BF16"):
            return None
        if value.dtype != numpy_dtype(enc.dtype):
            return None
        entries.append((enc.name, enc.dtype, value.dtype, tensor.dims))
    # Inputs in the request's (spec) order: the plan must produce the same request as the full path.
    return _Plan(spec, batch, tuple(entries), request.outputs)


def _merge_inputs(inputs: InputsArg, named: Mapping[str, object], model: str) -> dict[str, object]:
    merged: dict[str, object] = {}
    pairs: Iterable[tuple[str, object]]
    if inputs is None:
        pairs = ()
    elif isinstance(inputs, Mapping):
        pairs = inputs.items()
    else:
        pairs = list(inputs)
        if not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in pairs):
            raise UsageError(
                f"model {model!r}: pass inputs by name (keywords, a mapping or (name, value) pairs), "
                f"not a bare {type(inputs).__name__}",
                model=model,
            )
    for name, value in (*pairs, *named.items()):
        if name in merged:
            raise DuplicateInputError(f"input {name!r} given more than once", input_name=name, model=model)
        merged[name] = value
    return merged


def build_request(
    spec: ModelSpec,
    inputs: InputsArg = None,
    named: Mapping[str, object] | None = None,
    *,
    batch: bool = False,
    outputs: Sequence[str] | None = None,
    allow_lossy: bool = False,
    plans: Plans | None = None,
) -> InferRequest:
    """Validate ``inputs`` (a mapping or pairs) and ``named`` against ``spec`` and encode them once.

    Sample form (``batch=False``): values have the model's dims; a batched model gets a batch dim of 1.
    Batch form: values carry a leading batch dim, the same for every input, at most ``max_batch_size``.
    Raises an :class:`InputError` subclass naming the input and the expected and given dtype/shape.
    ``plans``: a cache of validated signatures for this spec (see :class:`_Plan`); the result is the same.
    """
    key: tuple[object, ...] | None = None
    simple: Mapping[str, object] | None = None
    if plans is not None:
        # Keywords only, or one plain dict: the two forms a signature can be read from without merging.
        if inputs is None:
            simple = named or {}
        elif type(inputs) is dict and not named:
            simple = inputs
        if simple is not None:
            key = (batch, tuple(simple), None if outputs is None else tuple(outputs))
            plan = plans.get(key)
            if plan is not None:
                planned = _planned(plan, simple)
                if planned is not None:
                    return planned
    request = _build_full(spec, inputs, named, batch=batch, outputs=outputs, allow_lossy=allow_lossy)
    if key is not None and simple is not None and plans is not None and len(plans) < _MAX_PLANS:
        made = _plan_for(request, simple, spec, batch)
        if made is not None:
            plans[key] = made
    return request


def checked_request(
    spec: ModelSpec,
    arrays: Mapping[str, np.ndarray[Any, Any]],
    *,
    outputs: tuple[str, ...] = (),
    headers: dict[tuple[object, ...], bytes] | None = None,
) -> InferRequest:
    """A request in batch form from ``arrays`` that :func:`validate_batch` (or stacked :func:`validate_row`) already
    checked against ``spec``, and ``outputs`` the caller checked: encoded, never checked again.

    ``headers``: a cache of the request's constant part by (outputs, shapes), kept by a caller that sends many
    requests of few shapes (a scoring job), so that each one costs its tensor bytes and nothing else.
    """
    encoded = []
    for tensor in spec.inputs:  # in the model's order, as _build_full
        arr = arrays.get(tensor.name)
        if arr is not None:
            encoded.append(EncodedInput(name=tensor.name, dtype=tensor.dtype, shape=arr.shape,
                                        data=to_wire(arr, tensor.dtype), array=arr))  # fmt: skip
    size = encoded[0].shape[0] if encoded else None
    key = (outputs, *(enc.shape for enc in encoded))
    header = headers.get(key) if headers is not None else None
    request = InferRequest(model=spec.name, version=spec.version or "", inputs=tuple(encoded), outputs=outputs,
                           batch_size=size, header=header)  # fmt: skip
    if headers is not None and header is None and len(headers) < _MAX_PLANS:
        headers[key] = request.grpc_header()
    return request


def _build_full(
    spec: ModelSpec,
    inputs: InputsArg,
    named: Mapping[str, object] | None,
    *,
    batch: bool,
    outputs: Sequence[str] | None,
    allow_lossy: bool,
) -> InferRequest:
    given = _merge_inputs(inputs, named or {}, spec.name)
    if batch:
        arrays = validate_batch(spec, given, allow_lossy=allow_lossy)
        size = next(iter(arrays.values())).shape[0] if arrays else None
    else:
        arrays = add_batch_dim(spec, validate_row(spec, given, allow_lossy=allow_lossy))
        size = 1 if spec.batched and arrays else None
    encoded = []
    for tensor in spec.inputs:  # in the model's order, as the plan (_plan_for) reproduces it
        if tensor.name in arrays:
            arr = arrays[tensor.name]
            data = to_wire(arr, tensor.dtype)
            encoded.append(EncodedInput(name=tensor.name, dtype=tensor.dtype, shape=tuple(arr.shape), data=data,
                                        array=arr))
    wanted: tuple[str, ...] = ()
    if outputs is not None:
        for out in outputs:
            if spec.output(out) is None:
                known = ", ".join(t.name for t in spec.outputs)
                raise UnknownOutputError(
                    f"model {spec.name!r} has no output {out!r} (outputs: {known})", model=spec.name
                )
        wanted = tuple(outputs)
    return InferRequest(
        model=spec.name,
        version=spec.version or "",
        inputs=tuple(encoded),
        outputs=wanted,
        batch_size=size,
    )
