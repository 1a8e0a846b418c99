"""Results: numpy arrays by output name, decoded lazily from the wire (BYTES as ``bytes``, BF16 as float32)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
from tritonclient.grpc import service_pb2

from ._dtypes import from_wire

__all__ = ["InferResult"]


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
