"""Input builders against a spec (pure, Hypothesis): validation, batch handling, the gRPC protobuf, results."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from triton_npu_client import (
    BatchSizeError,
    InferResult,
    InputShapeError,
    MissingInputError,
    ModelSpec,
    TensorSpec,
    UnknownInputError,
    UsageError,
)
from triton_npu_client._model import build_request
from triton_npu_client._wire._dtypes import to_wire

SPEC = ModelSpec(
    name="m",
    inputs=(
        TensorSpec(name="A", dtype="FP32", dims=(-1, 3)),
        TensorSpec(name="B", dtype="BYTES", dims=(2,)),
        TensorSpec(name="C", dtype="INT64", dims=(1,), optional=True),
    ),
    outputs=(TensorSpec(name="Y", dtype="FP32", dims=(-1,)),),
    max_batch_size=4,
)


@given(rows=st.integers(0, 5), batch=st.integers(1, 4))
def test_shapes_matching_dims_are_accepted(rows: int, batch: int) -> None:
    """Any length on a -1 dim is accepted; sample form adds batch 1, batch form keeps the caller's batch."""
    a = np.zeros((rows, 3), np.float32)
    sample = build_request(SPEC, {"A": a, "B": [b"x", "y"]})
    assert [i.shape for i in sample.inputs] == [(1, rows, 3), (1, 2)]
    assert sample.batch_size == 1
    batched = build_request(SPEC, {"A": np.zeros((batch, rows, 3), np.float32), "B": [["a", "b"]] * batch}, batch=True)
    assert [i.shape for i in batched.inputs] == [(batch, rows, 3), (batch, 2)]
    assert batched.batch_size == batch


@given(shape=st.lists(st.integers(1, 4), min_size=0, max_size=3))
def test_shapes_not_matching_are_refused(shape: list[int]) -> None:
    """A shape that does not match [-1,3] is refused with InputShapeError naming A, expected and given."""
    if len(shape) == 2 and shape[1] == 3:
        return
    with pytest.raises(InputShapeError) as info:
        build_request(SPEC, {"A": np.zeros(shape, np.float32), "B": [b"x", b"y"]})
    assert info.value.input_name == "A"
    assert "expected shape [-1,3]" in str(info.value)
    assert f"given [{','.join(map(str, shape))}]" in str(info.value)


def test_errors_name_the_input() -> None:
    """Missing, unknown and batch errors carry input_name and model."""
    with pytest.raises(MissingInputError) as missing:
        build_request(SPEC, {"A": np.zeros((1, 3), np.float32)})
    assert (missing.value.input_name, missing.value.model) == ("B", "m")
    with pytest.raises(UnknownInputError, match=r"'Z'.*inputs: A, B, C"):
        build_request(SPEC, {"Z": 1})
    with pytest.raises(BatchSizeError, match=r"batch size 5 outside \[1, 4\]"):
        build_request(SPEC, {"A": np.zeros((5, 1, 3), np.float32), "B": [["a", "b"]] * 5}, batch=True)


def test_positional_array_is_refused() -> None:
    """A bare array instead of named inputs is a UsageError, not a confusing unpacking error."""
    with pytest.raises(UsageError, match="by name"):
        build_request(SPEC, np.zeros((1, 3), np.float32))  # type: ignore[arg-type]


def test_scalar_fills_a_one_element_input() -> None:
    """A scalar is accepted for a dims [1] input."""
    req = build_request(SPEC, {"A": np.zeros((1, 3), np.float32), "B": [b"x", b"y"], "C": 7})
    assert req.arrays()["C"].tolist() == [[7]]


def test_to_grpc_sets_sequence_and_timeout_parameters() -> None:
    """to_grpc copies the template and sets id, sequence id (int64, uint64 or string), flags and timeout."""
    req = build_request(SPEC, {"A": np.ones((1, 3), np.float32), "B": [b"x", b"y"]}, outputs=["Y"])
    plain = req.to_grpc()
    assert plain is req.to_grpc()  # the cached template, no copy
    assert [i.name for i in plain.inputs] == ["A", "B"]
    assert [o.name for o in plain.outputs] == ["Y"]
    assert plain.raw_input_contents[0] == np.ones((1, 1, 3), np.float32).tobytes()
    step = req.to_grpc(request_id="r1", sequence_id=42, sequence_start=True, timeout_us=5000)
    assert step.id == "r1"
    assert step.parameters["sequence_id"].int64_param == 42
    assert step.parameters["sequence_start"].bool_param is True
    assert step.parameters["sequence_end"].bool_param is False
    assert step.parameters["timeout"].int64_param == 5000
    assert "sequence_id" not in plain.parameters  # the template is untouched
    assert req.to_grpc(sequence_id=2**63 + 1).parameters["sequence_id"].uint64_param == 2**63 + 1
    assert req.to_grpc(sequence_id="abc", sequence_end=True).parameters["sequence_id"].string_param == "abc"


def test_result_from_grpc_decodes_bytes_and_bf16() -> None:
    """InferResult.from_grpc decodes BYTES to bytes objects and BF16 to float32, shaped."""
    words = np.array([[b"a\x00", "\u00e9".encode()]], dtype=object)
    halves = np.array([[1.5, -2.0, 0.25]], np.float32)
    response = service_pb2.ModelInferResponse(
        model_name="m",
        model_version="1",
        id="r",
        outputs=[
            service_pb2.ModelInferResponse.InferOutputTensor(name="W", datatype="BYTES", shape=[1, 2]),
            service_pb2.ModelInferResponse.InferOutputTensor(name="H", datatype="BF16", shape=[1, 3]),
        ],
        raw_output_contents=[to_wire(words, "BYTES"), to_wire(halves, "BF16")],
    )
    result = InferResult.from_grpc(response)
    assert result == InferResult(model="m", version="1", request_id="r", outputs={"W": words, "H": halves})
    assert result.as_str("W").tolist() == [["a\x00", "\u00e9"]]
    assert result["H"].dtype == np.float32
