"""The wire form of a request: validated, encoded tensors and the protobuf / HTTP objects built from them.

An :class:`InferRequest` holds the encoded tensors and builds the gRPC ``ModelInferRequest`` (or tritonclient's
HTTP ``InferInput`` objects) on first use, so sending it again costs no validation and no encoding. The
builders that validate against a model's config live one layer up (``_model/_build.py``).
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
from tritonclient.grpc import service_pb2

__all__ = ["EncodedInput", "InferRequest"]

_INT63 = 2**63


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
