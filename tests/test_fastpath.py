"""The client's fast-path pieces: lazily decoded gRPC results (pure, no server)."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from triton_npu_client import InferResult
from triton_npu_client._wire._dtypes import to_wire


def _response() -> service_pb2.ModelInferResponse:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([[7]], dtype=np.int64)
    return service_pb2.ModelInferResponse(
        model_name="m",
        outputs=[
            service_pb2.ModelInferResponse.InferOutputTensor(name="A", datatype="FP32", shape=[2, 3]),
            service_pb2.ModelInferResponse.InferOutputTensor(name="B", datatype="INT64", shape=[1, 1]),
        ],
        raw_output_contents=[to_wire(a, "FP32"), to_wire(b, "INT64")],
    )


def test_lazy_outputs_behave_like_a_dict_of_arrays() -> None:
    """A gRPC result's outputs list names in order, decode each on access once, and raise KeyError for others."""
    result = InferResult.from_grpc(_response())
    assert list(result) == ["A", "B"]
    assert len(result.outputs) == 2
    first = result["A"]
    assert first is result.outputs["A"]  # decoded once, then kept
    np.testing.assert_array_equal(first, np.arange(6, dtype=np.float32).reshape(2, 3))
    assert result.as_numpy("B").dtype == np.int64
    assert result["B"].tolist() == [[7]]
    assert "C" not in result.outputs
    with pytest.raises(KeyError):
        result["C"]


def test_lazy_result_equals_an_eager_one() -> None:
    """A lazily decoded result compares equal to one built from plain arrays, and unequal when a value differs."""
    lazy = InferResult.from_grpc(_response())
    eager = InferResult(
        model="m",
        outputs={"A": np.arange(6, dtype=np.float32).reshape(2, 3), "B": np.array([[7]], dtype=np.int64)},
    )
    assert lazy == eager
    assert lazy != InferResult(model="m", outputs={"A": eager["A"], "B": np.array([[8]], dtype=np.int64)})
