"""The wire form of a request: validated, encoded tensors and the protobuf / HTTP objects built from them.

An :class:`InferRequest` holds the encoded tensors and builds the gRPC ``ModelInferRequest`` (or tritonclient's
HTTP ``InferInput`` objects) on first use, so sending it again costs no validation and no encoding. The
builders that validate against a model's config live one layer up (``_model/_build.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Final

import attrs
import numpy as np
import numpy.typing as npt
from tritonclient.grpc import service_pb2

__all__ = ["EncodedInput", "InferRequest", "ShmPlace"]

_INT63 = 2**63


# -- protobuf wire pieces for ModelInferRequest (field numbers from tritonclient's grpc_service.proto) ------------
# Why by hand: the per-call fields of a request are a handful of bytes, while building and serialising a protobuf
# object per call costs more client CPU than the rest of the SDK's request path. The constant part (model, version,
# input metadata, outputs) is serialised once by protobuf itself; the per-call fields and the tensor bytes are
# appended (protobuf concatenation: repeated and map fields accumulate), and a test checks that the result parses
# to the same message ``to_grpc`` builds.
_ID: Final = b"\x1a"  # field 3 (id), length-delimited
_PARAM: Final = b"\x22"  # field 4 (parameters map entry), length-delimited
_RAW: Final = b"\x3a"  # field 7 (raw_input_contents), length-delimited


def _varint(value: int) -> bytes:
    if value < 0x80:
        return _SMALL[value]
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_SMALL: Final = tuple(bytes((i,)) for i in range(0x80))


def _delimited(tag: bytes, payload: bytes) -> bytes:
    return tag + _varint(len(payload)) + payload


def _param(key: str, value: bytes) -> bytes:
    """One ``parameters`` map entry: key (field 1) and an ``InferParameter`` value (field 2)."""
    return _delimited(_PARAM, _delimited(b"\x0a", key.encode()) + _delimited(b"\x12", value))


def _bool_param(key: str, flag: bool) -> bytes:
    return _param(key, b"\x08\x01" if flag else b"\x08\x00")  # bool_param = 1


_START = {flag: _bool_param("sequence_start", flag) for flag in (False, True)}
_END = {flag: _bool_param("sequence_end", flag) for flag in (False, True)}
_EMPTY_FINAL: Final = _bool_param("triton_enable_empty_final_response", True)


@functools.lru_cache(maxsize=64)  # a client sends the same timeout with every request
def _timeout_param(timeout_us: int) -> bytes:
    return _param("timeout", b"\x10" + _varint(timeout_us))  # int64_param = 2


@functools.lru_cache(maxsize=4096)  # a session sends the same id with every step
def _sequence_id_param(sequence_id: int | str) -> bytes:
    if isinstance(sequence_id, str):
        return _param("sequence_id", _delimited(b"\x1a", sequence_id.encode()))  # string_param = 3
    if sequence_id >= _INT63:
        return _param("sequence_id", b"\x28" + _varint(sequence_id))  # uint64_param = 5
    return _param("sequence_id", b"\x10" + _varint(sequence_id))  # int64_param = 2


@attrs.frozen
class ShmPlace:
    """Where one tensor lies in a shared-memory region registered with the server: region name, bytes, offset."""

    region: str
    byte_size: int
    offset: int = 0


def _place_params(params: Any, place: ShmPlace) -> None:
    params["shared_memory_region"].string_param = place.region
    params["shared_memory_byte_size"].int64_param = place.byte_size
    if place.offset:
        params["shared_memory_offset"].int64_param = place.offset


@attrs.frozen(kw_only=True)
class EncodedInput:
    """One validated input: its Triton dtype, full shape (batch dim included) and wire bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes = attrs.field(repr=lambda b: f"<{len(b)} bytes>")
    array: npt.NDArray[Any] = attrs.field(eq=attrs.cmp_using(eq=np.array_equal), repr=False)


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
    # The serialised constant part (model, version, input metadata, outputs); a builder may hand over a cached one.
    header: bytes | None = attrs.field(default=None, repr=False, eq=False)

    def grpc_header(self) -> bytes:
        """The serialised ``ModelInferRequest`` fields that do not change between sends of this request."""
        header = self.header
        if header is None:
            header = service_pb2.ModelInferRequest(
                model_name=self.model,
                model_version=self.version,
                inputs=[
                    service_pb2.ModelInferRequest.InferInputTensor(name=i.name, datatype=i.dtype, shape=i.shape)
                    for i in self.inputs
                ],
                outputs=[service_pb2.ModelInferRequest.InferRequestedOutputTensor(name=o) for o in self.outputs],
            ).SerializeToString()
            object.__setattr__(self, "header", header)
        return header

    def grpc_bytes(
        self,
        *,
        request_id: str = "",
        sequence_id: int | str | None = None,
        sequence_start: bool = False,
        sequence_end: bool = False,
        timeout_us: int | None = None,
        empty_final: bool = False,
    ) -> bytes:
        """The serialised ``ModelInferRequest`` that :meth:`to_grpc` would build, without building it.

        ``empty_final`` asks Triton for a response carrying only the final flag (decoupled models, streams).
        """
        parts = [self.grpc_header()]
        if request_id:
            parts.append(_delimited(_ID, request_id.encode()))
        if sequence_id is not None:
            parts += (_sequence_id_param(sequence_id), _START[sequence_start], _END[sequence_end])
        if timeout_us is not None:
            parts.append(_timeout_param(timeout_us))
        if empty_final:
            parts.append(_EMPTY_FINAL)
        for i in self.inputs:
            data = i.data
            parts += (_RAW, _varint(len(data)), data)
        return b"".join(parts)

    def grpc_shm_bytes(
        self,
        inputs: Sequence[ShmPlace],
        outputs: Sequence[tuple[str, ShmPlace | None]] | None = None,
        *,
        timeout_us: int | None = None,
    ) -> bytes:
        """The serialised ``ModelInferRequest`` whose inputs lie in shared memory: ``inputs[i]`` for input i.

        No tensor bytes travel: every input names its region instead. ``outputs``: the outputs to ask for, each
        with the place to write it (None: sent back in the response as usual); None keeps :attr:`outputs`.
        Built through protobuf per call: it is a few hundred bytes, sent with tensors of megabytes.
        """
        if len(inputs) != len(self.inputs):
            raise ValueError(f"{len(inputs)} shared-memory places for {len(self.inputs)} inputs")
        req = service_pb2.ModelInferRequest(model_name=self.model, model_version=self.version)
        for enc, place in zip(self.inputs, inputs, strict=True):
            tensor = req.inputs.add(name=enc.name, datatype=enc.dtype, shape=enc.shape)
            _place_params(tensor.parameters, place)
        wanted = [(o, None) for o in self.outputs] if outputs is None else outputs
        for name, out_place in wanted:
            out = req.outputs.add(name=name)
            if out_place is not None:
                _place_params(out.parameters, out_place)
        if timeout_us is not None:
            req.parameters["timeout"].int64_param = timeout_us
        payload: bytes = req.SerializeToString()
        return payload

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
