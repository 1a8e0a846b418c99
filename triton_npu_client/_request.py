"""Typed input builders: validate and encode once against a :class:`ModelSpec`; decode results.

An :class:`InferRequest` holds the encoded tensors and a prebuilt gRPC ``ModelInferRequest`` template, so
sending it again costs no validation and no encoding. Results come back as :class:`InferResult`, numpy
arrays by output name (BYTES as ``bytes`` objects, BF16 as float32: see ``_dtypes``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
from tritonclient.grpc import service_pb2

from ._dtypes import coerce, from_wire, to_wire
from ._exceptions import (
    BatchSizeError,
    DuplicateInputError,
    InputShapeError,
    MissingInputError,
    UnknownInputError,
    UnknownOutputError,
    UsageError,
)
from ._spec import ModelSpec, TensorSpec

__all__ = ["EncodedInput", "InferRequest", "InferResult", "InputsArg", "build_request"]

# What callers may pass as inputs besides keywords: a mapping, or (name, value) pairs (which may repeat a
# name by mistake: that is refused as a duplicate).
InputsArg = Mapping[str, object] | Iterable[tuple[str, object]] | None

_INT63 = 2**63


@attrs.frozen(kw_only=True)
class EncodedInput:
    """One validated input: its Triton dtype, full shape (batch dim included) and wire bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes = attrs.field(repr=lambda b: f"<{len(b)} bytes>")
    array: npt.NDArray[Any] = attrs.field(eq=attrs.cmp_using(eq=np.array_equal), repr=False)


def _shape_matches(shape: tuple[int, ...], dims: tuple[int, ...]) -> bool:
    return len(shape) == len(dims) and all(d == -1 or d == s for s, d in zip(shape, dims, strict=True))


