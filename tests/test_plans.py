"""Cached encode plans and the hand-assembled gRPC bytes: the fast paths give exactly what the full paths give."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from triton_npu_client import BatchSizeError, InputDtypeError, InputShapeError, ModelSpec
from triton_npu_client._model import build_request

SPEC = ModelSpec.from_config(
    {
        "name": "m",
        "max_batch_size": 8,
        "input": [
            {"name": "A", "data_type": "TYPE_FP32", "dims": ["4"]},
            {"name": "B", "data_type": "TYPE_INT64", "dims": ["-1"]},
            {"name": "C", "data_type": "TYPE_UINT8", "dims": ["2"], "optional": True},
            {"name": "S", "data_type": "TYPE_STRING", "dims": ["1"], "optional": True},
        ],
        "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": ["4"]}],
    }
)
UNBATCHED = ModelSpec.from_config(
    {
        "name": "u",
        "max_batch_size": 0,
        "input": [{"name": "A", "data_type": "TYPE_FP32", "dims": ["-1"]}],
        "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": ["-1"]}],
    }
)


def _same(a: Any, b: Any) -> None:
    assert a == b
    assert a.grpc_bytes() == b.grpc_bytes()


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 8),
    width=st.integers(1, 5),
    with_c=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_planned_requests_equal_full_ones(n: int, width: int, with_c: bool, seed: int) -> None:
    """Whatever the shapes, a planned request equals the one the full path builds, bytes included."""
    rng = np.random.default_rng(seed)
    plans: dict[Any, Any] = {}
    for batch in (False, True):
        lead = (n,) if batch else ()
        inputs: dict[str, Any] = {
            "A": rng.standard_normal((*lead, 4)).astype(np.float32),
            "B": rng.integers(-5, 5, (*lead, width)).astype(np.int64),
        }
        if with_c:
            inputs["C"] = rng.integers(0, 255, (*lead, 2)).astype(np.uint8)
        first = build_request(SPEC, None, inputs, batch=batch, plans=plans)
        again = build_request(SPEC, None, inputs, batch=batch, plans=plans)
        _same(first, build_request(SPEC, None, inputs, batch=batch))
        _same(again, first)
    assert len(plans) == 2


def test_plans_refuse_what_the_full_path_refuses() -> None:
    """After a signature is planned, a wrong dtype, shape or batch size still raises the same error."""
    plans: dict[Any, Any] = {}
    ok = {"A": np.zeros(4, np.float32), "B": np.zeros(3, np.int64)}
    build_request(SPEC, None, ok, plans=plans)
    with pytest.raises(InputDtypeError):
        build_request(SPEC, None, {**ok, "A": np.zeros(4, np.float64)}, plans=plans)
    with pytest.raises(InputShapeError):
        build_request(SPEC, None, {**ok, "A": np.zeros(5, np.float32)}, plans=plans)
    build_request(
        SPEC, None, {"A": np.zeros((2, 4), np.float32), "B": np.zeros((2, 3), np.int64)}, batch=True, plans=plans
    )
    with pytest.raises(BatchSizeError):
        build_request(
            SPEC, None, {"A": np.zeros((9, 4), np.float32), "B": np.zeros((9, 3), np.int64)}, batch=True, plans=plans
        )
    with pytest.raises(BatchSizeError):
        build_request(
            SPEC, None, {"A": np.zeros((2, 4), np.float32), "B": np.zeros((3, 3), np.int64)}, batch=True, plans=plans
        )


def test_values_needing_a_cast_or_special_encoding_are_not_planned() -> None:
    """Lists, other dtypes and BYTES inputs take the full path every time (no plan is kept for them)."""
    plans: dict[Any, Any] = {}
    build_request(SPEC, None, {"A": [1.0, 2.0, 3.0, 4.0], "B": [1]}, plans=plans)
    build_request(SPEC, None, {"A": np.zeros(4, np.float32), "B": np.zeros(1, np.int64), "S": ["x"]}, plans=plans)
    assert plans == {}
    req = build_request(UNBATCHED, None, {"A": np.ones(3, np.float32)}, plans=plans)
    assert len(plans) == 1
    assert build_request(UNBATCHED, None, {"A": np.ones(7, np.float32)}, plans=plans).inputs[0].shape == (7,)
    assert req.batch_size is None


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"request_id": "42"},
        {"sequence_id": 5, "sequence_start": True},
        {"sequence_id": 2**63 + 7, "sequence_end": True},
        {"sequence_id": 2**62, "sequence_start": True, "sequence_end": True},
        {"sequence_id": "caf\u00e9-id", "sequence_start": False},
        {"timeout_us": 1_500_000},
        {"request_id": "x" * 300, "sequence_id": 1, "timeout_us": 1},
    ],
)
def test_grpc_bytes_parse_to_the_protobuf_to_grpc_builds(fields: dict[str, Any]) -> None:
    """The hand-assembled bytes parse to exactly the ModelInferRequest that protobuf builds."""
    req = build_request(
        SPEC,
        None,
        {"A": np.arange(4, dtype=np.float32), "B": np.arange(200, dtype=np.int64), "S": ["\u00e9"]},
        outputs=["Y"],
    )
    parsed = service_pb2.ModelInferRequest.FromString(req.grpc_bytes(**fields))
    assert parsed == req.to_grpc(**fields)
    with_final = service_pb2.ModelInferRequest.FromString(req.grpc_bytes(empty_final=True, **fields))
    assert with_final.parameters["triton_enable_empty_final_response"].bool_param is True