def _fmt(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


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


def _check_shape(
    arr: npt.NDArray[Any], tensor: TensorSpec, spec: ModelSpec, *, batch: bool
) -> tuple[npt.NDArray[Any], int | None]:
    """Return the array with its batch dim (added in sample form) and the batch size it carries."""
    dims = tensor.dims
    if batch:
        if not spec.batched:
            raise BatchSizeError(
                f"input {tensor.name!r}: model {spec.name!r} has no batch dimension (max_batch_size 0); "
                "use the sample form",
                input_name=tensor.name,
                model=spec.name,
            )
        if arr.ndim != len(dims) + 1:
            raise BatchSizeError(
                f"input {tensor.name!r}: batch form expects shape [batch]+{_fmt(dims)}, given {_fmt(arr.shape)}",
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
        if not _shape_matches(arr.shape[1:], dims):
            raise InputShapeError(
                f"input {tensor.name!r}: expected shape [batch]+{_fmt(dims)}, given {_fmt(arr.shape)}",
                input_name=tensor.name,
                model=spec.name,
            )
        return arr, size
    if arr.ndim == 0 and len(dims) == 1 and dims[0] in (1, -1):
        arr = arr.reshape(1)  # a scalar for a one-element (or any-length) vector input
    if not _shape_matches(arr.shape, dims):
        raise InputShapeError(
            f"input {tensor.name!r}: expected shape {_fmt(dims)}, given {_fmt(arr.shape)}",
            input_name=tensor.name,
            model=spec.name,
        )
    if spec.batched:
        return arr[np.newaxis, ...], 1
    return arr, None


def build_request(
    spec: ModelSpec,
    inputs: InputsArg = None,
    named: Mapping[str, object] | None = None,
    *,
    batch: bool = False,
    outputs: Sequence[str] | None = None,
    allow_lossy: bool = False,
) -> InferRequest:
    """Validate ``inputs`` (a mapping or pairs) and ``named`` against ``spec`` and encode them once.

    Sample form (``batch=False``): values have the model's dims; a batched model gets a batch dim of 1.
    Batch form: values carry a leading batch dim, the same for every input, at most ``max_batch_size``.
    Raises an :class:`InputError` subclass naming the input and the expected and given dtype/shape.
    """
    given = _merge_inputs(inputs, named or {}, spec.name)
    for name in given:
        if spec.input(name) is None:
            known = ", ".join(t.name for t in spec.inputs)
            raise UnknownInputError(
                f"model {spec.name!r} has no input {name!r} (inputs: {known})", input_name=name, model=spec.name
            )
    encoded: list[EncodedInput] = []
    batch_sizes: dict[str, int] = {}
    for tensor in spec.inputs:
        if tensor.name not in given:
            if not tensor.optional:
                raise MissingInputError(
                    f"model {spec.name!r}: missing input {tensor.name!r} ({tensor.dtype}{_fmt(tensor.dims)})",
                    input_name=tensor.name,
                    model=spec.name,
                )
            continue
        arr = coerce(given[tensor.name], tensor.dtype, allow_lossy=allow_lossy, name=tensor.name, model=spec.name)
        arr, size = _check_shape(arr, tensor, spec, batch=batch)
        if size is not None:
            batch_sizes[tensor.name] = size
        encoded.append(
            EncodedInput(
                name=tensor.name, dtype=tensor.dtype, shape=tuple(arr.shape), data=to_wire(arr, tensor.dtype), array=arr
            )
        )
    if len(set(batch_sizes.values())) > 1:
        sizes = ", ".join(f"{n}={s}" for n, s in batch_sizes.items())
        raise BatchSizeError(
            f"model {spec.name!r}: inputs disagree on the batch size ({sizes})",
            input_name=next(iter(batch_sizes)),
            model=spec.name,
        )
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
        batch_size=next(iter(batch_sizes.values()), None),
    )


@attrs.frozen(kw_only=True)
class InferRequest:
    """A validated, encoded request for one model; reusable and cheap to send again.

    Build it with ``model.request(...)`` (or :func:`build_request`). ``outputs`` empty means "all outputs".
    """

    model: str
    version: str = ""
    inputs: tuple[EncodedInput, ...] = ()
    outputs: tuple[str, ...] = ()
    batch_size: int | None = None
    # Built on first use. A request sent once (``model.infer``) never builds a template: its one protobuf is
    # built with the per-call fields in place. A request sent again gets a template, copied per send.
    _template: service_pb2.ModelInferRequest | None = attrs.field(init=False, repr=False, eq=False, default=None)
    _sent: bool = attrs.field(init=False, repr=False, eq=False, default=False)
    _http_inputs: list[Any] | None = attrs.field(init=False, repr=False, eq=False, default=None)

    def _build(self) -> service_pb2.ModelInferRequest:
        return service_pb2.ModelInferRequest(
            model_name=self.model,
            model_version=self.version,
            inputs=[
                service_pb2.ModelInferRequest.InferInputTensor(name=i.name, datatype=i.dtype, shape=i.shape)
                for i in self.inputs
            ],
            outputs=[service_pb2.ModelInferRequest.InferRequestedOutputTensor(name=o) for o in self.outputs],
            raw_input_contents=[i.data for i in self.inputs],
        )

    def _cached_template(self) -> service_pb2.ModelInferRequest:
        if self._template is None:
            object.__setattr__(self, "_template", self._build())
        assert self._template is not None
        return self._template

    def arrays(self) -> dict[str, npt.NDArray[Any]]:
        """The validated arrays by input name (batch dim included), as they will be sent."""
        return {i.name: i.array for i in self.inputs}

    def to_grpc(
        self,
        *,
        request_id: str = "",
        sequence_id: int | str | None = None,
        sequence_start: bool = False,
        sequence_end: bool = False,
        timeout_us: int | None = None,
    ) -> service_pb2.ModelInferRequest:
        """The gRPC ``ModelInferRequest`` with these per-call fields set.

        With no per-call field the cached template itself is returned: treat it as read-only.
        Integer sequence ids travel as ``int64_param`` (``uint64_param`` from 2**63), string ids as
        ``string_param``; START/END are sent only with an id, as Triton expects.
        """
        if not request_id and sequence_id is None and timeout_us is None:
            return self._cached_template()
        if not self._sent and self._template is None:
            object.__setattr__(self, "_sent", True)
            req = self._build()
        else:
            req = service_pb2.ModelInferRequest()
            req.CopyFrom(self._cached_template())
        if request_id:
            req.id = request_id
        if sequence_id is not None:
            param = req.parameters["sequence_id"]
            if isinstance(sequence_id, str):
                param.string_param = sequence_id
            elif sequence_id >= _INT63:
                param.uint64_param = sequence_id
            else:
                param.int64_param = sequence_id
            req.parameters["sequence_start"].bool_param = sequence_start
            req.parameters["sequence_end"].bool_param = sequence_end
        if timeout_us is not None:
            req.parameters["timeout"].int64_param = timeout_us
        return req

    def http_inputs(self) -> list[Any]:
        """``tritonclient.http.InferInput`` objects with binary data (built on first use, then reused)."""
        if self._http_inputs is None:
            import tritonclient.http as httpclient

            built = []
            for enc in self.inputs:
                inp = httpclient.InferInput(enc.name, list(enc.shape), enc.dtype)
                arr = enc.array
                if enc.dtype == "BF16":
                    import ml_dtypes

                    # tritonclient takes BF16 as ml_dtypes.bfloat16; reuse our rounded wire bytes.
                    arr = np.frombuffer(enc.data, dtype=ml_dtypes.bfloat16).reshape(enc.shape)
                inp.set_data_from_numpy(arr, binary_data=True)
                built.append(inp)
            object.__setattr__(self, "_http_inputs", built)
            return built
        return self._http_inputs

    def http_outputs(self) -> list[Any] | None:
        """``tritonclient.http.InferRequestedOutput`` objects (binary), or None for all outputs."""
        if not self.outputs:
            return None
        import tritonclient.http as httpclient

        return [httpclient.InferRequestedOutput(o, binary_data=True) for o in self.outputs]


class _GrpcOutputs(Mapping[str, npt.NDArray[Any]]):
    """The outputs of a gRPC response, decoded one by one on first access, then kept.

    Why lazy: on the 2-core machines this SDK targets every microsecond of client CPU is taken from the server;
    decoding all outputs eagerly cost ~35 us per 4-output response, often for outputs nobody reads.
    """

    __slots__ = ("_decoded", "_index", "_response")

    def __init__(self, response: service_pb2.ModelInferResponse) -> None:
        self._response = response
        self._index: dict[str, int] | None = None
        self._decoded: dict[str, npt.NDArray[Any]] = {}

    def _positions(self) -> dict[str, int]:
        if self._index is None:
            self._index = {out.name: i for i, out in enumerate(self._response.outputs)}
        return self._index

    def __getitem__(self, name: str) -> npt.NDArray[Any]:
        arr = self._decoded.get(name)
        if arr is None:
            i = self._positions()[name]  # KeyError for an unknown name, as a dict would
            out = self._response.outputs[i]
            arr = from_wire(self._response.raw_output_contents[i], out.datatype, tuple(out.shape))
            self._decoded[name] = arr
        return arr

    def __iter__(self) -> Iterator[str]:
        return iter(self._positions())

    def __len__(self) -> int:
        return len(self._response.outputs)

    def __repr__(self) -> str:
        return "{" + ", ".join(f"{name!r}: {self[name]!r}" for name in self) + "}"


def _outputs_eq(a: Mapping[str, npt.NDArray[Any]], b: Mapping[str, npt.NDArray[Any]]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@attrs.frozen(kw_only=True)
class InferResult:
    """The outputs of one inference: numpy arrays by name. BYTES outputs hold ``bytes``; see :meth:`as_str`."""

    model: str
    version: str = ""
    request_id: str = ""
    outputs: Mapping[str, npt.NDArray[Any]] = attrs.field(
        factory=dict,
        eq=attrs.cmp_using(eq=_outputs_eq, require_same_type=False),
        repr=lambda o: "{" + ", ".join(o) + "}",
    )

    def __getitem__(self, name: str) -> npt.NDArray[Any]:
        return self.outputs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.outputs)

    def as_numpy(self, name: str) -> npt.NDArray[Any]:
        """The output called ``name``."""
        return self.outputs[name]

    def as_str(self, name: str, *, encoding: str = "utf-8", errors: str = "strict") -> npt.NDArray[np.object_]:
        """A BYTES output decoded to an object array of ``str`` (object, because numpy's ``str`` dtype would
        drop trailing NUL characters)."""
        arr = self.outputs[name]
        out = np.empty(arr.shape, dtype=object)
        flat = out.reshape(-1)
        for i, b in enumerate(arr.reshape(-1).tolist()):
            flat[i] = b.decode(encoding, errors) if isinstance(b, bytes) else str(b)
        return out

    @classmethod
    def from_grpc(cls, response: service_pb2.ModelInferResponse) -> InferResult:
        """Wrap a gRPC ``ModelInferResponse`` (raw output contents); each output is decoded on first access."""
        return cls(
            model=response.model_name,
            version=response.model_version,
            request_id=response.id,
            outputs=_GrpcOutputs(response),
        )

    @classmethod
    def from_http(cls, result: Any) -> InferResult:
        """Decode a ``tritonclient.http.InferResult`` (binary outputs)."""
        response = result.get_response()
        outputs: dict[str, npt.NDArray[Any]] = {}
        for out in response.get("outputs", ()):
            arr = result.as_numpy(out["name"])
            if out["datatype"] == "BF16":
                arr = np.asarray(arr).astype(np.float32)
            outputs[out["name"]] = arr
        return cls(
            model=str(response.get("model_name", "")),
            version=str(response.get("model_version", "")),
            request_id=str(response.get("id", "")),
            outputs=outputs,
        )
